"""``python -m attn`` (bare, --version), ``python -m attn bench`` and the ATTN_SIMD check.

The bench runs use ``--benchmark-disable`` (every contender once: this checks
the wiring, never a speed) from a directory outside the clone, as a user would.
"""

import os
import subprocess
import sys

import pytest

import attn
from conftest import attn_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(attn.__file__)))  # the attn being tested


def run(args, cwd, without=None, env=None):
    """``python -m attn ARGS`` in ``cwd`` (``without``: modules made unimportable)."""
    cmd = attn_command(*args, without=without)
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=full_env)


def test_bare_command_lists_the_commands(tmp_path):
    proc = run([], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "bench"):
        assert f"\n    {command} " in proc.stdout


def test_version(tmp_path):
    proc = run(["--version"], tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"attn {attn.__version__}"


QUICK_SMOKE = ["bench", "--quick", "-k", "headline", "--", "--benchmark-disable"]


def test_bench_runs_outside_the_clone(tmp_path):
    proc = run(QUICK_SMOKE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "attn bench, quick grid" in out
    assert "attn benchmark summary" in out
    assert "seed headline: one head (128,64) f64 dense" in out  # the group on the progress line
    assert "Name (time in" not in out  # pytest-benchmark's own tables are left out
    # the CPU is named: model name and family/model as /proc/cpuinfo has them, SIMD path, cores
    info = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    info.setdefault(key.strip(), value.strip())
    cpu_line = next(ln for ln in out.splitlines() if ln.startswith("CPU: "))
    if "model name" in info:
        assert cpu_line.startswith(f"CPU: {info['model name']} (family {info['cpu family']} model {info['model']}), ")
    assert f", {attn.backends()['simd']} SIMD path, {len(os.sched_getaffinity(0))} cores" in cpu_line
    assert not (tmp_path / ".pytest_cache").exists()
    assert os.listdir(tmp_path) == []  # writes nothing where it runs


def test_bench_avx2_runs_the_capped_proxy(tmp_path):
    """--avx2: a new process where attn takes its avx2-fma path and torch its AVX2 kernels, said in the summary."""
    pytest.importorskip("torch")
    if not attn.backends()["cython"]:
        pytest.skip("attn's Cython extension is not built")
    from attn import _kernels

    if "avx2" not in _kernels.simd_caps():
        pytest.skip("this CPU has no AVX2")
    proc = run(["bench", "--avx2"] + QUICK_SMOKE[1:], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "fused kernel with SIMD path avx2-fma" in out
    assert "(CPU capability AVX2)" in out
    assert "capped AVX2 proxy: ATTN_SIMD=avx2 for attn" in out
    assert "seed headline: one head (128,64) f64 dense" in out


def test_bench_without_torch_runs_attn_and_says_why(tmp_path):
    proc = run(QUICK_SMOKE, tmp_path, without=["torch"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no torch column: PyTorch is not installed" in proc.stdout
    assert "pip install torch --index-url" in proc.stdout
    # the torch contender's skip is listed with its reason (not a bare "1 skipped")
    lines = proc.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("skipped ("))
    n = int(lines[at].removeprefix("skipped (").removesuffix("):"))
    listed = lines[at + 1:at + 1 + n]
    assert all(ln.startswith("  ") and ": " in ln for ln in listed)
    assert "  test_sdpa[headline-seed-T128-E64-f64-torch]: PyTorch is not installed" in [
        ln.split(" (")[0] for ln in listed]
    assert "passed" in proc.stdout.splitlines()[-1]


def test_bench_without_pytest_benchmark_says_which_extra(tmp_path):
    proc = run(["bench", "--quick"], tmp_path, without=["pytest_benchmark"])
    assert proc.returncode == 1
    assert proc.stdout.strip() == ("python -m attn bench needs pytest_benchmark: pip install pytest "
                                   'pytest-benchmark (from a clone: pip install ".[bench]")')


@pytest.mark.parametrize("value", ["bogus", "avx512-amx", "AVX2"])
def test_unknown_attn_simd_warns_naming_the_valid_values(value, tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import attn"], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT, ATTN_SIMD=value))
    assert proc.returncode == 0
    assert f"RuntimeWarning: ATTN_SIMD={value!r} is not a valid value" in proc.stderr
    for valid in attn._kernels.simd_caps():   # the kernel's own list (attn_dispatch.h)
        assert repr(valid) in proc.stderr


@pytest.mark.parametrize("value", ["generic", "avx2", "avx512", "avx512-bf16", ""])
def test_valid_attn_simd_is_silent(value, tmp_path):
    code = "import attn; print(attn.backends()['simd'])"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT, ATTN_SIMD=value))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    if value == "generic" and attn.backends()["cython"]:
        assert proc.stdout.strip() == "generic"
    if value == "avx512" and attn.backends()["cython"] and "avx512" in attn._kernels.simd_paths():
        assert proc.stdout.strip() == "avx512"  # the cap below avx512-bf16
    if value == "avx512-bf16" and attn.backends()["cython"] and "avx512-bf16" in attn._kernels.simd_paths():
        assert proc.stdout.strip() == "avx512-bf16"  # the cap below avx512-amx
