# One pool of threads for attn and NumPy's OpenBLAS: the C side
# (attn/_src/attn_blas_pool.h); attn/_blas_pool.py finds the libraries.

from libc.stdint cimport int64_t, uintptr_t


cdef extern from "attn_blas_pool.h" nogil:
    ctypedef void (*attn_blas_set_callback)(void* callback)
    int attn_blas_pool_install(attn_blas_set_callback setter)
    void attn_blas_pool_uninstall(attn_blas_set_callback setter)
    int64_t attn_blas_pool_calls
    int64_t attn_blas_pool_extra_jobs


def install(uintptr_t setter):
    """Register attn's team as the threads of the OpenBLAS whose
    ``openblas_set_threads_callback_function`` is at address ``setter``; False if not."""
    if setter == 0:
        return False
    return attn_blas_pool_install(<attn_blas_set_callback>setter) == 0


def uninstall(uintptr_t setter):
    """Give that OpenBLAS its own threads back."""
    if setter != 0:
        attn_blas_pool_uninstall(<attn_blas_set_callback>setter)


def counters():
    """(OpenBLAS calls run through attn's callback, jobs that got a thread of their own)."""
    return attn_blas_pool_calls, attn_blas_pool_extra_jobs
