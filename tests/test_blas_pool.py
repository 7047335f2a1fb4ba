"""One pool of threads for attn and NumPy's OpenBLAS (attn/_blas_pool.py), in fresh interpreters:
OpenBLAS's parallel jobs run on attn's OpenMP team, their results are the bits OpenBLAS's own
threads give, OpenBLAS's thread count still decides how many jobs there are, a team too small
for the jobs (OMP_THREAD_LIMIT) gets threads of their own instead of a deadlock, a forked child
gets OpenBLAS's own threads back, and ATTN_SHARE_BLAS_THREADS=0 leaves OpenBLAS alone."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import attn
from attn import _blas_pool

pytestmark = [
    pytest.mark.skipif(not (attn.backends()["cython"] and attn.backends()["openmp"]),
                       reason="needs the kernels built with OpenMP"),
    pytest.mark.skipif(not _blas_pool._libraries(),
                       reason="NumPy's BLAS is not a pthreads OpenBLAS 0.3.27+ (nothing to share)"),
]

# A NumPy program: products (GEMM and GEMV, float32 and float64) and attn decode calls between
# them, its outputs saved to OUT (.npz); prints attn's state and the pool's counters.
PROGRAM = """
import json, os, sys
import numpy as np
import attn
from attn import _blas_pool
rng = np.random.default_rng(7)
out = {}
for dt in (np.float32, np.float64):
    a, b = rng.standard_normal((300, 700)).astype(dt), rng.standard_normal((700, 500)).astype(dt)
    x, w = rng.standard_normal((1, 576)).astype(dt), rng.standard_normal((1536, 576)).astype(dt)
    out[f"gemm_{dt.__name__}"], out[f"gemv_{dt.__name__}"] = a @ b, x @ w.T
q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
k, v = (rng.standard_normal((1, 3, 4096, 64)).astype(np.float32) for _ in range(2))
wo = rng.standard_normal((576, 576)).astype(np.float32)
h = q
for layer in range(4):  # attention (two threads at this length), then a product of its output
    y = attn.scaled_dot_product_attention(h, k, v, enable_gqa=True)
    h = (y.reshape(1, 576) @ wo).reshape(1, 9, 1, 64) / 24
out["mixed"] = h
np.savez(os.environ["OUT"], **out)
print(json.dumps({"state": attn.backends()["blas_threads"], "counters": _blas_pool.counters()}))
"""


def _run(tmp_path, name, code=PROGRAM, **env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ATTN_SHARE_BLAS_THREADS", "OMP_THREAD_LIMIT", "OMP_NUM_THREADS",
                          "OPENBLAS_NUM_THREADS")}
    out = str(tmp_path / f"{name}.npz")
    env = dict(clean, OUT=out, **{k: str(v) for k, v in env.items()})
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    info = json.loads(res.stdout.strip().splitlines()[-1])
    with np.load(out) as f:
        return info, dict(f)


def _same_bits(x, y):
    assert x.keys() == y.keys()
    for key in x:
        assert x[key].dtype == y[key].dtype and np.array_equal(x[key].view(np.uint8), y[key].view(np.uint8)), key


def test_openblas_jobs_run_on_attns_team_with_the_same_bits(tmp_path):
    shared, got = _run(tmp_path, "shared", OPENBLAS_NUM_THREADS=2)
    own, ref = _run(tmp_path, "own", OPENBLAS_NUM_THREADS=2, ATTN_SHARE_BLAS_THREADS=0)
    assert shared["state"].startswith("shared with") and "openblas" in shared["state"]
    assert own["state"] == "not shared (ATTN_SHARE_BLAS_THREADS=0)"
    calls, extra = shared["counters"]
    assert calls >= 4 and extra == 0  # every threaded product (4 + 4 in the loop) on the team
    assert own["counters"] == [0, 0]
    _same_bits(got, ref)
    # and the products are products: against float64 (the float32 ones within their rounding)
    rng = np.random.default_rng(7)  # the program's draws, in its order
    draws = {dt: [rng.standard_normal(s) for s in ((300, 700), (700, 500), (1, 576), (1536, 576))]
             for dt in ("float32", "float64")}
    a, b = draws["float64"][:2]
    np.testing.assert_allclose(got["gemm_float64"], np.einsum("ij,jk->ik", a, b), rtol=1e-10, atol=1e-10)
    a32, b32 = (m.astype(np.float32).astype(np.float64) for m in draws["float32"][:2])
    bound = 700 * 2**-24 * np.einsum("ij,jk->ik", np.abs(a32), np.abs(b32))
    assert (np.abs(got["gemm_float32"] - np.einsum("ij,jk->ik", a32, b32)) <= bound).all()


def test_openblas_keeps_deciding_its_thread_count(tmp_path):
    # one OpenBLAS thread: no parallel job at all, so nothing reaches attn's team
    info, got = _run(tmp_path, "one", OPENBLAS_NUM_THREADS=1)
    _, ref = _run(tmp_path, "one-own", OPENBLAS_NUM_THREADS=1, ATTN_SHARE_BLAS_THREADS=0)
    assert info["state"].startswith("shared with") and info["counters"] == [0, 0]
    _same_bits(got, ref)


def test_a_team_smaller_than_the_jobs_gives_them_threads_instead_of_a_deadlock(tmp_path):
    # OMP_THREAD_LIMIT=1: attn's team is the calling thread alone, OpenBLAS still makes 2 jobs,
    # whose GEMM halves wait for each other's packed panels (run one after the other: a deadlock)
    info, got = _run(tmp_path, "limited", OPENBLAS_NUM_THREADS=2, OMP_THREAD_LIMIT=1)
    _, ref = _run(tmp_path, "limited-own", OPENBLAS_NUM_THREADS=2, ATTN_SHARE_BLAS_THREADS=0)
    calls, extra = info["counters"]
    assert calls >= 4 and extra >= calls  # each threaded call's second job on a thread of its own
    _same_bits(got, ref)


FORK = """
import json, os
import numpy as np
import attn
from attn import _blas_pool
a = np.arange(600 * 600, dtype=np.float64).reshape(600, 600) % 7
before = (a @ a).sum()
parent = _blas_pool.counters()[0]
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # libgomp's team does not survive a fork: OpenBLAS's own threads must do the product
    os.write(w, json.dumps([float((a @ a).sum()), _blas_pool.counters()[0]]).encode())
    os._exit(0)
os.waitpid(pid, 0)
child_sum, child_calls = json.loads(os.read(r, 1000))
after = _blas_pool.counters()[0]
np.savez(os.environ["OUT"], x=np.zeros(1))
print(json.dumps({"state": "", "counters": [parent, child_calls, after], "sums": [float(before), child_sum]}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_openblas_own_threads_back(tmp_path):
    info, _ = _run(tmp_path, "fork", FORK, OPENBLAS_NUM_THREADS=2)
    parent, child, after = info["counters"]
    assert parent >= 1 and child == parent and after == parent  # the child's product did not use the team
    a = np.arange(600 * 600, dtype=np.float64).reshape(600, 600) % 7
    assert info["sums"] == [float((a @ a).sum())] * 2


def test_disable_and_enable_switch_at_run_time():
    a = np.ones((400, 400))
    was = _blas_pool.shared()
    try:
        _blas_pool.disable()
        assert _blas_pool.shared() == [] and attn.backends()["blas_threads"] == "not shared (disabled)"
        n = _blas_pool.counters()[0]
        np.testing.assert_array_equal(a @ a, np.full((400, 400), 400.0))
        assert _blas_pool.counters()[0] == n
        assert _blas_pool.enable() and _blas_pool.shared()
        assert attn.backends()["blas_threads"].startswith("shared with")
    finally:
        _blas_pool.disable()
        if was:
            _blas_pool.enable()
