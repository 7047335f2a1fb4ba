"""The fused kernel (attn._kernels): describe each operand to the kernel and run it.

The kernel reads every operand in place: a base pointer, one element offset
per matrix of the (broadcast) batch and element strides (:mod:`attn._operands`).
It never builds the L x S scores unless the weights are asked for.
"""

import math

import numpy as np

from .. import _build, _dtypes, _operands, _memory, _quantized, _variants
from .._build import _fast_path, _kernels, _kernels_backward, _problem
from .._arrays import astype_no_broadcast_copy
from . import matrix

# the fast path's entry (validates before it runs anything; bound once, so a
# test stubbing the kernels out still sees bad arguments rejected in Python)
_fast = None if _fast_path is None else _fast_path.sdpa_fast
_flash_fast = None if _fast_path is None else _fast_path.flash_dense_fast


def bind_fast_path(decide):
    """Hand the fast path the validation's decisions (attn._validation.decide_shapes_and_options)
    and the int8 cache's type: attn._api, which imports both layers, wires them at its import, so
    neither this backend nor the compiled kernel imports the validation above them."""
    if _fast_path is not None:
        _fast_path.bind_validation(decide, _quantized.Q8Tensor)
_NO_OFFSETS = np.zeros(0, np.int64)  # no mask: the kernel never reads its offsets


def fast_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                 return_weights, num_threads):
    """The output of the common call, recognized and run in compiled code; or None.

    The common case is what decoding and most layers call: ndarrays of float32
    or float64 (or a 16-bit cache) without dropout or weights, no mask or a
    padding mask broadcast over the query rows ([..., 1, S]), the same batch
    dims (GQA aside). Its decisions are the validation's own
    (:func:`attn._validation.decide_shapes_and_options`, raising the same
    errors) and its operand offsets are computed by the same compiled routine
    as every other call's (:func:`attn._operands.describe`). For anything else
    this returns None and the caller runs the full validation.
    """
    if _fast is None:
        return None
    return _fast(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_weights,
        num_threads, _memory.CHECK_MEMORY_ABOVE,
    )


def flash_dense_fast(q, k, v, causal, scale, num_threads):
    """attn.flash.flash_attn_func's common call (see attn._fast_path.flash_dense_fast), run in compiled
    code with the problem :func:`cache_forward` would build for it; or None. ``causal`` a bool,
    ``scale`` and ``num_threads`` decided by the caller."""
    if _flash_fast is None or not _build.HAVE_CYTHON:
        return None
    return _flash_fast(q, k, v, causal, scale, num_threads, _memory.CHECK_MEMORY_ABOVE)


#: The kernel joins the sinks to each row's sum itself (attn_kernel.h): forward,
#: forward_and_lse and forward_lse return out, weights and lse with them.
APPLIES_SINKS = True

#: Reads int8 (q8_0) key/value rows in place; else they are dequantized first (attn._backends.read_by).
READS_Q8 = True

#: forward_and_lse(p) gives out and lse in one pass (attn._gradients.forward).
FORWARD_WRITES_LSE = True

#: Runs a packed variable-length batch (attn._varlen) in one kernel call: varlen_forward(p),
#: varlen_backward(p, out, lse, dout).
RUNS_VARLEN = True

#: Runs attention over a key/value cache (attn._paged), contiguous or in pages, reading it in
#: place (one kernel call per plan): cache_forward(p, with_lse).
RUNS_CACHE = True


def unavailable(gradients=False):
    """None when the compiled kernel is importable (with ``gradients``: its backward too), else
    ``(extension, import error)`` of the one that is not; read at each call."""
    if not _build.HAVE_CYTHON:
        return "attn._kernels", _build.CYTHON_IMPORT_ERROR
    if gradients and not _build.HAVE_BACKWARD:
        return "attn._kernels_backward", _build.BACKWARD_IMPORT_ERROR
    return None


def cannot_run(p):
    """What the kernel does not do: dropout."""
    return "apply dropout (dropout_p > 0)" if p.dropout_p > 0 else None


NO_MASK = (None, _NO_OFFSETS, (0, 0))  # the (array, offsets, strides) of no mask


def run_forward(q, k, v, out, *, mask=NO_MASK, weights=None, lse=None, causal_offset=None, scale, num_threads,
                variants=None, varlen=None, out_rs=0, dims=None, q_bf16=False, paged=None, kv_len=None):
    """The one call of the forward kernel (attn._kernels.attention) every forward entry point makes.

    ``q``, ``k``, ``v``, ``mask``: ``(array, int64 offsets [N], (row, col) element strides)``, as
    :func:`attn._operands.describe` gives them; ``causal_offset``: None (not causal) or key j visible
    to row i iff j <= i + causal_offset; ``variants``: the call's :class:`attn._variants.Variants`
    (or None), its per-head arrays over the N matrices, sinks joined by the kernel; the rest as
    attn._kernels.attention's (a packed ``varlen`` table, a ``paged`` K/V, per-matrix ``kv_len``).
    The compiled builder (attn._problem.build) makes every decision from here on.
    """
    (qa, q_off, q_st), (ka, k_off, k_st), (va, v_off, v_st), (ma, m_off, m_st) = q, k, v, mask
    _kernels.attention(
        qa, ka, va, ma, out, weights, q_off, k_off, v_off, m_off, q_st, k_st, v_st, m_st,
        causal_offset, scale, num_threads, lse=lse, variants=variants, varlen=varlen, out_rs=out_rs,
        dims=dims, q_bf16=q_bf16, paged=paged, kv_len=kv_len,
    )


def run_forward_overlapped(first, second, num_threads):
    """Two :func:`run_forward` calls whose outputs do not overlap, in one parallel region of the kernel
    (attn._kernels.attention_overlapped): ``first`` reading K/V from memory (a mixed batch's decode
    rows), ``second`` computing (its prefill chunks), so that one's reads overlap the other's
    products. Each is ``(q, k, v, out, kwargs)``, run_forward's arguments (a ``num_threads`` in kwargs
    is ignored: the one given here serves both). Bit for bit the outputs of the two calls."""
    _kernels.attention_overlapped(_attention_args(*first), _attention_args(*second), num_threads)


_FORWARD_DEFAULTS = dict(mask=NO_MASK, weights=None, lse=None, causal_offset=None, variants=None, varlen=None,
                         out_rs=0, dims=None, q_bf16=False, paged=None, kv_len=None)


def _attention_args(q, k, v, out, kwargs):
    """attn._kernels.attention's arguments from q to kv_len (all but num_threads) of a run_forward call."""
    unknown = set(kwargs) - set(_FORWARD_DEFAULTS) - {"scale", "num_threads"}
    if unknown or "scale" not in kwargs:
        raise TypeError(f"run_forward's keyword arguments take scale and any of {sorted(_FORWARD_DEFAULTS)}; "
                        f"got {sorted(kwargs)}")
    kw = dict(_FORWARD_DEFAULTS, **kwargs)
    (qa, q_off, q_st), (ka, k_off, k_st), (va, v_off, v_st), (ma, m_off, m_st) = q, k, v, kw["mask"]
    return (qa, ka, va, ma, out, kw["weights"], q_off, k_off, v_off, m_off, q_st, k_st, v_st, m_st,
            kw["causal_offset"], kw["scale"], kw["lse"], kw["variants"], kw["varlen"], kw["out_rs"], kw["dims"],
            kw["q_bf16"], kw["paged"], kw["kv_len"])


def run_backward(q, k, v, out, dout, lse, dq, dk, dv, *, mask=NO_MASK, ds=None, causal_offset=None, scale,
                 num_threads, variants=None, varlen=None, n_k=0, bf16=False):
    """The one call of the backward kernel (attn._kernels_backward.backward), operands as
    :func:`run_forward`'s; ``lse`` includes the sinks, so the kernel takes none."""
    (qa, q_off, q_st), (ka, k_off, k_st), (va, v_off, v_st), (ma, m_off, m_st) = q, k, v, mask
    _kernels_backward.backward(
        qa, ka, va, ma, out, dout, lse, dq, dk, dv, ds, q_off, k_off, v_off, m_off, q_st, k_st, v_st, m_st,
        causal_offset, scale, num_threads, variants=variants, varlen=varlen, n_k=n_k, bf16=bf16,
    )


def check_memory(p):
    """The output, and the L x S weights only when they are returned."""
    _memory.check_output_and_weights(p)


def _attention(p, with_lse, narrow=False):
    """``(out [*batch, L, Ev], weights [*batch, L, S] or None, lse [*batch, L] or None)``:
    one pass of the forward kernel (weights when ``p.return_weights``). With
    ``narrow``, a 16-bit call (bfloat16, float16) without weights gets its out in
    its dtype from the kernel, each row rounded once as it is written; otherwise
    out is in the compute dtype."""
    batch, n_batch = p.batch, math.prod(p.batch)
    q = _operands.describe(p.q, batch)  # q first: the canary tests shift it
    k = _operands.describe(kv_operand(p.k), batch, group=p.group)
    v = _operands.describe(kv_operand(p.v), batch, group=p.group)
    narrow = narrow and not p.return_weights and _dtypes.is_16bit(p.out_dtype)  # (computed in float32)
    out = _problem.empty_out((n_batch, p.n_q, p.d_v), p.out_dtype if narrow else p.q.dtype)  # [N, L, Ev]
    w = np.empty((n_batch, p.n_q, p.n_k), dtype=p.q.dtype) if p.return_weights else None  # [N, L, S]
    lse = np.empty((n_batch, p.n_q), dtype=p.q.dtype) if with_lse else None  # [N, L]
    run_forward(q, k, v, out, mask=_mask_operand(p), weights=w, lse=lse, causal_offset=p.causal_offset,
                scale=p.scale, num_threads=p.num_threads, variants=p.variants,
                q_bf16=_dtypes.is_bfloat16(p.out_dtype))
    return (out.reshape(batch + (p.n_q, p.d_v)),  # [N, L, Ev] -> [*batch, L, Ev]
            None if w is None else w.reshape(batch + (p.n_q, p.n_k)),
            None if lse is None else lse.reshape(batch + (p.n_q,)))


def kv_operand(a):
    """K or V as the kernel reads it: q8_0 rows (an attn.Q8Tensor) as int8 elements
    [..., S, row bytes], whose kind (int8) tells the kernel; any other array as it is."""
    return a.data.view(np.int8) if _quantized.is_q8(a) else a


def forward(p):
    """``(out, weights or None)`` of validated problem ``p``, sinks included: out in
    ``p.out_dtype`` when that is 16-bit and there are no weights, else in the
    compute dtype."""
    out, w, _ = _attention(p, with_lse=False, narrow=True)
    return out, w


def masked_softmax_forward(p):
    """Masked softmax of validated problem ``p`` along its last axis, one kernel row per slice."""
    x, mask = p.x, p.mask
    lead, n = x.shape[:-1], x.shape[-1]
    x, x_off, (x_stride,) = _operands.describe(x, lead, n_inner=1)
    out = np.empty((math.prod(lead), n), dtype=x.dtype)  # [rows, n]
    m_off, m_stride = x_off, 0
    if mask is not None:
        mask, m_off, (m_stride,) = _operands.describe(mask, lead, n_inner=1)
    _kernels.masked_softmax(x, mask, out, x_off, m_off, x_stride, m_stride, p.num_threads)
    return out.reshape(x.shape)  # [rows, n] -> [..., n]


# ------------------------------------------------------------------ backward
# attn._kernels_backward (attn/_src/attn_backward_impl.h): FlashAttention-2's
# backward, P recomputed from the saved lse one 64 x 64 tile at a time; the
# packed operands it allocates are O((L + S) E) per matrix.

def forward_and_lse(p):
    """``(out [*batch, L, Ev], lse [*batch, L])`` in one kernel pass (the forward writes lse),
    sinks included."""
    out, _, lse = _attention(p, with_lse=True)
    return out, lse


def _mask_operand(p):
    """(mask, offsets, strides) of ``p``'s mask as the kernel reads it (its kind is its dtype)."""
    if p.mask is None:
        return NO_MASK
    mask = np.broadcast_to(p.mask, p.batch + (p.n_q, p.n_k))  # a view, stride 0
    return _operands.describe(mask, p.batch)


def _compute(a, p):
    """``a`` in the compute dtype (q's): the backward kernel reads one dtype (a float16 cache is widened)."""
    return astype_no_broadcast_copy(a, p.q.dtype)


def forward_lse(p):
    """lse [*batch, L] of validated problem ``p``: the forward kernel's (:func:`forward_and_lse`),
    the one place the fused backend computes it."""
    return forward_and_lse(p)[1]


def backward(p, out, lse, keep, dout, want_ds):
    """``(dq, dk, dv, ds or None)`` over the batch, per query head (``keep`` is None: no dropout).

    A float mask's gradient through a softcap comes from the matrix form
    (the kernel's dS tile is then dS o (1 - tanh^2), not dS).
    """
    if want_ds and p.variants is not None and p.variants.softcap:
        return matrix.backward(p, out, lse, keep, dout, want_ds)
    batch, n_batch = p.batch, math.prod(p.batch)
    q = _operands.describe(p.q, batch)
    k = _operands.describe(_compute(p.k, p), batch, group=p.group)
    v = _operands.describe(_compute(p.v, p), batch, group=p.group)
    out = np.ascontiguousarray(out).reshape(n_batch, p.n_q, p.d_v)  # [*batch, L, Ev] -> [N, L, Ev]
    dout = np.ascontiguousarray(dout).reshape(n_batch, p.n_q, p.d_v)
    lse = np.ascontiguousarray(lse).reshape(n_batch, p.n_q)  # [N, L]
    dt = p.q.dtype
    dq = np.empty((n_batch, p.n_q, p.d_k), dt)
    dk = np.empty((n_batch, p.n_k, p.d_k), dt)
    dv = np.empty((n_batch, p.n_k, p.d_v), dt)
    ds = np.empty((n_batch, p.n_q, p.n_k), dt) if want_ds else None
    run_backward(q, k, v, out, dout, lse, dq, dk, dv, mask=_mask_operand(p), ds=ds, causal_offset=p.causal_offset,
                 scale=p.scale, num_threads=p.num_threads, variants=p.variants,
                 bf16=_dtypes.is_bfloat16(p.out_dtype))
    shape = lambda a: batch + a.shape[1:]  # [N, ., .] -> [*batch, ., .]
    return (dq.reshape(shape(dq)), dk.reshape(shape(dk)), dv.reshape(shape(dv)),
            None if ds is None else ds.reshape(shape(ds)))


# ------------------------------------------------------------------ packed variable-length batches
# attn._varlen's VarlenProblem in one call: each (sequence, head) is one matrix, described by its
# offsets into the packed arrays, its own lengths in the kernel's varlen table (no padding computed).

def _packed_operands(p):
    """q, k, v as the kernel reads them, ``(array, offsets [N], (row, col) strides)`` per matrix
    b = s * H + h, and the kernel's varlen table [5, N]."""
    B, H, g = p.n_seq, p.heads, p.group
    seq, head = np.repeat(np.arange(B), H), np.tile(np.arange(H), B)  # matrix b -> (s, h)
    described = []
    for a, cu, h in ((p.q, p.cu_q, head), (p.k, p.cu_k, head // g), (p.v, p.cu_k, head // g)):
        a = _operands.expressible(a)
        st = _operands.element_strides(a)
        described.append((a, np.ascontiguousarray(cu[seq] * st[0] + h * st[1]), (st[0], st[2])))
    n_q, n_k = np.diff(p.cu_q)[seq], np.diff(p.cu_k)[seq]
    shift = np.zeros_like(n_q) if p.alignment == "upper_left" else n_k - n_q
    ev = p.v.shape[2]
    out_off = (p.cu_q[seq] * H + head) * ev  # out [total_q, H, Ev]
    lse_off = head * p.q.shape[0] + p.cu_q[seq]  # lse [H, total_q]
    table = np.ascontiguousarray(np.stack([n_q, n_k, shift, out_off, lse_off]), np.int64)
    return (*described, table)


def varlen_forward(p, narrow=False):
    """``(out [total_q, H, Ev], lse [H, total_q])`` of packed batch ``p``, sinks included: out in the
    compute dtype, or with ``narrow`` in ``p.out_dtype`` where that is 16-bit (each row rounded once
    as the kernel writes it, as :func:`forward`'s).

    A batch with decode rows runs as the cache problem it is (:func:`_varlen_as_cache`, K and V read in
    place as one contiguous cache row): its decode plan reads each key once for the query heads of a
    key/value head and splits long contexts into key chunks, where the varlen plan's one matrix per
    (sequence, query head), each reading its keys on its own, took 3.8x the time (vLLM's decode batch:
    16 sequences of 1k-4k keys, H32/8 E128 bfloat16). Any other batch is one kernel call of the varlen
    plan.
    """
    cache = _varlen_as_cache(p)
    if cache is not None:
        cp, uniform = cache
        out, lse = cache_forward(cp, with_lse=True, narrow=narrow)  # [Bq, Tq, H, Ev], [Bq, H, Tq]
        if uniform:
            out = out.reshape(p.q.shape[0], p.heads, -1)  # [B, L, H, Ev] -> [total_q, H, Ev] (a view)
            return out, np.ascontiguousarray(lse.transpose(1, 0, 2)).reshape(p.heads, -1)  # [B, H, L] -> [H, total_q]
        return out[0], lse[0]  # [1, total_q, H, Ev], [1, H, total_q]
    q, k, v, table = _packed_operands(p)
    H, ev = p.heads, p.v.shape[2]
    narrow = narrow and _dtypes.is_16bit(p.out_dtype)
    out = _problem.empty_out(p.q.shape[:2] + (ev,), p.out_dtype if narrow else p.q.dtype)
    lse = np.empty((H, p.q.shape[0]), p.q.dtype)
    run_forward(q, k, v, out, lse=lse, causal_offset=0 if p.alignment is not None else None, scale=p.scale,
                num_threads=p.num_threads, variants=p.variants, varlen=table,
                out_rs=H * ev, dims=(p.n_seq * H, p.max_q, p.max_k, p.q.shape[2], ev),
                q_bf16=_dtypes.is_bfloat16(p.out_dtype))
    return out, lse


def _varlen_as_cache(p):
    """``(cache problem, uniform)`` of packed batch ``p`` where it has decode rows, else None.

    Decode rows: every sequence has the same L <= ``DECODE_MAX_Q`` query rows (then ``uniform``: q as
    [B, L, H, E], the decode plan's uniform batch), or some sequences have a single row (q as [1,
    total_q, H, E]: those rows by the decode plan, the others by the varlen plan, as a vLLM step's).
    The cache plans align each sequence's rows with its last key, causal or not, as ``p`` does unless
    it asks for upper-left alignment (then None). K and V: [1, total_k, H_kv, E], sequence s's keys
    from token ``cu_k[s]``.
    """
    from .. import _paged   # (attn._paged imports the backends)

    if p.alignment == "upper_left" or p.k.shape[0] == 0:
        return None
    B, q_len = p.n_seq, np.diff(p.cu_q)
    uniform = B > 0 and p.max_q <= _paged.DECODE_MAX_Q and bool(np.all(q_len == p.max_q))
    if not uniform and not np.any(q_len == 1):
        return None
    if uniform:   # [total_q, H, E] -> [B, L, H, E] (a view)
        q, q_batch, q_start = p.q.reshape(B, p.max_q, *p.q.shape[1:]), np.arange(B), np.zeros(B, np.int64)
    else:         # [total_q, H, E] -> [1, total_q, H, E]
        q, q_batch, q_start = p.q[None], np.zeros(B, np.int64), p.cu_q[:-1]
    var = p.variants
    cp = _paged.CacheProblem(
        q=q, q_batch=q_batch, q_start=q_start, q_len=q_len,
        k=p.k[None], v=p.v[None], k_batch=np.zeros(B, np.int64), k_start=p.cu_k[:-1], k_len=np.diff(p.cu_k),
        block_table=None, causal=p.alignment is not None, scale=p.scale,
        window=None if var is None else var.window, softcap=None if var is None else var.softcap,
        alibi_slopes=None if var is None else var.alibi,                 # [B, H]
        sinks=None if var is None or var.sinks is None else var.sinks[0],  # [B, H] broadcast from [H]
        out_dtype=p.out_dtype, q_bf16=_dtypes.is_bfloat16(p.out_dtype), num_threads=p.num_threads)
    return cp, uniform


def _padded(p, a, cu, n_max):
    """Packed [total, H, F] -> per matrix [B * H, n_max, F] (rows past a sequence: 0); and the valid mask."""
    B = p.n_seq
    rows = cu[:-1, None] + np.arange(n_max)[None, :]  # [B, n_max] token of row i of sequence s
    valid = np.arange(n_max)[None, :] < np.diff(cu)[:, None]
    g = np.where(valid, rows, 0)
    x = np.where(valid[..., None, None], a[g], 0)  # [B, n_max, H, F]
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B * a.shape[1], n_max, a.shape[2]), valid


def _packed(p, x, cu, group=1):
    """Per matrix [B * H, n_max, F] -> packed [total, H // group, F], each ``group`` consecutive
    heads summed (GQA's query heads of one key/value head).

    Reads only each sequence's own rows (``cu``'s lengths): the kernel writes no others, so the
    rows past a sequence are never read (they may be uninitialised). Sequence by sequence, each
    a slice: no padded row is summed and no boolean gather runs (both cost more).
    """
    B, H, n_max, f = p.n_seq, p.heads, x.shape[1], x.shape[2]
    x = x.reshape(B, H // group, group, n_max, f)
    packed = np.empty((cu[-1], H // group, f), x.dtype)  # every row written below: cu partitions it
    for s in range(B):
        rows = x[s, :, :, :cu[s + 1] - cu[s]]  # [H // group, group, n_s, F]
        packed[cu[s]:cu[s + 1]] = (rows[:, 0] if group == 1 else rows.sum(axis=1)).transpose(1, 0, 2)
    return packed


def varlen_backward(p, out, lse, dout):
    """``(dq, dk, dv)`` of packed batch ``p`` in its packed shapes, in one kernel call (``lse`` with the sinks)."""
    p = p.widened_kv()   # (the backward kernel reads one dtype)
    q, k, v, table = _packed_operands(p)
    H, g, N = p.heads, p.group, p.n_seq * p.heads
    out_p, valid_q = _padded(p, out, p.cu_q, p.max_q)
    dout_p, _ = _padded(p, dout, p.cu_q, p.max_q)
    lse_p = np.full((p.n_seq, H, p.max_q), -np.inf, p.q.dtype)
    lse_p.transpose(0, 2, 1)[valid_q] = lse.T  # [total_q, H] rows of the valid positions
    lse_p = lse_p.reshape(N, p.max_q)
    dq = np.empty((N, p.max_q, p.q.shape[2]), p.q.dtype)
    dk = np.empty((N, p.max_k, p.q.shape[2]), p.q.dtype)
    dv = np.empty((N, p.max_k, p.v.shape[2]), p.q.dtype)
    run_backward(q, k, v, out_p, dout_p, lse_p, dq, dk, dv, causal_offset=0 if p.alignment is not None else None,
                 scale=p.scale, num_threads=p.num_threads, variants=p.variants,
                 varlen=table, n_k=p.max_k, bf16=_dtypes.is_bfloat16(p.out_dtype))
    return _packed(p, dq, p.cu_q), _packed(p, dk, p.cu_k, g), _packed(p, dv, p.cu_k, g)


# ------------------------------------------------------------------ key/value caches
# attn._paged's CacheProblem in one call, K/V read in place (contiguous or in pages): the decode
# plan with per-matrix key lengths, or the packed varlen table.

def _cache_variants(p, seqs, n_q, n_k):
    """The :class:`attn._variants.Variants` of sequences ``seqs``' matrices for base sizes n_q, n_k
    (offsets n_k - n_q: FlashAttention aligns every sequence's rows with its last key, causal or
    not), or None."""
    slopes = p.alibi_slopes
    if slopes is not None and np.ndim(slopes) == 2:  # [B, H]: the rows of these sequences
        slopes = np.asarray(slopes)[seqs]
    return _variants.validate(p.window, p.softcap, slopes, p.sinks, batch=(len(seqs), p.heads), n_q=n_q, n_k=n_k,
                              causal_offset=None, cdtype=p.cdtype)


def _matrices(p, seqs):
    """Sequence and head of each kernel matrix of sequences ``seqs`` (matrix i = seqs[i // H], head i % H),
    and the query operand (array, offsets, (row, col) strides) of those matrices."""
    H = p.heads
    seq, head = np.repeat(seqs, H), np.tile(np.arange(H), len(seqs))
    q = _operands.expressible(p.q)
    qs = _operands.element_strides(q)
    q_off = np.ascontiguousarray(p.q_batch[seq] * qs[0] + p.q_start[seq] * qs[1] + head * qs[2], np.int64)
    return seq, head, (q, q_off, (qs[1], qs[3]))


def _cache_kv_operands(p, seq, head):
    """(array, offsets [N], (row, col) strides) of K and V, and the kernel's ``paged`` tuple or None."""
    kv_head = head // p.group
    described = []
    for a in (p.k, p.v):
        a = _operands.expressible(kv_operand(a))  # (q8_0 rows: int8 bytes [.., .., H_kv, row bytes])
        st = _operands.element_strides(a)
        off = kv_head * st[2]
        if p.block_table is None:
            off = off + p.k_batch[seq] * st[0] + p.k_start[seq] * st[1]
        described.append((a, np.ascontiguousarray(off, np.int64), (st[1], st[3]), st[0]))
    (k, k_off, k_st, k_page), (v, v_off, v_st, v_page) = described
    paged = None
    if p.block_table is not None:
        page_rows = np.ascontiguousarray(seq * p.block_table.shape[1], np.int64)
        paged = (p.block_table.reshape(-1), page_rows, p.k.shape[1], k_page, v_page)
    return (k, k_off, k_st), (v, v_off, v_st), paged


# One problem layout's derived arrays, for problems that share a plan_token (every layer of a vLLM step):
# (key, the plan token (kept alive, so that its id is not reused), {part: value}). One tuple, read and
# replaced whole: a thread sees one layout's entries or another's, never a mix.
_plan_memo = (None, None, {})


def _planned(p, part, build):
    """``build()``, computed once per plan token and operand layout when ``p`` has a plan token."""
    global _plan_memo
    if p.plan_token is None:
        return build()
    key = (id(p.plan_token), p.q.shape, p.q.strides, p.q.dtype.str, p.k.shape, p.k.strides, p.v.shape, p.v.strides,
           _quantized.is_q8(p.k))
    memo = _plan_memo
    if memo[0] != key:
        memo = (key, p.plan_token, {})
        _plan_memo = memo
    parts = memo[2]
    if part not in parts:
        parts[part] = build()
    return parts[part]


def cache_forward(p, with_lse=True, narrow=False):
    """``(out [Bq, Tq, H, Ev], lse [Bq, H, Tq])`` of cache problem ``p``, K/V read in place, sinks included
    (lse None when not ``with_lse``). out in the compute dtype; with ``narrow``, in ``p.out_dtype`` where
    that is 16-bit and every row is a packed varlen call's (no single decode row, no float8 value scale
    to apply afterwards): each row rounded once as the kernel writes it, as :func:`forward`'s.

    Every sequence's rows in one kernel call of the decode plan when all have the same few rows
    (``p.uniform_decode``); otherwise the single decode rows in one such call (the query heads of
    a key/value head reading each key together, long contexts split into key chunks) and the
    longer sequences (prefill chunks) in one call of the packed varlen plan, both writing into
    the caller's layout, the two run overlapped (:func:`run_forward_overlapped`). Where the single
    rows are one run of tokens in sequence order (:func:`_single_run`: vLLM's decode rows first,
    or after the chunks), the decode call writes them in place too, so a 16-bit out is narrowed
    as the kernel writes it there as well.
    """
    if _planned(p, "uniform", lambda: p.uniform_decode):
        return _decode_rows(p, _planned(p, "all", lambda: np.arange(p.n_seq)), p.q.shape[1], with_lse)
    Bq, Tq, H, Ev = p.q.shape[:3] + (p.v.shape[3],)
    single, longer = _planned(p, "split", lambda: (np.flatnonzero(p.q_len == 1), np.flatnonzero(p.q_len > 1)))
    run = _planned(p, "single run", lambda: _single_run(p, single))
    narrow = (narrow and (not single.size or run is not None) and p.v_descale is None
              and _dtypes.is_16bit(p.out_dtype))
    out = _problem.empty_out((Bq, Tq, H, Ev), p.out_dtype if narrow else p.cdtype)   # [Bq, Tq, H, Ev]
    lse = np.full((Bq, H, Tq), -np.inf, p.cdtype) if with_lse else None
    if p.q_len.sum() < Bq * Tq:  # tokens no sequence owns: defined zeros
        out[...] = 0
    if single.size:   # (with longer chunks: run together, the decode's reads overlapping their products)
        chunks = _varlen_call(p, longer) + (out, lse) if longer.size else None
        rows, at = p.q_batch[single], p.q_start[single]
        if run is not None:   # out's tokens [t0, t0 + n) of batch row b, as [n H, 1, Ev] (a view)
            b, t0 = run
            o = out[b].reshape(Tq * H, Ev)[t0 * H:(t0 + single.size) * H].reshape(single.size * H, 1, Ev)
            _, l = _decode_rows(p, single, 1, with_lse, chunks, out=o)
        else:
            o, l = _decode_rows(p, single, 1, with_lse, chunks)  # [n, 1, H, Ev], [n, H, 1]
            out[rows, at] = o[:, 0]
        if with_lse:
            lse[rows, :, at] = l[:, :, 0]
    elif longer.size:
        _varlen_rows(p, longer, out, lse)
    return out, lse


def _single_run(p, single):
    """``(b, t0)`` where the single rows of sequences ``single`` (in their order) are tokens
    ``[t0, t0 + n)`` of batch row ``b`` of the query, else None."""
    if not single.size:
        return None
    b, t0 = int(p.q_batch[single[0]]), int(p.q_start[single[0]])
    if (p.q_batch[single] != b).any() or not np.array_equal(p.q_start[single], t0 + np.arange(single.size)):
        return None
    return b, t0


def cache_calls_into(p, out_dtype):
    """The kernel calls of ``cache_forward(p, with_lse=False)`` rearranged to write straight into an
    output ``[1, Tq, H, Ev]`` (C-contiguous, ``out_dtype``: the compute dtype, or bfloat16 or float16 from a
    float32 compute, each row rounded once as the kernel writes it), for :func:`run_cache_calls`; or None when
    the layout needs :func:`cache_forward`'s copies.

    What vLLM's steps are: one packed query (``Bq`` = 1) whose every token a sequence owns, its single
    rows (decode) the first tokens in order, the longer chunks (prefill) after them. The single rows
    are then one decode call writing out's first rows ([n, H, Ev] is [n * H, 1, Ev]) and the chunks one
    packed varlen call writing their own rows, run overlapped (:func:`run_cache_calls`): cache_forward's
    own calls (:func:`_decode_call`, :func:`_varlen_call`, so the same bits) less its copies. No lse, no
    float8 value scale (it multiplies the output afterwards).

    Returns
    -------
    tuple of (n_rows, q_op, k_op, v_op, kwargs) or None
        One entry per kernel call: n_rows > 0 the call writes out's first n_rows tokens viewed as
        ``[n_rows * H, 1, Ev]``, 0 the whole out (packed varlen rows); the operands hold ``p``'s arrays,
        which :func:`run_cache_calls` replaces.
    """
    Bq, Tq, H = p.q.shape[:3]
    if Bq != 1 or p.v_descale is not None or p.n_seq == 0 or int(p.q_len.sum()) != Tq:
        return None
    if Tq > 1 and p.uniform_decode:  # (one sequence of a few rows: cache_forward's decode plan)
        return None
    single, longer = np.flatnonzero(p.q_len == 1), np.flatnonzero(p.q_len > 1)
    if not np.array_equal(p.q_start[single], np.arange(single.size)) or (p.q_start[longer] < single.size).any():
        return None
    calls = []
    if single.size:
        calls.append((single.size,) + _decode_call(p, single, 1))
    if longer.size:
        calls.append((0,) + _varlen_call(p, longer))
    return tuple(calls)


def run_cache_calls(calls, q, k, v, out):
    """Run :func:`cache_calls_into`'s calls with query ``q`` [1, Tq, H, E] (as
    :func:`attn._paged.kernel_query` gives it: the compute dtype, or 16-bit over a cache of its dtype), K/V
    ``k``, ``v`` and output ``out`` [1, Tq, H, Ev]: arrays of exactly the layout (shapes, strides,
    dtypes) of the problem the calls were derived from, aligned, ``out`` C-contiguous; the caller
    checks that."""
    H, Ev = out.shape[2], out.shape[3]
    k, v = kv_operand(k), kv_operand(v)
    runs = []
    for n_rows, q_op, k_op, v_op, kwargs in calls:
        o = out.reshape(-1, Ev)[: n_rows * H].reshape(n_rows * H, 1, Ev) if n_rows else out  # [n H, 1, Ev]
        runs.append(((q,) + q_op[1:], (k,) + k_op[1:], (v,) + v_op[1:], o, kwargs))
    if len(runs) == 2:  # decode rows and prefill chunks: overlapped
        run_forward_overlapped(*runs, num_threads=runs[0][4]["num_threads"])
    else:
        q_op, k_op, v_op, o, kwargs = runs[0]
        run_forward(q_op, k_op, v_op, o, **kwargs)


def _decode_rows(p, seqs, L, with_lse, chunks=None, out=None):
    """``(out [n, L, H, Ev], lse [n, H, L] or None)`` of sequences ``seqs``, each of L query rows, by
    the decode plan with per-matrix key lengths. ``chunks``: None, or a packed varlen call
    ``(q_op, k_op, v_op, kwargs, out, lse)`` (:func:`_varlen_call`'s, its output and lse) run
    overlapped with this one (:func:`run_forward_overlapped`). ``out``: None, or where the rows
    go, [n H, L, Ev] (the compute dtype or 16-bit; then returned as it is)."""
    n, H, Ev = len(seqs), p.heads, p.v.shape[3]
    q_op, k_op, v_op, kwargs = _decode_call(p, seqs, L)
    given = out is not None
    if not given:
        out = np.empty((n * H, L, Ev), p.cdtype)  # [n * H, L, Ev]
    lse = np.empty((n * H, L), p.cdtype) if with_lse else None
    if chunks is None:
        run_forward(q_op, k_op, v_op, out, lse=lse, **kwargs)
    else:
        cq, ck, cv, ckw, c_out, c_lse = chunks
        run_forward_overlapped((q_op, k_op, v_op, out, dict(kwargs, lse=lse)),
                               (cq, ck, cv, c_out, dict(ckw, lse=c_lse)), num_threads=p.num_threads)
    if given:
        return out, None if lse is None else lse.reshape(n, H, L)
    out = out.reshape(n, H, L, Ev).transpose(0, 2, 1, 3)  # [n, H, L, Ev] -> [n, L, H, Ev] (a view)
    return np.ascontiguousarray(out), None if lse is None else lse.reshape(n, H, L)


def _decode_call(p, seqs, L):
    """``(q_op, k_op, v_op, kwargs)`` of :func:`run_forward` for the decode call over sequences ``seqs``
    (L query rows each), writing [len(seqs) * H, L, Ev] (lse: [len(seqs) * H, L])."""
    n, H, E, Ev = len(seqs), p.heads, p.q.shape[3], p.v.shape[3]
    seq, head, q_op, k_op, v_op, paged, kv_len = _planned(p, ("decode", L, len(seqs)),
                                                          lambda: _decode_operands(p, seqs))
    q_op, k_op, v_op = _with_arrays(p, q_op, k_op, v_op)
    n_k = int(kv_len.max())
    return q_op, k_op, v_op, dict(
        causal_offset=n_k - L if p.causal else None, scale=p.scale, num_threads=p.num_threads,
        variants=_cache_variants(p, seqs, L, n_k), dims=(n * H, L, n_k, E, Ev), q_bf16=p.q_bf16, paged=paged,
        kv_len=kv_len)


def _decode_operands(p, seqs):
    """What a decode call over sequences ``seqs`` derives from the layout alone: matrices' sequence and head,
    the operands' offsets and strides (their arrays are the caller's: :func:`_with_arrays`), the paged
    tuple and each matrix's key count."""
    seq, head, q_op = _matrices(p, seqs)
    k_op, v_op, paged = _cache_kv_operands(p, seq, head)
    return seq, head, q_op, k_op, v_op, paged, np.ascontiguousarray(p.k_len[seq], np.int64)


def _varlen_operands(p, seqs):
    """What a packed varlen call over sequences ``seqs`` derives from the layout alone (as
    :func:`_decode_operands`), with its table of lengths, shifts and output offsets."""
    Tq, H, Ev = p.q.shape[1], p.heads, p.v.shape[3]
    seq, head, q_op = _matrices(p, seqs)
    k_op, v_op, paged = _cache_kv_operands(p, seq, head)
    q_len, k_len = p.q_len[seq], p.k_len[seq]
    out_off = ((p.q_batch[seq] * Tq + p.q_start[seq]) * H + head) * Ev
    lse_off = (p.q_batch[seq] * H + head) * Tq + p.q_start[seq]
    table = np.ascontiguousarray(np.stack([q_len, k_len, k_len - q_len, out_off, lse_off]), np.int64)
    return seq, q_op, k_op, v_op, paged, table


def _with_arrays(p, q_op, k_op, v_op):
    """Operands of a layout derived for another problem of the same plan, with ``p``'s own arrays (the
    same shapes and strides: the memo's key)."""
    if p.plan_token is None:
        return q_op, k_op, v_op
    q, k, v = (_operands.expressible(a) for a in (p.q, kv_operand(p.k), kv_operand(p.v)))
    return (q,) + q_op[1:], (k,) + k_op[1:], (v,) + v_op[1:]


def _varlen_rows(p, seqs, out, lse):
    """Sequences ``seqs``' rows by the packed varlen plan, written into ``out`` [Bq, Tq, H, Ev] and
    ``lse`` [Bq, H, Tq] (or None) in place."""
    q_op, k_op, v_op, kwargs = _varlen_call(p, seqs)
    run_forward(q_op, k_op, v_op, out, lse=lse, **kwargs)


def _varlen_call(p, seqs):
    """``(q_op, k_op, v_op, kwargs)`` of :func:`run_forward` for the packed varlen call over sequences
    ``seqs``, writing their rows of out [Bq, Tq, H, Ev] (lse: [Bq, H, Tq])."""
    H, E, Ev = p.heads, p.q.shape[3], p.v.shape[3]
    seq, q_op, k_op, v_op, paged, table = _planned(p, "varlen", lambda: _varlen_operands(p, seqs))
    q_op, k_op, v_op = _with_arrays(p, q_op, k_op, v_op)
    q_len, k_len = table[0], table[1]
    return q_op, k_op, v_op, dict(
        causal_offset=0 if p.causal else None, scale=p.scale, num_threads=p.num_threads,
        variants=_cache_variants(p, seqs, 0, 0), varlen=table, out_rs=H * Ev,
        dims=(len(seq), int(q_len.max()), int(k_len.max()), E, Ev), q_bf16=p.q_bf16, paged=paged)
