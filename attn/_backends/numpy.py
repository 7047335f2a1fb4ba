"""The matrix form of attention: ``softmax(q k^T * scale + mask) v`` in NumPy.

The seed article's matrix version, made correct for every edge. Inputs
arrive validated and already in the compute dtype from
:mod:`attn._validation`. Masks arrive as

* ``allowed``: bool array broadcastable to ``[..., n_q, n_k]``, True = the key
  takes part (SDPA's convention; causal masks are turned into this), or None;
* ``bias``: float array broadcastable to ``[..., n_q, n_k]``, added to the
  scaled scores, or None.

A row in which no key takes part gets weights 0 and output 0, never NaN.
"""

import math

import numpy as np

from .. import _memory
from ._heads import grouped, merge_group_dim, split_head_dim


def softmax(x, axis=-1):
    """Numerically stable softmax: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : ndarray, float
    axis : int
        The axis that sums to 1.

    Returns
    -------
    ndarray, same shape and dtype as ``x``.

    Notes
    -----
    Subtracting the row max makes the largest exponent ``exp(0) = 1``: no
    overflow, and the denominator is at least 1. A row that is entirely
    ``-inf`` has no defined softmax and gives NaN, as in ``torch.softmax``;
    use :func:`attn.masked_softmax` for rows that may be fully masked.
    """
    x = x - np.max(x, axis=axis, keepdims=True)  # the largest exponent is 0
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def masked_softmax(x, allowed=None, bias=None, axis=-1):
    """Softmax of ``x + bias`` over ``axis`` where ``allowed``; 0 elsewhere.

    A row with nothing allowed (every entry masked, or ``-inf``) yields zeros.
    NaN in a row gives NaN in that row only.
    """
    if bias is not None:
        x = x + bias
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(m == -np.inf, 0, m)  # fully masked row: exp(-inf - 0) = 0, not NaN
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0, 1, total)  # 0 / 1 = 0 for a fully masked row


def attention(q, k, v, allowed=None, bias=None, scale=1.0, keep=None, dropout_p=0.0):
    """Attention as matrix products: ``softmax(q k^T * scale + mask) v``.

    Parameters
    ----------
    q : ndarray, shape [..., n_q, d_k]
    k : ndarray, shape [..., n_k, d_k]
    v : ndarray, shape [..., n_k, d_v]
    allowed, bias : see the module docstring.
    scale : float
        Multiplies ``q k^T`` (``1 / sqrt(d_k)`` by default in the public API).
    keep : bool ndarray, shape [..., n_q, n_k], or None
        Dropout keep mask; kept weights are divided by ``1 - dropout_p``.

    Returns
    -------
    out : ndarray, shape [..., n_q, d_v]
    w : ndarray, shape [..., n_q, n_k] -- the weights applied to ``v``.
    """
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # [.., n_q, d_k] @ [.., d_k, n_k] -> [.., n_q, n_k]
    w = masked_softmax(scores, allowed, bias)  # [.., n_q, n_k], rows sum to 1 (or are all 0)
    if keep is not None:
        w = np.where(keep, w / (1.0 - dropout_p), 0).astype(w.dtype)
    return w @ v, w  # [.., n_q, n_k] @ [.., n_k, d_v] -> [.., n_q, d_v]


def causal_allowed(n_q, n_k, offset=0):
    """Bool [n_q, n_k]: key j is visible to row i iff ``j <= i + offset``.

    ``offset=0`` is torch's ``is_causal`` (upper-left); ``offset=n_k - n_q``
    is lower-right alignment.
    """
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset  # [n_q, 1] vs [1, n_k] -> [n_q, n_k]


def cannot_run(p):
    """The matrix form runs every problem."""
    return None


def check_memory(p):
    """Scores, exponentials and weights: three L x S arrays per matrix (and dropout's keep mask)."""
    n_scores = math.prod(p.batch) * p.n_q * p.n_k
    out_bytes = math.prod(p.batch) * p.n_q * p.d_v * p.q.itemsize
    _memory.check_fits_in_memory(n_scores, p.q.itemsize, 3,
                                 "backend='numpy' (scores, exp and weights)", out_bytes)
    if p.dropout_p > 0.0:  # one float64 draw and one bool per score
        _memory.check_fits_in_memory(n_scores, 9, 1, "dropout's keep mask", out_bytes)


def forward(p):
    """``(out [*batch, L, Ev], weights [*batch, L, S])`` of validated problem ``p``."""
    q, k, v, allowed, bias = grouped(p)  # GQA by broadcasting, no copies
    if p.causal_offset is not None:
        allowed = causal_allowed(p.n_q, p.n_k, p.causal_offset)  # [L, S]
    keep = None
    if p.dropout_p > 0:  # drawn in C order over (batch, row, key), as the loop draws it
        keep = p.rng.random(p.batch + (p.n_q, p.n_k)) >= p.dropout_p
        if p.group > 1:
            keep = split_head_dim(keep, p.group)  # [.., H_q, L, S] -> [.., H_kv, g, L, S]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        out, w = attention(q, k, v, allowed, bias, p.scale, keep, p.dropout_p)
    return merge_group_dim(out, p), merge_group_dim(w, p)


def masked_softmax_forward(p):
    """Masked softmax of validated problem ``p`` along its last axis."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN slices by contract
        return masked_softmax(p.x, p.allowed, p.bias)
