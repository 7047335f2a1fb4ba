"""Decode: query heads sharing a K/V head computed together, split keys, float16
caches read in place, and the per-call fast path; each held to torch in float64.

On every instruction-set path: GQA/MQA/MHA ratios, one and several query
rows, causal alignments, a key padding mask shared by the heads (grouped) and
a per-head mask (not grouped), keys split into chunks and merged; bitwise
thread-count invariance; float16 keys/values widened in the kernel without a
conversion copy; the fast path gives the same bits as the validated path and
declines every call it does not handle.
"""

import tracemalloc

import numpy as np
import pytest

import attn
from attn._build import HAVE_CYTHON, _kernels
from attn._backends import fused
from attn._validation import validate_attention

from _bounds import assert_sdpa_close, assert_weights_close
from conftest import torch_sdpa64, torch_weights

pytestmark = pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")



def qkv(rng, B, Hq, Hkv, L, S, E, dtype=np.float32, kv_dtype=None):
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(kv_dtype)
    v = rng.standard_normal((B, Hkv, S, E)).astype(kv_dtype)
    return q, k, v


def reference(q, k, v, **kw):
    """torch in float64 on exactly the values the kernel reads."""
    return torch_sdpa64(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


def sdpa(q, k, v, **kw):
    return attn.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1],
                                             backend="cython", **kw)


@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (32, 8), (12, 12), (8, 1)])
@pytest.mark.parametrize("L,S", [(1, 64), (1, 300), (1, 1030), (3, 700), (16, 600)])
def test_grouped_decode_matches_torch(simd, rng, Hq, Hkv, L, S):
    q, k, v = qkv(rng, 2, Hq, Hkv, L, S, 64)
    ref = reference(q, k, v)
    out = sdpa(q, k, v)
    assert out.dtype == np.float32
    assert_sdpa_close(out, ref, q, k, v)
    for n in (1, 2, 3):
        assert np.array_equal(sdpa(q, k, v, num_threads=n), out)


@pytest.mark.parametrize("causal", [True, "lower_right"])
@pytest.mark.parametrize("L,S", [(1, 50), (1, 900), (4, 900)])
def test_grouped_decode_causal(simd, rng, causal, L, S):
    q, k, v = qkv(rng, 1, 8, 2, L, S, 32)
    out = sdpa(q, k, v, is_causal=causal)
    offset = 0 if causal is True else S - L
    allowed = np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    assert_sdpa_close(out, reference(q, k, v, attn_mask=allowed), q, k, v, attn_mask=allowed)
    for n in (1, 2):
        assert np.array_equal(sdpa(q, k, v, is_causal=causal, num_threads=n), out)


@pytest.mark.parametrize("S", [70, 1500])
def test_padding_mask_shared_by_heads_and_per_head_mask(simd, rng, S):
    q, k, v = qkv(rng, 2, 6, 2, 1, S, 16)
    pad = np.ones((2, 1, 1, S), bool)
    pad[0, ..., S // 3:] = False                  # sequence 0 is shorter
    out = sdpa(q, k, v, attn_mask=pad)            # one mask row for all heads: grouped
    assert_sdpa_close(out, reference(q, k, v, attn_mask=pad), q, k, v, attn_mask=pad)
    per_head = rng.random((2, 6, 1, S)) < 0.6      # differs per head: one head at a time
    per_head[..., 0] = True
    out = sdpa(q, k, v, attn_mask=per_head)
    assert_sdpa_close(out, reference(q, k, v, attn_mask=per_head), q, k, v, attn_mask=per_head)
    bias = np.where(pad, 0.25, -np.inf).astype(np.float32)
    assert_sdpa_close(sdpa(q, k, v, attn_mask=bias), reference(q, k, v, attn_mask=bias), q, k, v, attn_mask=bias)


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("Hq,Hkv,L,S,E", [(9, 3, 1, 64, 64), (32, 8, 1, 2100, 64), (4, 4, 7, 300, 40),
                                          (2, 1, 70, 200, 24)])
def test_float16_cache_widened_in_kernel(simd, rng, q_dtype, Hq, Hkv, L, S, E):
    q, k, v = qkv(rng, 1, Hq, Hkv, L, S, E, dtype=q_dtype, kv_dtype=np.float16)
    ref = reference(q, k, v)
    out = sdpa(q, k, v)
    assert out.dtype == q_dtype
    if q_dtype == np.float32:
        # float32 arithmetic on the exact float16 values
        assert_sdpa_close(out, ref, q, k, v)
    else:
        # computed in float32 (the same as a float32 query), rounded once to float16
        out32 = sdpa(q.astype(np.float32), k, v)
        assert np.array_equal(out, out32.astype(np.float16))
    for n in (1, 2):
        assert np.array_equal(sdpa(q, k, v, num_threads=n), out)


def test_float16_strided_cache_and_causal(simd, rng):
    """A KVCache prefix (strided view) and lower-right causal, in float16."""
    cache = attn.KVCache(1, 2, max_len=1200, head_dim=32, dtype=np.float16)
    k_new = rng.standard_normal((1, 2, 1100, 32)).astype(np.float16)
    v_new = rng.standard_normal((1, 2, 1100, 32)).astype(np.float16)
    k, v = cache.append(k_new, v_new)
    assert k.dtype == np.float16 and not k.flags.c_contiguous
    q = rng.standard_normal((1, 6, 2, 32)).astype(np.float32)
    out = attn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", enable_gqa=True)
    S = 1100
    allowed = np.arange(S)[None, :] <= np.arange(2)[:, None] + S - 2
    assert_sdpa_close(out, reference(q, k, v, attn_mask=allowed), q, k, v, attn_mask=allowed)


def test_float16_cache_is_not_converted(rng):
    """No whole-array conversion: the call allocates far less than the float32 K."""
    q, k, v = qkv(rng, 1, 8, 2, 1, 1 << 16, 64, kv_dtype=np.float16)   # K: 16 MiB in float16
    sdpa(q, k, v)
    tracemalloc.start()
    try:
        sdpa(q, k, v)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < k.nbytes // 8, peak


@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("case", ["bool_rows", "float_rows", "causal", "lower_right", "v_columns",
                                  "k_columns", "float16", "float64"])
def test_few_query_rows(simd, rng, L, case):
    """Blocks of <= 4 query rows keep S row-major (the decode layout): per-row
    masks and causal horizons, strided K or V columns, d_k and d_v that are not
    a multiple of the vector (24), float16 and float64, weights too."""
    S = 150
    dtype = np.float64 if case == "float64" else np.float32
    q, k, v = qkv(rng, 2, 3, 3, L, S, 24, dtype=dtype, kv_dtype=np.float16 if case == "float16" else dtype)
    mask, kw = None, {}
    if case == "bool_rows":
        mask = rng.random((2, 3, L, S)) < 0.5
        mask[..., 0, :] = False            # one row sees no key: output 0, weights 0
    elif case == "float_rows":
        mask = rng.standard_normal((2, 3, L, S)).astype(dtype)
        mask[..., -1, 7:40] = -np.inf
    elif case in ("causal", "lower_right"):
        kw["is_causal"] = True if case == "causal" else "lower_right"
        offset = 0 if case == "causal" else S - L
        mask = np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    elif case == "v_columns":
        v = np.swapaxes(np.swapaxes(v, -1, -2).copy(), -1, -2)   # column-major V matrices
    elif case == "k_columns":
        k = np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2)
    call_mask = mask if "rows" in case else None
    out, w = sdpa(q, k, v, attn_mask=call_mask, return_weights=True, **kw)
    out_plain = sdpa(q, k, v, attn_mask=call_mask, **kw)      # split keys, no weights pass
    ref = reference(q, k, v, attn_mask=mask)
    for got in (out, out_plain):
        assert_sdpa_close(got, ref, q, k, v, attn_mask=mask)
    w_ref = torch_weights(q.astype(np.float64), k.astype(np.float64),
                          attn_mask=None if mask is None else (mask if mask.dtype == bool else mask.astype(np.float64)))
    assert_weights_close(w, w_ref, q, k, attn_mask=mask)
    if case == "bool_rows":
        assert not out[..., 0, :].any() and not w[..., 0, :].any()
    for n in (1, 2, 3):
        assert np.array_equal(sdpa(q, k, v, attn_mask=call_mask, num_threads=n, **kw), out_plain)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(is_causal="lower_right"),
                                dict(scale=0.3), dict(num_threads=1)])
@pytest.mark.parametrize("layout", ["contiguous", "cache_prefix", "gqa", "float64", "float16_kv",
                                    "transposed_inner"])
def test_fast_path_same_bits_as_validated_path(rng, kw, layout):
    if layout == "gqa":
        q, k, v = qkv(rng, 2, 8, 2, 3, 90, 16)
    elif layout == "cache_prefix":
        q, k, v = qkv(rng, 2, 4, 4, 1, 128, 16)
        k, v = k[:, :, :77], v[:, :, :77]
    elif layout == "float64":
        q, k, v = qkv(rng, 1, 3, 3, 5, 40, 8, dtype=np.float64)
    elif layout == "float16_kv":
        q, k, v = qkv(rng, 1, 4, 2, 2, 600, 16, kv_dtype=np.float16)
    elif layout == "transposed_inner":
        q, k, v = qkv(rng, 2, 3, 3, 6, 20, 16)
        k = np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2)   # column-major matrices
    else:
        q, k, v = qkv(rng, 2, 3, 3, 6, 20, 16)
    gqa = q.shape[1] != k.shape[1]
    fast = fused.fast_forward(q, k, v, None, 0.0, kw.get("is_causal", False), kw.get("scale"), gqa,
                              "auto", False, kw.get("num_threads"))
    assert fast is not None
    p = validate_attention(q, k, v, None, 0.0, kw.get("is_causal", False), kw.get("scale"), gqa,
                           "cython", False, None, kw.get("num_threads"))
    slow, _ = fused.forward(p)
    assert fast.dtype == slow.dtype and np.array_equal(fast, slow)
    mask = None
    if "is_causal" in kw:
        L, S = q.shape[-2], k.shape[-2]
        mask = np.arange(S)[None, :] <= np.arange(L)[:, None] + (0 if kw["is_causal"] is True else S - L)
    ref = reference(q, k, v, attn_mask=mask, scale=kw.get("scale"))
    assert_sdpa_close(fast, ref, q, k, v, attn_mask=mask, scale=kw.get("scale"))


def _padding_masks(rng, B, H, S, dtype):
    keep = rng.random((B, 1, 1, S)) < 0.7
    keep[0, ..., :] = False                                    # sequence 0: nothing visible
    bias = np.where(rng.random((1, H, 1, S)) < 0.8, rng.standard_normal((1, H, 1, S)), -np.inf).astype(dtype)
    strided = np.ones((B, H, 1, 2 * S), bool)[..., ::2]
    strided[-1, :, :, : S // 2] = False
    return {"bool [B,1,1,S]": keep, "float [1,H,1,S]": bias, "bool [S]": keep[-1, 0, 0],
            "bool strided keys": strided, "bool [H,1,S]": keep[-1].repeat(H, 0)}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_path_padding_masks_same_bits_as_validated_path(rng, gqa, dtype):
    """A padding mask broadcast over the query rows takes the fast path; the bits
    are those of the validated path, and the output is torch's."""
    B, Hq, S = 3, 4, 300
    q, k, v = qkv(rng, B, Hq, 2 if gqa else Hq, 1, S, 16, dtype=dtype)
    for name, mask in _padding_masks(rng, B, Hq, S, dtype).items():
        fast = fused.fast_forward(q, k, v, mask, 0.0, False, None, gqa, "auto", False, None)
        assert fast is not None, name
        p = validate_attention(q, k, v, mask, 0.0, False, None, gqa, "cython", False, None, None)
        slow, _ = fused.forward(p)
        assert np.array_equal(fast, slow), name
        full = np.broadcast_to(mask, (B, Hq, 1, S))   # (torch wants a mask of 2+ dims)
        assert_sdpa_close(fast, reference(q, k, v, attn_mask=full), q, k, v, attn_mask=full, what=name)
        for n in (1, 2):
            assert np.array_equal(sdpa(q, k, v, attn_mask=mask, num_threads=n), fast), name


Q, K, V = qkv(np.random.default_rng(1), 1, 2, 2, 3, 10, 8)


@pytest.mark.parametrize("change", [
    dict(attn_mask=np.ones((3, 10), bool)), dict(attn_mask=np.ones((1, 10), np.float16)),
    dict(attn_mask=np.ones((1, 10), np.float64)), dict(attn_mask=np.ones((1, 10), np.int8)),
    dict(attn_mask=np.ones((1, 10), bool), is_causal=True), dict(attn_mask=np.ones((3, 1, 1, 10), bool)),
    dict(attn_mask=np.ones((1, 1, 1, 1, 10), bool)), dict(attn_mask=np.ones((1, 11), bool)),
    dict(attn_mask=[[True] * 10]), dict(attn_mask=np.ones((1, 10), ">f4")), dict(dropout_p=0.1), dict(return_weights=True),
    dict(backend="numpy"), dict(query=Q.tolist()), dict(query=Q.astype(">f4")),
    dict(key=K.astype(np.float64)), dict(query=Q[..., :4]), dict(query=Q[:, :, :0]),
    dict(key=np.broadcast_to(K[:, :1], (1, 4, 10, 8)), value=np.broadcast_to(V[:, :1], (1, 4, 10, 8))),
    dict(dropout_p=np.float32(0)), dict(return_weights=0),
])
def test_fast_path_declines_all_but_the_common_case(change):
    """Every call it does not recognize goes through the full validation (which raises on bad input)."""
    args = dict(query=Q, key=K, value=V, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, backend="auto", return_weights=False, num_threads=None)
    assert fused.fast_forward(**args) is not None
    args.update(change)
    assert fused.fast_forward(**args) is None


@pytest.mark.parametrize("change", [
    dict(enable_gqa=1), dict(is_causal="upper-left"), dict(is_causal=np.bool_(True)),
    dict(is_causal="lower_right"), dict(scale=2), dict(scale=np.inf), dict(scale="2"),
    dict(num_threads=0), dict(num_threads=np.int64(2)), dict(num_threads=2.0),
])
def test_fast_path_decides_as_the_validation(change):
    """What the fast path takes, it decides with the validation's own function
    (attn._validation.decide_shapes_and_options): the same answer, bit for bit,
    as the validated path, or the same error."""
    args = dict(query=Q, key=K, value=V, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, backend="auto", return_weights=False, num_threads=None)
    args.update(change)
    try:
        p = validate_attention(
            args["query"], args["key"], args["value"], None, 0.0, args["is_causal"], args["scale"],
            args["enable_gqa"], "cython", False, None, args["num_threads"])
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)) as raised:
            fused.fast_forward(**args)
        assert str(raised.value) == str(exc)
        return
    slow, _ = fused.forward(p)
    fast = fused.fast_forward(**args)
    assert fast is not None
    assert np.array_equal(fast, slow)
