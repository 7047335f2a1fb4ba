"""``python -m attn bench``: run the packaged benchmark suite through pytest.

Everything is pytest + pytest-benchmark with :mod:`attn.apps.bench.plugin`, exactly
what ``python -m pytest bench`` runs in a clone; this module only turns the
command line into pytest arguments, runs pytest in this process and draws the
plot from the JSON it wrote.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

from . import PLUGIN, SUITE_DIR

#: pip's extras syntax needs a project to apply to: from a clone, ".[bench]" (the clone's
#: root; or its path); "attn[bench]" only resolves once attn itself is installed (it is
#: not on PyPI), so the hint names the packages too.
EXTRA_HINT = 'pip install pytest pytest-benchmark (from a clone: pip install ".[bench]")'
PLOT_HINT = 'pip install matplotlib (from a clone: pip install ".[plot]")'
QUICK = ("--benchmark-max-time=0.25", "--benchmark-min-rounds=3", "--bench-paired-budget=1")

DESCRIPTION = """\
Time attn's three forms of scaled dot-product attention (per-row Python loop,
NumPy matrix form, fused Cython kernel) against PyTorch's on the same arrays,
and print a summary table: median time per call, the paired cython/torch ratio,
GFLOP/s as a percentage of a BLAS GEMM timed in the same run, memory, on which CPU. Uses pytest-benchmark (from a clone: pip install ".[bench]"); PyTorch is
optional (without it the torch column is empty and the summary says why).
"""

#: The capped proxy of an AVX2-only CPU (docs/performance.md): attn's avx2-fma path, torch's
#: kernels and MKL capped to AVX2; set in a new process (both read them once, at start).
AVX2_ENV = {"ATTN_SIMD": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ATTN_BENCH_AVX2": "1"}

EPILOG = """\
grids:
  --quick    the seed's single head, T=1024 float32 dense and causal, short timings (< 1 min)
  (default)  seed, T=1024 float32/float64 dense/causal, masks, decode, memory (a few minutes)
  --full     T = 128..4096, E = 64/128, both dtypes, dense/causal (10+ minutes)

examples:
  python -m attn bench --quick
  python -m attn bench --backends torch,cython --json run.json --plot run.png
  python -m attn bench -k "f32 and causal" -- --benchmark-max-time=2
  python -m attn bench --avx2      # the capped AVX2 proxy: attn's avx2-fma path, torch capped to AVX2

The same suite, from a clone's root: python -m pytest bench [--bench-grid quick|default|full ...]
"""


def add_parser(sub):
    """Add the ``bench`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("bench", help="time the backends against PyTorch (needs the bench extra)",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="three groups, short timings (under a minute)")
    size.add_argument("--full", action="store_true", help="the whole T x E x dtype grid (10+ minutes)")
    p.add_argument("--backends", metavar="LIST",
                   help="comma-separated subset of torch,cython,numpy,loop (default: all)")
    p.add_argument("--json", metavar="FILE", help="write pytest-benchmark's JSON (with an 'attn' section)")
    p.add_argument("--plot", metavar="FILE.png", help="draw median time per group and backend; needs matplotlib")
    p.add_argument("--threads", type=int, metavar="N", help="threads for torch and attn (default: all cores)")
    p.add_argument("--details", action="store_true", help="also print per-group details after the table")
    p.add_argument("--avx2", action="store_true",
                   help="the capped proxy of an AVX2-only CPU, in a new process: ATTN_SIMD=avx2 for attn, "
                        "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 for torch")
    p.add_argument("-k", metavar="EXPR", dest="keyword", help="only benchmarks whose id matches (pytest -k)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="after '--': more pytest / pytest-benchmark options")
    return p


def pytest_argv(args, json_path, scratch):
    """The pytest command line for ``args`` (an argparse namespace of :func:`add_parser`).

    ``scratch``: a temporary directory for pytest-benchmark's storage (which it
    creates even when nothing is saved).
    """
    grid = "quick" if args.quick else "full" if args.full else "default"
    argv = [
        SUITE_DIR,
        "-p", PLUGIN,
        "-p", "no:cacheprovider", "--assert=plain",  # write nothing into the installed package or the cwd
        f"--benchmark-storage=file://{scratch}",
        "--rootdir", SUITE_DIR, "-c", os.devnull,  # no ini file of wherever this runs
        "-q", "--no-header", "-o", "console_output_style=classic",
        "--benchmark-quiet", "--bench-ui", f"--bench-grid={grid}",
    ]
    if args.quick:
        argv += QUICK
    if args.backends:
        argv.append(f"--bench-backends={args.backends}")
    if args.threads:
        argv.append(f"--bench-threads={args.threads}")
    if args.details:
        argv.append("--bench-details")
    if args.keyword:
        argv += ["-k", args.keyword]
    if json_path:
        argv.append(f"--benchmark-json={json_path}")
    return argv + list(args.pytest_args)


def command_line(args):
    """``args`` (an argparse namespace of :func:`add_parser`) back as ``bench``'s command line, less --avx2."""
    argv = ["--quick"] if args.quick else ["--full"] if args.full else []
    for flag, value in (("--backends", args.backends), ("--json", args.json), ("--plot", args.plot),
                        ("--threads", args.threads), ("-k", args.keyword)):
        argv += [flag, str(value)] if value else []
    argv += ["--details"] if args.details else []
    return argv + (["--"] + list(args.pytest_args) if args.pytest_args else [])


def _capped_avx2(args):
    """Run ``bench`` again in a process capped to AVX2 (:data:`AVX2_ENV`); its exit status."""
    cmd = [sys.executable, "-m", "attn", "bench"] + command_line(args)
    return subprocess.call(cmd, env=dict(os.environ, **AVX2_ENV))


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


def run(args):
    """Run the suite; return the exit status (pytest's, or 1 when a requirement is missing)."""
    if getattr(args, "avx2", False) and os.environ.get("ATTN_BENCH_AVX2") != "1":
        return _capped_avx2(args)
    missing = _missing("pytest", "pytest_benchmark")
    if missing:
        print(f"python -m attn bench needs {' and '.join(missing)}: {EXTRA_HINT}")
        return 1
    if args.plot and _missing("matplotlib"):
        print(f"--plot needs matplotlib: {PLOT_HINT}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        json_path = args.json or (os.path.join(tmp, "bench.json") if args.plot else None)
        import pytest

        status = int(pytest.main(pytest_argv(args, json_path, tmp)))
        if args.plot and os.path.exists(json_path):
            from . import plot

            data, rows = plot.load(json_path)
            if rows:
                plot.plot(rows, args.plot)
            else:
                print("--plot: nothing was timed (no plot written)")
    return status
