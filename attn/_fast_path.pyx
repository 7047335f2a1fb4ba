# The per-call fast paths: scaled_dot_product_attention's common call (sdpa_fast)
# and attn.flash.flash_attn_func's (flash_dense_fast) recognized in compiled
# code and fed to the one builder (attn._problem.build), then run
# (attn._kernels.run_attention), with no Python validation layer in between.
# (Right after a kernel call the caches are cold, and a Python layer's tens of
# microseconds take two to three times as long: flash_attn_func at T = 256 ran
# 1.39 times SDPA's time on the same memory, its kernel time equal.)
#
# It owns no rule of its own: the element kind is attn._problem.element_kind's,
# the batch, GQA group, causal offset, scale and thread count come from
# attn._validation.decide_shapes_and_options (bound once by attn._api, so this
# compiled layer imports nothing above it; it raises the validation's errors),
# the operand offsets from attn._problem.fill_offsets. What it checks is only
# whether a call is the common one; for any other call it returns None and
# the caller runs the full validation, whose results it matches bit for bit
# (tests/test_fast_path_layouts.py).

from libc.stdint cimport int64_t
from libc.string cimport memset

cimport numpy as cnp
import numpy as np

from attn._attn_kernel cimport *  # the structs and kinds shared with C
from attn._kernels cimport run_attention
from attn._problem import empty_out
from attn._problem cimport build, element_kind, fill_offsets, is_bfloat16, mask_kind, operand

from attn._casts import cast_bf16

cnp.import_array()

cdef object _decide = None   # attn._validation.decide_shapes_and_options (bind_validation)
cdef object _Q8Tensor = None # attn._quantized.Q8Tensor (bind_validation)


def bind_validation(decide, q8_tensor):
    """Give the fast path the validation's decisions and the int8 cache's type: the Python layer
    above hands them down once (attn._api, through attn._backends.fused.bind_fast_path), so this
    compiled layer imports nothing from the layers above it. Until then sdpa_fast declines every
    call."""
    global _decide, _Q8Tensor
    _decide, _Q8Tensor = decide, q8_tensor


cdef bint _in_place(cnp.ndarray a):
    """Whether the kernel reads ``a`` as it is: native byte order, aligned, every stride a whole
    number of elements (the kernels count strides and offsets in elements; attn._operands copies
    an operand that is not)."""
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(a)
    cdef int d
    if not (cnp.PyArray_ISNOTSWAPPED(a) and cnp.PyArray_ISALIGNED(a)):
        return False
    for d in range(a.ndim):
        if cnp.PyArray_STRIDES(a)[d] % isz != 0:
            return False
    return True


cdef attn_operand _matrices(cnp.ndarray x, const int64_t* offsets):
    """``x``'s descriptor: its matrices [..., rows, cols] at ``offsets``, its own strides."""
    cdef int64_t isz = cnp.PyArray_ITEMSIZE(x)
    cdef int nd = x.ndim
    return operand(x, offsets, cnp.PyArray_STRIDES(x)[nd - 2] // isz, cnp.PyArray_STRIDES(x)[nd - 1] // isz)


cdef int _padding_mask(cnp.ndarray m, int kind, const cnp.npy_intp* batch, int nb, int64_t n_k,
                       int64_t* offs, attn_operand* r):
    """A padding mask broadcast over the query rows (shape [..., 1, S] or [S]; bool, or
    float of the compute dtype; read in place; leading dims 1 or the batch's) as the
    kernel's operand (per-matrix offsets into ``offs``): its mask kind, or -1 for any
    other mask (the caller then validates in Python). A mask with one row is never the
    inverted causal pattern the validation warns about."""
    cdef int t = cnp.PyArray_TYPE(m), md = m.ndim, lead, d, mk = mask_kind(m)
    cdef cnp.npy_intp* sh = cnp.PyArray_DIMS(m)
    if mk == ATTN_MASK_ADD and not ((t == cnp.NPY_FLOAT32 and kind != ATTN_F64)
                                    or (t == cnp.NPY_FLOAT64 and kind == ATTN_F64)):
        return -1                         # a float mask not in the compute dtype (an int mask too)
    if not _in_place(m):
        return -1
    if md < 1 or sh[md - 1] != n_k or (md >= 2 and sh[md - 2] != 1):
        return -1
    lead = md - 2 if md >= 2 else 0
    if lead > nb:
        return -1
    for d in range(lead):                 # right-aligned with the batch dims
        if sh[d] != 1 and sh[d] != batch[nb - lead + d]:
            return -1
    fill_offsets(m, batch, nb, 2 if md >= 2 else 1, 1, offs)
    r[0] = operand(m, offs, 0, cnp.PyArray_STRIDES(m)[md - 1] // cnp.PyArray_ITEMSIZE(m))  # row stride 0: one row
    return mk


def sdpa_fast(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
              return_weights, num_threads, int64_t check_memory_above):
    """scaled_dot_product_attention's common case straight to the kernel, or None.

    The common case: ndarrays (or an int8 cache: key and value attn.Q8Tensor)
    of a kind the kernel reads in place (attn._problem.element_kind), native
    and aligned, strides in whole elements, without dropout or weights, no
    mask or a padding mask broadcast over the query rows (see _padding_mask),
    the same batch dims (GQA: query heads a multiple of key/value heads at
    dim -3), nothing empty, the output below the memory check's size. Anything else
    returns None: the caller then runs the full validation.
    """
    cdef cnp.ndarray q, k, v, o, off
    cdef int kind, nb, d, mk = ATTN_MASK_NONE
    cdef int64_t n_batch = 1, n_q, n_k, d_k, d_v
    cdef cnp.npy_intp dims[64]
    cdef int64_t* offs
    cdef attn_operand m_op
    cdef attn_problem a
    if type(query) is not np.ndarray or _decide is None:
        return None
    if return_weights is not False or not (type(backend) is str and (backend == "auto" or backend == "cython")):
        return None
    if not ((type(dropout_p) is float or type(dropout_p) is int) and dropout_p == 0):
        return None
    q = query
    if type(key) is np.ndarray and type(value) is np.ndarray:
        k, v = key, value
    elif type(key) is _Q8Tensor and type(value) is _Q8Tensor:
        k, v = key.data.view(np.int8), value.data.view(np.int8)  # q8_0 rows [..., S, row bytes], in place
    else:
        return None
    kind = element_kind(cnp.PyArray_TYPE(q), cnp.PyArray_TYPE(k), cnp.PyArray_TYPE(v))
    if kind < 0 or not (_in_place(q) and _in_place(k) and _in_place(v)):
        return None
    if kind == ATTN_F32_KVE4M3 or kind == ATTN_F32_KVE5M2:
        return None   # float8 is a cache's storage (attn.flash, with its descales): the checks refuse it here
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        return None
    for d in range(q.ndim - 2):           # the same batch dims, but for GQA's heads
        if k.shape[d] != v.shape[d] or (q.shape[d] != k.shape[d] and not (enable_gqa is True and d == q.ndim - 3)):
            return None
    n_q, n_k, d_k = q.shape[q.ndim - 2], k.shape[k.ndim - 2], q.shape[q.ndim - 1]
    if kind == ATTN_F32_KVQ8:
        if key.dim != d_k:
            return None
        d_v = value.dim
    elif k.shape[k.ndim - 1] != d_k:
        return None
    else:
        d_v = v.shape[v.ndim - 1]
    if v.shape[v.ndim - 2] != n_k:
        return None
    if attn_mask is not None and not (type(attn_mask) is np.ndarray and (is_causal is None or is_causal is False)):
        return None                      # (with is_causal: the validation's error)
    batch, group, causal_offset, sc, threads = _decide(q, key, value, is_causal, scale, enable_gqa, num_threads)
    nb = len(batch)
    if nb > 64:
        return None
    for d in range(nb):
        dims[d] = batch[d]
        n_batch *= dims[d]
    if n_batch == 0 or n_q == 0 or n_k == 0 or d_k == 0 or d_v == 0:
        return None
    if <double>n_batch * n_q * d_v * 8 >= <double>check_memory_above:  # large: checked in Python
        return None
    off = np.empty(4 * n_batch, np.int64)   # q's, k's, v's and the mask's offsets
    offs = <int64_t*>cnp.PyArray_DATA(off)
    memset(&m_op, 0, sizeof(m_op))
    if attn_mask is not None:
        mk = _padding_mask(attn_mask, kind, dims, nb, n_k, offs + 3 * n_batch, &m_op)
        if mk < 0:
            return None
    if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT16 or is_bfloat16(cnp.PyArray_TYPE(q)):
        for d in range(q.ndim):
            if cnp.PyArray_STRIDES(q)[d] == 0:
                return None              # broadcast: converted without expanding in Python
        # a 16-bit query is computed in float32 (element_kind). Over a key and value of its
        # own dtype the kernel reads it as it is (attn_problem.q_raw16: widened exactly where
        # it is loaded); over int8 ones, a C-ordered float32 copy (astype keeps the input's
        # memory order, and an overlapping view's copy is not one)
        if kind == ATTN_F32_KVQ8:
            if is_bfloat16(cnp.PyArray_TYPE(q)) and cnp.PyArray_IS_C_CONTIGUOUS(q):
                q = cast_bf16(query, np.float32, threads)
            else:
                q = np.ascontiguousarray(q, dtype=np.float32)
    q_bf16 = is_bfloat16(cnp.PyArray_TYPE(query))
    out16 = q_bf16 or cnp.PyArray_TYPE(query) == cnp.NPY_FLOAT16   # a 16-bit out, rounded as written
    o = empty_out(batch + (n_q, d_v), query.dtype if out16 else np.float64 if kind == ATTN_F64 else np.float32)
    fill_offsets(q, dims, nb, 2, 1, offs)
    fill_offsets(k, dims, nb, 2, group, offs + n_batch)
    fill_offsets(v, dims, nb, 2, group, offs + 2 * n_batch)
    build(&a, q, k, v, attn_mask if mk != ATTN_MASK_NONE else None,
          _matrices(q, offs), _matrices(k, offs + n_batch), _matrices(v, offs + 2 * n_batch), m_op,
          o, None, None, n_batch, n_q, n_k, d_k, d_v, causal_offset, sc, None, False, None,
          q_bf16, None, 0, None, None)
    run_attention(&a, threads)
    return o   # (query's dtype: a 16-bit out is written as such)


def flash_dense_fast(query, key, value, bint causal, double scale, int threads, int64_t check_memory_above):
    """attn.flash.flash_attn_func's common call straight to the kernel's packed plan, or None.

    The common case: ndarrays q [B, L, H, E], k [B, S, H_kv, E], v [B, S, H_kv, Ev], all float32 or
    all float64, native and aligned, strides in whole elements, more than ATTN_SPLIT_MAX_Q query rows
    (fewer take the decode plan: attn._paged), H a multiple of H_kv, nothing empty, the output below
    the memory check's size; no dropout, variants or returned probabilities (the caller's test),
    ``scale`` and ``threads`` decided by the caller (attn.flash's checks). The problem is the one
    attn._backends.fused's cache_forward builds for such a call (matrix b H + h: batch row b, head
    h, a packed varlen table of equal lengths, the output written in place in [B, L, H, Ev], no
    lse), so the result is that path's, bit for bit (tests/test_flash.py). Anything else returns
    None: the caller then validates in Python.
    """
    cdef cnp.ndarray q, k, v, o, off, table
    cdef int kind
    cdef int64_t B, L, H, E, S, H_kv, E_v, N, g, b, h, n, isz
    cdef int64_t* offs
    cdef int64_t* t
    cdef cnp.npy_intp* qs
    cdef cnp.npy_intp* ks
    cdef cnp.npy_intp* vs
    cdef attn_operand m_op
    cdef attn_problem a
    if type(query) is not np.ndarray or type(key) is not np.ndarray or type(value) is not np.ndarray:
        return None
    q, k, v = query, key, value
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    kind = element_kind(cnp.PyArray_TYPE(q), cnp.PyArray_TYPE(k), cnp.PyArray_TYPE(v))
    if (kind != ATTN_F32 and kind != ATTN_F64) or not (_in_place(q) and _in_place(k) and _in_place(v)):
        return None
    B, L, H, E = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    S, H_kv, E_v = k.shape[1], k.shape[2], v.shape[3]
    if not (k.shape[0] == B and v.shape[0] == B and v.shape[1] == S and v.shape[2] == H_kv and k.shape[3] == E):
        return None
    if L <= ATTN_SPLIT_MAX_Q or B == 0 or H == 0 or H_kv == 0 or S == 0 or E == 0 or E_v == 0 or H % H_kv != 0:
        return None
    N, g = B * H, H // H_kv
    if <double>N * L * E_v * 8 >= <double>check_memory_above:  # large: checked in Python
        return None
    isz = cnp.PyArray_ITEMSIZE(q)
    qs, ks, vs = cnp.PyArray_STRIDES(q), cnp.PyArray_STRIDES(k), cnp.PyArray_STRIDES(v)
    off = np.empty(3 * N, np.int64)     # q's, k's and v's offsets
    table = np.empty(5 * N, np.int64)   # the varlen table [5, N] (attn_kernel.h): q_len, k_len, shift, out, lse
    offs, t = <int64_t*>cnp.PyArray_DATA(off), <int64_t*>cnp.PyArray_DATA(table)
    for b in range(B):
        for h in range(H):
            n = b * H + h
            offs[n] = (b * qs[0] + h * qs[2]) // isz
            offs[N + n] = (b * ks[0] + (h // g) * ks[2]) // isz
            offs[2 * N + n] = (b * vs[0] + (h // g) * vs[2]) // isz
            t[n], t[N + n], t[2 * N + n] = L, S, S - L
            t[3 * N + n] = (b * L * H + h) * E_v
            t[4 * N + n] = (b * H + h) * L
    o = empty_out((B, L, H, E_v), q.dtype)
    memset(&m_op, 0, sizeof(m_op))
    build(&a, q, k, v, None, operand(q, offs, qs[1] // isz, qs[3] // isz),
          operand(k, offs + N, ks[1] // isz, ks[3] // isz), operand(v, offs + 2 * N, vs[1] // isz, vs[3] // isz),
          m_op, o, None, None, N, L, S, E, E_v, 0 if causal else None, scale, None, False, None,
          False, table.reshape(5, N), H * E_v, None, None)
    run_attention(&a, threads)
    return o
