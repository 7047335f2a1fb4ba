"""Backward pass: attn's fused FlashAttention-2 backward vs torch's CPU backward.

torch: ``out.backward(grad)`` through ``F.scaled_dot_product_attention`` with
``requires_grad`` (which runs torch's ``cpu_flash_attention_backward``;
``retain_graph=True`` so the forward is not re-run, grads reset to None
before each call). attn: ``backward(grad)`` from
``attn.scaled_dot_product_attention_vjp(..., backend="cython")``. Only the
backward is timed, on the same float inputs (torch reads NumPy's memory).

What is timed is checked against the exact gradients (torch's float64
backward on the same values): in float32 and float64, attn's gradients and
torch's are each elementwise within the rounding bound of the case
(:func:`attn.apps.bench._common.backward_rounding_bound`, worst case, from the
case's own magnitudes), i.e. ``|attn - exact| <= bound(dtype) + bound(float64)``;
in bfloat16, attn's largest error is at most 1.5x torch's.

Groups: B=1 H=8 T in {512, 1024, 2048} E=64, causal or not, float32 and
float64, and bfloat16 at T=1024 against torch's bfloat16 backward; the full
grid adds E=128 and the bool- and float-masked groups (ab.make_mask's
patterns) at T in {1024, 2048}, float32 and float64 (the
targets: cython <= 0.8 of torch's time, judged on the paired ratio of
alternating blocks, attn/apps/bench/_paired.py). Memory: extra
peak RSS of one backward at L=S=8192 H=1 E=64 float32 (target <= 64 MiB
beyond inputs and gradients), by attn/apps/bench/_memprobe_backward.py in a fresh
process.

    python -m pytest bench -k backward                       # timings (python -m attn bench -k backward)
    python -m pytest bench -k backward --benchmark-disable   # one call each, checks only
"""

import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")
import attn  # noqa: E402
from attn.apps.bench import _common as ab  # noqa: E402
from attn.apps.bench._paired import paired_ratio  # noqa: E402
from attn.apps.bench.plugin import gemm_yardstick, peak_yardstick  # noqa: E402

H, E = 8, 64
# (T, causal, dtype, E, mask): mask "none", "bool" or "float" (ab.make_mask's patterns)
CASES = [(T, causal, dt, E, "none") for T in (512, 1024, 2048) for causal in (False, True) for dt in ("f32", "f64")]
CASES += [(1024, causal, "bf16", E, "none") for causal in (False, True)]
# the full grid's: the rest of the groups held to the GEMM (E = 128; masks), as the forward's
FULL_CASES = [(T, False, dt, 128, "none") for T in (1024, 2048) for dt in ("f32", "f64")]
FULL_CASES += [(T, False, dt, E, m) for T in (1024, 2048) for dt in ("f32", "f64") for m in ("bool", "float")]
PARAMS = CASES + [pytest.param(c, marks=pytest.mark.bench_grids("full")) for c in FULL_CASES]
BF16_RULE = 1.5  # bfloat16: attn's gradient error (vs float64) at most 1.5x torch's bfloat16 one
TARGET = 0.8
PROBE = "attn.apps.bench._memprobe_backward"


def _group(T, causal, dt, e, mask):
    masked = "" if mask == "none" else f" {mask} mask"
    return f"backward B=1 H={H} T={T} E={e}{' causal' if causal else ''}{masked} {dt}"


def _ids(c):
    T, causal, dt, e, mask = c
    return (f"T{T}-{'causal' if causal else 'full'}-{dt}" + ("" if e == E else f"-E{e}")
            + ("" if mask == "none" else f"-{mask}mask"))


def _mask(T, causal, dt, e, mask):
    """The case's attn_mask (None, bool, or the bool pattern as a 0 / -inf bias) and its
    visible entries."""
    m = ab.make_mask(ab.Case("grid", (1, H), T, T, e, e, dt, causal, mask=mask))
    return m, None if m is None else (m if m.dtype == bool else np.isfinite(m))


class State:
    """Inputs, torch's graph and attn's backward closure for one case."""

    def __init__(self, T, causal, dt, e, mask):
        dtype = ab.DTYPES[dt]
        self.causal, self.bf16 = causal, dt == "bf16"
        self.mask, self.visible = _mask(T, causal, dt, e, mask)
        rng = np.random.default_rng(20261012)
        self.q, self.k, self.v, self.g = (rng.standard_normal((1, H, T, e)).astype(dtype) for _ in range(4))
        self.tq, self.tk, self.tv = (ab.as_torch(a).requires_grad_() for a in (self.q, self.k, self.v))
        self.tmask = None if self.mask is None else torch.from_numpy(self.mask)
        self.tout = torch.nn.functional.scaled_dot_product_attention(self.tq, self.tk, self.tv,
                                                                     attn_mask=self.tmask, is_causal=causal)
        self.tg = ab.as_torch(self.g)
        _, self.attn_backward = attn.scaled_dot_product_attention_vjp(
            self.q, self.k, self.v, attn_mask=self.mask, is_causal=causal, backend="cython")

    def torch_fn(self):
        for t in (self.tq, self.tk, self.tv):
            t.grad = None
        self.tout.backward(self.tg, retain_graph=True)
        return self.tq.grad, self.tk.grad, self.tv.grad

    def cython_fn(self):
        return self.attn_backward(self.g)

    def reference(self):
        """``(exact, tolerance)``: torch's float64 gradients (dq, dk, dv) of the same values and the
        elementwise ``|computed - exact|`` allowed (the case's bound plus float64's; None for
        bfloat16, held to torch's own error instead), computed once."""
        if not hasattr(self, "_reference"):
            x64 = [torch.from_numpy(a.astype(np.float64)) for a in (self.q, self.k, self.v, self.g)]
            tq, tk, tv = (t.requires_grad_() for t in x64[:3])
            m64 = None if self.mask is None else torch.from_numpy(
                self.mask if self.mask.dtype == bool else self.mask.astype(np.float64))
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=m64, is_causal=self.causal)
            exact = tuple(_f64(g) for g in torch.autograd.grad(out, (tq, tk, tv), x64[3]))
            tol = None
            if not self.bf16:
                args = (self.q, self.k, self.v, self.g, self.causal)
                tol = [b + b64 for b, b64 in zip(ab.backward_rounding_bound(*args, self.q.dtype, self.visible),
                                                 ab.backward_rounding_bound(*args, np.float64, self.visible))]
            self._reference = exact, tol
        return self._reference


_STATES = {}


def _f64(g):
    """A gradient (torch's, bfloat16 too, or attn's) as float64 NumPy."""
    return np.asarray(ab.as_numpy(g.detach()) if hasattr(g, "detach") else g, dtype=np.float64)


def check_gradients(st, attn_grads, torch_grads):
    """attn's and torch's (dq, dk, dv), checked against the exact ones.

    float32/float64: each elementwise within the rounding bound. bfloat16 (no
    worst-case bound: torch rounds P and dS to bfloat16 inside): attn's max
    error at most BF16_RULE x torch's. Returns the largest max |attn - torch|
    and max |attn - exact| over the three, for the report.
    """
    exact, tol = st.reference()
    attn_grads, torch_grads = [_f64(g) for g in attn_grads], [_f64(g) for g in torch_grads]
    diff = max(float(np.max(np.abs(a - t))) for a, t in zip(attn_grads, torch_grads))
    errs = {who: max(float(np.max(np.abs(g - x))) for g, x in zip(grads, exact))
            for who, grads in (("attn", attn_grads), ("torch", torch_grads))}
    if st.bf16:
        assert errs["attn"] <= BF16_RULE * errs["torch"], (
            f"attn's error {errs['attn']:.3g} > {BF16_RULE} x torch's {errs['torch']:.3g}")
        return diff, errs["attn"]
    for name, a, t, x, b in zip(("dq", "dk", "dv"), attn_grads, torch_grads, exact, tol):
        for who, g in (("attn", a), ("torch", t)):
            over = np.abs(g - x) / b
            i = np.unravel_index(np.argmax(over), over.shape)
            assert over[i] <= 1, (f"{name} of {who}: error {abs(g - x)[i]:.3g} at {i} > its rounding bound "
                                  f"{b[i]:.3g}")
    return diff, errs["attn"]


def _state(case):
    if case not in _STATES:
        _STATES.clear()  # one case's arrays at a time
        _STATES[case] = State(*case)
    return _STATES[case]


@pytest.mark.parametrize("contender", ["torch", "cython"])
@pytest.mark.parametrize("case", PARAMS, ids=_ids)
def test_backward(benchmark, case, contender):
    st = _state(case)
    fn = st.torch_fn if contender == "torch" else st.cython_fn
    benchmark.group = _group(*case)
    benchmark.extra_info.update(contender=contender, backend=contender)
    gc.collect()
    grads = benchmark.pedantic(fn, rounds=5 if case[0] >= 2048 else 10, warmup_rounds=1)
    if contender == "torch":  # the timed result is torch's: attn's checked with it
        diff, err = check_gradients(st, st.cython_fn(), grads)
    else:
        diff, err = check_gradients(st, grads, st.torch_fn())
    # (the names attn.apps.bench.plot reads; "_f64": against the float64 reference)
    benchmark.extra_info.update(max_abs_diff_vs_torch=diff, max_abs_diff_vs_torch_f64=err)


@pytest.mark.parametrize("case", PARAMS, ids=_ids)
def test_backward_paired(case, bench_settings, bench_results, bench_env):
    """cython/torch time ratio from alternating blocks; printed in the summary (target <= 0.8),
    with cython's GFLOP/s as a share of a GEMM measured in this run (as the forward groups').

    What is timed is checked first: the two contenders' gradients agree (as in test_backward).
    """
    st = _state(case)
    check_gradients(st, st.cython_fn(), st.torch_fn())
    gc.collect()
    r = paired_ratio(st.torch_fn, st.cython_fn, blocks=1 if bench_settings.disabled else None)
    rec = dict(r, torch=r["a"], cython=r["b"], target=TARGET)
    if not bench_settings.disabled:
        flops = ab.backward_flops(H, case[0], case[3], case[1])
        gemm = gemm_yardstick(bench_results, bench_env, bench_settings, case[2], flops)
        rec.update(gflops=flops / r["b"] / 1e9, gemm=gemm)
        rec["pct_gemm"] = 100 * rec["gflops"] / gemm["gflops"]
        peak = peak_yardstick(bench_results, bench_env, bench_settings, case[2])
        if peak:
            rec.update(pct_peak=100 * rec["gflops"] / peak["gflops"], peak=peak)
    bench_results.paired[_group(*case)] = rec
    print(f"\n{_group(*case)}: torch {r['a'] * 1e3:.2f} ms, cython {r['b'] * 1e3:.2f} ms, "
          f"paired cython/torch {r['ratio']:.2f} (q1 {r['ratio_q1']:.2f}, q3 {r['ratio_q3']:.2f}; "
          f"target <= {TARGET})")


@pytest.mark.memory
@pytest.mark.parametrize("backend", ["cython", "torch"])
def test_backward_memory(backend, bench_settings, bench_results):
    """Extra peak RSS of one backward at L=S=8192 H=1 E=64 float32 (target <= 64 MiB for cython)."""
    cmd = [sys.executable, "-m", PROBE, "--backend", backend, "--H", "1", "--L", "8192", "--S", "8192",
           "--E", "64", "--dtype", "f32", "--threads", str(bench_settings.threads)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(attn.__file__)))  # the attn this process runs
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",  # see test_bench_memory.py
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nbackward memory {backend}: growth {res['growth_mib']:.1f} MiB, gradients "
          f"{res['grads_mib']:.1f} MiB, extra {res['extra_mib']:.1f} MiB, call {res['seconds']:.3f} s")
    bench_results.memory.append({
        "label": "backward (one call) H=1 L=S=8192 E=64 f32", "backend": backend, "L": 8192, "seconds": res["seconds"],
        "growth_mib": res["growth_mib"], "extra_mib": res["extra_mib"], "output_mib": res["grads_mib"],
        "inputs_mib": 4 * 8192 * 64 * 4 / 2**20, "hwm_reset": res["hwm_reset"]})
    if backend == "cython":
        assert res["extra_mib"] <= 64
