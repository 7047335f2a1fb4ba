"""Gradients: ``scaled_dot_product_attention_vjp`` and the forward's log-sum-exp.

Validation is :func:`attn._validation.validate_attention` (the forward's) plus
the checks of ``backward``'s own arguments, all before any kernel runs. The
forms are in :mod:`attn._backward` (loop, numpy, online) and the compiled
``attn._kernels_backward`` (cython).
"""

import math

import numpy as np

from . import _backward, _reference, _strided
from ._validation import as_float_array, validate_attention

try:  # the fused backward kernel: a separate extension, optional like attn._kernels
    from . import _kernels_backward
except ImportError:  # pragma: no cover - a source tree without build_ext
    _kernels_backward = None

VJP_BACKENDS = ("auto", "loop", "numpy", "online", "cython")


def _describe(a):
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


# ------------------------------------------------------------------ helpers
def _expand_kv(p):
    """Key and value with one head per query head (GQA repeats each key/value head)."""
    if p.group == 1:
        return p.k, p.v
    return (np.repeat(p.k, p.group, axis=-3),  # [.., Hkv, S, E] -> [.., Hq, S, E]
            np.repeat(p.v, p.group, axis=-3))


def _allowed(p):
    """The problem's bool mask, causal alignment included (True = takes part), or None."""
    from ._dispatch import causal_allowed  # (lazy: _dispatch imports this module)

    if p.causal_offset is not None:
        return causal_allowed(p.n_q, p.n_k, p.causal_offset)
    return p.allowed


def _draw_keep(p):
    """Dropout's keep mask, drawn exactly as the forward backends draw it (or None)."""
    if p.dropout_p == 0:
        return None
    return p.rng.random(p.batch + (p.n_q, p.n_k)) >= p.dropout_p  # [.., L, S]


def sum_to_shape(g, shape):
    """Sum ``g`` over the dims that were broadcast from ``shape`` (torch's ``sum_to_size``).

    g : [*batch, *inner] with ``shape`` broadcastable to ``g.shape`` -> [*shape]
    """
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))  # leading dims the input did not have
    axes = tuple(d for d, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)  # dims of size 1 that were broadcast
    return g.reshape(shape)


def _sum_groups(g, group):
    """GQA: sum each key/value head's gradient over its ``group`` query heads.

    g : [..., Hq, S, F] -> [..., Hq // group, S, F]
    """
    if group == 1:
        return g
    h_q = g.shape[-3]
    g = g.reshape(g.shape[:-3] + (h_q // group, group) + g.shape[-2:])  # [.., Hkv, group, S, F]
    return g.sum(axis=-3)


# ------------------------------------------------------------------ forward
def forward_lse(p):
    """lse [*batch, L] of a validated problem: log sum_j exp(s q.k_j + bias_j) over visible keys."""
    lse_shape = p.batch + (p.n_q,)
    if p.n_k == 0 or 0 in lse_shape:
        return np.full(lse_shape, -np.inf, p.q.dtype)
    if p.backend == "cython" and _kernels_backward is not None:
        return _lse_cython(p)
    k, _ = _expand_kv(p)
    form = _backward.LSE_FORMS["loop" if p.backend == "loop" else
                               "numpy" if p.backend == "numpy" else "online"]
    lse = form(p.q, k, _allowed(p), p.bias, p.scale).astype(p.q.dtype, copy=False)
    if lse.shape != lse_shape:  # value had more leading dims than query and key
        lse = np.array(np.broadcast_to(lse, lse_shape))  # [*batch, L], writable
    return lse


def _forward(p):
    """out [*batch, L, Ev] (compute dtype), lse [*batch, L], keep mask or None."""
    from . import _dispatch

    out_shape = p.batch + (p.n_q, p.d_v)
    keep = None
    if 0 in out_shape or p.n_k == 0:
        out = np.zeros(out_shape, p.q.dtype)
    elif p.backend == "cython":
        out, _ = _dispatch._attention_cython(p)
    else:
        k, v = _expand_kv(p)
        keep = _draw_keep(p)
        args = (p.q, k, v, _allowed(p), p.bias, p.scale, keep, p.dropout_p)
        with np.errstate(invalid="ignore", over="ignore"):
            if p.backend == "loop":
                out, _ = _reference.sdpa_loop(*args, return_weights=False)
            else:  # numpy; the online form's forward is the numpy one until it lands
                out, _ = _reference.sdpa_numpy(*args)
    return out, forward_lse(p), keep


# ----------------------------------------------------------------- backward
def _check_grad_out(grad_out, out_shape, out_dtype):
    g = as_float_array(grad_out, "grad_out")
    if tuple(g.shape) != tuple(out_shape):
        raise ValueError(
            f"grad_out must have the output's shape {tuple(out_shape)}; got {_describe(g)}"
        )
    if g.dtype != out_dtype:
        raise TypeError(
            f"grad_out must have the output's dtype {np.dtype(out_dtype)}; got {_describe(g)}"
        )
    return g


def _check_mask_grad(mask_grad, attn_mask_dtype):
    if not isinstance(mask_grad, (bool, np.bool_)):
        raise TypeError(f"mask_grad must be True or False, got {mask_grad!r}")
    if mask_grad and (attn_mask_dtype is None or attn_mask_dtype.kind != "f"):
        have = "no attn_mask" if attn_mask_dtype is None else f"an attn_mask of dtype {attn_mask_dtype}"
        raise ValueError(
            "mask_grad=True needs a float attn_mask (a bool mask or is_causal has no gradient); "
            f"the forward had {have}"
        )
    return bool(mask_grad)


def gradients(p, out, lse, keep, dout, want_ds):
    """dq, dk, dv (each over the broadcast batch, per query head) and dS or None."""
    if p.backend == "cython" and _kernels_backward is not None:
        return _backward_cython(p, out, lse, dout, want_ds)
    k, v = _expand_kv(p)
    form = _backward.BACKWARD_FORMS["online" if p.backend == "cython" else p.backend]
    with np.errstate(invalid="ignore", over="ignore"):
        return form(p.q, k, v, out, lse, dout, _allowed(p), p.bias, p.scale, keep, p.dropout_p,
                    want_ds=want_ds)


def reduce_gradients(p, dq, dk, dv, ds, shapes, mask_shape, mask_dtype):
    """Gradients over the broadcast batch -> each input's own shape and dtype.

    shapes : the (query, key, value) input shapes; mask_shape/dtype: the float
    attn_mask's (for ``ds``).
    """
    dq = sum_to_shape(dq, shapes[0])
    dk = sum_to_shape(_sum_groups(dk, p.group), shapes[1])
    dv = sum_to_shape(_sum_groups(dv, p.group), shapes[2])
    grads = tuple(g.astype(p.out_dtype, copy=False) for g in (dq, dk, dv))
    if ds is not None:
        grads += (sum_to_shape(ds, mask_shape).astype(mask_dtype, copy=False),)
    return grads


def scaled_dot_product_attention_vjp(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, backend="auto", rng=None, num_threads=None,
):
    """Attention and a function computing its vector-Jacobian product (the backward pass).

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng, num_threads
        As :func:`attn.scaled_dot_product_attention`.
    backend : {"auto", "loop", "numpy", "online", "cython"}
        The form of the backward (and of the forward): "loop" one query row
        at a time, "numpy" matrix form, "online" key blocks recomputing P
        from the log-sum-exp (FlashAttention-2 in NumPy), "cython" the fused
        kernel (no L x S array). "auto": cython when built and no dropout,
        else numpy.

    Returns
    -------
    out : ndarray, shape [..., L, Ev], the input dtype
        What :func:`attn.scaled_dot_product_attention` returns.
    backward : callable ``backward(grad_out, mask_grad=False)``
        ``grad_out``: shape and dtype of ``out``. Returns ``(grad_query,
        grad_key, grad_value)``, each of its input's shape and dtype (summed
        over broadcast leading dims, and with ``enable_gqa`` over each key/value
        head's query heads); with ``mask_grad=True`` (float ``attn_mask`` only)
        also the mask's gradient, reduced to the mask's own shape. Dropout
        reuses the forward's keep mask. ``backward`` keeps what it needs
        (out and its log-sum-exp, [..., L]) and may be called any number of times.

    Examples
    --------
    >>> import numpy as np, attn
    >>> q = k = v = np.random.default_rng(0).normal(size=(2, 4, 16, 8))
    >>> out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True)
    >>> dq, dk, dv = backward(np.ones_like(out))
    """
    if not isinstance(backend, str) or backend not in VJP_BACKENDS:
        raise ValueError(f"backend must be one of {VJP_BACKENDS}, got {backend!r}")
    p = validate_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        "numpy" if backend == "online" else backend, False, rng, num_threads,
    )
    if backend == "online":
        p.backend = "online"
    shapes = (np.shape(query), np.shape(key), np.shape(value))
    mask_shape = None if attn_mask is None else np.shape(attn_mask)
    mask_dtype = None if attn_mask is None else np.asarray(attn_mask).dtype
    out, lse, keep = _forward(p)
    out_public = out.astype(p.out_dtype, copy=False)

    def backward(grad_out, mask_grad=False):
        """(grad_query, grad_key, grad_value[, grad_attn_mask]) for ``grad_out`` = dLoss/d out."""
        dout = _check_grad_out(grad_out, out.shape, p.out_dtype)
        want_ds = _check_mask_grad(mask_grad, mask_dtype)
        dout = dout.astype(p.q.dtype, copy=False)
        if 0 in out.shape or p.n_k == 0 or 0 in p.q.shape[-2:-1]:
            dq, dk, dv = (np.zeros(p.batch + a.shape[-2:], p.q.dtype) for a in (p.q, *_expand_kv(p)))
            ds = np.zeros(p.batch + (p.n_q, p.n_k), p.q.dtype) if want_ds else None
        else:
            dq, dk, dv, ds = gradients(p, out, lse, keep, dout, want_ds)
        return reduce_gradients(p, dq, dk, dv, ds, shapes, mask_shape, mask_dtype)

    return out_public, backward


# -------------------------------------------------------------- cython form
def _lse_cython(p):
    """lse by the fused extension: score tiles, never the L x S scores."""
    batch, n_batch = p.batch, math.prod(p.batch)
    q, q_off, q_strides = _strided.describe(p.q, batch)
    k, k_off, k_strides = _strided.describe(p.k, batch, group=p.group)
    mask, m_off, m_strides = _mask_operand(p)
    lse = np.empty((n_batch, p.n_q), q.dtype)  # [N, L]
    _kernels_backward.lse(
        q, k, mask, lse, q_off, k_off, m_off, q_strides, k_strides, m_strides,
        p.causal_offset is not None, p.causal_offset or 0, p.scale, p.num_threads,
    )
    return lse.reshape(batch + (p.n_q,))


def _mask_operand(p):
    mask = p.allowed if p.allowed is not None else p.bias
    if mask is None:
        return None, np.zeros(0, np.int64), (0, 0)
    mask = np.broadcast_to(mask, p.batch + (p.n_q, p.n_k))  # a view, stride 0
    return _strided.describe(mask, p.batch)


def _backward_cython(p, out, lse, dout, want_ds):
    """The fused FlashAttention-2 backward; gradients per query head [N, ., .]."""
    batch, n_batch = p.batch, math.prod(p.batch)
    q, q_off, q_strides = _strided.describe(p.q, batch)
    k, k_off, k_strides = _strided.describe(p.k, batch, group=p.group)
    v, v_off, v_strides = _strided.describe(p.v, batch, group=p.group)
    mask, m_off, m_strides = _mask_operand(p)
    out = np.ascontiguousarray(out).reshape(n_batch, p.n_q, p.d_v)  # [N, L, Ev]
    dout = np.ascontiguousarray(dout).reshape(n_batch, p.n_q, p.d_v)  # [N, L, Ev]
    lse = np.ascontiguousarray(lse).reshape(n_batch, p.n_q)  # [N, L]
    dq = np.empty((n_batch, p.n_q, p.d_k), q.dtype)
    dk = np.empty((n_batch, p.n_k, p.d_k), q.dtype)
    dv = np.empty((n_batch, p.n_k, p.d_v), q.dtype)
    ds = np.empty((n_batch, p.n_q, p.n_k), q.dtype) if want_ds else None
    _kernels_backward.backward(
        q, k, v, mask, out, dout, lse, dq, dk, dv, ds, q_off, k_off, v_off, m_off,
        q_strides, k_strides, v_strides, m_strides,
        p.causal_offset is not None, p.causal_offset or 0, p.scale, p.num_threads,
    )
    shape = lambda a: batch + a.shape[1:]  # [N, ., .] -> [*batch, ., .]
    return (dq.reshape(shape(dq)), dk.reshape(shape(dk)), dv.reshape(shape(dv)),
            None if ds is None else ds.reshape(shape(ds)))
