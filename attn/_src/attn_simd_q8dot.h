/* Decode scores over a q8_0 K by integer dot products (AVX512-VNNI), as
 * llama.cpp's q8_0 x q8_0 dot: included by attn_simd_impl.h in its
 * avx512-vnni instance of ATTN_F32_KVQ8 (ATTN_Q8_VNNI), used by the
 * avx512-bf16 and avx512-amx paths (every CPU with AVX512_BF16 has VNNI).
 *
 * A block of <= ATTN_DOT_MAX_Q query rows (the "rows" layout of FN(qk_dot))
 * quantizes its scaled query rows qt once, in FN(load_q), to q8_0 too: per
 * group g of 32 values, dq_g = max|qt_g| / 127 and qq = round(qt / dq_g) in
 * [-127, 127]. A score is then
 *
 *     s_j = sum_g dq_g * dk_jg * I_jg,   I_jg = sum_{e in g} qq_e * kq_je,
 *
 * I_jg exact in int32 (vpdpbusd), where the float path multiplies each K
 * value, dequantized, by qt. The query's rounding, |qt_e - dq_g qq_e| <=
 * dq_g / 2, is the only error this adds (docs/kv_cache_int8.md gives the
 * bound; tests/_bounds.py: q8_query_error). vpdpbusd multiplies unsigned by
 * signed bytes: it takes kq + 128 (the sign bit flipped) and q, and each lane
 * starts from -128 * (the sum of its four q bytes), which cancels the +128.
 *
 * The quantized rows live in the part of qt the rows layout leaves unused
 * (qt holds ATTN_BQ + ATTN_VL_MAX rows of d_k; the block uses ATTN_DOT_MAX_Q),
 * from float ATTN_DOT_MAX_Q * d_k on, each array [ATTN_DOT_MAX_Q][...]:
 *   qq    int8  [d_k]             the quantized row
 *   corr  int32 [d_k / 64][16]    vpdpbusd's starting lanes
 *   dqv   float [ATTN_Q8_PAIRS_MAX][16]  each group's dq in FN(qk_dot_q8_4)'s lane order
 * Which calls: decode calls only (ATTN_Q8_DOT_SHAPE: n_q <= ATTN_SPLIT_MAX_Q,
 * so a prefill's last short block keeps the float query), d_k a multiple of
 * 64 (whole 64-byte vectors) and at most 512 (ATTN_Q8_PAIRS_MAX pairs). Every
 * block of such a call rounds its query, so the answer does not depend on how
 * the call is cut: blocks of <= ATTN_DOT_MAX_Q rows (ws->q8_dot) take the
 * integer dots; larger ones (many heads per K/V head) the register tiles over
 * the rounded values, d_g * round(x / d_g), in float32. */

#define ATTN_Q8_PAIRS_MAX 4   /* pairs of 64-value vectors in a row: 512 / 128 */

static inline char *FN(q8q_base)(T *qt, ptrdiff_t d_k) { return (char *)(qt + ATTN_DOT_MAX_Q * d_k); }

/* Round one row x of d_k scaled query values to q8_0: y = round(x / d_g),
 * dq[g] = d_g = max|x_g| / 127, 32 values (two vectors) a group, in float32
 * as written (tests/_bounds.py: q8_reference_round_query repeats it). */
static ATTN_TGT void FN(q8q_round)(const float *x, ptrdiff_t d_k, int8_t *y, float *dq)
{
    ptrdiff_t g;
    for (g = 0; g < d_k / ATTN_Q8_GROUP; g++) {
        const __m512 x0 = _mm512_loadu_ps(x + g * 32), x1 = _mm512_loadu_ps(x + g * 32 + 16);
        /* max|x| of the group; NaN anywhere makes it NaN (vmaxps returns its
           second operand when either is NaN), and then every score is NaN */
        const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
        const __m512 am = _mm512_max_ps(_mm512_max_ps(a1, a0), _mm512_max_ps(a0, a1));
        float amax = _mm512_reduce_max_ps(am), id;
        if (_mm512_cmp_ps_mask(am, am, _CMP_UNORD_Q)) amax = NAN;
        dq[g] = amax / 127.0f;
        id = amax > 0 ? 127.0f / amax : 0.0f;   /* (NaN: 0; inf: 0 and d = inf) */
        {
            const __m512 vid = _mm512_set1_ps(id);
            /* to nearest, ties to even (the default rounding); |x id| <= 127 */
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
            _mm_storeu_si128((__m128i *)(void *)(y + g * 32), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(void *)(y + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
        }
    }
}

/* Rows [r0, r0 + n) of qt (rows layout) to the arrays above. */
static ATTN_TGT void FN(q8q_rows)(T *qt, ptrdiff_t d_k, ptrdiff_t r0, ptrdiff_t n)
{
    char *base = FN(q8q_base)(qt, d_k);
    int8_t *qq = (int8_t *)base;
    int32_t *corr = (int32_t *)(base + ATTN_DOT_MAX_Q * d_k);
    float *dqv = (float *)(base + 2 * ATTN_DOT_MAX_Q * d_k);
    const ptrdiff_t nh = d_k / 64;
    const __m512i m128 = _mm512_set1_epi8((char)0x80);   /* 128 as an unsigned byte */
    float dq[4 * ATTN_Q8_PAIRS_MAX];
    ptrdiff_t r, g, h, hp, l;
    for (r = r0; r < r0 + n; r++) {
        int8_t *y = qq + r * d_k;
        FN(q8q_round)(qt + r * d_k, d_k, y, dq);
        for (g = d_k / ATTN_Q8_GROUP; g < 4 * ATTN_Q8_PAIRS_MAX; g++) dq[g] = 0;
        for (hp = 0; hp < (nh + 1) / 2; hp++) {
            /* FN(qk_dot_q8_4)'s lane order: blocks 0, 2 [g0, g0+2, g0, g0+2], blocks 1, 3 g0+1, g0+3 */
            const float *dg = dq + 4 * hp;
            float *o = dqv + (r * ATTN_Q8_PAIRS_MAX + hp) * 16;
            for (l = 0; l < 16; l += 8) {
                o[l + 0] = dg[0]; o[l + 1] = dg[2]; o[l + 2] = dg[0]; o[l + 3] = dg[2];
                o[l + 4] = dg[1]; o[l + 5] = dg[3]; o[l + 6] = dg[1]; o[l + 7] = dg[3];
            }
        }
        for (h = 0; h < nh; h++) {
            /* -128 * (the sum of each lane's four bytes) */
            const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), m128,
                                                    _mm512_loadu_si512((const void *)(y + 64 * h)));
            _mm512_storeu_si512((void *)(corr + (r * nh + h) * 16), _mm512_sub_epi32(_mm512_setzero_si512(), sum));
        }
    }
}

/* A decode block of more rows (the register tiles, qt transposed [d_k][ld]):
 * rows [r0, r0 + n) become their rounded values d_g * round(x / d_g) in
 * float32, so that every block of a decode call computes with the same query
 * (the products then run as for any float query). */
static ATTN_TGT void FN(q8q_round_columns)(T *qt, ptrdiff_t ld, ptrdiff_t d_k, ptrdiff_t r0, ptrdiff_t n)
{
    float x[512] = {0}, dq[4 * ATTN_Q8_PAIRS_MAX];   /* (d_k <= 512) */
    int8_t y[512];
    ptrdiff_t r, e;
    for (r = r0; r < r0 + n; r++) {
        for (e = 0; e < d_k; e++) x[e] = qt[e * ld + r];
        FN(q8q_round)(x, d_k, y, dq);
        for (e = 0; e < d_k; e++) qt[e * ld + r] = dq[e / ATTN_Q8_GROUP] * (float)y[e];
    }
}

/* Scores of 4 keys (rows kr + u * k_rs, u < 4) for the nq rows into
 * out[i * 4 + u]. For each pair of 64-value vectors (h = 2 hp, 2 hp + 1:
 * groups g0 = 4 hp .. g0 + 3; a missing second vector counts as zeros) the
 * int32 lanes reduce to one sum per (key, group) before any float work:
 *   P_u = lo32(A, B) + hi32(A, B)    A = I[u][2hp], B = I[u][2hp + 1]
 *   Q   = lo64(P_u, P_u') + hi64(..)  per 128-bit block [A_u, B_u, A_u', B_u'] sums
 *   R   = blocks (0 + 1, 2 + 3) of Q01, Q23: block 0 [G(0,g0) G(0,g0+2) G(1,g0) G(1,g0+2)],
 *         block 1 the same for g0+1, g0+3, blocks 2, 3 for keys 2, 3;
 * then F_i += float(R) * dq_i * dk (both in R's lane order), and the lanes of
 * each key add up to its score. (The in-lane shuffles run beside the FMAs;
 * one float horizontal sum per key and row would cost more than the dots.) */
static ATTN_TGT ATTN_INLINE void FN(qk_dot_q8_4)(const int8_t *kr, ptrdiff_t k_rs, const int8_t *qq,
                                                  const int32_t *corr, const float *dqv,
                                                  ptrdiff_t d_k, const int nq, float *out,
                                                  ptrdiff_t lds)
{
    const ptrdiff_t nh = d_k / 64, ng = d_k / ATTN_Q8_GROUP;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i dk_order = _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0);
    const __m512i row_order = _mm512_set_epi32(15, 14, 11, 10, 13, 12, 9, 8, 7, 6, 3, 2, 5, 4, 1, 0);
    __m512 f[ATTN_DOT_MAX_Q];
    ptrdiff_t hp;
    int i, u;
    for (i = 0; i < ATTN_DOT_MAX_Q; i++) f[i] = _mm512_setzero_ps();
    for (hp = 0; hp < (nh + 1) / 2; hp++) {
        const int two = 2 * hp + 1 < nh;
        const ptrdiff_t left = ng - 4 * hp;
        const __mmask16 m4 = (__mmask16)(left >= 4 ? 0xf : (1u << left) - 1);
        __m512i ka[4], kb[4];
        /* the four keys' scales of groups g0..g0+3, key u in 128-bit block u
           (immediate block numbers: an unoptimized build does not unroll) */
#define ATTN_Q8_KEY_SCALES(u_) _mm512_castps512_ps128(_mm512_maskz_loadu_ps( \
            m4, (const void *)(kr + (u_) * k_rs + d_k + 16 * hp)))
        __m512 dk = _mm512_maskz_loadu_ps(m4, (const void *)(kr + d_k + 16 * hp));
        dk = _mm512_insertf32x4(dk, ATTN_Q8_KEY_SCALES(1), 1);
        dk = _mm512_insertf32x4(dk, ATTN_Q8_KEY_SCALES(2), 2);
        dk = _mm512_insertf32x4(dk, ATTN_Q8_KEY_SCALES(3), 3);
#undef ATTN_Q8_KEY_SCALES
        dk = _mm512_permutexvar_ps(dk_order, dk);
        for (u = 0; u < 4; u++) {
            ka[u] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(kr + u * k_rs + 128 * hp)), flip);
            kb[u] = two ? _mm512_xor_si512(_mm512_loadu_si512((const void *)(kr + u * k_rs + 128 * hp + 64)), flip)
                        : _mm512_setzero_si512();
        }
        for (i = 0; i < nq; i++) {
            const __m512i qa = _mm512_loadu_si512((const void *)(qq + i * d_k + 128 * hp));
            const __m512i ca = _mm512_loadu_si512((const void *)(corr + (i * nh + 2 * hp) * 16));
            __m512i qb = _mm512_setzero_si512(), cb = _mm512_setzero_si512(), pu[4], q01, q23, r;
            if (two) {
                qb = _mm512_loadu_si512((const void *)(qq + i * d_k + 128 * hp + 64));
                cb = _mm512_loadu_si512((const void *)(corr + (i * nh + 2 * hp + 1) * 16));
            }
            for (u = 0; u < 4; u++) {
                const __m512i a = _mm512_dpbusd_epi32(ca, ka[u], qa);
                const __m512i b = two ? _mm512_dpbusd_epi32(cb, kb[u], qb) : _mm512_setzero_si512();
                pu[u] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            }
            q01 = _mm512_add_epi32(_mm512_unpacklo_epi64(pu[0], pu[1]), _mm512_unpackhi_epi64(pu[0], pu[1]));
            q23 = _mm512_add_epi32(_mm512_unpacklo_epi64(pu[2], pu[3]), _mm512_unpackhi_epi64(pu[2], pu[3]));
            r = _mm512_add_epi32(_mm512_shuffle_i32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r),
                                   _mm512_mul_ps(_mm512_loadu_ps(dqv + (i * ATTN_Q8_PAIRS_MAX + hp) * 16), dk),
                                   f[i]);
        }
    }
    {
        /* lanes of key u: blocks 2(u/2), 2(u/2)+1, lanes 2(u%2), 2(u%2)+1 */
        __m512 t[ATTN_DOT_MAX_Q], w01, w23, x;
        for (i = 0; i < ATTN_DOT_MAX_Q; i++)
            t[i] = _mm512_add_ps(f[i], _mm512_shuffle_f32x4(f[i], f[i], _MM_SHUFFLE(2, 3, 0, 1)));
        w01 = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
        w23 = _mm512_add_ps(_mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
        x = _mm512_permutexvar_ps(row_order, _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)));
        /* row i's four scores: block i of x */
        _mm_storeu_ps(out, _mm512_castps512_ps128(x));
        if (nq > 1) _mm_storeu_ps(out + lds, _mm512_extractf32x4_ps(x, 1));
        if (nq > 2) _mm_storeu_ps(out + 2 * lds, _mm512_extractf32x4_ps(x, 2));
        if (nq > 3) _mm_storeu_ps(out + 3 * lds, _mm512_extractf32x4_ps(x, 3));
    }
}

/* s[i][j] = sum_g dq_ig dk_jg I_ijg for nq (a compile-time constant in each
 * copy) rows and keys [0, nk), K in q8_0 rows k_rs bytes apart; prefetches
 * K's and V's rows like FN(qk_dot). */
static ATTN_TGT ATTN_INLINE void FN(qk_dot_q8)(const int8_t *k, ptrdiff_t k_rs, const T *qt,
                                                ptrdiff_t d_k, T *s, ptrdiff_t lds, ptrdiff_t nk,
                                                const int nq, const int8_t *v, ptrdiff_t v_rs,
                                                ptrdiff_t v_bytes, ptrdiff_t k_pf)
{
    const char *base = FN(q8q_base)((T *)qt, d_k);
    const int8_t *qq = (const int8_t *)base;
    const int32_t *corr = (const int32_t *)(base + ATTN_DOT_MAX_Q * d_k);
    const float *dqv = (const float *)(base + 2 * ATTN_DOT_MAX_Q * d_k);
    const ptrdiff_t k_bytes = KV_ROW_BYTES(d_k);
    ptrdiff_t j, b;
    int i, u;
    for (j = 0; j < nk; j += 4) {
        const int8_t *kr = k + j * k_rs;
        const int nu = nk - j < 4 ? (int)(nk - j) : 4;
        for (u = 0; u < nu; u++) {
            const char *kp = (const char *)(kr + (k_pf + u) * k_rs);
            const char *vp = (const char *)(v + (j + u) * v_rs);
            if (k_pf > 0)
                for (b = 0; b < k_bytes; b += 64) ATTN_PREFETCH(kp + b);
            for (b = 0; b < v_bytes; b += 64) ATTN_PREFETCH(vp + b);
        }
        if (nu == 4) {
            FN(qk_dot_q8_4)(kr, k_rs, qq, corr, dqv, d_k, nq, s + j, lds);
        } else if (nk >= 4) {   /* the last nu keys: the tile's last four, the first 4 - nu again */
            float last[16];
            FN(qk_dot_q8_4)(k + (nk - 4) * k_rs, k_rs, qq, corr, dqv, d_k, nq, last, 4);
            for (i = 0; i < nq; i++)
                for (u = 0; u < nu; u++) s[i * lds + j + u] = last[i * 4 + 4 - nu + u];
        } else {                /* fewer than four keys in all: one at a time (rows 0 apart) */
            float one[16];
            for (u = 0; u < nu; u++) {
                FN(qk_dot_q8_4)(kr + u * k_rs, 0, qq, corr, dqv, d_k, nq, one, 4);
                for (i = 0; i < nq; i++) s[i * lds + j + u] = one[i * 4];
            }
        }
    }
}

static ATTN_TGT void FN(qk_dot_q8_any)(const int8_t *k, ptrdiff_t k_rs, const T *qt, ptrdiff_t d_k,
                                       T *s, ptrdiff_t lds, ptrdiff_t nk, int nq, const int8_t *v,
                                       ptrdiff_t v_rs, ptrdiff_t v_bytes, ptrdiff_t k_pf)
{
    switch (nq) {
    case 1: FN(qk_dot_q8)(k, k_rs, qt, d_k, s, lds, nk, 1, v, v_rs, v_bytes, k_pf); break;
    case 2: FN(qk_dot_q8)(k, k_rs, qt, d_k, s, lds, nk, 2, v, v_rs, v_bytes, k_pf); break;
    case 3: FN(qk_dot_q8)(k, k_rs, qt, d_k, s, lds, nk, 3, v, v_rs, v_bytes, k_pf); break;
    default: FN(qk_dot_q8)(k, k_rs, qt, d_k, s, lds, nk, 4, v, v_rs, v_bytes, k_pf); break;
    }
}
