/* bfloat16 dot products over a float8 e4m3 cache: the decode rows of a bfloat16 query
 * (a->q_bf16: a 16-bit model over an 8-bit cache, vLLM's kv_cache_dtype="fp8"), and the packs
 * of its register tiles, included by attn_simd_bf16dot.h in the avx512vbmi instance of kind
 * ATTN_F32_KVE4M3 (ATTN_DPBF16 with ATTN_E4M3_DOT: its CPUs have AVX512_BF16 too), in place of
 * that file's own decode rows. These are attn_simd_bf16dot.h's decode rows, on the same hooks
 * (ws->bf16_dot, FN(bf16q_rows), FN(qk_dot_bf16_4), FN(pv_rows_pairs)), with K and V widened
 * by AVX512_VBMI's byte tables to bfloat16 instead of float32: exact (e4m3's values are
 * bfloat16s; the tables give them over KV_UNIT = 256, whose scale the caller's multiplies
 * back), so a key's products are the float32 path's, exact, and summed in float32; V's
 * products take P rounded to bfloat16, as the bfloat16 cache's decode rows do. Where the
 * float32 products took four FMAs a query row for 64 values of a key, these take two
 * vdpbf16ps. Inputs below 2^-126 read as zero (the instruction's), as for a bfloat16 cache.
 *
 * The lookups and the in-lane byte unpack (attn_e4m3_bf16_pairs_vbmi) leave 64 values as two vectors
 * of pairs: natural pairs 0-3 8-11 16-19 24-27 in the first, 4-7 12-15 20-23 28-31 in the
 * second (pairs 8L + t and 8L + 4 + t in dword 4L + t of 128-bit lane L); the query's pairs are
 * stored in that order (FN(bf16q_rows)). V's rows j and j + 1 are interleaved byte by byte first,
 * so that each word pair is (v[j][c], v[j+1][c]); a 64-column strip's column 16L + 4k + t then
 * lands in dword 4L + t of vector k, a transpose of its 128-bit blocks (FN(transpose_4x128)),
 * which the accumulators take as a call loads them and undo as it stores them. d_k and d_v
 * multiples of 64 (ATTN_BF16_DOT_SHAPE, ATTN_BF16_PV_ROWS); V's columns contiguous.
 * Not in the avx512-amx instance (ATTN_AMX; attn_table): the Xeons with AMX issue vdpbf16ps at
 * half the FMA's instruction rate, so there, as for a bfloat16 cache (attn_simd_bf16dot.h), the
 * decode rows take the float32 template's FMAs over the tables' float32 values (KV_VLOAD4), P
 * not rounded, and the longer blocks run on AMX tiles over the same packs (FN(qk_amx),
 * FN(pv_amx)), or where those do not fit (d_k < 32, d_v < 16) the float32 register tiles
 * (ATTN_PAIRS_ON_PATH, attn_simd_bf16dot.h). */

#define ATTN_BF16_DOT_SHAPE(a) ((a)->q_bf16 && (a)->d_k % 64 == 0 && ATTN_PAIRS_ON_PATH)
#define ATTN_BF16_PV_ROWS(a, ws) ((ws)->bf16_dot && (a)->d_v % 64 == 0 && (a)->v.s_col == 1)

/* ------------------------------------------ decode rows' scores (ws->bf16_dot) */
/* rows [row0, row0 + n) of q (float32 holding bfloat16 values) as their pairs, row r at
   r * d_k / 2 of FN(bf16q_base), each 32 pairs of a 64-value chunk in the lookups' order */
static ATTN_TGT void FN(bf16q_rows)(const attn_problem *a, attn_ws *ws, const char *q, int64_t n, int64_t row0)
{
    const ptrdiff_t d_k = a->d_k, q_rs = a->q.s_row, q_cs = a->q.s_col;
    uint32_t *qp = FN(bf16q_base)(ws->qt, d_k);
    ptrdiff_t i, e;
    int t;
    for (i = 0; i < n; i++)
        for (e = 0; e < d_k; e += 64) {
            uint32_t nat[32], *out = qp + (row0 + i) * (d_k / 2) + e / 2;
            for (t = 0; t < 32; t++) {
                const ptrdiff_t at = i * q_rs + (e + 2 * t) * q_cs;
                nat[t] = FN(bf16_bits)(FN(q_elem)(q, 0, at)) | FN(bf16_bits)(FN(q_elem)(q, 0, at + q_cs)) << 16;
            }
            for (t = 0; t < 16; t++) {   /* dword 4L + u: pairs 8L + u, then 8L + 4 + u */
                out[t] = nat[8 * (t / 4) + t % 4];
                out[16 + t] = nat[8 * (t / 4) + 4 + t % 4];
            }
        }
}

/* s[i][u] = scale * qp[i] . k4[u] for nq rows (FN(qk_dot4)'s, by pairs; scale includes KV_UNIT) */
static ATTN_TGT ATTN_INLINE void FN(qk_dot_bf16_4)(const uint8_t *const k4[4], const uint32_t *qp, ptrdiff_t d_k,
                                                   float scale, float *s, ptrdiff_t lds, const int nq)
{
    const __m128 vs = _mm_set1_ps(scale);
    __m512 acc[ATTN_DOT_MAX_Q][4];
    ptrdiff_t e;
    int i, u;
    for (i = 0; i < nq; i++)
        for (u = 0; u < 4; u++) acc[i][u] = _mm512_setzero_ps();
    for (e = 0; e < d_k; e += 64)
        for (u = 0; u < 4; u++) {
            __m512i w0, w1;
            attn_e4m3_bf16_pairs_vbmi(_mm512_loadu_si512((const void *)(k4[u] + e)), &w0, &w1);
            for (i = 0; i < nq; i++) {
                const uint32_t *qi = qp + i * (d_k / 2) + e / 2;
                acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)_mm512_loadu_si512((const void *)qi), (__m512bh)w0);
                acc[i][u] = _mm512_dpbf16_ps(acc[i][u], (__m512bh)_mm512_loadu_si512((const void *)(qi + 16)),
                                             (__m512bh)w1);
            }
        }
    for (i = 0; i < nq; i++) FN(hsum4_scaled)(acc[i][0], acc[i][1], acc[i][2], acc[i][3], vs, s + i * lds);
}

/* ------------------------------------------ decode rows' P.V by pairs */
/* (c0, c1, c2, c3) = the 4 x 4 transpose of the 128-bit blocks of (x0, x1, x2, x3): block k of
   c_m is block m of x_k. Its own inverse. */
static ATTN_TGT ATTN_INLINE void FN(transpose_4x128)(__m512 x[4])
{
    const __m512 t0 = _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t1 = _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 t2 = _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 t3 = _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2));
    x[0] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
    x[1] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
    x[2] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
    x[3] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

/* 64 columns of two keys' e4m3 rows y0, y1 (y1 zero: no second key) as word pairs (v[j][c],
   v[j+1][c]) over 256: the rows interleaved byte by byte, then looked up, so that column
   16L + 4k + t lands in dword 4L + t of x[k] (the transpose of x's 128-bit blocks puts them in
   column order) */
static ATTN_TGT ATTN_INLINE void FN(e4m3_key_pairs)(__m512i y0, __m512i y1, __m512i x[4])
{
    attn_e4m3_bf16_pairs_vbmi(_mm512_unpacklo_epi8(y0, y1), &x[0], &x[1]);   /* columns 16L + 0..7 */
    attn_e4m3_bf16_pairs_vbmi(_mm512_unpackhi_epi8(y0, y1), &x[2], &x[3]);   /* columns 16L + 8..15 */
}

/* acc[r][c0 + c] = alpha[r] acc[r][c0 + c] + sum_j p[r][j] v[j][c0 + c] for r < nr rows and
 * c < 64, the P pairs pw (rows ATTN_ROWS_LD / 2 words apart) of the n keys whose V rows are
 * rows[0, n). */
static ATTN_TGT ATTN_INLINE void FN(pv_pairs_strip)(const uint32_t *pw, const uint8_t *const *rows, ptrdiff_t n,
                                                     ptrdiff_t c0, ptrdiff_t d_v, float *acc, const float *alpha,
                                                     const int nr)
{
    __m512 c[ATTN_DOT_MAX_Q][4];
    ptrdiff_t j;
    int r, k;
    for (r = 0; r < nr; r++) {
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (k = 0; k < 4; k++) c[r][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d_v + c0 + 16 * k), al);
        FN(transpose_4x128)(c[r]);
    }
    for (j = 0; j < n; j += 2) {
        const __m512i y0 = _mm512_loadu_si512((const void *)(rows[j] + c0));
        const __m512i y1 = j + 1 < n ? _mm512_loadu_si512((const void *)(rows[j + 1] + c0)) : _mm512_setzero_si512();
        __m512i x[4];
        FN(e4m3_key_pairs)(y0, y1, x);
        for (r = 0; r < nr; r++) {
            const __m512i pp = _mm512_set1_epi32((int)pw[r * (ATTN_ROWS_LD / 2) + j / 2]);
            for (k = 0; k < 4; k++) c[r][k] = _mm512_dpbf16_ps(c[r][k], (__m512bh)pp, (__m512bh)x[k]);
        }
    }
    for (r = 0; r < nr; r++) {
        FN(transpose_4x128)(c[r]);
        for (k = 0; k < 4; k++) _mm512_storeu_ps(acc + r * d_v + c0 + 16 * k, c[r][k]);
    }
}

/* Rows layout by pairs (ATTN_BF16_PV_ROWS): acc = diag(alpha) acc + P V over the n <= ATTN_BK
 * keys of p (float32 rows ATTN_ROWS_LD apart, read to n rounded up to 16) whose V rows are
 * rows[0, n), every column of d_v (a multiple of 64). */
static ATTN_TGT void FN(pv_rows_pairs)(const float *p, const uint8_t *const *rows, ptrdiff_t n, ptrdiff_t d_v,
                                       float *acc, const float *alpha, int nq)
{
    uint32_t pw[ATTN_DOT_MAX_Q * (ATTN_ROWS_LD / 2)];
    ptrdiff_t c0;
    FN(p_rows_pairs)(p, n, nq, pw);
#define ATTN_PVP_CASE(NR_) case NR_:                                                          \
        for (c0 = 0; c0 < d_v; c0 += 64) FN(pv_pairs_strip)(pw, rows, n, c0, d_v, acc, alpha, NR_); \
        break;
    switch (nq) {
        ATTN_PVP_CASE(1) ATTN_PVP_CASE(2) ATTN_PVP_CASE(3)
        default: ATTN_PVP_CASE(4)
    }
#undef ATTN_PVP_CASE
}

/* ------------------------------------------ register tiles' packs (attn_simd_bf16dot.h) */
/* one e4m3 byte as the bfloat16 bits of its value over 256 (the tables'; NaN stays NaN) */
static inline uint16_t FN(e4m3_bf16_bits)(uint8_t b)
{
    return (uint16_t)(attn_e4m3_bf16_lo[b & 0x7fu] | attn_e4m3_bf16_hi[b & 0x7fu] << 8 | (b & 0x80u) << 8);
}

/* 64 e4m3 bytes at p as 64 bfloat16s in order, w[0] values 0-31 and w[1] 32-63: vpermb first
   moves byte 8L + s to 16L + s and byte 32 + 8L + s to 16L + 8 + s (s < 8), which the lookups'
   in-lane unpack undoes */
#ifndef ATTN_E4M3_ROW_ORDER   /* (one table for both instances) */
#define ATTN_E4M3_ROW_ORDER
#define ATTN_E4M3_R8(b) b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7
static const uint8_t attn_e4m3_row_order[64] __attribute__((aligned(64))) = {
    ATTN_E4M3_R8(0), ATTN_E4M3_R8(32), ATTN_E4M3_R8(8), ATTN_E4M3_R8(40),
    ATTN_E4M3_R8(16), ATTN_E4M3_R8(48), ATTN_E4M3_R8(24), ATTN_E4M3_R8(56)};
#undef ATTN_E4M3_R8
#endif
static ATTN_TGT ATTN_INLINE void FN(e4m3_bf16_row64)(const uint8_t *p, __m512i w[2])
{
    const __m512i order = _mm512_load_si512((const void *)attn_e4m3_row_order);
    attn_e4m3_bf16_pairs_vbmi(_mm512_permutexvar_epi8(order, _mm512_loadu_si512((const void *)p)), &w[0], &w[1]);
}

/* n values of an e4m3 row (cs apart) as bfloat16 over 256 into dst (FN(qk_bf16)'s K pack) */
static ATTN_TGT void FN(e4m3_row_bf16)(const uint8_t *src, ptrdiff_t cs, ptrdiff_t n, uint16_t *dst)
{
    ptrdiff_t e = 0;
    if (cs == 1)
        for (; e + 64 <= n; e += 64) {
            __m512i w[2];
            FN(e4m3_bf16_row64)(src + e, w);
            _mm512_storeu_si512((void *)(dst + e), w[0]);
            _mm512_storeu_si512((void *)(dst + e + 32), w[1]);
        }
    for (; e < n; e++) dst[e] = FN(e4m3_bf16_bits)(src[e * cs]);
}

/* V of keys [kb, kb + nk) as pairs of keys at v2, as FN(pack_v_pairs) packs a bfloat16 V:
 * v2[(j/2) ldv + c] = (v[j][c], v[j+1][c]), ldv = d_v + 16, pairs past the last key zero (so is an
 * odd count's last partner). 64 columns of two rows at a time as FN(pv_pairs_strip) forms their
 * pairs, its 128-bit blocks transposed back into column order. */
static ATTN_TGT void FN(pack_v_pairs_e4m3)(const attn_problem *a, const attn_ws *ws, int64_t kb, int64_t nk,
                                           ptrdiff_t rows, uint32_t *v2)
{
    const ptrdiff_t d_v = a->d_v, n_pairs = (nk + 1) / 2, ldv = d_v + 16;
    const ptrdiff_t v_rs = a->v.s_row, v_cs = a->v.s_col;
    const uint8_t *v = (const uint8_t *)ws->v + kb * v_rs;
    ptrdiff_t j2, c;
    int k;
    for (j2 = 0; j2 < n_pairs; j2++) {
        const int odd = 2 * j2 + 1 == nk;   /* the last key has no partner */
        const uint8_t *v0 = v + 2 * j2 * v_rs, *v1 = v0 + v_rs;
        uint32_t *vr = v2 + j2 * ldv;
        c = 0;
        if (v_cs == 1)
            for (; c + 64 <= d_v; c += 64) {
                const __m512i y0 = _mm512_loadu_si512((const void *)(v0 + c));
                const __m512i y1 = odd ? _mm512_setzero_si512() : _mm512_loadu_si512((const void *)(v1 + c));
                __m512i x[4];
                __m512 f[4];
                FN(e4m3_key_pairs)(y0, y1, x);
                for (k = 0; k < 4; k++) f[k] = _mm512_castsi512_ps(x[k]);
                FN(transpose_4x128)(f);   /* f[k]: columns 16k .. 16k + 15 */
                for (k = 0; k < 4; k++) _mm512_storeu_ps((float *)(void *)(vr + c + 16 * k), f[k]);
            }
        for (; c < d_v; c++)
            vr[c] = (uint32_t)FN(e4m3_bf16_bits)(v0[c * v_cs])
                    | (odd ? 0u : (uint32_t)FN(e4m3_bf16_bits)(v1[c * v_cs]) << 16);
    }
    for (; j2 < rows; j2++) memset(v2 + j2 * ldv, 0, sizeof(uint32_t) * (size_t)d_v);
}
