/* Per-ISA micro-kernels and the dispatch table chosen at import.
 *
 * The micro-kernel template attn_simd_impl.h is compiled once per
 * (instruction set, element kind):
 *   avx512   x86-64 with AVX-512F            (target attribute, no -m flags)
 *   avx512-bf16  avx512 and AVX512_BF16 (+BW): the same, except that a
 *            bfloat16 problem's register tiles run vdpbf16ps (attn_simd_bf16dot.h)
 *   avx512-amx   avx512-bf16 and AMX-BF16: those products by AMX tiles instead
 *            (tdpbf16ps, 16 x 16 float32 per instruction; attn_simd_bf16dot.h)
 *   avx2-fma x86-64 with AVX2, FMA and F16C  (target attribute, no -m flags)
 *   generic  GCC/clang vector extensions of the baseline ISA (SSE2, NEON, ...)
 *            or, with any other C compiler, plain scalar C
 * x kinds float32, float64, float32 with float16 or bfloat16 K/V (attn_kernel.h).
 * attn_simd_init() picks the widest instruction set the running CPU supports
 * (__builtin_cpu_supports, which also checks that the OS saves the
 * registers), so the built module never executes an instruction the CPU
 * lacks; ATTN_SIMD=generic, avx2 or avx512 caps the choice (for testing the
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

/* float8 -> float, exactly. e5m2 is the top byte of a float16. e4m3fn (OCP
   FP8, as torch.float8_e4m3fn and ml_dtypes) has a 4-bit exponent of bias 7,
   3 mantissa bits, no infinity and NaN at 0x7f / 0xff: its bits shifted to a
   float16's (exponent bias 15) give the value times 2^-8 exactly, subnormals
   included. The kernel reads an e4m3 cache in those units (KV_UNIT = 256 in
   attn_simd_impl.h: the query and the output carry the 2^8), so the widening
   is the float16's alone. */
static inline float attn_e5m2_to_float(uint8_t b) { return attn_half_to_float((uint16_t)((uint16_t)b << 8)); }
static inline float attn_e4m3_over256(uint8_t b)
{
    const uint32_t nan_bits = 0x7fc00000u;
    float f;
    if ((b & 0x7fu) == 0x7fu) {
        memcpy(&f, &nan_bits, sizeof f);
        return f;
    }
    return attn_half_to_float((uint16_t)(((b & 0x7fu) << 7) | ((b & 0x80u) << 8)));
}

#if ATTN_X86_DISPATCH
/* float8 e4m3 bytes, sign-extended to 16 bits, as the float16 bit patterns of their
   values times 2^-8 (NaN kept NaN), for F16C's widening: the shift by 7 puts
   exponent and mantissa in place and the sign in bits 15 and 14, whose 14 is
   cleared; a NaN (exponent and mantissa all ones) becomes all ones, a float16 NaN.
   Six operations, where taking sign and magnitude apart took nine. */
static __attribute__((target("avx2,f16c"))) inline __m128i attn_e4m3_half8(__m128i sx)
{
    const __m128i h = _mm_slli_epi16(sx, 7), em = _mm_set1_epi16(0x3f80);
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, em), em);
    return _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16((short)0xbfff)), nan);
}
static __attribute__((target("avx2,f16c"))) inline __m256i attn_e4m3_half16(__m256i sx)
{
    const __m256i h = _mm256_slli_epi16(sx, 7), em = _mm256_set1_epi16(0x3f80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, em), em);
    return _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16((short)0xbfff)), nan);
}
/* V_L (8 or 16) float8 values at p, widened (e4m3: times 2^-8, attn_e4m3_over256). */
static __attribute__((target("avx2,fma,f16c"))) inline __m256 attn_e4m3_over256_avx2(const uint8_t *p)
{
    const __m128i sx = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)p));
    return _mm256_cvtph_ps(attn_e4m3_half8(sx));
}
static __attribute__((target("avx2,fma,f16c"))) inline __m256 attn_e5m2_avx2(const uint8_t *p)
{
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)p));
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}
static __attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 attn_e4m3_over256_avx512(const uint8_t *p)
{
    const __m256i sx = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm512_cvtph_ps(attn_e4m3_half16(sx));
}
/* The same with AVX-512VL's three-input logic (the avx512-bf16 and avx512-amx paths):
   the clearing of bit 14 and the NaN's bits in one operation, five where it takes six. */
static __attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))) inline __m512
attn_e4m3_over256_avx512vl(const uint8_t *p)
{
    const __m256i sx = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m256i h = _mm256_slli_epi16(sx, 7), em = _mm256_set1_epi16(0x3f80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, em), em);
    /* 0xea: (h & 0xbfff) | nan */
    return _mm512_cvtph_ps(_mm256_ternarylogic_epi32(h, _mm256_set1_epi16((short)0xbfff), nan, 0xea));
}
/* AVX512_VBMI (avx512-bf16 and avx512-amx paths, where the CPU has it: attn_simd_init):
   e4m3 by table. The bfloat16 bits of an e4m3 magnitude m (0..127) over 256, as
   attn_e4m3_over256 gives it (an exponent field of e + 112 and the 3 mantissa bits on
   top; subnormals f 2^-17 normalized; 127 NaN): every value exact in bfloat16. Its two
   bytes are two 128-entry tables, each two registers for vpermi2b, which looks up 64
   bytes by their low 7 bits; the sign is the byte's bit 7, ORed into the high byte. A
   bfloat16 is the top half of its float32. */
#define ATTN_E4M3_BF16_SUB(f) ((f) == 0 ? 0u : (f) == 1 ? 110u << 7 : (f) < 4 ? 111u << 7 | ((f) - 2u) << 6 \
                               : 112u << 7 | ((f) - 4u) << 5)
#define ATTN_E4M3_BF16(m) ((m) == 127u ? 0x7fc0u : ((m) >> 3) != 0 ? (((m) >> 3) + 112u) << 7 | ((m) & 7u) << 4 \
                           : ATTN_E4M3_BF16_SUB(m))
#define ATTN_E4M3_X8(F, m) F(m), F(m + 1u), F(m + 2u), F(m + 3u), F(m + 4u), F(m + 5u), F(m + 6u), F(m + 7u)
#define ATTN_E4M3_X128(F) ATTN_E4M3_X8(F, 0u), ATTN_E4M3_X8(F, 8u), ATTN_E4M3_X8(F, 16u), ATTN_E4M3_X8(F, 24u), \
    ATTN_E4M3_X8(F, 32u), ATTN_E4M3_X8(F, 40u), ATTN_E4M3_X8(F, 48u), ATTN_E4M3_X8(F, 56u), ATTN_E4M3_X8(F, 64u), \
    ATTN_E4M3_X8(F, 72u), ATTN_E4M3_X8(F, 80u), ATTN_E4M3_X8(F, 88u), ATTN_E4M3_X8(F, 96u), ATTN_E4M3_X8(F, 104u), \
    ATTN_E4M3_X8(F, 112u), ATTN_E4M3_X8(F, 120u)
#define ATTN_E4M3_BF16_LO(m) (uint8_t)(ATTN_E4M3_BF16(m) & 0xffu)
#define ATTN_E4M3_BF16_HI(m) (uint8_t)(ATTN_E4M3_BF16(m) >> 8)
static const uint8_t attn_e4m3_bf16_lo[128] __attribute__((aligned(64))) = {ATTN_E4M3_X128(ATTN_E4M3_BF16_LO)};
static const uint8_t attn_e4m3_bf16_hi[128] __attribute__((aligned(64))) = {ATTN_E4M3_X128(ATTN_E4M3_BF16_HI)};
#define ATTN_VBMI_TGT __attribute__((target("avx512f,avx512vl,avx512bw,avx512vbmi,avx2,fma,f16c")))

/* 16 values at p (natural order): vpermb spreads byte t to bytes 2 and 3 of dword t (the
   rest zero), one lookup writes the low byte, one the high byte (each merging into its
   index), the sign ORed in: four operations. */
static ATTN_VBMI_TGT inline __m512 attn_e4m3_over256_vbmi(const uint8_t *p)
{
    const __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m512i spread = _mm512_set_epi32(0x0f0f0000, 0x0e0e0000, 0x0d0d0000, 0x0c0c0000, 0x0b0b0000,
                                            0x0a0a0000, 0x09090000, 0x08080000, 0x07070000, 0x06060000,
                                            0x05050000, 0x04040000, 0x03030000, 0x02020000, 0x01010000, 0x00000000);
    const __m512i tl0 = _mm512_load_si512((const void *)attn_e4m3_bf16_lo);
    const __m512i tl1 = _mm512_load_si512((const void *)(attn_e4m3_bf16_lo + 64));
    const __m512i th0 = _mm512_load_si512((const void *)attn_e4m3_bf16_hi);
    const __m512i th1 = _mm512_load_si512((const void *)(attn_e4m3_bf16_hi + 64));
    const __m512i xs = _mm512_maskz_permutexvar_epi8((__mmask64)0xccccccccccccccccull, spread, x);
    const __m512i lo = _mm512_mask2_permutex2var_epi8(tl0, xs, (__mmask64)0x4444444444444444ull, tl1);
    const __m512i hl = _mm512_mask2_permutex2var_epi8(th0, lo, (__mmask64)0x8888888888888888ull, th1);
    /* 0xf8: hl | (xs & sign) */
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(hl, xs, _mm512_set1_epi32((int)0x80000000u), 0xf8));
}
/* 64 e4m3 bytes x as 64 bfloat16s over 256, two vectors of word pairs: the two lookups and the
   sign give each value's low and high byte, the in-lane unpacks pair them, so w0 holds the values
   of bytes 16L + 0..7 of lane L and w1 those of 16L + 8..15 (five operations). */
static ATTN_VBMI_TGT inline void attn_e4m3_bf16_pairs_vbmi(__m512i x, __m512i *w0, __m512i *w1)
{
    const __m512i tl0 = _mm512_load_si512((const void *)attn_e4m3_bf16_lo);
    const __m512i tl1 = _mm512_load_si512((const void *)(attn_e4m3_bf16_lo + 64));
    const __m512i th0 = _mm512_load_si512((const void *)attn_e4m3_bf16_hi);
    const __m512i th1 = _mm512_load_si512((const void *)(attn_e4m3_bf16_hi + 64));
    const __m512i lo = _mm512_permutex2var_epi8(tl0, x, tl1);
    /* 0xf8: hi | (x & sign) */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(th0, x, th1), x,
                                                 _mm512_set1_epi8((char)0x80), 0xf8);
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}
/* 64 values at p as four vectors of 16, natural order, in ten operations (2.5 a vector):
   vpermb moves byte 16k + 4L + t to 16L + 4k + t (a transpose of 4-byte groups), the lookups
   (attn_e4m3_bf16_pairs_vbmi) give the 64 bfloat16s, the unpacks with zeros make them float32s,
   which that transpose has put back in order: out[k] holds values 16k .. 16k + 15. */
static ATTN_VBMI_TGT inline void attn_e4m3_over256_vbmi64(const uint8_t *p, __m512 out[4])
{
    const __m512i tr = _mm512_set_epi32(0x3f3e3d3c, 0x2f2e2d2c, 0x1f1e1d1c, 0x0f0e0d0c, 0x3b3a3938, 0x2b2a2928,
                                        0x1b1a1918, 0x0b0a0908, 0x37363534, 0x27262524, 0x17161514, 0x07060504,
                                        0x33323130, 0x23222120, 0x13121110, 0x03020100);
    const __m512i z = _mm512_setzero_si512();
    __m512i w0, w1;
    attn_e4m3_bf16_pairs_vbmi(_mm512_permutexvar_epi8(tr, _mm512_loadu_si512((const void *)p)), &w0, &w1);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w0));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w0));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w1));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w1));
}
static __attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 attn_e5m2_avx512(const uint8_t *p)
{
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}
#endif

/* ---------------------------------------------------------------- bool masks
 * A 16 x 16 tile of a bool mask (16 query rows m_rs bytes apart, 16 contiguous
 * keys) applied to the key-major scores: s[j * ld + i] = -inf where row i does
 * not take key j. A byte transpose by SSE2 unpacks (4 rounds of 16), then each
 * key's 16 bytes widened to lane masks that select -inf into the scores: about
 * 1.5 instructions per mask entry, against a strided scalar transpose into a
 * bias tile and a second pass over it (what the generic path keeps). The x86
 * paths use it (SSE2 is in every x86-64 CPU). */
#if ATTN_X86_DISPATCH
#include <emmintrin.h>
#include <xmmintrin.h>

static inline void attn_transpose_16x16_u8(const uint8_t *m, ptrdiff_t m_rs, __m128i e[16])
{
    __m128i a[16], b[16], c[16], d[16];
    int x;
    for (x = 0; x < 16; x++) a[x] = _mm_loadu_si128((const __m128i *)(const void *)(m + x * m_rs));
    for (x = 0; x < 8; x++) {  /* bytes of row pairs */
        b[2 * x] = _mm_unpacklo_epi8(a[2 * x], a[2 * x + 1]);
        b[2 * x + 1] = _mm_unpackhi_epi8(a[2 * x], a[2 * x + 1]);
    }
    for (x = 0; x < 4; x++) {  /* 16-bit pairs of row quads */
        c[4 * x] = _mm_unpacklo_epi16(b[4 * x], b[4 * x + 2]);
        c[4 * x + 1] = _mm_unpackhi_epi16(b[4 * x], b[4 * x + 2]);
        c[4 * x + 2] = _mm_unpacklo_epi16(b[4 * x + 1], b[4 * x + 3]);
        c[4 * x + 3] = _mm_unpackhi_epi16(b[4 * x + 1], b[4 * x + 3]);
    }
    for (x = 0; x < 2; x++) {  /* 32-bit quads of row octets */
        const int o = 8 * x;
        d[o] = _mm_unpacklo_epi32(c[o], c[o + 4]);
        d[o + 1] = _mm_unpackhi_epi32(c[o], c[o + 4]);
        d[o + 2] = _mm_unpacklo_epi32(c[o + 1], c[o + 5]);
        d[o + 3] = _mm_unpackhi_epi32(c[o + 1], c[o + 5]);
        d[o + 4] = _mm_unpacklo_epi32(c[o + 2], c[o + 6]);
        d[o + 5] = _mm_unpackhi_epi32(c[o + 2], c[o + 6]);
        d[o + 6] = _mm_unpacklo_epi32(c[o + 3], c[o + 7]);
        d[o + 7] = _mm_unpackhi_epi32(c[o + 3], c[o + 7]);
    }
    for (x = 0; x < 8; x++) {  /* e[j]: key j of the 16 rows */
        e[2 * x] = _mm_unpacklo_epi64(d[x], d[x + 8]);
        e[2 * x + 1] = _mm_unpackhi_epi64(d[x], d[x + 8]);
    }
}

/* -inf where the mask byte is 0, s itself elsewhere (NaN too), on 4 lanes of
 * 32 (float) or 2 of 64 (double) bits: ``masked`` all-ones where masked. */
static inline void attn_mask_blend(void *s, __m128i masked, __m128i ninf)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)s);
    _mm_storeu_si128((__m128i *)s, _mm_or_si128(_mm_and_si128(masked, ninf), _mm_andnot_si128(masked, x)));
}

static inline void attn_bool_mask_16x16_f32(const uint8_t *m, ptrdiff_t m_rs, float *s, ptrdiff_t ld)
{
    const __m128i zero = _mm_setzero_si128(), ninf = _mm_set1_epi32((int)0xFF800000u);
    __m128i e[16];
    int j;
    attn_transpose_16x16_u8(m, m_rs, e);
    for (j = 0; j < 16; j++) {
        const __m128i z = _mm_cmpeq_epi8(e[j], zero);  /* 0xff: masked (False) */
        const __m128i lo = _mm_unpacklo_epi8(z, z), hi = _mm_unpackhi_epi8(z, z);
        float *o = s + j * ld;
        attn_mask_blend(o, _mm_unpacklo_epi16(lo, lo), ninf);
        attn_mask_blend(o + 4, _mm_unpackhi_epi16(lo, lo), ninf);
        attn_mask_blend(o + 8, _mm_unpacklo_epi16(hi, hi), ninf);
        attn_mask_blend(o + 12, _mm_unpackhi_epi16(hi, hi), ninf);
    }
}

static inline void attn_bool_mask_16x16_f64(const uint8_t *m, ptrdiff_t m_rs, double *s, ptrdiff_t ld)
{
    const __m128i zero = _mm_setzero_si128(), ninf = _mm_set1_epi64x((long long)0xFFF0000000000000ull);
    __m128i e[16];
    int j, h;
    attn_transpose_16x16_u8(m, m_rs, e);
    for (j = 0; j < 16; j++) {
        const __m128i z = _mm_cmpeq_epi8(e[j], zero);
        const __m128i w[2] = {_mm_unpacklo_epi8(z, z), _mm_unpackhi_epi8(z, z)};  /* 16-bit */
        double *o = s + j * ld;
        for (h = 0; h < 2; h++) {
            const __m128i lo = _mm_unpacklo_epi16(w[h], w[h]), hi = _mm_unpackhi_epi16(w[h], w[h]);  /* 32-bit */
            attn_mask_blend(o + 8 * h, _mm_unpacklo_epi32(lo, lo), ninf);
            attn_mask_blend(o + 8 * h + 2, _mm_unpackhi_epi32(lo, lo), ninf);
            attn_mask_blend(o + 8 * h + 4, _mm_unpacklo_epi32(hi, hi), ninf);
            attn_mask_blend(o + 8 * h + 6, _mm_unpackhi_epi32(hi, hi), ninf);
        }
    }
}
/* The avx2-fma path's float32 bool tile: the same result as
 * attn_bool_mask_16x16_f32, each key's 16 compare bytes sign-extended to two
 * 256-bit lane masks that blend -inf into the scores (10 instructions a key
 * instead of 27 on 128-bit halves). */
static __attribute__((target("avx2"))) inline void attn_bool_mask_16x16_f32_avx2(const uint8_t *m, ptrdiff_t m_rs,
                                                                                float *s, ptrdiff_t ld)
{
    const __m128i zero = _mm_setzero_si128();
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m128i e[16];
    int j;
    attn_transpose_16x16_u8(m, m_rs, e);
    for (j = 0; j < 16; j++) {
        const __m128i z = _mm_cmpeq_epi8(e[j], zero);  /* 0xff: masked (False) */
        const __m256 lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(z));
        const __m256 hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(z, 8)));
        float *o = s + j * ld;
        _mm256_storeu_ps(o, _mm256_blendv_ps(_mm256_loadu_ps(o), ninf, lo));
        _mm256_storeu_ps(o + 8, _mm256_blendv_ps(_mm256_loadu_ps(o + 8), ninf, hi));
    }
}

/* A 16 x 16 tile of a float mask (rows m_rs elements apart, contiguous keys)
 * added to the key-major score tile: s[j * ld + i] += m[i * m_rs + j], by
 * 4 x 4 (float32) or 2 x 2 (float64) SSE transposes in registers (a scalar
 * transpose stores one element per entry, ld apart, and a second pass adds
 * it). The same one rounding, s + m, as the vector add of the bias tile. */
static inline void attn_float_mask_16x16_f32(const float *m, ptrdiff_t m_rs, float *s, ptrdiff_t ld)
{
    int bi, bj;
    for (bi = 0; bi < 16; bi += 4)
        for (bj = 0; bj < 16; bj += 4) {
            const float *src = m + bi * m_rs + bj;
            __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + m_rs);
            __m128 r2 = _mm_loadu_ps(src + 2 * m_rs), r3 = _mm_loadu_ps(src + 3 * m_rs);
            float *dst = s + bj * ld + bi;
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
            _mm_storeu_ps(dst, _mm_add_ps(_mm_loadu_ps(dst), r0));
            _mm_storeu_ps(dst + ld, _mm_add_ps(_mm_loadu_ps(dst + ld), r1));
            _mm_storeu_ps(dst + 2 * ld, _mm_add_ps(_mm_loadu_ps(dst + 2 * ld), r2));
            _mm_storeu_ps(dst + 3 * ld, _mm_add_ps(_mm_loadu_ps(dst + 3 * ld), r3));
        }
}

static inline void attn_float_mask_16x16_f64(const double *m, ptrdiff_t m_rs, double *s, ptrdiff_t ld)
{
    int bi, bj;
    for (bi = 0; bi < 16; bi += 2)
        for (bj = 0; bj < 16; bj += 2) {
            const double *src = m + bi * m_rs + bj;
            const __m128d r0 = _mm_loadu_pd(src), r1 = _mm_loadu_pd(src + m_rs);
            double *dst = s + bj * ld + bi;
            _mm_storeu_pd(dst, _mm_add_pd(_mm_loadu_pd(dst), _mm_unpacklo_pd(r0, r1)));
            _mm_storeu_pd(dst + ld, _mm_add_pd(_mm_loadu_pd(dst + ld), _mm_unpackhi_pd(r0, r1)));
        }
}
#define ATTN_BOOL_MASK_16X16 1  /* the x86 paths; the generic one keeps the scalar transpose */

/* The AVX-512 paths' float32 mask tiles: the same results by 512-bit
 * registers, a row of 16 per vector. r[u] <- column u of the 16 x 16 matrix
 * of 32-bit words whose row u was r[u] (64 shuffles; also the avx512-amx
 * path's transpose of P's pairs). */
static __attribute__((target("avx512f"))) inline void attn_transpose_16x16_avx512(__m512i r[16])
{
    __m512i t[16];
    int g, c;
    for (g = 0; g < 16; g += 2) {   /* 32-bit pairs of rows g, g + 1, in each 128-bit lane */
        t[g] = _mm512_unpacklo_epi32(r[g], r[g + 1]);
        t[g + 1] = _mm512_unpackhi_epi32(r[g], r[g + 1]);
    }
    for (g = 0; g < 16; g += 4) {   /* r[g + c] lane L: column 4L + c of rows g..g+3 */
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (c = 0; c < 4; c++) {       /* column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
        const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        const __m512i u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(u0, w0, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(u0, w0, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(u1, w1, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(u1, w1, 0xDD);
    }
    for (c = 0; c < 16; c++) r[c] = t[c];
}

/* s[j * ld + i] += m[i * m_rs + j] (as attn_float_mask_16x16_f32) */
static __attribute__((target("avx512f"))) inline void attn_float_mask_16x16_f32_avx512(const float *m, ptrdiff_t m_rs,
                                                                                  float *s, ptrdiff_t ld)
{
    __m512i r[16];
    int u;
    for (u = 0; u < 16; u++) r[u] = _mm512_castps_si512(_mm512_loadu_ps(m + u * m_rs));
    attn_transpose_16x16_avx512(r);
    for (u = 0; u < 16; u++)
        _mm512_storeu_ps(s + u * ld, _mm512_add_ps(_mm512_loadu_ps(s + u * ld), _mm512_castsi512_ps(r[u])));
}

/* qt[e * ld + i] = scale * q[i * q_rs + e] for i, e < 16: a 16 x 16 block of the
 * register tiles' transposed, pre-scaled query (FN(load_q)), each product the
 * scalar loop's. The scalar transpose it replaces (a gather of one element per
 * row) took 2.9 % of a float32 prefill (2 x 1024 causal, H32/8 E128, 1 thread). */
static __attribute__((target("avx512f"))) inline void attn_scaled_transpose_16x16_f32_avx512(
    const float *q, ptrdiff_t q_rs, float scale, float *qt, ptrdiff_t ld)
{
    const __m512 s = _mm512_set1_ps(scale);
    __m512i r[16];
    int u;
    for (u = 0; u < 16; u++) r[u] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(q + u * q_rs), s));
    attn_transpose_16x16_avx512(r);
    for (u = 0; u < 16; u++) _mm512_storeu_ps(qt + u * ld, _mm512_castsi512_ps(r[u]));
}

/* float64: r[u] <- column u of the 8 x 8 matrix of doubles whose row u was r[u] */
static __attribute__((target("avx512f"))) inline void attn_transpose_8x8_avx512(__m512d r[8])
{
    __m512d t[8];
    int g;
    for (g = 0; g < 8; g += 2) {    /* lane pairs (2L, 2L + 1) of rows g, g + 1 */
        t[g] = _mm512_unpacklo_pd(r[g], r[g + 1]);
        t[g + 1] = _mm512_unpackhi_pd(r[g], r[g + 1]);
    }
    for (g = 0; g < 8; g += 4) {    /* 128-bit lanes 0, 2 | 1, 3 of row quads */
        r[g] = _mm512_shuffle_f64x2(t[g], t[g + 2], 0x88);
        r[g + 1] = _mm512_shuffle_f64x2(t[g + 1], t[g + 3], 0x88);
        r[g + 2] = _mm512_shuffle_f64x2(t[g], t[g + 2], 0xDD);
        r[g + 3] = _mm512_shuffle_f64x2(t[g + 1], t[g + 3], 0xDD);
    }
    for (g = 0; g < 4; g++) {       /* the two row quads' halves */
        t[g] = _mm512_shuffle_f64x2(r[g], r[4 + g], 0x88);
        t[4 + g] = _mm512_shuffle_f64x2(r[g], r[4 + g], 0xDD);
    }
    for (g = 0; g < 8; g++) r[g] = t[g];
}

/* s[j * ld + i] += m[i * m_rs + j] (as attn_float_mask_16x16_f64), by 8 x 8 blocks */
static __attribute__((target("avx512f"))) inline void attn_float_mask_16x16_f64_avx512(const double *m, ptrdiff_t m_rs,
                                                                                      double *s, ptrdiff_t ld)
{
    __m512d r[8];
    int bi, bj, u;
    for (bi = 0; bi < 16; bi += 8)
        for (bj = 0; bj < 16; bj += 8) {
            for (u = 0; u < 8; u++) r[u] = _mm512_loadu_pd(m + (bi + u) * m_rs + bj);
            attn_transpose_8x8_avx512(r);
            for (u = 0; u < 8; u++) {
                double *o = s + (bj + u) * ld + bi;
                _mm512_storeu_pd(o, _mm512_add_pd(_mm512_loadu_pd(o), r[u]));
            }
        }
}

/* s[j * ld + i] = -inf where m[i * m_rs + j] == 0, float64: two masked stores a key */
static __attribute__((target("avx512f"))) inline void attn_bool_mask_16x16_f64_avx512(const uint8_t *m, ptrdiff_t m_rs,
                                                                                     double *s, ptrdiff_t ld)
{
    const __m512d ninf = _mm512_set1_pd(-INFINITY);
    const __m512i zero = _mm512_setzero_si512();
    __m128i e[16];
    int j;
    attn_transpose_16x16_u8(m, m_rs, e);
    for (j = 0; j < 16; j++) {
        _mm512_mask_storeu_pd(s + j * ld, _mm512_cmpeq_epi64_mask(_mm512_cvtepu8_epi64(e[j]), zero), ninf);
        _mm512_mask_storeu_pd(s + j * ld + 8,
                              _mm512_cmpeq_epi64_mask(_mm512_cvtepu8_epi64(_mm_srli_si128(e[j], 8)), zero), ninf);
    }
}

/* s[j * ld + i] = -inf where m[i * m_rs + j] == 0 (as attn_bool_mask_16x16_f32):
 * each key's 16 bytes compared into a lane mask, one masked store */
static __attribute__((target("avx512f"))) inline void attn_bool_mask_16x16_f32_avx512(const uint8_t *m, ptrdiff_t m_rs,
                                                                                 float *s, ptrdiff_t ld)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m128i e[16];
    int j;
    attn_transpose_16x16_u8(m, m_rs, e);
    for (j = 0; j < 16; j++)
        _mm512_mask_storeu_ps(s + j * ld, _mm512_cmpeq_epi32_mask(_mm512_cvtepu8_epi32(e[j]), _mm512_setzero_si512()),
                              ninf);
}
#endif

/* ------------------------------------------------- paged rows
 * A paged K/V (attn_problem.pages): the address of key row j of one matrix
 * whose page list is `pages` (a->pages + a->page_rows[b]) and whose element
 * [0, 0] of page 0 is `base` (K's or V's, with its page stride and row
 * stride), and the rows of j's page from j on. */
static inline const char *attn_paged_row(const attn_problem *a, const int32_t *pages, const char *base,
                                         int64_t page_elems, int64_t s_row, int64_t j)
{
    return base + (pages[j / a->page_size] * page_elems + (j % a->page_size) * s_row)
                  * (int64_t)attn_kind_kv_size(a->kind);
}

static inline int64_t attn_paged_run(const attn_problem *a, int64_t j) { return a->page_size - j % a->page_size; }

/* A decode block's P V prefetches the V rows of keys a tile further on (FN(pv)): of the n
   keys from t0, how many lie below the block's end; those past ws->v_pf_end join it, so
   that the scores skip their V rows. */
static inline ptrdiff_t attn_v_prefetch_keys(attn_ws *ws, int64_t t0, ptrdiff_t n)
{
    const ptrdiff_t m = t0 >= ws->kv_end ? 0 : ws->kv_end - t0 < n ? (ptrdiff_t)(ws->kv_end - t0) : n;
    if (t0 <= ws->v_pf_end && t0 + m > ws->v_pf_end) ws->v_pf_end = t0 + m;
    return m;
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
#define KV_VLOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32( \
    _mm_loadu_si128((const __m128i *)(const void *)(p))))
#define KV_GET(p) ((float)*(p))
#define ATTN_KIND ATTN_F32_KVQ8
#define FN(name) ATTN_PASTE(name, avx512_f32kvq8)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) attn_e4m3_over256_avx512(p)
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, avx512_f32kve4m3)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) attn_e5m2_avx512(p)
#define KV_GET(p) attn_e5m2_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVE5M2
#define FN(name) ATTN_PASTE(name, avx512_f32kve5m2)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512-vnni: q8_0 decode scores by integer dot products (attn_simd_q8dot.h),
   in the avx512-bf16 and avx512-amx paths (their CPUs all have VNNI) */
#define ATTN_TGT __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
#define KV_VLOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32( \
    _mm_loadu_si128((const __m128i *)(const void *)(p))))
#define KV_GET(p) ((float)*(p))
#define ATTN_Q8_VNNI 1
#define ATTN_KIND ATTN_F32_KVQ8
#define FN(name) ATTN_PASTE(name, avx512vnni_f32kvq8)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512vl: float8 e4m3 caches widened with three-input logic, in the avx512-bf16 and
   avx512-amx paths (their CPUs all have AVX-512VL) */
#define ATTN_TGT __attribute__((target("avx512f,avx512vl,avx512bw,f16c,fma")))
#define KV_VLOAD(p) attn_e4m3_over256_avx512vl(p)
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, avx512vl_f32kve4m3)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512vbmi: float8 e4m3 caches widened by table (attn_e4m3_over256_vbmi), in the
   avx512-bf16 and avx512-amx paths where the CPU has AVX512_VBMI (attn_table); a bfloat16
   query's decode rows by vdpbf16ps over the tables' bfloat16s (attn_simd_e4m3dot.h) */
#define ATTN_TGT __attribute__((target("avx512f,avx512vl,avx512bw,avx512vbmi,avx512bf16,avx2,fma,f16c")))
#define ATTN_DPBF16 1
#define ATTN_E4M3_DOT 1
#define KV_VLOAD(p) attn_e4m3_over256_vbmi(p)
#define KV_VLOAD4(p, out) attn_e4m3_over256_vbmi64((p), (out))
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, avx512vbmi_f32kve4m3)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512-amx with AVX512_VBMI: the same tables for a float8 e4m3 cache, a bfloat16 query's
   blocks on AMX tiles over the tables' bfloat16s (attn_simd_bf16dot.h, ATTN_AMX), its decode
   rows on the float32 template's FMAs (attn_simd_e4m3dot.h says why) */
#define ATTN_TGT __attribute__((target("avx512f,avx512vl,avx512bw,avx512vbmi,avx512bf16,avx2,fma,f16c," \
                                       "amx-tile,amx-bf16")))
#define ATTN_DPBF16 1
#define ATTN_E4M3_DOT 1
#define ATTN_AMX 1
#define KV_VLOAD(p) attn_e4m3_over256_vbmi(p)
#define KV_VLOAD4(p, out) attn_e4m3_over256_vbmi64((p), (out))
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, avx512amx_f32kve4m3)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512-bf16: bfloat16 problems' products by vdpbf16ps (attn_simd_bf16dot.h);
   the other kinds of this path are avx512's */
#define ATTN_TGT __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma")))
#define KV_VLOAD(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(p))), 16))
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_DPBF16 1
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, avx512bf16_f32kvbf16)
#include "attn_simd_impl.h"
#undef ATTN_TGT
/* avx512-amx: the same products by AMX tiles (attn_simd_bf16dot.h, ATTN_AMX) */
#define ATTN_TGT __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma,amx-tile,amx-bf16")))
#define KV_VLOAD(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(p))), 16))
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_DPBF16 1
#define ATTN_AMX 1
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, avx512amx_f32kvbf16)
#include "attn_simd_impl.h"
#undef ATTN_TGT
#define ATTN_TGT __attribute__((target("avx512f,f16c,fma")))
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
/* decode P.V: column strips as wide as 16 registers allow for 1-3 rows
   (attn_simd_impl.h, ATTN_PVR_NV); float32 bool mask tiles by 256-bit blends */
#define ATTN_PVR_WIDE 1
#define ATTN_BOOL_MASK_AVX2 1
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
#define KV_VLOAD(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32( \
    _mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define KV_GET(p) ((float)*(p))
#define ATTN_KIND ATTN_F32_KVQ8
#define FN(name) ATTN_PASTE(name, avx2_f32kvq8)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) attn_e4m3_over256_avx2(p)
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, avx2_f32kve4m3)
#include "attn_simd_impl.h"
#define KV_VLOAD(p) attn_e5m2_avx2(p)
#define KV_GET(p) attn_e5m2_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVE5M2
#define FN(name) ATTN_PASTE(name, avx2_f32kve5m2)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX2_F32
#define ATTN_OPS_AVX2_F64
#include "attn_simd_ops.h"
#define ATTN_KIND ATTN_F64
#define FN(name) ATTN_PASTE(name, avx2_f64)
#include "attn_simd_impl.h"
#undef ATTN_OPS_AVX2_F64
#undef ATTN_PVR_WIDE
#undef ATTN_BOOL_MASK_AVX2
#undef MR_QK
#undef NR_QK
#undef MR_PV
#undef NR_PV
#undef ATTN_TGT
#endif /* ATTN_X86_DISPATCH */

/* generic: baseline vector extensions, or scalar C */
#undef ATTN_BOOL_MASK_16X16
#define ATTN_BOOL_MASK_16X16 0
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
/* narrower K/V: no KV_VLOAD, so the template widens V_L values one by one with KV_GET (FN(kv_widen)) */
#define KV_GET(p) attn_half_to_float(*(p))
#define ATTN_KIND ATTN_F32_KV16
#define FN(name) ATTN_PASTE(name, generic_f32kv16)
#include "attn_simd_impl.h"
#define KV_GET(p) attn_bf16_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVBF16
#define FN(name) ATTN_PASTE(name, generic_f32kvbf16)
#include "attn_simd_impl.h"
#define KV_GET(p) ((float)*(p))
#define ATTN_KIND ATTN_F32_KVQ8
#define FN(name) ATTN_PASTE(name, generic_f32kvq8)
#include "attn_simd_impl.h"
#define KV_GET(p) attn_e4m3_over256(*(p))
#define KV_UNIT 256
#define ATTN_KIND ATTN_F32_KVE4M3
#define FN(name) ATTN_PASTE(name, generic_f32kve4m3)
#include "attn_simd_impl.h"
#define KV_GET(p) attn_e5m2_to_float(*(p))
#define ATTN_KIND ATTN_F32_KVE5M2
#define FN(name) ATTN_PASTE(name, generic_f32kve5m2)
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
static const attn_kernels *const attn_tables[ATTN_N_PATHS][ATTN_N_KINDS] = {
    {&table_generic_f32, &table_generic_f64, &table_generic_f32kv16, &table_generic_f32kvbf16,
     &table_generic_f32kvq8, &table_generic_f32kve4m3, &table_generic_f32kve5m2},
#if ATTN_X86_DISPATCH
    {&table_avx2_f32, &table_avx2_f64, &table_avx2_f32kv16, &table_avx2_f32kvbf16,
     &table_avx2_f32kvq8, &table_avx2_f32kve4m3, &table_avx2_f32kve5m2},
    {&table_avx512_f32, &table_avx512_f64, &table_avx512_f32kv16, &table_avx512_f32kvbf16,
     &table_avx512_f32kvq8, &table_avx512_f32kve4m3, &table_avx512_f32kve5m2},
    /* avx512-bf16: vdpbf16ps for all-bfloat16 problems, vpdpbusd for q8_0
       decode scores, AVX-512VL's float8 e4m3 widening, avx512's kernels for the rest */
    {&table_avx512_f32, &table_avx512_f64, &table_avx512_f32kv16, &table_avx512bf16_f32kvbf16,
     &table_avx512vnni_f32kvq8, &table_avx512vl_f32kve4m3, &table_avx512_f32kve5m2},
    /* avx512-amx: AMX tiles for all-bfloat16 problems, the rest as avx512-bf16 */
    {&table_avx512_f32, &table_avx512_f64, &table_avx512_f32kv16, &table_avx512amx_f32kvbf16,
     &table_avx512vnni_f32kvq8, &table_avx512vl_f32kve4m3, &table_avx512_f32kve5m2},
#else
    {NULL, NULL, NULL, NULL, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL, NULL, NULL}, {NULL, NULL, NULL, NULL, NULL, NULL, NULL},
#endif
};

/* The chosen path's table for one element kind; an e4m3 cache on the avx512-bf16 and
   avx512-amx paths takes AVX512_VBMI's tables where the CPU has them (attn_simd_vbmi). */
static inline const attn_kernels *attn_table(int kind)
{
#if ATTN_X86_DISPATCH
    if (kind == ATTN_F32_KVE4M3 && attn_simd_vbmi && attn_simd_path_id == ATTN_PATH_AVX512AMX)
        return &table_avx512amx_f32kve4m3;
    if (kind == ATTN_F32_KVE4M3 && attn_simd_vbmi && attn_simd_path_id == ATTN_PATH_AVX512BF16)
        return &table_avx512vbmi_f32kve4m3;
#endif
    return attn_tables[attn_simd_path_id][kind];
}

/* 1 when an e4m3 cache takes AVX512_VBMI's tables now (attn_table; attn.backends()["e4m3_tables"]) */
static inline int attn_e4m3_tables(void)
{
#if ATTN_X86_DISPATCH
    const attn_kernels *t = attn_table(ATTN_F32_KVE4M3);
    return t == &table_avx512vbmi_f32kve4m3 || t == &table_avx512amx_f32kve4m3;
#else
    return 0;
#endif
}

/* 1 when element kind `kind` now runs an instance with AMX tiles (ATTN_AMX: a bfloat16 cache's
   and, with AVX512_VBMI's tables, an e4m3 cache's on the avx512-amx path): attn_table's choice. */
static inline int attn_amx_table(int kind)
{
#if ATTN_X86_DISPATCH
    const attn_kernels *t = attn_table(kind);
    return t == &table_avx512amx_f32kvbf16 || t == &table_avx512amx_f32kve4m3;
#else
    (void)kind;
    return 0;
#endif
}

/* Whether the avx512-amx path runs a block of nq rows of problem a on AMX tiles. */
static inline int attn_amx_block(const attn_problem *a, int64_t nq)
{
    return attn_amx_table(a->kind) && attn_amx_shape(a, nq);
}

/* Keys per tile for a block of nq rows of problem a: ATTN_BK_AMX where the
 * avx512-amx path runs the block on AMX tiles, ATTN_BK_TILES for the other
 * blocks of the register tiles (more than ATTN_DOT_MAX_Q rows), else (the
 * rows layout's dot products) ATTN_BK. A function of the shape and the path
 * alone, like every other cut. (The scratch is sized for the plan's largest
 * block: a decode call's stays small.) */
static inline int64_t attn_key_tile(const attn_problem *a, int64_t nq)
{
    if (attn_amx_block(a, nq)) return ATTN_BK_AMX;
    return nq > ATTN_DOT_MAX_Q ? ATTN_BK_TILES : ATTN_BK;
}

/* Back to the tiles' initial state (TILERELEASE) on the calling thread, after
 * a bfloat16 query's problem on an AMX instance configured them (FN(begin)): the
 * kernels' driver calls it as each thread finishes its items, so no thread
 * keeps AMX state in use between calls. */
#if ATTN_X86_DISPATCH
static __attribute__((target("amx-tile"))) void attn_amx_release(void) { _tile_release(); }
#endif
static inline void attn_tiles_release(const attn_problem *a)
{
#if ATTN_X86_DISPATCH
    if (a->q_bf16 && attn_amx_table(a->kind))
        attn_amx_release();
#else
    (void)a;
#endif
}

/* Whether the current path rounds the query of problem a (its kind and
 * shape) to q8_0: the paths whose q8_0 kernels are the avx512-vnni instance
 * (the table above), ATTN_Q8_DOT_SHAPE. */
static inline int attn_q8_rounds_query(const attn_problem *a)
{
    return (attn_simd_path_id == ATTN_PATH_AVX512BF16 || attn_simd_path_id == ATTN_PATH_AVX512AMX)
        && ATTN_Q8_DOT_SHAPE(a);
}

/* The benchmark's softmax yardstick (attn/apps/bench/_yardsticks.pyx, through attn._kernels'
 * tile_softmax_rounds): iters rounds of the current path's float32 tile softmax, its table's
 * online_softmax as a register-tile block runs it between its products (m_new, alpha, P = exp(S -
 * m_new) written over S, l), over a key-major tile of ATTN_SOFTMAX_RATE_KEYS keys and 16 query
 * rows that stays in L1 (16 KiB), on the calling thread. The first round's scores lie in [-8, 0),
 * a causal prefill's spread; later rounds read the P before them (in (0, 1]): the same operations,
 * none of them an underflow. Returns the scores done. */
#define ATTN_SOFTMAX_RATE_KEYS 256   /* a register-tile block's keys (ATTN_BK_TILES) */
static inline double attn_tile_softmax_rounds(int64_t iters)
{
    float s[ATTN_SOFTMAX_RATE_KEYS * 16] __attribute__((aligned(64)));
    float m[16] __attribute__((aligned(64))), l[16] __attribute__((aligned(64)));
    float alpha[16] __attribute__((aligned(64)));
    const attn_kernels *K = attn_table(ATTN_F32);
    attn_ws ws;
    int64_t it, j;
    memset(&ws, 0, sizeof ws);
    for (j = 0; j < ATTN_SOFTMAX_RATE_KEYS * 16; j++) s[j] = -8.0f * (float)((j * 37 + 11) % 251) / 251.0f;
    for (j = 0; j < 16; j++) { m[j] = -INFINITY; l[j] = 0; alpha[j] = 1; }
    ws.s = s; ws.m = m; ws.l = l; ws.alpha = alpha;
    ws.nq = 16; ws.bqp = 16; ws.ld = 16;   /* (more rows than the decode rows' layout: the tiles') */
    for (it = 0; it < iters; it++) K->online_softmax(&ws, ATTN_SOFTMAX_RATE_KEYS);
    return (double)ATTN_SOFTMAX_RATE_KEYS * 16 * (double)iters;
}

#endif /* ATTN_SIMD_H */
