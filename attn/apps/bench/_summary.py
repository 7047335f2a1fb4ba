"""The benchmark summary: a table a newcomer reads at a glance, then the details.

Order: what ran where (the CPU named: model, family/model, SIMD path, cores);
the headline table (median time per call of each contender, then one ratio per
row: the paired cython/torch ratio with its middle half, and the kernel's
GFLOP/s as a percentage of a GEMM measured in the same run); memory; other
groups (e.g. decode); what was skipped and why; then, per group, the details
(min times, rounds, max abs differences from the references).

Only the paired ratio is printed as the cython/torch figure: the ratio of the
two medians (pytest-benchmark times the contenders one after the other) moves
with the machine's speed between the two stretches, so it stays in the details.
"""

from __future__ import annotations

import os

from . import TORCH_CPU_COMMAND, TORCH_CPU_WHERE
from . import _common as ab

NAMES = (
    ("torch ", "torch.nn.functional.scaled_dot_product_attention (PyTorch)"),
    ("cython", "attn.scaled_dot_product_attention's fused kernel (backend=\"cython\", the default)"),
    ("numpy ", "attn's NumPy matrix form (backend=\"numpy\")"),
    ("loop  ", "attn's per-row Python loop (backend=\"loop\")"),
)

def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _groups(results):
    groups = {}
    for r in results.timings:
        groups.setdefault(r["group"], []).append(r)
    return groups


def _time(r):
    return ab.fmt_time(r.get("median")) if r else "-"


def torch_note(settings, env):
    """Why the torch column is empty (lines), or []."""
    if "torch" not in settings.backends:
        return ["no torch column: torch is not among --backends"]
    if env.get("torch") is None:
        return [f"no torch column: {env.get('torch_error')}.",
                f"  To compare with it, install PyTorch's CPU build: {TORCH_CPU_COMMAND}",
                f"  ({TORCH_CPU_WHERE})."]
    return []


def machine_lines(settings, results, env):
    b = env.get("backends") or {}
    kernel = (f"fused kernel with SIMD path {b.get('simd')}" if b.get("cython")
              else f"fused kernel NOT built: {b.get('cython_error')}")
    who = f"attn {env.get('attn_version', '?')} ({kernel})"
    who += f" and torch {env['torch_version']} (CPU capability {env.get('torch_cpu')}), both" if env.get("torch") else ""
    la = results.loadavg
    end = (la["end"] or _loadavg() or [None])[0]
    proxy = (["capped AVX2 proxy: ATTN_SIMD=avx2 for attn, ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 "
              "for torch (an AVX2-only CPU's picture, on this CPU)"] if env.get("capped_avx2") else [])
    return [
        f"{who} on {settings.threads} threads; numpy {env.get('numpy_version')}",
        f"CPU: {ab.cpu_description(b.get('simd'))}; "
        f"load average {la['start'] and la['start'][0]} at start, {end} at end",
    ] + proxy


def busy_note(results):
    """A warning (lines) when other work kept the cores busy (load average above half the cores), or []."""
    loads = [la[0] for la in (results.loadavg["start"], results.loadavg["end"]) if la]
    cores = ab.n_cores()
    if not loads or max(loads) <= 0.5 * cores:
        return []
    return [f"note: the machine was busy (load average up to {max(loads):.1f} on {cores} cores): multi-threaded",
            "  calls (numpy's BLAS, torch, attn) lose the most, so times can even reorder; the paired",
            "  ratios are the robust figures."]


def headline_table(settings, results):
    """Per group: median times, the paired cython/torch ratio (middle half), cython GFLOP/s (% of GEMM).

    Returns the lines and whether the kernel outran the GEMM it is compared with in any group.
    """
    groups = _groups(results)
    head = (f"{'group':<42} {'torch':>10} {'cython':>10} {'numpy':>10} {'loop':>10}   "
            f"{'paired':>6} {'middle half':>11}  {'cython GFLOP/s (% GEMM, % peak)':>32}")
    out = [f"{'':<42} {'median time per call (lower is better)':^43}   {'cython/torch (below 1: attn faster)':<35}",
           head]
    above_gemm = False
    for name, rows in groups.items():
        by = {r["backend"]: r for r in rows if r.get("median")}
        pr = results.paired.get(name)
        cy = by.get("cython")
        paired = f"{pr['ratio']:>5.2f}x {pr['ratio_q1']:>5.2f}-{pr['ratio_q3']:<5.2f}" if pr else f"{'-':>6} {'':>11}"
        rate = "-"
        if cy:
            peak = f", {cy['pct_peak']:.0f}%" if cy.get("pct_peak") is not None else ""
            rate = f"{cy['gflops']:.1f} ({cy['pct_gemm']:.0f}%{peak})"
            if cy["pct_gemm"] > 100:
                rate += " >GEMM"
                above_gemm = True
        out.append(f"{name[:42]:<42} " + " ".join(f"{_time(by.get(b)):>10}" for b in ab.BACKEND_ORDER)
                   + f"   {paired}  {rate:>32}")
    return out, above_gemm


def gemm_lines(results):
    """The GEMMs measured in this run, one line each: ``    f32 n=1024: 180 GFLOP/s (torch.matmul)``."""
    return [f"    {key}: {g['gflops']:.0f} GFLOP/s ({g['by']})" for key, g in sorted(results.gemm.items())]


def peak_lines(results):
    """The FMA peaks measured in this run: ``    f32: 190 GFLOP/s (avx512 path, 2 threads)``."""
    return [f"    {d}: {p['gflops']:.0f} GFLOP/s ({p['path']} path, {p['threads']} threads"
            + (f"; {p['of']} multiply-adds" if p.get("of") != d else "") + ")"
            for d, p in sorted(getattr(results, "peak", {}).items())]


def legend_lines(results, above_gemm=False):
    lines = [f"{name}: {what}" for name, what in NAMES]
    lines += [
        "paired: the one cython/torch ratio this summary stands behind. cython and torch are timed in",
        "  alternating blocks of calls about 0.1 s long; the figure is the median of the per-block ratios",
        "  (the machine's speed drifts over seconds, which moves a ratio of two medians timed one after",
        "  the other, not this one); middle half: the middle 50% of those ratios. The ratio of the",
        "  medians is only in the details (--details).",
        "GFLOP/s: useful flops (4*E per allowed query-key pair) per second; % of GEMM: of the best rate",
        f"  of {ab.GEMM_REPEATS} square BLAS matrix products (n x n, about the group's flops, same dtype and",
        "  threads) measured in this run:",
    ] + (gemm_lines(results) or ["    (none measured)"])
    lines += ["% peak: of the CPU's multiply-add peak measured in this run on attn's SIMD path (independent",
              "  FMA chains in registers on every thread from one barrier, attn/apps/bench/_yardsticks.h), which no BLAS",
              "  or problem size moves:"] + (peak_lines(results) or ["    (none measured)"])
    if above_gemm:
        lines.append("  >GEMM: the fused kernel ran faster than that matrix product. A GEMM is not a ceiling:")
        lines.append("  the kernel's small tiles stay in cache, and a GEMM's rate depends on its size and the BLAS.")
    lines.append("These ratios differ between CPUs (vector width, cache sizes, the BLAS), even of the same family.")
    return lines


def skipped_lines(results):
    """What was skipped and why (one line each), or []."""
    skipped = getattr(results, "skipped", None) or []
    if not skipped:
        return []
    return [f"skipped ({len(skipped)}):"] + [f"  {test}: {reason}" for test, reason in skipped]


def memory_lines(results):
    rows = [m for m in results.memory]
    if not rows:
        return []
    shapes = {}
    for m in rows:
        shapes.setdefault(m["label"], {})[m["backend"]] = m
    out = ["memory: what one call allocates at its peak beyond its own output (peak RSS growth minus the",
           "  output, each in a fresh process; the inputs are allocated before the baseline)",
           f"{'shape':<42} " + " ".join(f"{b:>10}" for b in ab.BACKEND_ORDER) + f"   {'output':>10}"]
    for label, by in shapes.items():
        cells, output = [], None
        for b in ab.BACKEND_ORDER:
            m = by.get(b)
            if m is None or m.get("skipped"):
                cells.append(f"{'-':>10}")
            else:
                cells.append(f"{m['extra_mib']:>6.1f} MiB")
                output = m["output_mib"]
        out.append(f"{label:<42} " + " ".join(cells)
                   + (f"   {output:>6.1f} MiB" if output is not None else ""))
    return out


def other_benchmarks(benchsession):
    """pytest-benchmark records of group files other than test_bench_sdpa (e.g. decode)."""
    out = []
    for b in getattr(benchsession, "benchmarks", None) or []:
        info = getattr(b, "extra_info", {}) or {}
        if "case" in info or not b:
            continue
        out.append(b)
    return out


def other_lines(benchmarks, paired=None):
    groups = {}
    for b in benchmarks:
        groups.setdefault(b.group or b.name, []).append(b)
    lines = ["other groups: median time per call"]
    for name, rows in groups.items():
        med, extra = {}, []
        for b in rows:
            info = b.extra_info
            who = info.get("backend") or info.get("contender") or b.name
            med[who] = b.stats.median
            if "kv_gbps" in info:
                extra.append(f"{who} K+V {info['kv_gbps']:.1f} GB/s")
        cells = "  ".join(f"{who} {ab.fmt_time(t)}" for who, t in med.items())
        pr = (paired or {}).get(name)
        if pr:  # e.g. test_bench_backward.py's paired ratio: the one figure, as in the main table
            ratio = f"  cython/torch {pr['ratio']:.2f}x paired (middle half {pr['ratio_q1']:.2f}-{pr['ratio_q3']:.2f})"
            if "pct_gemm" in pr:  # (its cython time is the paired one's)
                ratio += f"; cython {pr['gflops']:.1f} GFLOP/s ({pr['pct_gemm']:.0f}% of GEMM" + (
                    f", {pr['pct_peak']:.0f}% of peak)" if "pct_peak" in pr else ")")
        else:
            ratio = (f"  cython/torch {ab.fmt_ratio(med['cython'], med['torch'])} (ratio of medians, not paired)"
                     if med.get("cython") and med.get("torch") else "")
        lines.append(f"  {name}: {cells}{ratio}" + (f"; {', '.join(extra)}" if extra else ""))
    return lines


def vllm_lines(reports):
    """attn against vLLM's CPU kernel (test_bench_vllm.py): per build, its yardsticks and rows."""
    from attn.apps.bench.vllm_kernels import _line, yardstick_lines

    lines = ["attn / vLLM's cpu_attention_with_kv_cache, same logical batch, paired (below 1: attn faster); "
             "roofline share = max(bytes / read bandwidth, flops / product peak, scores / softmax rate) / time"]
    for report in reports:
        lines.append(f"  [{report['build']}]")
        lines.extend("  " + line for line in yardstick_lines(report))
        lines.extend("    " + _line(row) for row in report["rows"])
    return lines


def paired_only_lines(paired):
    """Groups timed only as a pair (e.g. the decode table): both times and the paired ratio."""
    lines = ["paired groups (timed only in alternating blocks): time per call of each, paired ratio"]
    for name, pr in paired.items():
        if "ratio" not in pr:  # e.g. the decode stream rate: bytes per second, not a pair
            if "fraction_of_copy" in pr:
                lines.append(f"  {name}: {ab.fmt_time(pr['seconds'])}, K+V {pr['kv_bytes_per_s'] / 1e9:.1f} GB/s"
                             f" = {pr['fraction_of_copy']:.2f} of copy bandwidth "
                             f"({pr['copy_bytes_per_s'] / 1e9:.1f} GB/s read + write)")
            continue
        who = [k for k in pr if k in ("torch", "cython", "int8", "e4m3fn", "e5m2", "f16", "bf16", "f32", "reference",
                                      "variant")]
        cells = ", ".join(f"{k} {ab.fmt_time(pr[k])}" for k in who if isinstance(pr[k], (int, float)))
        half = next((h for h in ("f16", "bf16") if h in who), None)
        if "torch" in who:
            label = "cython/torch"
        elif "int8" in who:  # test_decode_int8_vs_float16_cache: float16 time / int8 time
            label = "f16/int8 cache"
        elif who and who[0] in ("e4m3fn", "e5m2"):  # test_decode_float8_vs_16bit_cache: 16-bit / float8 time
            label = f"{half}/{who[0]} cache"
        elif "variant" in who:  # test_bench_variants.py: time(variant) / time(reference)
            label = "variant/reference"
        else:
            label = f"f32/{half} cache" if half else "ratio"
        lines.append(f"  {name}: {cells}; {label} {pr['ratio']:.2f}x "
                     f"(middle half {pr['ratio_q1']:.2f}-{pr['ratio_q3']:.2f})")
    return lines


def correctness_line(results):
    diffs = [(r.get("diff_torch"), r.get("diff_ref64"), r["case_obj"].dtype) for r in results.timings
             if not r.get("skipped") and r.get("diff_ref64") is not None]
    if not diffs:
        return []
    worst = {}
    for dt, d64, dtype in diffs:
        worst[dtype] = max(worst.get(dtype, 0.0), d64)
    text = ", ".join(f"{dtype} {worst[dtype]:.1e}" for dtype in sorted(worst))
    return [f"correctness: every output checked before timing; largest abs difference from the float64 "
            f"reference: {text}"]


def detail_lines(settings, results):
    """Per group: median and min, rate, max abs differences, rounds; paired block counts."""
    lines = ["details per group (max|d| = max abs difference vs torch in the same dtype / vs float64)"]
    for name, rows in _groups(results).items():
        case = rows[0]["case_obj"]
        lines.append("")
        lines.append(f"[{name}]  {case.flops / 1e9:.3g} GFLOP/call"
                     + (f", K+V {case.kv_bytes / 2**20:.0f} MiB" if case.kind == "decode" else ""))
        for r in sorted(rows, key=lambda r: ab.BACKEND_ORDER.index(r["backend"])):
            if r.get("skipped"):
                lines.append(f"  {r['backend']:<7} skipped: {r['skipped']}")
                continue
            rate = ""
            if r.get("median"):
                rate = f"{r['gflops']:7.1f} GFLOP/s ({r['pct_gemm']:3.0f}% of GEMM {r['gemm']['gflops']:.0f}" + (
                    f", {r['pct_peak']:3.0f}% of peak {r['peak']['gflops']:.0f})" if r.get("pct_peak") else ")")
                if case.kind == "decode":
                    rate += f"  K+V {r['kv_gbps']:.1f} GB/s"
            mn = f"(min {ab.fmt_time(r['min'])})" if r.get("min") else ""
            lines.append(
                f"  {r['backend']:<7} {ab.fmt_time(r.get('median')):>11} {mn:<16} {rate:<32} "
                f"max|d| {ab.fmt_diff(r.get('diff_torch')):>7} / {ab.fmt_diff(r.get('diff_ref64')):>7}"
                + (f"  rounds {r['rounds']}" if r.get("rounds") else ""))
        med = {r["backend"]: r.get("median") for r in rows}
        if not settings.disabled:
            lines.append(
                f"  ratios of medians (timed one after the other; for cython/torch trust the paired line): "
                f"loop/numpy {ab.fmt_ratio(med.get('loop'), med.get('numpy'))}   "
                f"numpy/cython {ab.fmt_ratio(med.get('numpy'), med.get('cython'))}   "
                f"cython/torch {ab.fmt_ratio(med.get('cython'), med.get('torch'))}")
            pr = results.paired.get(name)
            if pr:
                lines.append(
                    f"  paired: torch {ab.fmt_time(pr['torch'])}, cython {ab.fmt_time(pr['cython'])}, "
                    f"cython/torch {pr['ratio']:.2f}x (middle half {pr['ratio_q1']:.2f}-{pr['ratio_q3']:.2f}; "
                    f"{pr['blocks']} alternating blocks of {pr['calls_per_block']} calls)")
            if case.kind == "seed":
                lines.append("  (the seed article measured loop/matrix 5.4x: 5.669 ms vs 1.050 ms on its machine)")
    return lines


def summary_lines(settings, results, env, benchsession=None, details=True):
    """All the summary's lines (empty when nothing ran)."""
    others = [] if settings.disabled else other_benchmarks(benchsession)
    vllm = getattr(results, "vllm", None)  # (test_bench_vllm.py's reports)
    if not (results.timings or results.memory or others or results.paired or vllm):
        return []
    lines = machine_lines(settings, results, env)
    lines += torch_note(settings, env) + busy_note(results)
    if results.timings:
        lines.append("")
        if settings.disabled:
            lines.append("timing disabled (--benchmark-disable): every contender ran once, checked only")
        else:
            table, above_gemm = headline_table(settings, results)
            lines.extend(table)
            lines.append("")
            lines.extend(legend_lines(results, above_gemm))
        lines.extend(correctness_line(results))
    if results.memory:
        lines.append("")
        lines.extend(memory_lines(results))
    if others:
        lines.append("")
        lines.extend(other_lines(others, results.paired))
        if results.gemm and not results.timings:  # (with a table, its legend lists them)
            lines.append(f"% of GEMM: of the best of {ab.GEMM_REPEATS} square BLAS matrix products measured "
                         f"in this run (same dtype and threads):")
            lines.extend(gemm_lines(results))
    shown = set(_groups(results)) | {b.group or b.name for b in others}
    paired_only = {name: pr for name, pr in results.paired.items() if name not in shown}
    if paired_only and not settings.disabled:
        lines.append("")
        lines.extend(paired_only_lines(paired_only))
    if vllm:
        lines.append("")
        lines.extend(vllm_lines(vllm))
    skipped = skipped_lines(results)
    if skipped:
        lines.append("")
        lines.extend(skipped)
    if details and results.timings:
        lines.append("")
        lines.extend(detail_lines(settings, results))
    return lines
