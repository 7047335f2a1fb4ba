# Fused attention kernels: masked softmax and blocked online-softmax attention.
#
# Layering (as scikit-learn's _pairwise_distances_reduction): attn/_validation.py
# checks every argument and attn/_dispatch.py computes the per-matrix element
# offsets; the `def` functions here only unpack arrays into a C struct, and
# the `noexcept nogil` cores never touch a Python object. Errors found in the
# cores (allocation failure, debug-build bounds violation) are returned as
# codes and raised after the nogil block.
#
# Directives (setup.py): boundscheck/wraparound/initializedcheck are off in a
# normal build and on in the debug build (ATTN_DEBUG_BUILD=1), which also
# defines ATTN_DEBUG so every row pointer is checked against its array.

cimport cython
from cython cimport floating
from cython.parallel cimport parallel, prange
from libc.math cimport INFINITY, exp, expf
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "attn_omp.h" nogil:
    int attn_omp_max_threads()
    int ATTN_HAVE_OPENMP
    int ATTN_DEBUG_ENABLED

cdef enum:
    BLOCK_Q = 64    # query rows per work item
    BLOCK_K = 128   # keys per tile

cdef enum:          # status bits returned by the nogil cores
    OK = 0
    ERR_NOMEM = 1
    ERR_BOUNDS = 2

cdef enum MaskKind:
    MASK_NONE = 0
    MASK_BOOL = 1   # uint8, nonzero = takes part
    MASK_ADD = 2    # same float type as q, added to the scaled scores


cdef struct Strided:
    # One operand: base pointer, per-matrix element offsets, row/column
    # element strides, and (debug builds) the byte extent [lo, hi).
    const char* base
    const int64_t* offsets
    int64_t s_row
    int64_t s_col
    const char* lo
    const char* hi


cdef struct AttentionArgs:
    Strided q        # [n_batch][n_q, d_k]
    Strided k        # [n_batch][n_k, d_k]
    Strided v        # [n_batch][n_k, d_v]
    Strided mask     # [n_batch][n_q, n_k] or base == NULL
    char* out        # C-contiguous [n_batch, n_q, d_v]
    char* weights    # C-contiguous [n_batch, n_q, n_k] or NULL
    int64_t n_batch, n_q, n_k, d_k, d_v
    int mask_kind
    bint causal
    int64_t causal_offset   # key j is visible to row i iff j <= i + causal_offset
    double scale


cdef struct SoftmaxArgs:
    Strided x        # [n_rows][n]
    Strided mask     # [n_rows][n] or base == NULL
    char* out        # C-contiguous [n_rows, n]
    int64_t n_rows, n
    int mask_kind


# --------------------------------------------------------------------------
# small helpers

cdef inline floating _exp(floating x) noexcept nogil:
    if floating is float:
        return expf(x)
    else:
        return exp(x)


cdef inline bint _row_ok(const Strided* a, const char* row, int64_t n, size_t itemsize) noexcept nogil:
    """Debug builds: the first and last element of a row lie inside the array."""
    if not ATTN_DEBUG_ENABLED or n == 0:
        return True
    cdef const char* last = row + (n - 1) * a.s_col * <int64_t>itemsize
    return a.lo <= row < a.hi and a.lo <= last < a.hi


cdef inline const char* _row(const Strided* a, int64_t b, int64_t i, size_t itemsize) noexcept nogil:
    return a.base + (a.offsets[b] + i * a.s_row) * <int64_t>itemsize


cdef inline bint _nan_or_greater(floating x, floating m) noexcept nogil:
    # max() that propagates NaN: once the running max is NaN, it stays NaN.
    return x > m or x != x


# --------------------------------------------------------------------------
# masked softmax: one row at a time

cdef int _softmax_row(const SoftmaxArgs* a, int64_t r, floating* out) noexcept nogil:
    cdef int64_t j, n = a.n
    cdef const char* xrow = _row(&a.x, r, 0, sizeof(floating))
    cdef const char* mrow = NULL
    cdef int64_t xs = a.x.s_col, ms = a.mask.s_col
    cdef floating val, m = -INFINITY, total = 0
    if not _row_ok(&a.x, xrow, n, sizeof(floating)):
        return ERR_BOUNDS
    if a.mask_kind != MASK_NONE:
        mrow = _row(&a.mask, r, 0, sizeof(floating) if a.mask_kind == MASK_ADD else 1)
        if not _row_ok(&a.mask, mrow, n, sizeof(floating) if a.mask_kind == MASK_ADD else 1):
            return ERR_BOUNDS
    # pass 1: out[j] = logit (masked -> -inf); m = max (NaN-propagating)
    for j in range(n):
        val = (<const floating*>xrow)[j * xs]
        if a.mask_kind == MASK_BOOL:
            if (<const uint8_t*>mrow)[j * ms] == 0:
                val = -INFINITY
        elif a.mask_kind == MASK_ADD:
            val = val + (<const floating*>mrow)[j * ms]
        out[j] = val
        if _nan_or_greater(val, m):
            m = val
    if m == -INFINITY:  # nothing takes part: a row of zeros, not 0/0
        for j in range(n):
            out[j] = 0
        return OK
    # pass 2: exponentials and their sum; the max entry gives exp(0) = 1
    for j in range(n):
        val = _exp(out[j] - m)
        out[j] = val
        total = total + val
    for j in range(n):
        out[j] = out[j] / total
    return OK


cdef int _softmax_run(const SoftmaxArgs* a, floating* out, int num_threads) noexcept nogil:
    cdef int64_t r
    cdef int status = OK
    for r in prange(a.n_rows, num_threads=num_threads, schedule="static"):
        status |= _softmax_row(a, r, out + r * a.n)  # OR-reduction of status bits
    return status


# --------------------------------------------------------------------------
# attention: one work item = one matrix b and a block of query rows [i0, i1)
#
# Per-thread scratch (floats of the compute type):
#   q_blk [BLOCK_Q, d_k]   packed query rows
#   kT    [d_k, BLOCK_K]   packed keys, transposed (key index fastest)
#   v_blk [BLOCK_K, d_v]   packed values
#   s     [BLOCK_Q, BLOCK_K] scores, then probabilities, of one tile
#   acc   [BLOCK_Q, d_v]   unnormalized output
#   m_i, l_i [BLOCK_Q]     running max and running sum

cdef inline int64_t _scratch_size(int64_t d_k, int64_t d_v) noexcept nogil:
    return (BLOCK_Q * d_k + d_k * BLOCK_K + BLOCK_K * d_v + BLOCK_Q * BLOCK_K
            + BLOCK_Q * d_v + 2 * BLOCK_Q)


cdef inline int64_t _visible_end(const AttentionArgs* a, int64_t i) noexcept nogil:
    """One past the last key row i may see."""
    cdef int64_t end
    if not a.causal:
        return a.n_k
    end = i + a.causal_offset + 1
    return 0 if end < 0 else (a.n_k if end > a.n_k else end)


cdef int _score_tile(const AttentionArgs* a, int64_t b, int64_t i0, int64_t nq,
                     int64_t j0, int64_t nk, const floating* q_blk, floating* kT,
                     floating* s) noexcept nogil:
    """s[r, c] = scale * q[i0 + r] . k[j0 + c] (+ mask), masked entries -inf."""
    cdef int64_t r, c, e, d_k = a.d_k, end
    cdef const char* row
    cdef floating qe, scale = <floating>a.scale
    cdef floating* srow
    # pack K tile transposed: kT[e, c] = k[j0 + c, e]
    for c in range(nk):
        row = _row(&a.k, b, j0 + c, sizeof(floating))
        if not _row_ok(&a.k, row, d_k, sizeof(floating)):
            return ERR_BOUNDS
        for e in range(d_k):
            kT[e * BLOCK_K + c] = (<const floating*>row)[e * a.k.s_col]
    for r in range(nq):
        srow = s + r * BLOCK_K
        for c in range(nk):
            srow[c] = 0
        # [d_k] @ [d_k, nk] -> [nk], as nk-wide axpys that the compiler vectorizes
        for e in range(d_k):
            qe = q_blk[r * d_k + e]
            for c in range(nk):
                srow[c] = srow[c] + qe * kT[e * BLOCK_K + c]
        for c in range(nk):
            srow[c] = srow[c] * scale
        if a.mask_kind == MASK_BOOL:
            row = _row(&a.mask, b, i0 + r, 1) + j0 * a.mask.s_col
            if not _row_ok(&a.mask, row, nk, 1):
                return ERR_BOUNDS
            for c in range(nk):
                if (<const uint8_t*>row)[c * a.mask.s_col] == 0:
                    srow[c] = -INFINITY
        elif a.mask_kind == MASK_ADD:
            row = _row(&a.mask, b, i0 + r, sizeof(floating)) + j0 * a.mask.s_col * <int64_t>sizeof(floating)
            if not _row_ok(&a.mask, row, nk, sizeof(floating)):
                return ERR_BOUNDS
            for c in range(nk):
                srow[c] = srow[c] + (<const floating*>row)[c * a.mask.s_col]
        if a.causal:
            end = _visible_end(a, i0 + r)
            for c in range(nk):
                if j0 + c >= end:
                    srow[c] = -INFINITY
    return OK


cdef int _attend_block(const AttentionArgs* a, int64_t b, int64_t i0, int64_t i1,
                       floating* scratch) noexcept nogil:
    cdef int64_t nq = i1 - i0, d_k = a.d_k, d_v = a.d_v
    cdef floating* q_blk = scratch
    cdef floating* kT = q_blk + BLOCK_Q * d_k
    cdef floating* v_blk = kT + d_k * BLOCK_K
    cdef floating* s = v_blk + BLOCK_K * d_v
    cdef floating* acc = s + BLOCK_Q * BLOCK_K
    cdef floating* m_i = acc + BLOCK_Q * d_v
    cdef floating* l_i = m_i + BLOCK_Q
    cdef floating* srow
    cdef floating* arow
    cdef floating* orow
    cdef floating* wrow
    cdef const floating* vrow
    cdef floating m_new, m_tile, alpha, p, inv
    cdef int64_t r, c, e, j0, nk, j_end, rc
    cdef const char* row

    # pack the query block
    for r in range(nq):
        row = _row(&a.q, b, i0 + r, sizeof(floating))
        if not _row_ok(&a.q, row, d_k, sizeof(floating)):
            return ERR_BOUNDS
        for e in range(d_k):
            q_blk[r * d_k + e] = (<const floating*>row)[e * a.q.s_col]
        m_i[r] = -INFINITY
        l_i[r] = 0
        for e in range(d_v):
            acc[r * d_v + e] = 0

    # Causal: keys at or past the last row's horizon are invisible to the whole
    # block, so those tiles are skipped; tiles crossing the diagonal are masked.
    j_end = _visible_end(a, i1 - 1)
    j0 = -BLOCK_K
    while j0 + BLOCK_K < j_end:
        j0 = j0 + BLOCK_K
        nk = j_end - j0 if j_end - j0 < BLOCK_K else BLOCK_K
        rc = _score_tile(a, b, i0, nq, j0, nk, q_blk, kT, s)
        if rc != OK:
            return rc
        for c in range(nk):
            row = _row(&a.v, b, j0 + c, sizeof(floating))
            if not _row_ok(&a.v, row, d_v, sizeof(floating)):
                return ERR_BOUNDS
            for e in range(d_v):
                v_blk[c * d_v + e] = (<const floating*>row)[e * a.v.s_col]
        # Online softmax. Invariant after each tile, for every row r:
        #   m_i[r] = max of the row's scores seen so far (-inf if none visible),
        #   l_i[r] = sum_j exp(score_j - m_i[r]) over those scores,
        #   acc[r] = sum_j exp(score_j - m_i[r]) * v_j.
        for r in range(nq):
            srow = s + r * BLOCK_K
            arow = acc + r * d_v
            m_tile = -INFINITY
            for c in range(nk):
                if _nan_or_greater(srow[c], m_tile):
                    m_tile = srow[c]
            m_new = m_tile if _nan_or_greater(m_tile, m_i[r]) else m_i[r]
            if m_new == -INFINITY:
                continue  # nothing visible yet: exp(-inf - -inf) would be NaN
            alpha = _exp(m_i[r] - m_new)  # exp(-inf) = 0 when the row was empty
            if alpha != 1:
                l_i[r] = l_i[r] * alpha
                for e in range(d_v):
                    arow[e] = arow[e] * alpha
            for c in range(nk):
                p = _exp(srow[c] - m_new)  # masked scores: exp(-inf) = 0
                l_i[r] = l_i[r] + p
                vrow = v_blk + c * d_v
                for e in range(d_v):
                    arow[e] = arow[e] + p * vrow[e]
            m_i[r] = m_new

    # out = acc / l; a row that saw no key (l == 0) is 0, not 0/0
    for r in range(nq):
        orow = (<floating*>a.out) + (b * a.n_q + i0 + r) * d_v
        arow = acc + r * d_v
        if l_i[r] == 0:
            for e in range(d_v):
                orow[e] = 0
        else:
            inv = 1 / l_i[r]
            for e in range(d_v):
                orow[e] = arow[e] * inv

    # Optional weights: a second pass recomputes each score tile and writes
    # exp(score - m_i) / l_i, with zeros for invisible keys and empty rows.
    if a.weights == NULL:
        return OK
    j0 = -BLOCK_K
    while j0 + BLOCK_K < a.n_k:
        j0 = j0 + BLOCK_K
        nk = a.n_k - j0 if a.n_k - j0 < BLOCK_K else BLOCK_K
        if j0 < j_end:
            rc = _score_tile(a, b, i0, nq, j0, nk, q_blk, kT, s)
            if rc != OK:
                return rc
        for r in range(nq):
            wrow = (<floating*>a.weights) + (b * a.n_q + i0 + r) * a.n_k + j0
            srow = s + r * BLOCK_K
            if j0 >= j_end or l_i[r] == 0:
                for c in range(nk):
                    wrow[c] = 0
            else:
                inv = 1 / l_i[r]
                for c in range(nk):
                    wrow[c] = _exp(srow[c] - m_i[r]) * inv
    return OK


cdef int _attention_run(const AttentionArgs* a, floating* out, int num_threads) noexcept nogil:
    cdef int64_t n_blocks = (a.n_q + BLOCK_Q - 1) // BLOCK_Q
    cdef int64_t n_items = a.n_batch * n_blocks
    cdef int64_t it, b, blk, i0, i1
    cdef int status = OK
    cdef floating* scratch
    cdef size_t nbytes = <size_t>_scratch_size(a.d_k, a.d_v) * sizeof(floating)
    with parallel(num_threads=num_threads):
        scratch = <floating*>malloc(nbytes)
        # dynamic schedule: causal blocks differ in cost; under causal the
        # longest blocks (last rows) are handed out first.
        for it in prange(n_items, schedule="dynamic"):
            if scratch == NULL:
                status |= ERR_NOMEM  # OR-reduction of status bits
            else:
                b = it // n_blocks
                blk = it % n_blocks
                if a.causal:
                    blk = n_blocks - 1 - blk
                i0 = blk * BLOCK_Q
                i1 = i0 + BLOCK_Q if i0 + BLOCK_Q < a.n_q else a.n_q
                status |= _attend_block(a, b, i0, i1, scratch)
        free(scratch)
    return status


# --------------------------------------------------------------------------
# Python-facing wrappers (validated inputs only: see attn/_dispatch.py)

cdef Strided _strided(object arr, const int64_t[::1] offsets, int64_t s_row, int64_t s_col):
    cdef Strided st
    cdef cnp.ndarray a = arr
    st.base = <const char*>cnp.PyArray_DATA(a)
    st.offsets = &offsets[0] if offsets.shape[0] > 0 else NULL
    st.s_row = s_row
    st.s_col = s_col
    lo, hi = np.lib.array_utils.byte_bounds(a)
    st.lo = <const char*><size_t>lo
    st.hi = <const char*><size_t>hi
    return st


cdef _raise(int status, str where):
    if status & ERR_NOMEM:
        raise MemoryError(f"{where}: could not allocate per-thread scratch")
    if status & ERR_BOUNDS:
        raise IndexError(f"{where}: debug build caught an out-of-bounds access (kernel bug)")


def attention(q, k, v, mask, out, weights,
              const int64_t[::1] q_off, const int64_t[::1] k_off,
              const int64_t[::1] v_off, const int64_t[::1] m_off,
              tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
              bint causal, int64_t causal_offset, double scale, int num_threads):
    """Fused attention over n_batch matrices; writes ``out`` (and ``weights``).

    Parameters
    ----------
    q, k, v : ndarray of float32 or float64 (any strides)
        The operand arrays; matrix b of q starts ``q_off[b]`` elements after
        q's data pointer and has element strides ``q_strides`` (row, column).
    mask : ndarray of bool or of q's dtype, or None
    out : ndarray, C-contiguous [n_batch, n_q, d_v], q's dtype
    weights : ndarray, C-contiguous [n_batch, n_q, n_k], q's dtype, or None
    causal, causal_offset : key j is visible to row i iff j <= i + causal_offset
    scale : float multiplying q . k
    num_threads : int >= 1
    """
    cdef AttentionArgs a
    cdef int status
    cdef cnp.ndarray o = out
    a.q = _strided(q, q_off, q_strides[0], q_strides[1])
    a.k = _strided(k, k_off, k_strides[0], k_strides[1])
    a.v = _strided(v, v_off, v_strides[0], v_strides[1])
    if mask is None:
        a.mask_kind = MASK_NONE
        a.mask.base = NULL
    else:
        a.mask_kind = MASK_BOOL if mask.dtype == np.bool_ else MASK_ADD
        a.mask = _strided(mask, m_off, m_strides[0], m_strides[1])
    a.out = <char*>cnp.PyArray_DATA(o)
    a.weights = NULL if weights is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>weights)
    a.n_batch = o.shape[0]
    a.n_q = o.shape[1]
    a.d_v = o.shape[2]
    a.n_k = k.shape[k.ndim - 2]
    a.d_k = q.shape[q.ndim - 1]
    a.causal = causal
    a.causal_offset = causal_offset
    a.scale = scale
    if out.dtype == np.float32:
        with nogil:
            status = _attention_run(&a, <float*>a.out, num_threads)
    else:
        with nogil:
            status = _attention_run(&a, <double*>a.out, num_threads)
    _raise(status, "attention")


def masked_softmax(x, mask, out, const int64_t[::1] x_off, const int64_t[::1] m_off,
                   int64_t x_stride, int64_t m_stride, int num_threads):
    """Softmax of each row of ``x`` (masked) into C-contiguous ``out`` [n_rows, n]."""
    cdef SoftmaxArgs a
    cdef int status
    cdef cnp.ndarray o = out
    a.x = _strided(x, x_off, 0, x_stride)
    if mask is None:
        a.mask_kind = MASK_NONE
        a.mask.base = NULL
    else:
        a.mask_kind = MASK_BOOL if mask.dtype == np.bool_ else MASK_ADD
        a.mask = _strided(mask, m_off, 0, m_stride)
    a.out = <char*>cnp.PyArray_DATA(o)
    a.n_rows = o.shape[0]
    a.n = o.shape[1]
    if out.dtype == np.float32:
        with nogil:
            status = _softmax_run(&a, <float*>a.out, num_threads)
    else:
        with nogil:
            status = _softmax_run(&a, <double*>a.out, num_threads)
    _raise(status, "masked_softmax")


def build_info():
    """What this build of the kernels has: OpenMP, its thread count, debug checks."""
    return {
        "openmp": bool(ATTN_HAVE_OPENMP),
        "max_threads": attn_omp_max_threads(),
        "debug": bool(ATTN_DEBUG_ENABLED),
        "simd": "generic",
    }
