# The one problem builder: a validated attention call becomes the kernels'
# problem description (attn_problem, attn/_src/attn_kernel.h) here and nowhere
# else.
#
# Every entry point reaches the kernels through build(): the forward
# (attn._kernels.attention, which attn/_backends/fused.py's run_forward calls
# for dense, varlen and paged calls), the backward (attn._kernels_backward,
# which fills the forward part of its problem with it) and the compiled fast
# path (attn._fast_path.sdpa_fast, which only recognizes the common call and
# feeds it here). The decisions it makes, each in one place:
#   element_kind   the kernel's element kind, from the operands' dtypes
#   mask_kind      none, bool (True = takes part) or additive, from the mask's
#   build          the variants (one typed value, attn._variants.Variants),
#                  the causal offset, a packed varlen table, a paged K/V,
#                  per-matrix key lengths, bfloat16 in and out
# and fill_offsets computes every operand's per-matrix element offsets (for
# attn._operands.describe and for the fast path alike).
#
# The kernels downstream never look at a dtype again: they read a.kind and
# a.mask_kind.

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memset

cimport numpy as cnp
import sys

import numpy as np

from attn._attn_kernel cimport *  # the structs, kinds and debug checks shared with C

cnp.import_array()

CACHE_LINE = 64  # bytes


def empty_out(tuple shape, dtype):
    """``np.empty(shape, dtype)`` for a kernel's out. One of at least ATTN_STREAM_OUT_BYTES, whose
    rows finish writes by non-temporal stores where a row starts on a cache line and fills whole
    ones (attn/_src/attn_kernel.h), starts on a line (NumPy aligns to 16 bytes); a smaller one
    is np.empty's, at its cost (decode calls take a few microseconds)."""
    dtype = np.dtype(dtype)
    cdef int64_t nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes < ATTN_STREAM_OUT_BYTES:
        return np.empty(shape, dtype)
    buf = np.empty(nbytes + CACHE_LINE, np.uint8)
    first = -buf.ctypes.data % CACHE_LINE
    return buf[first:first + nbytes].view(dtype).reshape(shape)


cdef attn_operand operand(object arr, const int64_t* offsets, int64_t s_row, int64_t s_col):
    """The descriptor of ndarray ``arr`` (all zero for None): matrix b at
    ``offsets[b]`` elements, element strides s_row, s_col. Debug builds add
    the array's byte extent, which the kernels' reads are checked against."""
    cdef attn_operand x
    memset(&x, 0, sizeof(x))
    if arr is None:
        return x
    x.base = <const char*>cnp.PyArray_DATA(<cnp.ndarray>arr)
    x.offsets = offsets
    x.s_row = s_row
    x.s_col = s_col
    if ATTN_DEBUG_ENABLED:  # extents only matter to the debug build's checks
        lo, hi = np.lib.array_utils.byte_bounds(arr)
        x.lo = <const char*><size_t>lo
        x.hi = <const char*><size_t>hi
    return x


cdef int _bf16_num = -1  # NumPy's type number of ml_dtypes.bfloat16, once ml_dtypes is imported


cdef bint is_bfloat16(int typenum):
    """Whether ``typenum`` is ml_dtypes' bfloat16 (a user dtype: its number is given at
    registration, so it is looked up the first time an array of a user dtype comes by)."""
    global _bf16_num
    if typenum < 256:                # NPY_USERDEF: user dtypes come after the builtin ones
        return False
    if _bf16_num < 0:
        ml_dtypes = sys.modules.get("ml_dtypes")
        if ml_dtypes is None:       # no bfloat16 array can exist without it
            return False
        _bf16_num = np.dtype(ml_dtypes.bfloat16).num
    return typenum == _bf16_num


cdef int _e4m3_num = -1  # NumPy's type numbers of ml_dtypes.float8_e4m3fn and float8_e5m2
cdef int _e5m2_num = -1


cdef int float8_kind(int typenum):
    """ATTN_F32_KVE4M3 or ATTN_F32_KVE5M2 when ``typenum`` is ml_dtypes' float8_e4m3fn or
    float8_e5m2 (user dtypes, looked up like bfloat16's), else -1."""
    global _e4m3_num, _e5m2_num
    if typenum < 256:
        return -1
    if _e4m3_num < 0:
        ml_dtypes = sys.modules.get("ml_dtypes")
        if ml_dtypes is None:
            return -1
        _e4m3_num = np.dtype(ml_dtypes.float8_e4m3fn).num
        _e5m2_num = np.dtype(ml_dtypes.float8_e5m2).num
    return ATTN_F32_KVE4M3 if typenum == _e4m3_num else ATTN_F32_KVE5M2 if typenum == _e5m2_num else -1


cdef int element_kind(int tq, int tk, int tv):
    """The kernel's element kind (ATTN_F32, ...) of query, key and value of NumPy
    type numbers tq, tk, tv, or -1 when the kernel has none for them.

    The rule: float64 throughout is ATTN_F64; a float32 query takes float32
    (ATTN_F32), float16 (ATTN_F32_KV16), bfloat16 (ATTN_F32_KVBF16) or int8
    q8_0 rows (ATTN_F32_KVQ8) or float8 e4m3fn / e5m2 (ATTN_F32_KVE4M3,
    ATTN_F32_KVE5M2) as key and value, read in place. A 16-bit query
    is computed in float32, so float16 and bfloat16 queries count as float32
    (their callers widen them before the kernel runs)."""
    cdef bint q32 = tq == cnp.NPY_FLOAT32 or tq == cnp.NPY_FLOAT16 or is_bfloat16(tq)
    if tk != tv:
        return -1
    if tq == cnp.NPY_FLOAT64:
        return ATTN_F64 if tk == cnp.NPY_FLOAT64 else -1
    if not q32:
        return -1
    if tk == cnp.NPY_FLOAT32:
        return ATTN_F32 if tq == cnp.NPY_FLOAT32 else -1   # (a 16-bit q with a float32 cache: validation's error)
    if tk == cnp.NPY_FLOAT16:
        return ATTN_F32_KV16 if not is_bfloat16(tq) else -1
    if tk == cnp.NPY_INT8:
        return ATTN_F32_KVQ8
    if is_bfloat16(tk):
        return ATTN_F32_KVBF16 if tq != cnp.NPY_FLOAT16 else -1
    return float8_kind(tk)


cdef int mask_kind(object mask):
    """The kernel's kind of a mask operand: ATTN_MASK_NONE (None), ATTN_MASK_BOOL
    (True = takes part) or ATTN_MASK_ADD (a float mask, added to the scores)."""
    if mask is None:
        return ATTN_MASK_NONE
    return ATTN_MASK_BOOL if cnp.PyArray_TYPE(<cnp.ndarray>mask) == cnp.NPY_BOOL else ATTN_MASK_ADD


cdef int fill_offsets(cnp.ndarray a, const cnp.npy_intp* batch, int nbatch, int n_inner, int64_t group,
                      int64_t* out) noexcept:
    """The element offset of every inner block of ``a`` over the broadcast ``batch``
    (C order over its nbatch dims) into ``out``: the one place operand offsets
    are computed (attn._operands.describe and the fast path both call it).

    ``a``'s leading dims (all but the last n_inner) are right-aligned with
    ``batch``; each is 1 (broadcast), or equal to its batch dim, or with
    ``group > 1`` the last one times group equals its batch dim (GQA: query
    head h reads key/value head h // group). Strides in whole elements (the
    caller checks), any sign; stride 0 broadcasts. Returns 0; -1 if there are
    more batch dims than NumPy has (never, for a NumPy shape)."""
    cdef int nlead = a.ndim - n_inner, first = nbatch - nlead, d, dl
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(a), n = 1, b, o = 0, new
    cdef int64_t idx[64]
    cdef int64_t step[64]
    cdef int64_t div[64]
    cdef int64_t contrib[64]
    if nbatch > 64:
        return -1
    for d in range(nbatch):
        n *= batch[d]
        idx[d] = 0
        contrib[d] = 0
        dl = d - first
        if dl >= 0 and cnp.PyArray_DIMS(a)[dl] != 1:
            step[d] = cnp.PyArray_STRIDES(a)[dl] // isz
        else:
            step[d] = 0                    # broadcast: every index reads the same block
        div[d] = group if (group > 1 and dl == nlead - 1) else 1
    for b in range(n):                     # an odometer over the batch indices
        out[b] = o
        d = nbatch - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] == batch[d]:
                idx[d] = 0
            new = (idx[d] // div[d]) * step[d]
            o += new - contrib[d]
            contrib[d] = new
            if idx[d] != 0:
                break
            d -= 1
    return 0


def matrix_offsets(cnp.ndarray a, tuple batch, int n_inner, int64_t group):
    """int64 [prod(batch)]: the element offset of every inner block of ``a`` over the
    broadcast ``batch`` (see fill_offsets; attn._operands.matrix_offsets calls it)."""
    cdef int nbatch = len(batch), d
    cdef cnp.npy_intp dims[64]
    cdef int64_t n = 1
    if nbatch > 64:
        raise ValueError(f"at most 64 batch dims, got {nbatch}")
    for d in range(nbatch):
        dims[d] = batch[d]
        n *= dims[d]
    out = np.empty(n, np.int64)
    fill_offsets(a, dims, nbatch, n_inner, group, <int64_t*>cnp.PyArray_DATA(out))
    return out


cdef int build(attn_problem* a, object q, object k, object v, object mask,
               attn_operand q_op, attn_operand k_op, attn_operand v_op, attn_operand m_op,
               object out, object weights, object lse,
               int64_t n_batch, int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v,
               object causal_offset, double scale, object variants, bint with_sinks, list keep,
               bint q_bf16, object varlen, int64_t out_rs, object paged, object kv_len) except -1:
    """Fill ``a`` with the problem of one validated kernel call: the one builder.

    Parameters
    ----------
    q, k, v, mask : ndarray (mask None): the operands the kernel reads (a
        16-bit query over a K, V of its own dtype as it is, any other 16-bit
        query already widened to float32; int8 K, V: q8_0 rows);
        ``*_op`` their descriptors (:func:`operand`).
    out, weights, lse : the outputs the kernel writes (weights, lse None: not
        asked for); a bfloat16 or float16 ``out`` is rounded as each row is written.
    n_batch, n_q, n_k, d_k, d_v : the problem's sizes (the largest, for a
        packed or paged batch).
    causal_offset : None (not causal) or int: key j visible to row i iff
        j <= i + causal_offset.
    variants : attn._variants.Variants or None (window, softcap, ALiBi slopes
        and sinks broadcast over the batch's matrices); ``with_sinks``: the
        forward joins the sinks to each row's sum, the backward (whose lse
        includes them) takes none. Arrays the kernel reads are appended to
        ``keep``, which the caller holds while the kernel runs.
    q_bf16 : the caller's query was bfloat16 (with a bfloat16 K, V, or a float8
        e4m3 one: the bfloat16 dot products of the avx512-bf16 paths).
    varlen, out_rs : a packed variable-length batch (C-contiguous int64
        [5, n_batch], attn_kernel.h) and its out row stride, or None, 0.
    paged : ``(pages int32, page_rows int64 [n_batch], page_size, k_page,
        v_page)``, a paged K/V (FlashAttention's block table), or None.
    kv_len : C-contiguous int64 [n_batch], the keys each matrix sees, or None.

    The caller keeps every array alive while the kernel runs and has checked
    every block table entry a matrix reads.
    """
    memset(a, 0, sizeof(attn_problem))
    a.kind = element_kind(cnp.PyArray_TYPE(<cnp.ndarray>q), cnp.PyArray_TYPE(<cnp.ndarray>k),
                          cnp.PyArray_TYPE(<cnp.ndarray>v))
    if a.kind < 0:
        raise TypeError(f"the kernels take no query {q.dtype} with key {k.dtype} and value {v.dtype}")
    if a.kind == ATTN_F32_KVQ8:
        # the kernel reads attn_q8_row_bytes(d) contiguous bytes of every row (values, then scales)
        if not (k.shape[k.ndim - 1] == <int64_t>attn_q8_row_bytes(d_k)
                and v.shape[v.ndim - 1] == <int64_t>attn_q8_row_bytes(d_v)
                and k_op.s_col == 1 and v_op.s_col == 1):
            raise ValueError(f"int8 key/value rows must be q8_0 rows of {attn_q8_row_bytes(d_k)} and "
                             f"{attn_q8_row_bytes(d_v)} contiguous bytes; got key {k.shape} {k.dtype}, "
                             f"value {v.shape} {v.dtype}")
    a.q, a.k, a.v, a.mask = q_op, k_op, v_op, m_op
    a.mask_kind = mask_kind(mask)
    a.out = <char*>cnp.PyArray_DATA(<cnp.ndarray>out)
    a.weights = NULL if weights is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>weights)
    a.lse = NULL if lse is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    a.n_batch, a.n_q, a.n_k, a.d_k, a.d_v = n_batch, n_q, n_k, d_k, d_v
    a.causal = causal_offset is not None
    a.causal_offset = causal_offset if a.causal else 0
    a.scale = scale
    # a 16-bit q array is read as it is (attn_problem.q_raw16) over a K, V of its own type only
    # (bfloat16 or float16); any other 16-bit query is widened by the caller
    cdef int tq = cnp.PyArray_TYPE(<cnp.ndarray>q), to = cnp.PyArray_TYPE(<cnp.ndarray>out)
    a.q_raw16 = is_bfloat16(tq) or tq == cnp.NPY_FLOAT16
    if a.q_raw16 and not ((is_bfloat16(tq) and a.kind == ATTN_F32_KVBF16)
                          or (tq == cnp.NPY_FLOAT16 and a.kind == ATTN_F32_KV16)):
        raise TypeError(f"the kernel reads a 16-bit query as it is over a key and value of its own dtype only: "
                        f"got query {q.dtype}, key {k.dtype}, value {v.dtype}")
    a.q_bf16 = (q_bf16 or is_bfloat16(tq)) and (a.kind == ATTN_F32_KVBF16 or a.kind == ATTN_F32_KVE4M3)
    a.out16 = ATTN_OUT_BF16 if is_bfloat16(to) else ATTN_OUT_F16 if to == cnp.NPY_FLOAT16 else 0
    if a.out16 and (a.kind == ATTN_F64 or weights is not None):
        raise ValueError(f"a {out.dtype} out needs a float32 kind and no weights")
    a.out_stream = cnp.PyArray_NBYTES(<cnp.ndarray>out) >= ATTN_STREAM_OUT_BYTES
    if variants is not None:
        _set_variants(a, variants, with_sinks, keep)
    if varlen is not None:
        _set_varlen(a, varlen, out_rs)
    if paged is not None or kv_len is not None:
        if weights is not None:
            raise ValueError("a paged K/V or per-matrix key lengths take no weights")
        _set_paged(a, paged, kv_len)
    return 0


cdef int _set_variants(attn_problem* a, object v, bint with_sinks, list keep) except -1:
    """attn._variants.Variants ``v`` into ``a``: its window (Variants.has_window, decided
    there), softcap, ALiBi slopes and (``with_sinks``) sink logits, the arrays as
    float64 [n_batch] (their views over the batch, made contiguous and kept in ``keep``)."""
    cdef const double[::1] slopes
    cdef const double[::1] sink_logits
    a.window = 1 if v.has_window else 0
    a.win_lo, a.win_hi = v.window_lo, v.window_hi
    a.softcap = v.softcap or 0.0
    a.alibi_offset = v.offset
    if v.alibi is not None:
        slopes = np.ascontiguousarray(v.alibi, np.float64).reshape(-1)  # [*batch] -> [n_batch]
        keep.append(slopes)
        a.alibi = &slopes[0]
    if with_sinks and v.sinks is not None:
        sink_logits = np.ascontiguousarray(v.sinks, np.float64).reshape(-1)  # [*batch] -> [n_batch]
        keep.append(sink_logits)
        a.sinks = &sink_logits[0]
    return 0


cdef int _set_varlen(attn_problem* a, object varlen, int64_t out_rs) except -1:
    """A packed variable-length batch into ``a``: a C-contiguous int64 array
    [5, n_batch] (attn_kernel.h)."""
    cdef const int64_t[:, ::1] table = varlen
    a.varlen = &table[0, 0]
    a.out_rs = out_rs
    return 0


cdef int _set_paged(attn_problem* a, object paged, object kv_len) except -1:
    """A paged K/V and per-matrix key lengths into ``a``: ``paged`` None, or (pages,
    page_rows, page_size, k_page, v_page) with pages a C-contiguous int32 array (the
    block table's entries) and page_rows a C-contiguous int64 array [n_batch];
    ``kv_len`` None or a C-contiguous int64 array [n_batch] (attn_kernel.h)."""
    cdef const int32_t[::1] table
    cdef const int64_t[::1] rows
    cdef const int64_t[::1] lengths
    if paged is not None:
        pages, page_rows, a.page_size, a.k_page, a.v_page = paged
        table = pages
        rows = page_rows
        a.pages = &table[0] if table.shape[0] > 0 else NULL
        a.page_rows = &rows[0]
    if kv_len is not None:
        lengths = kv_len
        a.kv_len = &lengths[0]
    return 0
