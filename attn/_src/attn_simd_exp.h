/* The vector exp of every kernel (forward attn_simd_impl.h and backward
 * attn_backward_impl.h): included by those templates once per instance.
 *
 * Expects ATTN_IS_F64, FN(name), the V_* operations of attn_simd_ops.h,
 * ATTN_TGT and ATTN_INLINE; defines FN(lanes), FN(vexp), FN(vtanh_times),
 * FN(vexp_shifted), FN(softcap_run), FN(alibi_run) (on T) and leaves no
 * other macro. */

/* Each lane's index (exact in T), V_LOAD(FN(lanes)) for any V_L <= 16. */
static const T FN(lanes)[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* ------------------------------------------------------------------ exp(x)
 * Branch-free, for the x <= 0 that softmax produces (also correct up to
 * x ~ 88 in float32 / 709 in float64). Cody-Waite: n = round(x / ln2) by the
 * 1.5 * 2^mant "magic number" addition (round to nearest even, exact for
 * |n| < 2^22), r = x - n*ln2 in two parts (ln2_hi has trailing zero bits so
 * n*ln2_hi is exact even without FMA), exp(r) by a polynomial on
 * |r| <= ln2/2, times 2^n built in the exponent field.
 *   float32: degree-6 minimax polynomial, ~1.5 ulp.
 *   float64: Taylor series to r^12 (truncation < 2e-16 relative), ~1-2 ulp.
 * x < LO (where the result would be subnormal) and x = -inf give exactly 0;
 * NaN gives NaN (the ordered compare is false for NaN and keeps the NaN
 * that the arithmetic produced). */
#if ATTN_IS_F64
#define EXP_MAGIC 6755399441055744.0      /* 1.5 * 2^52 */
#define EXP_LOG2E 1.4426950408889634
#define EXP_LN2HI 6.93145751953125E-1
#define EXP_LN2LO 1.42860682030941723212E-6
#define EXP_LO (-708.0)
#define EXP_HI 709.0
#else
#define EXP_MAGIC 12582912.0f              /* 1.5 * 2^23 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2HI 0.693359375f
#define EXP_LN2LO (-2.12194440e-4f)
#define EXP_LO (-87.0f)
#define EXP_HI 88.0f
#endif

#if ATTN_IS_F64
/* e^r on |r| <= ln2/2: Taylor series to r^12 (truncation < 2e-16 relative) */
#define EXP_POLY(p, r) do {                                   \
    p = V_SET1(1.0 / 479001600.0);                             \
    p = V_FMA(p, r, V_SET1(1.0 / 39916800.0));                 \
    p = V_FMA(p, r, V_SET1(1.0 / 3628800.0));                  \
    p = V_FMA(p, r, V_SET1(1.0 / 362880.0));                   \
    p = V_FMA(p, r, V_SET1(1.0 / 40320.0));                    \
    p = V_FMA(p, r, V_SET1(1.0 / 5040.0));                     \
    p = V_FMA(p, r, V_SET1(1.0 / 720.0));                      \
    p = V_FMA(p, r, V_SET1(1.0 / 120.0));                      \
    p = V_FMA(p, r, V_SET1(1.0 / 24.0));                       \
    p = V_FMA(p, r, V_SET1(1.0 / 6.0));                        \
    p = V_FMA(p, r, V_SET1(0.5));                              \
    p = V_FMA(p, r, V_SET1(1.0));                              \
    p = V_FMA(p, r, V_SET1(1.0));                              \
} while (0)
#else
/* e^r on |r| <= ln2/2: degree-6 minimax fit (relative error 2e-9, ~1.5 ulp
   after float32 rounding) */
#define EXP_POLY(p, r) do {                                   \
    p = V_SET1(1.3844169128524014e-3f);                        \
    p = V_FMA(p, r, V_SET1(8.374152633914448e-3f));            \
    p = V_FMA(p, r, V_SET1(4.166799317085059e-2f));            \
    p = V_FMA(p, r, V_SET1(1.666643131377838e-1f));            \
    p = V_FMA(p, r, V_SET1(4.9999994243678075e-1f));           \
    p = V_FMA(p, r, V_SET1(1.0000000321421072f));              \
    p = V_FMA(p, r, V_SET1(1.0f));                             \
} while (0)
#endif

#ifdef V_SCALEF
/* AVX-512: n = round(x / ln2) by vrndscale, 2^n applied by vscalef. x is
 * first clamped to >= EXP_LO, so that vscalef never underflows: a result
 * below the normal range (every masked -inf score) costs a microcode assist
 * per vector without flush-to-zero, which measured as about 40 % of the time
 * of small causal calls. x < EXP_LO (-inf included) then selects exactly 0,
 * as on the other paths; NaN stays NaN (V_MAX returns its second operand
 * when either is NaN, and the ordered compare is false for NaN). */
static ATTN_TGT ATTN_INLINE V_T FN(vexp)(V_T x)
{
    V_T xc = V_MAX(V_SET1(EXP_LO), x);
    V_T n = V_ROUND(V_MUL(xc, V_SET1(EXP_LOG2E)));
    V_T r = V_FMA(n, V_SET1(-EXP_LN2HI), xc), p;
    r = V_FMA(n, V_SET1(-EXP_LN2LO), r);
    EXP_POLY(p, r);
    return V_SEL_LT(x, V_SET1(EXP_LO), V_ZERO(), V_SCALEF(p, n));
}
#else
static ATTN_TGT ATTN_INLINE V_T FN(vexp)(V_T x)
{
    /* min(HI, x) written so that NaN stays NaN: HI < x ? HI : x is false for NaN
       (V_MIN(a, b) is a < b ? a : b on every path);
       then >= LO (NaN stays NaN, see V_MAX), so that 2^n is built from a
       normal exponent, never from -inf's bits, and the product never
       underflows (a microcode assist on x86); x < LO selects 0 below */
    V_T xc = V_MIN(V_SET1(EXP_HI), x);  /* (HI < x ? HI : x), one instruction */
    xc = V_MAX(V_SET1(EXP_LO), xc);
    V_T t = V_FMA(xc, V_SET1(EXP_LOG2E), V_SET1(EXP_MAGIC));
    V_T n = V_SUB(t, V_SET1(EXP_MAGIC));
    V_T r = V_FMA(n, V_SET1(-EXP_LN2HI), xc), p;
    r = V_FMA(n, V_SET1(-EXP_LN2LO), r);
    EXP_POLY(p, r);
    p = V_MUL(p, V_POW2N(t));
    return V_SEL_LT(x, V_SET1(EXP_LO), V_ZERO(), p);
}
#endif

/* --------------------------------------------------------- exp(s - m)
 * The register tiles' softmax exponentiates whole S tiles: exp(s - m) of a
 * score s against its row's running max m (x = s - m <= 0).
 *   AVX-512 float32: 2^y, y = x log2(e) (FlashAttention-2's exp2): n =
 *     round(y) and the rest r = y - n is exact (|r| <= 1/2), so no Cody-Waite
 *     split; 2^r by FN(vexp)'s polynomial with its coefficients times ln2^k
 *     (the same fit on the same interval, |r ln2| <= ln2/2); the select of 0
 *     below LO folded into vscalef's zero mask. Error: the rounding of y,
 *     u |s - m|, on top of the subtraction's (FN(vexp)(s - m): both), plus
 *     the polynomial's ~1.5 ulp. 13 vector operations against FN(vexp)'s 15.
 *     y < -125 (a masked -inf score, or a weight near the smallest normal)
 *     gives exactly 0, NaN stays NaN.
 *   AVX2 (V_POW2N_ZERO): FN(vexp)'s steps on x = s - m without its upper
 *     clamp (x <= 0) and without its select of 0: x is clamped below at
 *     EXP_LO_SHIFTED, where n = round(x / ln2) is -127 (float64: -1023), whose
 *     2^n built in the exponent field is exactly +0, so the product is 0 for
 *     every x below about -127.5 ln2 (-1023.5 ln2), -inf included. Between
 *     that and EXP_LO the result is e^x (below the smallest normal: a few
 *     subnormal ulps), where FN(vexp) gives 0: both far below a weight's
 *     rounding against the row's largest, 1. NaN stays NaN. 15 vector
 *     operations against 19.
 *   elsewhere: FN(vexp)(s - m) (the magic-number rounding already leaves an
 *     exact rest; an exp2 saves no operation). */
#if !ATTN_IS_F64 && defined(V_SCALEF)
static ATTN_TGT ATTN_INLINE V_T FN(vexp_shifted)(V_T s, V_T m)
{
    const V_T lo = V_SET1(-125.0f);
    V_T y = V_MUL(V_SUB(s, m), V_SET1(EXP_LOG2E));
    V_T yc = V_MAX(lo, y);   /* (NaN stays NaN, see V_MAX) */
    V_T n = V_ROUND(yc);
    V_T r = V_SUB(yc, n);
    V_T p = V_SET1(1.535393375584812e-4f);
    p = V_FMA(p, r, V_SET1(1.339887012856382e-3f));
    p = V_FMA(p, r, V_SET1(9.618435311352543e-3f));
    p = V_FMA(p, r, V_SET1(5.5503324881684406e-2f));
    p = V_FMA(p, r, V_SET1(2.4022647930267851e-1f));
    p = V_FMA(p, r, V_SET1(6.931472028391563e-1f));
    p = V_FMA(p, r, V_SET1(1.0f));
    return V_SCALEF_UNLESS_LT(y, lo, p, n);
}
#elif defined(V_POW2N_ZERO)
#if ATTN_IS_F64
#define EXP_LO_SHIFTED (-709.0)   /* x / ln2 = -1022.87: n = -1023 */
#else
#define EXP_LO_SHIFTED (-88.0f)   /* x / ln2 = -126.96: n = -127 */
#endif
static ATTN_TGT ATTN_INLINE V_T FN(vexp_shifted)(V_T s, V_T m)
{
    V_T xc = V_MAX(V_SET1(EXP_LO_SHIFTED), V_SUB(s, m));   /* (NaN stays NaN, see V_MAX) */
    V_T t = V_FMA(xc, V_SET1(EXP_LOG2E), V_SET1(EXP_MAGIC));
    V_T n = V_SUB(t, V_SET1(EXP_MAGIC));
    V_T r = V_FMA(n, V_SET1(-EXP_LN2HI), xc), p;
    r = V_FMA(n, V_SET1(-EXP_LN2LO), r);
    EXP_POLY(p, r);
    return V_MUL(p, V_POW2N(t));
}
#undef EXP_LO_SHIFTED
#else
static ATTN_TGT ATTN_INLINE V_T FN(vexp_shifted)(V_T s, V_T m)
{
    return FN(vexp)(V_SUB(s, m));
}
#endif

/* ------------------------------------------------------------ soft-capping
 * x[j] = cap tanh(x[j] / cap) for j < n (attn/_variants.py). NaN stays NaN.
 * Shared by the forward's score tiles and the backward's rows, so both cap
 * alike; a vector at a time, the last partial one through a copy.
 *   float32: tanh(y) = y P(y^2) / Q(y^2), y clamped to +-7.905 (where tanh
 *     rounds to +-1), Eigen's rational minimax (GenericPacketMathFunctions.h,
 *     ptanh_float): within 4.4 ulp of tanh, 2.7e-7 absolute over the line,
 *     and no exp (the exp of the cap's first form made a capped call 1.22x
 *     the plain one at T = 1024; this form, the paired bench's variants row),
 *     the clamp a min and a max, cap folded into P's coefficients;
 *   float64: tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2 |y|) in (0, 1]
 *     through the vector exp (no overflow; absolute error a few u).
 * Either is a few cap u on the capped score, below the rounding of the dot
 * product it caps. */
static ATTN_TGT ATTN_INLINE V_T FN(vtanh_times)(V_T x, T cap)
{
#if !ATTN_IS_F64
    const V_T hi = V_SET1((T)7.90531110763549805), lo = V_SET1((T)-7.90531110763549805);
    V_T y = V_MUL(x, V_SET1((T)1 / cap)), y2, p, q;
    y = V_MAX(lo, V_MIN(hi, y));  /* clamp; NaN: both keep y */
    y2 = V_MUL(y, y);
    /* P's coefficients times cap: cap y P / Q without a last multiply */
    p = V_FMA(y2, V_SET1((T)-2.76076847742355e-16 * cap), V_SET1((T)2.00018790482477e-13 * cap));
    p = V_FMA(y2, p, V_SET1((T)-8.60467152213735e-11 * cap));
    p = V_FMA(y2, p, V_SET1((T)5.12229709037114e-08 * cap));
    p = V_FMA(y2, p, V_SET1((T)1.48572235717979e-05 * cap));
    p = V_FMA(y2, p, V_SET1((T)6.37261928875436e-04 * cap));
    p = V_FMA(y2, p, V_SET1((T)4.89352455891786e-03 * cap));
    q = V_FMA(y2, V_SET1((T)1.19825839466702e-06), V_SET1((T)1.18534705686654e-04));
    q = V_FMA(y2, q, V_SET1((T)2.26843463243900e-03));
    q = V_FMA(y2, q, V_SET1((T)4.89352518554385e-03));
    return V_DIV(V_MUL(y, p), q);
#else
    const V_T zero = V_ZERO(), one = V_SET1((T)1);
    const V_T e = FN(vexp)(V_MUL(V_MAX(x, V_SUB(zero, x)), V_SET1((T)-2 / cap)));  /* exp(-2 |x| / cap) */
    const V_T t = V_MUL(V_SET1(cap), V_DIV(V_SUB(one, e), V_ADD(one, e)));
    return V_SEL_LT(x, zero, V_SUB(zero, t), t);
#endif
}

static ATTN_TGT void FN(softcap_run)(T *x, ptrdiff_t n, T cap)
{
    T tail[V_L];
    ptrdiff_t j, u;
    for (j = 0; j + V_L <= n; j += V_L) V_STORE(x + j, FN(vtanh_times)(V_LOAD(x + j), cap));
    if (j < n) {  /* padding 0: tanh 0 = 0 */
        for (u = 0; u < n - j; u++) tail[u] = x[j + u];
        for (; u < V_L; u++) tail[u] = 0;
        V_STORE(tail, FN(vtanh_times)(V_LOAD(tail), cap));
        for (u = 0; u < n - j; u++) x[j + u] = tail[u];
    }
}

/* ------------------------------------------------------------------ ALiBi
 * x[c] -= slope |first + sign c| for c < n, sign +-1: the distances along a
 * run of scores (attn/_variants.py), integers below 2^24 in magnitude, exact
 * in T; a vector of them is the first plus the lanes' indices. Not fused
 * (s - slope |d|, two roundings) in the vectors and the scalar tail alike.
 * Shared by the forward's score tiles and the backward's rows, so both bias
 * alike. */
static ATTN_TGT void FN(alibi_run)(T *x, ptrdiff_t n, T first, T sign, T slope)
{
    const V_T vslope = V_SET1(slope), zero = V_ZERO(), vsign = V_SET1(sign);
    const V_T step = V_MUL(vsign, V_SET1((T)V_L));
    V_T d = V_ADD(V_SET1(first), V_MUL(vsign, V_LOAD(FN(lanes))));
    ptrdiff_t c;
    for (c = 0; c + V_L <= n; c += V_L) {
        V_STORE(x + c, V_SUB(V_LOAD(x + c), V_MUL(vslope, V_MAX(d, V_SUB(zero, d)))));
        d = V_ADD(d, step);
    }
    for (; c < n; c++) {
        const T dc = first + sign * (T)c;
        x[c] = x[c] - slope * (dc < 0 ? -dc : dc);
    }
}

#undef EXP_POLY
#undef EXP_MAGIC
#undef EXP_LOG2E
#undef EXP_LN2HI
#undef EXP_LN2LO
#undef EXP_LO
#undef EXP_HI
