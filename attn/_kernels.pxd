# What attn._kernels exports to C-level callers (Cython cimports it; at
# import the caller takes the function from attn._kernels' __pyx_capi__).

cdef int simd_path_id() noexcept nogil
