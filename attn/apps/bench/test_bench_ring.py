"""Ring attention on 2 ranks of 1 thread vs one process with 2 threads, on the same sequence.

B=1 H=8 T=8192 E=64 float32, forward, causal and not (T: env ATTN_BENCH_RING_T).
Two spawned ranks (attn/apps/bench/_ring_worker.py: gloo on localhost, one kernel
thread each, inputs sharded once, zigzag when causal) wait for the
controller; one "ring" call is both ranks running ``ring_attention`` (the
controller times it from its request to both answers). "one process" is
``attn.scaled_dot_product_attention`` on the whole sequence with
``num_threads=2`` in the controller, the ranks idle meanwhile. Paired ratios
(alternating blocks, attn/apps/bench/_paired.py):

* ring / one process: what the ring costs on the cores one process would use
  (1.0: free; the ring does the same flops plus merges and transfers);
* ring without overlap / ring: what overlapping the transfer with the kernel gains.

Needs torch and 2 cores that nothing else uses; in the full grid only:

    python -m pytest bench --bench-grid full -k ring -s                       # the figures
    ATTN_BENCH_RING_T=1024 python -m pytest bench --bench-grid full -k ring -s --benchmark-disable   # smoke test
"""

from __future__ import annotations

import gc
import os
import socket
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import attn  # noqa: E402
from attn.apps.bench import _ring_worker  # noqa: E402
from attn.apps.bench._paired import paired_ratio  # noqa: E402
from attn.distributed import _layout  # noqa: E402

pytestmark = pytest.mark.bench_grids("full")

N_RANKS, H, E, DTYPE = 2, 8, 64, "float32"
T = int(os.environ.get("ATTN_BENCH_RING_T", "8192"))


class Ranks:
    """The spawned ranks and their pipes."""

    def __init__(self):
        ctx = torch.multiprocessing.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for r in range(N_RANKS):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_ring_worker.serve, args=(r, N_RANKS, port, theirs, T, H, E, DTYPE))
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def ask(self, *msg, timeout=600):
        for c in self.conns:
            c.send(msg)
        answers = []
        for c, p in zip(self.conns, self.procs):
            if not c.poll(timeout):
                raise RuntimeError(f"ring benchmark: a rank did not answer {msg[0]!r} within {timeout} s "
                                   f"(exit codes {[q.exitcode for q in self.procs]})")
            answers.append(c.recv())
        return answers

    def run(self, causal, overlap):
        self.ask("run", causal, overlap, 1)

    def close(self):
        for c in self.conns:
            c.send(("stop",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def ranks():
    r = Ranks()
    yield r
    r.close()


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_ring_paired(ranks, causal, bench_settings):
    q, k, v = _ring_worker.inputs(T, H, E, DTYPE)
    one = lambda: attn.scaled_dot_product_attention(q, k, v, is_causal=causal, num_threads=N_RANKS)
    # the check: the ranks' output shards put together are the one-process output
    shards = ranks.ask("out", causal)
    ref = one()
    for r, got in enumerate(shards):
        want = np.concatenate([ref[:, :, s:s + m] for s, m in _layout.rank_chunks(T, N_RANKS, r, causal)], axis=2)
        assert float(np.max(np.abs(got - want))) < 1e-4
    blocks = 1 if bench_settings.disabled else None
    ring = lambda: ranks.run(causal, True)
    serial = lambda: ranks.run(causal, False)
    gc.collect()
    r1 = paired_ratio(one, ring, blocks=blocks, budget=bench_settings.paired_budget)
    time.sleep(0.2)
    r2 = paired_ratio(ring, serial, blocks=blocks, budget=bench_settings.paired_budget)
    group = f"ring B=1 H={H} T={T} E={E}{' causal' if causal else ''} f32, {N_RANKS} ranks x 1 thread"
    print(f"\n{group}: one process ({N_RANKS} threads) {r1['a'] * 1e3:.1f} ms, ring {r1['b'] * 1e3:.1f} ms, "
          f"paired ring/one process {r1['ratio']:.2f} (q1 {r1['ratio_q1']:.2f}, q3 {r1['ratio_q3']:.2f}); "
          f"ring without overlap {r2['b'] * 1e3:.1f} ms, paired no-overlap/overlap {r2['ratio']:.2f} "
          f"(q1 {r2['ratio_q1']:.2f}, q3 {r2['ratio_q3']:.2f})")
    assert r1["a"] > 0 and r1["b"] > 0 and r2["b"] > 0
