"""attn.flash (FlashAttention's Python API) against references built here.

The reference of every call: gather each sequence's keys out of the pages
with NumPy, then attention in torch float64 from FlashAttention's documented
formulas (test_variants.reference: the window, causality and ALiBi as an
explicit mask and bias aligned to each sequence's last key, the softcap as
``softcap * tanh(s / softcap)``, sinks as an extra softmax column). float32 and
16-bit results are held to the rounding bound of the computation
(tests/_bounds.py), never to a tolerance tuned on one CPU.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import attn
from attn.flash import (
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
)
from _bounds import assert_within
from test_variants import reference, variants_bound

BF16 = attn._dtypes.bfloat16()


# ------------------------------------------------------------------ references
def seq_reference(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None, sinks=None, scale=None,
                  grad_out=None):
    """One sequence, FlashAttention's semantics: q [L, H, E], k [S, H_kv, E], v [S, H_kv, Ev] -> dict of
    out [L, H, Ev] and lse [H, L] (and gradients in the same layouts), torch float64."""
    qt, kt, vt = (np.swapaxes(np.asarray(x, np.float64), 0, 1) for x in (q, k, v))  # [T, H, E] -> [H, T, E]
    res = reference(qt, kt, vt, is_causal="lower_right" if causal else False, scale=scale, enable_gqa=True,
                    window=None if tuple(window_size) == (-1, -1) else tuple(window_size), softcap=softcap or None,
                    alibi_slopes=alibi, sinks=sinks,
                    grad_out=None if grad_out is None else np.swapaxes(grad_out, 0, 1))
    out = {"out": np.swapaxes(res["out"], 0, 1), "lse": res["lse"]}
    for g in ("dq", "dk", "dv"):
        if g in res:
            out[g] = np.swapaxes(res[g], 0, 1)
    return out


def seq_bound(q, k, v, ref_out, *, dtype, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None, sinks=None):
    """The float32 rounding bound [L, H, Ev] of one sequence's output stored in ``dtype``."""
    H, H_kv = q.shape[1], k.shape[1]
    qt = np.swapaxes(np.asarray(q, np.float64), 0, 1)
    kt, vt = (np.repeat(np.swapaxes(np.asarray(x, np.float64), 0, 1), H // H_kv, axis=0) for x in (k, v))
    err = variants_bound(qt, kt, vt, np.swapaxes(ref_out, 0, 1), dtype=dtype,
                         is_causal="lower_right" if causal else False,
                         window=None if tuple(window_size) == (-1, -1) else tuple(window_size), softcap=softcap or None,
                         alibi_slopes=alibi, sinks=sinks)
    return np.swapaxes(err, 0, 1)


def paged_pool(rng, lengths, page, H_kv, E, Ev, dtype, *, spare=3, shared=False):
    """Pages [n_pages, page, H_kv, E(v)] shuffled in a pool with ``spare`` unused pages, and a block
    table [B, max_pages] (unused entries -1). ``shared``: every sequence's first page is one page
    (a common prefix, as prefix caching shares it)."""
    need = [-(-n // page) for n in lengths]
    n_pages = sum(need) + spare
    order = rng.permutation(n_pages)
    width = max(need + [1]) + 1
    table = np.full((len(lengths), width), -1, np.int32)
    used = 0
    for s, n in enumerate(need):
        for j in range(n):
            table[s, j] = order[0] if shared and j == 0 else order[used]
            used += 0 if shared and j == 0 and s > 0 else 1
    k = rng.standard_normal((n_pages, page, H_kv, E)).astype(dtype)
    v = rng.standard_normal((n_pages, page, H_kv, Ev)).astype(dtype)
    return k, v, table


def to_pages(page, rng, *per_sequence):
    """Given values, in pages: ``per_sequence`` is one list per array (K, V, ...) of each sequence's rows
    [n_s, ...]; returns one pool per array, [n_pages, page, ...] shuffled (rows past a sequence's end
    zero), and the block table [B, max_pages] they share."""
    need = [-(-len(x) // page) for x in per_sequence[0]]
    order = rng.permutation(sum(need)).astype(np.int32)
    table = np.zeros((len(need), max(need + [1])), np.int32)
    pools = [np.zeros((len(order), page) + seqs[0].shape[1:], seqs[0].dtype) for seqs in per_sequence]
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = order[at:at + n]
        at += n
        for pool, seqs in zip(pools, per_sequence):
            for j in range(n):
                chunk = seqs[s][j * page:(j + 1) * page]
                pool[table[s, j], :len(chunk)] = chunk
    return (*pools, table)


def gather(pages, row, n):
    """A sequence's first n keys out of its pages (the reference's copy)."""
    return pages[row[: -(-n // pages.shape[1])]].reshape((-1,) + pages.shape[2:])[:n]


def alibi_for(rng, on, B, H):
    return rng.uniform(0.05, 0.5, (B, H)) if on else None


# ------------------------------------------------------------------ flash_attn_with_kvcache
DTYPES = [np.float32, np.float16, BF16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("E,Ev,H,H_kv", [(40, 40, 4, 4), (59, 59, 6, 2), (96, 64, 8, 1), (111, 111, 4, 2),
                                         (256, 256, 2, 1)])
def test_kvcache_paged_decode(dtype, E, Ev, H, H_kv, rng):
    """Decode rows of sequences of different lengths over shuffled pages of several sizes, with and
    without each variant, against the gathered float64 reference."""
    lengths = [1, 17, 300, 64]
    for page, causal, window, softcap, alibi, sinks in [
        (16, True, (-1, -1), 0.0, False, False),
        (1, False, (-1, -1), 0.0, False, False),
        (7, True, (20, 0), 0.0, True, False),
        (256, False, (-1, -1), 30.0, False, True),
        (3, True, (50, 3), 5.0, True, True),
    ]:
        k, v, table = paged_pool(rng, lengths, page, H_kv, E, Ev, dtype)
        q = rng.standard_normal((len(lengths), 1, H, E)).astype(dtype)
        slopes = alibi_for(rng, alibi, len(lengths), H)
        sink = rng.standard_normal(H) if sinks else None
        kw = dict(causal=causal, window_size=window, softcap=softcap)
        out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array(lengths, np.int32), block_table=table,
                                           alibi_slopes=slopes, return_softmax_lse=True, sinks=sink, **kw)
        assert out.dtype == q.dtype and out.shape == (len(lengths), 1, H, Ev) and lse.shape == (len(lengths), H, 1)
        for s, n in enumerate(lengths):
            ks, vs = gather(k, table[s], n), gather(v, table[s], n)
            a = None if slopes is None else slopes[s]
            ref = seq_reference(q[s], ks, vs, alibi=a, sinks=sink, **kw)
            bound = seq_bound(q[s], ks, vs, ref["out"], dtype=dtype, alibi=a, sinks=sink, **kw)
            assert_within(out[s], ref["out"], bound, f"page {page} {kw} sequence {s}")
            assert_within(lse[s], ref["lse"], 1e-4 * (1 + np.abs(ref["lse"])), f"lse, page {page} sequence {s}")


def test_kvcache_contiguous_matches_paged(rng):
    """The same keys in a contiguous cache (with cache_batch_idx and cache_leftpad) and in pages give
    results within the bound of the same reference."""
    lengths, E, H, H_kv = np.array([5, 40, 23]), 32, 4, 2
    cache = rng.standard_normal((4, 48, H_kv, E)).astype(np.float32)
    vcache = rng.standard_normal((4, 48, H_kv, E)).astype(np.float32)
    batch_idx = np.array([2, 0, 3])
    leftpad = np.array([0, 7, 3])
    q = rng.standard_normal((3, 2, H, E)).astype(np.float32)  # two query rows each (speculative decoding)
    out = flash_attn_with_kvcache(q, cache, vcache, cache_seqlens=lengths, cache_batch_idx=batch_idx,
                                  cache_leftpad=leftpad, causal=True)
    for s in range(3):
        ks = cache[batch_idx[s], leftpad[s]:lengths[s]]
        vs = vcache[batch_idx[s], leftpad[s]:lengths[s]]
        ref = seq_reference(q[s], ks, vs, causal=True)
        assert_within(out[s], ref["out"], seq_bound(q[s], ks, vs, ref["out"], dtype=np.float32, causal=True), f"row {s}")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), page=st.integers(1, 40), n_seq=st.integers(1, 5), L=st.integers(1, 20),
       group=st.sampled_from([1, 2, 4]), causal=st.booleans(), left=st.integers(-1, 60), shared=st.booleans())
def test_kvcache_paged_property(seed, page, n_seq, L, group, causal, left, shared):
    """Random page sizes, lengths (0 included), query rows (decode and prefill chunks), GQA ratios,
    windows and shared first pages, float32."""
    rng = np.random.default_rng(seed)
    H_kv, E = 2, 16
    H = H_kv * group
    lengths = [int(x) for x in rng.integers(0, 90, n_seq)]
    if shared:
        lengths = [max(n, page) for n in lengths]  # every sequence has its (shared) first page full
    k, v, table = paged_pool(rng, lengths, page, H_kv, E, E, np.float32, shared=shared)
    q = rng.standard_normal((n_seq, L, H, E)).astype(np.float32)
    window = (left, 0 if causal else -1)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array(lengths), block_table=table, causal=causal,
                                  window_size=window)
    for s, n in enumerate(lengths):
        ks, vs = gather(k, table[s], n), gather(v, table[s], n)
        ref = seq_reference(q[s], ks, vs, causal=causal, window_size=window)
        bound = seq_bound(q[s], ks, vs, ref["out"], dtype=np.float32, causal=causal, window_size=window)
        assert_within(out[s], ref["out"], bound, f"sequence {s} of {lengths}, page {page}")


def test_long_context_split_keys_and_window_pages(rng):
    """A decode row over 3000 keys in 16-key pages (the kernel splits the keys into chunks, each read
    page by page); with a window, pages wholly outside it hold NaN and must never be read."""
    H, H_kv, E, n = 8, 2, 64, 3000
    k, v, table = paged_pool(rng, [n, 1000], 16, H_kv, E, E, np.float32)
    q = rng.standard_normal((2, 1, H, E)).astype(np.float32)
    lengths = np.array([n, 1000])
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table)
    for s in range(2):
        ks, vs = gather(k, table[s], lengths[s]), gather(v, table[s], lengths[s])
        ref = seq_reference(q[s], ks, vs)
        assert_within(out[s], ref["out"], seq_bound(q[s], ks, vs, ref["out"], dtype=np.float32), f"sequence {s}")
    window = (100, 0)
    before = {s: gather(k, table[s], lengths[s]).copy() for s in range(2)}
    for s in range(2):  # poison every page that ends before the window of the last row begins
        first_seen = lengths[s] - 1 - window[0]
        for j in range(first_seen // 16):
            k[table[s, j]] = np.nan
            v[table[s, j]] = np.nan
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table, causal=True, window_size=window)
    for s in range(2):
        ks, vs = before[s], gather(v, table[s], lengths[s])
        ref = seq_reference(q[s], ks, np.nan_to_num(vs), causal=True, window_size=window)
        assert np.isfinite(out[s]).all(), "a page outside the window was read"
        bound = seq_bound(q[s], ks, np.nan_to_num(vs), ref["out"], dtype=np.float32, causal=True, window_size=window)
        assert_within(out[s], ref["out"], bound, f"window, sequence {s}")


def test_kernel_paths(simd, rng):
    """Paged decode and a paged mixed batch on each SIMD path this CPU has."""
    H, H_kv, E = 4, 2, 64
    lengths = [33, 70, 5]
    for dtype in (np.float32, BF16):
        k, v, table = paged_pool(rng, lengths, 5, H_kv, E, E, dtype)
        q = rng.standard_normal((3, 1, H, E)).astype(dtype)
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array(lengths), block_table=table, causal=True)
        qv = rng.standard_normal((1 + 9 + 1, H, E)).astype(dtype)
        cu_q, cu_k = np.array([0, 1, 10, 11]), np.concatenate([[0], np.cumsum(lengths)])
        outv = flash_attn_varlen_func(qv, k, v, cu_q, cu_k, 9, 70, causal=True, block_table=table, softcap=10.0)
        for s, n in enumerate(lengths):
            ks, vs = gather(k, table[s], n), gather(v, table[s], n)
            ref = seq_reference(q[s], ks, vs, causal=True)
            assert_within(out[s], ref["out"], seq_bound(q[s], ks, vs, ref["out"], dtype=dtype, causal=True), simd)
            qs = qv[cu_q[s]:cu_q[s + 1]]
            ref = seq_reference(qs, ks, vs, causal=True, softcap=10.0)
            bound = seq_bound(qs, ks, vs, ref["out"], dtype=dtype, causal=True, softcap=10.0)
            assert_within(outv[cu_q[s]:cu_q[s + 1]], ref["out"], bound, f"{simd} varlen")


# ------------------------------------------------------------------ mixed batches (flash_attn_varlen_func)
@pytest.mark.parametrize("slopes_per_sequence", [False, True], ids=["slopes [H]", "slopes [B, H]"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
def test_varlen_paged_mixed_prefill_and_decode(dtype, slopes_per_sequence, rng):
    """One call: chunked-prefill chunks and single decode rows (one with a context long enough to be
    split into key chunks), keys in shared and shuffled pages, with every variant at once, against
    the gathered reference; lse in FlashAttention's [H, total_q]."""
    H, H_kv, E = 6, 2, 48
    q_len = np.array([7, 1, 1, 12, 1, 0])
    k_len = np.array([20, 33, 1, 12, 1200, 4])
    k, v, table = paged_pool(rng, list(k_len), 8, H_kv, E, E, dtype)
    table[2, 0] = table[0, 0]  # sequence 2 reads sequence 0's first page (a shared prefix)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(q_len)]), np.concatenate([[0], np.cumsum(k_len)])
    q = rng.standard_normal((cu_q[-1], H, E)).astype(dtype)
    slopes = rng.uniform(0.05, 0.5, (len(q_len), H) if slopes_per_sequence else H)
    sink = rng.standard_normal(H)
    kw = dict(causal=True, window_size=(700, 0), softcap=8.0)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32), 12, 1200,
                                         alibi_slopes=slopes, block_table=table, sinks=sink, return_attn_probs=True,
                                         **kw)
    assert out.shape == (cu_q[-1], H, E) and lse.shape == (H, cu_q[-1])
    for s in range(len(q_len)):
        ks, vs = gather(k, table[s], k_len[s]), gather(v, table[s], k_len[s])
        qs = q[cu_q[s]:cu_q[s + 1]]
        a = slopes[s] if slopes_per_sequence else slopes
        ref = seq_reference(qs, ks, vs, alibi=a, sinks=sink, **kw)
        bound = seq_bound(qs, ks, vs, ref["out"], dtype=dtype, alibi=a, sinks=sink, **kw)
        assert_within(out[cu_q[s]:cu_q[s + 1]], ref["out"], bound, f"sequence {s}")
        assert_within(lse[:, cu_q[s]:cu_q[s + 1]], ref["lse"], 1e-4 * (1 + np.abs(ref["lse"])), f"lse {s}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
def test_varlen_packed_mixed_prefill_and_decode(dtype, simd, rng):
    """The same kind of batch over keys packed contiguously (no block table): its single decode rows run
    by the cache's decode plan, a bfloat16 call as one contiguous cache row (the query read as it is),
    the others by varlen_attention; every variant at once, against each sequence's float64 reference,
    the output within its rounding bound, lse in FlashAttention's [H, total_q]."""
    H, H_kv, E = 6, 2, 48
    q_len = np.array([7, 1, 1, 12, 1, 0, 300])
    k_len = np.array([20, 33, 1, 12, 1200, 4, 700])
    cu_q, cu_k = np.concatenate([[0], np.cumsum(q_len)]), np.concatenate([[0], np.cumsum(k_len)])
    q = rng.standard_normal((cu_q[-1], H, E)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], H_kv, E)).astype(dtype) for _ in range(2))
    slopes = rng.uniform(0.05, 0.5, (len(q_len), H))
    sink = rng.standard_normal(H)
    kw = dict(causal=True, window_size=(700, 0), softcap=8.0)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32), 300, 1200,
                                         alibi_slopes=slopes, sinks=sink, return_attn_probs=True, **kw)
    assert out.dtype == q.dtype and out.shape == (cu_q[-1], H, E) and lse.shape == (H, cu_q[-1])
    for s in range(len(q_len)):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        ref = seq_reference(qs, ks, vs, alibi=slopes[s], sinks=sink, **kw)
        bound = seq_bound(qs, ks, vs, ref["out"], dtype=dtype, alibi=slopes[s], sinks=sink, **kw)
        assert_within(out[cu_q[s]:cu_q[s + 1]], ref["out"], bound, f"sequence {s}")
        assert_within(lse[:, cu_q[s]:cu_q[s + 1]], ref["lse"], 1e-4 * (1 + np.abs(ref["lse"])), f"lse {s}")


# ------------------------------------------------------------------ in-place append, rotary
def rotary_reference(x, cos, sin, positions, interleaved):
    """RoPE by complex multiplication (float64): the pairs as complex numbers times e^{i theta}."""
    x = np.asarray(x, np.float64)
    rd = 2 * cos.shape[1]
    theta = np.arctan2(sin, cos)[positions][:, :, None, :]  # [B, L, 1, rd / 2]
    r = x[..., :rd]
    z = r[..., 0::2] + 1j * r[..., 1::2] if interleaved else r[..., : rd // 2] + 1j * r[..., rd // 2:]
    z = z * np.exp(1j * theta)
    y = x.copy()
    if interleaved:
        y[..., 0:rd:2], y[..., 1:rd:2] = z.real, z.imag
    else:
        y[..., : rd // 2], y[..., rd // 2:rd] = z.real, z.imag
    return y


@pytest.mark.parametrize("paged", [False, True])
def test_append_in_place_is_writing_the_rows(paged, rng):
    """New k/v land in the cache exactly where cache_seqlens says, bit for bit, and nowhere else; the
    attention then sees them (torch tensors: the caller's storage is written)."""
    B, H, H_kv, E, n_new = 3, 4, 2, 16, 3
    seqlens = np.array([0, 5, 13])
    if paged:
        k, v, table = paged_pool(rng, list(seqlens + n_new), 4, H_kv, E, E, np.float32)
    else:
        k = rng.standard_normal((B, 20, H_kv, E)).astype(np.float32)
        v = rng.standard_normal((B, 20, H_kv, E)).astype(np.float32)
        table = None
    k_new = rng.standard_normal((B, n_new, H_kv, E)).astype(np.float32)
    v_new = rng.standard_normal((B, n_new, H_kv, E)).astype(np.float32)
    q = rng.standard_normal((B, n_new, H, E)).astype(np.float32)
    expect_k, expect_v = k.copy(), v.copy()
    for b in range(B):  # by hand
        for i in range(n_new):
            pos = seqlens[b] + i
            if paged:
                expect_k[table[b, pos // 4], pos % 4] = k_new[b, i]
                expect_v[table[b, pos // 4], pos % 4] = v_new[b, i]
            else:
                expect_k[b, pos], expect_v[b, pos] = k_new[b, i], v_new[b, i]
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)  # the call writes through these into k, v
    out = flash_attn_with_kvcache(torch.from_numpy(q), tk, tv, torch.from_numpy(k_new), torch.from_numpy(v_new),
                                  cache_seqlens=torch.from_numpy(seqlens.astype(np.int32)),
                                  block_table=None if table is None else torch.from_numpy(table), causal=True)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(k, expect_k)
    np.testing.assert_array_equal(v, expect_v)
    for b in range(B):
        n = seqlens[b] + n_new
        ks = gather(k, table[b], n) if paged else k[b, :n]
        vs = gather(v, table[b], n) if paged else v[b, :n]
        ref = seq_reference(q[b], ks, vs, causal=True)
        assert_within(out[b].numpy(), ref["out"], seq_bound(q[b], ks, vs, ref["out"], dtype=np.float32, causal=True),
                      f"row {b}")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_both_conventions(interleaved, causal, rng):
    """The new keys are stored rotated at their cache positions, the query rotated at FlashAttention's
    positions (cache_seqlens + i when causal, cache_seqlens for every row otherwise); partial rotary_dim."""
    B, H, E, n_new, rd = 2, 2, 32, 3, 16
    seqlens = np.array([4, 9])
    inv = 1.0 / 10000 ** (np.arange(0, rd, 2) / rd)
    ang = np.arange(40)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    k = rng.standard_normal((B, 16, H, E)).astype(np.float32)
    v = rng.standard_normal((B, 16, H, E)).astype(np.float32)
    k_new = rng.standard_normal((B, n_new, H, E)).astype(np.float32)
    v_new = rng.standard_normal((B, n_new, H, E)).astype(np.float32)
    q = rng.standard_normal((B, n_new, H, E)).astype(np.float32)
    k_before = k.copy()
    out = flash_attn_with_kvcache(q, k, v, k_new, v_new, cos, sin, cache_seqlens=seqlens, causal=causal,
                                  rotary_interleaved=interleaved)
    k_pos = seqlens[:, None] + np.arange(n_new)
    q_pos = k_pos if causal else np.repeat(seqlens[:, None], n_new, axis=1)
    k_rot = rotary_reference(k_new, cos.astype(np.float64), sin.astype(np.float64), k_pos, interleaved)
    q_rot = rotary_reference(q, cos.astype(np.float64), sin.astype(np.float64), q_pos, interleaved)
    u = np.finfo(np.float32).eps / 2
    for b in range(B):
        stored = k[b, seqlens[b]:seqlens[b] + n_new]
        # float32 products of float32 tables: a few u of the pair's magnitude
        mag = np.abs(k_new[b]).astype(np.float64)
        np.testing.assert_array_less(np.abs(stored - k_rot[b]), 8 * u * (mag + np.roll(mag, 1, -1) + np.roll(mag, -1, -1)
                                                                         + np.abs(np.roll(mag, rd // 2, -1))) + 1e-30)
        np.testing.assert_array_equal(k[b, :seqlens[b]], k_before[b, :seqlens[b]])
        n = seqlens[b] + n_new
        ref = seq_reference(q_rot[b], k[b, :n], v[b, :n], causal=causal)
        dq = 8 * u * np.abs(q).max()  # the query's own rotation rounding
        bound = seq_bound(q_rot[b], k[b, :n], v[b, :n], ref["out"], dtype=np.float32, causal=causal)
        bound = bound + dq * np.abs(k[b, :n]).sum(-1).max() / np.sqrt(E) * 2 * np.abs(v[b, :n]).max()
        assert_within(out[b], ref["out"], bound, f"row {b}")


# ------------------------------------------------------------------ bad input never touches the cache
def test_bad_cache_arguments_raise_before_any_write(rng):
    H, H_kv, E = 4, 2, 8
    k, v, table = paged_pool(rng, [10, 20], 4, H_kv, E, E, np.float32, spare=0)
    q = rng.standard_normal((2, 1, H, E)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, H_kv, E)).astype(np.float32)
    k0, v0 = k.copy(), v.copy()
    seqlens = np.array([10, 19])
    good = dict(cache_seqlens=seqlens, block_table=table)

    def bad(exc, match, **change):
        kw = {**good, **change}
        with pytest.raises(exc, match=match):
            flash_attn_with_kvcache(q, k, v, k_new, k_new, **kw)
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)

    t = table.copy()
    t[1, 2] = k.shape[0]
    bad(ValueError, r"block_table\[1, 2\]", block_table=t)
    t = table.copy()
    t[0, 0] = -1
    bad(ValueError, r"block_table\[0, 0\] = -1", block_table=t)
    bad(TypeError, "block_table must be an array of page indices", block_table=table.astype(np.float32))
    bad(ValueError, "block_table must have shape", block_table=table[:1])
    bad(ValueError, "holds .* keys but its block_table row", cache_seqlens=np.array([10, table.shape[1] * 4]))
    bad(ValueError, "cache_seqlens must be >= 0", cache_seqlens=np.array([-1, 3]))
    bad(TypeError, "cache_seqlens must be an array of ints", cache_seqlens=np.array([1.0, 2.0]))
    bad(ValueError, "cache_leftpad is not supported with a block_table", cache_leftpad=np.array([0, 0]))
    with pytest.raises(ValueError, match="k_cache must have shape"):
        flash_attn_with_kvcache(q, k[0], v[0], cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="must have the cache's dtype"):
        flash_attn_with_kvcache(q, k, v, k_new.astype(np.float64), k_new.astype(np.float64), **good)
    # a contiguous cache: an append past its end
    kc = rng.standard_normal((2, 8, H_kv, E)).astype(np.float32)
    kc0 = kc.copy()
    with pytest.raises(ValueError, match="exceed the cache's seqlen_cache"):
        flash_attn_with_kvcache(q, kc, kc, k_new, k_new, cache_seqlens=np.array([3, 8]))
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 5"):
        flash_attn_with_kvcache(q, kc, kc, k_new, k_new, cache_seqlens=np.array([3, 2]), cache_batch_idx=[0, 5])
    np.testing.assert_array_equal(kc, kc0)
    np.testing.assert_array_equal(k, k0)


def test_unused_table_entries_are_not_read(rng):
    """Entries past a sequence's pages may hold anything (vLLM pads with -1 or 0)."""
    k, v, table = paged_pool(rng, [5, 9], 4, 1, 8, 8, np.float32)
    table[table < 0] = 10**9
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array([5, 9]), block_table=table)
    assert np.isfinite(out).all()


# ------------------------------------------------------------------ flash_attn_func / varlen, autograd
def _dense_layouts(rng, dtype):
    """flash_attn_func operands as callers lay them out: (name, q, k, v)."""
    B, L, S, H, H_kv, E = 2, 37, 53, 6, 2, 24
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in
               ((B, L, H, E), (B, S, H_kv, E), (B, S, H_kv, E + 8)))
    yield "contiguous", q, k, v
    qkv = rng.standard_normal((B, L, 3, H, E)).astype(dtype)  # a packed projection, read as views
    yield "views of a packed qkv", qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    yield "heads-major memory", *(np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2) for x in (q, k, v))
    yield "reversed keys", q, k[:, ::-1], v[:, ::-1]
    yield "more rows than keys", rng.standard_normal((1, 70, 4, 16)).astype(dtype), \
        *(rng.standard_normal((1, 20, 4, 16)).astype(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_common_call_in_compiled_code(dtype, causal, rng, monkeypatch):
    """flash_attn_func's common call (ndarrays, no variants, more than 16 rows) is recognized in
    compiled code (attn._fast_path.flash_dense_fast): it returns the validated path's result bit for
    bit, over every layout, and that result is the float64 reference's within its bound."""
    from attn._backends import fused

    fast = fused._flash_fast
    if fast is None:
        pytest.skip("attn's compiled kernels are not built")
    for name, q, k, v in _dense_layouts(rng, dtype):
        ran = []
        monkeypatch.setattr(fused, "_flash_fast", lambda *a: ran.append(1) or fast(*a))
        got = flash_attn_func(q, k, v, causal=causal)
        assert ran and got.dtype == dtype, name
        monkeypatch.setattr(fused, "_flash_fast", None)
        np.testing.assert_array_equal(got, flash_attn_func(q, k, v, causal=causal), err_msg=name)
        for b in range(q.shape[0]):
            qb, kb, vb = (np.ascontiguousarray(x[b]) for x in (q, k, v))  # (torch takes no negative strides)
            ref = seq_reference(qb, kb, vb, causal=causal)
            assert_within(got[b], ref["out"], seq_bound(qb, kb, vb, ref["out"], dtype=dtype, causal=causal),
                          f"{name}, batch row {b}")
    monkeypatch.setattr(fused, "_flash_fast", fast)
    q = rng.standard_normal((1, 16, 2, 8)).astype(dtype)  # 16 rows: the decode plan, not the fast path
    assert fused.flash_dense_fast(q, q, q, causal, 0.5, 1) is None


def test_flash_attn_func_and_packed_forms_with_gradients(rng):
    """Dense batches in FlashAttention's layout, GQA and d_v != d_k, every variant, out, lse and the
    weights; torch tensors keep autograd: gradients against torch float64 autograd."""
    B, L, S, H, H_kv, E, Ev = 2, 9, 14, 4, 2, 16, 24
    q = rng.standard_normal((B, L, H, E))
    k = rng.standard_normal((B, S, H_kv, E))
    v = rng.standard_normal((B, S, H_kv, Ev))
    slopes, sink = rng.uniform(0.1, 0.4, H), rng.standard_normal(H)
    kw = dict(causal=True, window_size=(6, 1), softcap=4.0)
    dout = rng.standard_normal((B, L, H, Ev))
    tq, tk, tv, ts = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sink))
    out = flash_attn_func(tq, tk, tv, alibi_slopes=torch.tensor(slopes), sinks=ts, **kw)
    out.backward(torch.tensor(dout))
    o_np, lse, w = flash_attn_func(q, k, v, alibi_slopes=slopes, sinks=sink, return_attn_probs=True, **kw)
    for b in range(B):
        ref = seq_reference(q[b], k[b], v[b], alibi=slopes, sinks=sink, grad_out=dout[b], **kw)
        np.testing.assert_allclose(out[b].detach().numpy(), ref["out"], atol=1e-12)
        np.testing.assert_allclose(o_np[b], ref["out"], atol=1e-12)
        np.testing.assert_allclose(lse[b], ref["lse"], atol=1e-12)
        np.testing.assert_allclose(tq.grad[b].numpy(), ref["dq"], atol=1e-11)
        np.testing.assert_allclose(tk.grad[b].numpy(), ref["dk"], atol=1e-11)
        np.testing.assert_allclose(tv.grad[b].numpy(), ref["dv"], atol=1e-11)
    assert w.shape == (B, H, L, S) and np.allclose(w.sum(-1) <= 1 + 1e-12, True)
    assert ts.grad is not None and ts.grad.shape == (H,)
    # the packed forms are views onto the same computation
    qkv = rng.standard_normal((B, L, 3, H, E))
    ref = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    np.testing.assert_array_equal(flash_attn_qkvpacked_func(qkv, causal=True), ref)
    kv = np.stack([k, k], axis=2)
    np.testing.assert_array_equal(flash_attn_kvpacked_func(q, kv), flash_attn_func(q, k, k))


def test_flash_attn_varlen_func_with_gradients(rng):
    """Packed sequences with autograd; the packed forms; against the per-sequence float64 reference."""
    q_len, k_len = np.array([3, 1, 8]), np.array([5, 9, 8])
    H, H_kv, E = 4, 1, 8
    cu_q = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, E))
    k = rng.standard_normal((cu_k[-1], H_kv, E))
    v = rng.standard_normal((cu_k[-1], H_kv, E))
    dout = rng.standard_normal(q.shape)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = flash_attn_varlen_func(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 8, 9, causal=True,
                                 window_size=(3, -1))
    out.backward(torch.tensor(dout))
    for s in range(3):
        sl_q, sl_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        ref = seq_reference(q[sl_q], k[sl_k], v[sl_k], causal=True, window_size=(3, -1), grad_out=dout[sl_q])
        np.testing.assert_allclose(out[sl_q].detach().numpy(), ref["out"], atol=1e-12)
        np.testing.assert_allclose(tq.grad[sl_q].numpy(), ref["dq"], atol=1e-11)
        np.testing.assert_allclose(tk.grad[sl_k].numpy(), ref["dk"], atol=1e-11)
        np.testing.assert_allclose(tv.grad[sl_k].numpy(), ref["dv"], atol=1e-11)
    kv = np.stack([k, v], axis=1)
    np.testing.assert_array_equal(flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 8, 9, causal=True),
                                  flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 9, causal=True))
    qkv = rng.standard_normal((cu_q[-1], 3, H, E))
    np.testing.assert_array_equal(
        flash_attn_varlen_qkvpacked_func(qkv, cu_q, 8),
        flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_q, 8, 8))


def test_torch_bfloat16_in_and_out(rng):
    """torch bfloat16 tensors are read in place and the result comes back as torch bfloat16."""
    q = torch.randn(2, 1, 4, 32, dtype=torch.bfloat16)
    k, v, table = paged_pool(rng, [6, 30], 8, 2, 32, 32, np.float32)
    tk, tv = torch.from_numpy(k).to(torch.bfloat16), torch.from_numpy(v).to(torch.bfloat16)
    out = flash_attn_with_kvcache(q, tk, tv, cache_seqlens=torch.tensor([6, 30], dtype=torch.int32),
                                  block_table=torch.from_numpy(table))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 4, 32)
    qn = q.float().numpy().astype(BF16)
    kn, vn = tk.float().numpy().astype(BF16), tv.float().numpy().astype(BF16)
    for s, n in enumerate([6, 30]):
        ks, vs = gather(kn, table[s], n), gather(vn, table[s], n)
        ref = seq_reference(qn[s], ks, vs)
        assert_within(out[s].float().numpy(), ref["out"], seq_bound(qn[s], ks, vs, ref["out"], dtype=BF16), f"{s}")


def test_numpy_fallback_matches(rng, monkeypatch):
    """Without the compiled kernels the pages are gathered and NumPy computes the same result."""
    k, v, table = paged_pool(rng, [7, 19], 4, 2, 16, 16, np.float64)
    q = rng.standard_normal((2, 3, 4, 16))
    fused = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array([7, 19]), block_table=table, causal=True)
    monkeypatch.setattr(attn._build, "HAVE_CYTHON", False)
    ref = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array([7, 19]), block_table=table, causal=True)
    np.testing.assert_allclose(fused, ref, atol=1e-12)


def test_without_the_kernels_the_pages_are_gathered(rng, monkeypatch):
    """Without attn._kernels no backend reads the cache in place (the fused cache_forward never
    runs): the gathered pages give each sequence's torch reference, a decode and a prefill chunk."""
    from attn._backends import fused

    def refuse(*args):
        raise AssertionError("the fused backend read the cache")

    monkeypatch.setattr(attn._build, "HAVE_CYTHON", False)
    monkeypatch.setattr(fused, "cache_forward", refuse)
    lengths = [7, 19]
    k, v, table = paged_pool(rng, lengths, 4, 2, 16, 16, np.float64)
    for L in (1, 5):
        q = rng.standard_normal((2, L, 4, 16))
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=np.array(lengths), block_table=table, causal=True)
        for s, n in enumerate(lengths):
            ks, vs = gather(k, table[s], n), gather(v, table[s], n)
            ref = seq_reference(q[s], ks, vs, causal=True)
            assert_within(out[s], ref["out"], seq_bound(q[s], ks, vs, ref["out"], dtype=np.float64, causal=True),
                          f"L={L} sequence {s}")


def test_vllm_layout_read_in_place(rng):
    """vLLM's CPU cache [2, num_blocks, H_kv, block, E] viewed as pages [num_blocks, block, H_kv, E]
    (a transposed view, no copy) gives the gathered reference (docs/flash_api.md)."""
    H, H_kv, E, block = 4, 2, 32, 8
    lengths = np.array([13, 30])
    kv_cache = torch.randn(2, 10, H_kv, block, E)
    table = torch.tensor([[3, 7, 0, 0], [9, 1, 4, 2]], dtype=torch.int32)
    k_cache, v_cache = kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    assert not k_cache.is_contiguous()
    q = torch.randn(3 + 1, H, E)
    cu_q, cu_k = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([0, 13, 43], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 30, causal=True, block_table=table)
    kn, vn, tn = k_cache.numpy(), v_cache.numpy(), table.numpy()
    for s, n in enumerate(lengths):
        ks, vs = gather(kn, tn[s], n), gather(vn, tn[s], n)
        qs = q.numpy()[cu_q[s]:cu_q[s + 1]]
        ref = seq_reference(qs, ks, vs, causal=True)
        assert_within(out[cu_q[s]:cu_q[s + 1]].numpy(), ref["out"],
                      seq_bound(qs, ks, vs, ref["out"], dtype=np.float32, causal=True), f"sequence {s}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("E", [64, 128])
def test_vllm_layout_decode_gives_the_contiguous_bits(dtype, E, simd, rng):
    """Decode rows over vLLM's CPU layout (each block's K rows of a head, then its V rows: a K/V head's
    keys lie side by side, its heads do not) read the pages in place, runs of a page's keys scored
    with their prefetches between the products (2 KiB of K rows a run: 4 to 16 keys) and the P V
    prefetching the next tile's V: on every SIMD path, for pages of 5, 32 and 128 keys and 1 to 3
    threads, the output equals, bit for bit, the same call over the keys gathered into a contiguous
    [B, S, H_kv, E] cache (split keys: up to 1100 keys), and lies within the rounding bound of the
    float64 reference."""
    H, H_kv = 8, 2
    lengths = [1100, 37, 300]
    B, cap = len(lengths), max(lengths)
    q = rng.standard_normal((B, 1, H, E)).astype(dtype)
    for page in (5, 32, 128):
        need = [-(-n // page) for n in lengths]
        n_blocks = sum(need) + 2
        kv = rng.standard_normal((n_blocks, H_kv, 2, page, E)).astype(dtype)   # [blocks, H_kv, K|V, page, E]
        k_pages, v_pages = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)  # [blocks, page, H_kv, E]
        table = np.zeros((B, max(need)), np.int32)
        order = rng.permutation(n_blocks)
        at = 0
        for s, n in enumerate(need):
            table[s, :n] = order[at:at + n]
            at += n
        kc = np.zeros((B, cap, H_kv, E), dtype)
        vc = np.zeros_like(kc)
        for s, n in enumerate(lengths):
            kc[s, :n], vc[s, :n] = gather(k_pages, table[s], n), gather(v_pages, table[s], n)
        kw = dict(cache_seqlens=np.array(lengths), causal=True)
        contiguous = flash_attn_with_kvcache(q, kc, vc, **kw)
        for threads in (1, 2, 3):
            attn.set_num_threads(threads)
            try:
                paged = flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table, **kw)
            finally:
                attn.set_num_threads(None)
            np.testing.assert_array_equal(paged.view(np.uint8), contiguous.view(np.uint8), f"page {page}")
        for s, n in enumerate(lengths):
            ref = seq_reference(q[s], kc[s, :n], vc[s, :n], causal=True)
            assert_within(paged[s], ref["out"], seq_bound(q[s], kc[s, :n], vc[s, :n], ref["out"], dtype=dtype, causal=True),
                          f"page {page} sequence {s}")


@pytest.mark.parametrize("E", [64, 40])
def test_int8_pages(E, rng):
    """attn's extension: q8_0 pages (attn.Q8Tensor [num_blocks, page, H_kv, E]). A decode call (the
    VNNI paths round the query to q8_0 there: tests/test_kv_cache_int8.py's kernel_query) and a mixed
    varlen call (its single-row sequences take the decode plan, rounding alike), against float64 over the dequantized gathered rows; an append stores exactly the
    q8_0 rows of the new keys."""
    from attn import Q8Tensor
    from test_kv_cache_int8 import kernel_query

    H, H_kv, page = 8, 2, 16
    lengths = [40, 200, 7]
    k32, v32, table = paged_pool(rng, lengths, page, H_kv, E, E, np.float32)
    kq, vq = Q8Tensor.quantize(k32), Q8Tensor.quantize(v32)
    kd, vd = kq.dequantize().astype(np.float64), vq.dequantize().astype(np.float64)
    q = rng.standard_normal((3, 1, H, E)).astype(np.float32)
    out = flash_attn_with_kvcache(q, kq, vq, cache_seqlens=np.array(lengths), block_table=table, causal=True)
    for s, n in enumerate(lengths):
        ks, vs = gather(kd, table[s], n), gather(vd, table[s], n)
        qs = kernel_query(q[s].transpose(1, 0, 2)).transpose(1, 0, 2)  # [1, H, E] (rounded where the path does)
        ref = seq_reference(qs, ks, vs, causal=True)
        bound = seq_bound(qs, ks, vs, ref["out"], dtype=np.float32, causal=True)
        assert_within(out[s], ref["out"], bound, f"int8 decode {s}")
    qv = rng.standard_normal((5 + 1 + 1, H, E)).astype(np.float32)
    cu_q, cu_k = np.array([0, 5, 6, 7]), np.concatenate([[0], np.cumsum(lengths)])
    outv = flash_attn_varlen_func(qv, kq, vq, cu_q, cu_k, 5, 200, causal=True, block_table=table)
    for s, n in enumerate(lengths):
        ks, vs = gather(kd, table[s], n), gather(vd, table[s], n)
        qs = qv[cu_q[s]:cu_q[s + 1]]
        if len(qs) == 1:  # a single decode row runs the decode plan (rounded where the path rounds)
            qs = kernel_query(qs.transpose(1, 0, 2)).transpose(1, 0, 2)
        ref = seq_reference(qs, ks, vs, causal=True)
        assert_within(outv[cu_q[s]:cu_q[s + 1]], ref["out"],
                      seq_bound(qs, ks, vs, ref["out"], dtype=np.float32, causal=True), f"int8 varlen {s}")
    # append: the new rows' own q8_0 bytes land at the positions, nothing else changes
    k_new = rng.standard_normal((3, 2, H_kv, E)).astype(np.float32)
    before = kq.data.copy()
    seqlens = np.array([10, 100, 3])
    flash_attn_with_kvcache(np.repeat(q, 2, axis=1), kq, vq, k_new, k_new, cache_seqlens=seqlens, block_table=table,
                            causal=True)
    expect = before.copy()
    rows = Q8Tensor.quantize(k_new).data
    for b in range(3):
        for i in range(2):
            pos = seqlens[b] + i
            expect[table[b, pos // page], pos % page] = rows[b, i]
    np.testing.assert_array_equal(kq.data, expect)


@pytest.mark.parametrize("dtype", [np.float32, BF16, "int8"], ids=["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("page", [1, 5, 16])
def test_small_pages_give_the_contiguous_bits(dtype, page, simd, rng):
    """Decode rows read the pages in place, in runs cut at page ends, and every key's score is the
    same sum wherever a run starts or ends (the last keys of a run take the 4-key products too): the
    paged call's output equals, bit for bit, the same call over the gathered contiguous cache (decode
    rows of lengths up to 700, GQA 4, split keys), on every SIMD path."""
    from attn import Q8Tensor

    H, H_kv, E = 8, 2, 64
    lengths = [700, 1, 130]
    k, v, table = paged_pool(rng, lengths, page, H_kv, E, E, np.float32)
    cap = max(lengths)
    kc = np.zeros((3, cap, H_kv, E), np.float32)
    vc = np.zeros_like(kc)
    for s, n in enumerate(lengths):
        kc[s, :n], vc[s, :n] = gather(k, table[s], n), gather(v, table[s], n)
    as_cache = (lambda x: Q8Tensor.quantize(x)) if dtype == "int8" else (lambda x: x.astype(dtype))
    q = rng.standard_normal((3, 1, H, E)).astype(np.float32 if dtype == "int8" else dtype)
    kw = dict(cache_seqlens=np.array(lengths), causal=True, softcap=20.0)
    paged = flash_attn_with_kvcache(q, as_cache(k), as_cache(v), block_table=table, **kw)
    contiguous = flash_attn_with_kvcache(q, as_cache(kc), as_cache(vc), **kw)
    np.testing.assert_array_equal(paged.view(np.uint8), contiguous.view(np.uint8))


def test_float16_decode_over_split_keys_rounded_once(simd, rng):
    """A float16 decode over long caches splits each sequence's keys into chunks whose partial states
    are merged in float32 and rounded to float16 once as the merge writes the out (attn_narrow16): the
    bits of the same call with a float32 query (its float32 out) rounded afterwards, through
    flash_attn_with_kvcache's decode plan and a varlen batch's decode rows, on every SIMD path."""
    H, H_kv, E, S = 8, 2, 64, 3000
    q = rng.standard_normal((3, 1, H, E)).astype(np.float16)
    k, v = (rng.standard_normal((3, S, H_kv, E)).astype(np.float16) for _ in range(2))
    got = flash_attn_with_kvcache(q, k, v, causal=True)
    want = flash_attn_with_kvcache(q.astype(np.float32), k, v, causal=True)
    assert got.dtype == np.float16 and want.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(np.float16).view(np.uint16))
    cu_q, cu_k = np.arange(4, dtype=np.int32), np.arange(0, 3 * S + 1, S, dtype=np.int32)
    kk, vv = k.reshape(-1, H_kv, E), v.reshape(-1, H_kv, E)   # [3 S, H_kv, E] packed
    got = flash_attn_varlen_func(q[:, 0], kk, vv, cu_q, cu_k, 1, S, causal=True)
    want = flash_attn_varlen_func(q[:, 0].astype(np.float32), kk.astype(np.float32), vv.astype(np.float32),
                                  cu_q, cu_k, 1, S, causal=True)
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bfloat16", "float16"])
def test_16bit_query_over_a_cache_of_its_dtype_is_read_as_it_is(dtype, simd, rng):
    """A bfloat16 or float16 query over a cache of its dtype reaches the kernel as it is
    (attn._paged.kernel_query: no float32 copy; attn_problem.q_raw16) and gets its out in its dtype
    from the kernel (attn_problem.out16, each row rounded once), any other query widened. The output
    of a mixed batch (decode rows and prefill chunks, pages of 16) equals, bit for bit, the same batch
    over the keys packed contiguously (one contiguous cache row, its query read as it is too) and,
    float16 (whose products are float32's), the batch with a float32 copy of the query rounded to
    float16, on every SIMD path; and the kernel refuses a 16-bit query array over any other cache (a
    TypeError naming the dtypes) rather than misread it."""
    from attn import _paged
    from attn._backends import fused

    dt, other = np.dtype(dtype), np.dtype(np.float16 if dtype == BF16 else BF16)
    H, H_kv, E = 8, 2, 64
    q_lens, k_lens = [1, 37, 1, 200], [300, 37, 90, 260]
    cu_q, cu_k = np.cumsum([0] + q_lens).astype(np.int32), np.cumsum([0] + k_lens).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, E)).astype(dt)
    k, v, table = paged_pool(rng, k_lens, 16, H_kv, E, E, dt)
    assert _paged.kernel_query(q, k, v) is q
    assert _paged.kernel_query(q, k.astype(np.float32), v.astype(np.float32)).dtype == np.float32
    assert _paged.kernel_query(q.astype(other), k.astype(other), v.astype(other)) is not q
    kc = np.concatenate([gather(k, table[s], n) for s, n in enumerate(k_lens)])   # [sum k_lens, H_kv, E]
    vc = np.concatenate([gather(v, table[s], n) for s, n in enumerate(k_lens)])
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    paged = flash_attn_varlen_func(q, k, v, *args, causal=True, block_table=table)
    contiguous = flash_attn_varlen_func(q, kc, vc, *args, causal=True)
    assert paged.dtype == dt
    np.testing.assert_array_equal(paged.view(np.uint16), contiguous.view(np.uint16))
    if dt == np.float16:
        widened = flash_attn_varlen_func(q.astype(np.float32), k, v, *args, causal=True, block_table=table)
        assert widened.dtype == np.float32
        np.testing.assert_array_equal(paged.view(np.uint16), widened.astype(np.float16).view(np.uint16))
    q2 = q[:4, :1]   # [N, L, E]: 4 one-row matrices
    describe = lambda a: (a, np.arange(4, dtype=np.int64) * (a.strides[0] // a.itemsize),
                          (a.strides[1] // a.itemsize, a.strides[2] // a.itemsize))
    for k2 in (rng.standard_normal((4, 10, E)).astype(attn._dtypes.float8("float8_e4m3fn")),
               rng.standard_normal((4, 10, E)).astype(other)):
        out = np.empty((4, 1, E), np.float32)
        with pytest.raises(TypeError, match=f"(16-bit query as it is .* got query {dt}, key {k2.dtype}"
                                            f"|take no query {dt} with key {k2.dtype})"):
            fused.run_forward(describe(q2), describe(k2), describe(k2), out, scale=0.125, num_threads=1)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [(-1, -1), (100, 0)], ids=["causal", "window"])
def test_prefill_over_small_pages_gives_the_contiguous_bits(dtype, window, simd, rng):
    """Blocks of more rows than decode's over pages shorter than a key tile read each tile from the
    thread's copy of their sequence's keys (attn._kernels' _Pack): appended tile by tile, shared by the
    query heads of one K/V head and the blocks after it, started afresh for another sequence, a window's
    earlier keys, or past its size (4 MiB: the (8, 2100) sequence's 2 KiB key rows). The output equals,
    bit for bit, the same varlen call over the keys gathered contiguously, on 1 to 3 threads, pages of
    5, 16 and 32 keys."""
    H, H_kv, E = 4, 2, 256
    q_lens, k_lens = [40, 8, 130], [700, 2100, 130]   # (bottom-right causal: the last q row sees every key)
    cu_q, cu_k = np.cumsum([0] + q_lens).astype(np.int32), np.cumsum([0] + k_lens).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, E)).astype(dtype)
    kw = dict(causal=True, window_size=window)
    for page in (5, 16, 32):
        k, v, table = paged_pool(rng, k_lens, page, H_kv, E, E, dtype)
        kc = np.concatenate([gather(k, table[s], n) for s, n in enumerate(k_lens)])   # [sum k_lens, H_kv, E]
        vc = np.concatenate([gather(v, table[s], n) for s, n in enumerate(k_lens)])
        contiguous = flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(q_lens), max(k_lens), **kw)
        for threads in (1, 2, 3):
            attn.set_num_threads(threads)
            try:
                paged = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), block_table=table, **kw)
            finally:
                attn.set_num_threads(None)
            np.testing.assert_array_equal(paged.view(np.uint8), contiguous.view(np.uint8), f"page {page}, {threads} threads")
    if dtype != np.float32:
        return   # (a bfloat16 varlen call's values: test_varlen_reads_16bit_keys_as_they_are)
    s = 2   # and the values are attention's
    ref = seq_reference(q[cu_q[s]:], kc[cu_k[s]:], vc[cu_k[s]:], causal=True, window_size=window)
    assert_within(paged[cu_q[s]:], ref["out"],
                  seq_bound(q[cu_q[s]:], kc[cu_k[s]:], vc[cu_k[s]:], ref["out"], dtype=np.float32, causal=True,
                            window_size=window), "sequence 2")


@pytest.mark.parametrize("E", [64, 80, 256])
def test_float16_keys_widened_once_give_float32s_bits(E, simd, rng):
    """A float16 K/V's register tiles read its rows widened to float32 once per thread (attn._kernels'
    _pack_wide: the thread's copy of its matrix's keys, appended tile by tile, shared by the blocks and
    query heads after it, started afresh for another sequence or past its size), where each block
    widened each tile it read. The output equals, bit for bit, the same call over the query, keys and
    values widened to float32 beforehand (no widening in the kernel) with its out rounded to float16:
    a mixed varlen batch over pages of 16 and 128 and packed FlashAttention rows [total, H_kv, E]
    (strided), and SDPA over contiguous rows, GQA 4/1 and 2/2, on 1 to 3 threads and every SIMD path;
    a block of at most four rows reads K/V as stored (the decode rows' products) in such a call.
    E = 256's 2,100-key sequence is past the copy (ATTN_PACK_WIDE_MAX_BYTES: its tiles widen their
    own, the same bits); a paged call over fewer keys than a tile still reads its tiles from the copy
    (cut at every page end, they would sum in another order)."""
    f32 = lambda x: x.astype(np.float32)   # noqa: E731
    bits = lambda a: np.ascontiguousarray(a).view(np.uint16)   # noqa: E731
    # (the 2-row sequence: with 2 query heads a K/V head, a block of 4 rows, the decode rows' products)
    q_lens, k_lens = [1, 300, 40, 2, 1], [700, 300, 2100 if E == 256 else 1300, 200, 90]
    cu_q, cu_k = np.cumsum([0] + q_lens).astype(np.int32), np.cumsum([0] + k_lens).astype(np.int32)
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    for H, H_kv in ((4, 1), (4, 2)):
        q = rng.standard_normal((cu_q[-1], H, E)).astype(np.float16)
        calls = []
        for page in (16, 128):
            k, v, table = paged_pool(rng, k_lens, page, H_kv, E, E, np.float16)
            calls.append((lambda q, k, v, table=table: flash_attn_varlen_func(
                q, k, v, *args, causal=True, block_table=table), k, v))
        k, v = (rng.standard_normal((cu_k[-1], H_kv, E)).astype(np.float16) for _ in range(2))
        calls.append((lambda q, k, v: flash_attn_varlen_func(q, k, v, *args, causal=True), k, v))
        for call, k, v in calls:
            want = bits(call(f32(q), f32(k), f32(v)).astype(np.float16))
            for threads in (1, 2, 3):
                attn.set_num_threads(threads)
                try:
                    np.testing.assert_array_equal(bits(call(q, k, v)), want, f"H{H}/{H_kv}, {threads} threads")
                finally:
                    attn.set_num_threads(None)
        # a call over fewer keys than a tile: over pages shorter than one, the copy all the same
        short_q, short_k = [30, 2], [60, 40]
        cu_sq, cu_sk = (np.cumsum([0] + n).astype(np.int32) for n in (short_q, short_k))
        qh = rng.standard_normal((cu_sq[-1], H, E)).astype(np.float16)
        k, v, table = paged_pool(rng, short_k, 16, H_kv, E, E, np.float16)
        short = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_sq, cu_sk, 30, 60, causal=True,   # noqa: E731
                                                       block_table=table)
        np.testing.assert_array_equal(bits(short(qh, k, v)), bits(short(f32(qh), f32(k), f32(v)).astype(np.float16)),
                                      f"fewer keys than a tile, H{H}/{H_kv}")
        qs = rng.standard_normal((2, H, 600, E)).astype(np.float16)   # [B, H, L, E], contiguous rows
        ks, vs = (rng.standard_normal((2, H_kv, 600, E)).astype(np.float16) for _ in range(2))
        got = attn.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, num_threads=2)
        want = attn.scaled_dot_product_attention(f32(qs), f32(ks), f32(vs), is_causal=True, enable_gqa=True)
        np.testing.assert_array_equal(bits(got), bits(want.astype(np.float16)), f"SDPA H{H}/{H_kv}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, "int8", "float8"],
                         ids=["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("H,H_kv,E", [(4, 1, 64), (8, 2, 64), (16, 8, 64), (8, 8, 64), (8, 4, 80)])
def test_decode_reads_key_rows_whole(dtype, H, H_kv, E, rng):
    """Decode over FlashAttention's layout (a key row holds every K/V head: [.., S, H_kv, E]) runs each
    key chunk of a sequence over all its K/V heads, key tiles outermost, each tile's products a few keys
    of every head at a time so the rows are read in address order (attn._kernels' _flash_heads,
    FN(heads_tile)), each head's sums those of one head alone: paged (pages of 16 and 256) and
    contiguous, on 1 to 3 threads, every cache dtype (E = 80: columns past the last vector), the output
    equals bit for bit the [B, H, S, E] SDPA of the same values (one head per item; the dtypes the dense
    call takes) and lies within the rounding bound of the float64 reference."""
    from attn import Q8Tensor

    B, n = 2, 1100   # split keys: 4 chunks of 275 (tiles cut at pages of 16 and 256)
    widened = dtype in ("int8", "float8")   # a float32 query over the cache
    q = rng.standard_normal((B, 1, H, E)).astype(np.float32 if widened else dtype)
    if dtype == "int8":
        as_cache, values = Q8Tensor.quantize, (lambda x: x.dequantize())
    else:
        cache_dtype = attn._dtypes.float8("float8_e4m3fn") if dtype == "float8" else dtype
        as_cache, values = (lambda x: x.astype(cache_dtype)), (lambda x: x)
    results = []
    for page in (16, 256):
        k, v, table = paged_pool(rng, [n] * B, page, H_kv, E, E, np.float32)
        kc = np.stack([gather(k, table[s], n) for s in range(B)])
        vc = np.stack([gather(v, table[s], n) for s in range(B)])
        kp, vp, kcc, vcc = as_cache(k), as_cache(v), as_cache(kc), as_cache(vc)
        for threads in (1, 2, 3):
            attn.set_num_threads(threads)
            try:
                paged = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=np.full(B, n), block_table=table, causal=True)
                contiguous = flash_attn_with_kvcache(q, kcc, vcc, cache_seqlens=np.full(B, n), causal=True)
            finally:
                attn.set_num_threads(None)
            np.testing.assert_array_equal(paged.view(np.uint8), contiguous.view(np.uint8))
            results.append(paged)
        if not widened:   # the [B, H, S, E] SDPA: one K/V head per item, read row by row
            sdpa = attn.scaled_dot_product_attention(
                np.ascontiguousarray(q.transpose(0, 2, 1, 3)), np.ascontiguousarray(kc.astype(dtype).transpose(0, 2, 1, 3)),
                np.ascontiguousarray(vc.astype(dtype).transpose(0, 2, 1, 3)), is_causal="lower_right", enable_gqa=True)
            np.testing.assert_array_equal(paged.view(np.uint8), sdpa.transpose(0, 2, 1, 3).view(np.uint8))
        kd, vd = np.asarray(values(kcc), np.float64), np.asarray(values(vcc), np.float64)
        for s in range(B):
            qs = q[s]
            if dtype == "int8":
                from test_kv_cache_int8 import kernel_query
                qs = kernel_query(q[s].transpose(1, 0, 2)).transpose(1, 0, 2)
            ref = seq_reference(qs, kd[s], vd[s], causal=True)
            bound = seq_bound(qs, kd[s], vd[s], ref["out"], dtype=np.float32 if widened else dtype, causal=True)
            assert_within(paged[s], ref["out"], bound, f"page {page} sequence {s}")
    for r in results[1:3]:
        np.testing.assert_array_equal(r.view(np.uint8), results[0].view(np.uint8))
