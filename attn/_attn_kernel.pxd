# The declarations the compiled modules (attn._problem, attn._kernels,
# attn._kernels_backward, attn._fast_path, attn._casts) share with C:
# the build's switches (attn/_src/attn_omp.h), and (attn/_src/attn_kernel.h)
# element kinds, mask kinds, the tuning knobs and the thread count they give,
# the aligned allocator, the operand descriptor and the forward problem (the
# backward's extends it); the status bits of the nogil cores and the debug
# build's bounds check.

from libc.stdint cimport int32_t, int64_t, uint16_t

cdef extern from "attn_omp.h" nogil:
    int attn_omp_max_threads()
    int attn_omp_thread_num()
    void attn_omp_barrier()  # every thread of the region waits (prange in parallel() has none)
    int ATTN_HAVE_OPENMP
    int ATTN_DEBUG_ENABLED

cdef extern from "attn_kernel.h" nogil:
    enum:
        ATTN_F32, ATTN_F64, ATTN_F32_KV16, ATTN_F32_KVBF16, ATTN_F32_KVQ8, ATTN_F32_KVE4M3,
        ATTN_F32_KVE5M2
        ATTN_MASK_NONE, ATTN_MASK_BOOL, ATTN_MASK_ADD
        # tuning knobs (their reasons are beside them in attn_kernel.h)
        ATTN_BQ, ATTN_BQ_MIN, ATTN_WINDOW_BLOCKS, ATTN_BK, ATTN_SPLIT_MAX_Q, ATTN_SPLIT_MIN_KEYS, ATTN_SPLIT_KEYS, ATTN_SPLIT_ITEMS,
        ATTN_SPLIT_MAX_CHUNKS, ATTN_SPAN_MAX, ATTN_GRAIN_FMA, ATTN_GRAIN_DECODE_BYTES, ATTN_GRAIN_DECODE_FMA, ATTN_GRAIN_SOFTMAX,
        ATTN_PACK_MAX_BYTES, ATTN_PACK_WIDE_MAX_BYTES, ATTN_STREAM_OUT_BYTES,
        ATTN_OUT_BF16, ATTN_OUT_F16   # attn_problem.out16
        ATTN_BW_BQ, ATTN_BW_BK
    size_t attn_kind_size(int kind)     # bytes of the compute type
    size_t attn_kind_kv_size(int kind)  # bytes of K, V as stored
    size_t attn_q8_row_bytes(int64_t d)  # bytes of a q8_0 row of d values (and its scales)
    int attn_threads_for(double work, double grain, int max_threads)
    void* attn_aligned_alloc(size_t nbytes)
    void attn_aligned_free(void* p)
    ctypedef struct attn_kept:
        pass
    void* attn_kept_take(attn_kept* k, size_t nbytes, size_t max)
    void attn_kept_give(attn_kept* k, void* p)
    attn_kept* attn_parts_kept()
    int64_t attn_take(int64_t* next)  # *next, then *next + 1 (atomic)
    size_t ATTN_PARTS_KEEP_MAX
    void attn_narrow_bf16(const float* x, uint16_t* y, int64_t n)  # round to bfloat16, nearest even
    void attn_narrow_bf16_array(const float* x, uint16_t* y, int64_t n)  # the same, for whole arrays
    void attn_narrow16(const float* x, uint16_t* y, int64_t n, int out16)  # to out16's type, nearest even
    int attn_f16_array(const void* x, void* y, int64_t n, int narrow)  # float16 <-> float32 by F16C (0: none)
    int attn_has_f16c()
    ctypedef struct attn_operand:
        const char* base
        const int64_t* offsets
        int64_t s_row, s_col
        const char* lo
        const char* hi
    ctypedef struct attn_problem:
        attn_operand q, k, v, mask
        char* out
        char* weights
        char* lse
        int64_t n_batch, n_q, n_k, d_k, d_v
        int kind, mask_kind, causal
        int64_t causal_offset
        double scale
        int window                  # the variants (attn_kernel.h)
        int64_t win_lo, win_hi
        double softcap
        const double* alibi
        int64_t alibi_offset
        const double* sinks         # [n_batch] or NULL: each row's sum gains exp(sink)
        const int64_t* varlen       # packed variable-length batches (attn_kernel.h)
        int64_t out_rs
        int q_bf16                  # q holds bfloat16 values (the avx512-bf16 path's products)
        int q_raw16                 # q stored as K and V's 16-bit type (bfloat16 with q_bf16, or float16)
        int out16                   # out holds 16-bit floats (ATTN_OUT_BF16, ATTN_OUT_F16), each row rounded once
        int out_stream              # out written by non-temporal stores (ATTN_STREAM_OUT_BYTES)
        const int32_t* pages        # a paged K/V: block table entries (attn_kernel.h), or NULL
        const int64_t* page_rows    # [n_batch]: where matrix b's row of the table starts
        int64_t page_size, k_page, v_page
        const int64_t* kv_len       # [n_batch] keys each matrix sees, or NULL (attn_kernel.h)


cdef inline const int64_t* offsets_data(const int64_t[::1] offsets) noexcept:
    """An operand's per-matrix offsets as attn_operand takes them (NULL when empty)."""
    return &offsets[0] if offsets.shape[0] > 0 else NULL


cdef enum:  # status bits the nogil cores return; raise_status raises them after the nogil block
    OK = 0
    ERR_NOMEM = 1
    ERR_BOUNDS = 2


cdef inline int raise_status(int status, str where) except -1:
    if status & ERR_NOMEM:
        raise MemoryError(f"{where}: could not allocate the kernel's working memory")
    if status & ERR_BOUNDS:
        raise IndexError(f"{where}: debug build caught an out-of-bounds access (kernel bug)")
    return 0


# debug builds: every region a kernel will touch is checked against its array

cdef inline bint addr_ok(const attn_operand* a, const char* p) noexcept nogil:
    return a.lo <= p < a.hi


cdef inline bint region_ok(const attn_operand* a, int64_t b, int64_t r0, int64_t r1,
                           int64_t ncol, size_t itemsize) noexcept nogil:
    """Debug builds: the corners of rows [r0, r1) x columns [0, ncol) of
    matrix b lie inside the array (strides are affine, so corners bound it).
    Always true in other builds."""
    cdef const char* first
    cdef int64_t sz = <int64_t>itemsize
    if not ATTN_DEBUG_ENABLED or r1 <= r0 or ncol <= 0:
        return True
    first = a.base + (a.offsets[b] + r0 * a.s_row) * sz
    return (addr_ok(a, first) and addr_ok(a, first + (ncol - 1) * a.s_col * sz)
            and addr_ok(a, first + (r1 - 1 - r0) * a.s_row * sz)
            and addr_ok(a, first + ((r1 - 1 - r0) * a.s_row + (ncol - 1) * a.s_col) * sz))
