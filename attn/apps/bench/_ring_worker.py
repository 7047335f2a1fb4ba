"""One rank of the ring benchmark (attn/apps/bench/test_bench_ring.py), a spawned process.

Joins a gloo group, draws the benchmark's inputs (the same on every rank and
in the controller), keeps its shards of them, and then serves the
controller's requests over a pipe: ``("run", causal, overlap, n)`` runs
``ring_attention`` forward ``n`` times and answers the seconds;
``("out", causal)`` answers this rank's output shard (for the check);
``("stop",)`` leaves.
"""

import datetime
import time

import numpy as np

SEED = 20261012


def inputs(T, H, E, dtype):
    """q, k, v [1, H, T, E] (the controller draws the same)."""
    rng = np.random.default_rng(SEED)
    return tuple(rng.standard_normal((1, H, T, E)).astype(dtype) for _ in range(3))


def serve(rank, n, port, conn, T, H, E, dtype):
    import torch
    import torch.distributed as dist

    from attn.distributed import ring_attention, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=300))
    full = [torch.from_numpy(a) for a in inputs(T, H, E, dtype)]
    shards = {c: [shard(a, 2, is_causal=c) for a in full] for c in (False, True)}
    del full
    call = lambda causal, overlap: ring_attention(*shards[causal], is_causal=causal, overlap=overlap,
                                                  num_threads=1, timeout=300)
    with torch.inference_mode():
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "out":
                conn.send(call(msg[1], True).numpy())
                continue
            _, causal, overlap, times = msg
            t0 = time.perf_counter()
            for _ in range(times):
                call(causal, overlap)
            conn.send(time.perf_counter() - t0)
    dist.destroy_process_group()
    conn.close()
