"""8-bit (q8_0) keys and values: the quantization, the kernel reading it in place, the bound.

References are independent of attn's code: the dequantized values are
rebuilt here from the stored bytes (int8 times the float32 scale of each
group of 32), the attention reference is torch's float64 SDPA, and every
comparison is bounded by tests/_bounds.py (the float32 rounding of the
computation, plus, against the unquantized keys and values, the quantization
error of docs/kv_cache_int8.md: ``d_g (1/2 + 127 u)`` per value).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn
from attn import Q8Tensor

from _bounds import assert_within, q8_query_error, q8_reference_round_query, sdpa_error
from _bounds import q8_error as quantization_error
from _bounds import q8_reference_dequantize as reference_dequantize
from conftest import torch_sdpa64

U32 = 2.0 ** -24


def _rounds(q):
    from attn._build import _kernels

    return _kernels is not None and bool(_kernels.q8_rounds_query(q.shape[-2], q.shape[-1]))


def kernel_query(q, scale=None):
    """The query the fused kernel computes with over an int8 key: rounded to q8_0 where the current
    path rounds it (a decode call on a path with VNNI: attn._kernels.q8_rounds_query, docs/
    kv_cache_int8.md), rebuilt by tests/_bounds.py from the documented steps; else q itself."""
    return q8_reference_round_query(q, scale) if _rounds(q) else q


def query_error(q):
    """The documented bound on that rounding (an error of q for the bounds against the unquantized
    keys and values), or None where the kernel does not round."""
    return q8_query_error(q) if _rounds(q) else None

@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 128), (4, 7), (1, 33), (2, 3, 96)])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30, 1e-42])
def test_quantize_within_its_bound(rng, shape, scale):
    x = rng.standard_normal(shape) * scale
    x[..., 0] = 0  # a zero and a group's extreme value
    t = Q8Tensor.quantize(x)
    assert t.shape == shape and t.data.dtype == np.uint8
    assert np.abs(t.data[..., : shape[-1]].view(np.int8)).max() <= 127
    got = reference_dequantize(t)
    assert np.all(np.abs(got - x) <= quantization_error(x))
    # the kernel's values are float32 products q * d: within one rounding of the exact ones
    np.testing.assert_array_equal(t.dequantize(), got.astype(np.float32))


def test_quantize_zero_and_refuses_non_finite():
    t = Q8Tensor.quantize(np.zeros((2, 40)))
    assert np.all(reference_dequantize(t) == 0)
    for bad in (np.inf, np.nan):
        x = np.ones((2, 64))
        x[1, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            Q8Tensor.quantize(x)
    with pytest.raises(ValueError, match="finite"):
        Q8Tensor.quantize(np.full((1, 32), 1e300))  # its scale would overflow float32


CASES = {
    # name: (q heads, kv heads, L, S, E, mask, is_causal)
    "decode split keys": (4, 2, 1, 3000, 64, None, "lower_right"),
    "decode 4 rows E128": (8, 2, 4, 700, 128, None, "lower_right"),
    "prefill over a prefix": (4, 2, 96, 300, 64, None, "lower_right"),
    "prefill E128 bool mask": (2, 2, 130, 200, 128, "bool", False),
    "float mask": (2, 1, 40, 90, 64, "float", False),
    "odd head size E40": (2, 2, 20, 77, 40, None, True),
    "E7 decode": (2, 2, 1, 600, 7, None, False),
}


def _case(rng, name):
    hq, hkv, L, S, E, mask_kind, causal = CASES[name]
    q = rng.standard_normal((2, hq, L, E)).astype(np.float32)
    k = rng.standard_normal((2, hkv, S, E)).astype(np.float32)
    v = rng.standard_normal((2, hkv, S, E)).astype(np.float32)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((2, 1, L, S)) < 0.7
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = rng.standard_normal((L, S)).astype(np.float32)
    return q, k, v, mask, causal


def _torch(q, k, v, mask, causal, scale=None):
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)  # [B, Hkv, S, E] -> [B, Hq, S, E]
    if causal == "lower_right":
        L, S = q.shape[-2], k.shape[-2]
        return torch_sdpa64(q, k, v, attn_mask=np.tril(np.ones((L, S), bool), S - L), scale=scale)
    return torch_sdpa64(q, k, v, attn_mask=mask, is_causal=bool(causal), scale=scale)


def _bound_mask(q, k, mask, causal):
    if causal == "lower_right":
        L, S = q.shape[-2], k.shape[-2]
        return np.tril(np.ones((L, S), bool), S - L), False
    return mask, causal


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_reads_q8_in_place_on_every_simd_path(simd, rng, name):
    q, k, v, mask, causal = _case(rng, name)
    kq, vq = Q8Tensor.quantize(k), Q8Tensor.quantize(v)
    kd, vd = reference_dequantize(kq), reference_dequantize(vq)
    out = attn.scaled_dot_product_attention(q, kq, vq, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                            backend="cython")
    assert out.dtype == np.float32
    bm, bc = _bound_mask(q, kd, mask, causal)
    # against the dequantized values (and the query the kernel computes with): only float32 rounding
    qk = kernel_query(q)
    assert_within(out, _torch(qk, kd, vd, mask, causal),
                  sdpa_error(qk, kd, vd, attn_mask=bm, is_causal=bc, dtype=np.float32), f"{name} on {simd}")
    # against the keys and values before quantization: the documented bound
    assert_within(out, _torch(q, k, v, mask, causal),
                  sdpa_error(q, k, v, attn_mask=bm, is_causal=bc, dtype=np.float32, dq=query_error(q),
                             dk=quantization_error(k), dv=quantization_error(v)), f"{name} vs unquantized")


@pytest.mark.parametrize("backend", ["loop", "numpy", "online"])
@pytest.mark.parametrize("name", ["decode 4 rows E128", "prefill E128 bool mask", "odd head size E40"])
def test_every_backend_computes_with_the_dequantized_values(rng, backend, name):
    q, k, v, mask, causal = _case(rng, name)
    kq, vq = Q8Tensor.quantize(k), Q8Tensor.quantize(v)
    kd, vd = reference_dequantize(kq), reference_dequantize(vq)
    out, lse = attn.scaled_dot_product_attention(q, kq, vq, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                                 backend=backend, return_lse=True)
    bm, bc = _bound_mask(q, kd, mask, causal)
    assert_within(out, _torch(q, kd, vd, mask, causal),
                  sdpa_error(q, kd, vd, attn_mask=bm, is_causal=bc, dtype=np.float32), backend)
    assert lse.shape == q.shape[:-1] and np.isfinite(lse).all()


def test_variants_on_a_q8_cache(simd, rng):
    """Window, softcap and ALiBi run on q8_0 rows as on float ones (the same kernel tiles): against
    torch float64 with the variants written out (tests/test_variants.py's reference) over the
    dequantized values, within the float32 bound of the computation with the variants as a mask."""
    from test_variants import reference, variants_bound

    q = rng.standard_normal((1, 4, 3, 64)).astype(np.float32)
    k = rng.standard_normal((1, 4, 500, 64)).astype(np.float32)
    v = rng.standard_normal((1, 4, 500, 64)).astype(np.float32)
    kq, vq = Q8Tensor.quantize(k), Q8Tensor.quantize(v)
    kw = dict(is_causal="lower_right", window=(100, 0), softcap=20.0, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.0]))
    got = attn.scaled_dot_product_attention(q, kq, vq, **kw)
    kd, vd = reference_dequantize(kq), reference_dequantize(vq)
    qk = kernel_query(q)
    ref = reference(qk, kd, vd, **kw)["out"]
    # the kernel's values are float32 products int8 * scale: one rounding of the exact ones
    bound = variants_bound(qk, kd, vd, ref, dtype=np.float32, dq=U32 * np.abs(qk), dk=U32 * np.abs(kd),
                           dv=U32 * np.abs(vd), **kw)
    assert_within(got, ref, bound, f"variants on {simd}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_query_over_q8_cache(rng, dtype):
    import ml_dtypes  # noqa: F401  (bfloat16)

    q32, k, v, _, _ = _case(rng, "decode 4 rows E128")
    q = q32.astype(attn._dtypes.as_dtype(dtype))
    kq, vq = Q8Tensor.quantize(k), Q8Tensor.quantize(v)
    out = attn.scaled_dot_product_attention(q, kq, vq, is_causal="lower_right", enable_gqa=True)
    assert out.dtype == q.dtype
    qf = q.astype(np.float32)
    kd, vd = reference_dequantize(kq), reference_dequantize(vq)
    bm, _ = _bound_mask(qf, kd, None, "lower_right")
    qk = kernel_query(qf)
    assert_within(out.astype(np.float64), _torch(qk, kd, vd, None, "lower_right"),
                  sdpa_error(qk, kd, vd, attn_mask=bm, dtype=np.float32, out_dtype=q.dtype, dq=U32 * np.abs(qk)),
                  dtype)


def test_kv_cache_int8_appends_as_quantize_of_the_whole(rng):
    B, H, E = 2, 2, 64
    cache = attn.KVCache(B, H, max_len=40, head_dim=E, dtype="int8")
    assert cache.dtype == np.int8 and cache.k_buffer.dtype == np.uint8
    ks = [rng.standard_normal((B, H, t, E)) for t in (7, 1, 1, 12)]
    vs = [rng.standard_normal((B, H, t, E)).astype(np.float32) for t in (7, 1, 1, 12)]
    for k, v in zip(ks, vs):
        kq, vq = cache.append(k, v)
    assert isinstance(kq, Q8Tensor) and kq.shape == (B, H, 21, E) and len(cache) == 21
    assert np.shares_memory(kq.data, cache.k_buffer)
    k_all, v_all = np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)
    assert np.all(np.abs(reference_dequantize(kq) - k_all) <= quantization_error(k_all))
    assert np.all(np.abs(reference_dequantize(vq) - v_all) <= quantization_error(v_all))
    # decoding one token over the cache equals attention over its dequantized values
    q = rng.standard_normal((B, H, 1, E)).astype(np.float32)
    out = attn.scaled_dot_product_attention(q, cache.k, cache.v, is_causal="lower_right")
    kd, vd = reference_dequantize(cache.k), reference_dequantize(cache.v)
    qk = kernel_query(q)
    assert_within(out, torch_sdpa64(qk, kd, vd), sdpa_error(qk, kd, vd, dtype=np.float32, dq=U32 * np.abs(qk)),
                  "decode")
    with pytest.raises(ValueError, match="finite"):
        cache.append(np.full((B, H, 1, E), np.nan), np.zeros((B, H, 1, E)))
    assert len(cache) == 21  # nothing written


def test_multi_head_attention_through_an_int8_cache(rng):
    """Each step equals float64 multi-head attention whose keys and values are the ones the cache
    stores (rebuilt from its bytes), within the float32 bound of the projections and attention
    (tests/_bounds.py: heads_error); the first step is a prefill of 8 tokens, the second a decode."""
    from _bounds import heads_error, matmul_error, split_heads

    d, H = 64, 4
    w = [rng.standard_normal((d, d)).astype(np.float32) / 8 for _ in range(4)]
    x = rng.standard_normal((1, 9, d)).astype(np.float32)
    cache = attn.KVCache(1, H, max_len=16, head_dim=d // H, dtype="int8")
    for sl in (slice(0, 8), slice(8, 9)):
        xs = x[:, sl]
        got = attn.multi_head_attention(xs, xs, xs, *w, H, is_causal="lower_right", kv_cache=cache)
        x64 = xs.astype(np.float64)
        q = split_heads(x64 @ w[0], H)  # [1, H, L, d/H] exact projection
        dq = split_heads(matmul_error(x64, w[0], dtype=np.float32), H)
        kd, vd = reference_dequantize(cache.k), reference_dequantize(cache.v)  # [1, H, S, d/H]
        L, S = q.shape[-2], kd.shape[-2]
        causal = np.tril(np.ones((L, S), bool), S - L)
        heads = torch_sdpa64(q, kd, vd, attn_mask=causal)  # [1, H, L, d/H]
        ref = np.swapaxes(heads, 1, 2).reshape(1, L, d) @ w[3].astype(np.float64)
        bound = heads_error(q, kd, vd, dq, U32 * np.abs(kd), U32 * np.abs(vd), w[3], attn_mask=causal,
                            dtype=np.float32)
        assert_within(got, ref, bound, f"int8 cache, {L} new tokens")
    assert len(cache) == 9


def test_bad_int8_calls_are_refused(rng):
    q = rng.standard_normal((1, 2, 3, 64))
    k = Q8Tensor.quantize(rng.standard_normal((1, 2, 5, 64)))
    v = rng.standard_normal((1, 2, 5, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        attn.scaled_dot_product_attention(q, k, k)  # float64 query
    with pytest.raises(TypeError, match="both be int8"):
        attn.scaled_dot_product_attention(q.astype(np.float32), k, v)
    with pytest.raises(TypeError, match="no gradient"):
        attn.scaled_dot_product_attention_vjp(q.astype(np.float32), k, k)
    with pytest.raises(ValueError, match="same last dim"):
        attn.scaled_dot_product_attention(q[..., :32].astype(np.float32), k, k)


def test_attention_error_is_a_bound_and_not_vacuous(rng):
    """attn._quantized.attention_error (docs/kv_cache_int8.md) holds for the kernel's output over an
    int8 cache, against float64 attention over the unquantized keys and values, with the float32
    rounding on top (and the query's own rounding where the kernel rounds it); it stays well below
    what any weights could move an output."""
    from attn._quantized import attention_error

    for kscale in (0.3, 1.0):
        q = rng.standard_normal((3, 4, 64)).astype(np.float32)
        k = (rng.standard_normal((3, 500, 64)) * kscale).astype(np.float32)
        v = rng.standard_normal((3, 500, 64)).astype(np.float32)
        out = attn.scaled_dot_product_attention(q, Q8Tensor.quantize(k), Q8Tensor.quantize(v))
        bound = attention_error(q, k, v, query_rounded=query_error(q) is not None)
        kd = reference_dequantize(Q8Tensor.quantize(k))
        vd = reference_dequantize(Q8Tensor.quantize(v))
        rounding = sdpa_error(q, kd, vd, dtype=np.float32)
        assert_within(out, torch_sdpa64(q, k, v), bound + rounding, f"k scale {kscale}")
        # not vacuous: any weights keep an output within the values' range, so a bound of half that
        # range says nothing; W ~ 0.01 kscale sum|q| / sqrt(E) (about twice with the query rounded)
        half_range = (v.max(-2, keepdims=True) - v.min(-2, keepdims=True)) / 2
        assert np.all(bound < half_range / 2)


@st.composite
def q8_problems(draw):
    """Random decode/prefill shapes over an int8 cache: GQA, head sizes off the group and vector
    widths, a strided (transposed) query, causal or a bool padding mask."""
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 4))
    L, S, E = draw(st.integers(1, 70)), draw(st.integers(1, 600)), draw(st.integers(1, 140))
    seed = draw(st.integers(0, 2**32 - 1))
    transposed = draw(st.booleans())
    how = draw(st.sampled_from(["none", "lower_right", "mask"]))
    if how == "lower_right":
        L = min(L, S)  # (rows that see no key are tests/test_edges.py's)
    return hq, hkv, L, S, E, seed, transposed, how


@settings(max_examples=60, deadline=None)
@given(q8_problems())
def test_random_q8_problems_equal_float64_over_the_dequantized_values(problem):
    hq, hkv, L, S, E, seed, transposed, how = problem
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, hq, L, E)).astype(np.float32)
    if transposed:  # the same values, E outermost in memory
        q = np.ascontiguousarray(q.transpose(3, 0, 1, 2)).transpose(1, 2, 3, 0)
    k = Q8Tensor.quantize(rng.standard_normal((2, hkv, S, E)))
    v = Q8Tensor.quantize(rng.standard_normal((2, hkv, S, E)))
    mask = None
    if how == "mask":  # a padding mask: key j of sequence b is valid from b * S // 4 on
        mask = np.arange(S)[None, None, None, :] >= (np.arange(2) * S // 4)[:, None, None, None]
    causal = "lower_right" if how == "lower_right" else False
    out = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    kd, vd = reference_dequantize(k), reference_dequantize(v)
    bm = np.tril(np.ones((L, S), bool), S - L) if causal else mask
    qk = kernel_query(q)
    assert_within(out, _torch(qk, kd, vd, mask, causal),
                  sdpa_error(qk, kd, vd, attn_mask=bm, dtype=np.float32, dq=U32 * np.abs(qk)), str(problem))


def test_weights_lse_and_sinks_over_a_q8_cache(simd, rng):
    """The fused kernel's weights pass and its log-sum-exp read q8_0 rows too; sinks join the lse.
    References in float64 from the dequantized values, bounds from tests/_bounds.py."""
    from _bounds import lse_error

    q = rng.standard_normal((1, 2, 5, 64)).astype(np.float32)
    k, v = Q8Tensor.quantize(rng.standard_normal((1, 2, 300, 64))), Q8Tensor.quantize(rng.standard_normal((1, 2, 300, 64)))
    kd, vd = reference_dequantize(k), reference_dequantize(v)
    dk, dv = U32 * np.abs(kd), U32 * np.abs(vd)  # float32 products int8 * scale
    out, w, lse = attn.scaled_dot_product_attention(q, k, v, backend="cython", return_weights=True, return_lse=True)
    qk = kernel_query(q)  # (where the kernel rounds it, the query it computes with)
    s = qk.astype(np.float64) @ kd.swapaxes(-1, -2) / 8  # [1, 2, 5, 300] exact scores of the dequantized keys
    ref_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    ref_w = np.exp(s - ref_lse[..., None])
    ref_out = torch_sdpa64(qk, kd, vd)
    dq = U32 * np.abs(qk)
    out_err, w_err = sdpa_error(qk, kd, vd, dtype=np.float32, dq=dq, dk=dk, dv=dv, return_weights=True)
    dlse = lse_error(qk, kd, dtype=np.float32, dq=dq, dk=dk)
    assert_within(lse, ref_lse, dlse, "lse")
    assert_within(w, ref_w, w_err, "weights")
    assert_within(out, ref_out, out_err, "out")
    # sinks: lse' = logaddexp(lse, sink) moves by at most lse's error (its derivative is <= 1) and
    # a few roundings; out' = out * exp(lse - lse'), the scaling within a few u (|lse| + |lse'|)
    sinks = np.array([0.5, -1.0])
    out_s, lse_s = attn.scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    with_sink = np.logaddexp(ref_lse, sinks[None, :, None])
    assert_within(lse_s, with_sink, dlse + 4 * U32 * (np.abs(with_sink) + 1), "lse with sinks")
    growth = 8 + 2 * (np.abs(ref_lse) + np.abs(with_sink))  # tests/test_variants.py's variants_bound
    assert_within(out_s, ref_out * np.exp(ref_lse - with_sink)[..., None],
                  out_err + (growth * U32)[..., None] * np.abs(ref_out), "out with sinks")


def test_q8_keys_and_values_of_other_widths_and_strided_rows(simd, rng):
    """d_k != d_v (value rows sized by d_v, not d_k), and rows every other position (a strided S)."""
    q = rng.standard_normal((2, 4, 3, 40)).astype(np.float32)
    k = Q8Tensor.quantize(rng.standard_normal((2, 2, 400, 40)))
    v = Q8Tensor.quantize(rng.standard_normal((2, 2, 400, 72)))
    k2, v2 = Q8Tensor(k.data[:, :, ::2], 40), Q8Tensor(v.data[:, :, ::2], 72)  # views: S stride of two rows
    for kk, vv in ((k, v), (k2, v2)):
        out = attn.scaled_dot_product_attention(q, kk, vv, enable_gqa=True, is_causal="lower_right")
        kd, vd = reference_dequantize(kk), reference_dequantize(vv)
        assert out.shape == (2, 4, 3, 72)
        bm, _ = _bound_mask(q, kd, None, "lower_right")
        qk = kernel_query(q)
        assert_within(out, _torch(qk, kd, vd, None, "lower_right"),
                      sdpa_error(qk, kd, vd, attn_mask=bm, dtype=np.float32, dq=U32 * np.abs(qk)),
                      f"S {kk.shape[2]} on {simd}")


def test_q8tensor_is_read_only_and_the_kernel_checks_its_rows(rng):
    t = Q8Tensor.quantize(rng.standard_normal((1, 1, 4, 64)))
    with pytest.raises(AttributeError):
        t.dim = 128  # would make the kernel read 144-byte rows of 72-byte data
    with pytest.raises(ValueError, match="positive int"):
        Q8Tensor(t.data, 0)
    with pytest.raises(ValueError, match="contiguous bytes"):
        Q8Tensor(t.data[..., :40], 32)
    # the compiled layer refuses int8 rows of the wrong width (never reached from the public API)
    from attn._backends import fused

    q = np.zeros((1, 2, 64), np.float32)
    rows = np.zeros((1, 4, 64), np.int8)  # no room for the scales
    out = np.empty((1, 2, 64), np.float32)
    off = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="q8_0 rows"):
        fused._kernels.attention(q, rows, rows, None, out, None, off, off, off, off,
                                 (64, 1), (64, 1), (64, 1), (0, 0), None, 0.125, 1)


def test_float64_multi_head_attention_refuses_an_int8_cache_before_writing(rng):
    d, H = 32, 2
    w = [rng.standard_normal((d, d)) for _ in range(4)]
    x = rng.standard_normal((1, 3, d))  # float64
    cache = attn.KVCache(1, H, max_len=8, head_dim=d // H, dtype="int8")
    with pytest.raises(TypeError, match="int8 kv_cache computes in float32"):
        attn.multi_head_attention(x, x, x, *w, H, is_causal="lower_right", kv_cache=cache)
    assert len(cache) == 0


def _q8_fast_cases(rng):
    import ml_dtypes

    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    k = Q8Tensor.quantize(rng.standard_normal((2, 2, 300, 64)))
    v = Q8Tensor.quantize(rng.standard_normal((2, 2, 300, 64)))
    # the same rows with their heads outermost in memory, every other position: batch dims out of order
    heads_outer = np.ascontiguousarray(v.data.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    keep = np.arange(300)[None, None, None, :] >= np.array([0, 120])[:, None, None, None]  # [B, 1, 1, S]
    return {
        "decode GQA": (q, k, v, None, False, None),
        "float16 query": (q.astype(np.float16), k, v, None, False, None),
        "bfloat16 query": (q.astype(ml_dtypes.bfloat16), k, v, None, False, None),
        "bool padding mask": (q, k, v, keep, False, None),
        "float padding mask": (q, k, v, np.where(keep, 0.5, -np.inf).astype(np.float32), False, None),
        "4 rows lower_right, scale": (rng.standard_normal((2, 4, 4, 64)).astype(np.float32), k, v, None,
                                      "lower_right", 0.3),
        "strided S, heads outermost": (q, Q8Tensor(k.data[:, :, ::2], 64), Q8Tensor(heads_outer[:, :, ::2], 64),
                                       None, False, None),
    }


@pytest.mark.parametrize("name", ["decode GQA", "float16 query", "bfloat16 query", "bool padding mask",
                                  "float padding mask", "4 rows lower_right, scale", "strided S, heads outermost"])
def test_int8_calls_take_the_compiled_fast_path_with_the_validated_answer(rng, name):
    """An int8 cache's common call runs from compiled code (sdpa_fast), as a float16 cache's does:
    the validated path's bits, and float64 attention over the rows it reads within float32 rounding."""
    from attn._backends import fused
    from attn._validation import validate_attention

    q, k, v, mask, causal, scale = _q8_fast_cases(rng)[name]
    fast = fused.fast_forward(q, k, v, mask, 0.0, causal, scale, True, "auto", False, None)
    assert fast is not None and fast.dtype == q.dtype
    p = validate_attention(q, k, v, mask, 0.0, causal, scale, True, "cython", False, None, None)
    slow, _ = fused.forward(p)
    assert np.array_equal(fast, slow.astype(q.dtype))  # (a float16 out is rounded from the float32 one)
    qk = kernel_query(q.astype(np.float32), scale)
    kd, vd = reference_dequantize(k), reference_dequantize(v)
    bm, bc = _bound_mask(qk, kd, mask, causal)
    err = sdpa_error(qk, kd, vd, attn_mask=bm, is_causal=bc, scale=scale, dtype=np.float32, out_dtype=q.dtype,
                     dq=U32 * np.abs(qk))
    assert_within(fast, _torch(qk, kd, vd, mask, causal, scale), err, name)


@pytest.mark.parametrize("change", ["value float32", "query Q8Tensor", "query float64", "dim mismatch",
                                    "query byte-swapped"])
def test_int8_fast_path_declines_what_the_validation_refuses(rng, change):
    """Mixed or mismatched int8 calls leave the fast path (None); the validation raises."""
    from attn._backends import fused

    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    k = Q8Tensor.quantize(rng.standard_normal((1, 2, 9, 64)))
    v = k
    if change == "value float32":
        v = rng.standard_normal((1, 2, 9, 64)).astype(np.float32)
    elif change == "query Q8Tensor":
        q = Q8Tensor.quantize(q)
    elif change == "query float64":
        q = q.astype(np.float64)
    elif change == "dim mismatch":
        q = q[..., :32]
    else:
        q = q.astype(">f4")
    assert fused.fast_forward(q, k, v, None, 0.0, False, None, False, "auto", False, None) is None
    if change == "query byte-swapped":
        return
    with pytest.raises((TypeError, ValueError)):
        attn.scaled_dot_product_attention(q, k, v)
