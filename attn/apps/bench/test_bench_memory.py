"""Memory: peak RSS growth of one call per backend, each in a fresh subprocess.

Default: B=1 H=8 L=S=1024 E=64 float32.  With --bench-grid full or
--bench-memory-large (ATTN_BENCH_MEMORY_LARGE=1) also H=1 L=S=16384 E=64
float32, where a kernel that materializes the L x S scores would need 1 GiB
(NumPy's matrix version needs ~4 GiB there).  Deselect with `-m "not memory"`.
The measurement itself: _memprobe.py (``python -m attn.apps.bench._memprobe``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attn.apps.bench import _common as ab

pytestmark = [pytest.mark.memory, pytest.mark.bench_grids("quick", "default", "full")]

PROBE = "attn.apps.bench._memprobe"


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_peak_rss(mem_case, mem_backend, bench_env, bench_settings, bench_results):
    mc, b = mem_case, mem_backend
    record = {"label": mc.label, "backend": b, "L": mc.L}
    if b == "torch" and bench_env["torch"] is None:
        record["skipped"] = bench_env["torch_error"]
        bench_results.memory.append(record)
        pytest.skip(record["skipped"])
    if b == "cython" and not ab.cython_available(bench_env["backends"]):
        record["skipped"] = "attn's Cython extension is not built"
        bench_results.memory.append(record)
        pytest.skip(record["skipped"])
    if b == "numpy":
        itemsize = 4 if mc.dtype == "f32" else 8
        need = 4 * mc.B * mc.H * mc.L * mc.S * itemsize  # scores, exp, weights + slack
        avail = _mem_available()
        if avail is not None and need > 0.8 * avail:
            record["skipped"] = (f"needs ~{need / 2**30:.1f} GiB, only {avail / 2**30:.1f} GiB available")
            bench_results.memory.append(record)
            pytest.skip(record["skipped"])
    cmd = [sys.executable, "-m", PROBE, "--backend", b, "--B", str(mc.B), "--H", str(mc.H),
           "--L", str(mc.L), "--S", str(mc.S), "--E", str(mc.E), "--dtype", mc.dtype,
           "--threads", str(bench_settings.threads)] + (["--causal"] if mc.causal else [])
    # A fixed glibc mmap threshold (setting it disables the dynamic one): every
    # block >= 128 KiB is mmapped and returned on free, so memory freed before
    # the baseline cannot be silently reused by the call and RSS tracks live data.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    # the probe imports the very attn this process runs (a clone's in-place build or the installed one)
    attn_root = os.path.dirname(os.path.dirname(os.path.abspath(bench_env["attn"].__file__)))
    env["PYTHONPATH"] = os.pathsep.join([attn_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    record.update(res)
    bench_results.memory.append(record)
