# bfloat16 <-> float32 and float16 <-> float32 of whole C-contiguous arrays, on
# attn's OpenMP threads (ml_dtypes' and numpy's astype run about 1 ns an
# element, as long as a small attention call itself). attn._dtypes.cast and the
# compiled fast path (attn._fast_path) call cast_bf16; the rounding is the
# kernel's own (attn_narrow_bf16, nearest even, as ml_dtypes and torch round).
# attn._dtypes.cast calls cast_f16 (F16C's conversions, attn_f16_array).

from libc.stdint cimport int64_t, uint16_t, uint32_t
from cython.parallel cimport prange

cimport numpy as cnp
import numpy as np

from attn._attn_kernel cimport attn_f16_array, attn_has_f16c, attn_narrow_bf16_array, attn_threads_for
from attn._kernels cimport fork_threads, run_parallel  # fork-safe parallel regions (attn_fork.h)

cnp.import_array()


cdef enum:
    CAST_CHUNK = 1 << 16   # elements per work item
    CAST_GRAIN = 1 << 19   # elements per thread, at least


cdef void _narrow_bf16_run(const uint32_t* x, uint16_t* y, int64_t n, int threads) noexcept nogil:
    """y = x rounded to bfloat16 (attn_narrow_bf16: the kernel's own rule for its
    bfloat16 out, nearest even as ml_dtypes and torch round)."""
    cdef int64_t c, lo
    for c in prange((n + CAST_CHUNK - 1) // CAST_CHUNK, num_threads=threads, schedule="static"):
        lo = c * CAST_CHUNK
        attn_narrow_bf16_array(<const float*>x + lo, y + lo, min(n - lo, <int64_t>CAST_CHUNK))


cdef void _widen_bf16_run(const uint16_t* x, uint32_t* y, int64_t n, int threads) noexcept nogil:
    """y = x as float32 (exact: a bfloat16 is the top half of a float32)."""
    cdef int64_t c, i, lo, hi
    for c in prange((n + CAST_CHUNK - 1) // CAST_CHUNK, num_threads=threads, schedule="static"):
        lo = c * CAST_CHUNK
        hi = min(n, lo + CAST_CHUNK)
        for i in range(lo, hi):
            y[i] = (<uint32_t>x[i]) << 16


cdef void _f16_run(const char* x, char* y, int64_t n, int threads, bint narrow) noexcept nogil:
    """y = x converted float32 -> float16 (narrow) or float16 -> float32 (attn_f16_array)."""
    cdef int64_t c, lo
    cdef int64_t sx = 4 if narrow else 2
    cdef int64_t sy = 2 if narrow else 4
    for c in prange((n + CAST_CHUNK - 1) // CAST_CHUNK, num_threads=threads, schedule="static"):
        lo = c * CAST_CHUNK
        attn_f16_array(x + lo * sx, y + lo * sy, min(n - lo, <int64_t>CAST_CHUNK), narrow)


cdef struct _CastCall:
    const void* src
    void* dst
    int64_t n
    int threads
    bint narrow
    bint half


cdef int _cast_job(void* arg) noexcept nogil:
    cdef _CastCall* c = <_CastCall*>arg
    if c.half:
        _f16_run(<const char*>c.src, <char*>c.dst, c.n, c.threads, c.narrow)
    elif c.narrow:
        _narrow_bf16_run(<const uint32_t*>c.src, <uint16_t*>c.dst, c.n, c.threads)
    else:
        _widen_bf16_run(<const uint16_t*>c.src, <uint32_t*>c.dst, c.n, c.threads)
    return 0


cdef cnp.ndarray _cast(cnp.ndarray x, dtype, int num_threads, bint half):
    """A new array of ``x``'s shape and ``dtype``: C-contiguous ``x`` converted on attn's threads,
    float32 <-> float16 (half) or float32 <-> bfloat16, the direction by x's itemsize."""
    cdef cnp.ndarray out = np.empty((<object>x).shape, dtype)
    cdef _CastCall c
    c.n = cnp.PyArray_SIZE(x)
    c.src, c.dst, c.narrow = cnp.PyArray_DATA(x), cnp.PyArray_DATA(out), cnp.PyArray_ITEMSIZE(x) == 4
    c.half = half
    with nogil:
        c.threads = fork_threads(attn_threads_for(<double>c.n, CAST_GRAIN, num_threads))
        run_parallel(_cast_job, &c, c.threads)
    return out


def cast_bf16(cnp.ndarray x, dtype, int num_threads):
    """A new C-contiguous array of ``x``'s shape and ``dtype``: C-contiguous ``x``
    converted between float32 and bfloat16, either way (the callers,
    attn._dtypes.cast and attn._fast_path.sdpa_fast, check the kinds)."""
    return _cast(x, dtype, num_threads, False)


def cast_f16(cnp.ndarray x, dtype, int num_threads):
    """A new C-contiguous array of ``x``'s shape and ``dtype``: C-contiguous ``x`` converted
    between float32 and float16, either way, by F16C's conversions (nearest even; NaN quiet,
    its sign kept); None when the CPU has no F16C (the caller, attn._dtypes.cast, checks the
    kinds and converts otherwise)."""
    if not attn_has_f16c():
        return None
    return _cast(x, dtype, num_threads, True)
