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
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "attn_omp.h" nogil:
    int attn_omp_max_threads()
    int ATTN_HAVE_OPENMP
    int ATTN_DEBUG_ENABLED

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
    char* lse        # C-contiguous [n_batch, n_q] or NULL: m_i + log(l_i)
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

cdef inline const char* _row(const Strided* a, int64_t b, int64_t i, size_t itemsize) noexcept nogil:
    return a.base + (a.offsets[b] + i * a.s_row) * <int64_t>itemsize


# --------------------------------------------------------------------------
# SIMD cores (attn/_src/attn_simd.h): register-tiled score and output tiles,
# a branch-free polynomial exp, one copy per instruction set chosen at import.

cdef extern from "attn_simd.h" nogil:
    ctypedef struct attn_mat_f32:
        const float* q
        ptrdiff_t q_rs, q_cs
        const float* k
        ptrdiff_t k_rs, k_cs
        const float* v
        ptrdiff_t v_rs, v_cs
        const void* mask
        ptrdiff_t m_rs, m_cs
        int mask_kind
        float* out
        ptrdiff_t o_rs
        ptrdiff_t n_q, n_k, d_k, d_v
        int causal
        ptrdiff_t causal_offset
        float scale
    ctypedef struct attn_mat_f64:
        const double* q
        ptrdiff_t q_rs, q_cs
        const double* k
        ptrdiff_t k_rs, k_cs
        const double* v
        ptrdiff_t v_rs, v_cs
        const void* mask
        ptrdiff_t m_rs, m_cs
        int mask_kind
        double* out
        ptrdiff_t o_rs
        ptrdiff_t n_q, n_k, d_k, d_v
        int causal
        ptrdiff_t causal_offset
        double scale
    enum:
        ATTN_BQ_F32
        ATTN_BQ_F64
    void attn_simd_init()
    const char* attn_simd_path()
    int attn_simd_available(const char** names, int n)
    int attn_simd_select(const char* name)
    ptrdiff_t attn_scratch_elems_f32(ptrdiff_t d_k, ptrdiff_t d_v)
    ptrdiff_t attn_scratch_elems_f64(ptrdiff_t d_k, ptrdiff_t d_v)
    void attn_rows_f32(const attn_mat_f32* a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0,
                       ptrdiff_t j1, float* scratch, float* part, float* w, ptrdiff_t w_rs,
                       float* lse)
    void attn_rows_f64(const attn_mat_f64* a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0,
                       ptrdiff_t j1, double* scratch, double* part, double* w, ptrdiff_t w_rs,
                       double* lse)
    void attn_merge_f32(const float* parts, ptrdiff_t n_chunks, ptrdiff_t nq, ptrdiff_t d_v,
                        float* out, ptrdiff_t o_rs, float* lse)
    void attn_merge_f64(const double* parts, ptrdiff_t n_chunks, ptrdiff_t nq, ptrdiff_t d_v,
                        double* out, ptrdiff_t o_rs, double* lse)
    void attn_softmax_row_f32(const float* x, ptrdiff_t xs, const void* mask, int kind,
                              ptrdiff_t ms, float* out, ptrdiff_t n)
    void attn_softmax_row_f64(const double* x, ptrdiff_t xs, const void* mask, int kind,
                              ptrdiff_t ms, double* out, ptrdiff_t n)

attn_simd_init()  # pick the instruction-set path once, before any kernel runs

cdef enum:
    # Decode: with at most SPLIT_MAX_Q query rows and at least 2 * SPLIT_CHUNK
    # keys, the keys are cut into fixed chunks (a function of n_k only, never
    # of the thread count) processed in parallel and merged in chunk order.
    SPLIT_MAX_Q = 16
    SPLIT_CHUNK = 512
    SPLIT_MAX_CHUNKS = 64
    # Smallest work worth another thread: ~1M multiply-adds (~10-20 us on
    # one core) for attention, 64K elements for the masked softmax.
    GRAIN_FMA = 1000000
    GRAIN_SOFTMAX = 65536


# --------------------------------------------------------------------------
# debug builds: every region a core will touch is checked against its array

cdef inline bint _addr_ok(const Strided* a, const char* p) noexcept nogil:
    return a.lo <= p < a.hi


cdef inline bint _region_ok(const Strided* a, int64_t b, int64_t r0, int64_t r1,
                            int64_t ncol, size_t itemsize) noexcept nogil:
    """Debug builds: the corners of rows [r0, r1) x columns [0, ncol) of
    matrix b lie inside the array (strides are affine, so corners bound it)."""
    cdef const char* first
    cdef int64_t sz = <int64_t>itemsize
    if not ATTN_DEBUG_ENABLED or r1 <= r0 or ncol <= 0:
        return True
    first = a.base + (a.offsets[b] + r0 * a.s_row) * sz
    return (_addr_ok(a, first) and _addr_ok(a, first + (ncol - 1) * a.s_col * sz)
            and _addr_ok(a, first + (r1 - 1 - r0) * a.s_row * sz)
            and _addr_ok(a, first + ((r1 - 1 - r0) * a.s_row + (ncol - 1) * a.s_col) * sz))


# --------------------------------------------------------------------------
# masked softmax: rows in parallel, each row vectorized in C

cdef int _softmax_run(const SoftmaxArgs* a, floating* out, int num_threads) noexcept nogil:
    cdef int64_t r
    cdef double work = <double>a.n_rows * a.n
    if work < <double>GRAIN_SOFTMAX * num_threads:   # see GRAIN_FMA
        num_threads = 1 if work < GRAIN_SOFTMAX else <int>(work / GRAIN_SOFTMAX)
    cdef int status = OK
    cdef size_t msize = sizeof(floating) if a.mask_kind == MASK_ADD else 1
    cdef const char* xrow
    cdef const char* mrow
    for r in prange(a.n_rows, num_threads=num_threads, schedule="static"):
        xrow = _row(&a.x, r, 0, sizeof(floating))
        mrow = NULL
        if not _region_ok(&a.x, r, 0, 1, a.n, sizeof(floating)):
            status |= ERR_BOUNDS  # OR-reduction of status bits
            continue
        if a.mask_kind != MASK_NONE:
            mrow = _row(&a.mask, r, 0, msize)
            if not _region_ok(&a.mask, r, 0, 1, a.n, msize):
                status |= ERR_BOUNDS
                continue
        if floating is float:
            attn_softmax_row_f32(<const float*>xrow, a.x.s_col, mrow, a.mask_kind,
                                 a.mask.s_col if mrow != NULL else 0, out + r * a.n, a.n)
        else:
            attn_softmax_row_f64(<const double*>xrow, a.x.s_col, mrow, a.mask_kind,
                                 a.mask.s_col if mrow != NULL else 0, out + r * a.n, a.n)
    return status


# --------------------------------------------------------------------------
# attention: one work item = one matrix b and a block of ATTN_BQ_F32/F64 query rows
# (or, when decoding, one matrix and one chunk of keys)

cdef inline int64_t _visible_end(const AttentionArgs* a, int64_t i) noexcept nogil:
    """One past the last key row i may see."""
    cdef int64_t end
    if not a.causal:
        return a.n_k
    end = i + a.causal_offset + 1
    return 0 if end < 0 else (a.n_k if end > a.n_k else end)


cdef int _item(const AttentionArgs* a, int64_t b, int64_t i0, int64_t nq, int64_t j0,
               int64_t j1, floating* scratch, floating* part) noexcept nogil:
    """Rows [i0, i0 + nq) of matrix b against keys [j0, j1): out (and weights)
    rows, or the partial (max, sum, acc) state of a key chunk into ``part``."""
    cdef attn_mat_f32 a32
    cdef attn_mat_f64 a64
    cdef int64_t jend = _visible_end(a, i0 + nq - 1)
    cdef size_t msize = sizeof(floating) if a.mask_kind == MASK_ADD else 1
    cdef floating* w = NULL
    cdef floating* o = (<floating*>a.out) + b * a.n_q * a.d_v
    cdef floating* lse = NULL
    if a.lse != NULL:
        lse = (<floating*>a.lse) + b * a.n_q
    if jend > j1:
        jend = j1
    if ATTN_DEBUG_ENABLED:
        if not (_region_ok(&a.q, b, i0, i0 + nq, a.d_k, sizeof(floating))
                and _region_ok(&a.k, b, j0, jend, a.d_k, sizeof(floating))
                and _region_ok(&a.v, b, j0, jend, a.d_v, sizeof(floating))):
            return ERR_BOUNDS
        if a.mask_kind != MASK_NONE and not _region_ok(&a.mask, b, i0, i0 + nq, a.n_k, msize):
            return ERR_BOUNDS
    if a.weights != NULL:
        w = (<floating*>a.weights) + b * a.n_q * a.n_k
    if floating is float:
        a32.q = <const float*>_row(&a.q, b, 0, sizeof(float))
        a32.q_rs = a.q.s_row
        a32.q_cs = a.q.s_col
        a32.k = <const float*>_row(&a.k, b, 0, sizeof(float))
        a32.k_rs = a.k.s_row
        a32.k_cs = a.k.s_col
        a32.v = <const float*>_row(&a.v, b, 0, sizeof(float))
        a32.v_rs = a.v.s_row
        a32.v_cs = a.v.s_col
        a32.mask_kind = a.mask_kind
        a32.mask = _row(&a.mask, b, 0, msize) if a.mask_kind != MASK_NONE else NULL
        a32.m_rs = a.mask.s_row if a.mask_kind != MASK_NONE else 0
        a32.m_cs = a.mask.s_col if a.mask_kind != MASK_NONE else 0
        a32.out = o
        a32.o_rs = a.d_v
        a32.n_q = a.n_q
        a32.n_k = a.n_k
        a32.d_k = a.d_k
        a32.d_v = a.d_v
        a32.causal = a.causal
        a32.causal_offset = a.causal_offset
        a32.scale = <float>a.scale
        attn_rows_f32(&a32, i0, nq, j0, j1, scratch, part, w, a.n_k, <float*>lse)
    else:
        a64.q = <const double*>_row(&a.q, b, 0, sizeof(double))
        a64.q_rs = a.q.s_row
        a64.q_cs = a.q.s_col
        a64.k = <const double*>_row(&a.k, b, 0, sizeof(double))
        a64.k_rs = a.k.s_row
        a64.k_cs = a.k.s_col
        a64.v = <const double*>_row(&a.v, b, 0, sizeof(double))
        a64.v_rs = a.v.s_row
        a64.v_cs = a.v.s_col
        a64.mask_kind = a.mask_kind
        a64.mask = _row(&a.mask, b, 0, msize) if a.mask_kind != MASK_NONE else NULL
        a64.m_rs = a.mask.s_row if a.mask_kind != MASK_NONE else 0
        a64.m_cs = a.mask.s_col if a.mask_kind != MASK_NONE else 0
        a64.out = o
        a64.o_rs = a.d_v
        a64.n_q = a.n_q
        a64.n_k = a.n_k
        a64.d_k = a.d_k
        a64.d_v = a.d_v
        a64.causal = a.causal
        a64.causal_offset = a.causal_offset
        a64.scale = a.scale
        attn_rows_f64(&a64, i0, nq, j0, j1, scratch, part, w, a.n_k, <double*>lse)
    return OK


cdef inline void* _scratch_alloc(size_t nbytes) noexcept nogil:
    # 64-byte aligned start; the cores use unaligned loads, this only avoids
    # split cache lines. Freed with free() of the pointer stored just before.
    cdef char* raw = <char*>malloc(nbytes + 64 + sizeof(void*))
    cdef size_t addr
    if raw == NULL:
        return NULL
    addr = (<size_t>(raw + sizeof(void*)) + 63) & ~(<size_t>63)
    (<void**>addr)[-1] = raw
    return <void*>addr


cdef inline void _scratch_free(void* p) noexcept nogil:
    if p != NULL:
        free((<void**>p)[-1])


cdef int _attention_run(const AttentionArgs* a, floating* out, int num_threads) noexcept nogil:
    cdef int64_t bq = ATTN_BQ_F32 if floating is float else ATTN_BQ_F64
    cdef int64_t n_blocks
    if a.causal:
        # A block crossing the diagonal computes its whole key range; smaller
        # blocks waste less (about bq / (2 n_q) of the causal work). A
        # function of the shape only, so results stay thread-count invariant.
        if a.n_q <= 256:
            bq = 32
        elif a.n_q <= 1024 and bq > 64:
            bq = 64
    # Few matrices (one head, short sequence): halve the blocks until there
    # are 8 items to share out, down to 32 rows (a function of the shape
    # only, like everything that decides how rows are split).
    while bq > 32 and a.n_batch * ((a.n_q + bq - 1) // bq) < 8:
        bq = bq // 2
    n_blocks = (a.n_q + bq - 1) // bq
    cdef int64_t n_items, it, b, blk, i0, nq, c, j0, j1
    cdef int64_t n_chunks = 1, chunk = a.n_k, pstride = 0
    cdef int status = OK
    cdef floating* scratch
    cdef floating* parts = NULL
    cdef size_t nscratch
    cdef double work = <double>a.n_batch * a.n_q * a.n_k * (a.d_k + a.d_v)
    if floating is float:
        nscratch = <size_t>attn_scratch_elems_f32(a.d_k, a.d_v)
    else:
        nscratch = <size_t>attn_scratch_elems_f64(a.d_k, a.d_v)
    # Grain: a thread for every GRAIN_FMA multiply-adds at most; waking a
    # thread costs more than a call this small (results do not depend on
    # the thread count).
    if work < <double>GRAIN_FMA * num_threads:
        num_threads = 1 if work < GRAIN_FMA else <int>(work / GRAIN_FMA)

    if a.weights == NULL and a.n_q <= SPLIT_MAX_Q and a.n_k >= 2 * SPLIT_CHUNK:
        # Decode: one row block, keys split into fixed chunks (set by n_k
        # alone, so the result does not depend on the thread count).
        n_chunks = (a.n_k + SPLIT_CHUNK - 1) // SPLIT_CHUNK
        if n_chunks > SPLIT_MAX_CHUNKS:
            n_chunks = SPLIT_MAX_CHUNKS
        chunk = (a.n_k + n_chunks - 1) // n_chunks
        pstride = 2 * a.n_q + a.n_q * a.d_v
        parts = <floating*>malloc(<size_t>(a.n_batch * n_chunks * pstride) * sizeof(floating))
        if parts == NULL:
            return ERR_NOMEM
        n_items = a.n_batch * n_chunks
    else:
        n_items = a.n_batch * n_blocks

    with parallel(num_threads=num_threads):
        scratch = <floating*>_scratch_alloc(nscratch * sizeof(floating))
        # dynamic schedule: causal blocks differ in cost
        for it in prange(n_items, schedule="dynamic"):
            if scratch == NULL:
                status |= ERR_NOMEM  # OR-reduction of status bits
            elif parts != NULL:
                b = it // n_chunks
                c = it % n_chunks
                j0 = c * chunk
                j1 = j0 + chunk if j0 + chunk < a.n_k else a.n_k
                status |= _item(a, b, 0, a.n_q, j0, j1, scratch, parts + it * pstride)
            else:
                # matrix-major: consecutive items share a matrix, so its keys
                # and values stay in cache between them; under causal a
                # matrix's longest blocks (last rows) go first and its short
                # ones fill in at the end
                b = it // n_blocks
                blk = n_blocks - 1 - it % n_blocks if a.causal else it % n_blocks
                i0 = blk * bq
                nq = a.n_q - i0 if a.n_q - i0 < bq else bq
                status |= _item(a, b, i0, nq, 0, a.n_k, scratch, <floating*>NULL)
        _scratch_free(scratch)
        # Decode: merge the chunks of each matrix in chunk order, in the same
        # parallel region (one fork/join per call; the loop above ends with a
        # barrier). After an allocation failure this merges garbage that is
        # never returned: the caller raises.
        if parts != NULL:
            for b in prange(a.n_batch, schedule="static"):
                if floating is float:
                    attn_merge_f32(parts + b * n_chunks * pstride, n_chunks, a.n_q, a.d_v,
                                   out + b * a.n_q * a.d_v, a.d_v,
                                   NULL if a.lse == NULL else (<float*>a.lse) + b * a.n_q)
                else:
                    attn_merge_f64(parts + b * n_chunks * pstride, n_chunks, a.n_q, a.d_v,
                                   out + b * a.n_q * a.d_v, a.d_v,
                                   NULL if a.lse == NULL else (<double*>a.lse) + b * a.n_q)

    if parts != NULL:
        free(parts)
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
    st.lo = st.hi = NULL
    if ATTN_DEBUG_ENABLED:  # extents only matter to the debug build's checks
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
              bint causal, int64_t causal_offset, double scale, int num_threads, lse=None):
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
    lse : ndarray, C-contiguous [n_batch, n_q], q's dtype, or None
        Receives the log-sum-exp of each row's visible scaled scores,
        m_i + log(l_i) (-inf for a row with no visible key; NaN where the
        row's output is NaN).
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
    a.lse = NULL if lse is None else <char*>cnp.PyArray_DATA(<cnp.ndarray>lse)
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


def simd_paths():
    """Instruction-set paths this CPU can run, widest (the default) first."""
    cdef const char* names[8]
    cdef int i, n = attn_simd_available(names, 8)
    return [names[i].decode("ascii") for i in range(n)]


def _select_simd(str name):
    """Switch the kernels to another available path (for tests); returns the
    previous one. Not thread-safe against kernels running concurrently."""
    previous = attn_simd_path().decode("ascii")
    if attn_simd_select(name.encode("ascii")) != 0:
        raise ValueError(f"SIMD path {name!r} not available; this CPU has {simd_paths()}")
    return previous


def build_info():
    """What this build of the kernels has: OpenMP, its thread count, debug checks."""
    return {
        "openmp": bool(ATTN_HAVE_OPENMP),
        "max_threads": attn_omp_max_threads(),
        "debug": bool(ATTN_DEBUG_ENABLED),
        "simd": attn_simd_path().decode("ascii"),
    }
