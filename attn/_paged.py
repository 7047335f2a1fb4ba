"""Attention over a key/value cache: each sequence its own lengths, K/V contiguous or in pages.

This is what serving needs below FlashAttention's API (:mod:`attn.flash`):
a batch of sequences, each with its own query rows and its own number of
cached keys, the keys either in one array per batch row (a contiguous cache,
``[batch_cache, seqlen_cache, H_kv, E]``) or in fixed-size pages of a shared
pool (``[n_pages, page_size, H_kv, E]``) listed per sequence by a block table
(``[batch, max_pages]`` of page indices). Sequence s attends with its query
rows aligned to its own last key (FlashAttention's bottom-right convention:
row i of L_s rows sees key j iff ``j <= i + S_s - L_s`` under ``causal``,
window and ALiBi offsets alike).

The backend layer chooses how (:func:`attn._backends.select_cache`). The fused
kernel (a backend that ``RUNS_CACHE``: its ``cache_forward``) reads the pages
where they lie (``attn_problem.pages``, attn/_src/attn_kernel.h; attn._kernels'
``_flash_block``): decode blocks follow the page list key by key, larger blocks
read a tile per page or, for pages shorter than a tile, from their thread's
copy of the sequence's keys. Two plans:

* sequences of the same L <= ``DECODE_MAX_Q`` query rows (decoding,
  speculative tokens): the uniform batch of the kernel, one matrix per
  (sequence, head), with per-matrix key lengths (``kv_len``): the query heads
  of a key/value head share each page read and long contexts are split into
  key chunks merged afterwards (split-KV), as the contiguous decode is;
* longer sequences (chunked prefill): the kernel's packed variable-length
  batch (``varlen``), blocks of one sequence's rows, the output written in
  place in the caller's layout.

A batch mixing prefill chunks and decode rows runs both: its single decode
rows by the first plan, its longer sequences by the second, in two kernel
calls writing one output.

Every index is checked before the kernel runs (:func:`check_block_table`):
a page index outside the pool, a length beyond the table's capacity, a
block table of the wrong dtype or shape are a ValueError/TypeError naming the
argument. Without the compiled kernels the pages are gathered and each
sequence runs :func:`attn.varlen_attention`'s NumPy reference.
"""

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from . import _backends, _dtypes, _quantized
from ._validation import as_float_array, describe_array
from ._varlen import varlen_attention

#: The most query rows per sequence that take the decode plan (attn_kernel.h's ATTN_SPLIT_MAX_Q).
DECODE_MAX_Q = 16


@dataclass(frozen=True)
class CacheProblem:
    """A validated attention call over a cache (see the module docstring).

    Query rows: sequence s owns tokens ``q_start[s] : q_start[s] + q_len[s]``
    of ``q[q_batch[s]]``; keys: ``k_len[s]`` keys from token ``k_start[s]``
    of ``k[k_batch[s]]`` (contiguous) or the pages ``block_table[s]``.
    """

    q: np.ndarray  # [Bq, Tq, H, E], the compute dtype (float32 for 16-bit inputs), or a 16-bit q as given
    #                over a cache of its dtype (the fused kernel reads it so: :func:`kernel_query`)
    q_batch: np.ndarray  # int64 [B]
    q_start: np.ndarray  # int64 [B]
    q_len: np.ndarray  # int64 [B]
    k: np.ndarray  # [Bc, Tk, H_kv, E] or pages [n_pages, page_size, H_kv, E]; as stored (or a Q8Tensor)
    v: np.ndarray  # [Bc, Tk, H_kv, Ev] or pages [n_pages, page_size, H_kv, Ev]
    k_batch: np.ndarray  # int64 [B] (zeros when paged)
    k_start: np.ndarray  # int64 [B] (zeros when paged)
    k_len: np.ndarray  # int64 [B]
    block_table: Optional[np.ndarray]  # int32 [B, max_pages], C-contiguous; None: contiguous K/V
    causal: bool
    scale: float
    window: Optional[tuple]  # (left, right), -1 unbounded; None
    softcap: Optional[float]
    alibi_slopes: Optional[np.ndarray]  # [H] or [B, H]
    sinks: Optional[np.ndarray]  # [H]
    out_dtype: np.dtype
    q_bf16: bool  # the query was bfloat16 (the kernel's bfloat16 products)
    num_threads: int
    v_descale: Optional[object] = None  # a float8 cache's value scale: a float, or [B, H] per sequence and head
    # an object standing for the lengths, block table and thread count, the same for every problem that
    # shares it (a vLLM step's plan: attn.integrations._vllm_plan), whose arrays are never changed: the
    # fused backend then derives the kernel's offsets once per token and layout (attn._backends.fused)
    plan_token: Optional[object] = None

    @property
    def n_seq(self):
        return self.q_len.shape[0]

    @property
    def cdtype(self):
        """The compute dtype (float32 for a 16-bit ``q``)."""
        return _dtypes.compute_dtype(self.q.dtype)

    @property
    def heads(self):
        return self.q.shape[2]

    @property
    def group(self):
        return self.q.shape[2] // self.k.shape[2]

    @property
    def uniform_decode(self):
        """Whether the decode plan runs it: q is [B, L, H, E], L <= DECODE_MAX_Q, every row a query."""
        n = self.n_seq
        return (self.q.shape[0] == n and self.q.shape[1] <= DECODE_MAX_Q and n > 0
                and np.array_equal(self.q_batch, np.arange(n)) and not self.q_start.any()
                and bool(np.all(self.q_len == self.q.shape[1])))


def kernel_query(q, k, v):
    """Query ``q`` as a :class:`CacheProblem` holds it: a 16-bit query (bfloat16, float16) over a ``k``
    and ``v`` of its dtype as it is (the fused kernel reads its values in place, attn_problem.q_raw16,
    where a float32 copy cost a bfloat16 prefill 2 x 1024 H32/8 E128 a pass over 32 MiB and its page
    faults), any other widened to the compute dtype."""
    if (_dtypes.is_16bit(q.dtype) and isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
            and k.dtype == q.dtype and v.dtype == q.dtype):
        return q
    return _dtypes.cast(q, _dtypes.compute_dtype(q.dtype))


# ------------------------------------------------------------------ checks
def as_cache(x, name):
    """A cache operand as attn reads it: an :class:`attn.Q8Tensor` (int8 q8_0 rows, attn's
    extension) as it is, a float8 (ml_dtypes' float8_e4m3fn / float8_e5m2) ndarray as it is,
    anything else as a float ndarray (TypeError naming ``name``)."""
    if _quantized.is_q8(x):
        return x
    if isinstance(x, np.ndarray) and _dtypes.is_float8(x.dtype):
        return x
    return as_float_array(x, name)


def check_cache_dtypes(q, k, v, what):
    """q's dtype against a cache's: the cache's own, or float32 (or 16-bit) q over a float16,
    bfloat16, float8 or int8 (q8_0) cache; k and v of one kind. TypeError naming them otherwise."""
    k_q8, v_q8 = _quantized.is_q8(k), _quantized.is_q8(v)
    q_compute = _dtypes.compute_dtype(q.dtype)
    if k_q8 or v_q8:
        ok = k_q8 and v_q8 and q_compute == np.float32
    elif _dtypes.is_float8(k.dtype) or _dtypes.is_float8(v.dtype):
        ok = k.dtype == v.dtype and q_compute == np.float32
    else:
        ok = (k.dtype == v.dtype and q_compute == _dtypes.compute_dtype(k.dtype)
              and (not _dtypes.is_16bit(q.dtype) or q.dtype == k.dtype))
    if not ok:
        raise TypeError(f"q and {what} must have one dtype (or a float32 q over float16, bfloat16, float8 "
                        f"(float8_e4m3fn, float8_e5m2) or int8 "
                        f"attn.Q8Tensor {what}, k and v alike); got q with {describe_array(q)}, "
                        f"k with {describe_array(k)}, v with {describe_array(v)}")


def check_descale(x, name, batch, heads_k, cache):
    """A float8 cache's ``k_descale`` / ``v_descale`` (FlashAttention 3's names: the stored value
    times it is the real one): None (1), a number, or an array broadcastable to [batch, nheads_k];
    a float ndarray [batch, nheads_k] of finite positive values, or None. ValueError/TypeError
    naming ``name`` otherwise (a descale for a cache that is not float8 included)."""
    if x is None:
        return None
    if not _dtypes.is_float8(cache.dtype):
        raise ValueError(f"{name} applies to a float8 cache (float8_e4m3fn, float8_e5m2); the cache has dtype "
                         f"{cache.dtype}")
    try:
        a = np.asarray(x, np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or an array of [batch, nheads_k] floats, got {x!r}") from None
    try:
        a = np.broadcast_to(a, (batch, heads_k))
    except ValueError:
        raise ValueError(f"{name} must broadcast to [batch, nheads_k] = [{batch}, {heads_k}]; got shape "
                         f"{a.shape}") from None
    if not (np.isfinite(a).all() and (a > 0).all()):
        raise ValueError(f"{name} must be finite and > 0; got {a.ravel()[:8].tolist()}")
    return a


def apply_descale(p, k_descale, v_descale):
    """Problem ``p`` over a float8 cache with the checked descales (:func:`check_descale`, [B, H_kv]
    or None): K's scale joins the softmax scale (one value for all) or each sequence's query rows
    of each head (per sequence and head, a float32 copy of q, no longer bfloat16 values: q_bf16
    cleared); V's is kept for :func:`forward`,
    which multiplies the output by it."""
    g = p.group
    changes = {}
    if k_descale is not None:
        if (k_descale == k_descale.flat[0]).all():
            changes["scale"] = p.scale * float(k_descale.flat[0])
        else:
            q = p.q.copy()
            for s in range(p.n_seq):
                b, t, n = int(p.q_batch[s]), int(p.q_start[s]), int(p.q_len[s])
                q[b, t:t + n] *= np.repeat(k_descale[s], g).astype(q.dtype)[None, :, None]  # [H] per head
            # the products hold no bfloat16 values: not the kernel's bfloat16 pairs (q_bf16)
            changes["q"], changes["q_bf16"] = q, False
    if v_descale is not None:
        uniform = (v_descale == v_descale.flat[0]).all()
        changes["v_descale"] = float(v_descale.flat[0]) if uniform else np.repeat(v_descale, g, axis=1)  # [B, H]
    return replace(p, **changes) if changes else p


def as_index_array(x, name, shape_doc, ndim=1):
    """``x`` as an int64 ndarray of ``ndim`` dims, or a TypeError/ValueError naming ``name``."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of ints; np.asarray({name}) failed: {exc}") from None
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of ints (int32 or int64); got {describe_array(a)}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}; got {describe_array(a)}")
    return a.astype(np.int64)


def check_block_table(block_table, n_seq, n_pages, page_size, lengths):
    """The block table as a C-contiguous int32 array, every entry a sequence reads checked.

    Parameters
    ----------
    block_table : array_like of int, shape [n_seq, max_pages]
    n_seq : int
    n_pages, page_size : int
        The pool's pages and keys per page.
    lengths : ndarray of int64 [n_seq]
        Keys each sequence holds: entries ``[s, : ceil(lengths[s] / page_size)]``
        must be pages of the pool (the rest of a row is never read).
    """
    try:
        bt = np.asarray(block_table)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"block_table must be an array of ints; np.asarray(block_table) failed: {exc}") from None
    if bt.dtype.kind not in "iu":
        raise TypeError(f"block_table must be an array of page indices (int32); got {describe_array(bt)}")
    if bt.ndim != 2 or bt.shape[0] != n_seq:
        raise ValueError(f"block_table must have shape [batch, max_blocks_per_seq] with batch = {n_seq}; "
                         f"got {describe_array(bt)}")
    capacity = bt.shape[1] * page_size
    over = np.flatnonzero(lengths > capacity)
    if over.size:
        s = int(over[0])
        raise ValueError(f"sequence {s} holds {int(lengths[s])} keys but its block_table row has "
                         f"{bt.shape[1]} pages of {page_size} keys ({capacity} keys)")
    used = np.arange(bt.shape[1])[None, :] < -(-lengths // page_size)[:, None]  # [n_seq, max_pages]
    entries = bt[used].astype(np.int64)
    bad = np.flatnonzero((entries < 0) | (entries >= n_pages))
    if bad.size:
        s, j = (int(i[bad[0]]) for i in np.nonzero(used))
        raise ValueError(f"block_table[{s}, {j}] = {int(bt[s, j])} is not a page of the cache "
                         f"(0 <= page < {n_pages}); sequence {s} reads it for its keys "
                         f"{j * page_size}..{min((j + 1) * page_size, int(lengths[s])) - 1}")
    return np.ascontiguousarray(bt, np.int32)


# ------------------------------------------------------------------ the reference
def gather_keys(p, a, s):
    """Sequence s's keys (or values) of cache ``a`` as one [k_len, H_kv, F] array (a copy when paged;
    q8_0 rows dequantized)."""
    n = int(p.k_len[s])
    x = a.data if _quantized.is_q8(a) else a
    if p.block_table is None:
        b, t = int(p.k_batch[s]), int(p.k_start[s])
        rows = x[b, t:t + n]
    else:
        pages = p.block_table[s, : -(-n // p.k.shape[1])]
        rows = x[pages].reshape((-1,) + x.shape[2:])[:n]  # [n_pages, page, H_kv, F] -> [n, H_kv, F]
    return _quantized.Q8Tensor(rows, a.dim).dequantize() if _quantized.is_q8(a) else rows


def _forward_reference(p):
    """The same result by gathering each sequence's keys and running NumPy attention per sequence."""
    Bq, Tq, H = p.q.shape[:3]
    cdtype = p.cdtype
    q = _dtypes.cast(p.q, cdtype)
    out = np.zeros((Bq, Tq, H, p.v.shape[3]), cdtype)
    lse = np.full((Bq, H, Tq), -np.inf, cdtype)
    for s in range(p.n_seq):
        b, t, n = int(p.q_batch[s]), int(p.q_start[s]), int(p.q_len[s])
        k = _dtypes.cast(gather_keys(p, p.k, s), cdtype)
        v = _dtypes.cast(gather_keys(p, p.v, s), cdtype)
        cu_q, cu_k = np.array([0, n]), np.array([0, k.shape[0]])
        alibi = None if p.alibi_slopes is None else np.broadcast_to(p.alibi_slopes, (p.n_seq, H))[s]
        o, l = varlen_attention(q[b, t:t + n], k, v, cu_q, cu_k, is_causal="lower_right" if p.causal else False,
                                scale=p.scale, window=p.window, softcap=p.softcap, alibi_slopes=alibi,
                                sinks=p.sinks, backend="numpy", return_lse=True)
        out[b, t:t + n], lse[b, :, t:t + n] = o, l
    return out, lse


def forward(p, backend="auto", with_lse=True, narrow=False):
    """``(out [Bq, Tq, H, Ev], lse [Bq, H, Tq])`` of validated problem ``p``, out in the compute dtype
    (lse None when not ``with_lse``: the kernel then skips it); with ``narrow``, the fused kernel may
    give it in ``p.out_dtype`` already (bfloat16: :func:`attn._backends.fused.cache_forward`).

    ``backend``: "auto" (the fused kernel when built), "cython" or "numpy" (gather, then the reference).
    Rows that see no key give output 0 and lse -inf (with sinks: the sink's logit).
    """
    out, lse = _forward(p, backend, with_lse, narrow)
    if p.v_descale is not None:
        _scale_out(p, out)
    return out, (lse if with_lse else None)


def _scale_out(p, out):
    """out [Bq, Tq, H, Ev] times a float8 cache's V descale, in place (each sequence's rows by its own)."""
    if isinstance(p.v_descale, float):
        out *= out.dtype.type(p.v_descale)
        return
    for s in range(p.n_seq):
        b, t, n = int(p.q_batch[s]), int(p.q_start[s]), int(p.q_len[s])
        out[b, t:t + n] *= p.v_descale[s].astype(out.dtype)[None, :, None]


def _forward(p, backend, with_lse, narrow=False):
    impl = _backends.select_cache(backend)  # None: gathered, then the reference
    Bq, Tq, H = p.q.shape[:3]
    if p.q.size == 0 or p.n_seq == 0 or not p.k_len.any():  # no row sees any key
        out = np.zeros((Bq, Tq, H, p.v.shape[3]), p.cdtype)
        lse = np.full((Bq, H, Tq), -np.inf, p.cdtype)
        if p.sinks is not None and p.n_seq:
            rows = np.zeros((Bq, Tq), bool)
            for s in range(p.n_seq):
                rows[p.q_batch[s], p.q_start[s]:p.q_start[s] + p.q_len[s]] = True
            sink = np.asarray(p.sinks, p.cdtype)[None, :, None]  # [1, H, 1]
            lse = np.where(rows[:, None, :], sink, lse)
        return out, lse
    if impl is None:
        return _forward_reference(p)
    return impl.cache_forward(p, with_lse, narrow)
