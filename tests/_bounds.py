"""Rounding-error bounds for comparing attention results across implementations.

Two implementations of the same formula (attn's backends, torch, NumPy's BLAS,
each SIMD path, any thread count) round differently: they sum in different
orders, use different ``exp`` approximations, rescale partial sums at different
block boundaries. A fixed tolerance that passed on one CPU fails on another.
So every cross-implementation comparison here is bounded by what the
computation itself guarantees, for ANY summation order, and two results are
compared with the sum of their bounds: ``|a - b| <= err_a + err_b``.

The reasoning (u = unit roundoff of the working dtype, 2**-24 for float32,
2**-53 for float64; gamma(n) = n u / (1 - n u), Higham's bound for a sum or
dot product of n terms in any order: ``|fl(sum x_i) - sum x_i| <= gamma(n) sum |x_i|``):

1. Scores ``s_ij = scale * q_i . k_j (+ mask_ij)``. The dot product, the
   scale (some libraries multiply q and k by sqrt(scale) each) and the mask
   add give ``|ds_ij| <= gamma(d_k + 3) * scale * (|q| @ |k|^T)_ij``. Softmax
   then subtracts the row max (and may multiply by log2(e) for an exp2): a
   further ``3 u (|s_ij| + |max_j s_ij|)``. exp itself is accurate to a few
   ulps (attn's kernel: ~1.5-2 ulp, see ``attn/_src/attn_simd_impl.h``; libm
   and Sleef <= 1 ulp) and the exponentials may be rounded to the working
   dtype before P.V: a relative error ``EXP_ULPS * u``, the same as an extra
   ``EXP_ULPS * u`` on the score. Errors of q, k (projections, input casts)
   add ``scale * (|dq| @ |k|^T + |q| @ |dk|^T + |dq| @ |dk|^T)``.
2. Softmax moves by a rigorous (not only first-order) amount: if every score
   of a row moves by at most ``ds_j``, then ``p'_j = p_j e^{ds_j} / Z`` with
   ``Z = sum_l p_l e^{ds_l}``, and ``sum_j |p'_j - p_j| <= 2 W / (1 - W)``,
   ``W = sum_j p_j (e^{|ds_j|} - 1)``. (Summed in the log domain, so a key
   masked by -1e9 whose score error is huge but whose weight underflows adds 0.)
   The output moves by at most that times ``max_j |v_je|``. For a row whose
   scores are all off by at most d this is ``~2 d max|v|``.
3. The weighted sum ``sum_j e_j v_j / sum_j e_j`` over S keys: numerator and
   denominator each within gamma(S) of their terms, plus one rounding per key
   block where an online softmax rescales its running sums (<= S blocks),
   plus the final division: ``(2 gamma(2 S) + 2 u) max_j |v_je|``. Errors of
   v add ``max_j |dv_je|``. A result stored in a narrower dtype adds one
   rounding of the output.
4. Projections ``x @ W + b`` over n inputs: ``gamma(n + 1) (|x| @ |W| + |b|)``,
   and an input error dx adds ``|dx| @ |W|``; these feed 1-3 above.

Float64 "exact" values below are computed in float64 from the same inputs;
their own error is 2**29 times smaller than float32's, and for float64 results
the error of the reference weights only enters the bound at second order.
"""

import numpy as np

EXP_ULPS = 4  # exp's relative error in ulps, plus rounding exp to the working dtype


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
    if q.ndim >= 3 and kv.ndim >= 3 and kv.shape[-3] != q.shape[-3] and kv.shape[-3] != 1:
        return np.repeat(kv, q.shape[-3] // kv.shape[-3], axis=-3)
    return kv


def sdpa_error(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dtype=None, out_dtype=None,
               dq=None, dk=None, dv=None):
    """Bound on ``|computed - exact|`` of SDPA computed in ``dtype``, any implementation.

    Parameters
    ----------
    q : array_like, shape [..., L, E]
    k : array_like, shape [..., S, E]
    v : array_like, shape [..., S, Ev]
        The inputs as the implementation received them (exact values; key/value
        heads are repeated for grouped-query attention).
    attn_mask, is_causal, scale
        As in ``torch.nn.functional.scaled_dot_product_attention`` (bool True =
        takes part, float added); ``is_causal`` may also be "lower_right".
    dtype : working precision (default: q's dtype). ``out_dtype``: the stored
        result's dtype, if narrower (e.g. float16 computed in float32).
    dq, dk, dv : array_like, optional
        Bounds on errors already in q, k, v (same shapes).

    Returns
    -------
    ndarray, shape [..., L, Ev], float64. 0 on rows where no key takes part.
    """
    dtype = np.dtype(np.asarray(q).dtype if dtype is None else dtype)
    u = unit_roundoff(dtype)
    q, k, v = _f64(q), _f64(k), _f64(v)
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    dk, dv = (None if d is None else _repeat_kv(q, _f64(d)) for d in (dk, dv))
    L, E = q.shape[-2:]
    S = k.shape[-2]
    scale = 1 / np.sqrt(E) if scale is None else scale
    kt, akt = np.swapaxes(k, -1, -2), np.swapaxes(np.abs(k), -1, -2)  # [..., E, S]
    mag = abs(scale) * (np.abs(q) @ akt)  # [..., L, S] scale * |q| @ |k|^T
    s = scale * (q @ kt)  # [..., L, S]
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None and mask.dtype != bool:
        mask = _f64(mask)
        s = s + mask
        mag = mag + np.abs(np.where(np.isfinite(mask), mask, 0))
    vis = np.broadcast_to(visible_keys(L, S, attn_mask, is_causal), s.shape)
    s = np.where(vis, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)  # [..., L, 1]
    any_key = np.isfinite(row_max)
    row_max = np.where(any_key, row_max, 0.0)
    ds = gamma(E + 3, dtype) * mag + 3 * u * (np.abs(np.where(vis, s, 0)) + np.abs(row_max)) + EXP_ULPS * u
    if dq is not None or dk is not None:
        adq = 0 if dq is None else np.abs(_f64(dq))
        adk = 0 if dk is None else np.swapaxes(np.abs(dk), -1, -2)
        ds = ds + abs(scale) * ((adq @ akt if dq is not None else 0) + (np.abs(q) @ adk if dk is not None else 0)
                                + (adq @ adk if dq is not None and dk is not None else 0))
    # W = sum_j p_j (e^{|ds_j|} - 1), with log p_j the exact log-softmax (log domain: no overflow)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        z = s - row_max
        logp = z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))
        grown = np.where(vis, np.exp(np.minimum(logp + ds, 700.0)) - np.exp(logp), 0.0)
    w = np.sum(grown, axis=-1, keepdims=True)  # [..., L, 1]
    assert np.all(w[any_key] < 0.5), "scores too ill-conditioned for a meaningful bound"
    weights = 2 * w / (1 - w)
    vmax = np.max(np.abs(v), axis=-2, keepdims=True) if S else np.zeros(v.shape[:-2] + (1, v.shape[-1]))
    err = (weights + 2 * gamma(2 * max(S, 1), dtype) + 2 * u) * vmax  # [..., L, Ev]
    if dv is not None:
        err = err + np.max(np.abs(dv), axis=-2, keepdims=True)
    if out_dtype is not None and np.dtype(out_dtype) != dtype:
        err = err * (1 + unit_roundoff(out_dtype)) + unit_roundoff(out_dtype) * vmax
    return np.where(any_key, err, 0.0)


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


def mha_error(query, key, value, w_q, w_k, w_v, w_o, num_heads, num_kv_heads=None, *, b_q=None, b_k=None,
              b_v=None, b_o=None, attn_mask=None, is_causal=False, scale=None, dtype=np.float64):
    """Bound on ``|computed - exact|`` of multi-head attention (x @ W weights), any implementation.

    Projections (item 4 of the module docstring), their errors carried through
    SDPA (items 1-3) per head, then the output projection of the heads with
    their errors. Shapes as in :func:`attn.multi_head_attention`; returns
    [..., L, d_out] float64.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    xq, xk, xv = _f64(query), _f64(key), _f64(value)

    def heads(x, n):  # [..., T, n * d] -> [..., n, T, d]
        return np.swapaxes(x.reshape(x.shape[:-1] + (n, x.shape[-1] // n)), -2, -3)

    proj = [(heads(x @ _f64(w) + (0 if b is None else _f64(b)), n), heads(matmul_error(x, w, b, dtype), n))
            for x, w, b, n in ((xq, w_q, b_q, num_heads), (xk, w_k, b_k, num_kv_heads),
                               (xv, w_v, b_v, num_kv_heads))]
    (q, dq), (k, dk), (v, dv) = proj
    mask = None if attn_mask is None else np.asarray(attn_mask)
    h = sdpa_float64(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)  # [..., n, L, d_v]
    dh = sdpa_error(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, dtype=dtype, dq=dq, dk=dk, dv=dv)

    def concat(a):  # [..., n, L, d_v] -> [..., L, n * d_v]
        a = np.swapaxes(a, -2, -3)
        return a.reshape(a.shape[:-2] + (-1,))

    # |computed heads| <= |h| + dh: the output projection's rounding is taken on that
    return matmul_error(np.abs(concat(h)) + concat(dh), w_o, b_o, dtype, dx=concat(dh))
