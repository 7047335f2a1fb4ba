# What attn._kernels exports to the other compiled modules (Cython cimports it;
# at import the caller takes the functions from attn._kernels' __pyx_capi__).

from attn._attn_kernel cimport attn_problem

cdef int simd_path_id() noexcept nogil
cdef int run_attention(const attn_problem* a, int num_threads) except -1
