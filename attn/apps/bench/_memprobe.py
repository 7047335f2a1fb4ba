"""Peak RSS growth of ONE attention call; run in a fresh process per measurement.

    python -m attn.apps.bench._memprobe --backend cython --B 1 --H 1 --L 16384 --S 16384 --E 64 --dtype f32

Steps: import everything, make one tiny call of the same backend (so thread
pools, their stacks and lazy imports exist), allocate and touch q, k, v,
record VmRSS, reset the kernel's high-water mark (write 5 to
/proc/self/clear_refs), make the call, read VmHWM.  Growth = VmHWM - VmRSS
before: everything the call allocated at its peak, including its output;
extra = growth - output bytes.  Prints one JSON line.  The suite runs it with
MALLOC_MMAP_THRESHOLD_=131072 (see test_bench_memory.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import time

import numpy as np


def _status(field):
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024


def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=("torch", "cython", "numpy", "loop"))
    for n, d in (("B", 1), ("H", 1), ("L", 1024), ("S", 1024), ("E", 64), ("Ev", None)):
        p.add_argument(f"--{n}", type=int, default=d)
    p.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    Ev = a.Ev or a.E
    dt = np.float32 if a.dtype == "f32" else np.float64

    if a.backend == "torch":
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(a.threads)

        def call(q, k, v):
            with torch.inference_mode():
                return F.scaled_dot_product_attention(
                    torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=a.causal
                ).numpy()
    else:
        import attn

        if hasattr(attn, "set_num_threads"):
            attn.set_num_threads(a.threads)

        def call(q, k, v):
            return attn.scaled_dot_product_attention(q, k, v, is_causal=a.causal, backend=a.backend)

    rng = np.random.default_rng(0)

    def inputs(L, S):
        return (rng.standard_normal((a.B, a.H, L, a.E), dtype=np.float32).astype(dt, copy=False),
                rng.standard_normal((a.B, a.H, S, a.E), dtype=np.float32).astype(dt, copy=False),
                rng.standard_normal((a.B, a.H, S, Ev), dtype=np.float32).astype(dt, copy=False))

    call(*inputs(min(a.L, 64), min(a.S, 64)))  # warm: thread pools, lazy imports
    q, k, v = inputs(a.L, a.S)  # written by the generator: every page touched
    in_bytes = q.nbytes + k.nbytes + v.nbytes
    gc.collect()
    time.sleep(0.2)  # let other threads settle

    rss0 = _status("VmRSS")
    reset = _reset_hwm()
    hwm0 = _status("VmHWM")
    t0 = time.perf_counter()
    out = call(q, k, v)
    seconds = time.perf_counter() - t0
    hwm1 = _status("VmHWM")
    growth = hwm1 - rss0 if reset else max(0, hwm1 - hwm0)
    mib = 2.0**20
    print(json.dumps({
        "backend": a.backend, "B": a.B, "H": a.H, "L": a.L, "S": a.S, "E": a.E, "Ev": Ev,
        "dtype": np.dtype(dt).name, "causal": a.causal, "threads": a.threads,
        "seconds": seconds, "hwm_reset": reset,
        "rss_before_mib": rss0 / mib, "hwm_after_mib": hwm1 / mib,
        "growth_mib": growth / mib, "output_mib": out.nbytes / mib,
        "extra_mib": (growth - out.nbytes) / mib, "inputs_mib": in_bytes / mib,
    }))


if __name__ == "__main__":
    main()
