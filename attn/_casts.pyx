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


def cast_bf16(cnp.ndarray x, dtype, int num_threads):
    """A new C-contiguous array of ``x``'s shape and ``dtype``: C-contiguous ``x``
    converted between float32 and bfloat16, either way (the callers,
    attn._dtypes.cast and attn._fast_path.sdpa_fast, check the kinds)."""
    cdef cnp.ndarray out = np.empty((<object>x).shape, dtype)
    cdef int64_t n = cnp.PyArray_SIZE(x)
    cdef int threads = attn_threads_for(<double>n, CAST_GRAIN, num_threads)
    cdef void* src = cnp.PyArray_DATA(x)
    cdef void* dst = cnp.PyArray_DATA(out)
    if cnp.PyArray_ITEMSIZE(x) == 4:
        with nogil:
            _narrow_bf16_run(<const uint32_t*>src, <uint16_t*>dst, n, threads)
    else:
        with nogil:
            _widen_bf16_run(<const uint16_t*>src, <uint32_t*>dst, n, threads)
    return out

