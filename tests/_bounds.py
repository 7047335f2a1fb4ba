"""Rounding-error bounds for comparing attention results across implementations.

Two implementations of the same formula (attn's backends, torch, NumPy's BLAS,
each SIMD path, any thread count) round differently: they sum in different
orders, use different ``exp`` approximations, rescale partial sums at different
block boundaries. A fixed tolerance that passed on one CPU fails on another.
So every cross-implementation comparison in the suite is bounded by what the
computation itself guarantees, for ANY summation order, and two results are
compared with the sum of their bounds: ``|a - b| <= err_a + err_b``.
(Comparisons of one implementation with itself, e.g. across thread counts on
one SIMD path, stay bitwise.)

The reasoning (u = unit roundoff of the working dtype, 2**-24 for float32,
2**-53 for float64; gamma(n) = n u / (1 - n u), Higham's bound for a sum or
dot product of n terms in any order: ``|fl(sum x_i) - sum x_i| <= gamma(n) sum |x_i|``):

1. Scores ``s_ij = scale * q_i . k_j (+ mask_ij)``. The dot product and the
   scale (some libraries multiply q and k by sqrt(scale) each) give
   ``|ds_ij| <= gamma(d_k + 2) * scale * (|q| @ |k|^T)_ij``; a float mask's add
   ``u |s_ij + mask_ij|``. Softmax subtracts the row max (and may multiply by
   log2(e) for an exp2): ``2 u |s_ij - max_j s_ij|``. exp is accurate to a few
   ulps (attn's kernel ~1.5-2 ulp, ``attn/_src/attn_simd_impl.h``; libm and
   Sleef <= 1 ulp) and e^x may be rounded to the working dtype before P.V: a
   relative error ``EXP_ERR_U * u``, the same as that much more on the score.
   Errors already in q, k (projections, input casts) add
   ``scale * (|dq| @ |k|^T + |q| @ |dk|^T + |dq| @ |dk|^T)``, in a mask ``|dmask|``.
2. The weights then move by a rigorous (not only first-order) amount. With
   ``p'_j = p_j e^{ds_j} / Z``, ``Z = sum_l p_l e^{ds_l}``, the smaller of
   (a) ``sum_j |p'_j - p_j| <= 2 W / (1 - W)``, ``W = sum_j p_j (e^{|ds_j|} - 1)``
       (about ``2 d`` for scores all off by at most d), and
   (b) around the row's largest weight p_m: ``1 - p'_m <= R = sum_{j != m}
       p_j e^{|ds_j| + |ds_m|} / p_m`` and ``sum_j |p'_j - p_j| <= 2 (R + 1 - p_m)``
       (tight when large score errors are drowned by the gap to the top score),
   both evaluated in the log domain, so a key masked by -1e9 whose score
   error is huge but whose weight underflows adds 0. The output moves by at
   most that times ``max_j |v_je|``. A row where neither is below 1 cannot be
   pinned by any rounding analysis: sdpa_error raises (or, with strict=False,
   gives it an infinite bound).
3. The weighted sum ``sum_j e_j v_j / sum_j e_j`` over S keys: numerator and
   denominator each within gamma(S) of their terms, plus one rounding per key
   block where an online softmax rescales its running sums (<= S blocks),
   plus the final division: ``(2 gamma(2 S) + 2 u) max_j |v_je|``. Weights below
   the smallest normal may be flushed to 0 (``2 tiny`` each). Errors of v add
   ``max_j |dv_je|``. A result stored in a narrower dtype (float16 computed in
   float32) adds one rounding of the output.
4. Projections ``x @ W + b`` over n inputs: ``gamma(n + 1) (|x| @ |W| + |b|)``,
   and an input error dx adds ``|dx| @ |W|``; these feed 1-3 above, and the
   output projection takes the heads' errors from 3.
5. The backward (FlashAttention-2's formulas, :func:`sdpa_grad_error`):
   ``P = exp(s - lse)`` from the recomputed scores (item 1) and the forward's
   lse (:func:`lse_error`) moves by the factor ``e^theta``, ``theta`` the two
   bounds, the subtraction's ``u |s - lse|`` and exp's ``EXP_ERR_U u``; ``dP = dO
   V^T`` by ``gamma(Ev)`` of its terms; ``D = rowsum(dO o O)`` by that and the
   forward output's bound (item 3); ``dS = P o (dP - D)`` (times the cap's
   derivative ``1 - tanh^2``, itself off by its score's error) by the product of
   those, plus its roundings; the sums ``dV = P^T dO``, ``dQ = scale dS K``,
   ``dK = scale dS^T Q`` by ``gamma(n + 1)`` of their terms, plus the errors of
   P and dS carried through.

The "exact" values used for the magnitudes (p, |q| @ |k|^T, ...) are computed in
float64 from the same inputs; for float32 results their own error is 2**29
times smaller, and for float64 results it enters the bound at second order.
These are worst-case bounds: typical rounding errors grow like sqrt(n) u, not
n u, so a bound is often 10-1000 times the observed difference; a wrong
result (a mask, a head, a scale, a row off) is off by O(1) and still fails.
"""

import numpy as np

# exp's relative error, in units of u: attn's kernel ~1.5-2 ulp = 3-4 u (attn/_src/attn_simd_impl.h),
# libm and Sleef <= 1 ulp; plus rounding e^x to the working dtype before P.V
EXP_ERR_U = 6


def unit_roundoff(dtype):
    """u = eps / 2: 2**-11 (float16), 2**-24 (float32), 2**-53 (float64)."""
    return float(np.finfo(dtype).eps) / 2


def gamma(n, dtype):
    """Higham's gamma_n = n u / (1 - n u): a sum of n terms in any order."""
    u = unit_roundoff(dtype)
    assert n * u < 0.5, (n, dtype)
    return n * u / (1 - n * u)


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def matmul_error(x, w, b=None, dtype=np.float64, dx=None):
    """Bound on ``|fl(x @ w + b) - (x @ w + b)|`` for any summation order.

    ``dx`` is a bound on the error already in ``x`` (elementwise).
    """
    x, w = np.abs(_f64(x)), np.abs(_f64(w))
    ab = x @ w if b is None else x @ w + np.abs(_f64(b))
    err = gamma(x.shape[-1] + 1, dtype) * ab
    return err if dx is None else err + np.abs(_f64(dx)) @ w


def visible_keys(L, S, attn_mask=None, is_causal=False):
    """Bool [..., L, S]: True where a key takes part (SDPA's conventions)."""
    vis = np.ones((L, S), dtype=bool)
    if is_causal:
        offset = S - L if is_causal == "lower_right" else 0  # True / "upper_left": top-left aligned
        vis = np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    if attn_mask is not None and np.asarray(attn_mask).dtype == bool:
        vis = vis & np.asarray(attn_mask)
    elif attn_mask is not None:
        vis = vis & (np.asarray(attn_mask) > -np.inf)
    return vis


def _repeat_kv(q, kv):
    """Grouped-query attention: repeat each key/value head over its query heads (axis -3)."""
    if q.ndim >= 3 and kv.ndim >= 3 and q.shape[-3] > kv.shape[-3] > 1 and q.shape[-3] % kv.shape[-3] == 0:
        return np.repeat(kv, q.shape[-3] // kv.shape[-3], axis=-3)
    return kv


def _softmax(t, vis, ds, dtype, strict=True):
    """Softmax over the last axis of exact logits ``t`` and its rounding bounds (items 1-2 and 3's sum).

    ``ds`` bounds the logits' errors before the max is subtracted. Returns
    (p, dp_sum, any_key, weight_err): exact weights; per row a bound on
    ``sum_j |p'_j - p_j|`` (item 2); rows with a key; a bound on each computed
    weight's error (item 2 per entry, then the normalising sum and division,
    ``(gamma(2 S) + 2 u) p'_j``, then weights flushed to 0 below the smallest normal).
    A row whose weights no rounding analysis can pin (``sum_j |p'_j - p_j|`` may
    reach 1) raises, or with ``strict=False`` gets infinite bounds.
    """
    u = unit_roundoff(dtype)
    vis = vis & (t > -np.inf)  # a -inf logit is an excluded entry: e^-inf is exactly 0 everywhere
    t = np.where(vis, t, -np.inf)
    S = t.shape[-1]
    row_max = np.max(t, axis=-1, keepdims=True) if S else np.full(t.shape[:-1] + (1,), -np.inf)
    any_key = np.isfinite(row_max)
    z = np.where(vis, t - np.where(any_key, row_max, 0), 0.0)  # [..., S] logits minus the row max, <= 0
    ds = np.where(vis, ds + 2 * u * np.abs(z) + EXP_ERR_U * u, 0.0)  # the subtraction, log2(e), exp
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        logp = np.where(vis, z, -np.inf)
        logp = logp - np.log(np.sum(np.exp(logp), axis=-1, keepdims=True))
        p = np.where(vis, np.exp(logp), 0.0)
        # (a) every weight scaled by e^{ds_j} / Z: W = sum_j p_j (e^{ds_j} - 1)
        grown = np.where(vis, np.exp(np.minimum(logp + ds, 700.0)) - p, 0.0)  # p_j (e^{ds_j} - 1)
        w = np.sum(grown, axis=-1, keepdims=True)  # [..., 1]
        ok = w < 1
        dp_sum = np.where(ok, 2 * w / (1 - w), np.inf)
        per_entry = np.where(ok, (grown + p * w) / (1 - w), np.inf)
        # (b) a dominant weight p_m (m = the row max): 1 - p'_m <= R = sum_{j != m} p_j e^{ds_j + ds_m} / p_m,
        # and sum_j |p'_j - p_j| <= 2 (R + 1 - p_m): tight when far larger score errors than (a)
        # allows are drowned by a gap between the top score and the rest (e.g. float32 scores ~1e3)
        m = np.argmax(np.where(vis, t, -np.inf), axis=-1)[..., None] if S else np.zeros(t.shape[:-1] + (1,), int)
        is_m = np.arange(S) == m
        logp_m = np.take_along_axis(logp, m, -1) if S else np.zeros(m.shape)
        ds_m = np.take_along_axis(ds, m, -1) if S else np.zeros(m.shape)
        rest = np.where(vis & ~is_m, np.exp(np.minimum(logp + ds + ds_m - logp_m, 700.0)), 0.0)
        r = np.sum(rest, axis=-1, keepdims=True)
        q = np.sum(np.where(is_m, 0.0, p), axis=-1, keepdims=True)  # 1 - p_m
        dp_sum = np.minimum(dp_sum, 2 * (r + q))
        per_entry = np.minimum(per_entry, np.where(is_m, r + q, rest + p))
    hopeless = any_key & ~(dp_sum < 1)
    assert not (strict and hopeless.any()), "logits too ill-conditioned for a meaningful bound"
    dp_sum, per_entry = np.where(hopeless, np.inf, dp_sum), np.where(hopeless, np.inf, per_entry)
    weight_err = per_entry + (gamma(2 * max(S, 1), dtype) + 2 * u) * (p + per_entry)
    # exponentials below the smallest normal may be flushed to 0 or lose digits (the row sum is >= 1)
    weight_err = weight_err + np.where(vis, 2 * float(np.finfo(dtype).tiny), 0.0)
    return p, np.where(any_key, dp_sum, 0.0), any_key, np.where(any_key & vis, weight_err, 0.0)


def softmax_error(x, mask=None, axis=-1, dtype=None, out_dtype=None):
    """Bound on each weight's ``|computed - exact|`` of (masked) softmax of exact ``x`` in ``dtype``.

    ``mask`` as in :func:`attn.masked_softmax` (bool True = takes part, float added).
    Returns an array of ``x``'s shape, float64; 0 where a slice has no entry.
    """
    dtype = np.dtype(np.asarray(x).dtype if dtype is None else dtype)
    x = np.moveaxis(_f64(x), axis, -1)
    vis = np.ones(x.shape, dtype=bool)
    ds = np.zeros(x.shape)
    if mask is not None:
        m = np.moveaxis(np.broadcast_to(np.asarray(mask), np.moveaxis(x, -1, axis).shape), axis, -1)
        if m.dtype == bool:
            vis = m
        else:
            x = x + _f64(m)
            vis = m > -np.inf
            ds = unit_roundoff(dtype) * np.abs(np.where(vis, x, 0))  # the add
    p, _, _, weight_err = _softmax(x, vis, ds, dtype)
    return np.moveaxis(_stored(weight_err, p, out_dtype, dtype), -1, axis)


def _scores(q, k, attn_mask, is_causal, scale, dtype, dq=None, dk=None, dmask=None):
    """Exact scores ``t`` [..., L, S] (float mask added), bounds ``ds`` on their computed errors
    (item 1: dot product, scale, input errors, the mask's add) and the visible keys ``vis``."""
    u = unit_roundoff(dtype)
    q, k = _f64(q), _repeat_kv(_f64(q), _f64(k))
    dk = None if dk is None else _repeat_kv(q, _f64(dk))
    L, E = q.shape[-2:]
    S = k.shape[-2]
    scale = (1 / np.sqrt(E) if E else 1.0) if scale is None else scale  # E = 0: every score is 0
    akt = np.swapaxes(np.abs(k), -1, -2)  # [..., E, S]
    with np.errstate(invalid="ignore"):
        t = scale * (q @ np.swapaxes(k, -1, -2))  # [..., L, S] exact scores
        ds = gamma(E + 2, dtype) * abs(scale) * (np.abs(q) @ akt)  # dot product and scale
    if dq is not None or dk is not None:
        adq = np.zeros_like(q) if dq is None else np.abs(_f64(dq))
        adk = np.zeros_like(akt) if dk is None else np.swapaxes(np.abs(dk), -1, -2)
        ds = ds + abs(scale) * (adq @ akt + np.abs(q) @ adk + adq @ adk)
    mask = None if attn_mask is None else np.asarray(attn_mask)
    vis = np.broadcast_to(visible_keys(L, S, mask, is_causal), np.broadcast_shapes(t.shape, np.shape(mask)))
    t, ds = np.broadcast_to(t, vis.shape), np.broadcast_to(ds, vis.shape)
    if mask is not None and mask.dtype != bool:
        with np.errstate(invalid="ignore"):
            t = t + _f64(mask)
        ds = ds + u * np.abs(np.where(vis, t, 0))  # the mask add
        if dmask is not None:
            ds = ds + np.where(vis, np.abs(_f64(dmask)), 0)
    return t, ds, vis


def lse_error(q, k, *, attn_mask=None, is_causal=False, scale=None, dtype=None, dq=None, dk=None, dmask=None):
    """Bound on ``|computed - exact|`` of the log-sum-exp of the scores, ``m + log(l)``, per row.

    The log-sum-exp moves by at most the largest score error (its gradient is
    the weights, which sum to 1); the terms of ``l`` carry the subtraction of
    the row max and exp's error (``2 u |s - m| + EXP_ERR_U u``, with the score
    errors); ``l``'s sum and the online rescales ``2 gamma(2 S)`` relative,
    which the log turns into as much absolute; the log itself a few u of
    ``|log l| <= log S``; the final add ``u |lse|``. Same arguments as
    :func:`sdpa_error`; returns [..., L], 0 on rows where no key takes part.
    """
    dtype = np.dtype(np.asarray(q).dtype if dtype is None else dtype)
    u = unit_roundoff(dtype)
    t, ds, vis = _scores(q, k, attn_mask, is_causal, scale, dtype, dq, dk, dmask)
    vis = vis & (t > -np.inf)
    S = t.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        top = np.max(np.where(vis, t, -np.inf), axis=-1, keepdims=True) if S else np.full(t.shape[:-1] + (1,), -np.inf)
        any_key = np.isfinite(top[..., 0])
        z = np.where(vis, t - np.where(np.isfinite(top), top, 0), 0.0)
        worst = np.max(np.where(vis, ds + 2 * u * np.abs(z) + EXP_ERR_U * u, 0.0), axis=-1) if S else 0.0
        lse = np.log(np.sum(np.where(vis, np.exp(z), 0.0), axis=-1)) + top[..., 0]
    err = worst + 2 * gamma(2 * max(S, 1), dtype) + 4 * u * np.log(max(S, 1)) + 2 * u * np.abs(np.where(any_key, lse, 0))
    return np.where(any_key, err, 0.0)


def sdpa_error(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dtype=None, out_dtype=None,
               dq=None, dk=None, dv=None, dmask=None, return_weights=False, strict=True, enable_gqa=None):
    """Bound on ``|computed - exact|`` of SDPA computed in ``dtype``, any implementation.

    Parameters
    ----------
    q : array_like, shape [..., L, E]
    k : array_like, shape [..., S, E]
    v : array_like, shape [..., S, Ev]
        The inputs as the implementation received them (exact values; key/value
        heads are repeated for grouped-query attention).
    attn_mask, is_causal, scale, enable_gqa
        As in ``torch.nn.functional.scaled_dot_product_attention`` (bool True =
        takes part, float added); ``is_causal`` may also be "lower_right";
        key/value heads (dim -3) fewer than the query heads are always repeated.
    dtype : working precision (default: q's dtype). ``out_dtype``: the stored
        result's dtype, if narrower (e.g. float16 computed in float32).
    dq, dk, dv, dmask : array_like, optional
        Bounds on errors already in q, k, v and a float mask (e.g. a mask
        converted to the working dtype: ``u |mask|``).
    return_weights : bool
        Also return the bound on the attention weights, [..., L, S].
    strict : bool
        Raise on a row whose scores are too close, relative to their rounding
        bounds, for any bound (False: that row's bound is inf).

    Returns
    -------
    ndarray, shape [..., L, Ev], float64. 0 on rows where no key takes part.
    """
    dtype = np.dtype(np.asarray(q).dtype if dtype is None else dtype)
    u = unit_roundoff(dtype)
    v = _repeat_kv(_f64(q), _f64(v))
    dv = None if dv is None else _repeat_kv(_f64(q), _f64(dv))
    S = v.shape[-2]
    t, ds, vis = _scores(q, k, attn_mask, is_causal, scale, dtype, dq, dk, dmask)
    p, dp_sum, any_key, weight_err = _softmax(t, vis, ds, dtype, strict)
    finite_v = np.where(np.isfinite(v), np.abs(v), 0)
    vmax = np.max(finite_v, axis=-2, keepdims=True) if S else np.zeros(v.shape[:-2] + (1, v.shape[-1]))
    tiny = 2 * S * float(np.finfo(dtype).tiny)  # weights flushed to 0 below the smallest normal
    err = (dp_sum + 2 * gamma(2 * max(S, 1), dtype) + 2 * u + tiny) * vmax  # [..., L, Ev]
    if dv is not None:
        err = err + np.max(np.abs(dv), axis=-2, keepdims=True)
    if out_dtype is not None and np.dtype(out_dtype) != dtype:
        err = err * (1 + unit_roundoff(out_dtype)) + unit_roundoff(out_dtype) * vmax + float(np.finfo(out_dtype).tiny)
    err = np.where(any_key, err, 0.0)
    return (err, _stored(weight_err, p, out_dtype, dtype)) if return_weights else err


def _stored(weight_err, p, out_dtype, dtype):
    """Weights computed in ``dtype`` and stored in a narrower ``out_dtype``: one more rounding."""
    if out_dtype is None or np.dtype(out_dtype) == dtype:
        return weight_err
    u, tiny = unit_roundoff(out_dtype), float(np.finfo(out_dtype).tiny)
    return weight_err * (1 + u) + u * p + np.where(p > 0, tiny, 0.0)


def assert_within(got, ref, bound, what=""):
    """Elementwise ``|got - ref| <= bound`` (NaN where ref is NaN), with the worst ratio in the message."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"NaN pattern {what}")
    bound = np.broadcast_to(bound, got.shape)
    ok = np.isnan(ref) | (np.abs(got - ref) <= bound)
    if not ok.all():
        diff = np.abs(got - ref)
        i = np.unravel_index(np.nanargmax(np.where(ok, 0, diff / np.maximum(bound, 1e-300))), got.shape)
        raise AssertionError(f"{what}: {np.count_nonzero(~ok)} of {got.size} entries outside the rounding "
                             f"bound; worst at {i}: |{got[i]!r} - {ref[i]!r}| = {diff[i]:.3g} > {bound[i]:.3g}")


def sdpa_float64(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Plain float64 SDPA (NumPy, for the magnitudes a bound needs; 0 on rows with no key)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    L, E = q.shape[-2:]
    S = k.shape[-2]
    s = (1 / np.sqrt(E) if scale is None else scale) * (q @ np.swapaxes(k, -1, -2))  # [..., L, S]
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        s = s + _f64(attn_mask)
    s = np.where(visible_keys(L, S, attn_mask, is_causal), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True) if S else np.zeros(s.shape[:-1] + (1,))
    with np.errstate(invalid="ignore"):
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
        p = np.nan_to_num(e / np.sum(e, axis=-1, keepdims=True))
    return p @ v


def sdpa_grad_error(q, k, v, dout, *, attn_mask=None, is_causal=False, scale=None, softcap=None,
                    dtype=None, dmask=None):
    """Bounds on ``|computed - exact|`` of SDPA's gradients (dq, dk, dv) computed in ``dtype`` by
    FlashAttention-2's backward (item 5 of the module docstring), for ``dout`` = dLoss/d out.

    Parameters
    ----------
    q, k, v : array_like, shapes [..., L, E], [..., S, E], [..., S, Ev] (one key/value head per
        query head), the exact inputs; dout : [..., L, Ev].
    attn_mask, is_causal, scale : as :func:`sdpa_error` (bool True = takes part, float added);
        ``dmask`` bounds the errors of a float mask (e.g. ALiBi's bias computed in ``dtype``).
    softcap : float, optional
        Scores ``softcap tanh(s / softcap)`` before the mask (attn's ``softcap``): as the float
        mask ``cap(s) - s`` (|d cap / ds| <= 1 carries the scores' bound over), plus
        ``8 softcap u`` for the cap's own rounding (attn/_src/attn_simd_exp.h: float32 tanh
        within 2.7e-7 absolute = 4.5 u).

    Returns
    -------
    (dq_err, dk_err, dv_err) : float64 arrays of q's, k's and v's shapes.
    """
    dtype = np.dtype(np.asarray(q).dtype if dtype is None else dtype)
    u = unit_roundoff(dtype)
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    assert q.shape[:-2] == k.shape[:-2] == v.shape[:-2], "one key/value head per query head"
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    scale = (1 / np.sqrt(E) if E else 1.0) if scale is None else scale
    raw = scale * (q @ np.swapaxes(k, -1, -2))  # [..., L, S] exact scaled scores
    vis = visible_keys(L, S, attn_mask, is_causal)
    bias = 0.0 if attn_mask is None or np.asarray(attn_mask).dtype == bool else _f64(attn_mask)
    dm = 0.0 if dmask is None else np.abs(_f64(dmask))
    c1, dcap = np.ones(raw.shape), np.zeros(raw.shape)  # the cap's derivative and its error
    if softcap:
        th = np.tanh(raw / softcap)
        c1 = 1 - th * th
        bias = bias + softcap * th - raw
        dm = dm + 8 * softcap * u
        ds_raw = gamma(E + 2, dtype) * abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2))
        # the capped score's error (the cap's slope near s at most c1 + ds / cap), then t = cap(s) / cap
        # and 1 - t^2 rounded: 2 |t| dt + dt^2 + 2 u
        dt = (np.minimum(1, c1 + ds_raw / softcap) * ds_raw + 8 * softcap * u) / softcap + u * np.abs(th)
        dcap = 2 * np.abs(th) * dt + dt * dt + 2 * u
    # everything but the product as one float mask (whose add _scores counts, u |t|, even where
    # the kernel adds nothing: an overestimate)
    mask = np.where(vis, bias + np.zeros(raw.shape), -np.inf)
    dm = np.where(vis, dm + np.zeros(raw.shape), 0.0)
    t, ds, vis = _scores(q, k, mask, False, scale, dtype, dmask=dm)  # the scores and their bound
    vis = vis & (t > -np.inf)
    dlse = lse_error(q, k, attn_mask=mask, scale=scale, dtype=dtype, dmask=dm)[..., None]
    d_out = sdpa_error(q, k, v, attn_mask=mask, scale=scale, dtype=dtype, dmask=dm)  # the forward's out
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = np.max(np.where(vis, t, -np.inf), axis=-1, keepdims=True) if S else np.full(t.shape[:-1] + (1,), -np.inf)
        e = np.where(vis, np.exp(t - np.where(np.isfinite(top), top, 0)), 0.0)
        lse = top + np.log(np.sum(e, axis=-1, keepdims=True))  # exact
        z = np.where(vis, t - lse, 0.0)
        p = np.where(vis, np.exp(z), 0.0)
    theta = ds + dlse + u * (np.abs(z) + ds + dlse) + EXP_ERR_U * u
    dp_err = np.where(vis, p * np.expm1(np.minimum(theta, 700.0)), 0.0)  # P = exp(s - lse)
    out = p @ v
    dP = dout @ np.swapaxes(v, -1, -2)
    ddP = gamma(Ev, dtype) * (np.abs(dout) @ np.swapaxes(np.abs(v), -1, -2))
    D = np.sum(dout * out, axis=-1, keepdims=True)
    dD = np.sum(np.abs(dout) * d_out + gamma(Ev, dtype) * np.abs(dout) * (np.abs(out) + d_out), -1, keepdims=True)
    x = dP - D
    dx = ddP + dD + u * (np.abs(x) + ddP + dD)
    pu, xu = p + dp_err, np.abs(x) + dx
    dS = np.where(vis, p * x * c1, 0.0)
    dS_err = np.where(vis, dp_err * np.abs(x) * c1 + pu * dx * c1 + pu * xu * dcap
                      + gamma(2, dtype) * pu * xu * (c1 + dcap), 0.0)
    tr = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    dq_err = abs(scale) * (dS_err @ np.abs(k) + gamma(S + 1, dtype) * ((np.abs(dS) + dS_err) @ np.abs(k)))
    dk_err = abs(scale) * (tr(dS_err) @ np.abs(q) + gamma(L + 1, dtype) * (tr(np.abs(dS) + dS_err) @ np.abs(q)))
    dv_err = tr(dp_err + gamma(L, dtype) * (p + dp_err)) @ np.abs(dout)
    return dq_err, dk_err, dv_err


def heads_error(q, k, v, dq, dk, dv, w_o, b_o=None, *, attn_mask=None, is_causal=False, scale=None,
                dtype=np.float64, dmask=None, return_weights=False):
    """Bound for attention over projected heads, then the output projection (items 1-4).

    q, k, v : [..., n, T, d] exact projected heads; dq, dk, dv their error bounds.
    Returns the bound on ``concat(heads) @ w_o + b_o``, [..., L, d_out] (and on the
    weights, [..., n, L, S], with ``return_weights``).
    """
    h = sdpa_float64(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)  # [..., n, L, d_v]
    dh, w_err = sdpa_error(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=dtype,
                           dq=dq, dk=dk, dv=dv, dmask=dmask, return_weights=True)

    def concat(a):  # [..., n, L, d_v] -> [..., L, n * d_v]
        a = np.swapaxes(a, -2, -3)
        return a.reshape(a.shape[:-2] + (-1,))

    # |computed heads| <= |h| + dh: the output projection's rounding is taken on that
    out_err = matmul_error(np.abs(concat(h)) + concat(dh), w_o, b_o, dtype, dx=concat(dh))
    return (out_err, w_err) if return_weights else out_err


def split_heads(x, n):
    """[..., T, n * d] -> [..., n, T, d]."""
    return np.swapaxes(x.reshape(x.shape[:-1] + (n, x.shape[-1] // n)), -2, -3)


def mha_error(query, key, value, w_q, w_k, w_v, w_o, num_heads, num_kv_heads=None, *, b_q=None, b_k=None,
              b_v=None, b_o=None, attn_mask=None, is_causal=False, scale=None, dtype=np.float64,
              return_weights=False):
    """Bound on ``|computed - exact|`` of multi-head attention (x @ W weights), any implementation.

    Projections (item 4 of the module docstring), their errors carried through
    SDPA (items 1-3) per head, then the output projection of the heads with
    their errors. Shapes and the mask convention (True = takes part) as in
    :func:`attn.multi_head_attention`; returns [..., L, d_out] float64 (and the
    weights' bound [..., num_heads, L, S] with ``return_weights``).
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    parts = []
    for x, w, b, n in ((query, w_q, b_q, num_heads), (key, w_k, b_k, num_kv_heads),
                       (value, w_v, b_v, num_kv_heads)):
        x = _f64(x)
        exact = x @ _f64(w) + (0 if b is None else _f64(b))
        parts += [split_heads(exact, n), split_heads(matmul_error(x, w, b, dtype), n)]
    q, dq, k, dk, v, dv = parts
    return heads_error(q, k, v, dq, dk, dv, w_o, b_o, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                       dtype=dtype, return_weights=return_weights)


def assert_sdpa_close(out, ref, q, k, v, *, dtype=None, out_dtype=None, ref_dtype=np.float64, what="",
                      **sdpa_kwargs):
    """``out`` (computed in ``dtype``) and ``ref`` (another implementation, in ``ref_dtype``) of SDPA
    on the same exact inputs differ by at most the sum of their rounding bounds.

    ``dtype`` defaults to out's dtype (float16 is computed in float32 and stored
    in float16); ``sdpa_kwargs``: attn_mask, is_causal, scale, dq, dk, dv.
    """
    out_dtype = np.dtype(np.asarray(out).dtype if out_dtype is None else out_dtype)
    if dtype is None:
        dtype = np.float32 if out_dtype == np.float16 else out_dtype
    bound = sdpa_error(q, k, v, dtype=dtype, out_dtype=out_dtype, **sdpa_kwargs)
    bound = bound + sdpa_error(q, k, v, dtype=ref_dtype, **sdpa_kwargs)
    assert np.asarray(out).shape == np.asarray(ref).shape, (np.shape(out), np.shape(ref))
    assert_within(out, ref, bound, what)


def assert_weights_close(w, w_ref, q, k, *, dtype=None, ref_dtype=np.float64, what="", **sdpa_kwargs):
    """Attention weights ``w`` (computed in ``dtype``) and ``w_ref`` (in ``ref_dtype``) of the same
    exact q, k differ by at most the sum of their rounding bounds (``sdpa_kwargs``: attn_mask,
    is_causal, scale)."""
    out_dtype = np.dtype(np.asarray(w).dtype)
    if dtype is None:
        dtype = np.float32 if out_dtype == np.float16 else out_dtype
    v = np.zeros(np.shape(k)[:-1] + (1,))
    bound = sdpa_error(q, k, v, dtype=dtype, out_dtype=out_dtype, return_weights=True, **sdpa_kwargs)[1]
    bound = bound + sdpa_error(q, k, v, dtype=ref_dtype, return_weights=True, **sdpa_kwargs)[1]
    assert np.shape(w) == np.shape(w_ref), (np.shape(w), np.shape(w_ref))
    assert_within(w, w_ref, bound, what)


# --------------------------------------------------- int8 (q8_0) keys and values
Q8_GROUP = 32  # values per scale of q8_0 (attn._quantized)


def q8_reference_dequantize(t):
    """The values a Q8Tensor stands for, read from its bytes: [..., S, E] float64."""
    e = t.dim
    g = -(-e // Q8_GROUP)
    values = t.data[..., :e].view(np.int8).astype(np.float64)  # [..., S, E]
    scales = np.ascontiguousarray(t.data[..., e:e + 4 * g]).view(np.float32).astype(np.float64)  # [..., S, G]
    return values * np.repeat(scales, Q8_GROUP, axis=-1)[..., :e]


def q8_error(x):
    """The documented bound per value: d_g (1/2 + 127 u) + 2**-150, d_g = max |x_g| / 127 rounded up
    to a float32 (at most 2u relative or, subnormal, 2**-149 absolute more)."""
    x = np.asarray(x, np.float64)
    e = x.shape[-1]
    g = -(-e // Q8_GROUP)
    padded = np.zeros(x.shape[:-1] + (g * Q8_GROUP,))
    padded[..., :e] = np.abs(x)
    u = unit_roundoff(np.float32)
    d = padded.reshape(x.shape[:-1] + (g, Q8_GROUP)).max(-1) / 127 * (1 + 2 * u) + 2.0 ** -149  # [..., G]
    return np.repeat(d * (0.5 + 127 * u) + 2.0 ** -150, Q8_GROUP, axis=-1)[..., :e]


def q8_query_error(q):
    """|q - q'| per value of the query attn rounds to q8_0 (decode over an int8 cache on the paths
    with VNNI: attn._kernels.q8_rounds_query; attn/_src/attn_simd_q8dot.h): max |q_g| / 254 per
    group of 32 along the last axis, times 1 + 2**-13 for the float32 steps (the scale, d = max / 127,
    127 / max and the product before rounding: under 770 u relative) plus 2**-140 for subnormal d."""
    q = np.asarray(q, np.float64)
    e = q.shape[-1]
    g = -(-e // Q8_GROUP)
    padded = np.zeros(q.shape[:-1] + (g * Q8_GROUP,))
    padded[..., :e] = np.abs(q)
    amax = padded.reshape(q.shape[:-1] + (g, Q8_GROUP)).max(-1)  # [..., G]
    return np.repeat(amax / 254 * (1 + 2.0 ** -13) + 2.0 ** -140, Q8_GROUP, axis=-1)[..., :e]


def q8_reference_round_query(q, scale=None):
    """The query attn computes with where it rounds it to q8_0 (attn._kernels.q8_rounds_query;
    docs/kv_cache_int8.md), in q's units (float64): the scaled query qt = fl32(q fl32(scale)); per
    group of 32, d = fl32(max |qt_g| / 127) and qq = rint(fl32(qt fl32(127 / max))) (ties to even);
    returns d qq / scale. Written from the documented steps, not from attn's code."""
    q32 = np.asarray(q, np.float32)
    e = q32.shape[-1]
    scale = 1 / np.sqrt(e) if scale is None else scale
    qt = q32 * np.float32(scale)
    g = -(-e // Q8_GROUP)
    padded = np.zeros(q32.shape[:-1] + (g * Q8_GROUP,), np.float32)
    padded[..., :e] = qt
    groups = padded.reshape(q32.shape[:-1] + (g, Q8_GROUP))  # [..., G, 32]
    amax = np.abs(groups).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qq = np.rint(groups * inv)
    return (d.astype(np.float64) * qq).reshape(padded.shape)[..., :e] / scale

