"""Scenarios of tests/test_fork.py, each run as ``python tests/_fork_scenarios.py NAME`` in a
subprocess with a time limit (a hang fails the test instead of stalling the suite).

Every scenario first runs attn on two threads in the parent, so that the OpenMP runtime's
pool exists when the children are made; the children then call attn and check their results
against float64 NumPy within the rounding bounds of tests/_bounds.py (and bit for bit against
the parent's: results do not depend on the thread count). A scenario prints ``ok`` at the end.
"""

import multiprocessing
import os
import sys
import warnings

import numpy as np

import attn
from _bounds import assert_sdpa_close, assert_within, sdpa_grad_error

THREADS = 2  # more than one: the parent's call starts a pool


def problem(seed, dtype=np.float32):
    """q, k, v [1, 4, 256, 64]: large enough that a call takes two threads."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 4, 256, 64)).astype(dtype) for _ in range(3))


def forward(seed, num_threads=THREADS):
    q, k, v = problem(seed)
    return attn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=num_threads)


def check_forward(seed, out):
    q, k, v = problem(seed)
    ref = _sdpa64(q, k, v)
    assert_sdpa_close(out, ref, q, k, v, is_causal=True, what=f"forward, seed {seed}, pid {os.getpid()}")


def _sdpa64(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def backward(seed):
    q, k, v = problem(seed, np.float64)
    out, vjp = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True, num_threads=THREADS)
    return vjp(np.cos(np.arange(out.size)).reshape(out.shape))


def check_backward(seed, grads):
    """The gradients against NumPy's float64 formulas (P, dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D), ...)."""
    q, k, v = problem(seed, np.float64)
    dout = np.cos(np.arange(q.size)).reshape(q.shape[:-1] + (v.shape[-1],))
    scale = 1 / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((q.shape[-2], k.shape[-2]), bool)), scale * q @ np.swapaxes(k, -1, -2), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dout * (p @ v), -1, keepdims=True))
    ref = (scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ dout)
    bounds = sdpa_grad_error(q, k, v, dout, is_causal=True, dtype=np.float64)
    for name, got, want, bound in zip(("dq", "dk", "dv"), grads, ref, bounds):
        assert_within(got, want, 2 * bound, f"{name}, pid {os.getpid()}")


def threads_of_this_process():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def in_child(work):
    """Run ``work()`` in a forked child; its exit status is the parent's verdict."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child failed: status {status}"


def scenario_fork_after_forward():
    parent = forward(0)
    check_forward(0, parent)

    def child():
        before = threads_of_this_process()
        out = forward(0)
        assert np.array_equal(out, parent)
        check_forward(0, out)
        assert np.array_equal(forward(0, num_threads=None), parent)   # the default count too
        # the call ran on more threads than the child started with: the master and its pool
        assert threads_of_this_process() >= before + THREADS, (before, threads_of_this_process())
        in_child(lambda: check_forward(0, forward(0)))                # a grandchild too
    in_child(child)
    assert np.array_equal(forward(0), parent)                         # the parent is unharmed


def scenario_fork_after_backward():
    parent = backward(1)
    check_backward(1, parent)

    def child():
        grads = backward(1)
        assert all(np.array_equal(a, b) for a, b in zip(grads, parent))
        check_backward(1, grads)
        check_forward(2, forward(2))
    in_child(child)


def scenario_fork_without_master():
    """Where no master thread can be created (the tests' hook says so), the child runs
    single-threaded, with one RuntimeWarning for the process."""
    import attn._kernels_testing as testing

    parent = forward(3)

    def child():
        testing.refuse_fork_master()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [forward(3), forward(3), forward(3, num_threads=None)]
        mine = [w for w in caught if issubclass(w.category, RuntimeWarning) and "forked child" in str(w.message)]
        assert len(mine) == 1, [str(w.message) for w in caught]
        assert all(np.array_equal(o, parent) for o in outs)
        check_forward(3, outs[0])
    in_child(child)


def pool_task(seed):
    out = forward(seed)
    check_forward(seed, out)
    return seed, out


def scenario_pool(method):
    parents = {seed: forward(seed) for seed in range(4)}
    with multiprocessing.get_context(method).Pool(2) as pool:
        for seed, out in pool.map(pool_task, range(4)):
            assert np.array_equal(out, parents[seed]), seed


class AttentionDataset:
    """torch Dataset: item i is attn's output on problem i and the thread count attn used."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        out = forward(i, num_threads=None)
        check_forward(i, out)
        return attn.get_num_threads(), out


def scenario_dataloader():
    import torch
    from torch.utils.data import DataLoader

    parents = {i: forward(i) for i in range(4)}
    loader = DataLoader(AttentionDataset(), batch_size=None, num_workers=2, persistent_workers=False)
    for epoch in range(2):
        seen = 0
        for i, (threads, out) in enumerate(loader):
            assert threads == 1, f"epoch {epoch}, item {i}: attn used {threads} threads in a worker (torch: 1)"
            assert np.array_equal(np.asarray(out), parents[i]), (epoch, i)
            seen += 1
        assert seen == 4
    assert attn.get_num_threads() == attn.backends()["max_threads"]   # the parent keeps its default
    del torch


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    globals()[f"scenario_{name}"](*args)
    print("ok")
