"""The public functions: validate (attn._validation), pick a backend (attn._backends), run it."""

import numpy as np

from . import _backends as backends
from . import _dtypes, _gradients, _quantized
from ._interop import accepts_torch
from ._validation import (
    as_float_array, compute_dtype, decide_shapes_and_options, validate_attention, validate_grad_out,
    validate_mask_grad, validate_masked_softmax,
)

backends.fused.bind_fast_path(decide_shapes_and_options)  # the compiled fast path decides as the validation


@accepts_torch("x")
def softmax(x, axis=-1):
    """Numerically stable softmax over ``axis`` (NumPy; see :func:`attn.masked_softmax`).

    Parameters
    ----------
    x : array_like of float16, bfloat16, float32 or float64
    axis : int, default -1

    Returns
    -------
    ndarray, same shape and dtype as ``x``; slices along ``axis`` sum to 1.
    A slice that is entirely ``-inf`` gives NaN, as ``torch.softmax`` does.
    """
    a = as_float_array(x, "x")
    if a.size == 0:  # empty slices: an empty result (np.max over them would raise)
        return np.zeros(a.shape, a.dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN slices, as torch
        w = backends.matrix.softmax(a.astype(compute_dtype(a.dtype), copy=False), axis=axis)
    return w.astype(a.dtype, copy=False)


@accepts_torch("x", "mask")
def masked_softmax(x, mask=None, axis=-1, *, backend="auto", num_threads=None):
    """Softmax over ``axis`` of the entries that take part; 0 elsewhere.

    Parameters
    ----------
    x : array_like of float16, bfloat16, float32 or float64, shape [...]
    mask : array_like of bool or float, broadcastable to ``x.shape``, or None
        SDPA's convention: bool True = takes part, False = excluded;
        a float mask is added to ``x`` (``-inf`` excludes).
    axis : int
    backend : {"auto", "numpy", "cython"}
        "cython" is the fused one-pass-per-row kernel; "auto" picks it when built.
    num_threads : int, optional
        Threads for the cython backend, 1 to 1024 (default :func:`attn.get_num_threads`).

    Returns
    -------
    ndarray of x's dtype and shape. A slice with nothing taking part is all
    zeros (not NaN); NaN in a slice makes that slice NaN.
    """
    p = validate_masked_softmax(x, mask, axis, backend, num_threads)
    impl = backends.select_softmax(p)
    if p.x.size == 0:  # no slice, or empty slices (a max over them would raise)
        out = np.zeros(p.x.shape, p.x.dtype)
    else:
        out = impl.masked_softmax_forward(p)  # softmax axis last
    return np.moveaxis(out, -1, p.axis).astype(p.out_dtype, copy=False)


@accepts_torch("query", "key", "value", "attn_mask")
def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, backend="auto", return_weights=False, return_lse=False, rng=None,
    num_threads=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
):
    """Scaled dot-product attention with ``torch.nn.functional.scaled_dot_product_attention``'s semantics.

    ``softmax(query @ key^T * scale + mask) @ value``, computed by one of
    four backends that give the same answer.

    Parameters
    ----------
    query : array_like, shape [..., L, E]
    key : array_like, shape [..., S, E]
    value : array_like, shape [..., S, Ev]
        float16, bfloat16 (ml_dtypes), float32 or float64, all the same dtype (16-bit types are computed
        in float32). Leading dims broadcast; any strides.
    attn_mask : array_like of bool or float, broadcastable to [..., L, S], optional
        bool: True = the key takes part (torch SDPA's convention, the opposite
        of ``nn.MultiheadAttention``'s masks); float: added to the scores.
    dropout_p : float in [0, 1)
        Dropout on the weights, drawn from ``rng`` (numpy/loop backends).
    is_causal : bool or {"upper_left", "lower_right"}
        True / "upper_left": row i sees keys 0..i (torch's alignment when
        L != S). "lower_right": row i sees keys 0..S-L+i (decoding with a
        cache). Mutually exclusive with ``attn_mask`` (ValueError).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention: query heads (dim -3) a multiple of key/value
        heads; query head h uses key/value head ``h // (Hq // Hkv)``.
    backend : {"auto", "loop", "numpy", "online", "cython"}
        "loop": a Python loop over query rows; "numpy": the matrix version;
        "online": the fused kernel's algorithm in NumPy (key blocks, running
        max and sum); "cython": the fused kernel (never builds the L x S
        scores unless ``return_weights``); "auto": cython when built and
        able, else numpy. See :mod:`attn._backends`.
    return_weights : bool
        Also return the attention weights.
    return_lse : bool
        Also return the log-sum-exp of each row's scaled, masked scores,
        ``lse = log sum_j exp(scale * q . k_j + mask_j)`` over the visible
        keys, shape [..., L], in the compute dtype (float32 for 16-bit
        inputs); -inf for a row that sees no key. What the backward pass
        needs (:func:`attn.scaled_dot_product_attention_vjp`).
    rng : numpy.random.Generator, optional
        Source of the dropout mask (a fresh default generator if None).
    num_threads : int, optional
        Threads for the cython backend, 1 to 1024 (default :func:`attn.get_num_threads`).
    window : (int, int), optional
        Sliding window ``(left, right)``, FlashAttention's ``window_size``
        (-1 = unbounded on that side): key j takes part in row i only if
        ``i + off - left <= j <= i + off + right``, ``off`` the causal
        alignment's offset (0 upper-left, S - L lower-right) and S - L
        without ``is_causal`` (FlashAttention's convention). Combines with
        ``is_causal`` and ``attn_mask``. The fused kernel visits only the key
        blocks inside the window.
    softcap : float, optional
        Soft-capping (Gemma 2): each scaled score s becomes
        ``softcap * tanh(s / softcap)`` before the mask is added. 0 or None: off.
    alibi_slopes : array_like, shape [H] or [B, H], optional
        ALiBi: adds ``-slope * |i + off - j|`` to the (capped) scores of query
        head h (dim -3; [B, H]: dims -4, -3), computed in the kernel, never
        materialized. Not differentiated.
    sinks : array_like, shape [H], optional
        Attention sinks (gpt-oss, transformers' ``s_aux``): one logit per
        query head joining each row's softmax denominator with no value.
        ``lse`` includes it; :func:`scaled_dot_product_attention_vjp`
        returns its gradient.

    Returns
    -------
    out : ndarray, shape [..., L, Ev], the input dtype
    weights : ndarray, shape [..., L, S] (only with ``return_weights=True``)
    lse : ndarray, shape [..., L] (only with ``return_lse=True``; after the weights)

    Rows whose keys are all masked (or S = 0) give output 0 and weights 0.
    """
    no_variants = window is None and softcap is None and alibi_slopes is None and sinks is None
    if return_lse is False and no_variants:
        out = backends.fused.fast_forward(  # the common case, validated in compiled code
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
            return_weights, num_threads,
        )
        if out is not None:
            return out
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    p = validate_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        backend, return_weights, rng, num_threads, window, softcap, alibi_slopes, sinks,
    )
    sinks_on = p.variants is not None and p.variants.sinks is not None  # they need each row's lse
    impl = backends.select(p, gradients=return_lse or sinks_on)
    p = backends.read_by(p, impl)  # an int8 cache: dequantized once for the NumPy forms
    out_shape, w_shape = p.batch + (p.n_q, p.d_v), p.batch + (p.n_q, p.n_k)
    # Nothing to compute: empty output and no weights (or empty weights), or no
    # keys at all (output 0, like torch). With Ev = 0 the weights are still real.
    nothing_to_compute = 0 in out_shape and (not p.return_weights or 0 in w_shape)
    lse = None
    if (return_lse or sinks_on) and not p.return_weights:
        out, lse = _gradients.forward(p, impl)  # one pass where the backend can
    elif nothing_to_compute or p.n_k == 0:
        out, w = np.zeros(out_shape, p.q.dtype), np.zeros(w_shape, p.q.dtype)
    else:
        out, w = _gradients.forward_weights(p, impl)
    out = _dtypes.cast(out, p.out_dtype)
    extra = (_dtypes.cast(w, p.out_dtype),) if p.return_weights else ()
    if return_lse:
        extra += (_gradients.forward_lse(p, impl) if lse is None else lse,)
    return (out,) + extra if extra else out


def scaled_dot_product_attention_vjp(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, backend="auto", rng=None, num_threads=None, window=None, softcap=None,
    alibi_slopes=None, sinks=None,
):
    """Attention and a function computing its vector-Jacobian product (the backward pass).

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng, num_threads
        As :func:`scaled_dot_product_attention`.
    window, softcap, alibi_slopes, sinks
        The variants, as :func:`scaled_dot_product_attention`.
    backend : {"auto", "loop", "numpy", "online", "cython"}
        The form of the forward and of the backward: "loop" one query row at
        a time, "numpy" matrix form, "online" key blocks recomputing P from
        the log-sum-exp (FlashAttention-2 in NumPy), "cython" the fused
        kernel (attn._kernels_backward: no L x S array). "auto": cython when
        built and able (no dropout), else numpy.

    Returns
    -------
    out : ndarray, shape [..., L, Ev], the input dtype
        What :func:`scaled_dot_product_attention` returns.
    backward : callable ``backward(grad_out, mask_grad=False)``
        ``grad_out``: dLoss/d out, of out's shape and dtype. Returns
        ``(grad_query, grad_key, grad_value)``, each of its input's shape and
        dtype (summed over broadcast leading dims and, with ``enable_gqa``,
        over each key/value head's query heads). ``mask_grad=True`` (float
        ``attn_mask`` only) also returns the mask's gradient, reduced to the
        mask's own (broadcast) shape, as torch does. With ``sinks`` the last
        element is their gradient, shape [H]. With dropout the
        backward applies the keep mask the forward drew (redrawn from the
        generator's saved state, not stored). ``backward`` keeps ``out`` and
        its log-sum-exp [..., L] (never the L x S weights) and may be called
        any number of times.

    Examples
    --------
    >>> import numpy as np, attn
    >>> q = k = v = np.random.default_rng(0).normal(size=(2, 4, 16, 8))
    >>> out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    >>> dq, dk, dv = backward(np.ones_like(out))
    """
    if _quantized.is_q8(key) or _quantized.is_q8(value):
        raise TypeError("an int8 (attn.Q8Tensor) key/value cache has no gradient: pass float key and value "
                        "to scaled_dot_product_attention_vjp (Q8Tensor.dequantize() gives them)")
    p = validate_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        backend, False, rng, num_threads, window, softcap, alibi_slopes, sinks,
    )
    impl = backends.select(p, gradients=True)
    shapes = (np.shape(query), np.shape(key), np.shape(value))
    mask_shape = None if attn_mask is None else np.shape(attn_mask)
    mask_dtype = None if attn_mask is None else np.asarray(attn_mask).dtype
    state = _gradients.rng_state(p)  # before the forward draws
    out, lse = _gradients.forward(p, impl)

    def backward(grad_out, mask_grad=False):
        """(grad_query, grad_key, grad_value[, grad_attn_mask]) for ``grad_out`` = dLoss/d out."""
        dout = _dtypes.cast(validate_grad_out(grad_out, out.shape, p.out_dtype), p.q.dtype)
        want_ds = validate_mask_grad(mask_grad, mask_dtype)
        keep = _gradients.replay_keep(p, state)
        return _gradients.vjp(p, impl, out, lse, keep, dout, want_ds, shapes, mask_shape, mask_dtype)

    return _dtypes.cast(out, p.out_dtype), backward
