"""The compiled kernel's internal paths, each held to torch.

Every instruction-set path this CPU can run (avx512 / avx2-fma / generic) is
switched in turn; within each: the register-tiled blocks, the dot-product
path for blocks of <= 4 query rows, the split-key decode path (<= 16 query
rows, >= 1024 keys) with its merge, masks and causal alignment there, and
the exp at the edges (-inf -> exactly 0, NaN stays in its row).
"""

import os

import numpy as np
import pytest

import attn
from attn._build import HAVE_CYTHON, _kernels

if HAVE_CYTHON:
    from attn import _kernels_testing

from _bounds import EXP_ERR_U, assert_sdpa_close, assert_within, softmax_error, unit_roundoff
from conftest import make_qkv, random_bool_mask, torch_sdpa64

pytestmark = pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")

PATHS = _kernels.simd_paths() if HAVE_CYTHON else []


def sdpa(*args, **kw):
    return attn.scaled_dot_product_attention(*args, backend="cython", **kw)


def check(out, q, k, v, dtype, **kw):
    ref = torch_sdpa64(q, k, v, **kw)
    assert out.dtype == dtype
    assert_sdpa_close(out, ref, q, k, v, **kw)


def test_available_paths():
    assert PATHS and PATHS[-1] in ("generic", "generic-scalar")
    if not os.environ.get("ATTN_SIMD"):  # ATTN_SIMD=avx2|generic caps the default
        assert attn.backends()["simd"] == PATHS[0]
    assert attn.backends()["simd"] in PATHS
    with pytest.raises(ValueError, match="not available"):
        _kernels_testing.select_simd("no-such-path")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "L,S,E,Ev",
    [(1, 7, 8, 8), (3, 200, 64, 64), (4, 129, 33, 17), (5, 300, 64, 64), (64, 64, 64, 64),
     (65, 130, 128, 128), (200, 77, 19, 40), (130, 257, 80, 72)],
)
def test_blocks_and_edges(simd, rng, dtype, L, S, E, Ev):
    q, k, v = make_qkv(rng, (2, 1), L, S, E, Ev, dtype=dtype)
    check(sdpa(q, k, v), q, k, v, dtype)
    check(sdpa(q, k, v, is_causal=True), q, k, v, dtype, is_causal=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L,S", [(1, 1024), (1, 4097), (3, 2000), (16, 1500), (17, 1100)])
def test_split_keys_decode(simd, rng, dtype, L, S):
    q, k, v = make_qkv(rng, (2, 3), L, S, 64, 48, dtype=dtype)
    out = sdpa(q, k, v)
    check(out, q, k, v, dtype)
    for n in (1, 2, 3):
        assert np.array_equal(sdpa(q, k, v, num_threads=n), out)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("S", [1100, 3000])
def test_split_keys_decode_many_heads(simd, rng, dtype, S):
    # 64 head groups: chunks of ATTN_SPLIT_KEYS (1024) keys, one to three per group, not the 256-key
    # chunks a call of few groups takes (test_split_keys_decode)
    q, k, v = make_qkv(rng, (4, 16), 1, S, 32, 16, dtype=dtype)
    out = sdpa(q, k, v)
    check(out, q, k, v, dtype)
    for n in (1, 2, 3):
        assert np.array_equal(sdpa(q, k, v, num_threads=n), out)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_split_keys_with_masks(simd, rng, dtype):
    L, S = 3, 2500
    q, k, v = make_qkv(rng, (2, 2), L, S, 32, dtype=dtype)
    allowed = random_bool_mask(rng, (2, 1, L, S))
    allowed[0, 0, 1, :] = False          # a row with nothing visible -> 0
    allowed[1, 0, 2, :] = False
    allowed[1, 0, 2, 1777] = True        # one visible key, in a late chunk
    out = sdpa(q, k, v, attn_mask=allowed)
    ref = torch_sdpa64(q, k, v, attn_mask=allowed)
    ref[0, :, 1] = 0                     # torch gives NaN for the empty row
    assert_sdpa_close(out, ref, q, k, v, attn_mask=allowed)
    assert np.all(out[0, :, 1] == 0)
    bias = np.where(allowed, rng.standard_normal(allowed.shape), -np.inf).astype(dtype)
    bias[0, 0, 1, :] = 0.5
    check(sdpa(q, k, v, attn_mask=bias), q, k, v, dtype, attn_mask=bias)
    lr = sdpa(q, k, v, is_causal="lower_right")
    allowed_lr = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    check(lr, q, k, v, dtype, attn_mask=allowed_lr)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L,S", [(2, 50), (70, 300), (2, 3000), (9, 3000)])
def test_nan_stays_in_its_row_and_inf_masks_give_zero(simd, rng, dtype, L, S):
    q, k, v = make_qkv(rng, (1, 2), L, S, 16, dtype=dtype)
    q[0, 0, L - 1, 3] = np.nan
    bias = np.zeros((L, S), dtype)
    bias[0, :] = -np.inf                 # row 0: nothing visible
    out = sdpa(q, k, v, attn_mask=bias)
    assert np.all(np.isnan(out[0, 0, L - 1]))
    assert np.all(out[0, 0, 0] == 0) and np.all(out[0, 1, 0] == 0)
    rest = np.ones(out.shape, bool)
    rest[0, 0, L - 1] = False
    assert np.all(np.isfinite(out[rest]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("S", [50, 3000])
def test_nan_query_in_masked_row_is_nan(simd, rng, dtype, S):
    # NaN + -inf is NaN (as in torch): the row is NaN on every path
    q, k, v = make_qkv(rng, (1,), 1, S, 16, dtype=dtype)
    q[0, 0, 0] = np.nan
    bias = np.full((1, S), -np.inf, dtype)
    assert np.all(np.isnan(sdpa(q, k, v, attn_mask=bias)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_exp_accuracy_through_softmax(simd, dtype):
    # Scores spread over the whole range where exp is neither 1 nor 0, with
    # -inf entries: the softmax of each row against float64 NumPy.
    x = np.linspace(-80 if dtype == np.float32 else -700, 0, 4099)
    x = np.stack([x, x[::-1] * 0.5, np.where(np.arange(x.size) % 7 == 0, -np.inf, x / 40)])
    got = attn.masked_softmax(x.astype(dtype), backend="cython")
    xs = x.astype(dtype).astype(np.longdouble)  # exact; x87 extended exp for the reference
    e = np.exp(xs - xs.max(axis=-1, keepdims=True))
    want = (e / e.sum(axis=-1, keepdims=True)).astype(np.float64)
    assert_within(got, want, softmax_error(x.astype(dtype)), "softmax")
    # exp itself: the ratio of two weights of a row cancels the normalisation,
    # leaving two exps, two roundings of p = e * (1/l) and one of the ratio
    u = unit_roundoff(dtype)
    big = want > np.finfo(dtype).tiny * 2**24     # away from subnormal results
    ratio = got.astype(np.longdouble) / got.max(axis=-1, keepdims=True)
    rel = np.abs(ratio[big] - e[big]) / e[big]
    assert rel.max() <= (2 * EXP_ERR_U + 3) * u
    assert np.all(got[2][::7] == 0)               # exp(-inf) is exactly 0
    assert np.all(got[~big] <= np.finfo(dtype).tiny * 2**25)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_exp_accuracy_through_register_tiles(simd, dtype):
    # The register tiles' online softmax (blocks of > 4 rows) has its own exp of s - m
    # (attn_simd_exp.h's vexp_shifted). Scores are exactly x (d_k = 1, q = 1, scale 1),
    # falling from the first key on, so the running max never moves (no rescale);
    # V one-hot per key, so the output is the weights themselves. Their ratios to the
    # first cancel the sum, leaving each weight's exp and a few roundings.
    n_keys = 4099
    # (past the smallest normal's log: each path flushes there by its own clamp, to 0 or a subnormal)
    x = np.linspace(0, -100 if dtype == np.float32 else -760, n_keys).astype(dtype)
    q = np.ones((6, 1), dtype)
    k = x[:, None]
    v = np.eye(n_keys, dtype=dtype)
    mask = np.ones((6, n_keys), bool)
    mask[:, 5::7] = False  # -inf scores: exactly 0
    got = sdpa(q, k, v, attn_mask=mask, scale=1.0)
    xs = x.astype(np.longdouble)
    e = np.where(mask[0], np.exp(xs - xs[0]), 0)  # x87 extended exp for the reference
    u = unit_roundoff(dtype)
    big = e > np.finfo(dtype).tiny * 2**24  # away from subnormal results
    ratio = got.astype(np.longdouble) / got[:, :1]
    rel = np.abs(ratio[:, big] - e[big]) / e[big]
    assert rel.max() <= (2 * EXP_ERR_U + 3) * u
    assert np.all(got[:, 5::7] == 0)
    assert np.all(got[:, ~big] <= np.finfo(dtype).tiny * 2**25)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("e_dim", [128, 40])
def test_large_out_streamed_rows(simd, rng, dtype, e_dim):
    # An out of >= 4 MiB is written by non-temporal stores, row by row where a row starts
    # on a cache line and fills whole ones (attn_kernel.h: ATTN_STREAM_OUT_BYTES; attn's
    # outputs start on a line; a 16-bit out's rows rounded first): a packed batch. Rows of
    # 40 float32 or 16-bit values fill no whole line (plain stores); of 40 float64, five.
    # The bits are those of the same heads in two calls whose outs are under 4 MiB.
    from attn.flash import flash_attn_varlen_func

    dt = attn._dtypes.bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    lens = [300, 77]
    n_heads = -(-(4 << 20) // (sum(lens) * e_dim * dt.itemsize))
    q, k, v = (rng.standard_normal((sum(lens), n_heads, e_dim)).astype(dt) for _ in range(3))
    cu = np.array([0, lens[0], sum(lens)], np.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert out.nbytes >= 4 << 20
    half = n_heads // 2
    parts = [flash_attn_varlen_func(q[:, h], k[:, h], v[:, h], cu, cu, max(lens), max(lens), causal=True)
             for h in (slice(0, half), slice(half, None))]
    assert max(p.nbytes for p in parts) < 4 << 20
    bits = lambda a: np.ascontiguousarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(out), bits(np.concatenate(parts, axis=1)))
    for a, b in zip(cu[:-1], cu[1:]):
        tr = lambda x: np.swapaxes(x[a:b], 0, 1)  # noqa: E731  [H, L, E]
        if dtype in ("float64", "float32"):
            ref = torch_sdpa64(tr(q), tr(k), tr(v), is_causal=True)
            assert_sdpa_close(tr(out), ref, tr(q), tr(k), tr(v), is_causal=True)
            continue
        # float64 on the same values: float32's bound with the out stored in 16 bits, plus (bfloat16)
        # P's rounding to bfloat16 before P.V where the path multiplies bfloat16 pairs (2^-9 of P @ |V|)
        from _bounds import assert_within
        from test_flash import seq_bound, seq_reference

        ref = seq_reference(q[a:b], k[a:b], v[a:b], causal=True)["out"]   # [L, H, E]
        if dtype == "float16":
            assert out.dtype == np.float16
            assert_within(out[a:b], ref, seq_bound(q[a:b], k[a:b], v[a:b], ref, dtype=dt, causal=True),
                          f"sequence of {b - a} rows on {simd}")
            continue
        t = (tr(q).astype(np.float64) @ np.swapaxes(tr(k).astype(np.float64), 1, 2)) * e_dim ** -0.5
        t[:, np.triu(np.ones((b - a, b - a), bool), 1)] = -np.inf
        p = np.exp(t - t.max(-1, keepdims=True))
        p_rounding = np.swapaxes((p / p.sum(-1, keepdims=True)) @ np.abs(tr(v).astype(np.float64)), 0, 1) * 2.0 ** -9
        bound = seq_bound(q[a:b], k[a:b], v[a:b], ref, dtype=dt, causal=True) + p_rounding
        assert_within(out[a:b], ref, bound, f"sequence of {b - a} rows on {simd}")


def _float16_edges():
    """float32 values about float16's edges: every float16 (NaN and inf included), the halfway points
    between neighbours (ties: to the even one) and the float32 values either side of them, over the
    normal and subnormal ranges, the overflow edge 65520 (the tie that goes to inf) and the underflow
    edge 2^-25 (the tie that goes to 0)."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)   # every float16
    finite = np.sort(np.unique(np.abs(h[np.isfinite(h)])))
    mid = (finite[:-1].astype(np.float64) + finite[1:]) / 2                      # exact in float32
    mid = mid.astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(0)), mid, np.nextafter(mid, np.float32(np.inf))])
    edges = np.array([65504, 65519.996, 65520, 65520.004, 1e6, 2.0 ** -25, 2.0 ** -25 * 1.0000001,
                      2.0 ** -26, 1e-30, 2.0 ** -24 * 1.5, 2.0 ** -14 * (1 - 2.0 ** -11)], np.float32)
    x = np.concatenate([h, near, edges])
    return np.concatenate([x, -x])


def test_float16_rounding_is_ieee(rng):
    """The kernels' portable float32 -> float16 rounding (attn_narrow16: the generic path's out and the
    split keys' merge) gives numpy's bits for every finite value and inf, to nearest even, over
    float16's edges (_float16_edges) and a million random float32 bit patterns; a NaN stays a NaN with
    its sign. Where the CPU has F16C, every bit (NaN payloads included) is its vcvtps2ph's (attn._casts'
    cast_f16, the x86 paths' conversion)."""
    x = np.concatenate([_float16_edges(), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32).view(np.float32)])
    got = _kernels_testing.narrow_f16(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan].view(np.uint16))
    assert np.isnan(got[nan].view(np.float16)).all()
    np.testing.assert_array_equal(got[nan] >> 15, (x[nan].view(np.uint32) >> 31).astype(np.uint16))
    from attn._build import _casts

    hardware = _casts.cast_f16(x, np.float16, 1) if _casts is not None else None
    if hardware is not None:
        np.testing.assert_array_equal(got, hardware.view(np.uint16))


def test_float16_out_rounded_once_as_numpy_rounds(simd, rng):
    """A float16 call's out is rounded once from float32 as the kernel writes each row (F16C's
    instruction on the x86 paths, the portable rounding on the generic one): two keys of equal scores
    make each output the float32 sum of two float16 values halved, every float16 (inf and NaN
    included) beside a random partner. The out is numpy's float16 of that float32 value, bit for bit
    (a NaN a NaN), through the register tiles (33 query rows), the decode rows (1) and the packed
    varlen plan (flash_attn_varlen_func)."""
    from attn.flash import flash_attn_varlen_func

    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    v = np.stack([h, rng.permutation(h)], axis=1).reshape(512, 64, 2, 2).transpose(0, 2, 1, 3)
    v = v.reshape(512, 2, 128)   # [N, S = 2, Ev]: each output element's two values
    with np.errstate(invalid="ignore", over="ignore"):
        want = ((v[:, 0].astype(np.float32) + v[:, 1].astype(np.float32)) * np.float32(0.5)).astype(np.float16)
    k = np.zeros((512, 2, 16), np.float16)
    for rows in (33, 1):
        q = np.zeros((512, rows, 16), np.float16)
        with np.errstate(invalid="ignore"):
            out = sdpa(q, k, v)
        assert out.dtype == np.float16
        for r in range(rows):
            np.testing.assert_array_equal(out[:, r], want, f"row {r} of {rows} on {simd}")
    cu = np.arange(0, 2 * 512 + 1, 2, dtype=np.int32)   # 512 sequences of one row over 2 keys, as [total, H=1, E]
    with np.errstate(invalid="ignore"):
        out = flash_attn_varlen_func(np.zeros((512, 1, 16), np.float16), k.reshape(1024, 1, 16),
                                     v.reshape(1024, 1, 128), cu // 2, cu, 1, 2)
    np.testing.assert_array_equal(out[:, 0], want, f"packed on {simd}")


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_strided_key_rows(simd, rng, dtype, is_causal):
    """K and V rows H_kv E elements apart (a [B, S, H_kv, E] array viewed as [B, H_kv, S, E], as
    transformers and flash_attn_func pass them): a prefill over more keys than a key tile reads each
    tile from its thread's copy of the keys (attn._kernels' _pack_rows; a debug build's copy holds
    fewer keys than the call has, so it starts afresh mid-call): within the rounding bound of torch's
    float64 result, and bit for bit the result over the same keys stored contiguously, on 1 and 2
    threads."""
    dt = attn._dtypes.bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    B, H, H_kv, S, E = 1, 4, 2, 1100, 64   # (more keys than AMX's 512-key tiles)
    q = rng.standard_normal((B, S, H, E)).astype(dt).transpose(0, 2, 1, 3)       # [B, H, S, E] views
    k, v = (rng.standard_normal((B, S, H_kv, E)).astype(dt).transpose(0, 2, 1, 3) for _ in range(2))
    outs = [sdpa(q, k, v, is_causal=is_causal, enable_gqa=True, num_threads=t) for t in (1, 2)]
    contiguous = sdpa(q, np.ascontiguousarray(k), np.ascontiguousarray(v), is_causal=is_causal, enable_gqa=True)
    bits = lambda a: np.ascontiguousarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(outs[0]), bits(outs[1]))
    np.testing.assert_array_equal(bits(outs[0]), bits(contiguous))
    kr, vr = np.repeat(k, H // H_kv, axis=1), np.repeat(v, H // H_kv, axis=1)
    ref = torch_sdpa64(q, kr, vr, is_causal=is_causal)
    if dtype == "float64":   # return_weights: the weights pass reads the rows in place, not a thread's copy
        _, w = sdpa(q, k, v, is_causal=is_causal, enable_gqa=True, return_weights=True)
        s = q @ np.swapaxes(kr, -1, -2) / np.sqrt(E)
        if is_causal:
            s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(w, p / p.sum(-1, keepdims=True), rtol=1e-9, atol=1e-12)
    if dtype != "bfloat16":
        assert_sdpa_close(outs[0], ref, q, kr, vr, is_causal=is_causal)
        return
    import torch   # bfloat16: test_bfloat16's rule, at most 1.5 times torch bfloat16's error
    from test_bfloat16 import as_torch_bf16, assert_rule, err

    theirs = torch.nn.functional.scaled_dot_product_attention(*(as_torch_bf16(x) for x in (q, kr, vr)),
                                                              is_causal=is_causal)
    assert_rule(err(outs[0], ref), err(theirs, ref), "out")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ["per_row", "shared_row"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_tiles(simd, rng, dtype, layout, kind):
    """Masks are transposed tile by tile (per_row) or read as one value per key
    (shared_row: a [1, S] key padding mask broadcast over the queries)."""
    L, S = 130, 200  # several row blocks and key tiles; 130 rows leave padding lanes
    shape = (L, S) if layout == "per_row" else (1, S)
    q, k, v = make_qkv(rng, (2, 2), L, S, 24, dtype=dtype)
    if kind == "bool":
        mask = random_bool_mask(rng, shape)
    else:
        mask = (3 * rng.standard_normal(shape)).astype(dtype)
        mask[..., 1::5] = -np.inf  # masked keys; key 0 stays finite in every row
    check(sdpa(q, k, v, attn_mask=mask), q, k, v, dtype, attn_mask=mask)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ["per_row", "shared_row"])
def test_nan_key_excluded_by_bool_mask_takes_no_part(simd, rng, dtype, layout):
    """A key a bool mask excludes takes no part, even with a NaN score: the
    result equals attention over the other keys. (torch 2.13 adds -inf to the
    NaN score and returns NaN rows here; attn's three backends all give this.)"""
    L, S, bad = 70, 150, 97
    q, k, v = make_qkv(rng, (2,), L, S, 16, dtype=dtype)
    k[0, bad, 3] = np.nan
    mask = np.ones((L, S) if layout == "per_row" else (1, S), bool)
    mask[:, bad] = False
    out = sdpa(q, k, v, attn_mask=mask)
    keep = np.arange(S) != bad
    ref = torch_sdpa64(q, k[:, keep], v[:, keep])
    assert out.dtype == dtype
    assert_sdpa_close(out, ref, q, k[:, keep], v[:, keep])
    for backend in ("numpy", "loop"):
        other = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        assert_sdpa_close(other, ref, q, k[:, keep], v[:, keep], what=backend)
