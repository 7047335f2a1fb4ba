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

#define ATTN_BW_MASK_NONE 0
#define ATTN_BW_MASK_BOOL 1   /* uint8, nonzero = visible */
#define ATTN_BW_MASK_ADD 2    /* same float type, added to the scaled scores */

/* Query rows and keys per block: the same on every path and for any thread
 * count (the order of every sum depends on these alone). */
#define ATTN_BW_BQ 64
#define ATTN_BW_BK 64

/* One matrix of the batch. Inputs: pointers at element [0, 0], element
 * strides (any sign; 0 for broadcast). out, dout: [n_q][d_v] contiguous;
 * lse: [n_q]. Outputs dq [n_q][d_k], dk [n_k][d_k], dv [n_k][d_v]
 * contiguous; ds [n_q][n_k] (the float mask's gradient, zero-filled by the
 * caller) or NULL. work: attn_bw_work_elems() elements, 64-byte aligned,
 * owned by this matrix (packed operands and the dQ accumulator). */
#define ATTN_BW_STRUCT(T, NAME)                                                    \
typedef struct {                                                                   \
    const T *q; ptrdiff_t q_rs, q_cs;                                              \
    const T *k; ptrdiff_t k_rs, k_cs;                                              \
    const T *v; ptrdiff_t v_rs, v_cs;                                              \
    const void *mask; ptrdiff_t m_rs, m_cs; int mask_kind;                         \
    const T *out; const T *dout; const T *lse;                                     \
    T *dq; T *dk; T *dv; T *ds;                                                    \
    ptrdiff_t n_q, n_k, d_k, d_v;                                                  \
    int causal; ptrdiff_t causal_offset; /* key j visible to row i iff j <= i + offset */ \
    T scale;                                                                       \
    T *work;                                                                       \
} NAME;
ATTN_BW_STRUCT(float, attn_bw_f32)
ATTN_BW_STRUCT(double, attn_bw_f64)
#undef ATTN_BW_STRUCT

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
#define ATTN_IS_F64 0
#define FN(name) ATTN_BW_PASTE(name, avx512_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX512_F32
#define ATTN_OPS_AVX512_F64
#include "attn_simd_ops.h"
#define ATTN_IS_F64 1
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
#define ATTN_IS_F64 0
#define FN(name) ATTN_BW_PASTE(name, avx2_f32)
#include "attn_backward_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_IS_F64 1
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
#define ATTN_IS_F64 0
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
#define ATTN_IS_F64 1
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

#if ATTN_BW_X86
#define ATTN_BW_DISPATCH(name, sfx, args)                                \
    switch (attn_bw_path_id) {                                            \
    case ATTN_BW_AVX512: return name##_avx512_##sfx args;                 \
    case ATTN_BW_AVX2: return name##_avx2_##sfx args;                     \
    default: return name##_generic_##sfx args;                            \
    }
#else
#define ATTN_BW_DISPATCH(name, sfx, args) return name##_generic_##sfx args;
#endif

#define ATTN_BW_API(T, SFX)                                                                   \
static inline size_t attn_bw_work_elems_##SFX(ptrdiff_t n_q, ptrdiff_t n_k, ptrdiff_t d_k,    \
                                              ptrdiff_t d_v)                                  \
{ ATTN_BW_DISPATCH(bw_work_elems, SFX, (n_q, n_k, d_k, d_v)) }                                \
static inline size_t attn_bw_scratch_elems_##SFX(ptrdiff_t d_k, ptrdiff_t d_v)               \
{ ATTN_BW_DISPATCH(bw_scratch_elems, SFX, (d_k, d_v)) }                                       \
static inline void attn_bw_pack_##SFX(const attn_bw_##SFX *a, int for_lse)                    \
{ ATTN_BW_DISPATCH(bw_pack, SFX, (a, for_lse)) }                                              \
static inline void attn_bw_matrix_##SFX(const attn_bw_##SFX *a, T *scratch)                   \
{ ATTN_BW_DISPATCH(bw_matrix, SFX, (a, scratch)) }                                            \
static inline void attn_bw_kv_block_##SFX(const attn_bw_##SFX *a, ptrdiff_t jb, T *scratch)   \
{ ATTN_BW_DISPATCH(bw_kv_block, SFX, (a, jb, scratch)) }                                      \
static inline void attn_bw_q_block_##SFX(const attn_bw_##SFX *a, ptrdiff_t ib, T *scratch)    \
{ ATTN_BW_DISPATCH(bw_q_block, SFX, (a, ib, scratch)) }                                       \
static inline void attn_bw_dq_out_##SFX(const attn_bw_##SFX *a)                               \
{ ATTN_BW_DISPATCH(bw_dq_out, SFX, (a)) }                                                     \
static inline void attn_bw_lse_block_##SFX(const attn_bw_##SFX *a, ptrdiff_t ib, T *scratch,  \
                                           T *lse)                                            \
{ ATTN_BW_DISPATCH(bw_lse_block, SFX, (a, ib, scratch, lse)) }
ATTN_BW_API(float, f32)
ATTN_BW_API(double, f64)
#undef ATTN_BW_API

#endif /* ATTN_BACKWARD_H */
