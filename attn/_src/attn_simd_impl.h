/* Kernel template: included by attn_simd.h once per (instruction set, dtype).
 *
 * Expects: ATTN_IS_F64 (0/1), FN(name) (adds the instance suffix), the V_*
 * operations of attn_simd_ops.h, and the register-tile shape:
 *   MR_QK x NR_QK  score tile: MR_QK keys x NR_QK vectors of queries
 *   MR_PV x NR_PV  output tile: MR_PV query rows x NR_PV vectors of columns
 * and ATTN_TGT (a target attribute or nothing) put on every function.
 */

/* The dtype's element type, block sizes and argument struct; undefined again
 * (with ATTN_IS_F64 and FN) at the end of this file. */
#if ATTN_IS_F64
#define T double
#define ATTN_BQ ATTN_BQ_F64
#define ATTN_BK ATTN_BK_F64
#define ARGS attn_mat_f64
#else
#define T float
#define ATTN_BQ ATTN_BQ_F32
#define ATTN_BK ATTN_BK_F32
#define ARGS attn_mat_f32
#endif

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
    /* min(HI, x) written so that NaN stays NaN: x < HI ? x : HI is false for NaN;
       then >= LO (NaN stays NaN, see V_MAX), so that 2^n is built from a
       normal exponent, never from -inf's bits, and the product never
       underflows (a microcode assist on x86); x < LO selects 0 below */
    V_T xc = V_SEL_LT(V_SET1(EXP_HI), x, V_SET1(EXP_HI), x);
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
#undef EXP_POLY

/* --------------------------------------------------- score tile micro-kernel
 * s[r][c] = sum_e k[r][e] * qt[e][c] for r < nr keys, c < nv * V_L queries.
 * qt is the packed, pre-scaled query block transposed (query index fastest),
 * so the tile is key-major: row r of s holds one key's scores for V_L-wide
 * runs of queries, and the per-query max/sum of the softmax vectorize. */
static ATTN_TGT ATTN_INLINE void FN(qk_tile)(const T *k, ptrdiff_t k_rs, ptrdiff_t k_cs,
                                              const T *qt, ptrdiff_t ldq, T *s, ptrdiff_t lds,
                                              ptrdiff_t d_k, const int nr, const int nv)
{
    V_T c[MR_QK][NR_QK];
    int r, v;
    ptrdiff_t e;
    for (r = 0; r < MR_QK; r++)
        for (v = 0; v < NR_QK; v++)
            c[r][v] = V_ZERO();
    /* rows r = 4g + u addressed as base[g] + off[u]: 3 + 3 registers instead of
       one per row (12 row pointers would spill) */
    const T *base[(MR_QK + 3) / 4];
    const ptrdiff_t off[4] = {0, k_rs, 2 * k_rs, 3 * k_rs};
    for (r = 0; r < (MR_QK + 3) / 4; r++) base[r] = k + 4 * r * k_rs;
    for (e = 0; e < d_k; e++) {
        V_T b[NR_QK];
        for (v = 0; v < NR_QK; v++)
            if (v < nv) b[v] = V_LOAD(qt + e * ldq + v * V_L);
        for (r = 0; r < MR_QK; r++) {
            if (r < nr) {
                V_T a = V_SET1(base[r / 4][off[r % 4]]);
                for (v = 0; v < NR_QK; v++)
                    if (v < nv) c[r][v] = V_FMA(a, b[v], c[r][v]);
            }
        }
        for (r = 0; r < (MR_QK + 3) / 4; r++) base[r] += k_cs;
    }
    for (r = 0; r < MR_QK; r++)
        if (r < nr)
            for (v = 0; v < NR_QK; v++)
                if (v < nv) V_STORE(s + r * lds + v * V_L, c[r][v]);
}

/* ------------------------------------------------- output tile micro-kernel
 * acc[r][c] = alpha[r] * acc[r][c] + sum_j p[j][r] * v[j][c] for r < nr rows
 * and c < nv * V_L columns: the online-softmax rescale of the accumulator is
 * fused into loading it. */
static ATTN_TGT ATTN_INLINE void FN(pv_tile)(const T *p, ptrdiff_t ldp, const T *v, ptrdiff_t ldv,
                                              T *acc, ptrdiff_t lda, const T *alpha,
                                              ptrdiff_t nk, const int nr, const int nv)
{
    V_T c[MR_PV][NR_PV];
    int r, w;
    ptrdiff_t j;
    for (r = 0; r < MR_PV; r++) {
        if (r < nr) {
            V_T a = V_SET1(alpha[r]);
            for (w = 0; w < NR_PV; w++)
                if (w < nv) c[r][w] = V_MUL(V_LOAD(acc + r * lda + w * V_L), a);
        }
    }
    for (j = 0; j < nk; j++) {
        V_T b[NR_PV];
        const T *pj = p + j * ldp;
        for (w = 0; w < NR_PV; w++)
            if (w < nv) b[w] = V_LOAD(v + j * ldv + w * V_L);
        for (r = 0; r < MR_PV; r++) {
            if (r < nr) {
                V_T a = V_SET1(pj[r]);
                for (w = 0; w < NR_PV; w++)
                    if (w < nv) c[r][w] = V_FMA(a, b[w], c[r][w]);
            }
        }
    }
    for (r = 0; r < MR_PV; r++)
        if (r < nr)
            for (w = 0; w < NR_PV; w++)
                if (w < nv) V_STORE(acc + r * lda + w * V_L, c[r][w]);
}

/* The switch hands the micro-kernels compile-time tile shapes, so every edge
 * shape gets its own fully unrolled, register-allocated copy. A tile taller
 * than the cases below would silently skip rows: refuse to compile it. */
#if MR_QK > 12 || MR_PV > 8 || NR_QK > 4 || NR_PV > 4
#error "attn_simd_impl.h: add switch cases for this register tile shape"
#endif
#define ATTN_QK_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(qk_tile)(k, k_rs, k_cs, qt, ldq, s, lds, d_k, NR_, NV_); break;
#define ATTN_QK_CASES(NR_) ATTN_QK_CASE(NR_, 1) ATTN_QK_CASE(NR_, 2) ATTN_QK_CASE(NR_, 3) \
    ATTN_QK_CASE(NR_, 4)

static ATTN_TGT void FN(qk_tile_any)(const T *k, ptrdiff_t k_rs, ptrdiff_t k_cs,
                                     const T *qt, ptrdiff_t ldq, T *s, ptrdiff_t lds,
                                     ptrdiff_t d_k, int nr, int nv)
{
    switch (nr * 8 + nv) {
        ATTN_QK_CASES(1) ATTN_QK_CASES(2) ATTN_QK_CASES(3) ATTN_QK_CASES(4)
#if MR_QK > 4
        ATTN_QK_CASES(5) ATTN_QK_CASES(6)
#endif
#if MR_QK > 6
        ATTN_QK_CASES(7) ATTN_QK_CASES(8)
#endif
#if MR_QK > 8
        ATTN_QK_CASES(9) ATTN_QK_CASES(10) ATTN_QK_CASES(11) ATTN_QK_CASES(12)
#endif
        default: break;
    }
}
#undef ATTN_QK_CASE
#undef ATTN_QK_CASES

#define ATTN_PV_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(pv_tile)(p, ldp, v, ldv, acc, lda, alpha, nk, NR_, NV_); break;
#define ATTN_PV_CASES(NR_) ATTN_PV_CASE(NR_, 1) ATTN_PV_CASE(NR_, 2) ATTN_PV_CASE(NR_, 3) \
    ATTN_PV_CASE(NR_, 4)

static ATTN_TGT void FN(pv_tile_any)(const T *p, ptrdiff_t ldp, const T *v, ptrdiff_t ldv,
                                     T *acc, ptrdiff_t lda, const T *alpha, ptrdiff_t nk,
                                     int nr, int nv)
{
    switch (nr * 8 + nv) {
        ATTN_PV_CASES(1) ATTN_PV_CASES(2) ATTN_PV_CASES(3) ATTN_PV_CASES(4)
#if MR_PV > 4
        ATTN_PV_CASES(5) ATTN_PV_CASES(6)
#endif
#if MR_PV > 6
        ATTN_PV_CASES(7) ATTN_PV_CASES(8)
#endif
        default: break;
    }
}
#undef ATTN_PV_CASE
#undef ATTN_PV_CASES

/* Few query rows (decode): s[j][i] = qr[i] . k[j] as dot products along d_k,
 * each key row read with full vector loads (the register tile would
 * broadcast every element of K for one useful lane). qr: [nq][d_k]. */
#define ATTN_DOT_MAX_Q 4
static ATTN_TGT void FN(qk_dot)(const T *k, ptrdiff_t k_rs, ptrdiff_t k_cs, const T *qr,
                                ptrdiff_t d_k, ptrdiff_t nq, T *s, ptrdiff_t lds, ptrdiff_t nk)
{
    const ptrdiff_t dv = d_k / V_L * V_L;
    ptrdiff_t i, j, e;
    for (j = 0; j < nk; j++) {
        const T *kr = k + j * k_rs;
        for (i = 0; i < nq; i++) {
            const T *q = qr + i * d_k;
            T sum;
            if (k_cs == 1) {
                V_T a0 = V_ZERO(), a1 = V_ZERO();
                for (e = 0; e + 2 * V_L <= dv; e += 2 * V_L) {
                    a0 = V_FMA(V_LOAD(kr + e), V_LOAD(q + e), a0);
                    a1 = V_FMA(V_LOAD(kr + e + V_L), V_LOAD(q + e + V_L), a1);
                }
                if (e < dv) a0 = V_FMA(V_LOAD(kr + e), V_LOAD(q + e), a0);
                sum = V_HSUM(V_ADD(a0, a1));
                for (e = dv; e < d_k; e++) sum += kr[e] * q[e];
            } else {
                sum = 0;
                for (e = 0; e < d_k; e++) sum += kr[e * k_cs] * q[e];
            }
            s[j * lds + i] = sum;
        }
    }
}

/* s[j][i] = scale * q[i0 + i] . k[kb + j] (+ mask), invisible entries -inf,
 * for j < nk keys and i < bqp (padded) queries; qt = packed scale * q^T;
 * s and qt have leading dimension ld. */
static ATTN_TGT void FN(scores)(const ARGS *a, const T *qt, T *s, T *mt, ptrdiff_t bqp,
                                ptrdiff_t ld, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t kb, ptrdiff_t nk)
{
    const ptrdiff_t nvq = bqp / V_L, d_k = a->d_k;
    ptrdiff_t i, j, it, jt;
    if (nq <= ATTN_DOT_MAX_Q) {
        /* qt holds the rows [nq][d_k] here (see FN(rows)) */
        FN(qk_dot)(a->k + kb * a->k_rs, a->k_rs, a->k_cs, qt, d_k, nq, s, ld, nk);
    } else {
        /* Tile t covers key rows jt and query strip it. d_k < 128: key rows
         * outermost, so each group of MR_QK key rows stays in L1 while every
         * query strip passes. d_k >= 128 (qt is 64+ KiB, more than L1): query
         * strips outermost, so one strip of qt (d_k x NR_QK vectors) stays in
         * L1 while the key rows pass (single-thread A/B runs: 1-9 % faster at
         * d_k = 128, none to 5 % slower at 64). */
        const ptrdiff_t n_jt = (nk + MR_QK - 1) / MR_QK, n_it = (nvq + NR_QK - 1) / NR_QK;
        const int strips_outer = d_k >= 128;
        ptrdiff_t t;
        for (t = 0; t < n_jt * n_it; t++) {
            jt = (strips_outer ? t % n_jt : t / n_it) * MR_QK;
            it = (strips_outer ? t / n_jt : t % n_it) * NR_QK;
            FN(qk_tile_any)(a->k + (kb + jt) * a->k_rs, a->k_rs, a->k_cs,
                            qt + it * V_L, ld, s + jt * ld + it * V_L, ld, d_k,
                            (int)(nk - jt < MR_QK ? nk - jt : MR_QK),
                            (int)(nvq - it < NR_QK ? nvq - it : NR_QK));
        }
    }
    if (a->mask_kind != ATTN_MASK_NONE) {
        /* The mask tile is row-major ([query][key]) and s key-major: first
         * transpose it into mt (bool: 0 = takes part, -inf = masked; float:
         * the bias; padding lanes 0), then apply it a vector at a time. A
         * branch per masked entry into s (mispredicted half the time on a
         * random mask) made random bool masks 2x slower than torch. A mask
         * whose rows are all the same (m_rs = 0: a key padding mask
         * broadcast over L) needs no transpose: one value per key. */
        static const T bool_bias[2] = {-ATTN_INF, 0};
        const int is_bool = a->mask_kind == ATTN_MASK_BOOL, rows_differ = a->m_rs != 0;
        ptrdiff_t iv;
        if (rows_differ) {
            for (i = 0; i < nq; i++) {
                T *mc = mt + i;
                if (is_bool) {
                    const uint8_t *mr = (const uint8_t *)a->mask + (i0 + i) * a->m_rs + kb * a->m_cs;
                    for (j = 0; j < nk; j++) mc[j * ld] = bool_bias[mr[j * a->m_cs] != 0];
                } else {
                    const T *mr = (const T *)a->mask + (i0 + i) * a->m_rs + kb * a->m_cs;
                    for (j = 0; j < nk; j++) mc[j * ld] = mr[j * a->m_cs];
                }
            }
            for (j = 0; j < nk; j++)
                for (i = nq; i < bqp; i++) mt[j * ld + i] = 0;
        }
        for (j = 0; j < nk; j++) {
            const ptrdiff_t at = (kb + j) * a->m_cs;  /* key j in the shared row */
            const V_T mrow = V_SET1(rows_differ ? (T)0
                                    : is_bool ? bool_bias[((const uint8_t *)a->mask)[at] != 0]
                                    : ((const T *)a->mask)[at]);
            for (iv = 0; iv < nvq; iv++) {
                T *sv = s + j * ld + iv * V_L;
                V_T m = mrow;
                if (rows_differ) m = V_LOAD(mt + j * ld + iv * V_L);
                if (is_bool)  /* masked (-inf < 0): -inf, whatever the score (NaN too) */
                    V_STORE(sv, V_SEL_LT(m, V_ZERO(), V_SET1(-ATTN_INF), V_LOAD(sv)));
                else
                    V_STORE(sv, V_ADD(V_LOAD(sv), m));
            }
        }
    }
    if (a->causal && kb + nk - 1 > i0 + a->causal_offset) {
        /* a tile crossing the diagonal: key kb + j is visible to row i0 + i
           iff kb + j <= i0 + i + causal_offset. Rows i < first get -inf by
           vector selects, one store per vector of rows (row indices are
           exact in T, < 2^24). */
        T lane[V_L];
        V_T vlane;
        int u;
        for (u = 0; u < V_L; u++) lane[u] = (T)u;
        vlane = V_LOAD(lane);
        for (j = 0; j < nk; j++) {
            ptrdiff_t first = kb + j - i0 - a->causal_offset; /* first visible row */
            T *sr = s + j * ld;
            V_T vfirst;
            if (first > nq) first = nq;
            vfirst = V_SET1((T)first);
            for (i = 0; i < first; i += V_L) {
                V_T row = V_ADD(vlane, V_SET1((T)i));
                V_STORE(sr + i, V_SEL_LT(row, vfirst, V_SET1(-ATTN_INF), V_LOAD(sr + i)));
            }
        }
    }
}

/* ----------------------------------------------------------- one row block
 * Rows [i0, i0 + nq) (nq <= ATTN_BQ) of one matrix against keys [j0, j1).
 * part == NULL: writes the normalized rows of a->out.
 *   and, if w != NULL, the weights w[(i0 + i) * w_rs + j] for all keys j < n_k
 *   (a second pass recomputing the scores; 0 for invisible keys, empty rows).
 * part != NULL: writes the unnormalized partial state for a split over keys:
 *   part[0 .. nq)          running max m_i
 *   part[nq .. 2nq)        running sum l_i
 *   part[2nq ..)           accumulator [nq][d_v]
 * scratch: FN(scratch_elems)(d_k, d_v) elements of T, 64-byte aligned. */
static ptrdiff_t FN(scratch_elems)(ptrdiff_t d_k, ptrdiff_t d_v)
{
    return (ptrdiff_t)(ATTN_BQ + V_L) * d_k + 2 * (ptrdiff_t)ATTN_BK * (ATTN_BQ + V_L)
           + (ptrdiff_t)ATTN_BQ * d_v + 3 * ATTN_BQ + (ptrdiff_t)ATTN_BK * (d_v + V_L) + 64;
}

static ATTN_TGT void FN(rows)(const ARGS *a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0, ptrdiff_t j1,
                              T *scratch, T *part, T *w, ptrdiff_t w_rs, T *lse)
{
    const ptrdiff_t d_k = a->d_k, d_v = a->d_v;
    const ptrdiff_t bqp = (nq + V_L - 1) / V_L * V_L;    /* padded query count */
    /* Leading dimension of qt and s: one vector more than bqp, so that rows
     * are not a power of two apart (1 KiB strides in float64 put the rows of
     * a tile in 4 of the 64 L1 sets and measured 30% slower). */
    const ptrdiff_t ld = bqp + V_L;
    const ptrdiff_t nvq = bqp / V_L;
    const ptrdiff_t dvv = d_v / V_L * V_L;               /* columns done by vectors */
    T *qt = scratch;                      /* [d_k][ld]   scale * q, transposed */
    T *s = qt + (ptrdiff_t)(ATTN_BQ + V_L) * d_k; /* [BK][ld] scores, then exp */
    T *acc = s + (ptrdiff_t)ATTN_BK * (ATTN_BQ + V_L);  /* [nq][d_v] unnormalized output */
    T *m = acc + (ptrdiff_t)ATTN_BQ * d_v;      /* [bqp] running max */
    T *l = m + ATTN_BQ;                         /* [bqp] running sum */
    T *alpha = l + ATTN_BQ;                     /* [bqp] rescale of this tile */
    T *vpack = alpha + ATTN_BQ;                 /* [BK][d_v + V_L] (see below) */
    T *mt = vpack + (ptrdiff_t)ATTN_BK * (d_v + V_L);  /* [BK][ld] mask tile, key-major */
    const T scale = a->scale;
    ptrdiff_t i, j, e, kb, jend;

    if (nq <= ATTN_DOT_MAX_Q) {
        /* dot-product scores: qt = scale * q rows [nq][d_k]; the padding
           columns of s are never written by FN(qk_dot): keep them finite */
        for (i = 0; i < nq; i++)
            for (e = 0; e < d_k; e++)
                qt[i * d_k + e] = a->q[(i0 + i) * a->q_rs + e * a->q_cs] * scale;
        for (j = 0; j < ATTN_BK; j++)
            for (i = nq; i < bqp; i++) s[j * ld + i] = 0;
    } else {
        for (e = 0; e < d_k; e++) {
            const T *qc = a->q + i0 * a->q_rs + e * a->q_cs;
            T *qrow = qt + e * ld;
            for (i = 0; i < nq; i++) qrow[i] = qc[i * a->q_rs] * scale;
            for (; i < bqp; i++) qrow[i] = 0;
        }
    }
    for (i = 0; i < bqp; i++) { m[i] = -ATTN_INF; l[i] = 0; }
    memset(acc, 0, sizeof(T) * (size_t)(nq * d_v));

    jend = j1;
    if (a->causal) {
        /* keys past the last row's horizon are invisible to the whole block */
        ptrdiff_t h = i0 + nq + a->causal_offset;
        if (h < jend) jend = h;
    }
    /* Online softmax. Invariant after each key tile [j0, kb + nk), per row i:
     *   m[i]  = max of row i's visible scores so far (-inf while none),
     *   l[i]  = sum over those scores of exp(score - m[i]),
     *   acc[i]= sum over those keys of exp(score - m[i]) * v[key].
     * A new tile raises m to m_new and multiplies l and acc by
     * alpha = exp(m_old - m_new); while m_new = -inf, exponents are taken
     * against 0 instead (exp(-inf - 0) = 0, never exp(-inf + inf) = NaN). */
    for (kb = j0; kb < jend; kb += ATTN_BK) {
        const ptrdiff_t nk = jend - kb < ATTN_BK ? jend - kb : ATTN_BK;
        const T *vb;
        ptrdiff_t ldv, it, iv;

        FN(scores)(a, qt, s, mt, bqp, ld, i0, nq, kb, nk);

        /* softmax update, V_L queries at a time */
        for (iv = 0; iv < nvq; iv++) {
            T *sc = s + iv * V_L;
            V_T mx0 = V_SET1(-ATTN_INF), mx1 = mx0, mold, mnew, msafe, al, ls0, ls1;
            for (j = 0; j + 1 < nk; j += 2) {
                mx0 = V_MAX(mx0, V_LOAD(sc + j * ld));
                mx1 = V_MAX(mx1, V_LOAD(sc + (j + 1) * ld));
            }
            if (j < nk) mx0 = V_MAX(mx0, V_LOAD(sc + j * ld));
            mold = V_LOAD(m + iv * V_L);
            mnew = V_MAX(V_MAX(mx0, mx1), mold);
            msafe = V_SEL_EQ(mnew, V_SET1(-ATTN_INF), V_ZERO(), mnew);
            al = FN(vexp)(V_SUB(mold, msafe));
            ls0 = V_ZERO(); ls1 = V_ZERO();
            for (j = 0; j + 1 < nk; j += 2) {
                V_T p0 = FN(vexp)(V_SUB(V_LOAD(sc + j * ld), msafe));
                V_T p1 = FN(vexp)(V_SUB(V_LOAD(sc + (j + 1) * ld), msafe));
                V_STORE(sc + j * ld, p0);
                V_STORE(sc + (j + 1) * ld, p1);
                ls0 = V_ADD(ls0, p0);
                ls1 = V_ADD(ls1, p1);
            }
            if (j < nk) {
                V_T p0 = FN(vexp)(V_SUB(V_LOAD(sc + j * ld), msafe));
                V_STORE(sc + j * ld, p0);
                ls0 = V_ADD(ls0, p0);
            }
            V_STORE(l + iv * V_L, V_FMA(V_LOAD(l + iv * V_L), al, V_ADD(ls0, ls1)));
            V_STORE(m + iv * V_L, mnew);
            V_STORE(alpha + iv * V_L, al);
        }

        /* acc = alpha * acc + P^T V */
        if (a->v_cs == 1 && (a->v_rs * (ptrdiff_t)sizeof(T)) % 1024 != 0) {
            vb = a->v + kb * a->v_rs;
            ldv = a->v_rs;
        } else {
            /* strided columns, or rows a multiple of 1 KiB apart (float64
               d_v = 128: a tile's rows would share 16 of the 64 L1 sets):
               copy the tile with a padded row length */
            ldv = d_v + V_L;
            for (j = 0; j < nk; j++) {
                const T *vr = a->v + (kb + j) * a->v_rs;
                T *vp = vpack + j * ldv;
                if (a->v_cs == 1) {
                    for (e = 0; e < dvv; e += V_L) V_STORE(vp + e, V_LOAD(vr + e));
                    for (; e < d_v; e++) vp[e] = vr[e];
                } else {
                    for (e = 0; e < d_v; e++) vp[e] = vr[e * a->v_cs];
                }
            }
            vb = vpack;
        }
        /* column strips outermost: a strip of the value tile (nk x NR_PV
           vectors) stays in L1 while all row tiles pass over it */
        {
            ptrdiff_t dt;
            for (dt = 0; dt < dvv; dt += NR_PV * V_L) {
                int nv = (int)((dvv - dt) / V_L < NR_PV ? (dvv - dt) / V_L : NR_PV);
                for (it = 0; it < nq; it += MR_PV) {
                    int nr = (int)(nq - it < MR_PV ? nq - it : MR_PV);
                    FN(pv_tile_any)(s + it, ld, vb + dt, ldv, acc + it * d_v + dt, d_v,
                                    alpha + it, nk, nr, nv);
                }
            }
            for (dt = dvv; dt < d_v; dt++) {       /* columns past the last vector */
                for (i = 0; i < nq; i++) {
                    T sum = acc[i * d_v + dt] * alpha[i];
                    for (j = 0; j < nk; j++) sum += s[j * ld + i] * vb[j * ldv + dt];
                    acc[i * d_v + dt] = sum;
                }
            }
        }
    }

    if (part != NULL) {
        for (i = 0; i < nq; i++) { part[i] = m[i]; part[nq + i] = l[i]; }
        memcpy(part + 2 * nq, acc, sizeof(T) * (size_t)(nq * d_v));
        return;
    }
    /* lse = m + log(l): -inf for a row that saw no key (l == 0), NaN with l */
    if (lse != NULL)
        for (i = 0; i < nq; i++)
            lse[i0 + i] = l[i] == 0 ? -ATTN_INF : m[i] + (T)log((double)l[i]);
    /* out = acc / l; a row that saw no key (l == 0) is 0, not 0/0 */
    for (i = 0; i < nq; i++) {
        T *o = a->out + (i0 + i) * a->o_rs;
        const T *ar = acc + i * d_v;
        if (l[i] == 0) {
            for (e = 0; e < d_v; e++) o[e] = 0;
        } else {
            const T inv = (T)1 / l[i];
            V_T vinv = V_SET1(inv);
            for (e = 0; e < dvv; e += V_L) V_STORE(o + e, V_MUL(V_LOAD(ar + e), vinv));
            for (; e < d_v; e++) o[e] = ar[e] * inv;
        }
    }
    if (w == NULL) return;
    for (kb = 0; kb < a->n_k; kb += ATTN_BK) {
        const ptrdiff_t nk = a->n_k - kb < ATTN_BK ? a->n_k - kb : ATTN_BK;
        ptrdiff_t iv;
        if (kb >= jend) {
            for (i = 0; i < nq; i++)
                for (j = 0; j < nk; j++) w[(i0 + i) * w_rs + kb + j] = 0;
            continue;
        }
        FN(scores)(a, qt, s, mt, bqp, ld, i0, nq, kb, nk);
        for (iv = 0; iv < nvq; iv++) {
            /* l = 0 (nothing visible): inv = 0 and msafe = 0 give weights 0 */
            T mi[V_L], inv[V_L];
            int u;
            for (u = 0; u < V_L; u++) {
                T li = l[iv * V_L + u];
                mi[u] = m[iv * V_L + u] == -ATTN_INF ? (T)0 : m[iv * V_L + u];
                inv[u] = li == 0 ? (T)0 : (T)1 / li;
            }
            for (j = 0; j < nk; j++) {
                T *sc = s + j * ld + iv * V_L;
                V_STORE(sc, V_MUL(FN(vexp)(V_SUB(V_LOAD(sc), V_LOAD(mi))), V_LOAD(inv)));
            }
        }
        for (i = 0; i < nq; i++)
            for (j = 0; j < nk; j++) w[(i0 + i) * w_rs + kb + j] = s[j * ld + i];
    }
}

/* ------------------------------------------------------------ softmax row
 * out[j] = softmax(x[j] (+ mask[j]))_j over one row of n; a row with nothing
 * visible is all 0; NaN anywhere in the row makes the row NaN. */
static ATTN_TGT void FN(softmax_row)(const T *x, ptrdiff_t xs, const void *mask, int kind,
                                     ptrdiff_t ms, T *out, ptrdiff_t n)
{
    ptrdiff_t j, nv = n / V_L * V_L;
    T mx, total, inv;
    V_T vm0 = V_SET1(-ATTN_INF), vm1 = vm0, vs0 = V_ZERO(), vs1 = V_ZERO(), vmax;
    if (kind == ATTN_MASK_NONE && xs == 1) {
        if (x != out) memcpy(out, x, sizeof(T) * (size_t)n);
    } else {
        for (j = 0; j < n; j++) out[j] = x[j * xs];
        if (kind == ATTN_MASK_BOOL) {
            const uint8_t *mk = (const uint8_t *)mask;
            for (j = 0; j < n; j++) if (!mk[j * ms]) out[j] = -ATTN_INF;
        } else if (kind == ATTN_MASK_ADD) {
            const T *mk = (const T *)mask;
            for (j = 0; j < n; j++) out[j] += mk[j * ms];
        }
    }
    for (j = 0; j + 2 * V_L <= nv; j += 2 * V_L) {
        vm0 = V_MAX(vm0, V_LOAD(out + j));
        vm1 = V_MAX(vm1, V_LOAD(out + j + V_L));
    }
    for (; j < nv; j += V_L) vm0 = V_MAX(vm0, V_LOAD(out + j));
    mx = V_HMAX(V_MAX(vm0, vm1));
    for (j = nv; j < n; j++) if (out[j] > mx) mx = out[j];
    if (mx == -ATTN_INF) {
        /* nothing visible; a NaN (which max may have passed over) still wins */
        int has_nan = 0;
        for (j = 0; j < n; j++) has_nan |= out[j] != out[j];
        for (j = 0; j < n; j++) out[j] = has_nan ? (T)ATTN_NAN : (T)0;
        return;
    }
    vmax = V_SET1(mx);
    for (j = 0; j + 2 * V_L <= nv; j += 2 * V_L) {
        V_T p0 = FN(vexp)(V_SUB(V_LOAD(out + j), vmax));
        V_T p1 = FN(vexp)(V_SUB(V_LOAD(out + j + V_L), vmax));
        V_STORE(out + j, p0);
        V_STORE(out + j + V_L, p1);
        vs0 = V_ADD(vs0, p0);
        vs1 = V_ADD(vs1, p1);
    }
    for (; j < nv; j += V_L) {
        V_T p0 = FN(vexp)(V_SUB(V_LOAD(out + j), vmax));
        V_STORE(out + j, p0);
        vs0 = V_ADD(vs0, p0);
    }
    total = V_HSUM(V_ADD(vs0, vs1));
    for (j = nv; j < n; j++) {
        /* the tail through the same vector exp, one lane used */
        T tmp[V_L];
        int u;
        for (u = 0; u < V_L; u++) tmp[u] = out[j] - mx;
        V_STORE(tmp, FN(vexp)(V_LOAD(tmp)));
        out[j] = tmp[0];
        total += tmp[0];
    }
    inv = (T)1 / total;
    {
        V_T vinv = V_SET1(inv);
        for (j = 0; j < nv; j += V_L) V_STORE(out + j, V_MUL(V_LOAD(out + j), vinv));
        for (; j < n; j++) out[j] *= inv;
    }
}

#undef EXP_MAGIC
#undef EXP_LOG2E
#undef EXP_LN2HI
#undef EXP_LN2LO
#undef EXP_LO
#undef EXP_HI
#undef T
#undef ATTN_BQ
#undef ATTN_BK
#undef ARGS
#undef ATTN_IS_F64
#undef FN
