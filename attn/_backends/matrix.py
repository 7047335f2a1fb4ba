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

from .. import _memory, _variants
from ._heads import grouped, merge_group_dim, split_head_dim


#: Sinks are joined to this backend's (out, lse) afterwards (attn._variants.apply_sinks).
APPLIES_SINKS = False

#: Reads int8 (q8_0) key/value rows in place; else they are dequantized first (attn._backends.read_by).
READS_Q8 = False

#: forward_and_lse(p) gives out and lse in one pass (attn._gradients.forward).
FORWARD_WRITES_LSE = False

#: Runs a packed variable-length batch (attn._varlen) in one call: no, each sequence runs as its own call.
RUNS_VARLEN = False

#: Runs attention over a key/value cache (attn._paged) in place: no, its pages are gathered first.
RUNS_CACHE = False


def unavailable(gradients=False):
    """None: Python and NumPy only, this backend runs everywhere, its gradients too."""
    return None


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


def attention(q, k, v, allowed=None, bias=None, scale=1.0, keep=None, dropout_p=0.0, variants=None):
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
    variants : attn._variants.Variants or None
        Its softcap is applied to the scaled scores here (window and ALiBi
        arrive folded into ``allowed`` and ``bias``; sinks are applied by the caller).

    Returns
    -------
    out : ndarray, shape [..., n_q, d_v]
    w : ndarray, shape [..., n_q, n_k] -- the weights applied to ``v``.
    """
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # [.., n_q, d_k] @ [.., d_k, n_k] -> [.., n_q, n_k]
    scores, _ = _variants.cap(scores, variants)
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


def problem_masks(p):
    """The bool mask (causal, window folded in) and the float bias (ALiBi added) of ``p``: dense or None."""
    allowed = p.allowed
    if p.causal_offset is not None:
        allowed = causal_allowed(p.n_q, p.n_k, p.causal_offset)  # [L, S]
    return _variants.masks(p.variants, allowed, p.bias, p.n_q, 0, p.n_k)


def forward(p):
    """``(out [*batch, L, Ev], weights [*batch, L, S])`` of validated problem ``p`` (without sinks)."""
    q, k, v, allowed, bias = grouped(p)  # GQA by broadcasting, no copies
    if p.causal_offset is not None or p.variants is not None:
        allowed, bias = problem_masks(p)
        if p.group > 1:
            allowed, bias = split_head_dim(allowed, p.group), split_head_dim(bias, p.group)
    keep = None
    if p.dropout_p > 0:  # drawn in C order over (batch, row, key), as the loop draws it
        keep = p.rng.random(p.batch + (p.n_q, p.n_k)) >= p.dropout_p
        if p.group > 1:
            keep = split_head_dim(keep, p.group)  # [.., H_q, L, S] -> [.., H_kv, g, L, S]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        out, w = attention(q, k, v, allowed, bias, p.scale, keep, p.dropout_p, p.variants)
    return merge_group_dim(out, p), merge_group_dim(w, p)


def masked_softmax_forward(p):
    """Masked softmax of validated problem ``p`` along its last axis."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN slices by contract
        return masked_softmax(p.x, p.allowed, p.bias)


# ------------------------------------------------------------------ backward
# Forward, per matrix (scale s, additive mask B, invisible keys at -inf,
# dropout keep mask Z with drop probability p):
#     S = s Q K^T + B,  lse_i = log sum_j exp(S_ij),  P = exp(S - lse),
#     W = P o Z / (1 - p)  (W = P without dropout),  O = W V.
# Backward, given dO = dLoss/dO:
#     dV = W^T dO,  dW = dO V^T,  dP = dW o Z / (1 - p),
#     D_i = sum_j P_ij dP_ij = rowsum(dO o O)_i,  dS = P o (dP - D),
#     dQ = s dS K,  dK = s dS^T Q,  dB = dS.
# Why D = rowsum(dO o O): row i of the softmax has Jacobian diag(p) - p p^T,
# so dS_i = p o dP_i - p (p . dP_i), and p . dP_i = sum_j W_ij dW_ij
# = sum_j W_ij (dO_i . V_j) = dO_i . O_i (no L x S product needed).
# P is recomputed from Q, K and the saved lse, never stored by the forward
# (FlashAttention-2). A row with lse = -inf sees no key: subtracting +inf
# instead gives exp(-inf) = 0 (not exp(-inf + inf) = NaN), so its P, dS, dQ
# and its share of dK, dV are 0.
# Soft-capping S = c tanh(s Q K^T / c) + B multiplies the score's gradient
# by dS/d(s Q K^T) = 1 - tanh^2: dQ = s (dS o C) K, dK = s (dS o C)^T Q with
# C = 1 - tanh^2, while dB = dS (the mask is added after the cap).

def visible_scores(q, k, allowed, bias, scale, variants=None, with_dcap=False):
    """Scaled, (soft-capped,) masked scores ``cap(s q k^T) + bias``, invisible keys at -inf: [..., L, S].

    ``with_dcap``: also return d cap / d score (1 - tanh^2), or None without a softcap.
    """
    s = (q @ np.swapaxes(k, -1, -2)) * scale  # [.., L, E] @ [.., E, S] -> [.., L, S]
    s, dcap = _variants.cap(s, variants)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    return (s, dcap) if with_dcap else s


def safe_lse(lse):
    """lse with -inf (no visible key) replaced by +inf: ``exp(S - lse)`` is then 0, not NaN."""
    return np.where(lse == -np.inf, np.inf, lse)


def logsumexp(s):
    """``log sum_j exp(s_j)`` over the last axis: [..., S] -> [...]; -inf for an all -inf row."""
    m = np.max(s, axis=-1, keepdims=True)  # [.., 1]
    m = np.where(m == -np.inf, 0, m)  # all -inf: exp(-inf - 0) = 0, log 0 = -inf
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for an empty row
        return (m + np.log(np.sum(np.exp(s - m), axis=-1, keepdims=True)))[..., 0]


def lse_matrix(q, k, allowed=None, bias=None, scale=1.0, variants=None):
    """Log-sum-exp of each row's scaled, masked scores: q [..., L, E], k [..., S, E] -> [..., L]."""
    return logsumexp(visible_scores(q, k, allowed, bias, scale, variants))


def attention_backward(q, k, v, out, lse, dout, allowed=None, bias=None, scale=1.0,
                       keep=None, dropout_p=0.0, want_ds=False, variants=None):
    """Gradients of attention in matrix form (see the comment above).

    Parameters
    ----------
    q : [..., L, E];  k : [..., S, E];  v : [..., S, Ev]  (one key/value head per query head)
    out : [..., L, Ev] the forward's output;  lse : [..., L] its log-sum-exp
    dout : [..., L, Ev] dLoss/dout
    allowed, bias : see the module docstring
    scale : float
    keep : bool [..., L, S] or None, the forward's dropout keep mask
    want_ds : bool, also return dS (a float mask's gradient)
    variants : attn._variants.Variants or None (its softcap; window and ALiBi folded into the masks)

    Returns
    -------
    dq [..., L, E], dk [..., S, E], dv [..., S, Ev], ds [..., L, S] or None
    (over the broadcast batch).
    """
    s, dcap = visible_scores(q, k, allowed, bias, scale, variants, with_dcap=True)  # [.., L, S]
    p = np.exp(s - safe_lse(lse)[..., None])  # P, recomputed from lse
    w = p if keep is None else np.where(keep, p / (1.0 - dropout_p), 0).astype(p.dtype)  # W
    dv = np.swapaxes(w, -1, -2) @ dout  # dV = W^T dO: [.., S, L] @ [.., L, Ev] -> [.., S, Ev]
    dp = dout @ np.swapaxes(v, -1, -2)  # dW = dO V^T: [.., L, Ev] @ [.., Ev, S] -> [.., L, S]
    if keep is not None:
        dp = np.where(keep, dp / (1.0 - dropout_p), 0).astype(dp.dtype)  # dP = dW o Z / (1-p)
    d = np.sum(dout * out, axis=-1, keepdims=True)  # D = rowsum(dO o O): [.., L, 1]
    ds = p * (dp - d)  # dS = P o (dP - D): [.., L, S]
    dsc = ds if dcap is None else ds * dcap  # through the soft-cap: dS o (1 - tanh^2)
    dq = (dsc @ k) * scale  # dQ = s dS K: [.., L, S] @ [.., S, E] -> [.., L, E]
    dk = (np.swapaxes(dsc, -1, -2) @ q) * scale  # dK = s dS^T Q: [.., S, L] @ [.., L, E] -> [.., S, E]
    return dq, dk, dv, (ds if want_ds else None)


def expanded(p, dense=True):
    """q, k, v (one key/value head per query head: GQA repeats them), the bool mask with causality
    and the float mask; ``dense``: with the window and ALiBi folded in (:func:`problem_masks`)."""
    k, v = p.k, p.v
    if p.group > 1:
        k = np.repeat(k, p.group, axis=-3)  # [.., H_kv, S, E] -> [.., H_q, S, E]
        v = np.repeat(v, p.group, axis=-3)
    allowed, bias = problem_masks(p) if dense else (p.allowed, p.bias)
    if not dense and p.causal_offset is not None:
        allowed = causal_allowed(p.n_q, p.n_k, p.causal_offset)  # [L, S]
    return p.q, k, v, allowed, bias


def forward_lse(p):
    """lse [*batch, L] of validated problem ``p`` (matrix form; without sinks)."""
    q, k, _, allowed, bias = expanded(p)
    return lse_matrix(q, k, allowed, bias, p.scale, p.variants)


def backward(p, out, lse, keep, dout, want_ds):
    """``(dq, dk, dv, ds or None)`` over the batch, per query head, of validated problem ``p``."""
    q, k, v, allowed, bias = expanded(p)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        return attention_backward(q, k, v, out, lse, dout, allowed, bias, p.scale, keep,
                                  p.dropout_p, want_ds, p.variants)
