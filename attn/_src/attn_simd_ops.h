/* Vector operations for the attention kernels, one set per instruction set.
 *
 * attn_simd.h defines ATTN_OPS_<ISA>_<TYPE> before including this file (once
 * per instance), and the kernel template (attn_simd_impl.h) is written only
 * in terms of the V_* macros below:
 *
 *   V_T           vector type          V_L            lanes
 *   V_LOAD(p)     unaligned load       V_STORE(p, v)  unaligned store
 *   V_SET1(x)     broadcast            V_ZERO()       all zero
 *   V_ADD/SUB/MUL/DIV  V_FMA(a, b, c) = a*b + c (fused where the ISA has FMA)
 *   V_MAX(a, b)   lane max; when a lane of either is NaN the result is b
 *   V_MIN(a, b)   lane min; the same for NaN
 *   V_SEL_LT(x, y, a, b)  x < y ? a : b  (ordered compare: NaN -> b)
 *   V_SEL_EQ(x, y, a, b)  x == y ? a : b (NaN -> b)
 *   V_POW2N(t)    2^n where t = n + V_MAGIC (n integer, exactly), see exp
 *   V_POW2N_ZERO  (AVX2 only) defined where V_POW2N of n = -bias (127, 1023)
 *                 is exactly +0 (the biased exponent and the mantissa all zero)
 *   V_HSUM(v), V_HMAX(v)  horizontal sum / max to a scalar
 *   V_HSUM4(a, b, c, d, out)  the four horizontal sums into out[0..3] (shuffles
 *                 shared between them: the decode dot products' reduction)
 *   V_ROUND(x), V_SCALEF(a, n)  (AVX-512 only) round to nearest, a * 2^floor(n)
 *   V_SCALEF_UNLESS_LT(x, y, a, n)  (AVX-512 float32 only) x < y ? 0 : a * 2^floor(n)
 *                 (ordered compare: NaN -> a * 2^floor(n))
 *   V_STREAM(p, v)  (x86 only) non-temporal store, p aligned to V_L elements;
 *                 the writer fences (_mm_sfence) before others read them
 *
 * No -ffast-math anywhere: the exp below relies on IEEE rounding of t - MAGIC.
 */

#undef V_T
#undef V_L
#undef V_LOAD
#undef V_STORE
#undef V_SET1
#undef V_ZERO
#undef V_ADD
#undef V_SUB
#undef V_MUL
#undef V_DIV
#undef V_FMA
#undef V_MAX
#undef V_MIN
#undef V_SEL_LT
#undef V_SEL_EQ
#undef V_POW2N
#undef V_HSUM
#undef V_HSUM4
#undef V_HMAX
#undef V_SCALEF
#undef V_ROUND
#undef V_SCALEF_UNLESS_LT
#undef V_STREAM
#undef V_POW2N_ZERO
#undef ATTN_GV_EXPBIAS
#undef ATTN_GV_MANT

/* ------------------------------------------------------------------ AVX-512 */
#if defined(ATTN_OPS_AVX512_F32)
#define V_T __m512
#define V_L 16
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_STREAM(p, v) _mm512_stream_ps((p), (v))
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_DIV(a, b) _mm512_div_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_MIN(a, b) _mm512_min_ps((a), (b))
#define V_SEL_LT(x, y, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (y), _CMP_LT_OQ), (b), (a))
#define V_SEL_EQ(x, y, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (y), _CMP_EQ_OQ), (b), (a))
#define V_POW2N(t) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127)), 23))
#define V_HSUM(v) _mm512_reduce_add_ps(v)
#define V_HMAX(v) _mm512_reduce_max_ps(v)
/* The horizontal sums of a, b, c, d as one 128-bit vector: their 256-bit halves added, then their
   128-bit quarters, then the four lanes of each quarter; every sum the same tree, whichever place its
   vector has: 13 instructions, where three hadds of half sums took 18 uops */
static ATTN_TGT inline __m128 attn_hsum4_avx512_f32_v(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));   /* quarter k: a, b, c, d */
    u = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(1, 0, 3, 2)));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(
        _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), u));
}
static ATTN_TGT inline void attn_hsum4_avx512_f32(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    _mm_storeu_ps(out, attn_hsum4_avx512_f32_v(a, b, c, d));
}
#define V_HSUM4(a, b, c, d, out) attn_hsum4_avx512_f32((a), (b), (c), (d), (out))
#define V_ROUND(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_SCALEF(a, n) _mm512_scalef_ps((a), (n))
#define V_SCALEF_UNLESS_LT(x, y, a, n) _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask((x), (y), _CMP_NLT_UQ), (a), (n))

#elif defined(ATTN_OPS_AVX512_F64)
#define V_T __m512d
#define V_L 8
#define V_LOAD(p) _mm512_loadu_pd(p)
#define V_STORE(p, v) _mm512_storeu_pd((p), (v))
#define V_STREAM(p, v) _mm512_stream_pd((p), (v))
#define V_SET1(x) _mm512_set1_pd(x)
#define V_ZERO() _mm512_setzero_pd()
#define V_ADD(a, b) _mm512_add_pd((a), (b))
#define V_SUB(a, b) _mm512_sub_pd((a), (b))
#define V_DIV(a, b) _mm512_div_pd((a), (b))
#define V_MUL(a, b) _mm512_mul_pd((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define V_MAX(a, b) _mm512_max_pd((a), (b))
#define V_MIN(a, b) _mm512_min_pd((a), (b))
#define V_SEL_LT(x, y, a, b) _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), (y), _CMP_LT_OQ), (b), (a))
#define V_SEL_EQ(x, y, a, b) _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), (y), _CMP_EQ_OQ), (b), (a))
#define V_POW2N(t) _mm512_castsi512_pd(_mm512_slli_epi64( \
    _mm512_add_epi64(_mm512_castpd_si512(t), _mm512_set1_epi64(1023)), 52))
#define V_HSUM(v) _mm512_reduce_add_pd(v)
#define V_HMAX(v) _mm512_reduce_max_pd(v)
static ATTN_TGT inline __m256d attn_half_add_avx512_f64(__m512d v) {
    return _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
}
static ATTN_TGT inline void attn_hsum4_avx512_f64(__m512d a, __m512d b, __m512d c, __m512d d, double *out) {
    __m256d x = _mm256_hadd_pd(attn_half_add_avx512_f64(a), attn_half_add_avx512_f64(b));
    __m256d y = _mm256_hadd_pd(attn_half_add_avx512_f64(c), attn_half_add_avx512_f64(d));
    _mm_storeu_pd(out, _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1)));
    _mm_storeu_pd(out + 2, _mm_add_pd(_mm256_castpd256_pd128(y), _mm256_extractf128_pd(y, 1)));
}
#define V_HSUM4(a, b, c, d, out) attn_hsum4_avx512_f64((a), (b), (c), (d), (out))
#define V_ROUND(x) _mm512_roundscale_pd((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_SCALEF(a, n) _mm512_scalef_pd((a), (n))

/* --------------------------------------------------------------- AVX2 + FMA */
#elif defined(ATTN_OPS_AVX2_F32)
#define V_T __m256
#define V_L 8
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_STREAM(p, v) _mm256_stream_ps((p), (v))
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_DIV(a, b) _mm256_div_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_MIN(a, b) _mm256_min_ps((a), (b))
#define V_SEL_LT(x, y, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), (y), _CMP_LT_OQ))
#define V_SEL_EQ(x, y, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), (y), _CMP_EQ_OQ))
#define V_POW2N(t) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23))
#define V_POW2N_ZERO 1
static ATTN_TGT inline float attn_hsum_avx2_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static ATTN_TGT inline float attn_hmax_avx2_f32(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define V_HSUM(v) attn_hsum_avx2_f32(v)
#define V_HMAX(v) attn_hmax_avx2_f32(v)
static ATTN_TGT inline void attn_hsum4_avx2_f32(__m256 a, __m256 b, __m256 c, __m256 d, float *out) {
    __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1)));
}
#define V_HSUM4(a, b, c, d, out) attn_hsum4_avx2_f32((a), (b), (c), (d), (out))

#elif defined(ATTN_OPS_AVX2_F64)
#define V_T __m256d
#define V_L 4
#define V_LOAD(p) _mm256_loadu_pd(p)
#define V_STORE(p, v) _mm256_storeu_pd((p), (v))
#define V_STREAM(p, v) _mm256_stream_pd((p), (v))
#define V_SET1(x) _mm256_set1_pd(x)
#define V_ZERO() _mm256_setzero_pd()
#define V_ADD(a, b) _mm256_add_pd((a), (b))
#define V_SUB(a, b) _mm256_sub_pd((a), (b))
#define V_DIV(a, b) _mm256_div_pd((a), (b))
#define V_MUL(a, b) _mm256_mul_pd((a), (b))
#define V_FMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define V_MAX(a, b) _mm256_max_pd((a), (b))
#define V_MIN(a, b) _mm256_min_pd((a), (b))
#define V_SEL_LT(x, y, a, b) _mm256_blendv_pd((b), (a), _mm256_cmp_pd((x), (y), _CMP_LT_OQ))
#define V_SEL_EQ(x, y, a, b) _mm256_blendv_pd((b), (a), _mm256_cmp_pd((x), (y), _CMP_EQ_OQ))
#define V_POW2N(t) _mm256_castsi256_pd(_mm256_slli_epi64( \
    _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023)), 52))
#define V_POW2N_ZERO 1
static ATTN_TGT inline double attn_hsum_avx2_f64(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
static ATTN_TGT inline double attn_hmax_avx2_f64(__m256d v) {
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}
#define V_HSUM(v) attn_hsum_avx2_f64(v)
#define V_HMAX(v) attn_hmax_avx2_f64(v)
static ATTN_TGT inline void attn_hsum4_avx2_f64(__m256d a, __m256d b, __m256d c, __m256d d, double *out) {
    __m256d x = _mm256_hadd_pd(a, b), y = _mm256_hadd_pd(c, d);
    _mm_storeu_pd(out, _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1)));
    _mm_storeu_pd(out + 2, _mm_add_pd(_mm256_castpd256_pd128(y), _mm256_extractf128_pd(y, 1)));
}
#define V_HSUM4(a, b, c, d, out) attn_hsum4_avx2_f64((a), (b), (c), (d), (out))

/* ------------------------------------- generic: GCC/clang vector extensions */
#elif defined(ATTN_OPS_GVEC_F32) || defined(ATTN_OPS_GVEC_F64)
#undef ATTN_GV
#if defined(ATTN_OPS_GVEC_F32)
#define ATTN_GV(n) attn_gvf_##n
typedef float ATTN_GV(v) __attribute__((vector_size(16)));
typedef int32_t ATTN_GV(i) __attribute__((vector_size(16)));
typedef float ATTN_GV(s);
#define V_L 4
#define ATTN_GV_EXPBIAS 127
#define ATTN_GV_MANT 23
#else
#define ATTN_GV(n) attn_gvd_##n
typedef double ATTN_GV(v) __attribute__((vector_size(16)));
typedef int64_t ATTN_GV(i) __attribute__((vector_size(16)));
typedef double ATTN_GV(s);
#define V_L 2
#define ATTN_GV_EXPBIAS 1023
#define ATTN_GV_MANT 52
#endif
#define V_T ATTN_GV(v)
static inline ATTN_GV(v) ATTN_GV(load)(const ATTN_GV(s) *p) {
    ATTN_GV(v) v; memcpy(&v, p, sizeof v); return v;
}
static inline void ATTN_GV(store)(ATTN_GV(s) *p, ATTN_GV(v) v) { memcpy(p, &v, sizeof v); }
static inline ATTN_GV(v) ATTN_GV(set1)(ATTN_GV(s) x) { ATTN_GV(v) v = {0}; return v + x; }
static inline ATTN_GV(v) ATTN_GV(sel)(ATTN_GV(i) m, ATTN_GV(v) a, ATTN_GV(v) b) {
    return (ATTN_GV(v))((m & (ATTN_GV(i))a) | (~m & (ATTN_GV(i))b));
}
static inline ATTN_GV(s) ATTN_GV(hsum)(ATTN_GV(v) v) {
    ATTN_GV(s) s = 0; int i; for (i = 0; i < V_L; i++) s += v[i]; return s;
}
static inline ATTN_GV(s) ATTN_GV(hmax)(ATTN_GV(v) v) {
    ATTN_GV(s) s = v[0]; int i; for (i = 1; i < V_L; i++) s = v[i] > s ? v[i] : s; return s;
}
#define V_LOAD(p) ATTN_GV(load)(p)
#define V_STORE(p, v) ATTN_GV(store)((p), (v))
#define V_SET1(x) ATTN_GV(set1)(x)
#define V_ZERO() ATTN_GV(set1)(0)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_DIV(a, b) ((a) / (b))
#define V_MUL(a, b) ((a) * (b))
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_MAX(a, b) ATTN_GV(sel)((ATTN_GV(i))((a) > (b)), (a), (b))
#define V_MIN(a, b) ATTN_GV(sel)((ATTN_GV(i))((a) < (b)), (a), (b))
#define V_SEL_LT(x, y, a, b) ATTN_GV(sel)((ATTN_GV(i))((x) < (y)), (a), (b))
#define V_SEL_EQ(x, y, a, b) ATTN_GV(sel)((ATTN_GV(i))((x) == (y)), (a), (b))
#define V_POW2N(t) ((V_T)(((ATTN_GV(i))(t) + ATTN_GV_EXPBIAS) << ATTN_GV_MANT))
#define V_HSUM(v) ATTN_GV(hsum)(v)
#define V_HMAX(v) ATTN_GV(hmax)(v)

/* ------------------------------------------ scalar: any C compiler (VL = 1) */
#elif defined(ATTN_OPS_SCALAR_F32) || defined(ATTN_OPS_SCALAR_F64)
#if defined(ATTN_OPS_SCALAR_F32)
#define V_T float
static inline float attn_sc_pow2n_f32(float t) {
    uint32_t u; memcpy(&u, &t, 4); u = (u + 127u) << 23; memcpy(&t, &u, 4); return t;
}
#define V_POW2N(t) attn_sc_pow2n_f32(t)
#else
#define V_T double
static inline double attn_sc_pow2n_f64(double t) {
    uint64_t u; memcpy(&u, &t, 8); u = (u + 1023u) << 52; memcpy(&t, &u, 8); return t;
}
#define V_POW2N(t) attn_sc_pow2n_f64(t)
#endif
#define V_L 1
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(x) (x)
#define V_ZERO() ((V_T)0)
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_DIV(a, b) ((a) / (b))
#define V_MUL(a, b) ((a) * (b))
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define V_MAX(a, b) ((a) > (b) ? (a) : (b))
#define V_MIN(a, b) ((a) < (b) ? (a) : (b))
#define V_SEL_LT(x, y, a, b) ((x) < (y) ? (a) : (b))
#define V_SEL_EQ(x, y, a, b) ((x) == (y) ? (a) : (b))
#define V_HSUM(v) (v)
#define V_HMAX(v) (v)
#else
#error "attn_simd_ops.h: no ATTN_OPS_* instance selected"
#endif

#ifndef V_HSUM4
#define V_HSUM4(a, b, c, d, out) do {                                   \
        (out)[0] = V_HSUM(a); (out)[1] = V_HSUM(b);                     \
        (out)[2] = V_HSUM(c); (out)[3] = V_HSUM(d);                     \
    } while (0)
#endif
