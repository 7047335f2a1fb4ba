"""Plot (and tabulate) a saved benchmark run.

    python -m attn bench --full --json bench-full.json --plot bench-time-vs-T.png
    python -m attn.apps.bench.plot bench-full.json -o bench-time-vs-T.png --markdown

(in a clone: ``python -m pytest bench --bench-grid full --benchmark-json=bench-full.json``).
Reads pytest-benchmark's JSON (with the ``attn`` section the plugin adds). With
a T sweep (the full grid) it draws median time vs T per backend for the B=1
H=8 groups: one panel per dtype x (dense, causal), E=64 solid and E=128
dashed, log-log. Otherwise (quick and default grids: one T) a bar chart of
the median time per group and backend. ``--markdown`` prints a results table
(medians, ratios, GFLOP/s, memory) for the README. Needs matplotlib only for
the PNG (``pip install matplotlib``; from a clone ``pip install ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

BACKENDS = ("torch", "cython", "numpy", "loop")
COLORS = {"torch": "tab:red", "cython": "tab:blue", "numpy": "tab:green", "loop": "tab:gray"}


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "backend" not in info or not b.get("stats"):
            continue
        q = info["q_shape"]
        rows.append({
            "group": b.get("group") or info.get("group"),
            "backend": info["backend"],
            "median": b["stats"]["median"],
            "iqr": b["stats"].get("iqr"),
            "rounds": b["stats"].get("rounds"),
            "lead": tuple(q[:-2]),
            "T": q[-2],
            "S": info["k_shape"][-2],
            "E": q[-1],
            "dtype": info["dtype"],
            "causal": info["causal"],
            "mask": info.get("mask", "none"),
            "gflops": info.get("gflops"),
            "pct_gemm": info.get("pct_gemm"),
            "diff": info.get("max_abs_diff_vs_torch"),
            "diff64": info.get("max_abs_diff_vs_torch_f64"),
            "kv_gbps": info.get("kv_gbps"),
        })
    return data, rows


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r["lead"] == (1, 8) and r["T"] == r["S"] and r["mask"] == "none"]
    if len({r["T"] for r in grid}) < 2:
        return bars(rows, out, plt)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    for i, dtype in enumerate(("float32", "float64")):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            for backend in BACKENDS:
                for E, style in ((64, "-"), (128, "--")):
                    pts = sorted((r["T"], r["median"]) for r in grid
                                 if r["backend"] == backend and r["dtype"] == dtype
                                 and r["causal"] == causal and r["E"] == E)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, marker="o",
                                ms=3, color=COLORS[backend], label=f"{backend} E={E}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ts = sorted({r["T"] for r in grid})
            ax.set_xticks(ts)
            ax.set_xticklabels([str(t) for t in ts])
            ax.minorticks_off() if len(ts) > 1 else None
            ax.set_title(f"B=1 H=8 {dtype} {'causal' if causal else 'dense'}")
            ax.set_xlabel("T (= L = S)")
            ax.set_ylabel("median time per call (ms)")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not in this run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("attn: time vs T per backend (lower is better)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def bars(rows, out, plt):
    """Median time per group (one cluster each) and backend, log scale: runs without a T sweep."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    med = {(r["group"], r["backend"]): r["median"] for r in rows}
    present = [b for b in BACKENDS if any((g, b) in med for g in groups)]
    width = 0.8 / max(len(present), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 5.5))
    for i, backend in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j, g in enumerate(groups) if (g, backend) in med]
        ys = [med[(g, backend)] * 1e3 for g in groups if (g, backend) in med]
        ax.bar(xs, ys, width, color=COLORS[backend], label=backend)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g.replace(" E=", "\nE=").replace(": ", ":\n") for g in groups], fontsize=7)
    ax.set_ylabel("median time per call (ms, log scale)")
    ax.set_title("attn: median time per call per group and backend (lower is better)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def _t(s):
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def _r(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def markdown(data, rows):
    groups = defaultdict(dict)
    for r in rows:
        groups[r["group"]][r["backend"]] = r
    print("| group | torch | cython | numpy | loop | loop/numpy | numpy/cython | cython/torch "
          "| cython GFLOP/s (% of GEMM) | max abs diff vs torch (cython / numpy / loop) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, g in groups.items():
        med = {b: g[b]["median"] if b in g else None for b in BACKENDS}
        cy = g.get("cython")
        rate = (f"{cy['gflops']:.1f} ({cy['pct_gemm']:.0f}%)" if cy and cy.get("gflops") and cy.get("pct_gemm")
                else "-")
        if cy and cy.get("kv_gbps") and "decode" in name:
            rate += f", K+V {cy['kv_gbps']:.1f} GB/s"
        diffs = " / ".join(f"{g[b]['diff']:.1e}" if b in g and g[b]["diff"] is not None else "-"
                           for b in ("cython", "numpy", "loop"))
        print(f"| {name} | " + " | ".join(_t(med[b]) for b in BACKENDS)
              + f" | {_r(med['loop'], med['numpy'])} | {_r(med['numpy'], med['cython'])}"
              + f" | {_r(med['cython'], med['torch'])} | {rate} | {diffs} |")
    mem = (data.get("attn") or {}).get("memory") or []
    mem = [m for m in mem if "growth_mib" in m]
    if mem:
        print()
        print("| shape | backend | peak RSS growth of one call | beyond the output | call time |")
        print("|---|---|---|---|---|")
        for m in mem:
            print(f"| B={m['B']} H={m['H']} L=S={m['L']} E={m['E']} {m['dtype']} | {m['backend']} "
                  f"| {m['growth_mib']:.1f} MiB | {m['extra_mib']:.1f} MiB | {_t(m['seconds'])} |")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn.apps.bench.plot",
                                description="Plot/tabulate the JSON of a benchmark run.")
    p.add_argument("json", help="file written by `python -m attn bench --json FILE` "
                                "(or `python -m pytest bench --benchmark-json=FILE`)")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: no plot)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown results table")
    a = p.parse_args(argv)
    data, rows = load(a.json)
    if not rows:
        sys.exit(f"{a.json}: no timed attn benchmarks (was it run with --benchmark-disable?)")
    if a.markdown or not a.output:
        markdown(data, rows)
    if a.output:
        plot(rows, a.output)


if __name__ == "__main__":
    main()
