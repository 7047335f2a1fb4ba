/* Fused attention backward (FlashAttention-2) with run-time instruction-set dispatch.
 *
 * The template attn_backward_impl.h is compiled once per (instruction set,
 * dtype), in terms of the forward kernel's V_* vector operations
 * (attn_simd_ops.h), vector exp (attn_simd_exp.h), problem description
 * (attn_kernel.h) and path ids (attn_dispatch.h: avx512, avx2-fma,
 * generic). attn_bw_table(path, kind) returns a path's kernels for ATTN_F32
 * or ATTN_F64; the caller (attn/_kernels_backward.pyx) passes the forward
 * extension's current path, so both extensions run one choice.
 *
 * Work split (see attn_backward_impl.h): everything is cut into fixed query
 * blocks of ATTN_BW_BQ rows and key blocks of ATTN_BW_BK keys, independent of
 * the thread count, and every sum runs in a fixed order, so the gradients are
 * bitwise identical for any number of threads.
 */
#ifndef ATTN_BACKWARD_H
#define ATTN_BACKWARD_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "attn_dispatch.h"  /* ATTN_X86_DISPATCH, ATTN_GVEC, ATTN_INLINE, ATTN_PASTE, ATTN_PATH_* */
#include "attn_kernel.h"  /* attn_operand, attn_problem, ATTN_F32 / ATTN_F64, ATTN_MASK_*, ATTN_BW_BQ / BK */

/* ------------------------------------------------------------- layout
 * The only place that knows where the backward keeps things, in elements of
 * the kind's type. d_k and d_v are rounded up to whole vectors of the path
 * (vl elements, the table's vl) and zero padded: the products run over whole
 * vectors, so the sizes differ between paths through vl alone.
 *
 * Work, per matrix (nkb key blocks; every region starts 64-byte aligned):
 *   qp  [n_q][ep]          Q, rows contiguous
 *   kt  [nkb][d_k][BK]     K^T per key block (product 1's B)
 *   dop [n_q][evp]         dO
 *   dd  [n_q]              D = rowsum(dO o O)
 *   kp  [nkb * BK][ep]     K, rows contiguous (product 5's B)
 *   vt  [nkb][d_v][BK]     V^T per key block (product 2's B)
 *   dqa [n_q][ep]          dQ accumulator (unscaled)
 * The log-sum-exp pass uses qp and kt only.
 *
 * Scratch, per thread: P and dS tiles [BQ][BK], a mask row [BK], dK_j and
 * dV_j accumulators [BK][ep], [BK][evp]; the log-sum-exp pass: the score
 * tile at p, the mask row, the running max m and sum l [BQ]; a softcap's
 * derivative row dc [BK]. */
typedef struct {
    int64_t ep, evp, nkb;  /* d_k, d_v rounded up to vl; key blocks */
    int64_t qp, kt, dop, dd, kp, vt, dqa, work;   /* offsets; work: elements per matrix */
    int64_t p, ds, mrow, dka, dva, m, l, dc, scratch; /* offsets; scratch: elements per thread */
} attn_bw_layout;

static inline attn_bw_layout attn_bw_layout_of(int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v,
                                               int64_t vl)
{
#define ATTN_BW_RUP16(x) attn_round_up((x), 16)  /* 16 elements: a multiple of 64 bytes */
    attn_bw_layout w;
    w.ep = attn_round_up(d_k, vl);
    w.evp = attn_round_up(d_v, vl);
    w.nkb = (n_k + ATTN_BW_BK - 1) / ATTN_BW_BK;
    w.qp = 0;
    w.kt = w.qp + ATTN_BW_RUP16(n_q * w.ep);
    w.dop = w.kt + ATTN_BW_RUP16(w.nkb * d_k * ATTN_BW_BK);
    w.dd = w.dop + ATTN_BW_RUP16(n_q * w.evp);
    w.kp = w.dd + ATTN_BW_RUP16(n_q);
    w.vt = w.kp + ATTN_BW_RUP16(w.nkb * ATTN_BW_BK * w.ep);
    w.dqa = w.vt + ATTN_BW_RUP16(w.nkb * d_v * ATTN_BW_BK);
    w.work = w.dqa + ATTN_BW_RUP16(n_q * w.ep);
    w.p = 0;
    w.ds = w.p + ATTN_BW_BQ * ATTN_BW_BK;
    w.mrow = w.ds + ATTN_BW_BQ * ATTN_BW_BK;
    w.dka = w.mrow + ATTN_BW_BK;
    w.dva = w.dka + ATTN_BW_BK * w.ep;
    w.m = w.dva + ATTN_BW_BK * w.evp;
    w.l = w.m + ATTN_BW_BQ;
    w.dc = w.l + ATTN_BW_BQ;  /* a softcap's derivative, one row [BK] */
    /* 64 elements of slack; whole 64 bytes, so each thread's part stays aligned */
    w.scratch = ATTN_BW_RUP16(w.dc + ATTN_BW_BK + 64);
#undef ATTN_BW_RUP16
    return w;
}

/* One backward call over fw.n_batch matrices: the forward's problem (q, k, v,
 * mask operands, out and lse C-contiguous [n_batch, n_q, d_v] and [n_batch,
 * n_q], kind ATTN_F32 or ATTN_F64: every array of that one dtype, a bool
 * mask uint8) and the gradients. Outputs, C-contiguous: dq [n_batch, n_q,
 * d_k], dk [n_batch, n_k, d_k], dv [n_batch, n_k, d_v]; ds [n_batch, n_q,
 * n_k] (the float mask's gradient, zero-filled by the caller) or NULL.
 * work: n_batch * work_elems elements (attn_bw_layout's work), 64-byte
 * aligned, matrix b's part at b * work_elems (packed operands, dQ
 * accumulator). The log-sum-exp pass writes fw.lse and reads no v, out,
 * dout (fw.d_v = 0). */
typedef struct {
    attn_problem fw;
    const char *dout;
    char *dq, *dk, *dv, *ds;
    char *work;
    int64_t work_elems;
} attn_bw_problem;

/* The kernels of one (instruction set, dtype). scratch: per thread,
 * attn_bw_layout's scratch elements, 64-byte aligned. */
typedef struct {
    int vl;  /* elements per vector: the layout's rounding (attn_bw_layout_of) */
    /* pack matrix b's operands into its work */
    void (*pack)(const attn_bw_problem *p, int64_t b);
    /* all of matrix b on one thread */
    void (*matrix)(const attn_bw_problem *p, int64_t b, void *scratch);
    /* dK, dV of key block jb of matrix b */
    void (*kv_block)(const attn_bw_problem *p, int64_t b, int64_t jb, void *scratch);
    /* dQ of query block ib of matrix b */
    void (*q_block)(const attn_bw_problem *p, int64_t b, int64_t ib, void *scratch);
} attn_bw_kernels;

/* ---------------------------------------------------------------- instances
 * MR x NR: register tile of the matrix products (MR rows x NR vectors). */
#if ATTN_X86_DISPATCH
#define ATTN_TGT __attribute__((target("avx512f")))
#define MR 6
#define NR 4
#define ATTN_OPS_AVX512_F32
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, avx512_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX512_F32
#define ATTN_OPS_AVX512_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_PASTE(name, avx512_f64)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX512_F64
#undef MR
#undef NR
#undef ATTN_TGT

#define ATTN_TGT __attribute__((target("avx2,fma")))
#define MR 6
#define NR 2
#define ATTN_OPS_AVX2_F32
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, avx2_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_PASTE(name, avx2_f64)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX2_F64
#undef MR
#undef NR
#undef ATTN_TGT
#endif /* ATTN_X86_DISPATCH */

#define ATTN_TGT
#if ATTN_GVEC
#define MR 6
#define NR 2
#define ATTN_OPS_GVEC_F32
#else
#define MR 4
#define NR 4
#define ATTN_OPS_SCALAR_F32
#endif
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, generic_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_GVEC_F32
#undef ATTN_OPS_SCALAR_F32
#if ATTN_GVEC
#define ATTN_OPS_GVEC_F64
#else
#define ATTN_OPS_SCALAR_F64
#endif
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_PASTE(name, generic_f64)
#include "attn_backward_impl.h"
#undef ATTN_OPS_GVEC_F64
#undef ATTN_OPS_SCALAR_F64
#undef MR
#undef NR
#undef ATTN_TGT

/* The kernels of path ATTN_PATH_* (one the CPU runs) for kind ATTN_F32 or ATTN_F64. */
static const attn_bw_kernels *const attn_bw_tables[ATTN_N_PATHS][2] = {
    {&bw_table_generic_f32, &bw_table_generic_f64},
#if ATTN_X86_DISPATCH
    {&bw_table_avx2_f32, &bw_table_avx2_f64},
    {&bw_table_avx512_f32, &bw_table_avx512_f64},
    {&bw_table_avx512_f32, &bw_table_avx512_f64},  /* avx512-bf16: the backward is avx512's */
    {&bw_table_avx512_f32, &bw_table_avx512_f64},  /* avx512-amx: so is this one's */
#else
    {NULL, NULL}, {NULL, NULL}, {NULL, NULL}, {NULL, NULL},
#endif
};

static inline const attn_bw_kernels *attn_bw_table(int path, int kind) { return attn_bw_tables[path][kind]; }

#endif /* ATTN_BACKWARD_H */
