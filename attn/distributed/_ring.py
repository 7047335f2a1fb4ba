"""Ring attention: the forward and backward passes over a ring of ranks.

Each rank holds a shard of the queries and a block of the keys and values
(the same layout for both; :mod:`._layout`). At step ``s`` (0 .. n-1) rank
``r`` holds the key/value block of rank ``(r - s) mod n``: it posts the send
of that block to rank ``r + 1`` and the receive of the next one from rank
``r - 1``, runs the kernel on the block it holds while the transfer is under
way, then waits. Partial results are merged by their log-sum-exp
(:mod:`._merge`) in step order, which is fixed (never arrival order), so the
output does not depend on timing.

Backward (FlashAttention-2's, one block at a time): given the *global*
output and log-sum-exp of the local query rows, the backward of (local
queries, one key block) is exactly that block's contribution to dq, dk and
dv. dq stays home; dk and dv travel with their block, each rank adding its
contribution, and after the last step one more hop brings them to the
block's owner.

Every kernel call is a validated problem (:func:`attn._validation.validate_attention`)
whose causal offset is the block's own (:func:`._layout.plan`), run by the backend
that :func:`attn._backends.select` chooses (``gradients=True``), through :mod:`attn._gradients`.
"""

import time
from dataclasses import dataclass, replace

import numpy as np

from .. import _backends, _dtypes, _gradients
from .._interop import to_numpy, to_torch
from .._validation import _causal_alignment, describe_array, validate_attention
from . import _layout
from ._comm import Comm
from ._merge import merge_into

SUPPORTED = ("float32", "float64", "bfloat16")  # bfloat16: computed, merged and sent in float32
MAX_DIMS = 8
MSG_LEN = 512  # bytes of a refused argument's message shared with the other ranks
_DTYPE_CODE = {"float32": 1, "float64": 2, "bfloat16": 3}
_ALIGN_CODE = {None: 0, "upper_left": 1, "lower_right": 2}
_ALIGN_NAME = {0: False, 1: "upper_left", 2: "lower_right"}
_ERROR_TYPES = {1: TypeError, 2: ValueError, 3: RuntimeError}


# ----------------------------------------------------------------- arguments

def as_numpy(x, name):
    """A CPU float32/float64/bfloat16 tensor or array as an ndarray (no copy; bfloat16 as ml_dtypes');
    TypeError/ValueError otherwise."""
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).replace("torch.", "")
            if dt not in SUPPORTED:
                raise TypeError(
                    f"ring_attention supports dtypes {', '.join(SUPPORTED)}; got {name} with shape "
                    f"{tuple(x.shape)} and dtype {x.dtype}")
            return to_numpy(x, name, detach=True)  # a CPU tensor (else ValueError), read in place
    a = np.asarray(x)
    if a.dtype.name not in SUPPORTED:
        raise TypeError(f"ring_attention supports dtypes {', '.join(SUPPORTED)}; got {name} with {describe_array(a)}")
    return a


@dataclass
class Config:
    alignment: object  # None, "upper_left", "lower_right"
    scale: object
    enable_gqa: bool
    backend: str
    num_threads: object
    overlap: bool


@dataclass
class Layout:
    """Who holds which rows: the chunks of every rank's query shard and key block."""

    q_chunks: list  # per rank: [(global_start, length)]
    k_chunks: list
    k_len: list  # per rank: key rows
    offset: object  # global causal offset or None
    n_q: int  # global query rows
    n_k: int  # global key rows


@dataclass
class Stats:
    bytes_sent: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    calls: int = 0
    steps: int = 0

    def as_dict(self, prefix=""):
        return {prefix + k: getattr(self, k) for k in ("bytes_sent", "compute_s", "wait_s", "total_s", "calls", "steps")}


def _dims(shape):
    return [len(shape)] + list(shape) + [-1] * (MAX_DIMS - len(shape))


def _describe_row(row):
    """'query (..) float64, key (..) float64, value (..) float64' from a gathered metadata row."""
    parts = []
    for i, name in enumerate(("query", "key", "value")):
        d = row[1 + i * (MAX_DIMS + 1): 1 + (i + 1) * (MAX_DIMS + 1)]
        shape = tuple(int(x) for x in d[1:1 + d[0]]) if d[0] >= 0 else "?"
        dt = {v: k for k, v in _DTYPE_CODE.items()}.get(int(row[1 + 3 * (MAX_DIMS + 1) + i]), "?")
        parts.append(f"{name} shape {shape} dtype {dt}")
    return ", ".join(parts)


def agree(comm, q, k, v, cfg, grad, local_error):
    """Exchange every rank's shapes, dtypes and options; the same error on every rank if they differ.

    Returns the gathered rows ([size, fields]); raises on every rank when one
    rank refused its arguments (its message is shared), when shapes other
    than the sequence dim, dtypes or options differ between ranks.
    """
    shapes = [np.shape(a) if a is not None else () for a in (q, k, v)]
    if local_error is None and any(len(s) > MAX_DIMS for s in shapes):
        local_error = ValueError(f"ring_attention takes at most {MAX_DIMS} dims; got query with shape {shapes[0]}")
    row = [0]
    for s in shapes:
        row += _dims(s) if len(s) <= MAX_DIMS else [-1] * (MAX_DIMS + 1)
    row += [_DTYPE_CODE.get(getattr(getattr(a, "dtype", None), "name", None), 0) for a in (q, k, v)]
    try:  # (a scale this rank refused is in local_error; nothing here may raise before the exchange)
        scale_bits = -1 if cfg.scale is None else int(np.float64(cfg.scale).view(np.int64))
    except (TypeError, ValueError):
        scale_bits = -2
    row += [_ALIGN_CODE[cfg.alignment] if local_error is None else -1, int(bool(cfg.enable_gqa)), scale_bits,
            int(bool(grad))]
    msg = np.zeros(MSG_LEN, np.int64)
    if local_error is not None:
        row[0] = next((c for c, t in _ERROR_TYPES.items() if isinstance(local_error, t)), 3)
        text = str(local_error).encode()[:MSG_LEN]
        msg[:len(text)] = np.frombuffer(text, np.uint8)
    rows = comm.all_gather_int64(row + list(msg), "exchanging shapes and dtypes (all_gather)")
    meta, msgs = rows[:, :-MSG_LEN], rows[:, -MSG_LEN:]
    if local_error is not None:
        raise local_error
    for j in range(comm.size):
        if meta[j, 0]:
            text = bytes(msgs[j].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
            raise _ERROR_TYPES.get(int(meta[j, 0]), ValueError)(
                f"ring_attention: rank {j} of {comm.size} refused its arguments: {text}")
    comparable = np.ones(meta.shape[1], bool)
    for i in range(3):  # the sequence dim (-2) of query, key and value may differ between ranks
        base = 1 + i * (MAX_DIMS + 1)
        comparable[base + 1 + int(meta[0, base]) - 2] = False
    diff = [j for j in range(comm.size) if not np.array_equal(meta[j][comparable], meta[0][comparable])]
    if diff:
        ranks = [0] + diff
        raise ValueError(
            "ring_attention: the ranks disagree on shapes (other than the sequence dim -2), dtypes, "
            "is_causal, enable_gqa, scale or requires_grad: "
            + "; ".join(f"rank {j}: {_describe_row(meta[j])}, is_causal {_ALIGN_NAME[int(meta[j][-4])]!r}, "
                        f"enable_gqa {bool(meta[j][-3])}, requires_grad {bool(meta[j][-1])}" for j in ranks))
    return meta


def make_layout(comm, meta, alignment):
    """The :class:`Layout` from every rank's shard lengths; ValueError if they break the zigzag layout."""
    n = comm.size
    seq = lambda i: [int(meta[j, 1 + i * (MAX_DIMS + 1) + int(meta[j, 1 + i * (MAX_DIMS + 1)]) - 1])
                     for j in range(n)]
    q_len, k_len = seq(0), seq(1)
    n_q, n_k = sum(q_len), sum(k_len)
    if alignment is None:
        starts = lambda lens: np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(int)
        qs, ks = starts(q_len), starts(k_len)
        q_chunks = [[(int(qs[j]), q_len[j])] for j in range(n)]
        k_chunks = [[(int(ks[j]), k_len[j])] for j in range(n)]
    else:
        for name, lens, total in (("query", q_len, n_q), ("key", k_len, n_k)):
            want = _layout.shard_lengths(total, n, zigzag=True)
            if lens != want:
                raise ValueError(
                    f"ring_attention(is_causal={alignment!r}): the {name} shards must be in the zigzag layout "
                    f"of attn.distributed.shard(x, dim, is_causal=True): {total} rows over {n} ranks are "
                    f"{want} rows per rank; got {lens}")
        q_chunks = [_layout.rank_chunks(n_q, n, j, True) for j in range(n)]
        k_chunks = [_layout.rank_chunks(n_k, n, j, True) for j in range(n)]
    return Layout(q_chunks, k_chunks, k_len, _layout.global_causal_offset(alignment, n_q, n_k), n_q, n_k)


# ----------------------------------------------------------------- kernel calls

def block_problem(q, k, v, causal_offset, cfg):
    """The validated problem of one kernel call (its own causal offset) and the backend that runs it."""
    p = validate_attention(q, k, v, None, 0.0, causal_offset is not None, cfg.scale, cfg.enable_gqa,
                           cfg.backend, False, None, cfg.num_threads)
    # key b visible to row a iff b <= a + causal_offset; results stay in the compute dtype (the
    # ring merges and accumulates in it, and rounds a bfloat16 result once, at the end)
    p = replace(p, causal_offset=causal_offset, out_dtype=p.q.dtype)
    return p, _backends.select(p, gradients=True)


def _with_rows(a, lo, hi):
    return a[..., lo:hi, :]


def _as_tensor(a):
    """A contiguous copy-free torch view of NumPy block ``a`` to send or receive into (bfloat16 too)."""
    return to_torch(np.ascontiguousarray(a))


class Ring:
    """One ring attention call: the configuration, the group and the layout; forward and backward."""

    def __init__(self, comm: Comm, cfg: Config, layout: Layout):
        self.comm, self.cfg, self.layout = comm, cfg, layout
        self.forward_stats, self.backward_stats = Stats(), Stats()
        self.stats_sink = None  # the caller's stats dict, which the backward updates too

    def _block_shape(self, a, src):
        """Shape of rank ``src``'s key (or value) block: ``a``'s shape with its sequence length."""
        return a.shape[:-2] + (self.layout.k_len[src], a.shape[-1])

    def _kv_transfer(self, k_cur, v_cur, s, tag0):
        """Post the sends of the held block and the receives of the next one; (works, k_next, v_next)."""
        import torch

        c = self.comm
        src_next = (c.rank - s - 1) % c.size
        k_next = torch.empty(self._block_shape(k_cur, src_next), dtype=k_cur.dtype)
        v_next = torch.empty(self._block_shape(v_cur, src_next), dtype=v_cur.dtype)
        what_send = f"step {s + 1} of {c.size}: sending the key/value block of rank {(c.rank - s) % c.size}"
        what_recv = f"step {s + 1} of {c.size}: receiving the key/value block of rank {src_next}"
        works = [(c.send(k_cur, c.next, tag0), c.next, what_send), (c.send(v_cur, c.next, tag0 + 1), c.next, what_send),
                 (c.recv(k_next, c.prev, tag0), c.prev, what_recv), (c.recv(v_next, c.prev, tag0 + 1), c.prev, what_recv)]
        return works, k_next, v_next

    def _wait(self, works, stats):
        t0 = time.perf_counter()
        for work, peer, what in works:
            if work is not None:
                self.comm.wait(work, what, peer)
        stats.wait_s += time.perf_counter() - t0

    def _plan(self, src):
        lay = self.layout
        return _layout.plan(lay.q_chunks[self.comm.rank], lay.k_chunks[src], lay.offset)

    def forward(self, q, k, v):
        """``(out [*batch, L_r, Ev], lse [*batch, L_r])`` of the local query rows over every key,
        in the compute dtype (float32 for bfloat16: the caller rounds once)."""
        c, st = self.comm, self.forward_stats
        t_start, bytes0 = time.perf_counter(), c.bytes_sent
        p0 = validate_attention(q, k, v, None, 0.0, False, self.cfg.scale, self.cfg.enable_gqa,
                                self.cfg.backend, False, None, self.cfg.num_threads)
        acc_out = np.zeros(p0.batch + (p0.n_q, p0.d_v), p0.q.dtype)  # compute dtype (float32 for bfloat16)
        acc_lse = np.full(p0.batch + (p0.n_q,), -np.inf, p0.q.dtype)
        k_cur, v_cur = _as_tensor(k), _as_tensor(v)
        for s in range(c.size):
            src = (c.rank - s) % c.size
            works = None
            if s < c.size - 1 and self.cfg.overlap:
                works, k_next, v_next = self._kv_transfer(k_cur, v_cur, s, 2 * s)
            t0 = time.perf_counter()
            kb, vb = to_numpy(k_cur, "key"), to_numpy(v_cur, "value")
            for q_lo, q_hi, k_lo, k_hi, off in self._plan(src):
                p, impl = block_problem(_with_rows(q, q_lo, q_hi), _with_rows(kb, k_lo, k_hi),
                                        _with_rows(vb, k_lo, k_hi), off, self.cfg)
                out, lse = _gradients.forward(p, impl)
                merge_into(acc_out[..., q_lo:q_hi, :], acc_lse[..., q_lo:q_hi], out, lse)
                st.calls += 1
            st.compute_s += time.perf_counter() - t0
            if s < c.size - 1:
                if not self.cfg.overlap:
                    works, k_next, v_next = self._kv_transfer(k_cur, v_cur, s, 2 * s)
                self._wait(works, st)
                k_cur, v_cur = k_next, v_next
            st.steps += 1
        st.bytes_sent += c.bytes_sent - bytes0
        st.total_s += time.perf_counter() - t_start
        return acc_out, acc_lse

    def backward(self, q, k, v, out, lse, dout):
        """``(dq, dk, dv)`` of the local shards, each in its input's shape and the compute dtype
        (float32 for bfloat16: dK and dV travel in it), given the global ``out``, ``lse``."""
        import torch

        c, st = self.comm, self.backward_stats
        t_start, bytes0 = time.perf_counter(), c.bytes_sent
        dtype = _dtypes.compute_dtype(q.dtype)
        dq = np.zeros(q.shape, dtype)
        k_cur, v_cur = _as_tensor(k), _as_tensor(v)
        grad_works, acc = [], None  # the dk/dv transfer in flight; the received (dk, dv) accumulators
        base = 2 * c.size  # tags of the dk/dv transfers (the key/value ones use 0 .. 2n-1)
        for s in range(c.size):
            src = (c.rank - s) % c.size
            kv_works = None
            if s < c.size - 1 and self.cfg.overlap:
                kv_works, k_next, v_next = self._kv_transfer(k_cur, v_cur, s, 2 * s)
            t0 = time.perf_counter()
            kb, vb = to_numpy(k_cur, "key"), to_numpy(v_cur, "value")
            dk_blk, dv_blk = np.zeros(kb.shape, dtype), np.zeros(vb.shape, dtype)
            for q_lo, q_hi, k_lo, k_hi, off in self._plan(src):
                qi, ki, vi = _with_rows(q, q_lo, q_hi), _with_rows(kb, k_lo, k_hi), _with_rows(vb, k_lo, k_hi)
                p, impl = block_problem(qi, ki, vi, off, self.cfg)
                dqi, dki, dvi = _gradients.vjp(p, impl, _with_rows(out, q_lo, q_hi), lse[..., q_lo:q_hi], None,
                                               _with_rows(dout, q_lo, q_hi).astype(p.q.dtype, copy=False), False,
                                               (qi.shape, ki.shape, vi.shape))
                dq[..., q_lo:q_hi, :] += dqi
                dk_blk[..., k_lo:k_hi, :] += dki
                dv_blk[..., k_lo:k_hi, :] += dvi
                st.calls += 1
            st.compute_s += time.perf_counter() - t0
            if c.size == 1:
                dk, dv = dk_blk, dv_blk
                break
            if s > 0:  # what the ranks before this one added to this block
                self._wait(grad_works, st)
                dk_blk = acc[0].numpy() + dk_blk
                dv_blk = acc[1].numpy() + dv_blk
            # send this block's dk, dv on; receive the next block's (after the last step: our own)
            held = (torch.from_numpy(dk_blk), torch.from_numpy(dv_blk))
            owner_next = (c.rank - s - 1) % c.size
            acc = (torch.empty(self._block_shape(k, owner_next), dtype=held[0].dtype),
                   torch.empty(self._block_shape(v, owner_next), dtype=held[1].dtype))
            what_send = f"backward step {s + 1} of {c.size}: sending dK/dV of rank {src}'s block"
            what_recv = f"backward step {s + 1} of {c.size}: receiving dK/dV of rank {owner_next}'s block"
            tag = base + 2 * s
            grad_works = [(c.send(held[0], c.next, tag), c.next, what_send),
                          (c.send(held[1], c.next, tag + 1), c.next, what_send),
                          (c.recv(acc[0], c.prev, tag), c.prev, what_recv),
                          (c.recv(acc[1], c.prev, tag + 1), c.prev, what_recv)]
            if s < c.size - 1:
                if not self.cfg.overlap:
                    kv_works, k_next, v_next = self._kv_transfer(k_cur, v_cur, s, 2 * s)
                self._wait(kv_works, st)
                k_cur, v_cur = k_next, v_next
            st.steps += 1
        if c.size > 1:
            self._wait(grad_works, st)  # our own block's dk, dv, back from the last rank to add to it
            dk, dv = acc[0].numpy(), acc[1].numpy()
        st.steps = c.size
        st.bytes_sent += c.bytes_sent - bytes0
        st.total_s += time.perf_counter() - t_start
        if self.stats_sink is not None:
            self.stats_sink.update(st.as_dict("backward_"))
        return dq, dk, dv


def setup(query, key, value, group, is_causal, scale, enable_gqa, backend, num_threads, overlap, timeout, grad,
          return_lse=False, stats=None):
    """Check the arguments on every rank together; the :class:`Ring` and the local NumPy views."""
    comm = Comm(group, timeout, "ring_attention")
    cfg = Config(None, scale, enable_gqa, backend, num_threads, bool(overlap))
    q = k = v = None
    error = None
    try:  # what this rank refuses, every rank raises (after the exchange): no rank is left waiting
        for name, flag in (("overlap", overlap), ("return_lse", return_lse)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats must be a dict or None, got {type(stats).__name__}")
        cfg.alignment = _causal_alignment(is_causal)
        q, k, v = as_numpy(query, "query"), as_numpy(key, "key"), as_numpy(value, "value")
        p = validate_attention(q, k, v, None, 0.0, False, scale, enable_gqa, backend, False, None, num_threads)
        _backends.select(p, gradients=grad)  # a backend without gradients is refused now, not in backward
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    meta = agree(comm, q, k, v, cfg, grad, error)
    return Ring(comm, cfg, make_layout(comm, meta, cfg.alignment)), q, k, v
