"""Ring attention on several processes of this machine, against one process.

``python -m attn demo ring --nproc 4`` spawns 4 processes (torch.multiprocessing,
gloo on a free localhost port, one kernel thread each). Every rank draws the
same inputs, runs :func:`attn.distributed.ring_attention` forward and backward
on its shard (zigzag for the causal case) and compares its shards of the
output, log-sum-exp and gradients with the single-process call on the whole
sequence. The report gives the largest difference, each rank's times and
bytes sent, and the cost model of docs/distributed.md evaluated with the
kernel rate measured in this run.

The times are only as good as the machine is idle and has a core per rank.
"""

import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from attn._integers import check_int
from attn._interop import to_numpy

SEED = 20261012
B, H, H_KV, T, E = 1, 8, 2, 2048, 64
REPEATS = 3
LINKS = (("1 Gbit/s Ethernet", 0.125e9), ("10 Gbit/s Ethernet", 1.25e9), ("100 Gbit/s (InfiniBand EDR)", 12.5e9))


@dataclass
class RankTimes:
    rank: int
    rows: int  # query rows this rank holds
    forward_s: float  # median over REPEATS calls
    backward_s: float
    compute_s: float  # of one forward: kernel calls and merges
    wait_s: float  # of one forward: waiting for transfers after the kernel calls
    bytes_forward: int
    bytes_backward: int
    flops: float  # of this rank's forward kernel calls


@dataclass
class Case:
    name: str
    max_out: float
    max_lse: float
    max_grad: float
    ranks: list
    one_process_s: float  # forward, one process, one thread, whole sequence
    one_process_backward_s: float


@dataclass
class RingResult:
    nproc: int
    shape: tuple  # (B, H, H_kv, T, E)
    dtype: str
    cases: list = field(default_factory=list)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward_flops(causal, n, rank, shape):
    """Multiply-adds x 2 of this rank's forward blocks: 4 B H (visible pairs) E."""
    from attn.distributed import _layout

    b, h, _, t, e = shape
    chunks = _layout.rank_chunks(t, n, rank, causal)
    pairs = sum(min(i + 1, t) if causal else t for s, m in chunks for i in range(s, s + m))
    return 4.0 * b * h * pairs * e


def _worker(rank, n, port, out_dir, shape, dtype):
    import datetime

    import torch
    import torch.distributed as dist

    import attn
    from attn.distributed import ring_attention, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))
    b, h, h_kv, t, e = shape
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((b, h, t, e)).astype(dtype)
    k, v = (rng.standard_normal((b, h_kv, t, e)).astype(dtype) for _ in range(2))
    g = rng.standard_normal((b, h, t, e)).astype(dtype)
    results = []
    for name, causal in (("dense", False), ("causal", True)):
        # one process, one thread, the whole sequence: the reference (and its time, on rank 0)
        t0 = time.perf_counter()
        ref_out, ref_lse = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                             return_lse=True, num_threads=1)
        one_s = time.perf_counter() - t0
        _, vjp = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=causal, enable_gqa=True, num_threads=1)
        t0 = time.perf_counter()
        ref_grads = vjp(g)
        one_bwd_s = time.perf_counter() - t0
        sh = lambda a: shard(torch.from_numpy(a), 2, is_causal=causal)
        fwd, bwd, last = [], [], None
        for _ in range(REPEATS):
            ts = [sh(a).requires_grad_() for a in (q, k, v)]
            stats = {}
            dist.barrier()
            t0 = time.perf_counter()
            out, lse = ring_attention(*ts, is_causal=causal, enable_gqa=True, return_lse=True, num_threads=1,
                                      stats=stats)
            fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out.backward(sh(g))
            bwd.append(time.perf_counter() - t0)
            last = (out, lse, ts, stats)
        out, lse, ts, stats = last
        diff = lambda a, r: float(np.max(np.abs(to_numpy(a, "result", detach=True).astype(np.float64)
                                                - to_numpy(r, "reference")), initial=0.0))
        results.append({
            "name": name,
            "max_out": diff(out, sh(ref_out)),
            "max_lse": diff(lse, sh(ref_lse[..., None])[..., 0]),
            "max_grad": max(diff(x.grad, sh(r)) for x, r in zip(ts, ref_grads)),
            "rank": RankTimes(rank, int(ts[0].shape[2]), float(np.median(fwd)), float(np.median(bwd)),
                              stats["compute_s"], stats["wait_s"], stats["bytes_sent"],
                              stats["backward_bytes_sent"], _forward_flops(causal, n, rank, shape)).__dict__,
            "one_process_s": one_s, "one_process_backward_s": one_bwd_s,
        })
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run(nproc=4, shape=(B, H, H_KV, T, E), dtype="float64", limit_s=600):
    """Spawn ``nproc`` ranks, run both cases; a :class:`RingResult`."""
    import torch.multiprocessing as tmp

    nproc = check_int(nproc, "nproc", 1, 64)
    ctx = tmp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, nproc, port, out_dir, tuple(shape), dtype))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
        if codes != [0] * nproc:
            raise RuntimeError(f"ring demo: the ranks exited with codes {codes} (see their output above)")
        per_rank = []
        for r in range(nproc):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    result = RingResult(nproc, tuple(shape), dtype)
    for i, first in enumerate(per_rank[0]):
        rows = [pr[i] for pr in per_rank]
        result.cases.append(Case(
            first["name"], max(r["max_out"] for r in rows), max(r["max_lse"] for r in rows),
            max(r["max_grad"] for r in rows), [RankTimes(**r["rank"]) for r in rows],
            first["one_process_s"], first["one_process_backward_s"]))
    return result


def _ms(s):
    return f"{s * 1e3:.1f} ms"


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def hide_rows(rate, itemsize, group, bandwidth, causal):
    """Shard rows T/n from which one step's kernel time covers the transfer of the next block.

    Per step a rank computes 4 B H (T/n)^2 E flops (half with a causal mask) and
    sends 2 B H_kv (T/n) E itemsize bytes: equal times when
    T/n = rate * itemsize / (2 * group * bandwidth), twice that when causal.
    """
    return rate * itemsize / (2 * group * bandwidth) * (2 if causal else 1)


def report(res):
    b, h, h_kv, t, e = res.shape
    itemsize = np.dtype(res.dtype).itemsize
    lines = [
        f"ring attention on {res.nproc} processes of this machine (gloo, localhost), one kernel thread each; "
        f"{res.dtype}, B={b} H={h} (key/value heads {h_kv}) T={t} E={e}, forward and backward",
        f"each rank holds T/{res.nproc} rows of q, k, v (zigzag when causal); one process = the same call on "
        "the whole sequence, one thread",
        "",
        "case    max |out - one process|  max |lse diff|  max |grad diff|  one process fwd / bwd",
    ]
    for c in res.cases:
        lines.append(f"{c.name:<7} {c.max_out:>23.2e}  {c.max_lse:>14.2e}  {c.max_grad:>15.2e}  "
                     f"{_ms(c.one_process_s)} / {_ms(c.one_process_backward_s)}")
    for c in res.cases:
        lines += ["", f"{c.name}: per rank (median of {REPEATS} calls; compute and wait of the last forward)",
                  "rank  rows  forward     backward    compute     wait        sent fwd    sent bwd"]
        for r in c.ranks:
            lines.append(f"{r.rank:>4}  {r.rows:>4}  {_ms(r.forward_s):<10}  {_ms(r.backward_s):<10}  "
                         f"{_ms(r.compute_s):<10}  {_ms(r.wait_s):<10}  {_mib(r.bytes_forward):<10}  "
                         f"{_mib(r.bytes_backward)}")
    dense = next(c for c in res.cases if c.name == "dense")
    rates = [r.flops / r.compute_s for r in dense.ranks if r.compute_s > 0]
    if res.nproc > 1 and rates:
        rate = float(np.median(rates))
        lines += ["", f"cost model (docs/distributed.md) with this run's kernel rate, {rate / 1e9:.1f} GFLOP/s per "
                  f"rank (dense forward): the transfer of a key/value block hides behind one step's kernel "
                  f"call from T/n rows of",
                  "link                         dense      causal"]
        for name, bw in LINKS:
            lines.append(f"{name:<27} {math.ceil(hide_rows(rate, itemsize, h // h_kv, bw, False)):>6}  "
                         f"{math.ceil(hide_rows(rate, itemsize, h // h_kv, bw, True)):>10}")
    return "\n".join(lines)
