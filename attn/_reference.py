"""The readable NumPy forms of attention: a per-row loop and the matrix version.

These are the reference implementations (the seed article's ~40 lines, made
correct for every edge): inputs arrive validated and already in the compute
dtype from :mod:`attn._validation`. Masks arrive as

* ``allowed``: bool array broadcastable to ``[..., n_q, n_k]``, True = the key
  takes part (SDPA's convention; causal masks are turned into this), or None;
* ``bias``: float array broadcastable to ``[..., n_q, n_k]``, added to the
  scaled scores, or None.

A row in which no key takes part gets weights 0 and output 0, never NaN.
"""

import numpy as np


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


def sdpa_numpy(q, k, v, allowed=None, bias=None, scale=1.0, keep=None, dropout_p=0.0):
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


def sdpa_loop(q, k, v, allowed=None, bias=None, scale=1.0, keep=None, dropout_p=0.0,
              return_weights=True):
    """Attention one query row at a time: scores, mask, softmax, weighted sum.

    Same contract as :func:`sdpa_numpy`; the seed article's loop version.
    With ``return_weights=False`` only one row of weights exists at a time
    and ``w`` is None.
    """
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    q, k, v = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k, v))
    mask_shape = batch + (n_q, n_k)
    allowed = None if allowed is None else np.broadcast_to(allowed, mask_shape)
    bias = None if bias is None else np.broadcast_to(bias, mask_shape)
    keep = None if keep is None else np.broadcast_to(keep, mask_shape)
    out = np.empty(batch + (n_q, d_v), dtype=q.dtype)
    w = np.empty(mask_shape, dtype=q.dtype) if return_weights else None
    for b in np.ndindex(*batch):
        for i in range(n_q):
            s = (k[b] @ q[b][i]) * scale  # [n_k, d_k] @ [d_k] -> [n_k]
            row = masked_softmax(
                s,
                None if allowed is None else allowed[b][i],
                None if bias is None else bias[b][i],
            )  # [n_k]
            if keep is not None:
                row = np.where(keep[b][i], row / (1.0 - dropout_p), 0).astype(row.dtype)
            if w is not None:
                w[b][i] = row
            out[b][i] = row @ v[b]  # [n_k] @ [n_k, d_v] -> [d_v]
    return out, w
