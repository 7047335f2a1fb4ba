"""Peak RSS growth of ONE backward call (attn's fused kernel or torch's); run in a fresh process.

    python -m attn.apps.bench._memprobe_backward --backend cython --L 8192 --S 8192 --H 1 --E 64 --dtype f32

As attn/apps/bench/_memprobe.py: warm up with a tiny call of the same kind, build the
inputs, the forward (its output and log-sum-exp, or torch's graph) and the
upstream gradient, record VmRSS, reset the high-water mark (write 5 to
/proc/self/clear_refs), run the backward, read VmHWM. growth = VmHWM - VmRSS
before; extra = growth - the gradients' bytes (dq, dk, dv). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

from attn.apps.bench._memprobe import _reset_hwm, _status


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=("torch", "cython", "online", "numpy"))
    for n, d in (("B", 1), ("H", 1), ("L", 1024), ("S", 1024), ("E", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    p.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    dt = np.float32 if a.dtype == "f32" else np.float64
    rng = np.random.default_rng(0)

    def inputs(L, S):
        mk = lambda n: rng.standard_normal((a.B, a.H, n, a.E), dtype=np.float32).astype(dt, copy=False)
        return mk(L), mk(S), mk(S), mk(L)  # q, k, v, grad_out

    if a.backend == "torch":
        import torch

        torch.set_num_threads(a.threads)

        def prepare(q, k, v, g):
            tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=a.causal)
            tg = torch.from_numpy(g)
            return lambda: torch.autograd.grad(out, (tq, tk, tv), tg)
    else:
        import attn

        attn.set_num_threads(a.threads)

        def prepare(q, k, v, g):
            _, backward = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=a.causal, backend=a.backend)
            return lambda: backward(g)

    prepare(*inputs(64, 64))()  # warm: thread pools, lazy imports
    call = prepare(*inputs(a.L, a.S))
    gc.collect()
    time.sleep(0.2)
    rss0 = _status("VmRSS")
    reset = _reset_hwm()
    hwm0 = _status("VmHWM")
    t0 = time.perf_counter()
    grads = call()
    seconds = time.perf_counter() - t0
    hwm1 = _status("VmHWM")
    growth = hwm1 - rss0 if reset else max(0, hwm1 - hwm0)
    grad_bytes = sum(int(np.prod(tuple(x.shape))) * np.dtype(dt).itemsize for x in grads)
    mib = 2.0**20
    print(json.dumps({
        "backend": a.backend, "B": a.B, "H": a.H, "L": a.L, "S": a.S, "E": a.E,
        "dtype": np.dtype(dt).name, "causal": a.causal, "threads": a.threads, "seconds": seconds,
        "hwm_reset": reset, "growth_mib": growth / mib, "grads_mib": grad_bytes / mib,
        "extra_mib": (growth - grad_bytes) / mib,
    }))


if __name__ == "__main__":
    main()
