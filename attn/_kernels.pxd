# What attn._kernels exports to C-level callers (Cython cimports it; at
# import the caller takes the functions from attn._kernels' __pyx_capi__).

from libc.stdint cimport int64_t

from attn._attn_kernel cimport attn_operand

cdef int simd_path_id() noexcept nogil
cdef attn_operand operand(object arr, const int64_t* offsets, int64_t s_row, int64_t s_col)
cdef int mask_kind(object mask)
