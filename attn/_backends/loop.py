"""The per-row form of attention: the seed article's loop, one query row at a time.

For each row: scores against every key, the mask of that row, softmax, the
weighted sum of the values. Everything a row needs is computed for that row
alone (its causal horizon, its dropout draws), so the extra memory is O(S)
per row; only ``return_weights=True`` keeps all the rows' weights.
"""

import numpy as np

from .. import _memory
from .numpy import masked_softmax


def _kv_index(b, group):
    """Batch index of the key/value matrix that query matrix ``b`` reads (GQA: head // group)."""
    return b if group == 1 else b[:-1] + (b[-1] // group,)


def attention(q, k, v, allowed, bias, scale, causal_offset, group, dropout_p, rng, return_weights):
    """Attention one query row at a time.

    Parameters
    ----------
    q : ndarray, shape [*batch, L, E]
    k, v : ndarray, shape [*kv_batch, S, E] and [*kv_batch, S, Ev]; kv_batch is
        batch, or batch with its last dim divided by ``group`` (GQA)
    allowed, bias : bool / float ndarray broadcast to [*batch, L, S], or None
    scale : float
    causal_offset : int or None
        Row i sees keys ``j <= i + causal_offset``.
    group : int
        Query heads per key/value head.
    dropout_p : float; rng : numpy.random.Generator or None
    return_weights : bool

    Returns
    -------
    out : ndarray, shape [*batch, L, Ev]
    w : ndarray, shape [*batch, L, S], or None unless ``return_weights``
    """
    batch = q.shape[:-2]
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    keys = np.arange(n_k)  # [S]
    out = np.empty(batch + (n_q, d_v), dtype=q.dtype)
    w = np.empty(batch + (n_q, n_k), dtype=q.dtype) if return_weights else None
    for b in np.ndindex(*batch):
        kb, vb = k[_kv_index(b, group)], v[_kv_index(b, group)]  # [S, E], [S, Ev]
        for i in range(n_q):
            s = (kb @ q[b][i]) * scale  # [S, E] @ [E] -> [S]
            visible = None if allowed is None else allowed[b][i]  # [S]
            if causal_offset is not None:
                visible = keys <= i + causal_offset  # this row's horizon only
            row = masked_softmax(s, visible, None if bias is None else bias[b][i])  # [S]
            if dropout_p > 0:  # this row's draws (the same stream order as the matrix form)
                row = np.where(rng.random(n_k) >= dropout_p, row / (1.0 - dropout_p), 0).astype(row.dtype)
            if w is not None:
                w[b][i] = row
            out[b][i] = row @ vb  # [S] @ [S, Ev] -> [Ev]
    return out, w


def cannot_run(p):
    """The loop runs every problem."""
    return None


def check_memory(p):
    """The output, and the L x S weights only when they are returned."""
    _memory.check_output_and_weights(p)


def forward(p):
    """``(out, weights or None)`` of validated problem ``p``."""
    kv_batch = p.batch if p.group == 1 else p.batch[:-1] + (p.batch[-1] // p.group,)
    q = np.broadcast_to(p.q, p.batch + p.q.shape[-2:])  # [*batch, L, E], views
    k = np.broadcast_to(p.k, kv_batch + p.k.shape[-2:])
    v = np.broadcast_to(p.v, kv_batch + p.v.shape[-2:])
    mask_shape = p.batch + (p.n_q, p.n_k)
    allowed = None if p.allowed is None else np.broadcast_to(p.allowed, mask_shape)
    bias = None if p.bias is None else np.broadcast_to(p.bias, mask_shape)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        return attention(q, k, v, allowed, bias, p.scale, p.causal_offset, p.group,
                         p.dropout_p, p.rng, p.return_weights)
