/* Fused attention backward (FlashAttention-2) with run-time instruction-set dispatch.
 *
 * The template attn_backward_impl.h is compiled once per (instruction set,
 * dtype), in terms of the V_* vector operations of attn_simd_ops.h (shared
 * with the forward kernel; this header copies only the few dispatch lines of
 * attn_simd.h it needs, so the two extensions build independently). Paths:
 * avx512, avx2-fma (x86-64, target attributes) and generic (GCC/clang vector
 * extensions, or scalar C); ATTN_SIMD=generic / ATTN_SIMD=avx2 caps the
 * choice, as for the forward.
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

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) \
    && !defined(ATTN_NO_SIMD)
#define ATTN_BW_X86 1
#include <immintrin.h>
#else
#define ATTN_BW_X86 0
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(ATTN_NO_SIMD)
#define ATTN_BW_GVEC 1
#define ATTN_INLINE inline __attribute__((always_inline))
#else
#define ATTN_BW_GVEC 0
#define ATTN_INLINE inline
#endif

#include "attn_kernel.h"  /* attn_operand, attn_problem, ATTN_F32 / ATTN_F64, ATTN_MASK_* */

/* Query rows and keys per block: the same on every path and for any thread
 * count (the order of every sum depends on these alone). */
#define ATTN_BW_BQ 64
#define ATTN_BW_BK 64

/* One backward call over fw.n_batch matrices: the forward's problem (q, k, v,
 * mask operands, out and lse C-contiguous [n_batch, n_q, d_v] and [n_batch,
 * n_q], kind ATTN_F32 or ATTN_F64: every array of that one dtype, a bool
 * mask uint8) and the gradients. Outputs, C-contiguous: dq [n_batch, n_q,
 * d_k], dk [n_batch, n_k, d_k], dv [n_batch, n_k, d_v]; ds [n_batch, n_q,
 * n_k] (the float mask's gradient, zero-filled by the caller) or NULL.
 * work: n_batch * work_elems elements (the table's work_elems), 64-byte
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
 * scratch_elems elements, 64-byte aligned. */
typedef struct {
    size_t (*work_elems)(int64_t n_q, int64_t n_k, int64_t d_k, int64_t d_v);
    size_t (*scratch_elems)(int64_t d_k, int64_t d_v);
    /* pack matrix b's operands into its work (for_lse: only what lse_block reads) */
    void (*pack)(const attn_bw_problem *p, int64_t b, int for_lse);
    /* all of matrix b on one thread */
    void (*matrix)(const attn_bw_problem *p, int64_t b, void *scratch);
    /* dK, dV of key block jb of matrix b */
    void (*kv_block)(const attn_bw_problem *p, int64_t b, int64_t jb, void *scratch);
    /* dQ of query block ib of matrix b */
    void (*q_block)(const attn_bw_problem *p, int64_t b, int64_t ib, void *scratch);
    /* lse of the rows of query block ib of matrix b */
    void (*lse_block)(const attn_bw_problem *p, int64_t b, int64_t ib, void *scratch);
} attn_bw_kernels;

#define ATTN_BW_PASTE2(a, b) a##_##b
#define ATTN_BW_PASTE(a, b) ATTN_BW_PASTE2(a, b)

/* ---------------------------------------------------------------- instances
 * MR x NR: register tile of the matrix products (MR rows x NR vectors). */
#if ATTN_BW_X86
#define ATTN_TGT __attribute__((target("avx512f")))
#define MR 6
#define NR 4
#define ATTN_OPS_AVX512_F32
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_BW_PASTE(name, avx512_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX512_F32
#define ATTN_OPS_AVX512_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_BW_PASTE(name, avx512_f64)
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
#define FN(name) ATTN_BW_PASTE(name, avx2_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_BW_PASTE(name, avx2_f64)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX2_F64
#undef MR
#undef NR
#undef ATTN_TGT
#endif /* ATTN_BW_X86 */

#define ATTN_TGT
#if ATTN_BW_GVEC
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
#define FN(name) ATTN_BW_PASTE(name, generic_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_GVEC_F32
#undef ATTN_OPS_SCALAR_F32
#if ATTN_BW_GVEC
#define ATTN_OPS_GVEC_F64
#else
#define ATTN_OPS_SCALAR_F64
#endif
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_BW_PASTE(name, generic_f64)
#include "attn_backward_impl.h"
#undef ATTN_OPS_GVEC_F64
#undef ATTN_OPS_SCALAR_F64
#undef MR
#undef NR
#undef ATTN_TGT

/* ----------------------------------------------------------------- dispatch */
#define ATTN_BW_GENERIC 0
#define ATTN_BW_AVX2 1
#define ATTN_BW_AVX512 2

static int attn_bw_path_id = ATTN_BW_GENERIC;
static int attn_bw_best_id = ATTN_BW_GENERIC;

static inline const char *attn_bw_name(int id)
{
    switch (id) {
    case ATTN_BW_AVX512: return "avx512";
    case ATTN_BW_AVX2: return "avx2-fma";
    default: return ATTN_BW_GVEC ? "generic" : "generic-scalar";
    }
}

/* Once, at import: the widest path the CPU runs, capped by ATTN_SIMD. */
static inline void attn_bw_init(void)
{
    int path = ATTN_BW_GENERIC;
    const char *cap = getenv("ATTN_SIMD");
#if ATTN_BW_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        path = ATTN_BW_AVX2;
    if (path == ATTN_BW_AVX2 && __builtin_cpu_supports("avx512f"))
        path = ATTN_BW_AVX512;
#endif
    attn_bw_best_id = path;
    if (cap != NULL) {
        if (strcmp(cap, "generic") == 0) path = ATTN_BW_GENERIC;
        else if (strcmp(cap, "avx2") == 0 && path > ATTN_BW_AVX2) path = ATTN_BW_AVX2;
    }
    attn_bw_path_id = path;
}

static inline const char *attn_bw_path(void) { return attn_bw_name(attn_bw_path_id); }

static inline int attn_bw_available(const char **names, int n)
{
    int id, k = 0;
    for (id = attn_bw_best_id; id >= ATTN_BW_GENERIC && k < n; id--)
        names[k++] = attn_bw_name(id);
    return k;
}

static inline int attn_bw_select(const char *name)
{
    int id;
    for (id = attn_bw_best_id; id >= ATTN_BW_GENERIC; id--) {
        if (strcmp(name, attn_bw_name(id)) == 0) {
            attn_bw_path_id = id;
            return 0;
        }
    }
    return -1;
}

/* The chosen instruction set's kernels for kind ATTN_F32 or ATTN_F64. */
static const attn_bw_kernels *const attn_bw_tables[3][2] = {
    {&bw_table_generic_f32, &bw_table_generic_f64},
#if ATTN_BW_X86
    {&bw_table_avx2_f32, &bw_table_avx2_f64},
    {&bw_table_avx512_f32, &bw_table_avx512_f64},
#else
    {NULL, NULL}, {NULL, NULL},
#endif
};

static inline const attn_bw_kernels *attn_bw_table(int kind) { return attn_bw_tables[attn_bw_path_id][kind]; }

#endif /* ATTN_BACKWARD_H */
