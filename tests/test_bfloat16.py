"""bfloat16 end to end, held to torch's bfloat16 and to float64.

bfloat16 (``ml_dtypes.bfloat16``; torch bfloat16 tensors are read as it) is
computed in float32 and rounded once on output (on the avx512-bf16 path, a
bfloat16 query's register tiles multiply bfloat16 pairs and round P to
bfloat16 before P.V, as torch's bfloat16 SDPA does). The rule, for outputs and
gradients: against a float64 reference on the same (bfloat16) inputs, attn's
largest error is at most 1.5 times that of torch's own bfloat16 computation of
the same case. A float32 query over a bfloat16 cache is computed in float32 on
exactly the widened values, so it is held to float32's rounding bound.
"""

import numpy as np
import pytest
import torch

import attn
from attn._build import BF16_PRODUCT_PATHS, HAVE_CYTHON

from _bounds import assert_sdpa_close
from conftest import BACKENDS

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
RULE = 1.5


def bf16(rng, shape):
    return rng.standard_normal(shape).astype(BF16)


def f64(a):
    return torch.from_numpy(np.asarray(a).astype(np.float64))


def as_torch_bf16(a):
    return torch.from_numpy(np.ascontiguousarray(a).astype(np.float32)).to(torch.bfloat16)


def err(got, ref):
    got = got.double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got).astype(np.float64)
    ref = ref.double().numpy() if isinstance(ref, torch.Tensor) else ref
    return float(np.abs(got - ref).max()) if got.size else 0.0


def assert_rule(ours, torchs, what):
    """attn's error at most RULE times torch bfloat16's (both against float64)."""
    assert ours <= RULE * torchs + 1e-30, f"{what}: attn error {ours:.3g} > {RULE} x torch bfloat16's {torchs:.3g}"


def torch_sdpa_grads(q, k, v, g, dtype, mask=None, **kw):
    """torch's output and gradients computed in ``dtype`` (on the same bfloat16 values)."""
    conv = (lambda a: f64(a)) if dtype == torch.float64 else as_torch_bf16
    tq, tk, tv = (conv(a).requires_grad_() for a in (q, k, v))
    tm = None
    if mask is not None:
        tm = torch.from_numpy(mask) if mask.dtype == bool else conv(mask)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
    out.backward(conv(g))
    return out.detach(), tq.grad, tk.grad, tv.grad


def in_pages(page, kc, vc, lengths):
    """Sequence b's first lengths[b] K and V rows of kc, vc [B, S, H_kv, E] in shuffled pages of ``page``
    keys: the K pool, the V pool, the block table (test_flash.to_pages)."""
    from test_flash import to_pages

    return to_pages(page, np.random.default_rng(page), [kc[b, :n] for b, n in enumerate(lengths)],
                    [vc[b, :n] for b, n in enumerate(lengths)])


def lower_right(L, S):
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)


CASES = {  # name: (B, Hq, Hkv, L, S, E, mask kind)
    "dense E64": (2, 4, 4, 33, 70, 64, None),
    "causal E128": (1, 4, 4, 40, 40, 128, "causal"),
    "lower-right E64": (1, 2, 2, 9, 50, 64, "lower_right"),
    "GQA bool mask E256": (1, 8, 2, 17, 45, 256, "bool"),
    "float mask E64": (2, 2, 2, 12, 30, 64, "float"),
    "decode GQA E64": (2, 9, 3, 1, 300, 64, None),
    "odd sizes E63": (1, 2, 2, 37, 61, 63, "causal"),  # odd pairs: head size, keys of a block
    # AMX tiles (avx512-amx): a 512-key tile and a ragged last one, d_k padded to
    # whole tile rows (80 -> 96), an odd count of 16-column blocks, 16-row blocks of queries
    "long keys E80": (1, 2, 2, 70, 601, 80, "causal"),
    "bool mask E48": (1, 2, 1, 50, 301, 48, "bool"),
    # K's rows read as A tiles in place (d_k a multiple of 32), the last tile's
    # 76 keys: 64 in place, 12 copied and padded
    "K rows in place E64": (1, 2, 2, 40, 1100, 64, None),
}


def _case(name, rng):
    B, Hq, Hkv, L, S, E, kind = CASES[name]
    q, k, v = bf16(rng, (B, Hq, L, E)), bf16(rng, (B, Hkv, S, E)), bf16(rng, (B, Hkv, S, E))
    kw, tkw, mask = dict(enable_gqa=Hq != Hkv), dict(enable_gqa=Hq != Hkv), None
    if kind == "causal":
        kw["is_causal"] = tkw["is_causal"] = True
    elif kind == "lower_right":
        kw["is_causal"] = "lower_right"
        mask = lower_right(L, S)   # torch's reference takes the explicit mask
    elif kind == "bool":
        mask = rng.random((B, 1, L, S)) < 0.8
        kw["attn_mask"] = mask
    elif kind == "float":
        mask = bf16(rng, (1, Hq, L, S))
        kw["attn_mask"] = mask
    return q, k, v, kw, tkw, mask


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_within_torch_bfloat16_error(name, backend, rng):
    q, k, v, kw, tkw, mask = _case(name, rng)
    g = bf16(rng, q.shape[:-1] + v.shape[-1:])
    ref = torch_sdpa_grads(q, k, v, g, torch.float64, mask=mask, **tkw)
    tb = torch_sdpa_grads(q, k, v, g, torch.bfloat16, mask=mask, **tkw)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend=backend, **kw)
    grads = backward(g)
    assert out.dtype == BF16 and all(x.dtype == BF16 for x in grads)
    for what, ours, r, t in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads), ref, tb):
        assert_rule(err(ours, r), err(t, r), f"{name} {backend} {what}")
    plain = attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    assert_rule(err(plain, ref[0]), err(tb[0], ref[0]), f"{name} {backend} forward")


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
@pytest.mark.parametrize("name", list(CASES))
def test_every_simd_path(simd, name, rng):
    q, k, v, kw, tkw, mask = _case(name, rng)
    g = bf16(rng, q.shape[:-1] + v.shape[-1:])
    ref = torch_sdpa_grads(q, k, v, g, torch.float64, mask=mask, **tkw)
    tb = torch_sdpa_grads(q, k, v, g, torch.bfloat16, mask=mask, **tkw)
    out = attn.scaled_dot_product_attention(q, k, v, backend="cython", **kw)
    assert_rule(err(out, ref[0]), err(tb[0], ref[0]), f"{name} on {simd}")
    # the backward: on avx512-bf16 and avx512-amx its five products take
    # bfloat16 pairs (P and dS rounded, as torch's), float32 products elsewhere
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython", **kw)
    for what, ours, r, t in zip(("dq", "dk", "dv"), backward(g), ref[1:], tb[1:]):
        assert_rule(err(ours, r), err(t, r), f"{name} on {simd}: {what}")


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
@pytest.mark.parametrize("scale", [0.05, -0.3])
@pytest.mark.parametrize("d_v", [64, 40])
def test_prefill_tiles_scale_and_value_width(simd, scale, d_v, rng):
    """A bfloat16 prefill block on the register tiles: its softmax applies the scale where
    nothing reads S in between and the scale is positive (the row max commutes with it), the
    products apply it otherwise (a negative scale: the max of the unscaled scores would be the
    scaled minimum); P is kept in float32 as well where V has columns past the last 16."""
    q, k, v = bf16(rng, (1, 3, 70, 64)), bf16(rng, (1, 3, 90, 64)), bf16(rng, (1, 3, 90, d_v))

    def formula(dtype):   # (torch's SDPA takes sqrt(scale): NaN for a negative one)
        conv = f64 if dtype == torch.float64 else as_torch_bf16
        s = conv(q) @ conv(k).transpose(-1, -2) * scale                      # [1, 3, 70, 90]
        s = s.masked_fill(~torch.from_numpy(lower_right(70, 90)), float("-inf"))
        return torch.softmax(s, dim=-1) @ conv(v)

    ref, tb = formula(torch.float64), formula(torch.bfloat16)
    out = attn.scaled_dot_product_attention(q, k, v, backend="cython", is_causal="lower_right", scale=scale)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_rule(err(out, ref), err(tb, ref), f"scale {scale} d_v {d_v} on {simd}")


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 96), (6, 2, 48)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_bfloat16_query_scores_within_float32_bound(simd, heads, paged, rng):
    """A bfloat16 query over a bfloat16 cache, decode (a few rows per K/V head): the scores are exact
    products summed in float32 on every path (the avx512-bf16 and avx512-amx paths' vdpbf16ps pairs
    where d_k is a multiple of 32, widened float32 FMAs elsewhere), so each row's log-sum-exp is held
    to float32's rounding bound against float64 on the same bfloat16 values (a wrong pair, a missed or
    doubled scale fails it by orders of magnitude)."""
    from _bounds import assert_within, lse_error

    from attn.flash import flash_attn_func, flash_attn_with_kvcache

    H, H_kv, E = heads
    B, S, page = 3, 333, 16
    q, k, v = bf16(rng, (B, 1, H, E)), bf16(rng, (B, S, H_kv, E)), bf16(rng, (B, S, H_kv, E))
    scale = E ** -0.5
    if paged:
        order = rng.permutation(B * S // page + 3)[: -(-S // page) * B].reshape(B, -1).astype(np.int32)
        k_pages = np.zeros((B * S // page + 3, page, H_kv, E), BF16)
        v_pages = np.zeros_like(k_pages)
        for b in range(B):
            for j in range(S):
                k_pages[order[b, j // page], j % page], v_pages[order[b, j // page], j % page] = k[b, j], v[b, j]
        _, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=np.full(B, S, np.int32),
                                            block_table=order, softmax_scale=scale, causal=True,
                                            return_softmax_lse=True)
    else:
        _, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_attn_probs=True)
    qh, kh = np.swapaxes(q, 1, 2).astype(np.float64), np.swapaxes(k, 1, 2).astype(np.float64)   # [B, H, L, E]
    kh = np.repeat(kh, H // H_kv, axis=1)
    t = scale * (qh @ np.swapaxes(kh, -1, -2))   # [B, H, 1, S]
    ref = np.log(np.exp(t - t.max(-1, keepdims=True)).sum(-1)) + t.max(-1)   # [B, H, 1]
    bound = lse_error(qh, kh, scale=scale, dtype=np.float32)
    assert_within(np.asarray(lse, np.float64).reshape(B, H, 1), ref, bound, f"{heads} paged={paged} on {simd}")


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
@pytest.mark.parametrize("d_v", [64, 96, 128])
def test_decode_bfloat16_values_by_pairs_of_keys(simd, d_v, rng):
    """A bfloat16 query over a bfloat16 cache, decode: on the avx512-bf16 and avx512-amx paths P.V
    takes pairs of keys (P rounded to bfloat16, as the prefill tiles and torch's bfloat16 SDPA round
    it), one V row pointer per key. The pairs are counted from the block's first key whatever cuts
    the rows, so pages of 5 keys (pairs across two pages) and of 16, and a contiguous cache, on 1 and 2
    threads, give the same bits; odd lengths pair the last key with zeros; a V width of 96 takes a
    64- and a 32-column strip. Each sequence's output is within float32's rounding bound of float64
    on the same values, stored in bfloat16, plus P's rounding (2^-9 of P @ |V|)."""
    from _bounds import assert_within
    from attn.flash import flash_attn_with_kvcache
    from test_flash import seq_bound, seq_reference

    H, H_kv, d_k = 8, 2, 64
    lengths = [333, 1, 65, 1200]
    B, S = len(lengths), max(lengths)
    q = bf16(rng, (B, 1, H, d_k))
    kc, vc = bf16(rng, (B, S, H_kv, d_k)), bf16(rng, (B, S, H_kv, d_v))
    seqlens = np.array(lengths, np.int32)
    results = []
    for threads in (1, 2):
        attn.set_num_threads(threads)
        try:
            results.append(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True))
            for page in (5, 16):
                kp, vp, table = in_pages(page, kc, vc, lengths)
                results.append(flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                       causal=True))
        finally:
            attn.set_num_threads(None)
    for r in results[1:]:
        np.testing.assert_array_equal(r.view(np.uint16), results[0].view(np.uint16))
    out = results[0]
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b], kc[b, :n], vc[b, :n]   # [1, H, E], [n, H_kv, E]
        ref = seq_reference(qb, kb, vb, causal=True)["out"]   # float64 on the same values
        # float32 arithmetic with the output stored in bfloat16 (seq_bound), plus P's rounding to
        # bfloat16 before P.V: at most 2^-9 p_j |v_j| a term, (P @ |V|) 2^-9 after the division by l
        kh = np.repeat(np.swapaxes(kb.astype(np.float64), 0, 1), H // H_kv, axis=0)   # [H, n, E]
        vh = np.repeat(np.swapaxes(vb.astype(np.float64), 0, 1), H // H_kv, axis=0)
        t = (np.swapaxes(qb.astype(np.float64), 0, 1) @ np.swapaxes(kh, 1, 2)) * d_k ** -0.5   # [H, 1, n]
        p = np.exp(t - t.max(-1, keepdims=True))
        p_rounding = np.swapaxes((p / p.sum(-1, keepdims=True)) @ np.abs(vh), 0, 1) * 2.0 ** -9   # [1, H, E]
        bound = seq_bound(qb, kb, vb, ref, dtype=BF16, causal=True) + p_rounding
        assert_within(out[b], ref, bound, f"sequence {b} ({n} keys), d_v {d_v} on {simd}")


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
def test_prefill_bfloat16_value_pairs_packed_once(simd, rng):
    """A bfloat16 prefill over pages (or rows H_kv E apart) reads its keys from each thread's copy of
    the matrix's keys; on the avx512-amx path V's pairs of keys for the tiles are packed into that copy
    by the first tile that reads them, and read from it by every later tile, block and query head of
    the same K/V head. The bits must be those of a cache whose rows lie contiguous head by head, where
    every tile packs its own: 576 query rows over 1100, 1088 and 1300 keys (causal blocks of 64 rows
    whose last tiles end on a multiple of 32 keys, taking the packed pairs as they grow, or not,
    packing their own), GQA 8/2, pages of 16 and 128 and the unpaged [B, S, H_kv, E] cache, on 1 and 2
    threads; and within float32's rounding bound of float64 on the same values, stored in bfloat16,
    plus P's rounding to bfloat16 (2^-9 of P @ |V|)."""
    from _bounds import assert_within
    from attn.flash import flash_attn_func, flash_attn_with_kvcache
    from test_flash import seq_bound, seq_reference

    H, H_kv, E, L = 8, 2, 64, 576
    lengths = [1100, 1088, 1300]
    B, S = len(lengths), max(lengths)
    q = bf16(rng, (B, L, H, E))
    kc, vc = bf16(rng, (B, S, H_kv, E)), bf16(rng, (B, S, H_kv, E))
    seqlens = np.array(lengths, np.int32)
    outs = []
    for threads in (1, 2):
        attn.set_num_threads(threads)
        try:
            # each sequence over its keys laid out head by head ([1, n, H_kv, E] views of [1, H_kv, n, E])
            outs.append([flash_attn_func(q[b:b + 1], *(np.swapaxes(np.ascontiguousarray(np.swapaxes(x[b:b + 1, :n], 1, 2)),
                                                                   1, 2) for x in (kc, vc)), causal=True)[0]
                         for b, n in enumerate(lengths)])
            outs.append(list(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)))
            for page in (16, 128):
                kp, vp, table = in_pages(page, kc, vc, lengths)
                outs.append(list(flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table,
                                                         causal=True)))
        finally:
            attn.set_num_threads(None)
    for got in outs[1:]:
        for b in range(B):
            np.testing.assert_array_equal(got[b].view(np.uint16), outs[0][b].view(np.uint16))
    for b, n in enumerate(lengths):
        qb, kb, vb = q[b], kc[b, :n], vc[b, :n]   # [L, H, E], [n, H_kv, E]
        ref = seq_reference(qb, kb, vb, causal=True)["out"]   # float64 on the same values
        kh, vh = (np.repeat(np.swapaxes(x.astype(np.float64), 0, 1), H // H_kv, axis=0) for x in (kb, vb))  # [H, n, E]
        t = (np.swapaxes(qb.astype(np.float64), 0, 1) @ np.swapaxes(kh, 1, 2)) * E ** -0.5   # [H, L, n]
        t[:, ~lower_right(L, n)] = -np.inf
        p = np.exp(t - t.max(-1, keepdims=True))
        p_rounding = np.swapaxes((p / p.sum(-1, keepdims=True)) @ np.abs(vh), 0, 1) * 2.0 ** -9   # [L, H, E]
        bound = seq_bound(qb, kb, vb, ref, dtype=BF16, causal=True) + p_rounding
        assert_within(outs[0][b], ref, bound, f"sequence {b} ({n} keys) on {simd}")


@pytest.mark.parametrize("layout", ["transposed", "strided", "negative"])  # (forward and backward)
def test_strided_bfloat16_read_in_place(layout, rng):
    q, k, v = bf16(rng, (2, 3, 7, 64)), bf16(rng, (2, 3, 40, 64)), bf16(rng, (2, 3, 40, 64))
    if layout == "transposed":
        k = np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2)
    elif layout == "strided":
        v = np.repeat(v, 2, axis=-2)[..., ::2, :]
    else:
        q = q[:, ::-1].copy()[:, ::-1]
    g = bf16(rng, (2, 3, 7, 64))
    ref = torch_sdpa_grads(q, k, v, g, torch.float64)
    tb = torch_sdpa_grads(q, k, v, g, torch.bfloat16)
    for backend in BACKENDS:
        out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend=backend)
        for what, ours, r, t in zip(("out", "dq", "dk", "dv"), (out,) + tuple(backward(g)), ref, tb):
            assert_rule(err(ours, r), err(t, r), f"{layout} {backend} {what}")


def test_float32_query_over_bfloat16_cache(rng):
    """Computed in float32 on the widened cache: float32's rounding bound."""
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k, v = bf16(rng, (1, 2, 700, 64)), bf16(rng, (1, 2, 700, 64))
    out = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.dtype == np.float32
    kk, vv = (np.repeat(a.astype(np.float64), 4, axis=1) for a in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(f64(q), f64(kk), f64(vv)).numpy()
    assert_sdpa_close(out, ref, q, kk, vv)


def test_torch_tensors_in_and_out(rng):
    q, k, v = (torch.randn(1, 4, n, 64, dtype=torch.bfloat16) for n in (5, 60, 60))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    tb = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_rule(err(out, ref), err(tb, ref), "torch tensors")


def test_custom_operator_autograd(rng):
    from attn.integrations.torch import scaled_dot_product_attention as op

    q, k, v = (torch.randn(2, 4, n, 64, dtype=torch.bfloat16) for n in (20, 50, 50))
    g = torch.randn(2, 4, 20, 64, dtype=torch.bfloat16)

    def run(fn, dtype):
        tq, tk, tv = (x.to(dtype).requires_grad_() for x in (q, k, v))
        out = fn(tq, tk, tv, is_causal=True)
        out.backward(g.to(dtype))
        return out.detach(), tq.grad, tk.grad, tv.grad

    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref, tb, ours = run(sdpa, torch.float64), run(sdpa, torch.bfloat16), run(op, torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in ours)
    for what, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, tb):
        assert_rule(err(o, r), err(t, r), f"custom op {what}")


def test_kv_cache_bfloat16_decode_equals_one_causal_call(rng):
    """KVCache(dtype="bfloat16"): bfloat16 queries, step by step, as one lower-right causal call."""
    T, H, Hkv, E = 12, 4, 2, 64
    q, k, v = bf16(rng, (1, H, T, E)), bf16(rng, (1, Hkv, T, E)), bf16(rng, (1, Hkv, T, E))
    cache = attn.KVCache(1, Hkv, max_len=T, head_dim=E, dtype="bfloat16")
    assert cache.dtype == BF16
    steps = []
    for t in range(T):
        k_all, v_all = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        steps.append(attn.scaled_dot_product_attention(q[:, :, t:t + 1], k_all, v_all, enable_gqa=True,
                                                       is_causal="lower_right"))
    full = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    decoded = np.concatenate(steps, axis=2)
    if attn.backends()["simd"] in BF16_PRODUCT_PATHS:
        # the one call's register tiles take bfloat16 dot products (P rounded
        # to bfloat16), the decode steps float32: both held to the rule
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ref = sdpa(f64(q), f64(k), f64(v), is_causal=True, enable_gqa=True)
        tb = sdpa(as_torch_bf16(q), as_torch_bf16(k), as_torch_bf16(v), is_causal=True, enable_gqa=True)
        assert_rule(err(decoded, ref), err(tb, ref), "decode steps")
        assert_rule(err(full, ref), err(tb, ref), "one call")
    else:
        # the same float32 computation of each row, rounded once: the same bits
        assert np.array_equal(decoded.view(np.uint16), full.view(np.uint16))


def test_multi_head_module_bfloat16_against_torch():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    x = torch.randn(2, 10, 64).to(torch.bfloat16)
    mask = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)   # MHA's convention: True = masked
    ours = attn.MultiheadAttention.from_torch(mha.to(torch.bfloat16))
    assert ours.dtype == BF16
    with torch.no_grad():
        tb, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
        ref, _ = mha.double()(x.double(), x.double(), x.double(), attn_mask=mask, need_weights=False)
    out, _ = ours(x, x, x, attn_mask=mask, need_weights=False)
    assert out.dtype in (BF16, torch.bfloat16)
    assert_rule(err(out, ref), err(tb, ref), "MultiheadAttention")


def test_unsupported_dtypes_name_the_supported_ones():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        attn.scaled_dot_product_attention(*(np.ones((2, 3), np.int32),) * 3)
    with pytest.raises(TypeError, match="float16, bfloat16, float32, float64 or int8"):
        attn.KVCache(1, 1, max_len=4, head_dim=4, dtype="int16")
    q = np.ones((1, 2, 4), np.float16)
    with pytest.raises(TypeError, match="float32 query with float16 or bfloat16 key and value"):
        attn.scaled_dot_product_attention(q, q.astype(BF16), q.astype(BF16))


VARIANTS = {
    "window, lower-right": dict(window=(7, 0), is_causal="lower_right"),
    "window both sides": dict(window=(5, 3)),
    "softcap": dict(softcap=4.0),
    "ALiBi, causal": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), is_causal=True),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_within_torch_bfloat16_error(name, backend, rng):
    """Each variant in bfloat16: torch ops in bfloat16 (the formula written out, test_variants'
    reference) give the error attn is held to, against the same formula in float64."""
    from test_variants import reference

    kw = VARIANTS[name]
    q, k, v = bf16(rng, (2, 4, 20, 64)), bf16(rng, (2, 2, 30, 64)), bf16(rng, (2, 2, 30, 64))
    g = bf16(rng, (2, 4, 20, 64))
    ref = reference(q, k, v, enable_gqa=True, grad_out=g, **kw)
    tb = reference(q, k, v, enable_gqa=True, grad_out=g, dtype=torch.bfloat16, **kw)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, enable_gqa=True, backend=backend, **kw)
    grads = backward(g)
    assert out.dtype == BF16
    for what, ours in zip(("out", "dq", "dk", "dv", "dsinks"), (out,) + tuple(grads)):
        assert_rule(err(ours, ref[what]), err(tb[what], ref[what]), f"{name} {backend} {what}")


ROUNDED_ONCE = {  # (q shape, k/v shape, kwargs): the fast path, the validated path, split keys
    "prefill causal, a NaN row": ((2, 4, 70, 80), (2, 4, 70, 80), dict(is_causal=True)),
    "bool mask hiding a row": ((1, 2, 33, 64), (1, 2, 50, 64), dict(attn_mask="hide row 3")),
    "decode GQA, split keys": ((1, 6, 1, 64), (1, 2, 3000, 64), dict(enable_gqa=True)),
}


@pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")
@pytest.mark.parametrize("name", list(ROUNDED_ONCE))
def test_kernel_rounds_its_bfloat16_out_once_as_ml_dtypes(simd, name, rng):
    """The kernel writes a bfloat16 out itself: each element is the same
    computation's float32 result rounded by ml_dtypes' rule (nearest even,
    NaN quiet with its sign); fully masked rows stay 0."""
    from attn._backends import fused
    from attn._validation import validate_attention

    qs, ks, kw = ROUNDED_ONCE[name]
    q, k, v = bf16(rng, qs), bf16(rng, ks), bf16(rng, ks)
    if name.endswith("NaN row"):
        q[0, 1, 5, 7] = np.nan
    if kw.get("attn_mask") == "hide row 3":
        mask = rng.random(qs[:-1] + ks[-2:-1]) < 0.8
        mask[..., 3, :] = False
        kw = dict(attn_mask=mask)
    out = attn.scaled_dot_product_attention(q, k, v, backend="cython", **kw)
    args = (kw.get("attn_mask"), 0.0, kw.get("is_causal", False), None, kw.get("enable_gqa", False),
            "cython", False, None, None, None, None, None, None)
    out32, _ = fused.forward_and_lse(validate_attention(q, k, v, *args))   # float32, the same kernel
    assert out.dtype == BF16 and out32.dtype == np.float32
    expected = out32.astype(BF16)                                           # ml_dtypes' rounding
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16)), name
    if name.endswith("NaN row"):
        assert np.isnan(out[0, 1, 5].astype(np.float32)).all() and not np.isnan(out[0, 0].astype(np.float32)).any()
    if "hide row" in name:
        assert not out[..., 3, :].astype(np.float32).any()


@pytest.mark.parametrize("n", [1, 17, 1000, (1 << 19) + 123])   # one element .. several threads' chunks
def test_array_cast_is_ml_dtypes_bit_for_bit(n, rng):
    """attn._dtypes.cast (compiled, for contiguous arrays): float32 -> bfloat16
    rounds as ml_dtypes' astype does, ties to even, NaN quiet with its sign,
    overflow to inf, subnormals; bfloat16 -> float32 is exact."""
    from attn import _dtypes

    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-45, 3.4e38, -3.39e38,
                        1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9],  # ties: to even, up, and to even
                       np.float32)
    bits = rng.integers(0, 2**32, n, dtype=np.uint32)
    x = np.concatenate([special, bits.view(np.float32)])[:max(n, 1)]
    if n >= special.size:
        x[: special.size] = special
    x = x.copy()
    x.view(np.uint32)[-1:] = 0x7fa00001   # a signalling NaN's payload
    got = _dtypes.cast(x, BF16)
    with np.errstate(invalid="ignore"):   # (ml_dtypes warns about the NaN it converts)
        expected = x.astype(BF16)
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), expected.view(np.uint16))
    back = _dtypes.cast(got, np.float32)
    assert back.dtype == np.float32 and np.array_equal(back.view(np.uint32), got.astype(np.float32).view(np.uint32))


def _same_or_both_nan(got, expected, bits):
    """Bits equal, except NaNs: NaN both, with the same sign (F16C quiets a signalling NaN,
    numpy's loop keeps its payload as it is)."""
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(bits)[~nan], expected.view(bits)[~nan])
    assert np.array_equal(np.signbit(got[nan]), np.signbit(expected[nan]))


@pytest.mark.parametrize("n", [1, 17, 1000, (1 << 19) + 123])   # one element .. several threads' chunks
def test_array_cast_float16_is_numpy_bit_for_bit(n, rng):
    """attn._dtypes.cast (compiled, F16C, for contiguous arrays): float32 -> float16 rounds as numpy's
    astype does, ties to even, overflow to inf, subnormals (and the halfway point below the least one
    to 0); every one of the 65536 float16 values widens exactly; NaN stays NaN with its sign."""
    import attn
    from attn import _dtypes

    if attn._build._casts is None or attn._build._casts.cast_f16(np.zeros(1, np.float32), np.float16, 1) is None:
        pytest.skip("no compiled float16 converter here (no build, or a CPU without F16C)")
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 65519.99, 65520.0, -7e4,
                        2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-25, 2.0**-14 * (1 - 2.0**-11),
                        1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1e-40],   # ties to even, a float32 subnormal
                       np.float32)
    bits = rng.integers(0, 2**32, n, dtype=np.uint32)
    x = np.concatenate([special, bits.view(np.float32)])[:max(n, 1)].copy()
    if n >= special.size:
        x[: special.size] = special
    got = _dtypes.cast(x, np.float16)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = x.astype(np.float16)
    assert got.dtype == np.float16
    _same_or_both_nan(got, expected, np.uint16)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    wide = _dtypes.cast(halves, np.float32)
    assert wide.dtype == np.float32
    _same_or_both_nan(wide, halves.astype(np.float32), np.uint32)
