"""Timing: attn's loop / numpy / cython backends against torch SDPA.

One pytest-benchmark group per shape/dtype/causal/mask (so the relative columns
are ratios); the contenders of a group run in the order torch, cython, numpy,
loop, each after a pause.  Every benchmark records in `extra_info` its max
abs difference from torch (computed once, outside the timing), the shape,
dtype, causal flag and GFLOP/s.  Cases and options: plugin.py and
_common.py.  Without torch the torch contender is skipped and the others are
checked against a float64 NumPy reference.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time

import numpy as np
import pytest

import attn
from attn._build import BF16_PRODUCT_PATHS
from attn.apps.bench import _common as ab
from attn.apps.bench.plugin import gemm_yardstick, peak_yardstick, skip_without_torch

pytestmark = pytest.mark.bench_grids("quick", "default", "full")  # the cases follow the grid


def _contender(backend, data, env):
    if backend == "torch":
        return ab.torch_sdpa_fn(data.q, data.k, data.v, data.case.causal, data.mask)
    return functools.partial(env["attn"].scaled_dot_product_attention, data.q, data.k, data.v,
                             attn_mask=data.mask, is_causal=data.case.causal, backend=backend)


def test_sdpa(benchmark, case, backend, bench_data, bench_env, bench_settings, bench_results):
    s = bench_settings
    benchmark.group = case.group
    record = {"group": case.group, "case_obj": case, "backend": backend}
    info = benchmark.extra_info
    info.update(case.describe())
    info["backend"] = backend
    info["threads"] = s.threads
    if backend == "torch" and len(case.lead) < 2:
        info["torch_input"] = "4-D view (1, 1, L, E) of the same arrays (torch's fused CPU kernel is 4-D only)"

    if backend == "torch" and bench_env["torch"] is None:
        record["skipped"] = bench_env["torch_error"]
        bench_results.timings.append(record)
        skip_without_torch(bench_env)

    if backend == "cython":
        if not ab.cython_available(bench_env["backends"]):
            record["skipped"] = "attn's Cython extension is not built"
            bench_results.timings.append(record)
            pytest.skip(record["skipped"])

    if backend == "loop":
        entries = case.heads * case.L * case.S
        info["score_entries"] = entries
        if entries > s.loop_max:
            # say how long it would have taken: time a few rows (best of 3)
            time.sleep(0 if s.disabled else s.pause)  # numpy's BLAS threads may still spin
            est = ab.estimate_loop_seconds(bench_env["attn"], case, bench_data.q, bench_data.k, bench_data.v)
            calls = s.min_rounds + 1  # a timing: correctness check + min rounds
            total = est * calls
            record["skipped"] = (
                f"per-row Python loop not timed at this size ({entries / 2**20:.0f} Mi score entries > "
                f"--bench-loop-max {s.loop_max / 2**20:.0f} Mi): est. {est:.1f} s per call "
                f"({case.rows} Python-level rows x {est / case.rows * 1e6:.0f} us), "
                f"~{total / 60:.1f} min for the {calls} calls of a timing")
            info["loop_estimate_s"] = est
            bench_results.timings.append(record)
            pytest.skip(record["skipped"])

    fn = _contender(backend, bench_data, bench_env)
    torch = bench_env["torch"]

    with torch.inference_mode() if torch is not None else contextlib.nullcontext():
        # correctness, once, outside the timing (also the cold first call)
        t0 = time.perf_counter()
        out = fn()
        t_check = time.perf_counter() - t0
        out = ab.as_numpy(out) if backend == "torch" else out
        diff_torch = None if torch is None else ab.max_abs_diff(out, bench_data.torch_out)
        diff_ref64 = ab.max_abs_diff(out, bench_data.ref64)
        del out
        info["max_abs_diff_vs_torch"] = diff_torch
        info["max_abs_diff_vs_torch_f64"] = diff_ref64
        record.update(diff_torch=diff_torch, diff_ref64=diff_ref64)

        # hygiene: let the previous contender's spinning thread pools go idle
        gc.collect()
        if not s.disabled:
            time.sleep(s.pause)
            info["pause_s"] = s.pause

        if s.disabled:
            benchmark.pedantic(fn, rounds=1)
        else:
            if t_check >= s.max_time:  # slow contender: min_rounds, no extra calibration call
                t1 = t_check
            else:
                t0 = time.perf_counter()
                fn()  # warm call, also calibrates the number of rounds
                t1 = time.perf_counter() - t0
            rounds = int(min(s.max_rounds, max(s.min_rounds, math.ceil(s.max_time / max(t1, 1e-9)))))
            benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1 if t1 < 0.05 else 0)

    if not s.disabled and benchmark.stats is not None:
        st = benchmark.stats.stats
        median = st.median
        gflops = case.flops / median / 1e9
        gemm = gemm_yardstick(bench_results, bench_env, s, case.dtype, case.flops)
        record.update(median=median, min=st.min, q1=st.q1, q3=st.q3, iqr=st.iqr, rounds=st.rounds, gflops=gflops,
                      pct_gemm=100 * gflops / gemm["gflops"], gemm=gemm, kv_gbps=case.kv_bytes / median / 1e9)
        info["gflops"] = gflops
        info["pct_gemm"] = record["pct_gemm"]
        info["gemm"] = gemm
        peak = peak_yardstick(bench_results, bench_env, s, case.dtype)
        if peak:
            record.update(pct_peak=100 * gflops / peak["gflops"], peak=peak)
            info.update(pct_peak=record["pct_peak"], peak=peak)
        if case.kind == "decode":
            info["kv_gbps"] = record["kv_gbps"]
    bench_results.timings.append(record)

    # attn and torch (or the float64 reference) each within its rounding bound of the exact result
    dtype = np.float64 if case.dtype == "f64" else np.float32
    bound = ab.rounding_bound(bench_data.q, bench_data.k, bench_data.v, dtype)
    if case.dtype == "bf16":
        # bfloat16 inputs, computed in float32: attn rounds once, on output (u = 2^-8 of |out| <=
        # max |v|); torch's bfloat16 SDPA also rounds the weights P to bfloat16 before P V (each
        # weight off by u of itself: u max |v| more), and its output.
        out_round = ab.U_BF16 * float(np.abs(bench_data.v.astype(np.float32)).max())
        if backend != "torch":
            tol = bound + out_round + ab.rounding_bound(bench_data.q, bench_data.k, bench_data.v, np.float64)
            if backend == "cython" and attn.backends()["simd"] in BF16_PRODUCT_PATHS:
                tol += out_round  # that path rounds P to bfloat16 before P V, as torch does
            assert diff_ref64 <= tol, (f"{backend} differs from the float64 reference by {diff_ref64:.3g} "
                                       f"(> {tol:g}) on {case.id}")
        bound += 1.5 * out_round  # 2 x bound below: attn's output rounding and torch's two
    if torch is not None:
        tol = 2 * bound
        assert diff_torch <= tol, f"{backend} differs from torch by {diff_torch:.3g} (> {tol:g}) on {case.id}"
    else:
        tol = bound + ab.rounding_bound(bench_data.q, bench_data.k, bench_data.v, np.float64)
        assert diff_ref64 <= tol, (f"{backend} differs from the float64 reference by {diff_ref64:.3g} "
                                   f"(> {tol:g}) on {case.id}")
