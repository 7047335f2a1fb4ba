# What attn._kernels exports to the other compiled modules (Cython cimports it;
# at import the caller takes the functions from attn._kernels' __pyx_capi__): the SIMD
# path (attn._kernels_backward runs it), its switch (attn._kernels_testing, the tests'
# hook) and the forward's run (attn._fast_path).

from attn._attn_kernel cimport attn_problem

cdef int simd_path_id() noexcept nogil
cdef int select_simd(const char* name) noexcept nogil
cdef int run_attention(const attn_problem* a, int num_threads) except -1
