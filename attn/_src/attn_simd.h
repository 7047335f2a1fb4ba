/* SIMD attention kernels with run-time instruction-set dispatch.
 *
 * The kernel template attn_simd_impl.h is compiled several times:
 *   avx512   x86-64 with AVX-512F            (target attribute, no -m flags)
 *   avx2-fma x86-64 with AVX2 and FMA        (target attribute, no -m flags)
 *   generic  GCC/clang vector extensions of the baseline ISA (SSE2, NEON, ...)
 *            or, with any other C compiler, plain scalar C
 * attn_simd_init() picks the widest one the running CPU supports
 * (__builtin_cpu_supports, which also checks that the OS saves the
 * registers), so the built module runs on any x86-64 and never executes an
 * instruction the CPU lacks. The environment variable ATTN_SIMD=generic or
 * ATTN_SIMD=avx2 caps the choice (for testing the other paths).
 *
 * Results are deterministic for a given path: nothing here depends on the
 * thread count (callers split work only into independent row blocks and fixed
 * key chunks merged in a fixed order).
 */
#ifndef ATTN_SIMD_H
#define ATTN_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) \
    && !defined(ATTN_NO_SIMD)
#define ATTN_X86_DISPATCH 1
#include <immintrin.h>
#else
#define ATTN_X86_DISPATCH 0
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(ATTN_NO_SIMD)
#define ATTN_GVEC 1
#define ATTN_INLINE inline __attribute__((always_inline))
#else
#define ATTN_GVEC 0
#define ATTN_INLINE inline
#endif

#define ATTN_MASK_NONE 0
#define ATTN_MASK_BOOL 1   /* uint8, nonzero = visible */
#define ATTN_MASK_ADD 2    /* same float type, added to the scaled scores */

#define ATTN_INF ((T)INFINITY)
#define ATTN_NAN NAN

/* One matrix of the batch: every pointer already at element [0, 0] of this
 * (batch, head) matrix; strides in elements, any sign, 0 for broadcast. */
typedef struct {
    const float *q; ptrdiff_t q_rs, q_cs;
    const float *k; ptrdiff_t k_rs, k_cs;
    const float *v; ptrdiff_t v_rs, v_cs;
    const void *mask; ptrdiff_t m_rs, m_cs; int mask_kind;
    float *out; ptrdiff_t o_rs;          /* columns contiguous */
    ptrdiff_t n_q, n_k, d_k, d_v;
    int causal; ptrdiff_t causal_offset; /* key j visible to row i iff j <= i + offset */
    float scale;
} attn_mat_f32;

typedef struct {
    const double *q; ptrdiff_t q_rs, q_cs;
    const double *k; ptrdiff_t k_rs, k_cs;
    const double *v; ptrdiff_t v_rs, v_cs;
    const void *mask; ptrdiff_t m_rs, m_cs; int mask_kind;
    double *out; ptrdiff_t o_rs;
    ptrdiff_t n_q, n_k, d_k, d_v;
    int causal; ptrdiff_t causal_offset;
    double scale;
} attn_mat_f64;

/* Row block and key tile sizes per dtype (the same for every instruction
 * set, so that work splitting never depends on the chosen path). Chosen by
 * single-thread sweeps on an AVX-512 machine (BQ 32..128 x BK 32..256):
 * larger row blocks reuse each key/value tile more; 64-key tiles keep the
 * score tile and a value sub-block near L1. */
#define ATTN_BQ_F32 128
#define ATTN_BK_F32 64
#define ATTN_BQ_F64 128
#define ATTN_BK_F64 64

/* ---------------------------------------------------------------- instances */
#define ATTN_PASTE2(a, b) a##_##b
#define ATTN_PASTE(a, b) ATTN_PASTE2(a, b)

#if ATTN_X86_DISPATCH
/* AVX-512F: 32 vector registers */
#define ATTN_TGT __attribute__((target("avx512f")))
#define MR_QK 6
#define NR_QK 4
#define MR_PV 6
#define NR_PV 4
#define ATTN_OPS_AVX512_F32
#include "attn_simd_ops.h"
#define ATTN_IS_F64 0
#define FN(name) ATTN_PASTE(name, avx512_f32)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX512_F32
#define ATTN_OPS_AVX512_F64
#include "attn_simd_ops.h"
#define ATTN_IS_F64 1
#define FN(name) ATTN_PASTE(name, avx512_f64)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX512_F64
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT

/* AVX2 + FMA: 16 vector registers */
#define ATTN_TGT __attribute__((target("avx2,fma")))
#define MR_QK 6
#define NR_QK 2
#define MR_PV 6
#define NR_PV 2
#define ATTN_OPS_AVX2_F32
#include "attn_simd_ops.h"
#define ATTN_IS_F64 0
#define FN(name) ATTN_PASTE(name, avx2_f32)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_IS_F64 1
#define FN(name) ATTN_PASTE(name, avx2_f64)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX2_F64
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT
#endif /* ATTN_X86_DISPATCH */

/* generic: baseline vector extensions, or scalar C */
#define ATTN_TGT
#if ATTN_GVEC
#define MR_QK 6
#define NR_QK 2
#define MR_PV 6
#define NR_PV 2
#define ATTN_OPS_GVEC_F32
#else
#define MR_QK 4
#define NR_QK 4
#define MR_PV 4
#define NR_PV 4
#define ATTN_OPS_SCALAR_F32
#endif
#include "attn_simd_ops.h"
#define ATTN_IS_F64 0
#define FN(name) ATTN_PASTE(name, generic_f32)
#include "attn_simd_impl.h"
#undef ATTN_OPS_GVEC_F32
#undef ATTN_OPS_SCALAR_F32
#if ATTN_GVEC
#define ATTN_OPS_GVEC_F64
#else
#define ATTN_OPS_SCALAR_F64
#endif
#include "attn_simd_ops.h"
#define ATTN_IS_F64 1
#define FN(name) ATTN_PASTE(name, generic_f64)
#include "attn_simd_impl.h"
#undef ATTN_OPS_GVEC_F64
#undef ATTN_OPS_SCALAR_F64
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT

/* ----------------------------------------------------------------- dispatch */
#define ATTN_PATH_GENERIC 0
#define ATTN_PATH_AVX2 1
#define ATTN_PATH_AVX512 2

static int attn_simd_path_id = ATTN_PATH_GENERIC;
static int attn_simd_best_id = ATTN_PATH_GENERIC;   /* widest the CPU runs */

static inline const char *attn_simd_name(int id)
{
    switch (id) {
    case ATTN_PATH_AVX512: return "avx512";
    case ATTN_PATH_AVX2: return "avx2-fma";
    default: return ATTN_GVEC ? "generic" : "generic-scalar";
    }
}

/* Choose the path once, at module import (before any kernel runs). */
static inline void attn_simd_init(void)
{
    int path = ATTN_PATH_GENERIC;
    const char *cap = getenv("ATTN_SIMD");
#if ATTN_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        path = ATTN_PATH_AVX2;
    if (path == ATTN_PATH_AVX2 && __builtin_cpu_supports("avx512f"))
        path = ATTN_PATH_AVX512;
#endif
    attn_simd_best_id = path;
    if (cap != NULL) {
        if (strcmp(cap, "generic") == 0) path = ATTN_PATH_GENERIC;
        else if (strcmp(cap, "avx2") == 0 && path > ATTN_PATH_AVX2) path = ATTN_PATH_AVX2;
    }
    attn_simd_path_id = path;
}

static inline const char *attn_simd_path(void) { return attn_simd_name(attn_simd_path_id); }

/* Paths this CPU can run, widest first: n names into names[]. */
static inline int attn_simd_available(const char **names, int n)
{
    int id, k = 0;
    for (id = attn_simd_best_id; id >= ATTN_PATH_GENERIC && k < n; id--)
        names[k++] = attn_simd_name(id);
    return k;
}

/* Switch paths (tests only; not while a kernel runs). 0 = done, -1 = this
 * CPU cannot run it or no such path. */
static inline int attn_simd_select(const char *name)
{
    int id;
    for (id = attn_simd_best_id; id >= ATTN_PATH_GENERIC; id--) {
        if (strcmp(name, attn_simd_name(id)) == 0) {
            attn_simd_path_id = id;
            return 0;
        }
    }
    return -1;
}

#if ATTN_X86_DISPATCH
#define ATTN_DISPATCH(name, sfx, args)                                   \
    switch (attn_simd_path_id) {                                          \
    case ATTN_PATH_AVX512: return name##_avx512_##sfx args;               \
    case ATTN_PATH_AVX2: return name##_avx2_##sfx args;                   \
    default: return name##_generic_##sfx args;                            \
    }
#define ATTN_DISPATCH_VOID(name, sfx, args)                              \
    switch (attn_simd_path_id) {                                          \
    case ATTN_PATH_AVX512: name##_avx512_##sfx args; break;               \
    case ATTN_PATH_AVX2: name##_avx2_##sfx args; break;                   \
    default: name##_generic_##sfx args; break;                            \
    }
#else
#define ATTN_DISPATCH(name, sfx, args) return name##_generic_##sfx args;
#define ATTN_DISPATCH_VOID(name, sfx, args) name##_generic_##sfx args;
#endif

static inline ptrdiff_t attn_scratch_elems_f32(ptrdiff_t d_k, ptrdiff_t d_v)
{ ATTN_DISPATCH(scratch_elems, f32, (d_k, d_v)) }
static inline ptrdiff_t attn_scratch_elems_f64(ptrdiff_t d_k, ptrdiff_t d_v)
{ ATTN_DISPATCH(scratch_elems, f64, (d_k, d_v)) }

static inline void attn_rows_f32(const attn_mat_f32 *a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0,
                                 ptrdiff_t j1, float *scratch, float *part, float *w,
                                 ptrdiff_t w_rs, float *lse)
{ ATTN_DISPATCH_VOID(rows, f32, (a, i0, nq, j0, j1, scratch, part, w, w_rs, lse)) }
static inline void attn_rows_f64(const attn_mat_f64 *a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0,
                                 ptrdiff_t j1, double *scratch, double *part, double *w,
                                 ptrdiff_t w_rs, double *lse)
{ ATTN_DISPATCH_VOID(rows, f64, (a, i0, nq, j0, j1, scratch, part, w, w_rs, lse)) }

static inline void attn_softmax_row_f32(const float *x, ptrdiff_t xs, const void *mask, int kind,
                                        ptrdiff_t ms, float *out, ptrdiff_t n)
{ ATTN_DISPATCH_VOID(softmax_row, f32, (x, xs, mask, kind, ms, out, n)) }
static inline void attn_softmax_row_f64(const double *x, ptrdiff_t xs, const void *mask, int kind,
                                        ptrdiff_t ms, double *out, ptrdiff_t n)
{ ATTN_DISPATCH_VOID(softmax_row, f64, (x, xs, mask, kind, ms, out, n)) }

/* ------------------------------------------------------- split-key merging
 * parts: n_chunks partial states of rows [0, nq) laid out as FN(rows) writes
 * them (stride 2 * nq + nq * d_v), merged in chunk order 0, 1, ...:
 *   M = max_c m_c, L = sum_c exp(m_c - M) l_c, acc = sum_c exp(m_c - M) acc_c,
 *   out = acc / L (0 when L = 0, i.e. nothing visible; NaN propagates). */
#define ATTN_MERGE(T, SFX, EXPF)                                                         \
static inline void attn_merge_##SFX(const T *parts, ptrdiff_t n_chunks, ptrdiff_t nq,            \
                             ptrdiff_t d_v, T *out, ptrdiff_t o_rs, T *lse)              \
{                                                                                          \
    const ptrdiff_t stride = 2 * nq + nq * d_v;                                            \
    ptrdiff_t i, c, e;                                                                     \
    for (i = 0; i < nq; i++) {                                                             \
        T M = -(T)INFINITY, L = 0, *o = out + i * o_rs;                                    \
        for (c = 0; c < n_chunks; c++) {                                                   \
            T mc = parts[c * stride + i];                                                  \
            if (mc > M || mc != mc) M = mc;                                                \
        }                                                                                  \
        for (e = 0; e < d_v; e++) o[e] = 0;                                                \
        for (c = 0; c < n_chunks; c++) {                                                   \
            const T *pc = parts + c * stride;                                              \
            T w;                                                                           \
            if (pc[i] == -(T)INFINITY) {                                                   \
                /* the chunk saw nothing of row i (l = 0), or only NaN scores               \
                   (l = NaN, which max() passed over): NaN must still win */                \
                L += pc[nq + i];                                                           \
                continue;                                                                  \
            }                                                                              \
            w = EXPF(pc[i] - M);                                                           \
            L += w * pc[nq + i];                                                           \
            for (e = 0; e < d_v; e++) o[e] += w * pc[2 * nq + i * d_v + e];                \
        }                                                                                  \
        if (lse != NULL) lse[i] = L == 0 ? -(T)INFINITY : M + (T)log((double)L);          \
        if (L == 0) { for (e = 0; e < d_v; e++) o[e] = 0; }                                \
        else if (L != L) { for (e = 0; e < d_v; e++) o[e] = (T)NAN; }                      \
        else { T inv = (T)1 / L; for (e = 0; e < d_v; e++) o[e] *= inv; }                  \
    }                                                                                      \
}
ATTN_MERGE(float, f32, expf)
ATTN_MERGE(double, f64, exp)
#undef ATTN_MERGE

#endif /* ATTN_SIMD_H */
