"""attn.flash's serving calls, as paired ratios (_paired.py): each against what it replaces.

* paged decode: one decode row of H = 32 query heads over 8 key/value heads,
  E = 128, float32, at S = 4096 and 16384 keys held in pages of 16 or 256
  keys scattered in a shuffled pool, against the same call over a
  contiguous cache (``flash_attn_with_kvcache`` both; the pages are read in
  place, so the ratio is the cost of paging);
* mixed batch: 4 chunked-prefill chunks of 512 rows and 28 decode rows over
  contexts of 256 to 4096 keys (H = 8 over 2, E = 64, float32, 16-key pages)
  in one ``flash_attn_varlen_func`` call with a block table, against (a) the
  separate calls it replaces (one per prefill chunk, one decode call for the
  28 rows) and (b) torch SDPA over the gathered, padded and masked batch
  (what a user does without the API: gather every sequence's keys out of
  its pages, pad to the longest, mask padding and causality);
* paged = contiguous (issue 46): a prefill of 2 x 1024 causal rows (H = 32
  over 8, E = 128, float32 and bfloat16) and the mixed batch above, over
  pages of 16 to 256 keys, each against the same call over its keys packed
  contiguously (no block table);
* paged = contiguous for a decode batch: 16 sequences of one query row over
  1k to 4k keys (H = 32 over 8, E = 128, float32 and bfloat16: vLLM's
  decode batch), pages of 16 or 256 keys against the same
  ``flash_attn_varlen_func`` call over the keys packed contiguously (both
  take the decode plan: a packed call once ran one matrix per query head,
  3.8x the paged call's time);
* flash_attn_func in FlashAttention's layout [B, L, H, E], read in place,
  against attn's own SDPA over the same memory viewed as [B, H, L, E] (the
  new surface's cost) and over a contiguous [B, H, L, E] copy (the layout's
  cost: every head's rows are H E elements apart), T = 1024, H = 8, E = 64,
  causal.

Each ratio is time(new) / time(reference): below 1, the new call is faster.
Results go to the summary's paired table (``bench_results.paired``). Run:

    python -m attn bench -k flash
    ATTN_BENCH_FLASH_SMALL=1 python -m pytest -p attn.apps.bench.plugin attn/apps/bench/test_bench_flash.py \
        --benchmark-disable    # small sizes, one block: a smoke test
"""

from __future__ import annotations

import functools
import gc
import os

import numpy as np
import pytest

from attn.apps.bench._paired import paired_ratio

SMALL = os.environ.get("ATTN_BENCH_FLASH_SMALL", "") not in ("", "0")
DECODE_S = (256, 1024) if SMALL else (4096, 16384)
PAGES = (16, 256)
PAGED_PAGES = (16, 32, 64, 128, 256)  # issue 46's "paged = contiguous" range


def _flash():
    import attn

    if not attn.backends()["cython"]:
        pytest.skip("attn's Cython extension is not built")
    from attn import flash

    return flash


def _record(bench_results, group, r):
    bench_results.paired[group] = dict(r, reference=r["a"], variant=r["b"])
    print(f"\n{group}: {r['ratio']:.3f}x (middle half {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})")


def _run(fa, fb, bench_settings):
    gc.collect()
    return paired_ratio(fa, fb, blocks=1 if bench_settings.disabled else None, budget=bench_settings.paired_budget)


def _pool(rng, lengths, page, H_kv, E, spare=8):
    """Pages [n_pages, page, H_kv, E] for K and V in a shuffled pool, and the block table [B, max_pages]."""
    need = [-(-int(n) // page) for n in lengths]
    order = rng.permutation(sum(need) + spare).astype(np.int32)
    table = np.zeros((len(lengths), max(need)), np.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = order[at:at + n]
        at += n
    shape = (len(order), page, H_kv, E)
    return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32), table


def _gather(pages, row, n):
    return pages[row[: -(-n // pages.shape[1])]].reshape((-1,) + pages.shape[2:])[:n]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("S", DECODE_S)
def test_paged_decode(S, page, bench_settings, bench_results):
    flash = _flash()
    rng = np.random.default_rng(S + page)
    H, H_kv, E = 32, 8, 128
    k_pages, v_pages, table = _pool(rng, [S], page, H_kv, E)
    k, v = _gather(k_pages, table[0], S)[None], _gather(v_pages, table[0], S)[None]  # [1, S, H_kv, E]
    q = rng.standard_normal((1, 1, H, E), np.float32)
    lengths = np.array([S], np.int32)
    contiguous = functools.partial(flash.flash_attn_with_kvcache, q, k, v, cache_seqlens=lengths)
    paged = functools.partial(flash.flash_attn_with_kvcache, q, k_pages, v_pages, cache_seqlens=lengths,
                              block_table=table)
    np.testing.assert_allclose(paged(), contiguous(), atol=1e-5)  # the same keys
    r = _run(contiguous, paged, bench_settings)
    _record(bench_results, f"paged decode S={S} page={page} H=32/8 E=128 / contiguous", r)


class MixedBatch:
    """4 prefill chunks of 512 rows and 28 decode rows over paged contexts of 256..4096 keys."""

    H, H_KV, E = 8, 2, 64

    def __init__(self, page=16):
        rng = np.random.default_rng(7)
        chunk, lo, hi = (64, 64, 512) if SMALL else (512, 256, 4096)
        self.q_len = np.array([chunk] * 4 + [1] * 28)
        self.k_len = np.linspace(lo, hi, 32).astype(int)[rng.permutation(32)]
        self.k_len[:4] = np.maximum(self.k_len[:4], chunk)  # a chunk's keys include its own rows
        self.k, self.v, self.table = _pool(rng, self.k_len, page, self.H_KV, self.E)
        self.cu_q = np.concatenate([[0], np.cumsum(self.q_len)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(self.k_len)]).astype(np.int32)
        self.q = rng.standard_normal((int(self.cu_q[-1]), self.H, self.E), np.float32)

    def one_call(self, flash):
        return flash.flash_attn_varlen_func(self.q, self.k, self.v, self.cu_q, self.cu_k, int(self.q_len.max()),
                                            int(self.k_len.max()), causal=True, block_table=self.table)

    def contiguous_call(self, flash):
        """The same call over the keys packed contiguously (k [total_k, H_kv, E], no block table)."""
        k, v = self.packed()
        return flash.flash_attn_varlen_func(self.q, k, v, self.cu_q, self.cu_k, int(self.q_len.max()),
                                            int(self.k_len.max()), causal=True)

    def packed(self):
        if not hasattr(self, "_packed"):
            self._packed = tuple(np.concatenate([_gather(x, self.table[s], int(n)) for s, n in enumerate(self.k_len)])
                                 for x in (self.k, self.v))
        return self._packed

    def separate_calls(self, flash):
        """One call per prefill chunk (its own keys' pages) and one decode call for the 28 rows."""
        out = []
        for s in range(4):
            rows = slice(self.cu_q[s], self.cu_q[s + 1])
            out.append(flash.flash_attn_varlen_func(
                self.q[rows], self.k, self.v, np.array([0, self.q_len[s]], np.int32),
                np.array([0, self.k_len[s]], np.int32), int(self.q_len[s]), int(self.k_len[s]), causal=True,
                block_table=self.table[s:s + 1]))
        q_dec = self.q[self.cu_q[4]:, None]  # [28, 1, H, E]
        out.append(flash.flash_attn_with_kvcache(q_dec, self.k, self.v, cache_seqlens=self.k_len[4:],
                                                 block_table=self.table[4:], causal=True)[:, 0])
        return np.concatenate(out)

    def torch_padded(self, torch):
        """Gather, pad and mask: q [32, H, 512, E], k, v [32, H_kv, S_max, E], one SDPA call."""
        B, L, S = 32, int(self.q_len.max()), int(self.k_len.max())
        q = torch.zeros((B, self.H, L, self.E))
        k = torch.zeros((B, self.H_KV, S, self.E))
        v = torch.zeros((B, self.H_KV, S, self.E))
        mask = torch.zeros((B, 1, L, S), dtype=torch.bool)
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        for s in range(B):
            n, m = int(self.q_len[s]), int(self.k_len[s])
            q[s, :, :n] = torch.from_numpy(self.q[self.cu_q[s]:self.cu_q[s + 1]]).transpose(0, 1)
            k[s, :, :m] = torch.from_numpy(_gather(self.k, self.table[s], m)).transpose(0, 1)
            v[s, :, :m] = torch.from_numpy(_gather(self.v, self.table[s], m)).transpose(0, 1)
            mask[s, 0] = (j < m) & (j <= i + m - n)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return torch.cat([out[s, :, :int(self.q_len[s])].transpose(0, 1) for s in range(B)])


@pytest.mark.parametrize("against", ["separate calls", "torch padded"])
def test_mixed_batch(against, bench_settings, bench_results):
    flash = _flash()
    batch = MixedBatch()
    one = functools.partial(batch.one_call, flash)
    if against == "separate calls":
        reference = functools.partial(batch.separate_calls, flash)
        np.testing.assert_allclose(one(), reference(), atol=1e-5)
    else:
        torch = pytest.importorskip("torch")
        reference = functools.partial(batch.torch_padded, torch)
        with torch.inference_mode():
            np.testing.assert_allclose(one(), reference().numpy(), atol=1e-4)
    r = _run(reference, one, bench_settings)
    _record(bench_results, f"mixed batch 4x{batch.q_len[0]} prefill + 28 decode, contexts "
                           f"{batch.k_len.min()}..{batch.k_len.max()}, H=8/2 E=64 / {against}", r)


@pytest.mark.parametrize("page", PAGED_PAGES)
def test_paged_mixed_batch(page, bench_settings, bench_results):
    """The mixed batch over pages of `page` keys against the same call over a contiguous (packed) cache."""
    flash = _flash()
    batch = MixedBatch(page)
    paged = functools.partial(batch.one_call, flash)
    contiguous = functools.partial(batch.contiguous_call, flash)
    np.testing.assert_allclose(paged(), contiguous(), atol=1e-5)  # the same keys
    r = _run(contiguous, paged, bench_settings)
    _record(bench_results, f"mixed batch 4x{batch.q_len[0]} prefill + 28 decode, H=8/2 E=64, page={page} "
                           f"/ contiguous", r)


@pytest.mark.parametrize("page", PAGED_PAGES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_prefill(dtype, page, bench_settings, bench_results):
    """Prefill of 2 x T causal rows (H = 32 over 8, E = 128) reading its keys from pages of `page` keys
    in a shuffled pool, against the same ``flash_attn_varlen_func`` call over the keys packed contiguously."""
    flash = _flash()
    import attn

    T = 128 if SMALL else 1024
    H, H_kv, E = 32, 8, 128
    rng = np.random.default_rng(page)
    lengths = np.array([T, T])
    cu = np.array([0, T, 2 * T], np.int32)
    k_pages, v_pages, table = _pool(rng, lengths, page, H_kv, E)
    q = rng.standard_normal((2 * T, H, E), np.float32)
    if dtype == "bfloat16":
        bf16 = attn._dtypes.bfloat16()
        q, k_pages, v_pages = (x.astype(bf16) for x in (q, k_pages, v_pages))
    k, v = (np.concatenate([_gather(x, table[s], T) for s in range(2)]) for x in (k_pages, v_pages))  # [2T, H_kv, E]
    contiguous = functools.partial(flash.flash_attn_varlen_func, q, k, v, cu, cu, T, T, causal=True)
    paged = functools.partial(flash.flash_attn_varlen_func, q, k_pages, v_pages, cu, cu, T, T, causal=True,
                              block_table=table)
    tol = 1e-5 if dtype == "float32" else 2.0 ** -7  # bfloat16: one unit in the last place of the output
    np.testing.assert_allclose(np.asarray(paged(), np.float32), np.asarray(contiguous(), np.float32),
                               rtol=tol, atol=tol)  # the same keys, blocked at other boundaries
    r = _run(contiguous, paged, bench_settings)
    _record(bench_results, f"paged prefill 2x{T} causal H=32/8 E=128 {dtype} page={page} / contiguous", r)


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decode_batch(dtype, page, bench_settings, bench_results):
    """A decode batch (16 sequences, one query row each, 1k to 4k keys; H = 32 over 8, E = 128) reading its
    keys from pages of `page` keys in a shuffled pool, against the same ``flash_attn_varlen_func`` call
    over the keys packed contiguously."""
    flash = _flash()
    import attn

    B, lo, hi = (4, 64, 256) if SMALL else (16, 1024, 4096)
    H, H_kv, E = 32, 8, 128
    rng = np.random.default_rng(page + 1)
    lengths = rng.integers(lo, hi + 1, B)
    cu_q = np.arange(B + 1, dtype=np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    k_pages, v_pages, table = _pool(rng, lengths, page, H_kv, E)
    q = rng.standard_normal((B, H, E), np.float32)
    if dtype == "bfloat16":
        bf16 = attn._dtypes.bfloat16()
        q, k_pages, v_pages = (x.astype(bf16) for x in (q, k_pages, v_pages))
    k, v = (np.concatenate([_gather(x, table[s], int(n)) for s, n in enumerate(lengths)])
            for x in (k_pages, v_pages))  # [total_k, H_kv, E]
    contiguous = functools.partial(flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 1, int(hi), causal=True)
    paged = functools.partial(flash.flash_attn_varlen_func, q, k_pages, v_pages, cu_q, cu_k, 1, int(hi),
                              causal=True, block_table=table)
    tol = 1e-5 if dtype == "float32" else 2.0 ** -7  # bfloat16: one unit in the last place of the output
    np.testing.assert_allclose(np.asarray(paged(), np.float32), np.asarray(contiguous(), np.float32),
                               rtol=tol, atol=tol)  # the same keys
    r = _run(contiguous, paged, bench_settings)
    _record(bench_results, f"paged decode batch {B} x {lo}..{hi} keys H=32/8 E=128 {dtype} page={page} "
                           f"/ contiguous", r)


@pytest.mark.parametrize("against", ["SDPA same memory", "SDPA contiguous [B, H, L, E]"])
def test_flash_attn_func_layout(against, bench_settings, bench_results):
    """flash_attn_func on [B, L, H, E] against attn's SDPA over the same memory viewed as [B, H, L, E]
    (strided, read in place: the new surface's own cost) and over a contiguous copy (the layout's)."""
    flash = _flash()
    import attn

    T = 256 if SMALL else 1024
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, T, 8, 64), np.float32) for _ in range(3))  # [B, L, H, E]
    views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]  # [B, H, L, E]
    if against != "SDPA same memory":
        views = [np.ascontiguousarray(x) for x in views]
    sdpa = functools.partial(attn.scaled_dot_product_attention, *views, is_causal=True, backend="cython")
    func = functools.partial(flash.flash_attn_func, q, k, v, causal=True)
    np.testing.assert_allclose(func(), sdpa().transpose(0, 2, 1, 3), atol=1e-5)
    r = _run(sdpa, func, bench_settings)
    _record(bench_results, f"flash_attn_func [B, L, H, E] T={T} H=8 E=64 causal / {against}", r)
