"""Threads, determinism and leaks of the compiled kernel.

* The kernel releases the GIL: 8 Python threads calling at once (forward and
  backward) get exactly what serial calls get, and nothing deadlocks between
  Python threads and the OpenMP pool.
* Results are bitwise identical for 1 and N OpenMP threads, and on every
  repeated call.
* 10,000 calls with assorted small shapes keep the process RSS flat.

These are self-consistency properties (the kernel against itself); its
correctness against torch is tested elsewhere.
"""

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

import attn
from conftest import make_qkv, random_bool_mask

pytestmark = pytest.mark.skipif(not attn.backends()["cython"], reason="compiled kernel not built")

N_PY_THREADS = 8


def _problems(seed=3):
    """Assorted calls (kwargs) covering masks, causal, GQA, dtypes, weights, softmax."""
    rng = np.random.default_rng(seed)
    probs = []
    for i, (L, S, E, Ev) in enumerate([(1, 1, 1, 1), (70, 200, 16, 8), (129, 129, 32, 32),
                                       (5, 300, 8, 3), (200, 7, 4, 4), (64, 128, 64, 64)]):
        dtype = (np.float32, np.float64)[i % 2]
        q, k, v = make_qkv(rng, (2, 2), L, S, E, Ev, dtype=dtype)
        kw = dict(query=q, key=k, value=v)
        kind = ("none", "bool", "float", "causal", "lower_right", "gqa")[i]
        if kind == "bool":
            kw["attn_mask"] = random_bool_mask(rng, (2, 1, L, S))
        elif kind == "float":
            kw["attn_mask"] = rng.standard_normal((L, S)).astype(dtype)
        elif kind in ("causal", "lower_right"):
            kw["is_causal"] = True if kind == "causal" else "lower_right"
        elif kind == "gqa":
            kw.update(key=k[:, :1], value=v[:, :1], enable_gqa=True)
        probs.append(("sdpa", kw))
        probs.append(("sdpa_w", dict(kw, return_weights=True)))
        probs.append(("grad", kw))  # the backward: its work area is shared between calls
        probs.append(("softmax", dict(x=rng.standard_normal((3, L, S)).astype(dtype),
                                      mask=random_bool_mask(rng, (L, S)))))
    bf16 = np.dtype(ml_dtypes.bfloat16)  # (its backward's products are bfloat16 on avx512-bf16)
    q, k, v = (a.astype(bf16) for a in make_qkv(rng, (1, 4), 130, 150, 64, 64, dtype=np.float32))
    kw = dict(query=q, key=k, value=v, is_causal=True)
    probs += [("sdpa", kw), ("grad", kw)]
    return probs


def _call(kind, kw, **extra):
    if kind == "softmax":
        return (attn.masked_softmax(**kw, backend="cython", **extra),)
    if kind == "grad":
        out, backward = attn.scaled_dot_product_attention_vjp(**kw, backend="cython", **extra)
        return (out,) + tuple(backward(np.cos(np.arange(out.size)).reshape(out.shape).astype(out.dtype)))
    out = attn.scaled_dot_product_attention(**kw, backend="cython", **extra)
    return out if isinstance(out, tuple) else (out,)


def _identical(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
                                    for x, y in zip(a, b))


def _bits(arrays):
    return tuple(x.tobytes() for x in arrays)


@pytest.mark.parametrize("omp_threads", [1, 2])
def test_python_threads_match_serial(omp_threads):
    """8 Python threads x OpenMP threads: every result bitwise equal to the serial one."""
    probs = _problems()
    serial = [_call(kind, kw, num_threads=omp_threads) for kind, kw in probs]
    work = [(i, rep) for rep in range(4) for i in range(len(probs))]
    barrier = threading.Barrier(N_PY_THREADS)

    def worker(t):
        barrier.wait()  # all threads start calling at once
        bad = []
        for i, _ in work[t::N_PY_THREADS] + work[: len(work) // 2]:
            kind, kw = probs[i]
            if not _identical(_call(kind, kw, num_threads=omp_threads), serial[i]):
                bad.append(i)
        return bad

    with ThreadPoolExecutor(N_PY_THREADS) as pool:
        futures = [pool.submit(worker, t) for t in range(N_PY_THREADS)]
        results = [f.result(timeout=120) for f in futures]  # a deadlock fails, not hangs
    assert all(r == [] for r in results), results


def test_kernel_releases_the_gil():
    """While one thread is inside a long kernel call, another Python thread keeps running.

    The call is made long enough (>= 0.2 s, one OpenMP thread) that a ticker
    thread sleeping 1 ms gets many turns if and only if the GIL is released:
    a single C call holding the GIL would give it none.
    """
    rng = np.random.default_rng(0)
    n = 1024
    while True:
        q, k, v = make_qkv(rng, (), n, n, 64, dtype=np.float32)
        t0 = time.perf_counter()
        attn.scaled_dot_product_attention(q, k, v, backend="cython", num_threads=1)
        if time.perf_counter() - t0 >= 0.2 or n >= 16384:
            break
        n *= 2
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.01)  # the ticker is running
        start = time.perf_counter()
        attn.scaled_dot_product_attention(q, k, v, backend="cython", num_threads=1)
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    during = [x for x in ticks if start < x < end]
    assert len(during) >= 10, (len(during), end - start, n)


def test_no_deadlock_with_nested_python_threads_and_default_threads():
    """Default thread count (OpenMP pool), many short calls from many threads, with timeout."""
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, (3,), 65, 130, 8, dtype=np.float32)
    ref = attn.scaled_dot_product_attention(q, k, v, backend="cython")

    def worker(_):
        return all(np.array_equal(attn.scaled_dot_product_attention(q, k, v, backend="cython"), ref)
                   for _ in range(30))

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(worker, range(32), timeout=120))


@pytest.mark.parametrize("n_threads", [2, 3, 4, 7])
def test_bitwise_identical_across_thread_counts(n_threads):
    for kind, kw in _problems(seed=11):
        one = _call(kind, kw, num_threads=1)
        many = _call(kind, kw, num_threads=n_threads)
        assert _bits(one) == _bits(many), (kind, n_threads)


def test_set_num_threads_gives_identical_results():
    kind, kw = _problems(seed=5)[3]
    try:
        attn.set_num_threads(1)
        one = _call(kind, kw)
        attn.set_num_threads(2)
        two = _call(kind, kw)
    finally:
        attn.set_num_threads(None)
    assert _bits(one) == _bits(two)


def test_repeated_calls_bitwise_identical():
    probs = _problems(seed=13)
    first = [_bits(_call(kind, kw)) for kind, kw in probs]
    for _ in range(5):
        assert [_bits(_call(kind, kw)) for kind, kw in probs] == first


@pytest.mark.parametrize("backend", ["loop", "numpy", "online"])
def test_reference_backends_repeat_bitwise(backend):
    rng = np.random.default_rng(2)
    q, k, v = make_qkv(rng, (2,), 9, 30, 4)
    mask = random_bool_mask(rng, (9, 30))
    first = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend).tobytes()
    for _ in range(3):
        assert attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend).tobytes() == first


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_no_leak_10000_calls():
    """10,000 calls with assorted small shapes (and some raising ones): RSS stays flat."""
    rng = np.random.default_rng(4)
    shapes = [((), 1, 1, 1, 1), ((2,), 3, 5, 4, 2), ((2, 3), 17, 9, 8, 8), ((1,), 65, 129, 16, 3),
              ((3,), 0, 4, 2, 2), ((2,), 4, 0, 2, 2)]
    cases = []
    for i, (lead, L, S, E, Ev) in enumerate(shapes):
        dtype = (np.float32, np.float64, np.float16)[i % 3]
        q, k, v = make_qkv(rng, lead, L, S, E, Ev, dtype=dtype)
        mask = random_bool_mask(rng, (L, S)) if i % 2 and L and S else None
        cases.append((q, k, v, mask))
    x = rng.standard_normal((4, 33))
    bad_q = np.ones((2, 3, 4), np.int32)

    def one_round(n):
        for j in range(n):
            q, k, v, mask = cases[j % len(cases)]
            # mostly 1 thread: waking an OpenMP team costs more than these tiny problems
            threads = 2 if j % 16 == 0 else 1
            if j % 7 == 0:
                attn.masked_softmax(x, x > 0, backend="cython", num_threads=threads)
            elif j % 11 == 0:
                try:
                    attn.scaled_dot_product_attention(bad_q, k, v)
                except TypeError:
                    pass
            else:
                attn.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=(mask is None and j % 3 == 0),
                    return_weights=(j % 5 == 0), backend="cython", num_threads=threads)

    one_round(1000)  # warm up: allocator pools, caches, OpenMP pool
    gc.collect()
    before = _rss_bytes()
    one_round(10_000)
    gc.collect()
    grown = _rss_bytes() - before
    print(f"RSS growth over 10,000 calls: {grown / 2**20:.2f} MiB")
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 10,000 calls"
