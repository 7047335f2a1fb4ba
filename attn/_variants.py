"""The attention variants of today's models: sliding window, soft-capping, ALiBi, sinks.

One home for what the variants mean; every backend builds on these.
With ``s = scale * q . k`` the score of query row i and key j becomes

    s' = softcap * tanh(s / softcap)          soft-capping (Gemma 2), when softcap is set
    s' = s' - slope_h * |i + offset - j|      ALiBi, slopes per head (or per batch and head)
    s' = s' + mask                            the float attn_mask (bool: -inf where False)

and key j takes part only if ``i + offset - left <= j <= i + offset + right``
(a sliding window, FlashAttention's ``window_size=(left, right)``, -1 =
unbounded on that side), and, with ``is_causal``, if ``j <= i + offset``.
``offset`` is the causal alignment's: 0 for "upper_left" (torch's is_causal),
S - L for "lower_right"; without is_causal it is S - L, FlashAttention's
convention (its queries are always bottom-right aligned with the keys).

Sinks (gpt-oss; transformers' ``s_aux``): one learned logit ``sink_h`` per
head joins each row's softmax denominator with no value:

    P_ij = exp(s'_ij) / (exp(sink_h) + sum_k exp(s'_ik)),  out_i = sum_j P_ij v_j.

So with ``lse_i = log sum_k exp(s'_ik)`` of the attention without sinks,
``lse'_i = logaddexp(lse_i, sink_h)`` and ``out' = out * exp(lse_i - lse'_i)``:
the sink is applied to the (out, lse) of the plain computation by the
loop, numpy and online backends (:func:`apply_sinks`); the fused kernel joins
it to each row's running max and sum at the end of the row, before it
divides (attn_sink_join in attn/_src/attn_kernel.h; a backend's
``APPLIES_SINKS`` says which). The backward needs nothing else: P recomputed
from lse' is the sinks' P, and D_i = dO_i . O'_i still equals sum_j P_ij dP_ij
(the sink's dP is 0, it has no value). The sink's own gradient is
``d sink_h = -sum_i P_sink,i D_i`` with ``P_sink,i = exp(sink_h - lse'_i)``
(:func:`sinks_grad`).
"""

import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._integers import check_int

UNBOUNDED = 1 << 62  # a window side without a bound: |i + offset| stays far below it


@dataclass
class Variants:
    """The validated variant arguments of one attention call (see the module docstring)."""

    window: Optional[tuple]  # (left, right) as given, -1 = unbounded; None: no window
    window_lo: int  # key j visible to row i only if j >= i + window_lo (-UNBOUNDED: no bound)
    window_hi: int  # ... and j <= i + window_hi (UNBOUNDED: no bound)
    softcap: Optional[float]
    alibi: Optional[np.ndarray]  # slopes, compute dtype, broadcast to [*batch] (a view)
    offset: int  # the alignment offset of the window and ALiBi
    sinks: Optional[np.ndarray]  # compute dtype, broadcast to [*batch] (a view)

    @property
    def has_window(self):
        return self.window_lo > -UNBOUNDED or self.window_hi < UNBOUNDED


# ------------------------------------------------------------------ validation
def _head_params(x, name, batch, cdtype, allow_batch):
    """An array of per-head parameters [H] (or [B, H]) broadcast to ``batch``, in ``cdtype``."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, numbers.Number):
        raise TypeError(f"{name} must be an array of shape [H]" + (" or [B, H]" if allow_batch else "")
                        + f", got {x!r}")
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array; np.asarray({name}) failed: {exc}") from None
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be an array of floats; got shape {a.shape} and dtype {a.dtype}")
    shapes = "[H]" + (" or [B, H]" if allow_batch else "")
    if len(batch) < 1:
        raise ValueError(f"{name} needs a heads dim: query must be [..., H, L, E]; got batch dims {batch}")
    ok = (a.ndim == 1 and a.shape[0] == batch[-1]) or (
        allow_batch and a.ndim == 2 and len(batch) >= 2 and a.shape == tuple(batch[-2:]))
    if not ok:
        raise ValueError(
            f"{name} must have shape {shapes} with H = {batch[-1]} query heads"
            + (f" and B = {batch[-2]}" if allow_batch and len(batch) >= 2 else "")
            + f" (the query's dims -3" + (" and -4)" if allow_batch else ")")
            + f"; got shape {a.shape} and dtype {a.dtype}"
        )
    a = a.astype(cdtype)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite; got {a}")
    return np.broadcast_to(a, batch)


def validate(window, softcap, alibi_slopes, sinks, *, batch, n_q, n_k, causal_offset, cdtype):
    """The :class:`Variants` of a call, or None when it uses none; TypeError/ValueError naming the argument."""
    if window is None and softcap is None and alibi_slopes is None and sinks is None:
        return None
    offset = n_k - n_q if causal_offset is None else causal_offset
    lo, hi = -UNBOUNDED, UNBOUNDED
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints (-1 = unbounded), got {window!r}")
        left, right = check_int(window[0], "window[0] (left)"), check_int(window[1], "window[1] (right)")
        for side, w in (("left", left), ("right", right)):
            if w < -1:
                raise ValueError(f"window's {side} size must be >= 0, or -1 for unbounded; got {window!r}")
        window = (left, right)
        if left >= 0:
            lo = offset - left
        if right >= 0:
            hi = offset + right
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a positive real number or None, got {softcap!r}")
        softcap = float(softcap)
        if not (np.isfinite(softcap) and softcap >= 0):
            raise ValueError(f"softcap must be finite and >= 0 (0 or None: no capping), got {softcap}")
        softcap = softcap or None  # FlashAttention's softcap=0.0: off
    alibi = None if alibi_slopes is None else _head_params(alibi_slopes, "alibi_slopes", batch, cdtype, True)
    sink = None if sinks is None else _head_params(sinks, "sinks", batch, cdtype, False)
    return Variants(window=window, window_lo=lo, window_hi=hi, softcap=softcap, alibi=alibi,
                    offset=offset, sinks=sink)


# ------------------------------------------------------------------ the score terms
def visible(v, rows, cols):
    """Bool [..rows.., ..cols..] broadcast: key ``cols`` inside row ``rows``' window; None: no window."""
    if v is None or not v.has_window:
        return None
    return (cols >= rows + v.window_lo) & (cols <= rows + v.window_hi)


def alibi_bias(v, rows, cols, slopes=None):
    """-slope * |rows + offset - cols|: [*slopes.shape, r, c]; None: no ALiBi.

    ``slopes``: the problem's (``v.alibi``, [*batch]) unless given (e.g. grouped for GQA).
    """
    if v is None or v.alibi is None:
        return None
    slopes = v.alibi if slopes is None else slopes
    dist = np.abs(rows + v.offset - cols).astype(v.alibi.dtype)  # [r, c]
    return -slopes[..., None, None] * dist


def masks(v, allowed, bias, n_q, j0, j1, slopes=None):
    """``allowed`` with the window of keys [j0, j1) folded in, ``bias`` with ALiBi added.

    allowed, bias: broadcastable to [..., n_q, j1 - j0], or None. Returns them
    unchanged without variants (dense [.., n_q, j1 - j0] terms otherwise: for
    the NumPy backends, which build the scores anyway).
    """
    if v is None:
        return allowed, bias
    rows, cols = np.arange(n_q)[:, None], np.arange(j0, j1)[None, :]  # [L, 1], [1, B]
    win = visible(v, rows, cols)
    if win is not None:
        allowed = win if allowed is None else allowed & win
    ab = alibi_bias(v, rows, cols, slopes)
    if ab is not None:
        bias = ab if bias is None else bias + ab
    return allowed, bias


def cap(s, v):
    """Soft-capped scores ``softcap * tanh(s / softcap)`` and d(capped)/ds = 1 - tanh^2, or (s, None)."""
    if v is None or v.softcap is None:
        return s, None
    t = np.tanh(s / v.softcap)
    return v.softcap * t, 1 - t * t


# ------------------------------------------------------------------ sinks
def apply_sinks(v, out, lse, weights=None, sinks=None):
    """(out', lse'[, weights']) with the sinks joining the softmax (module docstring); unchanged without.

    out [*batch, L, Ev], lse [*batch, L] of the attention without sinks (-inf:
    no visible key); weights [*batch, L, S] or None, each scaled in place
    (the backends' fresh results). ``sinks``: broadcastable to [*batch]
    (default ``v.sinks``).
    """
    if v is None or v.sinks is None:
        return (out, lse) if weights is None else (out, lse, weights)
    sinks = v.sinks if sinks is None else sinks
    sink = np.broadcast_to(sinks, lse.shape[:-1])[..., None].astype(lse.dtype)  # [*batch, 1]
    with np.errstate(invalid="ignore", over="ignore"):
        lse2 = np.logaddexp(lse, sink)
        factor = np.exp(lse - lse2)  # 0 for a row that sees no key (lse = -inf)
    out *= factor[..., None].astype(out.dtype, copy=False)
    if weights is None:
        return out, lse2
    weights *= factor[..., None].astype(weights.dtype, copy=False)
    return out, lse2, weights


def sinks_grad(v, out, dout, lse, sinks=None):
    """d sinks [*batch]: -sum_i exp(sink - lse'_i) (dO_i . O'_i), over each matrix's rows.

    out, dout [*batch, L, Ev], lse [*batch, L] (sinks included); ``sinks`` as :func:`apply_sinks`.
    """
    sinks = v.sinks if sinks is None else sinks
    sink = np.broadcast_to(sinks, lse.shape[:-1])[..., None]
    d = np.sum(dout * out, axis=-1)  # D_i = dO_i . O_i: [*batch, L]
    with np.errstate(invalid="ignore", over="ignore"):
        return -np.sum(np.exp(sink - lse) * d, axis=-1)
