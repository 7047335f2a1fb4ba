"""float8 keys and values (e4m3fn, e5m2): widened exactly in the kernel, descaled, appended.

References are independent of attn's code: every stored byte's value is
ml_dtypes' (float64), the attention reference is torch's float64 SDPA over
those values times the descales, and every comparison is bounded by
tests/_bounds.py (the float32 rounding of the computation, plus one rounding
each for the descales folded into the query or the scale and into the output).
"""

import numpy as np
import pytest

import attn.flash as F

from _bounds import assert_within, sdpa_error
from conftest import torch_sdpa64

ml_dtypes = pytest.importorskip("ml_dtypes")


def _paths():
    """The SIMD paths this CPU has, and where it has AVX512_VBMI (whose byte tables widen an e4m3
    cache on the avx512-bf16 and avx512-amx paths) those paths again with the shifts that the
    CPUs without it take ("<path> shifts")."""
    import attn

    if not attn.backends()["cython"]:
        return []
    from attn import _kernels, _kernels_testing

    paths = list(_kernels.simd_paths())
    previous = _kernels_testing.select_vbmi(True)
    if previous is None:
        return paths
    _kernels_testing.select_vbmi(previous)
    return paths + [f"{p} shifts" for p in paths if p in ("avx512-bf16", "avx512-amx")]


@pytest.fixture(params=_paths())
def simd(request):
    """Each SIMD path this CPU has (conftest's fixture), and each e4m3 widening of a path."""
    from attn import _kernels_testing

    path, _, widening = request.param.partition(" ")
    previous_path = _kernels_testing.select_simd(path)
    previous_vbmi = _kernels_testing.select_vbmi(widening != "shifts")
    yield request.param
    _kernels_testing.select_simd(previous_path)
    if previous_vbmi is not None:
        _kernels_testing.select_vbmi(previous_vbmi)
U32 = 2.0 ** -24
FORMATS = ["float8_e4m3fn", "float8_e5m2"]


def f8(name):
    return np.dtype(getattr(ml_dtypes, name))


def all_bytes(name):
    """The 256 bytes of a format as its dtype, and their exact values (float64; NaN, inf as they are)."""
    b = np.arange(256, dtype=np.uint8).view(f8(name))
    return b, b.astype(np.float64)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("plan", ["decode", "tiles"])
def test_every_byte_widens_to_its_value(simd, name, plan):
    """One key: out is that key's value row exactly (its weight is 1), and with a one-hot query at
    scale 1 the lse is the key's element exactly; every byte of the format, NaN included."""
    b, exact = all_bytes(name)
    finite = np.isfinite(exact)
    E = 256
    if plan == "decode":   # 64 K/V heads of 4 query heads: the dot-product decode path (<= 4 rows)
        q = np.zeros((1, 1, 256, E), np.float32)
        q[0, 0, np.arange(256), np.arange(256)] = 1
        k = np.broadcast_to(np.where(finite, b, b[0]), (1, 1, 64, E)).copy()   # [B, S=1, H_kv, E]
    else:                  # 256 query rows of one head: the register-tile path
        q = np.zeros((1, 256, 1, E), np.float32)
        q[0, np.arange(256), 0, np.arange(256)] = 1
        k = np.where(finite, b, b[0]).reshape(1, 1, 1, E)
    v = np.broadcast_to(b, k.shape).copy()
    out, lse = F.flash_attn_with_kvcache(q, k, v, softmax_scale=1.0, return_softmax_lse=True)
    rows = out.reshape(-1, E)
    np.testing.assert_array_equal(rows, np.broadcast_to(exact.astype(np.float32), rows.shape))
    np.testing.assert_array_equal(lse.reshape(-1), np.where(finite, exact, exact[0]).astype(np.float32))


@pytest.mark.parametrize("name", FORMATS)
def test_nan_key_gives_nan_row(simd, name):
    """A NaN byte in a key (e4m3fn's 0x7f, e5m2's 0x7e) is NaN, not a finite number: its rows are NaN."""
    rng = np.random.default_rng(7)
    k = rng.standard_normal((1, 50, 2, 64)).astype(f8(name))
    v = rng.standard_normal((1, 50, 2, 64)).astype(f8(name))
    k.view(np.uint8)[0, 17, 1, 5] = 0x7F if name == "float8_e4m3fn" else 0x7E
    q = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
    out = F.flash_attn_with_kvcache(q, k, v)
    assert np.isnan(out[0, 0, 2:]).all() and np.isfinite(out[0, 0, :2]).all()


CASES = {
    # name: (B, L, H, H_kv, E, S, page or None)
    "decode split keys": (2, 1, 8, 2, 64, 3000, None),
    "decode E128 paged 16": (3, 1, 8, 2, 128, 416, 16),
    "speculative rows paged 32": (2, 3, 4, 1, 64, 640, 32),
    "prefill over a prefix": (2, 96, 4, 2, 64, 300, None),
    "prefill E80 paged 128": (2, 130, 2, 2, 80, 256, 128),
}


def _paged(x, page, rng):
    """[B, S, H_kv, E] as pages [B * S / page, page, H_kv, E] in a shuffled pool, and the block table."""
    B, S = x.shape[:2]
    n = B * S // page
    perm = rng.permutation(n)
    pool = np.empty((n, page) + x.shape[2:], x.dtype)
    pool[perm] = x.reshape((n, page) + x.shape[2:])
    return pool, perm.reshape(B, -1).astype(np.int32)


def _reference(q, k64, v64, scale=None):
    """torch float64 SDPA, bottom-right causal, over [B, L, H, E] q and [B, S, H_kv, E] keys/values."""
    L, S, g = q.shape[1], k64.shape[1], q.shape[2] // k64.shape[2]
    qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (q, np.repeat(k64, g, 2), np.repeat(v64, g, 2)))
    mask = np.tril(np.ones((L, S), bool), S - L)
    return np.swapaxes(torch_sdpa64(qt, kt, vt, attn_mask=mask, scale=scale), 1, 2), mask


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("descale", ["scalar", "per head"])
def test_cache_attention_within_float32_bound(simd, rng, name, case, descale):
    B, L, H, Hkv, E, S, page = CASES[case]
    q = rng.standard_normal((B, L, H, E)).astype(np.float32)
    k = (3 * rng.standard_normal((B, S, Hkv, E))).astype(f8(name))
    v = (3 * rng.standard_normal((B, S, Hkv, E))).astype(f8(name))
    if descale == "scalar":
        kd, vd = 0.37, 1.9
        kd_bh, vd_bh = np.full((B, Hkv), kd), np.full((B, Hkv), vd)
    else:
        kd_bh, vd_bh = rng.uniform(0.1, 3.0, (B, Hkv)), rng.uniform(0.1, 3.0, (B, Hkv))
        kd, vd = kd_bh, vd_bh
    k64 = k.astype(np.float64) * kd_bh[:, None, :, None]
    v64 = v.astype(np.float64) * vd_bh[:, None, :, None]
    if page:
        kp, table = _paged(k, page, rng)
        vp = np.empty_like(kp)
        vp[table.reshape(-1)] = v.reshape(kp.shape)
        out = F.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=np.full(B, S), block_table=table, causal=True,
                                        k_descale=kd, v_descale=vd)
    else:
        out = F.flash_attn_with_kvcache(q, k, v, causal=True, k_descale=kd, v_descale=vd)
    ref, mask = _reference(q, k64, v64)
    g = H // Hkv
    qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (q, np.repeat(k64, g, 2), np.repeat(v64, g, 2)))
    # float32 arithmetic, plus the descales: one rounding in q (or the scale) and one in the output
    bound = sdpa_error(qt, kt, vt, attn_mask=mask, dtype=np.float32, dq=U32 * np.abs(qt), dv=U32 * np.abs(vt))
    assert_within(out, ref, np.swapaxes(bound, 1, 2), f"{name} {case} {descale} on {simd}")


@pytest.mark.parametrize("name", FORMATS)
def test_varlen_packed_and_paged_agree_with_the_reference(rng, name):
    """flash_attn_varlen_func over a float8 k, v: packed (no block_table) and paged, each sequence against
    torch float64 over its own dequantized keys."""
    lens_q, lens_k = [1, 37, 5], [300, 64, 129]
    H, Hkv, E, page = 4, 2, 64, 16
    q = rng.standard_normal((sum(lens_q), H, E)).astype(np.float32)
    k = (2 * rng.standard_normal((sum(lens_k), Hkv, E))).astype(f8(name))
    v = (2 * rng.standard_normal((sum(lens_k), Hkv, E))).astype(f8(name))
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    packed = F.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      k_descale=0.5, v_descale=4.0)
    n_pages = [-(-n // page) for n in lens_k]
    kp = np.zeros((sum(n_pages) + 2, page, Hkv, E), k.dtype)
    vp = np.zeros_like(kp)
    table = np.zeros((3, max(n_pages)), np.int32)
    perm, at = rng.permutation(len(kp)), 0
    for s, n in enumerate(lens_k):
        table[s, : n_pages[s]] = perm[at:at + n_pages[s]]
        at += n_pages[s]
        for j in range(n):
            kp[table[s, j // page], j % page] = k[cu_k[s] + j]
            vp[table[s, j // page], j % page] = v[cu_k[s] + j]
    paged = F.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                     block_table=table, k_descale=0.5, v_descale=4.0)
    np.testing.assert_array_equal(paged, packed)   # the same sums: pages read in place keep the bits
    for s in range(3):
        qs = q[cu_q[s]:cu_q[s + 1]][None]
        k64 = k[cu_k[s]:cu_k[s + 1]].astype(np.float64)[None] * 0.5
        v64 = v[cu_k[s]:cu_k[s + 1]].astype(np.float64)[None] * 4.0
        ref, mask = _reference(qs, k64, v64)
        g = H // Hkv
        qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (qs, np.repeat(k64, g, 2), np.repeat(v64, g, 2)))
        bound = sdpa_error(qt, kt, vt, attn_mask=mask, dtype=np.float32, dq=U32 * np.abs(qt), dv=U32 * np.abs(vt))
        assert_within(packed[cu_q[s]:cu_q[s + 1]][None], ref, np.swapaxes(bound, 1, 2), f"{name} sequence {s}")


@pytest.mark.parametrize("name", FORMATS)
def test_append_stores_rounded_saturated_values(rng, name):
    """New k, v (float32) go into a float8 cache divided by the descale, saturated to the largest
    finite value (e4m3fn has no infinity: 448) and rounded to nearest even, as ml_dtypes rounds;
    the call then attends to them."""
    top = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[name]
    B, S, Hkv, E = 2, 40, 2, 32
    kc = np.zeros((B, S, Hkv, E), f8(name))
    vc = np.zeros_like(kc)
    new_k = (50 * rng.standard_normal((B, 3, Hkv, E))).astype(np.float32)
    new_k[0, 0, 0, :4] = [1e6, -1e6, top * 1.01, np.nan]
    new_v = rng.standard_normal((B, 3, Hkv, E)).astype(np.float32)
    q = rng.standard_normal((B, 3, 4, E)).astype(np.float32)
    seqlens = np.array([10, 0])
    kd = np.array([[0.25, 2.0], [1.0, 0.5]])
    F.flash_attn_with_kvcache(q, kc, vc, new_k, new_v, cache_seqlens=seqlens, causal=True, k_descale=kd, v_descale=0.1)
    for b in range(B):
        rows = slice(seqlens[b], seqlens[b] + 3)
        expect = np.clip(new_k[b] / kd[b][None, :, None], -top, top).astype(f8(name))
        np.testing.assert_array_equal(kc[b, rows].view(np.uint8), expect.view(np.uint8))
        np.testing.assert_array_equal(vc[b, rows].view(np.uint8),
                                      np.clip(new_v[b] / 0.1, -top, top).astype(f8(name)).view(np.uint8))
    assert kc[0, 10, 0, 0].astype(np.float64) == top and kc[0, 10, 0, 1].astype(np.float64) == -top


def test_torch_float8_tensors_read_in_place(rng):
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 100, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, 100, 2, 64)).astype(np.float32)
    for name in FORMATS:
        kt, vt = (torch.from_numpy(x).to(getattr(torch, name)) for x in (k, v))
        got = F.flash_attn_with_kvcache(torch.from_numpy(q), kt, vt, k_descale=torch.tensor(0.5))
        # the same bytes as ml_dtypes' arrays (torch and ml_dtypes round alike), the same result
        kn, vn = (t.view(torch.uint8).numpy().view(f8(name)) for t in (kt, vt))
        np.testing.assert_array_equal(got.numpy(), F.flash_attn_with_kvcache(q, kn, vn, k_descale=0.5))


def test_errors_name_the_argument(rng):
    q = rng.standard_normal((1, 1, 4, 64)).astype(np.float32)
    k8 = rng.standard_normal((1, 20, 2, 64)).astype(f8("float8_e4m3fn"))
    kf = rng.standard_normal((1, 20, 2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="k_descale applies to a float8 cache"):
        F.flash_attn_with_kvcache(q, kf, kf, k_descale=0.5)
    with pytest.raises(ValueError, match=r"v_descale must broadcast to \[batch, nheads_k\] = \[1, 2\]"):
        F.flash_attn_with_kvcache(q, k8, k8, v_descale=np.ones(3))
    with pytest.raises(ValueError, match="k_descale must be finite and > 0"):
        F.flash_attn_with_kvcache(q, k8, k8, k_descale=np.nan)
    with pytest.raises(TypeError, match="float8"):
        F.flash_attn_with_kvcache(q, k8, k8.astype(f8("float8_e5m2")))
    with pytest.raises(TypeError, match="float8"):
        F.flash_attn_with_kvcache(q.astype(np.float64), k8, k8)


def test_dense_api_refuses_float8_naming_the_cache_functions(rng):
    import attn

    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(f8("float8_e4m3fn"))
    with pytest.raises(TypeError, match="key is float8.*flash_attn_with_kvcache"):
        attn.scaled_dot_product_attention(q, k, k)


@pytest.mark.parametrize("L, d_k, d_v", [(1, 64, 64), (1, 64, 128), (1, 64, 96), (3, 128, 64), (70, 64, 128),
                                        (130, 80, 72)])
def test_bfloat16_query_over_e4m3(simd, rng, L, d_k, d_v):
    """A bfloat16 query over an e4m3fn cache (a 16-bit model over vLLM's fp8 cache). With AVX512_VBMI and
    AVX512_BF16 the products are bfloat16 pairs over the tables' bfloat16 keys and values: the decode rows
    (<= 4 query rows a K/V head; attn_simd_e4m3dot.h; E and Ev multiples of 64, else the float32 P.V or
    scores) and the register tiles of longer blocks (attn_simd_bf16dot.h over K and V packs looked up
    as bfloat16; an Ev of 72 has 8 columns past the last vector). Q.K^T exact and summed in float32, P
    rounded to bfloat16 before P.V. Pages of 5 and 16 keys (pairs across pages), a contiguous cache, 1 and
    2 threads: the same bits; odd lengths pair their last key with zeros. Each sequence within float32's
    rounding bound of float64 on the same values, stored in bfloat16, plus P's rounding (2^-9 of P @ |V|)."""
    import attn
    from test_flash import seq_bound, seq_reference, to_pages

    bf16 = np.dtype(ml_dtypes.bfloat16)
    H, H_kv = 8, 2
    lengths = [333, L, 65 + L, 1200]
    B, S = len(lengths), max(lengths)
    q = rng.standard_normal((B, L, H, d_k)).astype(bf16)
    kc = (3 * rng.standard_normal((B, S, H_kv, d_k))).astype(f8("float8_e4m3fn"))
    vc = (3 * rng.standard_normal((B, S, H_kv, d_v))).astype(f8("float8_e4m3fn"))
    seqlens = np.array(lengths, np.int32)
    results = []
    for threads in (1, 2):
        attn.set_num_threads(threads)
        try:
            results.append(F.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True))
            for page in (5, 16):
                kp, vp, table = to_pages(page, np.random.default_rng(page), [kc[b, :n] for b, n in enumerate(lengths)],
                                         [vc[b, :n] for b, n in enumerate(lengths)])
                results.append(F.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                         causal=True))
        finally:
            attn.set_num_threads(None)
    assert results[0].dtype == bf16
    for r in results[1:]:
        np.testing.assert_array_equal(r.view(np.uint16), results[0].view(np.uint16))
    out = results[0]
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b], kc[b, :n].astype(np.float64), vc[b, :n].astype(np.float64)   # [L, H, E], [n, H_kv, E]
        ref = seq_reference(qb, kb, vb, causal=True)["out"]   # float64 on the same values
        kh = np.repeat(np.swapaxes(kb, 0, 1), H // H_kv, axis=0)   # [H, n, E]
        vh = np.repeat(np.swapaxes(vb, 0, 1), H // H_kv, axis=0)
        t = (np.swapaxes(qb.astype(np.float64), 0, 1) @ np.swapaxes(kh, 1, 2)) * d_k ** -0.5   # [H, L, n]
        t = np.where(np.tril(np.ones((L, n), bool), n - L), t, -np.inf)   # bottom-right causal
        p = np.exp(t - t.max(-1, keepdims=True))
        p_rounding = np.swapaxes((p / p.sum(-1, keepdims=True)) @ np.abs(vh), 0, 1) * 2.0 ** -9   # [L, H, Ev]
        bound = seq_bound(qb, kb, vb, ref, dtype=bf16, causal=True) + p_rounding
        assert_within(out[b], ref, bound, f"sequence {b} ({n} keys), L {L}, d_k {d_k}, d_v {d_v} on {simd}")


def test_backends_says_which_e4m3_widening_runs(simd):
    """attn.backends()["e4m3_tables"]: the byte tables run on the avx512-bf16 and avx512-amx paths of a CPU
    whose flags (/proc/cpuinfo, not attn's probe) have AVX512_VBMI, unless the tests' switch turned them off."""
    import attn

    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags line")
    path, _, widening = simd.partition(" ")
    expected = "avx512vbmi" in flags and path in ("avx512-bf16", "avx512-amx") and widening != "shifts"
    assert attn.backends()["e4m3_tables"] is expected


@pytest.mark.parametrize("L", [1, 70])
def test_bfloat16_query_over_e4m3_with_per_head_descale(simd, rng, L):
    """A per-head k_descale multiplies a bfloat16 query's rows by it (a float32 copy: attn._paged.apply_descale),
    after which the query holds no bfloat16 values: the kernel must not read it as bfloat16 pairs. Against
    torch float64 over the real keys and values, within float32's bound (one rounding more in the query
    for its descale and one in the output for v_descale, as test_cache_attention_within_float32_bound),
    the output stored in bfloat16, plus P's rounding to bfloat16 (2^-9 of P @ |V|)."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    B, H, H_kv, E, S = 2, 8, 2, 64, 300
    q = rng.standard_normal((B, L, H, E)).astype(bf16)
    k = (3 * rng.standard_normal((B, S, H_kv, E))).astype(f8("float8_e4m3fn"))
    v = (3 * rng.standard_normal((B, S, H_kv, E))).astype(f8("float8_e4m3fn"))
    kd, vd = rng.uniform(0.1, 3.0, (B, H_kv)), rng.uniform(0.1, 3.0, (B, H_kv))
    out = F.flash_attn_with_kvcache(q, k, v, causal=True, k_descale=kd, v_descale=vd)
    assert out.dtype == bf16
    k64 = k.astype(np.float64) * kd[:, None, :, None]
    v64 = v.astype(np.float64) * vd[:, None, :, None]
    q64 = q.astype(np.float64)
    ref, mask = _reference(q64, k64, v64)
    g = H // H_kv
    qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (q64, np.repeat(k64, g, 2), np.repeat(v64, g, 2)))
    bound = sdpa_error(qt, kt, vt, attn_mask=mask, dtype=np.float32, out_dtype=bf16, dq=U32 * np.abs(qt),
                       dv=U32 * np.abs(vt))
    t = np.where(mask, qt @ np.swapaxes(kt, -1, -2) * E ** -0.5, -np.inf)   # [B, H, L, S]
    p = np.exp(t - t.max(-1, keepdims=True))
    p_rounding = (p / p.sum(-1, keepdims=True)) @ np.abs(vt) * 2.0 ** -9
    assert_within(out, ref, np.swapaxes(bound + p_rounding, 1, 2), f"L {L} on {simd}")
