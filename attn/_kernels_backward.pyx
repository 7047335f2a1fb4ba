# Fused attention backward (FlashAttention-2) and the forward's log-sum-exp.
#
# A separate extension from attn._kernels (same build flags, see setup.py).
# Layering as there: attn/_validation.py validates and attn/_backends/fused.py computes every operand's
# per-matrix element offsets; the `def` functions only fill C structs, the
# `noexcept nogil` drivers never touch a Python object, and errors (allocation
# failure) come back as status codes raised after the nogil block. The
# numerical work is in attn/_src/attn_backward_impl.h.

from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "attn_omp.h" nogil:
    int attn_omp_max_threads()
    int ATTN_HAVE_OPENMP
    int ATTN_DEBUG_ENABLED

cdef extern from "attn_backward.h" nogil:
    ctypedef struct attn_bw_f32:
        const float* q
        ptrdiff_t q_rs, q_cs
        const float* k
        ptrdiff_t k_rs, k_cs
        const float* v
        ptrdiff_t v_rs, v_cs
        const void* mask
        ptrdiff_t m_rs, m_cs
        int mask_kind
        const float* out
        const float* dout
        const float* lse
        float* dq
        float* dk
        float* dv
        float* ds
        ptrdiff_t n_q, n_k, d_k, d_v
        int causal
        ptrdiff_t causal_offset
        float scale
        float* work
    ctypedef struct attn_bw_f64:
        const double* q
        ptrdiff_t q_rs, q_cs
        const double* k
        ptrdiff_t k_rs, k_cs
        const double* v
        ptrdiff_t v_rs, v_cs
        const void* mask
        ptrdiff_t m_rs, m_cs
        int mask_kind
        const double* out
        const double* dout
        const double* lse
        double* dq
        double* dk
        double* dv
        double* ds
        ptrdiff_t n_q, n_k, d_k, d_v
        int causal
        ptrdiff_t causal_offset
        double scale
        double* work
    enum:
        ATTN_BW_BQ
        ATTN_BW_BK
    void attn_bw_init()
    const char* attn_bw_path()
    int attn_bw_available(const char** names, int n)
    int attn_bw_select(const char* name)
    size_t attn_bw_work_elems_f32(ptrdiff_t n_q, ptrdiff_t n_k, ptrdiff_t d_k, ptrdiff_t d_v)
    size_t attn_bw_work_elems_f64(ptrdiff_t n_q, ptrdiff_t n_k, ptrdiff_t d_k, ptrdiff_t d_v)
    size_t attn_bw_scratch_elems_f32(ptrdiff_t d_k, ptrdiff_t d_v)
    size_t attn_bw_scratch_elems_f64(ptrdiff_t d_k, ptrdiff_t d_v)
    void attn_bw_pack_f32(const attn_bw_f32* a, int for_lse)
    void attn_bw_pack_f64(const attn_bw_f64* a, int for_lse)
    void attn_bw_matrix_f32(const attn_bw_f32* a, float* scratch)
    void attn_bw_matrix_f64(const attn_bw_f64* a, double* scratch)
    void attn_bw_kv_block_f32(const attn_bw_f32* a, ptrdiff_t jb, float* scratch)
    void attn_bw_kv_block_f64(const attn_bw_f64* a, ptrdiff_t jb, double* scratch)
    void attn_bw_q_block_f32(const attn_bw_f32* a, ptrdiff_t ib, float* scratch)
    void attn_bw_q_block_f64(const attn_bw_f64* a, ptrdiff_t ib, double* scratch)
    void attn_bw_lse_block_f32(const attn_bw_f32* a, ptrdiff_t ib, float* scratch, float* lse)
    void attn_bw_lse_block_f64(const attn_bw_f64* a, ptrdiff_t ib, double* scratch, double* lse)

attn_bw_init()  # pick the instruction-set path once, before any kernel runs

cdef enum:
    OK = 0
    ERR_NOMEM = 1
    MASK_NONE = 0
    MASK_BOOL = 1
    MASK_ADD = 2
    # a thread per ~1M multiply-adds at most (as attn._kernels' GRAIN_FMA)
    GRAIN_FMA = 1000000


cdef struct Operand:
    const char* base
    const int64_t* offsets
    int64_t s_row
    int64_t s_col


cdef struct Problem:
    Operand q, k, v, mask
    int mask_kind
    char* out        # [N, L, Ev] contiguous
    char* dout       # [N, L, Ev] contiguous
    char* lse        # [N, L]
    char* dq         # [N, L, E]
    char* dk         # [N, S, E]
    char* dv         # [N, S, Ev]
    char* ds         # [N, L, S] or NULL
    int64_t n_batch, n_q, n_k, d_k, d_v
    bint causal
    int64_t causal_offset
    double scale


cdef inline void* _aligned_alloc(size_t nbytes) noexcept nogil:
    # 64-byte aligned; freed by _aligned_free (the raw pointer sits just before)
    cdef char* raw = <char*>malloc(nbytes + 64 + sizeof(void*))
    cdef size_t addr
    if raw == NULL:
        return NULL
    addr = (<size_t>(raw + sizeof(void*)) + 63) & ~(<size_t>63)
    ((<void**>addr) - 1)[0] = raw
    return <void*>addr


cdef inline void _aligned_free(void* p) noexcept nogil:
    if p != NULL:
        free(((<void**>p) - 1)[0])


cdef inline const char* _at(const Operand* o, int64_t b, size_t itemsize) noexcept nogil:
    return o.base + o.offsets[b] * <int64_t>itemsize


cdef void _fill32(const Problem* p, int64_t b, attn_bw_f32* a, float* work) noexcept nogil:
    a.q = <const float*>_at(&p.q, b, 4)
    a.q_rs = p.q.s_row
    a.q_cs = p.q.s_col
    a.k = <const float*>_at(&p.k, b, 4)
    a.k_rs = p.k.s_row
    a.k_cs = p.k.s_col
    a.v = <const float*>_at(&p.v, b, 4) if p.v.base != NULL else NULL
    a.v_rs = p.v.s_row
    a.v_cs = p.v.s_col
    a.mask_kind = p.mask_kind
    a.mask = _at(&p.mask, b, 4 if p.mask_kind == MASK_ADD else 1) if p.mask_kind != MASK_NONE else NULL
    a.m_rs = p.mask.s_row
    a.m_cs = p.mask.s_col
    a.out = (<const float*>p.out) + b * p.n_q * p.d_v if p.out != NULL else NULL
    a.dout = (<const float*>p.dout) + b * p.n_q * p.d_v if p.dout != NULL else NULL
    a.lse = (<const float*>p.lse) + b * p.n_q
    a.dq = (<float*>p.dq) + b * p.n_q * p.d_k if p.dq != NULL else NULL
    a.dk = (<float*>p.dk) + b * p.n_k * p.d_k if p.dk != NULL else NULL
    a.dv = (<float*>p.dv) + b * p.n_k * p.d_v if p.dv != NULL else NULL
    a.ds = (<float*>p.ds) + b * p.n_q * p.n_k if p.ds != NULL else NULL
    a.n_q = p.n_q
    a.n_k = p.n_k
    a.d_k = p.d_k
    a.d_v = p.d_v
    a.causal = p.causal
    a.causal_offset = p.causal_offset
    a.scale = <float>p.scale
    a.work = work


cdef void _fill64(const Problem* p, int64_t b, attn_bw_f64* a, double* work) noexcept nogil:
    a.q = <const double*>_at(&p.q, b, 8)
    a.q_rs = p.q.s_row
    a.q_cs = p.q.s_col
    a.k = <const double*>_at(&p.k, b, 8)
    a.k_rs = p.k.s_row
    a.k_cs = p.k.s_col
    a.v = <const double*>_at(&p.v, b, 8) if p.v.base != NULL else NULL
    a.v_rs = p.v.s_row
    a.v_cs = p.v.s_col
    a.mask_kind = p.mask_kind
    a.mask = _at(&p.mask, b, 8 if p.mask_kind == MASK_ADD else 1) if p.mask_kind != MASK_NONE else NULL
    a.m_rs = p.mask.s_row
    a.m_cs = p.mask.s_col
    a.out = (<const double*>p.out) + b * p.n_q * p.d_v if p.out != NULL else NULL
    a.dout = (<const double*>p.dout) + b * p.n_q * p.d_v if p.dout != NULL else NULL
    a.lse = (<const double*>p.lse) + b * p.n_q
    a.dq = (<double*>p.dq) + b * p.n_q * p.d_k if p.dq != NULL else NULL
    a.dk = (<double*>p.dk) + b * p.n_k * p.d_k if p.dk != NULL else NULL
    a.dv = (<double*>p.dv) + b * p.n_k * p.d_v if p.dv != NULL else NULL
    a.ds = (<double*>p.ds) + b * p.n_q * p.n_k if p.ds != NULL else NULL
    a.n_q = p.n_q
    a.n_k = p.n_k
    a.d_k = p.d_k
    a.d_v = p.d_v
    a.causal = p.causal
    a.causal_offset = p.causal_offset
    a.scale = p.scale
    a.work = work


cdef int _threads_for(const Problem* p, int num_threads, double fmas_per_score) noexcept nogil:
    cdef double work = <double>p.n_batch * p.n_q * p.n_k * fmas_per_score
    if work < <double>GRAIN_FMA * num_threads:
        return 1 if work < GRAIN_FMA else <int>(work / GRAIN_FMA)
    return num_threads


cdef int _backward_f32(const Problem* p, int num_threads) noexcept nogil:
    # Per matrix: fill its struct, pack its operands (parallel over matrices).
    # Then either each thread takes whole matrices (at least as many matrices
    # as threads), or FlashAttention-2's two passes: (matrix, key block)
    # items for dK, dV, then (matrix, query block) items for dQ. Both run
    # the same operations in the same order (attn_backward_impl.h): the
    # result does not depend on the thread count.
    cdef int64_t N = p.n_batch, b, it
    cdef int64_t nkb = (p.n_k + ATTN_BW_BK - 1) // ATTN_BW_BK
    cdef int64_t nqb = (p.n_q + ATTN_BW_BQ - 1) // ATTN_BW_BQ
    cdef size_t wn = attn_bw_work_elems_f32(p.n_q, p.n_k, p.d_k, p.d_v)
    cdef size_t sn = attn_bw_scratch_elems_f32(p.d_k, p.d_v)
    cdef int status = OK
    cdef float* scratch = NULL
    cdef float* scratch_all
    cdef bint per_matrix
    num_threads = _threads_for(p, num_threads, 3 * p.d_k + 2 * p.d_v)
    per_matrix = N >= num_threads
    cdef attn_bw_f32* mats = <attn_bw_f32*>malloc(N * sizeof(attn_bw_f32))
    cdef float* work = <float*>_aligned_alloc(N * wn * sizeof(float))
    sn = (sn + 15) // 16 * 16  # each thread's part starts 64-byte aligned
    scratch_all = <float*>_aligned_alloc(num_threads * sn * sizeof(float))
    if mats == NULL or work == NULL or scratch_all == NULL:
        free(mats)
        _aligned_free(work)
        _aligned_free(scratch_all)
        return ERR_NOMEM
    with parallel(num_threads=num_threads):
        scratch = scratch_all + threadid() * sn
        for b in prange(N, schedule="static"):
            _fill32(p, b, &mats[b], work + b * wn)
            attn_bw_pack_f32(&mats[b], 0)
        if per_matrix:
            for b in prange(N, schedule="dynamic"):
                attn_bw_matrix_f32(&mats[b], scratch)
        else:
            for it in prange(N * nkb, schedule="dynamic"):
                attn_bw_kv_block_f32(&mats[it // nkb], it % nkb, scratch)
            for it in prange(N * nqb, schedule="dynamic"):
                # last query blocks (the longest under causal) first
                attn_bw_q_block_f32(&mats[it // nqb], nqb - 1 - it % nqb, scratch)
    free(mats)
    _aligned_free(work)
    _aligned_free(scratch_all)
    return status


cdef int _backward_f64(const Problem* p, int num_threads) noexcept nogil:
    # (the float64 twin of _backward_f32)
    cdef int64_t N = p.n_batch, b, it
    cdef int64_t nkb = (p.n_k + ATTN_BW_BK - 1) // ATTN_BW_BK
    cdef int64_t nqb = (p.n_q + ATTN_BW_BQ - 1) // ATTN_BW_BQ
    cdef size_t wn = attn_bw_work_elems_f64(p.n_q, p.n_k, p.d_k, p.d_v)
    cdef size_t sn = attn_bw_scratch_elems_f64(p.d_k, p.d_v)
    cdef int status = OK
    cdef double* scratch = NULL
    cdef double* scratch_all
    cdef bint per_matrix
    num_threads = _threads_for(p, num_threads, 3 * p.d_k + 2 * p.d_v)
    per_matrix = N >= num_threads
    cdef attn_bw_f64* mats = <attn_bw_f64*>malloc(N * sizeof(attn_bw_f64))
    cdef double* work = <double*>_aligned_alloc(N * wn * sizeof(double))
    sn = (sn + 15) // 16 * 16  # each thread's part starts 64-byte aligned
    scratch_all = <double*>_aligned_alloc(num_threads * sn * sizeof(double))
    if mats == NULL or work == NULL or scratch_all == NULL:
        free(mats)
        _aligned_free(work)
        _aligned_free(scratch_all)
        return ERR_NOMEM
    with parallel(num_threads=num_threads):
        scratch = scratch_all + threadid() * sn
        for b in prange(N, schedule="static"):
            _fill64(p, b, &mats[b], work + b * wn)
            attn_bw_pack_f64(&mats[b], 0)
        if per_matrix:
            for b in prange(N, schedule="dynamic"):
                attn_bw_matrix_f64(&mats[b], scratch)
        else:
            for it in prange(N * nkb, schedule="dynamic"):
                attn_bw_kv_block_f64(&mats[it // nkb], it % nkb, scratch)
            for it in prange(N * nqb, schedule="dynamic"):
                attn_bw_q_block_f64(&mats[it // nqb], nqb - 1 - it % nqb, scratch)
    free(mats)
    _aligned_free(work)
    _aligned_free(scratch_all)
    return status


cdef int _lse_f32(const Problem* p, int num_threads) noexcept nogil:
    cdef int64_t N = p.n_batch, b, it
    cdef int64_t nqb = (p.n_q + ATTN_BW_BQ - 1) // ATTN_BW_BQ
    cdef size_t wn = attn_bw_work_elems_f32(p.n_q, p.n_k, p.d_k, 0)
    cdef size_t sn = attn_bw_scratch_elems_f32(p.d_k, 0)
    cdef int status = OK
    cdef float* scratch = NULL
    cdef float* scratch_all
    num_threads = _threads_for(p, num_threads, p.d_k)
    cdef attn_bw_f32* mats = <attn_bw_f32*>malloc(N * sizeof(attn_bw_f32))
    cdef float* work = <float*>_aligned_alloc(N * wn * sizeof(float))
    sn = (sn + 15) // 16 * 16  # each thread's part starts 64-byte aligned
    scratch_all = <float*>_aligned_alloc(num_threads * sn * sizeof(float))
    if mats == NULL or work == NULL or scratch_all == NULL:
        free(mats)
        _aligned_free(work)
        _aligned_free(scratch_all)
        return ERR_NOMEM
    with parallel(num_threads=num_threads):
        scratch = scratch_all + threadid() * sn
        for b in prange(N, schedule="static"):
            _fill32(p, b, &mats[b], work + b * wn)
            mats[b].d_v = 0
            attn_bw_pack_f32(&mats[b], 1)
        for it in prange(N * nqb, schedule="dynamic"):
            attn_bw_lse_block_f32(&mats[it // nqb], it % nqb, scratch,
                                  (<float*>p.lse) + (it // nqb) * p.n_q)
    free(mats)
    _aligned_free(work)
    _aligned_free(scratch_all)
    return status


cdef int _lse_f64(const Problem* p, int num_threads) noexcept nogil:
    cdef int64_t N = p.n_batch, b, it
    cdef int64_t nqb = (p.n_q + ATTN_BW_BQ - 1) // ATTN_BW_BQ
    cdef size_t wn = attn_bw_work_elems_f64(p.n_q, p.n_k, p.d_k, 0)
    cdef size_t sn = attn_bw_scratch_elems_f64(p.d_k, 0)
    cdef int status = OK
    cdef double* scratch = NULL
    cdef double* scratch_all
    num_threads = _threads_for(p, num_threads, p.d_k)
    cdef attn_bw_f64* mats = <attn_bw_f64*>malloc(N * sizeof(attn_bw_f64))
    cdef double* work = <double*>_aligned_alloc(N * wn * sizeof(double))
    sn = (sn + 15) // 16 * 16  # each thread's part starts 64-byte aligned
    scratch_all = <double*>_aligned_alloc(num_threads * sn * sizeof(double))
    if mats == NULL or work == NULL or scratch_all == NULL:
        free(mats)
        _aligned_free(work)
        _aligned_free(scratch_all)
        return ERR_NOMEM
    with parallel(num_threads=num_threads):
        scratch = scratch_all + threadid() * sn
        for b in prange(N, schedule="static"):
            _fill64(p, b, &mats[b], work + b * wn)
            mats[b].d_v = 0
            attn_bw_pack_f64(&mats[b], 1)
        for it in prange(N * nqb, schedule="dynamic"):
            attn_bw_lse_block_f64(&mats[it // nqb], it % nqb, scratch,
                                  (<double*>p.lse) + (it // nqb) * p.n_q)
    free(mats)
    _aligned_free(work)
    _aligned_free(scratch_all)
    return status


# --------------------------------------------------------------------------
# Python-facing wrappers (validated inputs only: see attn/_backends/fused.py)

cdef Operand _operand(object arr, const int64_t[::1] offsets, tuple strides, int64_t n_batch):
    cdef Operand o
    cdef cnp.ndarray a
    o.base = NULL
    o.offsets = NULL
    o.s_row = o.s_col = 0
    if arr is None:
        return o
    a = arr
    o.base = <const char*>cnp.PyArray_DATA(a)
    o.offsets = &offsets[0] if offsets.shape[0] > 0 else NULL
    o.s_row = strides[0]
    o.s_col = strides[1]
    if ATTN_DEBUG_ENABLED:
        _check_extent(a, offsets, strides, n_batch)
    return o


cdef _check_extent(cnp.ndarray a, const int64_t[::1] offsets, tuple strides, int64_t n_batch):
    """Debug builds: every matrix's corners lie inside the array's memory."""
    lo, hi = np.lib.array_utils.byte_bounds(a)
    base = <size_t>cnp.PyArray_DATA(a)
    rows, cols = a.shape[a.ndim - 2], a.shape[a.ndim - 1]
    if rows == 0 or cols == 0:
        return
    for b in range(n_batch):
        for r in (0, rows - 1):
            for c in (0, cols - 1):
                addr = base + (offsets[b] + r * strides[0] + c * strides[1]) * a.itemsize
                if not lo <= addr < hi:
                    raise IndexError("attn._kernels_backward: debug build caught an "
                                     "out-of-bounds operand (kernel bug)")


cdef size_t data(object a):
    return 0 if a is None else <size_t>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef Problem _problem(q, k, v, mask, out, dout, lse, dq, dk, dv, ds,
                      const int64_t[::1] q_off, const int64_t[::1] k_off,
                      const int64_t[::1] v_off, const int64_t[::1] m_off,
                      tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
                      bint causal, int64_t causal_offset, double scale):
    cdef Problem p
    p.n_batch = lse.shape[0]
    p.n_q = lse.shape[1]
    p.n_k = k.shape[k.ndim - 2]
    p.d_k = q.shape[q.ndim - 1]
    p.d_v = 0 if v is None else v.shape[v.ndim - 1]
    p.q = _operand(q, q_off, q_strides, p.n_batch)
    p.k = _operand(k, k_off, k_strides, p.n_batch)
    p.v = _operand(v, v_off, v_strides, p.n_batch)
    if mask is None:
        p.mask_kind = MASK_NONE
        p.mask = _operand(None, m_off, m_strides, p.n_batch)
    else:
        p.mask_kind = MASK_BOOL if mask.dtype == np.bool_ else MASK_ADD
        p.mask = _operand(mask, m_off, m_strides, p.n_batch)
    p.out = <char*>data(out)
    p.dout = <char*>data(dout)
    p.lse = <char*>data(lse)
    p.dq = <char*>data(dq)
    p.dk = <char*>data(dk)
    p.dv = <char*>data(dv)
    p.ds = <char*>data(ds)
    p.causal = causal
    p.causal_offset = causal_offset
    p.scale = scale
    return p


cdef _raise(int status, str where):
    if status & ERR_NOMEM:
        raise MemoryError(f"{where}: could not allocate the packed operands or per-thread scratch")


def backward(q, k, v, mask, out, dout, lse, dq, dk, dv, ds,
             const int64_t[::1] q_off, const int64_t[::1] k_off,
             const int64_t[::1] v_off, const int64_t[::1] m_off,
             tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
             bint causal, int64_t causal_offset, double scale, int num_threads):
    """Gradients of attention over n_batch matrices (FlashAttention-2).

    Parameters
    ----------
    q, k, v, mask : operands as for ``attn._kernels.attention`` (any strides:
        matrix b of q starts ``q_off[b]`` elements after its data pointer,
        element strides ``q_strides``); mask bool or of q's dtype, or None.
    out, dout : C-contiguous [n_batch, n_q, d_v], the forward's output and dLoss/dout
    lse : C-contiguous [n_batch, n_q], the forward's log-sum-exp
    dq, dk, dv : C-contiguous outputs [n_batch, n_q, d_k], [n_batch, n_k, d_k],
        [n_batch, n_k, d_v] (per query head: GQA groups are summed by the caller)
    ds : C-contiguous [n_batch, n_q, n_k], zero-filled, or None: receives dS
        (the float mask's gradient) where visible
    causal, causal_offset, scale, num_threads : as for the forward
    """
    cdef Problem p = _problem(q, k, v, mask, out, dout, lse, dq, dk, dv, ds, q_off, k_off,
                              v_off, m_off, q_strides, k_strides, v_strides, m_strides,
                              causal, causal_offset, scale)
    cdef int status
    if ds is not None:
        ds.fill(0)
    if p.n_batch == 0 or p.n_q == 0 or p.n_k == 0:
        dq.fill(0)
        dk.fill(0)
        dv.fill(0)
        return
    if lse.dtype == np.float32:
        with nogil:
            status = _backward_f32(&p, num_threads)
    else:
        with nogil:
            status = _backward_f64(&p, num_threads)
    _raise(status, "attention backward")


def lse(q, k, mask, lse, const int64_t[::1] q_off, const int64_t[::1] k_off,
        const int64_t[::1] m_off, tuple q_strides, tuple k_strides, tuple m_strides,
        bint causal, int64_t causal_offset, double scale, int num_threads):
    """Log-sum-exp of each row's scaled, masked scores into C-contiguous ``lse`` [n_batch, n_q]."""
    cdef Problem p = _problem(q, k, None, mask, None, None, lse, None, None, None, None,
                              q_off, k_off, q_off, m_off, q_strides, k_strides, (0, 0),
                              m_strides, causal, causal_offset, scale)
    cdef int status
    if p.n_batch == 0 or p.n_q == 0:
        return
    if p.n_k == 0:
        lse.fill(-np.inf)
        return
    if lse.dtype == np.float32:
        with nogil:
            status = _lse_f32(&p, num_threads)
    else:
        with nogil:
            status = _lse_f64(&p, num_threads)
    _raise(status, "attention log-sum-exp")


def simd_paths():
    """Instruction-set paths this CPU can run, widest (the default) first."""
    cdef const char* names[8]
    cdef int i, n = attn_bw_available(names, 8)
    return [names[i].decode("ascii") for i in range(n)]


def simd_path():
    """The path the backward kernels use now."""
    return attn_bw_path().decode("ascii")


def _select_simd(str name):
    """Switch to another available path (for tests); returns the previous one."""
    previous = attn_bw_path().decode("ascii")
    if attn_bw_select(name.encode("ascii")) != 0:
        raise ValueError(f"SIMD path {name!r} not available; this CPU has {simd_paths()}")
    return previous


def build_info():
    """OpenMP, thread count, debug checks and SIMD path of this extension."""
    return {
        "openmp": bool(ATTN_HAVE_OPENMP),
        "max_threads": attn_omp_max_threads(),
        "debug": bool(ATTN_DEBUG_ENABLED),
        "simd": attn_bw_path().decode("ascii"),
    }
