/* Per-ISA micro-kernels and the dispatch table chosen at import.
 *
 * The micro-kernel template attn_simd_impl.h is compiled once per
 * (instruction set, element kind):
 *   avx512   x86-64 with AVX-512F            (target attribute, no -m flags)
 *   avx2-fma x86-64 with AVX2, FMA and F16C  (target attribute, no -m flags)
 *   generic  GCC/clang vector extensions of the baseline ISA (SSE2, NEON, ...)
 *            or, with any other C compiler, plain scalar C
 * x kinds float32, float64, float32 with float16 or bfloat16 K/V (attn_kernel.h).
 * attn_simd_init() picks the widest instruction set the running CPU supports
 * (__builtin_cpu_supports, which also checks that the OS saves the
 * registers), so the built module never executes an instruction the CPU
 * lacks; ATTN_SIMD=generic or ATTN_SIMD=avx2 caps the choice (for testing the
 * other paths). attn_table(kind) returns that instruction set's table.
 */
#ifndef ATTN_SIMD_H
#define ATTN_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "attn_kernel.h"

#include "attn_dispatch.h"  /* ATTN_X86_DISPATCH, ATTN_GVEC, ATTN_INLINE, the path choice */

#define ATTN_INF ((T)INFINITY)
#define ATTN_NAN NAN

/* IEEE half -> float, exactly (every half is a float); the generic path's
 * widening, where no conversion instruction is known to exist. */
static inline float attn_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (ex == 0x1f) bits = sign | 0x7f800000u | (mant << 13);          /* inf, NaN */
    else if (ex != 0) bits = sign | ((ex + 112u) << 23) | (mant << 13);  /* normal */
    else {                                                               /* 0, subnormal */
        f = (float)mant * (1.0f / 16777216.0f);                          /* mant * 2^-24 */
        return sign ? -f : f;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* bfloat16 -> float, exactly: a bfloat16 is the top half of a float32. */
static inline float attn_bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- instances */
#if ATTN_X86_DISPATCH
/* AVX-512F: 32 vector registers */
#define ATTN_TGT __attribute__((target("avx512f,f16c,fma")))
#define MR_QK 6
#define NR_QK 4
#define MR_PV 6
#define NR_PV 4
#define ATTN_OPS_AVX512_F32
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, avx512_f32)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define KV_GET(p) _cvtsh_ss(*(p))
#define ATTN_KIND ATTN_F32_KV16
#define FN(name) ATTN_PASTE(name, avx512_f32kv16)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(p))), 16))
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, avx512_f32kvbf16)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX512_F32
#define ATTN_OPS_AVX512_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_PASTE(name, avx512_f64)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX512_F64
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT

/* AVX2 + FMA (+ F16C): 16 vector registers */
#define ATTN_TGT __attribute__((target("avx2,fma,f16c")))
#define MR_QK 6
#define NR_QK 2
#define MR_PV 6
#define NR_PV 2
#define ATTN_OPS_AVX2_F32
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, avx2_f32)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define KV_GET(p) _cvtsh_ss(*(p))
#define ATTN_KIND ATTN_F32_KV16
#define FN(name) ATTN_PASTE(name, avx2_f32kv16)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))), 16))
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, avx2_f32kvbf16)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
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
#define ATTN_KIND ATTN_F32
#define FN(name) ATTN_PASTE(name, generic_f32)
#include "attn_simd_impl.h"
/* V_L 16-bit values widened one by one: bfloat16 when bf16, else float16 */
static inline V_T attn_generic_widen(const uint16_t *p, const int bf16)
{
    float t[V_L];
    int u;
    for (u = 0; u < V_L; u++) t[u] = bf16 ? attn_bf16_to_float(p[u]) : attn_half_to_float(p[u]);
    return V_LOAD(t);
}
#define KV_VLOAD(p) attn_generic_widen(p, 0)
#define KV_GET(p) attn_half_to_float(*(p))
#define ATTN_KIND ATTN_F32_KV16
#define FN(name) ATTN_PASTE(name, generic_f32kv16)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) attn_generic_widen(p, 1)
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, generic_f32kvbf16)
#include "attn_simd_impl.h"
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
#include "attn_simd_impl.h"
#undef ATTN_OPS_GVEC_F64
#undef ATTN_OPS_SCALAR_F64
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT

/* The chosen instruction set's micro-kernels for one element kind. */
static const attn_kernels *const attn_tables[3][ATTN_N_KINDS] = {
    {&table_generic_f32, &table_generic_f64, &table_generic_f32kv16, &table_generic_f32kvbf16},
#if ATTN_X86_DISPATCH
    {&table_avx2_f32, &table_avx2_f64, &table_avx2_f32kv16, &table_avx2_f32kvbf16},
    {&table_avx512_f32, &table_avx512_f64, &table_avx512_f32kv16, &table_avx512_f32kvbf16},
#else
    {NULL, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL},
#endif
};

static inline const attn_kernels *attn_table(int kind) { return attn_tables[attn_simd_path_id][kind]; }

#endif /* ATTN_SIMD_H */
