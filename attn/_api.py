"""The public functions: validate (attn._validation), pick a backend (attn._backends), run it."""

import numpy as np

from . import _backends as backends
from ._validation import as_float_array, compute_dtype, validate_attention, validate_masked_softmax


def softmax(x, axis=-1):
    """Numerically stable softmax over ``axis`` (NumPy; see :func:`attn.masked_softmax`).

    Parameters
    ----------
    x : array_like of float16, float32 or float64
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
        w = backends.numpy.softmax(a.astype(compute_dtype(a.dtype), copy=False), axis=axis)
    return w.astype(a.dtype, copy=False)


def masked_softmax(x, mask=None, axis=-1, *, backend="auto", num_threads=None):
    """Softmax over ``axis`` of the entries that take part; 0 elsewhere.

    Parameters
    ----------
    x : array_like of float16, float32 or float64, shape [...]
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


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, backend="auto", return_weights=False, rng=None, num_threads=None,
):
    """Scaled dot-product attention with ``torch.nn.functional.scaled_dot_product_attention``'s semantics.

    ``softmax(query @ key^T * scale + mask) @ value``, computed by one of
    four backends that give the same answer.

    Parameters
    ----------
    query : array_like, shape [..., L, E]
    key : array_like, shape [..., S, E]
    value : array_like, shape [..., S, Ev]
        float16, float32 or float64, all the same dtype (float16 is computed
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
    rng : numpy.random.Generator, optional
        Source of the dropout mask (a fresh default generator if None).
    num_threads : int, optional
        Threads for the cython backend, 1 to 1024 (default :func:`attn.get_num_threads`).

    Returns
    -------
    out : ndarray, shape [..., L, Ev], the input dtype
    weights : ndarray, shape [..., L, S] (only with ``return_weights=True``)

    Rows whose keys are all masked (or S = 0) give output 0 and weights 0.
    """
    out = backends.fused.fast_forward(  # the common case, validated in compiled code
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
        return_weights, num_threads,
    )
    if out is not None:
        return out
    p = validate_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        backend, return_weights, rng, num_threads,
    )
    impl = backends.select(p)
    out_shape, w_shape = p.batch + (p.n_q, p.d_v), p.batch + (p.n_q, p.n_k)
    # Nothing to compute: empty output and no weights (or empty weights), or no
    # keys at all (output 0, like torch). With Ev = 0 the weights are still real.
    nothing_to_compute = 0 in out_shape and (not p.return_weights or 0 in w_shape)
    if nothing_to_compute or p.n_k == 0:
        out, w = np.zeros(out_shape, p.q.dtype), np.zeros(w_shape, p.q.dtype)
    else:
        out, w = impl.forward(p)
    out = out.astype(p.out_dtype, copy=False)
    if p.return_weights:
        return out, w.astype(p.out_dtype, copy=False)
    return out
