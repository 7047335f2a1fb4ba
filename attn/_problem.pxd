# What attn._problem exports to the other compiled modules (they cimport it; at
# import they take the functions from attn._problem's __pyx_capi__): the one
# builder of the kernels' problem description and the pieces it is made of.

from libc.stdint cimport int64_t
cimport numpy as cnp

from attn._attn_kernel cimport attn_operand, attn_problem

cdef attn_operand operand(object arr, const int64_t* offsets, int64_t s_row, int64_t s_col)
cdef int element_kind(int tq, int tk, int tv)
cdef int mask_kind(object mask)
cdef bint is_bfloat16(int typenum)
cdef int float8_kind(int typenum)
cdef int fill_offsets(cnp.ndarray a, const cnp.npy_intp* batch, int nbatch, int n_inner, int64_t group,
                      int64_t* out) noexcept
cdef int build(attn_problem* a, object q, object k, object v, object mask,
               attn_operand q_op, attn_operand k_op, attn_operand v_op, attn_operand m_op,
               object out, object weights, object lse,
               int64_t n_batch, int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v,
               object causal_offset, double scale, object variants, bint with_sinks, list keep,
               bint q_bf16, object varlen, int64_t out_rs, object paged, object kv_len) except -1
