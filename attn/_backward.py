"""The backward pass of attention in readable forms, and the log-sum-exp.

Forward (per matrix of the batch; ``scale`` s, optional additive mask B,
invisible keys at -inf, dropout keep mask Z with probability p of dropping)::

    S = s Q K^T + B                      [L, S]   scores
    lse_i = log sum_j exp(S_ij)          [L]      (-inf for a row that sees no key)
    P = exp(S - lse)                     [L, S]   softmax, rows sum to 1 (or are 0)
    W = P o Z / (1 - p)                  [L, S]   the weights applied to V (W = P without dropout)
    O = W V                              [L, Ev]

Backward, given dO = dLoss/dO (every form below computes these)::

    dV = W^T dO                          [S, Ev]
    dW = dO V^T                          [L, S]
    dP = dW o Z / (1 - p)                [L, S]
    D_i = sum_j P_ij dP_ij = sum_e dO_ie O_ie       (rowsum(dO o O): no L x S product needed)
    dS = P o (dP - D)                    [L, S]   (the softmax's Jacobian, one row at a time)
    dQ = s dS K                          [L, E]
    dK = s dS^T Q                        [S, E]
    dB = dS                              (an additive float mask's gradient)

Why ``D = rowsum(dO o O)``: row i of the softmax has Jacobian
``diag(p) - p p^T``, so ``dS_i = p o dP_i - p (p . dP_i)`` and
``p . dP_i = sum_j P_ij (dW_ij Z_ij / (1-p)) = sum_j W_ij dW_ij
= sum_j W_ij (dO_i . V_j) = dO_i . O_i``.

P is never stored by the forward: every form recomputes it from Q, K and the
saved ``lse`` (``exp(S - lse)``), as FlashAttention-2 does. A row whose lse is
-inf sees no key: its P is 0 (we subtract +inf instead, so ``exp`` gives 0, not
``exp(-inf + inf) = NaN``), and so are its dS, dQ and its share of dK, dV.

Forms
-----
``loop``     one query row at a time (the derivation above, vector by vector);
``numpy``    the matrix form (one L x S array of each kind);
``online``   key blocks of ``BLOCK_K``: per block recompute P from lse, add that
             block's dK, dV and its share of dQ -- the NumPy picture of the
             fused kernel (``attn/_kernels_backward.pyx``), which never holds
             more than a tile of P.

All forms take arrays already validated and in the compute dtype, keys and
values already expanded to the query heads (GQA), and masks as in
:mod:`attn._reference` (``allowed`` bool, ``bias`` float, both broadcastable
to ``[..., L, S]``); they return gradients over the broadcast batch, which the
caller reduces to each input's own shape.
"""

import numpy as np

BLOCK_K = 64  # keys per block of the online form (the fused kernel's key tile)


def _visible_scores(q, k, allowed, bias, scale):
    """Scaled, masked scores ``s q k^T + bias``, invisible keys at -inf.

    q : [..., L, E], k : [..., S, E] -> [..., L, S]
    """
    s = (q @ np.swapaxes(k, -1, -2)) * scale  # [.., L, E] @ [.., E, S] -> [.., L, S]
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    return s


def _safe_lse(lse):
    """lse with -inf (no visible key) replaced by +inf: ``exp(S - lse)`` is then 0, not NaN."""
    return np.where(lse == -np.inf, np.inf, lse)


def _logsumexp(s):
    """``log sum_j exp(s_j)`` over the last axis; -inf for an all -inf row."""
    m = np.max(s, axis=-1, keepdims=True)  # [.., 1]
    m = np.where(m == -np.inf, 0, m)  # all -inf: exp(-inf - 0) = 0, log 0 = -inf
    with np.errstate(divide="ignore"):  # log(0) = -inf is the answer for an empty row
        return (m + np.log(np.sum(np.exp(s - m), axis=-1, keepdims=True)))[..., 0]


# --------------------------------------------------------------------- lse
def lse_numpy(q, k, allowed=None, bias=None, scale=1.0):
    """Log-sum-exp of each row's scaled, masked scores (matrix form).

    q : [..., L, E], k : [..., S, E] -> lse : [..., L] (-inf where no key is visible)
    """
    return _logsumexp(_visible_scores(q, k, allowed, bias, scale))


def lse_loop(q, k, allowed=None, bias=None, scale=1.0):
    """:func:`lse_numpy`, one query row at a time (only one row of scores exists)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    n_q, n_k = q.shape[-2], k.shape[-2]
    q, k = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k))
    mask_shape = batch + (n_q, n_k)
    allowed = None if allowed is None else np.broadcast_to(allowed, mask_shape)
    bias = None if bias is None else np.broadcast_to(bias, mask_shape)
    lse = np.empty(batch + (n_q,), q.dtype)
    for b in np.ndindex(*batch):
        for i in range(n_q):
            s = (k[b] @ q[b][i]) * scale  # [S, E] @ [E] -> [S]
            if bias is not None:
                s = s + bias[b][i]
            if allowed is not None:
                s = np.where(allowed[b][i], s, -np.inf)
            lse[b][i] = _logsumexp(s)
    return lse


def lse_online(q, k, allowed=None, bias=None, scale=1.0, block_k=BLOCK_K):
    """:func:`lse_numpy` by key blocks with a running max (what a fused forward keeps).

    Per block: m_new = max(m, max_j S_ij), l = l exp(m - m_new) + sum_j exp(S_ij - m_new);
    at the end lse = m + log l.
    """
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    n_q, n_k = q.shape[-2], k.shape[-2]
    m = np.full(batch + (n_q, 1), -np.inf, q.dtype)  # running max
    l = np.zeros(batch + (n_q, 1), q.dtype)  # running sum of exp(S - m)
    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        s = _visible_scores(q, k[..., j0:j1, :], _cols(allowed, j0, j1), _cols(bias, j0, j1), scale)
        m_new = np.maximum(m, np.max(s, axis=-1, keepdims=True))  # [.., L, 1]
        m_safe = np.where(m_new == -np.inf, 0, m_new)
        l = l * np.exp(m - m_safe) + np.sum(np.exp(s - m_safe), axis=-1, keepdims=True)
        m = m_new
    with np.errstate(divide="ignore"):
        return (np.where(m == -np.inf, 0, m) + np.log(l))[..., 0]


def _cols(mask, j0, j1):
    """Columns [j0, j1) of a mask broadcastable to [..., L, S] (a size-1 key axis stays)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., j0:j1]


# ---------------------------------------------------------------- backward
def backward_numpy(q, k, v, out, lse, dout, allowed=None, bias=None, scale=1.0,
                   keep=None, dropout_p=0.0, want_ds=False):
    """Gradients of attention in matrix form.

    Parameters
    ----------
    q : [..., L, E];  k : [..., S, E];  v : [..., S, Ev]  (k, v already per query head)
    out : [..., L, Ev], the forward's output;  lse : [..., L], its log-sum-exp
    dout : [..., L, Ev], dLoss/dout
    allowed, bias : masks broadcastable to [..., L, S] (see module docstring)
    scale : float
    keep : bool [..., L, S] or None, the forward's dropout keep mask
    want_ds : bool, also return dS (the float mask's gradient)

    Returns
    -------
    dq [..., L, E], dk [..., S, E], dv [..., S, Ev], ds [..., L, S] or None
    (over the broadcast batch).
    """
    s = _visible_scores(q, k, allowed, bias, scale)  # [.., L, S]
    p = np.exp(s - _safe_lse(lse)[..., None])  # P, recomputed from lse
    w = p if keep is None else np.where(keep, p / (1.0 - dropout_p), 0).astype(p.dtype)  # W
    dv = np.swapaxes(w, -1, -2) @ dout  # dV = W^T dO: [.., S, L] @ [.., L, Ev] -> [.., S, Ev]
    dp = dout @ np.swapaxes(v, -1, -2)  # dW = dO V^T: [.., L, Ev] @ [.., Ev, S] -> [.., L, S]
    if keep is not None:
        dp = np.where(keep, dp / (1.0 - dropout_p), 0).astype(dp.dtype)  # dP = dW o Z / (1-p)
    d = np.sum(dout * out, axis=-1, keepdims=True)  # D = rowsum(dO o O): [.., L, 1]
    ds = p * (dp - d)  # dS = P o (dP - D): [.., L, S]
    dq = (ds @ k) * scale  # dQ = s dS K: [.., L, S] @ [.., S, E] -> [.., L, E]
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale  # dK = s dS^T Q: [.., S, L] @ [.., L, E] -> [.., S, E]
    return dq, dk, dv, (ds if want_ds else None)


def backward_loop(q, k, v, out, lse, dout, allowed=None, bias=None, scale=1.0,
                  keep=None, dropout_p=0.0, want_ds=False):
    """:func:`backward_numpy` one query row at a time (the seed article's loop style).

    Row i contributes its own dQ_i, and adds its outer products to every key's
    dK and dV. Only one row of scores, weights and dS exists at a time (plus
    ``ds`` when asked for).
    """
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], out.shape[:-2])
    n_q, n_k, d_k, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    q, k, v = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k, v))
    mask_shape = batch + (n_q, n_k)
    allowed = None if allowed is None else np.broadcast_to(allowed, mask_shape)
    bias = None if bias is None else np.broadcast_to(bias, mask_shape)
    keep = None if keep is None else np.broadcast_to(keep, mask_shape)
    dq = np.zeros(batch + (n_q, d_k), q.dtype)
    dk = np.zeros(batch + (n_k, d_k), q.dtype)
    dv = np.zeros(batch + (n_k, d_v), q.dtype)
    ds_all = np.zeros(mask_shape, q.dtype) if want_ds else None
    for b in np.ndindex(*batch):
        for i in range(n_q):
            qi, oi, doi = q[b][i], out[b][i], dout[b][i]  # [E], [Ev], [Ev]
            s = (k[b] @ qi) * scale  # scores of row i: [S, E] @ [E] -> [S]
            if bias is not None:
                s = s + bias[b][i]
            if allowed is not None:
                s = np.where(allowed[b][i], s, -np.inf)
            p = np.exp(s - _safe_lse(lse[b][i]))  # P_i = softmax row, from the saved lse: [S]
            w = p  # W_i: the weights the forward applied to V
            dw = v[b] @ doi  # dW_i = V dO_i: [S, Ev] @ [Ev] -> [S]   (dO V^T, row i)
            dp = dw  # dP_i: dropout scales the kept entries, zeroes the dropped ones
            if keep is not None:
                w = np.where(keep[b][i], p / (1.0 - dropout_p), 0).astype(p.dtype)
                dp = np.where(keep[b][i], dw / (1.0 - dropout_p), 0).astype(p.dtype)
            d = doi @ oi  # D_i = dO_i . O_i = P_i . dP_i (scalar)
            ds = p * (dp - d)  # dS_i = P_i o (dP_i - D_i): the softmax Jacobian applied to dP_i
            dq[b][i] = (ds @ k[b]) * scale  # dQ_i = s sum_j dS_ij K_j: [S] @ [S, E] -> [E]
            dk[b] += np.outer(ds, qi) * scale  # dK_j += s dS_ij Q_i: [S] x [E] -> [S, E]
            dv[b] += np.outer(w, doi)  # dV_j += W_ij dO_i: [S] x [Ev] -> [S, Ev]
            if want_ds:
                ds_all[b][i] = ds
    return dq, dk, dv, ds_all


def backward_online(q, k, v, out, lse, dout, allowed=None, bias=None, scale=1.0,
                    keep=None, dropout_p=0.0, want_ds=False, block_k=BLOCK_K):
    """:func:`backward_numpy` by key blocks of ``block_k``: FlashAttention-2's backward in NumPy.

    D = rowsum(dO o O) once; then for each key block K_b, V_b: recompute
    P_b = exp(s Q K_b^T + B_b - lse) from the saved lse (no running max: lse
    already is the row's normalizer), and

        dV_b = W_b^T dO,  dP_b = dO V_b^T (o Z_b / (1-p)),  dS_b = P_b o (dP_b - D),
        dK_b = s dS_b^T Q,  dQ += s dS_b K_b.

    Each block's dK_b and dV_b are complete when the block is done (the fused
    kernel gives each key block to one thread: no races); dQ sums over the
    blocks in key order. Only [L, block_k] tiles exist.
    """
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], out.shape[:-2])
    n_q, n_k, d_k, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    q, k, v = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k, v))
    lse_safe = _safe_lse(lse)[..., None]  # [.., L, 1]
    d = np.sum(dout * out, axis=-1, keepdims=True)  # D = rowsum(dO o O): [.., L, 1]
    dq = np.zeros(batch + (n_q, d_k), q.dtype)
    dk = np.empty(batch + (n_k, d_k), q.dtype)
    dv = np.empty(batch + (n_k, d_v), q.dtype)
    ds_all = np.empty(batch + (n_q, n_k), q.dtype) if want_ds else None
    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        kb, vb = k[..., j0:j1, :], v[..., j0:j1, :]  # [.., bk, E], [.., bk, Ev]
        s = _visible_scores(q, kb, _cols(allowed, j0, j1), _cols(bias, j0, j1), scale)  # [.., L, bk]
        p = np.exp(s - lse_safe)  # P_b: [.., L, bk]
        w, dp = p, dout @ np.swapaxes(vb, -1, -2)  # dW_b = dO V_b^T: [.., L, bk]
        if keep is not None:
            kp = _cols(keep, j0, j1)
            w = np.where(kp, p / (1.0 - dropout_p), 0).astype(p.dtype)
            dp = np.where(kp, dp / (1.0 - dropout_p), 0).astype(p.dtype)
        ds = p * (dp - d)  # dS_b = P_b o (dP_b - D): [.., L, bk]
        dv[..., j0:j1, :] = np.swapaxes(w, -1, -2) @ dout  # dV_b = W_b^T dO: [.., bk, Ev]
        dk[..., j0:j1, :] = (np.swapaxes(ds, -1, -2) @ q) * scale  # dK_b = s dS_b^T Q: [.., bk, E]
        dq += (ds @ kb) * scale  # dQ += s dS_b K_b: [.., L, bk] @ [.., bk, E] -> [.., L, E]
        if want_ds:
            ds_all[..., j0:j1] = ds
    return dq, dk, dv, ds_all


BACKWARD_FORMS = {"loop": backward_loop, "numpy": backward_numpy, "online": backward_online}
LSE_FORMS = {"loop": lse_loop, "numpy": lse_numpy, "online": lse_online}
