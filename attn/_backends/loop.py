"""The per-row form of attention: the seed article's loop, one query row at a time.

For each row: scores against every key, the mask of that row, softmax, the
weighted sum of the values. Everything a row needs is computed for that row
alone (its causal horizon, its dropout draws), so the extra memory is O(S)
per row; only ``return_weights=True`` keeps all the rows' weights.
"""

import numpy as np

from .. import _memory, _variants
from .matrix import expanded, logsumexp, masked_softmax, safe_lse


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


def _kv_index(b, group):
    """Batch index of the key/value matrix that query matrix ``b`` reads (GQA: head // group)."""
    return b if group == 1 else b[:-1] + (b[-1] // group,)


def attention(q, k, v, allowed, bias, scale, causal_offset, group, dropout_p, rng, return_weights,
              variants=None):
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
    variants : attn._variants.Variants or None
        Soft-capping, and the window and ALiBi of each row, computed for that
        row (ALiBi's slopes: ``variants.alibi`` broadcast to [*batch]).

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
            s, _ = _variants.cap((kb @ q[b][i]) * scale, variants)  # [S, E] @ [E] -> [S]
            visible = None if allowed is None else allowed[b][i]  # [S]
            if causal_offset is not None:
                visible = keys <= i + causal_offset  # this row's horizon only
            bias_row = None if bias is None else bias[b][i]
            if variants is not None:  # this row's window and ALiBi only
                win = _variants.visible(variants, i, keys)  # [S]
                visible = win if visible is None else (visible if win is None else visible & win)
                ab = _variants.alibi_bias(variants, np.array([[i]]), keys[None, :],
                                          None if variants.alibi is None else variants.alibi[b])
                bias_row = bias_row if ab is None else (ab[0] if bias_row is None else bias_row + ab[0])
            row = masked_softmax(s, visible, bias_row)  # [S]
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
                         p.dropout_p, p.rng, p.return_weights, p.variants)


# ------------------------------------------------------------------ backward
def lse_rows(q, k, allowed, bias, scale, variants=None):
    """Log-sum-exp of each row's scaled, (soft-capped,) masked scores, one row at a time: [..., L].

    q [*batch, L, E], k [*batch, S, E]; allowed/bias broadcast to [*batch, L, S] or None.
    """
    lse = np.empty(q.shape[:-1], q.dtype)
    for b in np.ndindex(*q.shape[:-2]):
        for i in range(q.shape[-2]):
            s, _ = _variants.cap((k[b] @ q[b][i]) * scale, variants)  # [S, E] @ [E] -> [S]
            if bias is not None:
                s = s + bias[b][i]
            if allowed is not None:
                s = np.where(allowed[b][i], s, -np.inf)
            lse[b][i] = logsumexp(s)
    return lse


def attention_backward(q, k, v, out, lse, dout, allowed, bias, scale, keep, dropout_p, want_ds,
                       variants=None):
    """Gradients one query row at a time (the derivation: :mod:`attn._backends.matrix`).

    Arrays broadcast to [*batch, ...] (k, v one head per query head); keep:
    bool [*batch, L, S] or None. Row i computes its own dQ_i and adds its
    outer products to every key's dK_j and dV_j; only one row of scores,
    weights and dS exists at a time (plus ``ds`` when asked for).
    Returns dq, dk, dv, ds or None.
    """
    batch, (n_q, d_k), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    dq = np.zeros(batch + (n_q, d_k), q.dtype)
    dk = np.zeros(batch + (n_k, d_k), q.dtype)
    dv = np.zeros(batch + (n_k, d_v), q.dtype)
    ds_all = np.zeros(batch + (n_q, n_k), q.dtype) if want_ds else None
    for b in np.ndindex(*batch):
        for i in range(n_q):
            qi, oi, doi = q[b][i], out[b][i], dout[b][i]  # [E], [Ev], [Ev]
            s, dcap = _variants.cap((k[b] @ qi) * scale, variants)  # scores of row i: [S, E] @ [E] -> [S]
            if bias is not None:
                s = s + bias[b][i]
            if allowed is not None:
                s = np.where(allowed[b][i], s, -np.inf)
            p = np.exp(s - safe_lse(lse[b][i]))  # P_i, the softmax row, from the saved lse: [S]
            w, dw = p, v[b] @ doi  # W_i (weights applied to V); dW_i = V dO_i: [S, Ev] @ [Ev] -> [S]
            dp = dw  # dP_i: dropout scales the kept entries and zeroes the dropped ones
            if keep is not None:
                w = np.where(keep[b][i], p / (1.0 - dropout_p), 0).astype(p.dtype)
                dp = np.where(keep[b][i], dw / (1.0 - dropout_p), 0).astype(p.dtype)
            d = doi @ oi  # D_i = dO_i . O_i  (= P_i . dP_i)
            ds = p * (dp - d)  # dS_i = P_i o (dP_i - D_i): the softmax Jacobian applied to dP_i
            dsc = ds if dcap is None else ds * dcap  # through the soft-cap: dS_i o (1 - tanh^2)
            dq[b][i] = (dsc @ k[b]) * scale  # dQ_i = s sum_j dS_ij K_j: [S] @ [S, E] -> [E]
            dk[b] += np.outer(dsc, qi) * scale  # dK_j += s dS_ij Q_i: [S] x [E] -> [S, E]
            dv[b] += np.outer(w, doi)  # dV_j += W_ij dO_i: [S] x [Ev] -> [S, Ev]
            if want_ds:
                ds_all[b][i] = ds
    return dq, dk, dv, ds_all


def _broadcast_all(p, *arrays):
    """The problem's q, k, v (one head per query head), masks and ``arrays`` as [*batch, ...] views."""
    q, k, v, allowed, bias = expanded(p)
    mask_shape = p.batch + (p.n_q, p.n_k)
    view = lambda a, inner: None if a is None else np.broadcast_to(a, p.batch + inner)
    return (view(q, q.shape[-2:]), view(k, k.shape[-2:]), view(v, v.shape[-2:]),
            view(allowed, mask_shape[-2:]), view(bias, mask_shape[-2:]),
            *(view(a, a.shape[len(p.batch):]) for a in arrays))


def forward_lse(p):
    """lse [*batch, L] of validated problem ``p``, row by row."""
    q, k, _, allowed, bias = _broadcast_all(p)
    return lse_rows(q, k, allowed, bias, p.scale, p.variants)


def backward(p, out, lse, keep, dout, want_ds):
    """``(dq, dk, dv, ds or None)`` over the batch, per query head, of validated problem ``p``."""
    q, k, v, allowed, bias = _broadcast_all(p)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf give NaN rows by contract
        return attention_backward(q, k, v, out, lse, dout, allowed, bias, p.scale, keep,
                                  p.dropout_p, want_ds, p.variants)
