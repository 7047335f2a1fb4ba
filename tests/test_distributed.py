"""attn.distributed: ring attention over 1, 2, 3 and 4 gloo ranks on this machine.

Each world size is one spawned group (``torch.multiprocessing``, spawn, rendezvous
on a free localhost port) that runs every case in turn and writes what it
measured; spawning is the slow part, so the cases share it. Every rank draws
the same full inputs, runs ``ring_attention`` on its shard and compares its
shard of the output, log-sum-exp and gradients with two independent
references on the full sequence in float64: torch's SDPA (autograd for the
gradients, ``torch.logsumexp`` of the masked scores for the lse) and the
single-process ``attn.scaled_dot_product_attention`` (and its vjp).
"""

import datetime
import json
import os
import socket
import time
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

import attn  # noqa: E402
from attn import _dtypes  # noqa: E402
from attn._interop import to_torch  # noqa: E402
from attn.distributed import _layout  # noqa: E402

TOL64, TOL32 = 1e-12, 2e-5
U_BF16 = 2.0 ** -8  # a bfloat16 result is its float32 value rounded once: off by at most u |x| more

# name: (B, H, H_kv, L, S, E, Ev, is_causal, dtype)
CASES = {
    "dense": (2, 2, 2, 16, 16, 8, 8, False, "float64"),
    "dense-odd-L-ne-S": (1, 2, 2, 7, 11, 8, 5, False, "float64"),
    "causal": (2, 2, 2, 16, 16, 8, 8, True, "float64"),
    "causal-odd": (1, 2, 2, 13, 13, 4, 4, True, "float64"),
    "causal-gqa": (1, 4, 2, 12, 12, 8, 8, True, "float64"),
    "dense-gqa": (1, 6, 2, 9, 9, 8, 8, False, "float64"),
    "upper-left-L<S": (1, 2, 2, 5, 12, 8, 8, "upper_left", "float64"),
    "lower-right-L<S": (1, 2, 2, 5, 12, 8, 8, "lower_right", "float64"),
    "lower-right-decode": (1, 4, 2, 1, 10, 8, 8, "lower_right", "float64"),
    "causal-tiny": (1, 1, 1, 3, 3, 4, 4, True, "float64"),
    "causal-f32": (1, 2, 2, 16, 16, 8, 8, True, "float32"),
    "causal-bf16": (1, 2, 2, 16, 16, 8, 8, True, "bfloat16"),
    "dense-gqa-bf16": (1, 6, 2, 9, 9, 8, 8, False, "bfloat16"),
}
EXTRA = ("numpy-in", "no-overlap", "stats")  # variants on "causal"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(case):
    B, H, Hkv, L, S, E, Ev, causal, dt = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    g = rng.standard_normal((B, H, L, Ev))
    return [a.astype(_dtypes.as_dtype(dt)) for a in (q, k, v, g)], causal, H != Hkv


def _torch_reference(q, k, v, g, causal, gqa):
    """out, lse, dq, dk, dv of the full sequence by torch in float64 (independent of attn)."""
    t = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (q, k, v)]
    L, S = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        off = 0 if causal in (True, "upper_left") else S - L
        mask = torch.from_numpy(np.arange(S)[None, :] <= np.arange(L)[:, None] + off)
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask, enable_gqa=gqa)
    out.backward(torch.from_numpy(g.astype(np.float64)))
    kk = t[1].detach().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = t[0].detach() @ kk.transpose(-2, -1) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return [out.detach().numpy(), lse.numpy()] + [x.grad.numpy() for x in t]


def _attn_reference(q, k, v, g, causal, gqa):
    """The same five by the single-process attn call (float64)."""
    q, k, v, g = (a.astype(np.float64) for a in (q, k, v, g))
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_lse=True)
    _, backward = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=causal, enable_gqa=gqa)
    return [out, lse] + list(backward(g))


def _excess(a, exact):
    """max |a - exact| beyond a bfloat16 ``a``'s one rounding (u |exact|, float32 values computed)."""
    if not a.size:
        return 0.0
    err = np.abs(a.astype(np.float64) - exact)
    if _dtypes.is_bfloat16(a.dtype):
        err = err - U_BF16 * np.abs(exact)
    return float(np.max(err))


def _shard_np(a, n, rank, causal, dim=2):
    pieces = _layout.rank_chunks(a.shape[dim], n, rank, bool(causal))
    return np.concatenate([a[:, :, s:s + m] for s, m in pieces], axis=dim)


def _run_case(case, n, rank, variant=None, group=None):
    from attn.distributed import ring_attention, shard, unshard

    (q, k, v, g), causal, gqa = _inputs(case)
    refs = {"torch": _torch_reference(q, k, v, g, causal, gqa), "attn": _attn_reference(q, k, v, g, causal, gqa)}
    stats = {}
    if variant == "numpy-in":
        qs, ks, vs = (shard(a, 2, is_causal=causal, group=group) for a in (q, k, v))
        out, lse = ring_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa, return_lse=True, group=group)
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
        mine = [out, lse]
    else:
        ts = [shard(to_torch(a), 2, is_causal=causal, group=group).requires_grad_() for a in (q, k, v)]
        out, lse = ring_attention(*ts, is_causal=causal, enable_gqa=gqa, return_lse=True, group=group,
                                  overlap=variant != "no-overlap", stats=stats)
        out.backward(to_torch(np.ascontiguousarray(_shard_np(g, n, rank, causal))))
        as_np = lambda t: attn._interop.to_numpy(t.detach(), "result")  # noqa: E731
        mine = [as_np(out), as_np(lse)] + [as_np(t.grad) for t in ts]
        full = unshard(out.detach(), 2, is_causal=causal, group=group)
        mine_full_err = _excess(as_np(full), refs["attn"][0])
    errs = {}
    names = ["out", "lse", "dq", "dk", "dv"]
    want = _dtypes.as_dtype(CASES[case][-1])
    for who, ref in refs.items():
        for name, a, r in zip(names, mine, ref):
            r = _shard_np(r[..., None] if name == "lse" else r, n, rank, causal)
            r = r[..., 0] if name == "lse" else r
            assert a.shape == r.shape, (case, name, a.shape, r.shape)
            # lse is in the compute dtype (float32 for bfloat16), the rest in the input's
            assert a.dtype == (_dtypes.compute_dtype(want) if name == "lse" else want), (case, name, a.dtype)
            errs[f"{name} vs {who}"] = _excess(a, r)
    if variant != "numpy-in":
        errs["unshard out vs attn"] = mine_full_err
    if variant == "stats":
        errs["stats"] = {k: stats[k] for k in ("bytes_sent", "calls", "steps", "backward_bytes_sent")}
    return errs


def _error_cases(n, rank):
    """Arguments that every rank must refuse together (and the group is still usable after)."""
    from attn.distributed import ring_attention

    x = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    got = {}

    def expect(name, exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            got[name] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got[name] = f"WRONG {type(exc).__name__}: {exc}"
        else:
            got[name] = "WRONG: nothing raised"

    half = x.to(torch.float16)
    expect("float16", TypeError, lambda: ring_attention(half, half, half))
    if n > 1:
        e = 8 if rank == 0 else 4
        y = torch.zeros(1, 2, 4, e, dtype=torch.float64)
        expect("shape", ValueError, lambda: ring_attention(y, y, y))
        z = x.float() if rank == n - 1 else x
        expect("dtype", ValueError, lambda: ring_attention(z, z, z))
        w = torch.zeros(1, 2, 4 if rank == 0 else 5, 8, dtype=torch.float64)  # zigzag gives rank 0 the most
        expect("layout", ValueError, lambda: ring_attention(w, w, w, is_causal=True))
    expect("overlap", TypeError, lambda: ring_attention(x, x, x, overlap="yes" if rank == 0 else True))
    expect("timeout", ValueError, lambda: ring_attention(x, x, x, timeout=-1))
    bad = torch.zeros(1, 2, 4, 3, dtype=torch.float64) if rank == 0 else x
    expect("local", ValueError, lambda: ring_attention(bad, x, x))  # E of query != E of key on rank 0
    return got


MISSING = {2: "silent", 3: "dies"}  # after its cases, the group of 2 (3) loses its last rank thus


def _missing_rank(n, rank, mode):
    """The last rank makes no call (silent) or dies in the middle of one; the others' error and seconds."""
    from attn.distributed import RingError, _ring, ring_attention

    x = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    if rank == n - 1:
        if mode == "silent":
            time.sleep(3.5)  # makes no call; alive past the others' timeout, so they time out
            return None
        _ring.block_problem = lambda *args: os._exit(17)  # dies at its first kernel call, its sends posted
    t0 = time.monotonic()
    try:
        ring_attention(x, x, x, timeout=2.0)
        error = "WRONG: nothing raised"
    except RingError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - t0}


def _worker(rank, n, port, out_dir):
    result = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=60))
        for case in CASES:
            result[case] = _run_case(case, n, rank)
        for variant in EXTRA:
            result["causal/" + variant] = _run_case("causal", n, rank, variant)
        result["errors"] = _error_cases(n, rank)
        result["after errors"] = _run_case("causal-odd", n, rank)  # the group is still in step
        if n == 4:  # two rings side by side in sub-groups: group ranks are not global ranks
            pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            mine = pairs[rank % 2]
            result["sub-group"] = _run_case("causal-gqa", 2, dist.get_rank(mine), group=mine)
    except Exception:  # noqa: BLE001 - reported to the test
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if n in MISSING and "crash" not in result:
        missing = _missing_rank(n, rank, MISSING[n])  # (the rank that dies never returns)
        with open(os.path.join(out_dir, f"rank{rank}-missing.json"), "w") as f:
            json.dump(missing, f)
    os._exit(0)  # no teardown handshake with ranks that may be gone


def _spawn(n, tmp_path, limit=240):
    ctx = tmp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, str(tmp_path))) for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"ranks still running after {limit} s: a hang"
    results = {}
    for r in range(n):
        path = tmp_path / f"rank{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
            missing = tmp_path / f"rank{r}-missing.json"
            if missing.exists():
                results[r]["missing"] = json.loads(missing.read_text())
    return results, [p.exitcode for p in procs]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"{n}ranks")
def group_results(request, tmp_path_factory):
    n = request.param
    results, codes = _spawn(n, tmp_path_factory.mktemp(f"ring{n}"))
    assert codes == [0] * (n - 1) + [17 if MISSING.get(n) == "dies" else 0], codes
    for r, res in results.items():
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return n, results


@pytest.mark.parametrize("case", list(CASES) + [f"causal/{v}" for v in EXTRA])
def test_matches_single_process(group_results, case):
    n, results = group_results
    tol = TOL64 if CASES[case.split("/")[0]][-1] == "float64" else TOL32  # bfloat16: beyond its rounding
    for r in range(n):
        errs = dict(results[r][case])
        stats = errs.pop("stats", None)
        bad = {k: e for k, e in errs.items() if not e <= tol}
        assert not bad, f"rank {r} of {n}, {case}: {bad} (tolerance {tol})"
        if stats is not None:  # "causal": B=2, H=2, L=16, E=Ev=8, float64
            assert stats["steps"] == n and stats["calls"] >= 1
            row = 2 * 2 * 8 * 8  # bytes of one sequence row of K (or V): B * H * E * 8
            lens = _layout.shard_lengths(16, n, zigzag=True)
            forward = sum(2 * row * lens[(r - s) % n] for s in range(n - 1))  # K and V of n - 1 blocks
            assert stats["bytes_sent"] == forward, stats
            grads = 2 * row * 16 if n > 1 else 0  # dK and dV of every block, one hop each step
            assert stats["backward_bytes_sent"] == forward + grads, stats


def test_errors_are_raised_on_every_rank(group_results):
    n, results = group_results
    for r in range(n):
        got = results[r]["errors"]
        wrong = {k: m for k, m in got.items() if m.startswith("WRONG")}
        assert not wrong, f"rank {r}: {wrong}"
        assert "float32, float64, bfloat16" in got["float16"] and "torch.float16" in got["float16"]
        if n > 1:
            assert "disagree" in got["shape"] and "(1, 2, 4, 8)" in got["shape"] and "(1, 2, 4, 4)" in got["shape"]
            assert "float32" in got["dtype"] and "float64" in got["dtype"]
            assert "zigzag" in got["layout"]
        assert ("query" in got["local"] and "key" in got["local"]) and (r == 0 or "rank 0" in got["local"])
        assert "overlap must be True or False" in got["overlap"] and "timeout must be positive" in got["timeout"]
        assert max(results[r]["after errors"].values()) <= TOL64
        if n == 4:
            assert max(results[r]["sub-group"].values()) <= TOL64


def test_a_missing_rank_is_an_error_within_the_timeout(group_results):
    n, results = group_results
    if n not in MISSING:
        pytest.skip(f"the groups of {sorted(MISSING)} ranks lose one")
    for r in range(n - 1):
        res = results[r]["missing"]
        expected = "RingTimeoutError" if MISSING[n] == "silent" else ("RingError", "RingTimeoutError")
        assert res["error"].startswith(expected), res["error"]
        assert "timeout=2 s" in res["error"] and f"rank {r} of {n}" in res["error"]
        assert res["seconds"] < 2.0 + 5.0, res


def test_size_one_group_and_no_group_without_torch_distributed():
    from attn.distributed import ring_attention

    assert not dist.is_initialized()
    x = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not initialized"):
        ring_attention(x, x, x)


def test_layout_arithmetic():
    assert _layout.shard_lengths(13, 4, zigzag=True) == [3, 3, 3, 4]
    assert _layout.shard_lengths(13, 4, zigzag=False) == [4, 3, 3, 3]
    assert _layout.rank_chunks(16, 2, 0, True) == [(0, 4), (12, 4)]
    for total, n in ((16, 2), (13, 4), (3, 4), (0, 3)):  # every row exactly once
        for zig in (False, True):
            rows = sorted(i for r in range(n) for s, m in _layout.rank_chunks(total, n, r, zig) for i in range(s, s + m))
            assert rows == list(range(total))
    # the causal work of the zigzag layout is the same on every rank (visible pairs per rank)
    for n in (2, 3, 4):
        L = 8 * n
        work = [sum(min(i + 1, L) for s, m in _layout.rank_chunks(L, n, r, True) for i in range(s, s + m))
                for r in range(n)]
        assert len(set(work)) == 1, work


def test_import_attn_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, attn, attn.distributed; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_reports_differences_times_and_bytes():
    from attn.apps.demos import ring

    res = ring.run(nproc=2, shape=(1, 2, 1, 40, 8))
    assert [c.name for c in res.cases] == ["dense", "causal"]
    for c in res.cases:
        assert max(c.max_out, c.max_lse, c.max_grad) < 1e-12
        assert [r.rank for r in c.ranks] == [0, 1] and all(r.bytes_forward == 20 * 8 * 2 * 8 for r in c.ranks)
    text = ring.report(res)
    assert "max |out - one process|" in text and "sent fwd" in text and "10 Gbit/s Ethernet" in text


def test_nproc_is_refused_for_other_demos():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "attn", "demo", "scaling", "--nproc", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--nproc is available for ring, not scaling" in proc.stderr


def test_a_transfer_that_fails_as_it_is_posted_is_a_ring_error():
    """A peer that died before a send or receive is posted makes torch.distributed raise at
    once ("Connection reset by peer"), not in the wait: the same RingError as a failed wait."""
    from attn.distributed import RingError, RingTimeoutError
    from attn.distributed._comm import Comm

    class DeadPeer:  # what gloo does when the peer's connection is gone
        def isend(self, *args, **kwargs):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

        irecv = all_gather = isend

    comm = Comm.__new__(Comm)  # a group of 3 seen from rank 1, without a process group
    comm.dist, comm.what, comm.timeout = DeadPeer(), "ring_attention", datetime.timedelta(seconds=2)
    comm.rank, comm.size, comm.next, comm.prev, comm.bytes_sent = 1, 3, 2, 0, 0
    comm.group = comm.dist.group = None
    comm._global = lambda peer: peer
    t = torch.zeros(4)
    for post in (lambda: comm.send(t, 2, 0), lambda: comm.recv(t, 0, 0),
                 lambda: comm.all_gather([t] * 3, t, "gathering")):
        with pytest.raises(RingError, match="rank 1 of 3, .* a rank probably died") as raised:
            post()
        assert not isinstance(raised.value, RingTimeoutError)
        assert "Connection reset by peer" in str(raised.value)
