# Fused attention backward (FlashAttention-2) and the forward's log-sum-exp.
#
# A separate extension from attn._kernels (same build flags, see setup.py).
# Layering as there: attn/_validation.py validates and attn/_backends/fused.py computes every operand's
# per-matrix element offsets; the `def` functions only fill C structs, the
# `noexcept nogil` drivers never touch a Python object, and errors (allocation
# failure) come back as status codes raised after the nogil block. The
# numerical work is in attn/_src/attn_backward_impl.h.

from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t

cimport numpy as cnp
import numpy as np

from attn._attn_kernel cimport *  # what the compiled modules share with C (see that file)
from attn._kernels cimport fork_threads, run_parallel, simd_path_id, test_delay  # its SIMD path, fork-safe regions, the tests' hook
from attn._problem cimport build, operand  # the one problem builder (the forward part of the backward's)

cnp.import_array()

cdef extern from "attn_backward.h" nogil:
    ctypedef struct attn_bw_problem:
        attn_problem fw
        const char* dout
        char* dq
        char* dk
        char* dv
        char* ds
        char* work
        int64_t work_elems
    ctypedef struct attn_bw_layout:
        int64_t work      # elements per matrix
        int64_t scratch   # elements per thread (whole 64 bytes)
    attn_bw_layout attn_bw_layout_of(int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v, int64_t vl,
                                     int bf16)
    ctypedef struct attn_bw_kernels:
        int vl
        int bf16dot
        void (*pack)(const attn_bw_problem*, int64_t) noexcept nogil
        void (*matrix)(const attn_bw_problem*, int64_t, void*) noexcept nogil
        void (*kv_block)(const attn_bw_problem*, int64_t, int64_t, void*) noexcept nogil
        void (*q_block)(const attn_bw_problem*, int64_t, int64_t, void*) noexcept nogil
    const attn_bw_kernels* attn_bw_table(int path, int kind, int bf16)
    void* attn_bw_take(size_t nbytes)
    void attn_bw_give(void* p)


cdef int _run(attn_bw_problem* p, int num_threads, bint bf16) noexcept nogil:
    # Pack each matrix's operands into its part of the work area (parallel
    # over matrices), then either each thread takes whole matrices (at least
    # as many matrices as threads), or FlashAttention-2's two passes: (matrix,
    # key block) items for dK, dV, then (matrix, query block) items for dQ.
    #   Both run the same operations in the same order
    #   (attn_backward_impl.h): the result does not depend on the thread count.
    # The micro-kernels are those of the forward's instruction-set path
    # (attn._kernels chooses it and switches it) for the problem's kind; bf16
    # (a bfloat16 problem in float32): the path's bfloat16 products, if it has them.
    cdef const attn_bw_kernels* K = attn_bw_table(simd_path_id(), p.fw.kind, bf16)
    cdef int64_t N = p.fw.n_batch, b, it
    cdef int64_t nkb = (p.fw.n_k + ATTN_BW_BK - 1) // ATTN_BW_BK
    cdef int64_t nqb = (p.fw.n_q + ATTN_BW_BQ - 1) // ATTN_BW_BQ
    cdef size_t itemsize = attn_kind_size(p.fw.kind)
    cdef attn_bw_layout lay = attn_bw_layout_of(p.fw.n_q, p.fw.n_k, p.fw.d_k, p.fw.d_v, K.vl,
                                                K.bf16dot)
    cdef size_t sn = lay.scratch
    cdef char* scratch = NULL
    cdef char* scratch_all
    cdef bint per_matrix
    # a thread for every ATTN_GRAIN_FMA multiply-adds at most (per score: the
    # five products' 3 d_k + 2 d_v)
    num_threads = attn_threads_for(<double>N * p.fw.n_q * p.fw.n_k * (3 * p.fw.d_k + 2 * p.fw.d_v),
                                   ATTN_GRAIN_FMA, num_threads)
    per_matrix = N >= num_threads
    p.work_elems = lay.work
    # one block: the matrices' work, then each thread's scratch (both whole 64 bytes)
    p.work = <char*>attn_bw_take((N * p.work_elems + num_threads * sn) * itemsize)
    if p.work == NULL:
        return ERR_NOMEM
    scratch_all = p.work + N * p.work_elems * itemsize
    with parallel(num_threads=num_threads):
        scratch = scratch_all + threadid() * sn * itemsize
        for b in prange(N, schedule="static"):
            test_delay()       # (the tests' hook: none outside them)
            K.pack(p, b)
        attn_omp_barrier()     # (every matrix packed before its blocks read it)
        if per_matrix:
            for b in prange(N, schedule="dynamic"):
                K.matrix(p, b, scratch)
        else:
            for it in prange(N * nkb, schedule="dynamic"):
                K.kv_block(p, it // nkb, it % nkb, scratch)
            for it in prange(N * nqb, schedule="dynamic"):
                # last query blocks (the longest under causal) first
                K.q_block(p, it // nqb, nqb - 1 - it % nqb, scratch)
    attn_bw_give(p.work)
    p.work = NULL
    return OK


cdef struct _BackwardCall:
    attn_bw_problem* p
    int threads
    bint bf16


cdef int _backward_job(void* arg) noexcept nogil:
    cdef _BackwardCall* c = <_BackwardCall*>arg
    return _run(c.p, c.threads, c.bf16)


# --------------------------------------------------------------------------
# Python-facing wrappers (validated inputs only: see attn/_backends/fused.py)

cdef attn_operand _operand(object arr, const int64_t[::1] offsets, tuple strides, int64_t n_batch,
                           const int64_t* rows):
    """``arr``'s attn_operand. rows: a packed batch's rows per matrix (the varlen table's n_q or
    n_k, attn_kernel.h), or NULL: each matrix has the array's rows (dim -2)."""
    cdef attn_operand o = operand(arr, offsets_data(offsets), strides[0], strides[1])
    cdef cnp.ndarray a
    cdef int64_t b
    if ATTN_DEBUG_ENABLED and arr is not None:  # every matrix inside the array's memory
        a = arr
        for b in range(n_batch):
            if not region_ok(&o, b, 0, a.shape[a.ndim - 2] if rows == NULL else rows[b],
                             a.shape[a.ndim - 1], a.itemsize):
                raise IndexError("attn._kernels_backward: debug build caught an "
                                 "out-of-bounds operand (kernel bug)")
    return o


cdef size_t data(object a):
    return 0 if a is None else <size_t>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef int _problem(attn_bw_problem* p, q, k, v, mask, out, dout, lse, dq, dk, dv, ds,
                  const int64_t[::1] q_off, const int64_t[::1] k_off,
                  const int64_t[::1] v_off, const int64_t[::1] m_off,
                  tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
                  causal_offset, double scale, variants, varlen, int64_t n_k, list keep) except -1:
    """The backward's problem: its forward part from attn._problem.build (as the forward's,
    but no sinks: the lse it reads includes them), then the gradients' pointers."""
    cdef attn_problem* f = &p.fw
    cdef int64_t n_batch = lse.shape[0]
    cdef const int64_t* q_rows = NULL   # the rows of each matrix of q, and of k and v,
    cdef const int64_t* kv_rows = NULL  # when they are not all alike (a packed batch's table)
    cdef const int64_t[:, ::1] table
    if varlen is not None:
        table = varlen
        q_rows, kv_rows = &table[0, 0], &table[1, 0]
    else:
        n_k = k.shape[k.ndim - 2]
    build(f, q, k, v, mask,
          _operand(q, q_off, q_strides, n_batch, q_rows),
          _operand(k, k_off, k_strides, n_batch, kv_rows),
          _operand(v, v_off, v_strides, n_batch, kv_rows),
          _operand(mask, m_off, m_strides, n_batch, NULL),
          out, None, lse, n_batch, lse.shape[1], n_k, q.shape[q.ndim - 1], v.shape[v.ndim - 1],
          causal_offset, scale, variants, False, keep, False, varlen, 0, None, None)
    if not (f.kind == ATTN_F32 or f.kind == ATTN_F64):
        raise TypeError(f"the backward computes in float32 or float64 (its caller widens K and V); "
                        f"got query {q.dtype}, key {k.dtype}, value {v.dtype}")
    p.dout = <const char*>data(dout)
    p.dq = <char*>data(dq)
    p.dk = <char*>data(dk)
    p.dv = <char*>data(dv)
    p.ds = <char*>data(ds)
    p.work = NULL
    p.work_elems = 0
    return 0


def backward(q, k, v, mask, out, dout, lse, dq, dk, dv, ds,
             const int64_t[::1] q_off, const int64_t[::1] k_off,
             const int64_t[::1] v_off, const int64_t[::1] m_off,
             tuple q_strides, tuple k_strides, tuple v_strides, tuple m_strides,
             causal_offset, double scale, int num_threads, variants=None,
             varlen=None, int64_t n_k=0, bint bf16=False):
    """Gradients of attention over n_batch matrices (FlashAttention-2).

    Parameters
    ----------
    q, k, v, mask : operands as for ``attn._kernels.attention`` (any strides:
        matrix b of q starts ``q_off[b]`` elements after its data pointer,
        element strides ``q_strides``); mask bool or of q's dtype, or None.
    out, dout : C-contiguous [n_batch, n_q, d_v], the forward's output and dLoss/dout
    lse : C-contiguous [n_batch, n_q], the forward's log-sum-exp
    dq, dk, dv : C-contiguous outputs [n_batch, n_q, d_k], [n_batch, n_k, d_k],
        [n_batch, n_k, d_v] (per query head: GQA groups are summed by the caller)
    ds : C-contiguous [n_batch, n_q, n_k], zero-filled, or None: receives dS
        (the float mask's gradient) where visible
    causal_offset, scale, num_threads, variants : as for the forward
        (with a softcap, ``ds`` receives dS o (1 - tanh^2), not the mask's gradient)
    varlen, n_k : a packed variable-length batch (attn_kernel.h; its out and lse
        offsets unused) and its largest n_k: matrix b reads its own n_q, n_k rows
        of the operands; out, dout, lse and the gradients keep the uniform
        layouts above (n_q the largest); rows past a matrix's own are not written
    bf16 : the float32 q, k, v and dout hold bfloat16 values (the caller's
        dtype): on avx512-bf16 and avx512-amx the five products then take
        them as bfloat16 and P, dS rounded to bfloat16 (vdpbf16ps), as torch's
        bfloat16 backward does; elsewhere (and for float64) no effect
    """
    cdef attn_bw_problem p
    cdef list keep = []     # arrays the problem points into, alive until the kernel returns
    cdef int status
    cdef _BackwardCall c
    _problem(&p, q, k, v, mask, out, dout, lse, dq, dk, dv, ds, q_off, k_off, v_off, m_off,
             q_strides, k_strides, v_strides, m_strides, causal_offset, scale, variants, varlen, n_k, keep)
    if ds is not None:
        ds.fill(0)
    if p.fw.n_batch == 0 or p.fw.n_q == 0 or p.fw.n_k == 0:
        dq.fill(0)
        dk.fill(0)
        dv.fill(0)
        return
    c.p, c.bf16 = &p, bf16
    with nogil:
        c.threads = fork_threads(num_threads)
        status = run_parallel(_backward_job, &c, c.threads)
    raise_status(status, "attention backward")
