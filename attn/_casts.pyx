# bfloat16 <-> float32 of whole C-contiguous arrays, on attn's OpenMP threads
# (ml_dtypes' astype runs about 1 ns an element, as long as a small attention
# call itself). attn._dtypes.cast and the compiled fast path (attn._fast_path)
# call cast_bf16; the rounding is the kernel's own (attn_narrow_bf16, nearest
# even, as ml_dtypes and torch round).

from libc.stdint cimport int64_t, uint16_t, uint32_t
from cython.parallel cimport prange

cimport numpy as cnp
import numpy as np

from attn._attn_kernel cimport attn_narrow_bf16_array, attn_threads_for
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


cdef struct _CastCall:
    const void* src
    void* dst
    int64_t n
    int threads
    bint narrow


cdef int _cast_job(void* arg) noexcept nogil:
    cdef _CastCall* c = <_CastCall*>arg
    if c.narrow:
        _narrow_bf16_run(<const uint32_t*>c.src, <uint16_t*>c.dst, c.n, c.threads)
    else:
        _widen_bf16_run(<const uint16_t*>c.src, <uint32_t*>c.dst, c.n, c.threads)
    return 0


def cast_bf16(cnp.ndarray x, dtype, int num_threads):
    """A new C-contiguous array of ``x``'s shape and ``dtype``: C-contiguous ``x``
    converted between float32 and bfloat16, either way (the callers,
    attn._dtypes.cast and attn._fast_path.sdpa_fast, check the kinds)."""
    cdef cnp.ndarray out = np.empty((<object>x).shape, dtype)
    cdef _CastCall c
    c.n = cnp.PyArray_SIZE(x)
    c.src, c.dst, c.narrow = cnp.PyArray_DATA(x), cnp.PyArray_DATA(out), cnp.PyArray_ITEMSIZE(x) == 4
    with nogil:
        c.threads = fork_threads(attn_threads_for(<double>c.n, CAST_GRAIN, num_threads))
        run_parallel(_cast_job, &c, c.threads)
    return out
