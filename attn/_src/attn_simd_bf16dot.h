/* bfloat16 dot products (AVX512_BF16's vdpbf16ps) for the register tiles:
 * included by attn_simd_impl.h in the avx512-bf16 and avx512-amx (ATTN_AMX)
 * instances of kind ATTN_F32_KVBF16 (ATTN_DPBF16) and in the avx512vbmi and
 * avx512-amx instances of kind ATTN_F32_KVE4M3 (with ATTN_E4M3_DOT: K and V
 * looked up as bfloat16 into the packs, attn_simd_e4m3dot.h), used for a
 * block when ATTN_BF16_BLOCK(a, ws):
 * the caller's query was bfloat16 (a->q_bf16, so q's float32 values round to
 * bfloat16 exactly) and the block takes the register tiles.
 *
 * _mm512_dpbf16_ps(c, x, y) adds x[2u] y[2u] + x[2u+1] y[2u+1] to float32
 * lane u: the products are exact in float32, the sums round (and the
 * instruction treats subnormal inputs and results as zero). The reduction
 * index runs in pairs, so both operands are packed as pairs, one 32-bit word
 * each (the lower-indexed element in the low half):
 *   Q.K^T (reduction over e): qt32[(e/2) ld + i] = (q[i][e], q[i][e+1]),
 *         unscaled (the scale is rarely a bfloat16: it multiplies the
 *         products instead); K from a bfloat16 copy whose rows have an even
 *         length, read as pairs along e.
 *   P.V   (reduction over keys): P rounded to bfloat16 (to nearest even, as
 *         torch's bfloat16 SDPA rounds its probabilities before the product
 *         with V; l_i stays the float32 sum) into p32[(j/2) ld + i] =
 *         (p[j][i], p[j+1][i]) in the mask tile's scratch, V into
 *         v32[(j/2) ldv + c] = (v[j][c], v[j+1][c]) in the V pack.
 * An odd count (d_k, or the block's keys) pads its last pair with a zero.
 * Everything else of the block (masks, causal, variants, softmax, the
 * columns past the last vector) is the float32 template's. */

/* 1 where this instance's vdpbf16ps pair products run: always, save the avx512-amx
 * instance of an e4m3 cache (attn_simd_e4m3dot.h says why). That instance's blocks go
 * by pairs only onto AMX tiles (ATTN_AMX_BLOCK), the others on the float32 register
 * tiles; a bfloat16 cache's avx512-amx blocks take the vdpbf16ps tiles where AMX's
 * do not fit (d_k < 32 or d_v < 16). */
#if ATTN_E4M3_DOT && ATTN_AMX
#define ATTN_PAIRS_ON_PATH 0
#define ATTN_BF16_BLOCK(a, ws) ((a)->q_bf16 && (ws)->nq > ATTN_DOT_MAX_Q && attn_amx_shape((a), (ws)->nq))
#else
#define ATTN_PAIRS_ON_PATH 1
#define ATTN_BF16_BLOCK(a, ws) ((a)->q_bf16 && (ws)->nq > ATTN_DOT_MAX_Q)
#endif
/* the avx512-amx instances (ATTN_AMX) run such a block's products on AMX
 * tiles when d_k fills at least one tile row (32 bfloat16) and d_v one tile
 * column block (16 floats); smaller heads take the vdpbf16ps tiles (an e4m3
 * cache's the float32 register tiles: ATTN_BF16_BLOCK above) */
#define ATTN_AMX_BLOCK(a, ws) attn_amx_shape((a), (ws)->nq)

/* out[0..3] = scale * the horizontal sums of a, b, c, d (attn_hsum4_avx512_f32_v's tree), for the
   decode rows' scores by pairs (FN(qk_dot_bf16_4), here and in attn_simd_e4m3dot.h): the scale
   applied to the four sums in one multiply */
static ATTN_TGT ATTN_INLINE void FN(hsum4_scaled)(__m512 a, __m512 b, __m512 c, __m512 d, __m128 scale, float *out)
{
    _mm_storeu_ps(out, _mm_mul_ps(attn_hsum4_avx512_f32_v(a, b, c, d), scale));
}

/* ------------------------------------------ decode rows' shared pieces (both caches) */
/* the bfloat16 of a float32 that is one exactly */
static inline uint32_t FN(bf16_bits)(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b >> 16;
}

/* the decode rows' query pairs: from float ATTN_DOT_MAX_Q * d_k of qt on, [ATTN_DOT_MAX_Q][d_k / 2] */
static inline uint32_t *FN(bf16q_base)(void *qt, ptrdiff_t d_k) { return (uint32_t *)((float *)qt + ATTN_DOT_MAX_Q * d_k); }

_Static_assert(ATTN_HEADS_KEYS % 2 == 0 && ATTN_BK % 16 == 0,
               "FN(heads_tile)'s runs keep the pairs of a block's keys (even run lengths)");

/* rows[u] = V's row of key key0 + u for u < n (paged or not: one page lookup a page) */
static ATTN_INLINE void FN(v_row_ptrs)(const attn_problem *a, const attn_ws *ws, int64_t key0, ptrdiff_t n,
                                       const KV_T **rows)
{
    const ptrdiff_t v_rs = a->v.s_row;
    ptrdiff_t u = 0, m;
    if (ws->pages == NULL) {
        const KV_T *v = (const KV_T *)ws->v + key0 * v_rs;
        for (; u < n; u++) rows[u] = v + u * v_rs;
        return;
    }
    while (u < n) {
        const KV_T *v = (const KV_T *)attn_paged_row(a, ws->pages, ws->v, a->v_page, v_rs, key0 + u);
        const int64_t run = attn_paged_run(a, key0 + u);
        for (m = 0; m < run && u < n; m++, u++) rows[u] = v + m * v_rs;
    }
}

/* the n <= ATTN_BK keys' P of nq rows (float32 rows ATTN_ROWS_LD apart, read to n rounded up
   to 16) rounded to bfloat16 (to nearest even), pairs of keys one word each in pw (rows
   ATTN_ROWS_LD / 2 words apart); an odd count's last key pairs with a zero */
static ATTN_TGT ATTN_INLINE void FN(p_rows_pairs)(const float *p, ptrdiff_t n, int nq, uint32_t *pw)
{
    ptrdiff_t j;
    int r;
    for (r = 0; r < nq; r++) {
        uint16_t *pr = (uint16_t *)(pw + r * (ATTN_ROWS_LD / 2));
        for (j = 0; j < n; j += 16)
            _mm256_storeu_si256((__m256i *)(void *)(pr + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * ATTN_ROWS_LD + j)));
        if (n % 2) pr[n] = 0;
    }
}

#if ATTN_E4M3_DOT
/* The avx512vbmi instance of a float8 e4m3 cache (ATTN_F32_KVE4M3): its decode rows are
 * attn_simd_e4m3dot.h's; its register tiles are these, over K and V looked up as bfloat16
 * (over KV_UNIT = 256: exact) into the K and V packs (FN(qk_bf16), FN(pack_v_pairs)). */
#include "attn_simd_e4m3dot.h"
#else
/* ------------------------------------------ decode rows (ws->bf16_dot)
 * A block of <= ATTN_DOT_MAX_Q rows (the rows layout of FN(qk_dot): a decode
 * call's heads of one K/V head) takes its scores by vdpbf16ps as well: each
 * row's d_k values as d_k / 2 pairs, unscaled (exact: they are bfloat16
 * values), in the part of qt the rows layout leaves unused (from float
 * ATTN_DOT_MAX_Q * d_k on, [ATTN_DOT_MAX_Q][d_k / 2]); a key's score is scale
 * times the sum of its 16 lanes (FN(hsum4_scaled)); FN(qk_dot) walks the
 * keys for both (FN(qk_four)). Where the float32
 * products widened every key value first, a 64-byte load now feeds one
 * vdpbf16ps per row: 32 values, not 16. The products are the register tiles'
 * (FN(qk_tile_bf16)): exact, summed in float32, inputs below 2^-126 read as
 * zero. d_k a multiple of 32 (whole vectors).
 * Not on the avx512-amx instance: the Xeons that have AMX issue vdpbf16ps on
 * one port, at half the FMA's instruction rate (a 2-core Sapphire Rapids-class
 * VM: 102 GFLOP/s a core against 204 of float32 FMAs, the benchmark's
 * yardsticks), and a decode there ran faster on the float32 template's
 * products (K widened by a shift, FMAs; P V likewise, P not rounded): 16
 * sequences of 1k-4k keys, H32/8 E128, pages of 128, 2 threads, 0.89x the
 * time of the pairs (one 4k-key sequence, cache-resident: 0.91x). Its
 * decode rows' tiles on AMX instead (K rows in place as A tiles, the query's
 * pairs as B, the scores gathered from C) ran 1.09-1.16x slower than the
 * pairs: a decode's products are not its bound there. */
#if ATTN_AMX
#define ATTN_BF16_DOT_SHAPE(a) 0
#else
#define ATTN_BF16_DOT_SHAPE(a) ((a)->q_bf16 && (a)->d_k % 32 == 0)
#endif

/* rows [row0, row0 + n) of q (float32 or, q_raw16, bfloat16: FN(q_elem)) as their pairs,
   row r at r * d_k / 2 of FN(bf16q_base) */
static ATTN_TGT void FN(bf16q_rows)(const attn_problem *a, attn_ws *ws, const char *q, int64_t n, int64_t row0)
{
    const ptrdiff_t d_k = a->d_k, q_rs = a->q.s_row, q_cs = a->q.s_col;
    const int raw16 = ATTN_Q_RAW16(a);
    uint32_t *qp = FN(bf16q_base)(ws->qt, d_k);
    ptrdiff_t i, e;
    for (i = 0; i < n; i++)
        for (e = 0; e < d_k; e += 2) {
            const ptrdiff_t at = i * q_rs + e * q_cs;
            qp[(row0 + i) * (d_k / 2) + e / 2] = FN(bf16_bits)(FN(q_elem)(q, raw16, at))
                                                 | FN(bf16_bits)(FN(q_elem)(q, raw16, at + q_cs)) << 16;
        }
}

/* FN(qk_dot4) by pairs: s[i][u] = scale * qp[i] . k4[u] for nq rows */
static ATTN_TGT ATTN_INLINE void FN(qk_dot_bf16_4)(const uint16_t *const k4[4], const uint32_t *qp, ptrdiff_t d_k,
                                                   float scale, float *s, ptrdiff_t lds, const int nq)
{
    const __m128 vs = _mm_set1_ps(scale);
    __m512 acc[ATTN_DOT_MAX_Q][4];
    ptrdiff_t e;
    int i, u;
    for (i = 0; i < nq; i++)
        for (u = 0; u < 4; u++) acc[i][u] = _mm512_setzero_ps();
    for (e = 0; e < d_k; e += 32) {
        __m512i kv[4];
        for (u = 0; u < 4; u++) kv[u] = _mm512_loadu_si512((const void *)(k4[u] + e));
        for (i = 0; i < nq; i++) {
            const __m512i qv = _mm512_loadu_si512((const void *)(qp + i * (d_k / 2) + e / 2));
            for (u = 0; u < 4; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)qv, (__m512bh)kv[u]);
        }
    }
    for (i = 0; i < nq; i++) FN(hsum4_scaled)(acc[i][0], acc[i][1], acc[i][2], acc[i][3], vs, s + i * lds);
}

/* ------------------------------------------ decode rows' P.V by pairs
 * With ws->bf16_dot (a bfloat16 query: a 16-bit model's decode), V's columns
 * contiguous and d_v a multiple of 32 (ATTN_BF16_PV_ROWS), the rows layout's
 * P.V goes by vdpbf16ps too, P rounded to bfloat16 (to nearest even, as the
 * register tiles round it; l_i stays the float32 sum of the unrounded P):
 * key pair (j, j + 1), j even counted from the call's first key, is one word
 * of P per row, (p[r][j], p[r][j+1]), broadcast against V's rows j and j + 1
 * interleaved by the in-lane 16-bit unpacks; an odd count's last key pairs
 * with zeros. The unpacks leave a 32-column strip's columns in the order
 * 0-3 8-11 16-19 24-27 (low half) and 4-7 12-15 20-23 28-31 (high half): the
 * accumulators are permuted into that order as a call loads them (times
 * alpha) and back as it stores them, so that a call over a block and calls
 * over its even runs chain the same operations. Each key's V row comes from
 * a pointer (FN(v_row_ptrs)), so a page may cut a pair: the sums are the
 * same, bit for bit, paged or not and whatever the page size. The float32
 * P.V widened every V value and took 4 FMAs per 16 columns of four rows per
 * key; the pairs take one shuffle per 16 columns of two keys and half the
 * products. */
#define ATTN_BF16_PV_ROWS(a, ws) ((ws)->bf16_dot && (a)->d_v % 32 == 0 && (a)->v.s_col == 1)

/* acc[r][c0 + c] = alpha[r] acc[r][c0 + c] + sum_j p[r][j] v[j][c0 + c] for r < nr rows and
 * c < 32 w columns (w strips of 32), the P pairs pw (rows ATTN_ROWS_LD / 2 words apart) of the
 * n keys whose V rows are rows[0, n). */
static ATTN_TGT ATTN_INLINE void FN(pv_pairs_strip)(const uint32_t *pw, const uint16_t *const *rows, ptrdiff_t n,
                                                     ptrdiff_t c0, ptrdiff_t d_v, float *acc, const float *alpha,
                                                     const int nr, const int w)
{
    /* natural columns -> the unpacks' order (to_lo, to_hi: from a strip's two halves) and back */
    const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i back0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i back1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    __m512 c[ATTN_DOT_MAX_Q][4];
    __m512i x[4];
    ptrdiff_t j;
    int r, h;
    for (r = 0; r < nr; r++) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (h = 0; h < w; h++) {
            const float *ar = acc + r * d_v + c0 + 32 * h;
            const __m512 a0 = _mm512_loadu_ps(ar), a1 = _mm512_loadu_ps(ar + 16);
            c[r][2 * h] = _mm512_mul_ps(_mm512_permutex2var_ps(a0, to_lo, a1), al);
            c[r][2 * h + 1] = _mm512_mul_ps(_mm512_permutex2var_ps(a0, to_hi, a1), al);
        }
    }
    for (j = 0; j < n; j += 2) {
        const uint16_t *v0 = rows[j] + c0, *v1 = j + 1 < n ? rows[j + 1] + c0 : NULL;
        for (h = 0; h < w; h++) {
            const __m512i y0 = _mm512_loadu_si512((const void *)(v0 + 32 * h));
            const __m512i y1 = v1 != NULL ? _mm512_loadu_si512((const void *)(v1 + 32 * h)) : _mm512_setzero_si512();
            x[2 * h] = _mm512_unpacklo_epi16(y0, y1);
            x[2 * h + 1] = _mm512_unpackhi_epi16(y0, y1);
        }
        for (r = 0; r < nr; r++) {
            const __m512i pp = _mm512_set1_epi32((int)pw[r * (ATTN_ROWS_LD / 2) + j / 2]);
            for (h = 0; h < 2 * w; h++) c[r][h] = _mm512_dpbf16_ps(c[r][h], (__m512bh)pp, (__m512bh)x[h]);
        }
    }
    for (r = 0; r < nr; r++)
        for (h = 0; h < w; h++) {
            float *ar = acc + r * d_v + c0 + 32 * h;
            _mm512_storeu_ps(ar, _mm512_permutex2var_ps(c[r][2 * h], back0, c[r][2 * h + 1]));
            _mm512_storeu_ps(ar + 16, _mm512_permutex2var_ps(c[r][2 * h], back1, c[r][2 * h + 1]));
        }
}

/* Rows layout by pairs (ATTN_BF16_PV_ROWS): acc = diag(alpha) acc + P V over the n <= ATTN_BK
 * keys of p (float32 rows ATTN_ROWS_LD apart, read to n rounded up to 16) whose V rows are
 * rows[0, n), every column of d_v (a multiple of 32). */
static ATTN_TGT void FN(pv_rows_pairs)(const float *p, const uint16_t *const *rows, ptrdiff_t n, ptrdiff_t d_v,
                                       float *acc, const float *alpha, int nq)
{
    uint32_t pw[ATTN_DOT_MAX_Q * (ATTN_ROWS_LD / 2)];
    ptrdiff_t c0;
    FN(p_rows_pairs)(p, n, nq, pw);
#define ATTN_PVP_CASE(NR_) case NR_:                                                          \
        for (c0 = 0; c0 + 64 <= d_v; c0 += 64)                                                 \
            FN(pv_pairs_strip)(pw, rows, n, c0, d_v, acc, alpha, NR_, 2);                      \
        if (c0 < d_v) FN(pv_pairs_strip)(pw, rows, n, c0, d_v, acc, alpha, NR_, 1);           \
        break;
    switch (nq) {
        ATTN_PVP_CASE(1) ATTN_PVP_CASE(2) ATTN_PVP_CASE(3)
        default: ATTN_PVP_CASE(4)
    }
#undef ATTN_PVP_CASE
}

#endif /* ATTN_E4M3_DOT */

/* rows [row0, row0 + n) of q (float32 or, q_raw16, bfloat16: FN(q_elem)) into the
   pairs of qt32 (the transposed layout) */
static ATTN_TGT void FN(load_q_bf16)(const attn_problem *a, attn_ws *ws, const char *qc,
                                     int64_t n, int64_t row0)
{
    const ptrdiff_t d_k = a->d_k, q_rs = a->q.s_row, q_cs = a->q.s_col, ld = ws->ld;
    const int raw16 = ATTN_Q_RAW16(a);
    const float *q = (const float *)(const void *)qc;
    const uint16_t *q16 = (const uint16_t *)(const void *)qc;
    uint32_t *qt = (uint32_t *)ws->qt;
    ptrdiff_t i = 0, e, c;
    int u;
    if (q_cs == 1 && d_k % 32 == 0) {
        /* 16 rows x 16 pairs at a time: each row's 32 values rounded to
           bfloat16 (exactly: they are bfloat16 values; a bfloat16 q's words
           are its pairs already) as its 16 pairs, then transposed, a pair
           row of the 16 query rows per store */
        for (; i + 16 <= n; i += 16)
            for (e = 0; e < d_k; e += 32) {
                __m512i r[16];
                for (u = 0; u < 16; u++) {
                    const ptrdiff_t at = (i + u) * q_rs + e;
                    r[u] = raw16 ? _mm512_loadu_si512((const void *)(q16 + at))
                                 : (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + at + 16), _mm512_loadu_ps(q + at));
                }
                attn_transpose_16x16_avx512(r);
                for (c = 0; c < 16; c++) _mm512_storeu_si512((void *)(qt + (e / 2 + c) * ld + row0 + i), r[c]);
            }
    }
    for (e = 0; e < d_k; e += 2)
        for (ptrdiff_t i1 = i; i1 < n; i1++) {
            const ptrdiff_t at = i1 * q_rs + e * q_cs;
            qt[(e / 2) * ld + row0 + i1] = FN(bf16_bits)(FN(q_elem)(qc, raw16, at))
                                           | (e + 1 < d_k ? FN(bf16_bits)(FN(q_elem)(qc, raw16, at + q_cs)) << 16 : 0u);
        }
}

/* s[r][c] = scale * sum over pairs e2 of k[r] pair e2 . qt pair e2, for
 * r < nr keys and c < nv * 16 queries (as FN(qk_tile)). */
static ATTN_TGT ATTN_INLINE void FN(qk_tile_bf16)(const uint16_t *k, ptrdiff_t k_rs,
                                                   const uint32_t *qt, ptrdiff_t ldq, float *s,
                                                   ptrdiff_t lds, ptrdiff_t n_pairs, float scale,
                                                   const int nr, const int nv)
{
    __m512 c[MR_QK][NR_QK];
    const __m512 vs = _mm512_set1_ps(scale);
    int r, v;
    ptrdiff_t e;
    ATTN_UNROLL
    for (r = 0; r < MR_QK; r++)
        ATTN_UNROLL
        for (v = 0; v < NR_QK; v++)
            c[r][v] = _mm512_setzero_ps();
    for (e = 0; e < n_pairs; e++) {
        __m512i b[NR_QK];
        ATTN_UNROLL
        for (v = 0; v < NR_QK; v++)
            if (v < nv) b[v] = _mm512_loadu_si512((const void *)(qt + e * ldq + v * 16));
        ATTN_UNROLL
        for (r = 0; r < MR_QK; r++) {
            if (r < nr) {
                uint32_t pair;
                memcpy(&pair, k + r * k_rs + 2 * e, sizeof pair);
                {
                    const __m512i x = _mm512_set1_epi32((int)pair);
                    ATTN_UNROLL
                    for (v = 0; v < NR_QK; v++)
                        if (v < nv) c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)x, (__m512bh)b[v]);
                }
            }
        }
    }
    ATTN_UNROLL
    for (r = 0; r < MR_QK; r++)
        if (r < nr)
            ATTN_UNROLL
            for (v = 0; v < NR_QK; v++)
                if (v < nv) _mm512_storeu_ps(s + r * lds + v * 16, scale != 1.0f ? _mm512_mul_ps(c[r][v], vs) : c[r][v]);
}

/* acc[r][c] = alpha[r] acc[r][c] + sum over key pairs j2 of p pair . v pair,
 * for r < nr rows and c < nv * 16 columns (as FN(pv_tile)). */
static ATTN_TGT ATTN_INLINE void FN(pv_tile_bf16)(const uint32_t *p, ptrdiff_t ldp,
                                                   const uint32_t *v, ptrdiff_t ldv, float *acc,
                                                   ptrdiff_t lda, const float *alpha,
                                                   ptrdiff_t n_pairs, const int nr, const int nv)
{
    __m512 c[MR_PV][NR_PV];
    int r, w;
    ptrdiff_t j;
    ATTN_UNROLL
    for (r = 0; r < MR_PV; r++) {
        if (r < nr) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            ATTN_UNROLL
            for (w = 0; w < NR_PV; w++)
                if (w < nv) c[r][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * lda + w * 16), al);
        }
    }
    for (j = 0; j < n_pairs; j++) {
        __m512i b[NR_PV];
        const uint32_t *pj = p + j * ldp;
        ATTN_UNROLL
        for (w = 0; w < NR_PV; w++)
            if (w < nv) b[w] = _mm512_loadu_si512((const void *)(v + j * ldv + w * 16));
        ATTN_UNROLL
        for (r = 0; r < MR_PV; r++) {
            if (r < nr) {
                const __m512i x = _mm512_set1_epi32((int)pj[r]);
                ATTN_UNROLL
                for (w = 0; w < NR_PV; w++)
                    if (w < nv) c[r][w] = _mm512_dpbf16_ps(c[r][w], (__m512bh)x, (__m512bh)b[w]);
            }
        }
    }
    ATTN_UNROLL
    for (r = 0; r < MR_PV; r++)
        if (r < nr)
            ATTN_UNROLL
            for (w = 0; w < NR_PV; w++)
                if (w < nv) _mm512_storeu_ps(acc + r * lda + w * 16, c[r][w]);
}

#if MR_QK > 6 || MR_PV > 6 || NR_QK > 4 || NR_PV > 4
#error "attn_simd_bf16dot.h: add switch cases for this register tile shape"
#endif
#define ATTN_QKB_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(qk_tile_bf16)(k, k_rs, qt, ldq, s, lds, n_pairs, scale, NR_, NV_); break;
#define ATTN_QKB_CASES(NR_) ATTN_QKB_CASE(NR_, 1) ATTN_QKB_CASE(NR_, 2) \
    ATTN_QKB_CASE(NR_, 3) ATTN_QKB_CASE(NR_, 4)
static ATTN_TGT void FN(qk_tile_bf16_any)(const uint16_t *k, ptrdiff_t k_rs, const uint32_t *qt,
                                          ptrdiff_t ldq, float *s, ptrdiff_t lds,
                                          ptrdiff_t n_pairs, float scale, int nr, int nv)
{
    switch (nr * 8 + nv) {
        ATTN_QKB_CASES(1) ATTN_QKB_CASES(2) ATTN_QKB_CASES(3) ATTN_QKB_CASES(4)
        ATTN_QKB_CASES(5) ATTN_QKB_CASES(6)
        default: break;
    }
}
#undef ATTN_QKB_CASE
#undef ATTN_QKB_CASES

#define ATTN_PVB_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(pv_tile_bf16)(p, ldp, v, ldv, acc, lda, alpha, n_pairs, NR_, NV_); break;
#define ATTN_PVB_CASES(NR_) ATTN_PVB_CASE(NR_, 1) ATTN_PVB_CASE(NR_, 2) \
    ATTN_PVB_CASE(NR_, 3) ATTN_PVB_CASE(NR_, 4)
static ATTN_TGT void FN(pv_tile_bf16_any)(const uint32_t *p, ptrdiff_t ldp, const uint32_t *v,
                                          ptrdiff_t ldv, float *acc, ptrdiff_t lda,
                                          const float *alpha, ptrdiff_t n_pairs, int nr, int nv)
{
    switch (nr * 8 + nv) {
        ATTN_PVB_CASES(1) ATTN_PVB_CASES(2) ATTN_PVB_CASES(3) ATTN_PVB_CASES(4)
        ATTN_PVB_CASES(5) ATTN_PVB_CASES(6)
        default: break;
    }
}
#undef ATTN_PVB_CASE
#undef ATTN_PVB_CASES

/* V of keys [kb, kb + nk) as pairs of keys at v2 (the V pack, or the pairs
 * of FN(v_pairs)): v2[(j/2) ldv + c] = (v[j][c], v[j+1][c]), ldv = d_v + 16,
 * for pairs j/2 < rows (those past the last key zero; so is an odd count's
 * partner). */
static ATTN_TGT void FN(pack_v_pairs)(const attn_problem *a, const attn_ws *ws, int64_t kb, int64_t nk,
                                      ptrdiff_t rows, uint32_t *v2)
{
#if ATTN_E4M3_DOT
    FN(pack_v_pairs_e4m3)(a, ws, kb, nk, rows, v2);
#else
    const ptrdiff_t d_v = a->d_v, n_pairs = (nk + 1) / 2, ldv = d_v + 16;
    const ptrdiff_t v_rs = a->v.s_row, v_cs = a->v.s_col;
    const uint16_t *v = (const uint16_t *)ws->v + kb * v_rs;
    /* quadwords 0 4 1 5 2 6 3 7: each 128-bit lane then holds columns 4u..4u+3
       and 16+4u..16+4u+3, which the in-lane 16-bit unpacks pair in order */
    const __m512i col_idx = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    ptrdiff_t j2, c;
    for (j2 = 0; j2 < n_pairs; j2++) {
        const int odd = 2 * j2 + 1 == nk;   /* the last key has no partner */
        const uint16_t *v0 = v + 2 * j2 * v_rs, *v1 = odd ? v0 : v0 + v_rs;
        uint32_t *vr = v2 + j2 * ldv;
        c = 0;
        if (v_cs == 1) {
            for (; c + 32 <= d_v; c += 32) {
                const __m512i y0 = _mm512_permutexvar_epi64(col_idx, _mm512_loadu_si512((const void *)(v0 + c)));
                const __m512i y1 = odd ? _mm512_setzero_si512()
                    : _mm512_permutexvar_epi64(col_idx, _mm512_loadu_si512((const void *)(v1 + c)));
                _mm512_storeu_si512((void *)(vr + c), _mm512_unpacklo_epi16(y0, y1));
                _mm512_storeu_si512((void *)(vr + c + 16), _mm512_unpackhi_epi16(y0, y1));
            }
        }
        for (; c < d_v; c++)
            vr[c] = (uint32_t)v0[c * v_cs] | (odd ? 0u : (uint32_t)v1[c * v_cs] << 16);
    }
    for (; j2 < rows; j2++) memset(v2 + j2 * ldv, 0, sizeof(uint32_t) * (size_t)d_v);
#endif
}

/* The 16 query rows [i, i + 16) of keys j, j + 1 (key-major s, ld apart) as
 * bfloat16 pairs, one 32-bit word per row: (p[j][r], p[j+1][r]); x1 zero
 * when j + 1 is past the last key. */
static ATTN_TGT ATTN_INLINE __m512i FN(p_pairs)(const float *s0, ptrdiff_t ld, int has_second)
{
    const __m512 x0 = _mm512_loadu_ps(s0);
    const __m512 x1 = has_second ? _mm512_loadu_ps(s0 + ld) : _mm512_setzero_ps();
    return attn_bf16_pairs_avx512(x0, x1);
}

/* The running max of the softmaxes that write P as pairs (FN(online_softmax_amx),
 * FN(online_softmax_pairs)), for 16 query rows (sc: their column of the key-major
 * tile, ld apart) over nk keys: m_new = max(m_i, c rowmax S) (the max of the scaled
 * scores: c > 0 and rounding is monotonic), alpha = exp(m_i - m_new) and -m_new,
 * taken as 0 while m_new = -inf (exp(-inf - 0) = 0, never exp(-inf + inf) = NaN). */
static ATTN_TGT ATTN_INLINE __m512 FN(pairs_row_max)(const float *sc, ptrdiff_t ld, int64_t nk, const float *mi,
                                                     __m512 vc, __m512 *al, __m512 *nms)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY), mold = _mm512_loadu_ps(mi);
    __m512 mx0 = ninf, mx1 = ninf, mnew, msafe;
    ptrdiff_t j;
    for (j = 0; j + 1 < nk; j += 2) {
        mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(sc + j * ld));
        mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(sc + (j + 1) * ld));
    }
    if (j < nk) mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(sc + j * ld));
    mnew = _mm512_max_ps(_mm512_mul_ps(_mm512_max_ps(mx0, mx1), vc), mold);
    msafe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), mnew, _mm512_setzero_ps());
    *al = FN(vexp)(_mm512_sub_ps(mold, msafe));
    *nms = _mm512_sub_ps(_mm512_setzero_ps(), msafe);
    return mnew;
}

#if ATTN_AMX
/* ------------------------------------------------------------ AMX tiles
 * Eight tile registers of 16 rows x 64 bytes (palette 1), configured by
 * FN(begin) for each block and released by the driver as each thread ends
 * (attn_tiles_release). tdpbf16ps C += A B: C 16 x 16 float32, A 16 rows of
 * 32 bfloat16 (16 pairs), B 16 rows of 16 pairs (the "VNNI" layout), each
 * product exact and each pair's sum added to C with one float32 rounding
 * (subnormals as zero), as vdpbf16ps does. The layouts are the register
 * tiles' (the header comment above), padded to whole tiles with zeros:
 *   S = K Q^T key-major: C = s (16 keys x 16 queries), A = K rows from the
 *       K pack (d_k padded to a multiple of 32), B = qt32 (pairs of e x
 *       queries; FN(begin) zeroes the pair rows past d_k).
 *   O += P V: C = acc (16 queries x 16 columns), A = P (16 queries x 16 key
 *       pairs: the pairs of FN(p_pairs), transposed), B = the V pairs.
 * Up to 2 x 2 C tiles per step (tiles 0-3), their A in tiles 4-5, B in 6-7. */
static ATTN_TGT void FN(amx_begin)(const attn_problem *a, attn_ws *ws)
{
    const ptrdiff_t n_pairs = (a->d_k + 1) / 2, npp = (n_pairs + 15) / 16 * 16, ld = ws->ld;
    memset((uint32_t *)ws->qt + n_pairs * ld, 0, sizeof(uint32_t) * (size_t)((npp - n_pairs) * ld));
    attn_amx_config_16x64();
}

/* Up to 2 x 2 accumulator tiles C[r][c] (16 x 16 float32 at cm + r 16 ldc + c 16,
 * rows ldc floats apart), from zero or loaded from there (load), plus the
 * sum over n chunks t of A_r B_c: A_r 16 rows a_rs bytes apart at
 * a + t a_step + r a_next, B_c 16 rows b_rs bytes apart at b + t b_step +
 * 64 c; then stored back. The second row (column) of tiles only when two_a
 * (two_b). Tiles 0-3 hold C, 4-5 A, 6-7 B. */
static ATTN_TGT ATTN_INLINE void FN(amx_tiles)(float *cm, ptrdiff_t ldc, int load,
                                               const char *a, ptrdiff_t a_rs, ptrdiff_t a_step,
                                               ptrdiff_t a_next, const char *b, ptrdiff_t b_rs,
                                               ptrdiff_t b_step, ptrdiff_t n, int two_a, int two_b)
{
    const ptrdiff_t c_rs = 4 * ldc;
    ptrdiff_t t;
    if (load) {
        _tile_loadd(0, cm, c_rs);
        if (two_b) _tile_loadd(1, cm + 16, c_rs);
        if (two_a) {
            _tile_loadd(2, cm + 16 * ldc, c_rs);
            if (two_b) _tile_loadd(3, cm + 16 * ldc + 16, c_rs);
        }
    } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    for (t = 0; t < n; t++) {
        const char *at = a + t * a_step, *bt = b + t * b_step;
        _tile_loadd(4, at, a_rs);
        _tile_loadd(6, bt, b_rs);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) { _tile_loadd(7, bt + 64, b_rs); _tile_dpbf16ps(1, 4, 7); }
        if (two_a) {
            _tile_loadd(5, at + a_next, a_rs);
            _tile_dpbf16ps(2, 5, 6);
            if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cm, c_rs);
    if (two_b) _tile_stored(1, cm + 16, c_rs);
    if (two_a) {
        _tile_stored(2, cm + 16 * ldc, c_rs);
        if (two_b) _tile_stored(3, cm + 16 * ldc + 16, c_rs);
    }
}

/* S = scale K Q^T for keys [kb, kb + nk), key-major, on tiles (FN(qk_bf16)'s result) */
static ATTN_TGT void FN(qk_amx)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t d_k = a->d_k, n_chunks = (d_k + 31) / 32, kld = 32 * n_chunks;
    const ptrdiff_t ld = ws->ld, bqp = ws->bqp, nkp = (nk + 15) / 16 * 16;
    const ptrdiff_t k_rs = a->k.s_row, k_cs = a->k.s_col;
    const KV_T *k = (const KV_T *)ws->k + kb * k_rs;
    uint16_t *kp = (uint16_t *)ws->kpack;
    const uint32_t *qt = (const uint32_t *)ws->qt;
    float *s = (float *)ws->s;
    const __m512 vs = _mm512_set1_ps((float)a->scale * (float)KV_UNIT);   /* (K in 1 / KV_UNIT) */
    /* K's rows are the A tiles as they are when they are whole tile rows
       (contiguous, d_k a multiple of 32), for the pairs of 16-key tiles
       inside the tile; the rest is copied, zero-padded to whole tiles (an
       e4m3 K's rows all, looked up as bfloat16) */
    const ptrdiff_t direct = !ATTN_E4M3_DOT && k_cs == 1 && d_k == kld ? nk / 32 * 32 : 0;
    ptrdiff_t j, e, jt, it;
    for (j = direct; j < nkp; j++) {
        uint16_t *pr = kp + (j - direct) * kld;
        e = 0;
        if (j < nk) {
            const KV_T *kr = k + j * k_rs;
#if ATTN_E4M3_DOT
            FN(e4m3_row_bf16)(kr, k_cs, d_k, pr);
            e = d_k;
#else
            if (k_cs == 1) { memcpy(pr, kr, sizeof(uint16_t) * (size_t)d_k); e = d_k; }
            else for (; e < d_k; e++) pr[e] = kr[e * k_cs];
#endif
        }
        memset(pr + e, 0, sizeof(uint16_t) * (size_t)(kld - e));
    }
    for (jt = 0; jt < nkp; jt += 32) {
        const int two_j = jt + 16 < nkp;
        const uint16_t *at = jt < direct ? (const uint16_t *)(const void *)(k + jt * k_rs) : kp + (jt - direct) * kld;
        const ptrdiff_t a_rs = jt < direct ? k_rs : kld;   /* (direct: 16-bit K rows) */
        for (it = 0; it < bqp; it += 32)      /* C = s (keys x queries), A = K rows, B = Q's pairs */
            FN(amx_tiles)(s + jt * ld + it, ld, 0, (const char *)at, 2 * a_rs, 64, 32 * a_rs,
                          (const char *)(qt + it), 4 * ld, 64 * ld, n_chunks, two_j, it + 16 < bqp);
    }
    if (ws->s_scale != 1)               /* the softmax applies the scale (FN(online_softmax_amx)) */
        return;
    for (j = 0; j < nk; j++)              /* the scale multiplies the sums (as FN(qk_tile_bf16)) */
        for (it = 0; it < bqp; it += 16) {
            float *r = s + j * ld + it;
            _mm512_storeu_ps(r, _mm512_mul_ps(_mm512_loadu_ps(r), vs));
        }
}

/* FN(online_softmax) of a block on AMX tiles: the same m, l, alpha and P
 * (the same sums, in the same order; when S comes unscaled, s_scale c != 1,
 * m_new = max(m_i, c rowmax S), which is the max of the scaled scores as c > 0
 * and rounding is monotonic, and P = exp(c S - m_new) with one rounding
 * (an FMA) in place of two), P written as bfloat16 A tiles for
 * FN(pv_amx) as it is computed: pa[i npp + j/2] = (p[j][i], p[j+1][i]) in
 * the mask tile's scratch, 16 pairs of 16 rows transposed at a time (pairs
 * past the last key zero). P stays in s (float32) only where V has columns
 * past the last 16 (ws->amx == 2). */
static ATTN_TGT void FN(online_softmax_amx)(attn_ws *ws, int64_t nk)
{
    const ptrdiff_t ld = ws->ld, nvq = ws->bqp / 16, n_pairs = (nk + 1) / 2;
    const ptrdiff_t npp = (n_pairs + 15) / 16 * 16;
    const int keep_s = ws->amx == 2;
    float *s = (float *)ws->s, *m = (float *)ws->m, *l = (float *)ws->l, *alpha = (float *)ws->alpha;
    uint32_t *pa = (uint32_t *)ws->mt;
    const __m512 vc = _mm512_set1_ps(ws->s_scale);
    ptrdiff_t iv, c;
    int u;
    for (iv = 0; iv < nvq; iv++) {
        float *sc = s + iv * 16;
        __m512 nms, al, ls0 = _mm512_setzero_ps(), ls1 = ls0;
        const __m512 mnew = FN(pairs_row_max)(sc, ld, nk, m + iv * 16, vc, &al, &nms);
        for (c = 0; c < npp; c += 16) {
            __m512i r[16];
            for (u = 0; u < 16; u++) {
                const ptrdiff_t j0 = 2 * (c + u);
                __m512 p0 = _mm512_setzero_ps(), p1 = p0;
                if (j0 < nk) {
                    p0 = FN(vexp)(_mm512_fmadd_ps(_mm512_loadu_ps(sc + j0 * ld), vc, nms));
                    ls0 = _mm512_add_ps(ls0, p0);
                    if (keep_s) _mm512_storeu_ps(sc + j0 * ld, p0);
                    if (j0 + 1 < nk) {
                        p1 = FN(vexp)(_mm512_fmadd_ps(_mm512_loadu_ps(sc + (j0 + 1) * ld), vc, nms));
                        ls1 = _mm512_add_ps(ls1, p1);
                        if (keep_s) _mm512_storeu_ps(sc + (j0 + 1) * ld, p1);
                    }
                }
                r[u] = attn_bf16_pairs_avx512(p0, p1);
            }
            attn_transpose_16x16_avx512(r);
            for (u = 0; u < 16; u++) _mm512_storeu_si512((void *)(pa + (iv * 16 + u) * npp + c), r[u]);
        }
        _mm512_storeu_ps(l + iv * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + iv * 16), al, _mm512_add_ps(ls0, ls1)));
        _mm512_storeu_ps(m + iv * 16, mnew);
        _mm512_storeu_ps(alpha + iv * 16, al);
    }
}

/* V's pairs of keys [kb, kb + nk) for the tiles, rows pair rows (those past
 * the last key zero): read from the copy's pairs (ws->vpairs) where they can
 * be, packed there first where they are not yet (from its last packed key, so
 * that it holds a run of keys); else packed into the V pack. The copy's pairs
 * serve whole tiles of pairs (nk a multiple of 32: no row past the last key
 * to zero) from an even number of keys past its first. */
static ATTN_TGT const uint32_t *FN(v_pairs)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk,
                                            ptrdiff_t rows)
{
    const ptrdiff_t ldv = a->d_v + 16;
    attn_vpairs *vp = ws->vpairs;
    if (vp != NULL && nk % 32 == 0 && kb >= vp->p0 && (kb - vp->p0) % 2 == 0 && kb + nk - vp->p0 <= vp->cap) {
        if (kb + nk > vp->hi) {   /* (the copy holds V's rows of keys [p0, kb + nk)) */
            FN(pack_v_pairs)(a, ws, vp->hi, kb + nk - vp->hi, (kb + nk - vp->hi) / 2,
                             vp->rows + (vp->hi - vp->p0) / 2 * ldv);
            vp->hi = kb + nk;
        }
        return vp->rows + (kb - vp->p0) / 2 * ldv;
    }
    FN(pack_v_pairs)(a, ws, kb, nk, rows, (uint32_t *)ws->vpack);
    return (const uint32_t *)ws->vpack;
}

/* acc = diag(alpha) acc + P^T V for keys [kb, kb + nk) on tiles (FN(pv_bf16)'s result) */
static ATTN_TGT void FN(pv_amx)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, ld = ws->ld, bqp = ws->bqp, d_v = a->d_v, dvv = d_v / 16 * 16;
    const ptrdiff_t npp = ((nk + 1) / 2 + 15) / 16 * 16, ldv = d_v + 16;  /* key pairs, whole tiles */
    const ptrdiff_t v_rs = a->v.s_row, v_cs = a->v.s_col;
    const KV_T *v = (const KV_T *)ws->v + kb * v_rs;
    const float *s = (const float *)ws->s, *alpha = (const float *)ws->alpha;
    float *acc = (float *)ws->acc;
    const uint32_t *pa = (const uint32_t *)ws->mt, *v2;
    ptrdiff_t it, i, dt, j;
    /* the rescale first (its stores drain while the packs below run; a tile
       load right behind them waited for them), skipping rows whose max held */
    for (i = 0; i < nq; i++) {
        if (alpha[i] != 1.0f) {
            const __m512 al = _mm512_set1_ps(alpha[i]);
            float *ar = acc + i * d_v;
            for (dt = 0; dt < dvv; dt += 16) _mm512_storeu_ps(ar + dt, _mm512_mul_ps(_mm512_loadu_ps(ar + dt), al));
        }
    }
    v2 = FN(v_pairs)(a, ws, kb, nk, npp);   /* (P's A tiles: FN(online_softmax_amx)) */
    for (it = 0; it < bqp; it += 32)          /* C = acc (queries x columns), A = P, B = V's pairs */
        for (dt = 0; dt < dvv; dt += 32)
            FN(amx_tiles)(acc + it * d_v + dt, d_v, 1, (const char *)(pa + it * npp), 4 * npp, 64,
                          64 * npp, (const char *)(v2 + dt), 4 * ldv, 64 * ldv, npp / 16, it + 16 < bqp,
                          dt + 16 < dvv);
    for (dt = dvv; dt < d_v; dt++) {       /* columns past the last vector, P in float32 */
        for (i = 0; i < nq; i++) {
            float sum = acc[i * d_v + dt] * alpha[i];
            for (j = 0; j < nk; j++) sum += s[j * ld + i] * (float)KV_GET(v + j * v_rs + dt * v_cs);
            acc[i * d_v + dt] = sum;
        }
    }
}
#endif /* ATTN_AMX */

/* The softmax of a block on the vdpbf16ps tiles (ws->p_pairs; FN(online_softmax)'s
 * m, l and alpha, the scale applied here as FN(online_softmax_amx) applies it
 * when s_scale c != 1): P = exp(c S - m_new) written as FN(pv_bf16)'s pairs as it
 * is computed, p2[(j/2) ld + i] = (p[j][i], p[j+1][i]) in the mask tile's scratch
 * (an odd count's last partner zero), where a pass of its own read P back from s;
 * P stays in s (float32) only where V has columns past the last 16 (p_pairs == 2).
 * With c = 1 the exponents are FN(online_softmax)'s, bit for bit (c S exact). */
static ATTN_TGT void FN(online_softmax_pairs)(attn_ws *ws, int64_t nk)
{
    const ptrdiff_t ld = ws->ld, nvq = ws->bqp / 16;
    const int keep_s = ws->p_pairs == 2;
    float *s = (float *)ws->s, *m = (float *)ws->m, *l = (float *)ws->l, *alpha = (float *)ws->alpha;
    uint32_t *p2 = (uint32_t *)ws->mt;
    const __m512 vc = _mm512_set1_ps(ws->s_scale);
    ptrdiff_t iv, j;
    for (iv = 0; iv < nvq; iv++) {
        float *sc = s + iv * 16;
        uint32_t *pc = p2 + iv * 16;
        __m512 nms, al, ls0 = _mm512_setzero_ps(), ls1 = ls0;
        const __m512 mnew = FN(pairs_row_max)(sc, ld, nk, m + iv * 16, vc, &al, &nms);
        for (j = 0; j + 1 < nk; j += 2) {
            const __m512 p0 = FN(vexp)(_mm512_fmadd_ps(_mm512_loadu_ps(sc + j * ld), vc, nms));
            const __m512 p1 = FN(vexp)(_mm512_fmadd_ps(_mm512_loadu_ps(sc + (j + 1) * ld), vc, nms));
            ls0 = _mm512_add_ps(ls0, p0);
            ls1 = _mm512_add_ps(ls1, p1);
            if (keep_s) {
                _mm512_storeu_ps(sc + j * ld, p0);
                _mm512_storeu_ps(sc + (j + 1) * ld, p1);
            }
            _mm512_storeu_si512((void *)(pc + (j / 2) * ld), attn_bf16_pairs_avx512(p0, p1));
        }
        if (j < nk) {
            const __m512 p0 = FN(vexp)(_mm512_fmadd_ps(_mm512_loadu_ps(sc + j * ld), vc, nms));
            ls0 = _mm512_add_ps(ls0, p0);
            if (keep_s) _mm512_storeu_ps(sc + j * ld, p0);
            _mm512_storeu_si512((void *)(pc + (j / 2) * ld), attn_bf16_pairs_avx512(p0, _mm512_setzero_ps()));
        }
        _mm512_storeu_ps(l + iv * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + iv * 16), al, _mm512_add_ps(ls0, ls1)));
        _mm512_storeu_ps(m + iv * 16, mnew);
        _mm512_storeu_ps(alpha + iv * 16, al);
    }
}

/* Key-major scores of keys [kb, kb + nk) (the products only; FN(scores)
 * applies the rest; unscaled when the softmax applies the scale, s_scale).
 * K read in place where its rows are contiguous and of even length (the
 * tiles read a row's pairs as 32-bit words), else copied into the K pack
 * as bfloat16 rows of even length kld (any strides, an odd d_k padded with
 * a zero). */
static ATTN_TGT void FN(qk_bf16)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t d_k = a->d_k, n_pairs = (d_k + 1) / 2, kld = 2 * n_pairs + 32;
    const ptrdiff_t ld = ws->ld, nvq = ws->bqp / 16, k_rs = a->k.s_row, k_cs = a->k.s_col;
    const KV_T *k = (const KV_T *)ws->k + kb * k_rs;
    uint16_t *kp = (uint16_t *)ws->kpack;
    const uint32_t *qt = (const uint32_t *)ws->qt;
    float *s = (float *)ws->s;
    const ptrdiff_t n_jt = (nk + MR_QK - 1) / MR_QK, n_it = (nvq + NR_QK - 1) / NR_QK;
    ptrdiff_t j, e, t;
#if ATTN_AMX
    if (ATTN_AMX_BLOCK(a, ws)) {
        FN(qk_amx)(a, ws, kb, nk);
        return;
    }
#endif
    const float scale = ws->s_scale != 1 ? 1.0f : (float)a->scale * (float)KV_UNIT;   /* (K in 1 / KV_UNIT) */
#if ATTN_E4M3_DOT   /* K's rows looked up as bfloat16 into the K pack */
    const uint16_t *kb16 = kp;
    const ptrdiff_t k_ld = kld;
    for (j = 0; j < nk; j++) {
        FN(e4m3_row_bf16)(k + j * k_rs, k_cs, d_k, kp + j * kld);
        if (d_k % 2) kp[j * kld + d_k] = 0;
    }
    (void)e;
#else
    const uint16_t *kb16 = k;
    ptrdiff_t k_ld = k_rs;
    if (k_cs != 1 || d_k % 2) {
        for (j = 0; j < nk; j++) {
            const uint16_t *kr = k + j * k_rs;
            uint16_t *pr = kp + j * kld;
            for (e = 0; e < d_k; e++) pr[e] = kr[e * k_cs];
            if (d_k % 2) pr[d_k] = 0;
        }
        kb16 = kp;
        k_ld = kld;
    }
#endif
    /* query strips outermost, key rows inner; on the causal diagonal and a
       window's edges only the vectors of rows that see one of the tile's
       keys (the tile loop of FN(scores)) */
    const int edges = ws->causal || ws->window;
    for (t = 0; t < n_jt * n_it; t++) {
        const ptrdiff_t jt = (t % n_jt) * MR_QK, it = (t / n_jt) * NR_QK, mr = nk - jt < MR_QK ? nk - jt : MR_QK;
        ptrdiff_t iv0 = it, iv1 = nvq - it < NR_QK ? nvq : it + NR_QK, r0, r1;
        if (edges) {
            attn_rows_seeing(a, ws, kb, jt, jt + mr, &r0, &r1);
            if (r0 / 16 > iv0) iv0 = r0 / 16;
            if ((r1 + 15) / 16 < iv1) iv1 = (r1 + 15) / 16;
            if (iv1 <= iv0) continue;
        }
        FN(qk_tile_bf16_any)(kb16 + jt * k_ld, k_ld, qt + iv0 * 16, ld, s + jt * ld + iv0 * 16, ld,
                             n_pairs, scale, (int)mr, (int)(iv1 - iv0));
    }
}

/* acc = diag(alpha) acc + P^T V for keys [kb, kb + nk), P (float32, in s)
 * rounded to bfloat16 pairs; the columns past the last vector of 16 in
 * float32 from P as it is. */
static ATTN_TGT void FN(pv_bf16)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, ld = ws->ld, bqp = ws->bqp, d_v = a->d_v, dvv = d_v / 16 * 16;
    const ptrdiff_t n_pairs = (nk + 1) / 2, ldv = d_v + 16, v_rs = a->v.s_row, v_cs = a->v.s_col;
    const KV_T *v = (const KV_T *)ws->v + kb * v_rs;
    const float *s = (const float *)ws->s, *alpha = (const float *)ws->alpha;
    float *acc = (float *)ws->acc;
    uint32_t *p2 = (uint32_t *)ws->mt, *v2 = (uint32_t *)ws->vpack;
    ptrdiff_t j2, i, dt, it, j;
#if ATTN_AMX
    if (ATTN_AMX_BLOCK(a, ws)) {
        FN(pv_amx)(a, ws, kb, nk);
        return;
    }
#endif
    if (!ws->p_pairs)   /* (else the softmax wrote them) */
        for (j2 = 0; j2 < n_pairs; j2++)
            for (i = 0; i < bqp; i += 16)
                _mm512_storeu_si512((void *)(p2 + j2 * ld + i), FN(p_pairs)(s + 2 * j2 * ld + i, ld, 2 * j2 + 1 < nk));
    FN(pack_v_pairs)(a, ws, kb, nk, n_pairs, v2);
    /* column strips outermost, each row tile over the key pairs its rows
       see (as FN(pv); none: the rescale alone) */
    const int edges = ws->causal || ws->window;
    for (dt = 0; dt < dvv; dt += NR_PV * 16) {
        int nv = (int)((dvv - dt) / 16 < NR_PV ? (dvv - dt) / 16 : NR_PV);
        for (it = 0; it < nq; it += MR_PV) {
            int nr = (int)(nq - it < MR_PV ? nq - it : MR_PV);
            ptrdiff_t k0 = 0, k1 = nk;
            if (edges) attn_keys_seen(a, ws, kb, nk, it, it + nr, &k0, &k1);
            FN(pv_tile_bf16_any)(p2 + (k0 / 2) * ld + it, ld, v2 + (k0 / 2) * ldv + dt, ldv, acc + it * d_v + dt,
                                 d_v, alpha + it, (k1 + 1) / 2 - k0 / 2, nr, nv);
        }
    }
    for (dt = dvv; dt < d_v; dt++) {       /* columns past the last vector */
        for (i = 0; i < nq; i++) {
            float sum = acc[i * d_v + dt] * alpha[i];
            for (j = 0; j < nk; j++) sum += s[j * ld + i] * (float)KV_GET(v + j * v_rs + dt * v_cs);
            acc[i * d_v + dt] = sum;
        }
    }
}
