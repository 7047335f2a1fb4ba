/* Fused attention backward (FlashAttention-2) with run-time instruction-set dispatch.
 *
 * The template attn_backward_impl.h is compiled once per (instruction set,
 * dtype), in terms of the forward kernel's V_* vector operations
 * (attn_simd_ops.h), vector exp (attn_simd_exp.h), problem description
 * (attn_kernel.h) and path ids (attn_dispatch.h: avx512, avx2-fma,
 * generic). attn_bw_table(path, kind, bf16) returns a path's kernels for
 * ATTN_F32 or ATTN_F64 (with bf16 on avx512-bf16 and avx512-amx: the
 * instance whose products take bfloat16 pairs); the caller
 * (attn/_kernels_backward.pyx) passes the forward extension's current path,
 * so both extensions run one choice.
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
 *   qp  [n_q][ep]          scale Q (the forward's rounding), rows contiguous
 *   kt  [nkb][d_k][BK]     K^T per key block (product 1's B)
 *   dop [n_q][evp]         dO
 *   dd  [n_q]              D = rowsum(dO o O)
 *   kp  [nkb * BK][ep]     K, rows contiguous (product 5's B)
 *   vt  [nkb][d_v][BK]     V^T per key block (product 2's B)
 *   dqa [n_q][ep]          dQ accumulator (unscaled)
 *
 * Scratch, per thread: P and dS tiles [BQ][BK], a mask row [BK], dK_j and
 * dV_j accumulators [BK][ep], [BK][evp]; a softcap's derivative row dc [BK].
 *
 * bfloat16 products (bf16 = 1, float32 kinds: the table's bf16dot): every
 * product's operands are bfloat16 pairs along its reduction index, one
 * 32-bit word (one float's slot) per pair, h(n) = ceil(n / 2) words:
 *   qp  [n_q][ep/2]        Q, pairs along e         (product 1's A)
 *   kt  [nkb][h(d_k)][BK]  K^T, pairs along e       (product 1's B)
 *   dop [n_q][evp/2]       dO, pairs along e        (product 2's A)
 *   kp  [nkb * BK/2][ep]   K, pairs of keys         (product 5's B)
 *   vt  [nkb][h(d_v)][BK]  V^T, pairs along e       (product 2's B)
 *   qpp [h(n_q)][ep]       Q, pairs of query rows   (product 4's B)
 *   dopp [h(n_q)][evp]     dO, pairs of query rows  (product 3's B)
 * dd and dqa stay float32; the scratch adds the tile rounded to pairs:
 * p2, ds2 [BQ/2][BK] (P, dS: pairs of rows, products 3 and 4's A^T) and dsb
 * [BQ][BK/2] (dS: pairs of keys, product 5's A). */
typedef struct {
    int64_t ep, evp, nkb;  /* d_k, d_v rounded up to vl; key blocks */
    int64_t dkw, dvw;      /* kt's, vt's rows per key block: d_k, d_v (bf16: h(d_k), h(d_v)) */
    int64_t qp, kt, dop, dd, kp, vt, dqa, qpp, dopp, work;  /* offsets; work: elements per matrix */
    int64_t p, ds, mrow, dka, dva, dc, p2, ds2, dsb, scratch;  /* offsets; scratch: per thread */
} attn_bw_layout;

static inline attn_bw_layout attn_bw_layout_of(int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v,
                                               int64_t vl, int bf16)
{
#define ATTN_BW_RUP16(x) attn_round_up((x), 16)  /* 16 elements: a multiple of 64 bytes */
    const int64_t half = bf16 ? 2 : 1;  /* elements per word of a product operand */
    attn_bw_layout w;
    w.dkw = (d_k + half - 1) / half;
    w.dvw = (d_v + half - 1) / half;
    w.ep = attn_round_up(d_k, vl);
    w.evp = attn_round_up(d_v, vl);
    w.nkb = (n_k + ATTN_BW_BK - 1) / ATTN_BW_BK;
    w.qp = 0;
    w.kt = w.qp + ATTN_BW_RUP16(n_q * w.ep / half);
    w.dop = w.kt + ATTN_BW_RUP16(w.nkb * w.dkw * ATTN_BW_BK);
    w.dd = w.dop + ATTN_BW_RUP16(n_q * w.evp / half);
    w.kp = w.dd + ATTN_BW_RUP16(n_q);
    w.vt = w.kp + ATTN_BW_RUP16(w.nkb * ATTN_BW_BK / half * w.ep);
    w.dqa = w.vt + ATTN_BW_RUP16(w.nkb * w.dvw * ATTN_BW_BK);
    w.qpp = w.dqa + ATTN_BW_RUP16(n_q * w.ep);
    w.dopp = w.qpp + (bf16 ? ATTN_BW_RUP16((n_q + 1) / 2 * w.ep) : 0);
    w.work = w.dopp + (bf16 ? ATTN_BW_RUP16((n_q + 1) / 2 * w.evp) : 0);
    w.p = 0;
    w.ds = w.p + ATTN_BW_BQ * ATTN_BW_BK;
    w.mrow = w.ds + ATTN_BW_BQ * ATTN_BW_BK;
    w.dka = w.mrow + ATTN_BW_BK;
    w.dva = w.dka + ATTN_BW_BK * w.ep;
    w.dc = w.dva + ATTN_BW_BK * w.evp;  /* a softcap's derivative, one row [BK] */
    w.p2 = w.dc + ATTN_BW_RUP16(ATTN_BW_BK);
    w.ds2 = w.p2 + (bf16 ? ATTN_BW_BQ / 2 * ATTN_BW_BK : 0);
    w.dsb = w.ds2 + (bf16 ? ATTN_BW_BQ / 2 * ATTN_BW_BK : 0);
    /* 64 elements of slack; whole 64 bytes, so each thread's part stays aligned */
    w.scratch = ATTN_BW_RUP16(w.dsb + (bf16 ? ATTN_BW_BQ * ATTN_BW_BK / 2 : 0) + 64);
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
 * accumulator). */
typedef struct {
    attn_problem fw;
    const char *dout;
    char *dq, *dk, *dv, *ds;
    char *work;
    int64_t work_elems;
} attn_bw_problem;

/* ------------------------------------------------------------ work area
 * One backward's work and scratch (attn_bw_layout), kept for the next call
 * (attn_kept in attn_kernel.h): a training loop asks for the same size every
 * step, and a fresh block of that size faulted in page by page was a third of
 * a T=1024 H=8 bfloat16 backward on a virtual machine. */
#define ATTN_BW_KEEP_MAX ((size_t)64 << 20)
static attn_kept attn_bw_kept;

static inline void *attn_bw_take(size_t nbytes) { return attn_kept_take(&attn_bw_kept, nbytes, ATTN_BW_KEEP_MAX); }
static inline void attn_bw_give(void *p) { attn_kept_give(&attn_bw_kept, p); }

/* The kernels of one (instruction set, dtype). scratch: per thread,
 * attn_bw_layout's scratch elements, 64-byte aligned. */
typedef struct {
    int vl;  /* elements per vector: the layout's rounding (attn_bw_layout_of) */
    int bf16dot;  /* the products take bfloat16 pairs (the layout's bf16) */
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
/* avx512-bf16 (and avx512-amx): a bfloat16 problem's five products by
 * vdpbf16ps on bfloat16 pairs, everything else float32 as above */
#undef ATTN_TGT
#define ATTN_TGT __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))
#define ATTN_BW_BF16DOT 1
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, avx512_bf16dot)
#include "attn_backward_impl.h"
#undef ATTN_BW_BF16DOT
#undef ATTN_TGT
#define ATTN_TGT __attribute__((target("avx512f")))
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

/* ... and with bf16 (a bfloat16 problem, float32 kind), its bfloat16-product
 * kernels where the path has them (avx512-bf16, avx512-amx), the float32 ones
 * elsewhere. */
static inline const attn_bw_kernels *attn_bw_table(int path, int kind, int bf16)
{
#if ATTN_X86_DISPATCH
    if (bf16 && kind == ATTN_F32 && (path == ATTN_PATH_AVX512BF16 || path == ATTN_PATH_AVX512AMX))
        return &bw_table_avx512_bf16dot;
#else
    (void)bf16;
#endif
    return attn_bw_tables[path][kind];
}

#endif /* ATTN_BACKWARD_H */
