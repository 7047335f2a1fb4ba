"""Public entry points: validate once (attn._validation), then run one backend."""

import math

import numpy as np

from . import _reference, _strided
from ._interop import accepts_torch
from ._dispatch_info import _kernels
from ._validation import as_float_array, compute_dtype, validate_attention, validate_masked_softmax

_NO_OFFSETS = np.zeros(0, np.int64)  # no mask: the kernel never reads its offsets


@accepts_torch("x")
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
        w = _reference.softmax(a.astype(compute_dtype(a.dtype), copy=False), axis=axis)
    return w.astype(a.dtype, copy=False)


@accepts_torch("x", "mask")
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
    x = p.x  # [..., n], softmax axis last
    if x.size == 0:  # no slice, or empty slices (a max over them would raise)
        out = np.zeros(x.shape, x.dtype)
    elif p.backend == "numpy":
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN slices by contract
            out = _reference.masked_softmax(x, p.allowed, p.bias)
    else:
        out = _softmax_cython(x, p.allowed if p.allowed is not None else p.bias, p.num_threads)
    return np.moveaxis(out, -1, p.axis).astype(p.out_dtype, copy=False)


def _softmax_cython(x, mask, num_threads):
    lead, n = x.shape[:-1], x.shape[-1]
    x, x_off, (x_stride,) = _strided.describe(x, lead, n_inner=1)
    out = np.empty((math.prod(lead), n), dtype=x.dtype)  # [rows, n]
    m_off, m_stride = x_off, 0
    if mask is not None:
        mask, m_off, (m_stride,) = _strided.describe(mask, lead, n_inner=1)
    _kernels.masked_softmax(x, mask, out, x_off, m_off, x_stride, m_stride, num_threads)
    return out.reshape(x.shape)


@accepts_torch("query", "key", "value", "attn_mask")
def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, backend="auto", return_weights=False, rng=None, num_threads=None,
):
    """Scaled dot-product attention with ``torch.nn.functional.scaled_dot_product_attention``'s semantics.

    ``softmax(query @ key^T * scale + mask) @ value``, computed by one of
    three backends that give the same answer.

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
    backend : {"auto", "loop", "numpy", "cython"}
        "loop": a Python loop over query rows; "numpy": the matrix version;
        "cython": the fused kernel (never builds the L x S scores unless
        ``return_weights``); "auto": cython when built and able, else numpy.
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
    p = validate_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        backend, return_weights, rng, num_threads,
    )
    out_shape, w_shape = p.batch + (p.n_q, p.d_v), p.batch + (p.n_q, p.n_k)
    # Nothing to compute: empty output and no weights (or empty weights), or no
    # keys at all (output 0, like torch). With Ev = 0 the weights are still real.
    nothing_to_compute = 0 in out_shape and (not p.return_weights or 0 in w_shape)
    if nothing_to_compute or p.n_k == 0:
        out, w = np.zeros(out_shape, p.q.dtype), np.zeros(w_shape, p.q.dtype)
    elif p.backend == "cython":
        out, w = _attention_cython(p)
    else:
        out, w = _attention_reference(p)
    out = out.astype(p.out_dtype, copy=False)
    if p.return_weights:
        return out, w.astype(p.out_dtype, copy=False)
    return out


def causal_allowed(n_q, n_k, offset=0):
    """Bool [n_q, n_k]: key j is visible to row i iff ``j <= i + offset``.

    ``offset=0`` is torch's ``is_causal`` (upper-left); ``offset=n_k - n_q``
    is lower-right alignment.
    """
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset  # [n_q, 1] vs [1, n_k] -> [n_q, n_k]


def _attention_reference(p):
    k, v = p.k, p.v
    if p.group > 1:  # the reference backends simply repeat key/value heads
        k = np.repeat(k, p.group, axis=-3)  # [.., Hkv, S, E] -> [.., Hq, S, E]
        v = np.repeat(v, p.group, axis=-3)
    allowed = p.allowed
    if p.causal_offset is not None:
        allowed = causal_allowed(p.n_q, p.n_k, p.causal_offset)
    keep = None
    if p.dropout_p > 0:
        keep = p.rng.random(p.batch + (p.n_q, p.n_k)) >= p.dropout_p
    args = (p.q, k, v, allowed, p.bias, p.scale, keep, p.dropout_p)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        if p.backend == "loop":
            return _reference.sdpa_loop(*args, return_weights=p.return_weights)
        return _reference.sdpa_numpy(*args)


def _attention_cython(p):
    batch, n_batch = p.batch, math.prod(p.batch)
    q, q_off, q_strides = _strided.describe(p.q, batch)  # q first: the canary tests shift it
    k, k_off, k_strides = _strided.describe(p.k, batch, group=p.group)
    v, v_off, v_strides = _strided.describe(p.v, batch, group=p.group)
    out = np.empty((n_batch, p.n_q, p.d_v), dtype=q.dtype)  # [N, L, Ev]
    w = np.empty((n_batch, p.n_q, p.n_k), dtype=q.dtype) if p.return_weights else None
    mask = p.allowed if p.allowed is not None else p.bias
    m_off, m_strides = _NO_OFFSETS, (0, 0)
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (p.n_q, p.n_k))  # a view, stride 0
        mask, m_off, m_strides = _strided.describe(mask, batch)
    _kernels.attention(
        q, k, v, mask, out, w, q_off, k_off, v_off, m_off,
        q_strides, k_strides, v_strides, m_strides,
        p.causal_offset is not None, p.causal_offset or 0, p.scale, p.num_threads,
    )
    out = out.reshape(batch + (p.n_q, p.d_v))
    return out, (None if w is None else w.reshape(batch + (p.n_q, p.n_k)))
