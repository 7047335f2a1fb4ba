"""The fused kernel's algorithm in NumPy: online softmax over blocks of keys.

FlashAttention-2's forward (Dao, 2023, Algorithm 1) for all query rows at
once: the keys are visited in blocks and no L x S array is ever built. Per
query row i the loop keeps

* ``m`` -- the largest score seen so far (m_i),
* ``l`` -- the sum of exp(score - m) over the keys seen so far (ℓ_i),
* ``acc`` -- the sum of exp(score - m) * v over the same keys (O_i, unnormalized).

When a block raises the maximum from m to m_new, the old sums are rescaled by
``alpha = exp(m - m_new)``; at the end ``out = acc / l``. While a row has
seen no visible key, m = -inf and exponents are taken against 0, so every
term is exp(-inf) = 0 (never exp(-inf + inf) = NaN) and a row with no
visible key ends with l = 0 and output 0. This is also the oracle of the
fused kernel's split-key merge: a block is exactly one of its key chunks.
"""

import math

import numpy as np

from .. import _memory, _variants
from .._shapes import batch_shape
from ._heads import grouped, merge_group_dim, split_head_dim
from .matrix import expanded, safe_lse, visible_scores

BLOCK = 64  # keys per block: the fused kernel's key tile


#: Sinks are joined to this backend's (out, lse) afterwards (attn._variants.apply_sinks).
APPLIES_SINKS = False

#: Reads int8 (q8_0) key/value rows in place; else they are dequantized first (attn._backends.read_by).
READS_Q8 = False

#: forward_and_lse(p) gives out and lse in one pass (attn._gradients.forward).
FORWARD_WRITES_LSE = True

#: Runs a packed variable-length batch (attn._varlen) in one call: no, each sequence runs as its own call.
RUNS_VARLEN = False

#: Runs attention over a key/value cache (attn._paged) in place: no, its pages are gathered first.
RUNS_CACHE = False


def unavailable(gradients=False):
    """None: Python and NumPy only, this backend runs everywhere, its gradients too."""
    return None


def _block_scores(q, k, allowed, bias, scale, causal_offset, j0, j1, variants=None, slopes=None):
    """Scaled, masked scores of keys [j0, j1): [..., L, j1 - j0]; excluded keys are -inf.

    ``variants``: soft-capping, then ALiBi (``slopes`` shaped like q's batch), window.
    """
    s = (q @ np.swapaxes(k[..., j0:j1, :], -1, -2)) * scale  # [.., L, E] @ [.., E, B] -> [.., L, B]
    s, _ = _variants.cap(s, variants)
    allowed, bias = _cols(allowed, j0, j1), _cols(bias, j0, j1)
    allowed, bias = _variants.masks(variants, allowed, bias, q.shape[-2], j0, j1, slopes)  # [L, B] terms
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    if causal_offset is not None:  # key j visible to row i iff j <= i + offset
        rows = np.arange(q.shape[-2])[:, None]  # [L, 1]
        s = np.where(np.arange(j0, j1) <= rows + causal_offset, s, -np.inf)  # [L, B]
    return s


def attention(q, k, v, allowed=None, bias=None, scale=1.0, causal_offset=None, block=BLOCK,
              variants=None, slopes=None):
    """Online-softmax attention.

    Parameters
    ----------
    q : ndarray, shape [..., L, E]; k : [..., S, E]; v : [..., S, Ev]
    allowed, bias : bool / float ndarray broadcastable to [..., L, S], or None
    scale : float
    causal_offset : int or None
    block : int, keys per block
    variants : attn._variants.Variants or None (softcap, window, ALiBi; sinks: the caller)
    slopes : ALiBi slopes broadcastable to q's batch dims (grouped for GQA), or None

    Returns
    -------
    out : ndarray, shape [..., L, Ev]
    m, l : ndarray, shape [..., L] -- each row's max score and sum of exp(score - m)
        (m = -inf and l = 0 for a row with no visible key); :func:`log_sum_exp` combines them.
    """
    lead = batch_shape(q.shape, k.shape, v.shape)
    n_k = k.shape[-2]
    allowed, bias = (None if a is None else np.broadcast_to(a, a.shape[:-1] + (n_k,))  # key axis sliced below
                     for a in (allowed, bias))
    m = np.full(lead + (q.shape[-2], 1), -np.inf, q.dtype)  # m_i    [.., L, 1]
    l = np.zeros_like(m)  # ℓ_i    [.., L, 1]
    acc = np.zeros(lead + (q.shape[-2], v.shape[-1]), q.dtype)  # O_i    [.., L, Ev]
    for j0 in range(0, k.shape[-2], block):
        j1 = min(j0 + block, k.shape[-2])
        s = _block_scores(q, k, allowed, bias, scale, causal_offset, j0, j1, variants, slopes)  # [.., L, B]
        m_new = np.maximum(m, np.max(s, axis=-1, keepdims=True))
        m_safe = np.where(m_new == -np.inf, 0, m_new)  # no visible key yet: exponents against 0
        alpha = np.exp(m - m_safe)  # rescale of the old state
        p = np.exp(s - m_safe)  # [.., L, B]
        l = alpha * l + np.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc + p @ v[..., j0:j1, :]  # [.., L, B] @ [.., B, Ev] -> [.., L, Ev]
        m = m_new
    out = acc / np.where(l == 0, 1, l)  # a row with no visible key: 0 / 1 = 0
    return out, m[..., 0], l[..., 0]


def log_sum_exp(m, l):
    """lse = m + log(l) per row [..., L]: -inf for a row with no visible key."""
    return np.where(l == 0, -np.inf, m + np.log(np.where(l == 0, 1, l)))


def weights(q, k, allowed, bias, scale, causal_offset, m, l, block=BLOCK, variants=None, slopes=None):
    """The attention weights exp(score - m) / l [..., L, S], recomputed block by block.

    (From m and l, not from lse = m + log(l): in float32, m = -1e9 would swallow log(l).)
    """
    m, l = m[..., None], l[..., None]  # [.., L, 1]
    allowed, bias = (None if a is None else np.broadcast_to(a, a.shape[:-1] + (k.shape[-2],))
                     for a in (allowed, bias))
    m_safe, l_safe = np.where(m == -np.inf, 0, m), np.where(l == 0, 1, l)  # no visible key: 0
    blocks = [np.exp(_block_scores(q, k, allowed, bias, scale, causal_offset, j0, min(j0 + block, k.shape[-2]),
                                   variants, slopes)
                     - m_safe) / l_safe
              for j0 in range(0, k.shape[-2], block)]
    return np.concatenate(blocks, axis=-1)


def cannot_run(p):
    """What the online form does not do: dropout (it would need the whole keep mask)."""
    return "apply dropout (dropout_p > 0)" if p.dropout_p > 0 else None


def check_memory(p):
    """The output; one [L, block] score block per matrix; the weights only when returned."""
    n_batch = math.prod(p.batch)
    out_bytes = n_batch * p.n_q * p.d_v * p.q.itemsize
    n_scores = n_batch * p.n_q * (p.n_k if p.return_weights else min(p.n_k, BLOCK))
    _memory.check_fits_in_memory(n_scores, p.q.itemsize, 3, "backend='online' (score blocks)", out_bytes)


def _slopes(p):
    """ALiBi slopes shaped like the grouped q's batch dims (attn._backends._heads.grouped), or None."""
    if p.variants is None or p.variants.alibi is None or p.group == 1:
        return None if p.variants is None else p.variants.alibi
    return split_head_dim(p.variants.alibi[..., None, None], p.group)[..., 0, 0]


def forward(p):
    """``(out, weights or None)`` of validated problem ``p`` (without sinks)."""
    q, k, v, allowed, bias = grouped(p)  # GQA by broadcasting, no copies
    args = (allowed, bias, p.scale, p.causal_offset)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        out, m, l = attention(q, k, v, *args, variants=p.variants, slopes=_slopes(p))
        w = (weights(q, k, *args, m, l, variants=p.variants, slopes=_slopes(p))
             if p.return_weights else None)
    return merge_group_dim(out, p), (None if w is None else merge_group_dim(w, p))


# ------------------------------------------------------------------ backward
def _cols(mask, j0, j1):
    """Columns [j0, j1) of a mask broadcastable to [..., L, S] (a size-1 key axis stays)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., j0:j1]


def attention_backward(q, k, v, out, lse, dout, allowed=None, bias=None, scale=1.0, keep=None,
                       dropout_p=0.0, want_ds=False, block=BLOCK, variants=None):
    """The gradients by key blocks: FlashAttention-2's backward (Dao, 2023, Algorithm 2) in NumPy.

    D = rowsum(dO o O) once; then for each block K_b, V_b of ``block`` keys,
    recompute P_b = exp(s Q K_b^T + B_b - lse) from the saved lse (no running
    max: lse already normalizes the row) and

        dV_b = W_b^T dO,  dP_b = dO V_b^T (o Z_b / (1 - p)),  dS_b = P_b o (dP_b - D),
        dK_b = s dS_b^T Q,  dQ += s dS_b K_b.

    A block's dK_b and dV_b are complete when it is done (the fused kernel
    gives a key block to one thread: no races); dQ sums over the blocks in key
    order. Only [L, block] tiles exist. Arguments and result as
    :func:`attn._backends.matrix.attention_backward` (``variants``: the
    window and ALiBi of each block are built here, [L, block] at a time).
    """
    batch = batch_shape(q.shape, k.shape, v.shape)
    n_q, n_k, d_k, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    lse_safe = safe_lse(lse)[..., None]  # [.., L, 1]
    d = np.sum(dout * out, axis=-1, keepdims=True)  # D = rowsum(dO o O): [.., L, 1]
    dq = np.zeros(batch + (n_q, d_k), q.dtype)
    dk = np.empty(batch + (n_k, d_k), q.dtype)
    dv = np.empty(batch + (n_k, d_v), q.dtype)
    ds_all = np.empty(batch + (n_q, n_k), q.dtype) if want_ds else None
    for j0 in range(0, n_k, block):
        j1 = min(j0 + block, n_k)
        kb, vb = k[..., j0:j1, :], v[..., j0:j1, :]  # [.., B, E], [.., B, Ev]
        s, dcap = visible_scores(q, kb, *_variants.masks(variants, _cols(allowed, j0, j1), _cols(bias, j0, j1),
                                                         n_q, j0, j1), scale, variants, with_dcap=True)
        p = np.exp(s - lse_safe)  # P_b: [.., L, B]
        w, dp = p, dout @ np.swapaxes(vb, -1, -2)  # dW_b = dO V_b^T: [.., L, B]
        if keep is not None:
            kp = _cols(keep, j0, j1)
            w = np.where(kp, p / (1.0 - dropout_p), 0).astype(p.dtype)
            dp = np.where(kp, dp / (1.0 - dropout_p), 0).astype(p.dtype)
        ds = p * (dp - d)  # dS_b = P_b o (dP_b - D): [.., L, B]
        dsc = ds if dcap is None else ds * dcap  # through the soft-cap
        dv[..., j0:j1, :] = np.swapaxes(w, -1, -2) @ dout  # dV_b = W_b^T dO: [.., B, Ev]
        dk[..., j0:j1, :] = (np.swapaxes(dsc, -1, -2) @ q) * scale  # dK_b = s dS_b^T Q: [.., B, E]
        dq += (dsc @ kb) * scale  # dQ += s dS_b K_b: [.., L, B] @ [.., B, E] -> [.., L, E]
        if want_ds:
            ds_all[..., j0:j1] = ds
    return dq, dk, dv, ds_all


def lse_blocks(q, k, allowed=None, bias=None, scale=1.0, block=BLOCK, variants=None):
    """lse [..., L] by key blocks with a running max m and sum l: lse = m + log l."""
    n_k = k.shape[-2]
    m = l = None
    for j0 in range(0, n_k, block):
        j1 = min(j0 + block, n_k)
        s = visible_scores(q, k[..., j0:j1, :], *_variants.masks(variants, _cols(allowed, j0, j1),
                                                                 _cols(bias, j0, j1), q.shape[-2], j0, j1),
                           scale, variants)
        if m is None:
            m, l = np.full(s.shape[:-1] + (1,), -np.inf, s.dtype), np.zeros(s.shape[:-1] + (1,), s.dtype)
        m_new = np.maximum(m, np.max(s, axis=-1, keepdims=True))  # [.., L, 1]
        m_safe = np.where(m_new == -np.inf, 0, m_new)
        l = l * np.exp(m - m_safe) + np.sum(np.exp(s - m_safe), axis=-1, keepdims=True)
        m = m_new
    return log_sum_exp(m[..., 0], l[..., 0])


def forward_and_lse(p):
    """``(out, lse)`` of validated problem ``p`` from one pass: lse = m + log l of the forward's state."""
    q, k, v, allowed, bias = grouped(p)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        out, m, l = attention(q, k, v, allowed, bias, p.scale, p.causal_offset, variants=p.variants,
                              slopes=_slopes(p))
        return merge_group_dim(out, p), merge_group_dim(log_sum_exp(m, l)[..., None], p)[..., 0]


def forward_lse(p):
    """lse [*batch, L] of validated problem ``p``, by key blocks (without sinks)."""
    q, k, _, allowed, bias = expanded(p, dense=False)
    with np.errstate(invalid="ignore", over="ignore"):
        return lse_blocks(q, k, allowed, bias, p.scale, variants=p.variants)


def backward(p, out, lse, keep, dout, want_ds):
    """``(dq, dk, dv, ds or None)`` over the batch, per query head, of validated problem ``p``."""
    q, k, v, allowed, bias = expanded(p, dense=False)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        return attention_backward(q, k, v, out, lse, dout, allowed, bias, p.scale, keep,
                                  p.dropout_p, want_ds, variants=p.variants)
