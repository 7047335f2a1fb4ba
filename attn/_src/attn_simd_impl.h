/* Micro-kernel template: included by attn_simd.h once per (instruction set,
 * element kind); the algorithm that calls these is in attn/_kernels.pyx.
 *
 * Expects: ATTN_KIND (ATTN_F32 / ATTN_F64 / ATTN_F32_KV16 / ATTN_F32_KVBF16 /
 * ATTN_F32_KVQ8 / ATTN_F32_KVE4M3 / ATTN_F32_KVE5M2), FN(name) (adds
 * the instance suffix), the V_* operations of attn_simd_ops.h, the
 * register-tile shape
 *   MR_QK x NR_QK  score tile: MR_QK keys x NR_QK vectors of queries
 *   MR_PV x NR_PV  output tile: MR_PV query rows x NR_PV vectors of columns
 * and ATTN_TGT (a target attribute or nothing) put on every function.
 * K/V stored narrower than T (ATTN_F32_KV16: float16, ATTN_F32_KVBF16:
 * bfloat16, ATTN_F32_KVQ8: q8_0 rows as attn_kernel.h describes,
 * ATTN_F32_KVE4M3 / ATTN_F32_KVE5M2: float8) also need KV_GET(p) (one stored
 * value widened exactly) and may give KV_VLOAD(p) (V_L of them widened to a
 * vector; without it, as on the generic path, FN(kv_widen) widens them
 * one by one with KV_GET). q8_0's KV_VLOAD_AT / KV_GET_AT below multiply them by
 * their group's scale. Every K or V read goes through those two.
 * KV_VLOAD4(p, out) (optional): 4 V_L values widened at once into out[0..3], in order,
 * where that costs less than four KV_VLOADs (e4m3 by AVX512_VBMI's tables); the decode
 * loops FN(qk_dot4) and FN(pv_rows) take it (the same products in the same order).
 * KV_UNIT (default 1): an instance may read K and V as their values divided by
 * KV_UNIT, a power of two (e4m3: 256, the float16 bits of attn_e4m3_over256
 * unscaled); FN(load_q) multiplies the pre-scaled query by it and FN(finish) and
 * FN(merge) the output. Scaling by a power of two is exact (short of float32's
 * overflow and subnormal range), so scores, P and the output keep their bits.
 */

#if ATTN_KIND == ATTN_F64
#define T double
#else
#define T float
#endif
#if ATTN_KIND == ATTN_F32_KV16 || ATTN_KIND == ATTN_F32_KVBF16
#define KV_T uint16_t
#define KV16 1
#define KVQ8 0
#define KVF8 0
#elif ATTN_KIND == ATTN_F32_KVQ8
#define KV_T int8_t
#define KV16 0
#define KVQ8 1
#define KVF8 0
#elif ATTN_KIND == ATTN_F32_KVE4M3 || ATTN_KIND == ATTN_F32_KVE5M2
#define KV_T uint8_t
#define KV16 0
#define KVQ8 0
#define KVF8 1
#else
#define KV_T T
#define KV16 0
#define KVQ8 0
#define KVF8 0
#define KV_VLOAD(p) V_LOAD(p)
#define KV_GET(p) (*(p))
#endif
/* K and V are stored narrower than T: tiles are widened into kpack / vpack */
#define KV_PACKED (KV16 || KVQ8 || KVF8)
#ifndef KV_UNIT
#define KV_UNIT 1
#endif
#ifndef KV_VLOAD
/* An instance without a vector widening (the generic path): V_L values, each by KV_GET. */
static ATTN_TGT ATTN_INLINE V_T FN(kv_widen)(const KV_T *p)
{
    T t[V_L];
    int u;
    for (u = 0; u < V_L; u++) t[u] = (T)KV_GET(p + u);
    return V_LOAD(t);
}
#define KV_VLOAD(p) FN(kv_widen)(p)
#endif
/* A query's element idx as T: the query stored as T, or (raw16: attn_problem.q_raw16,
   kinds ATTN_F32_KVBF16 and ATTN_F32_KV16 only) as K and V's 16-bit type, widened
   exactly (KV_GET). FN(load_q) and the loaders of attn_simd_bf16dot.h read the query
   through it. */
#if ATTN_KIND == ATTN_F32_KVBF16 || ATTN_KIND == ATTN_F32_KV16
#define ATTN_Q_RAW16(a) ((a)->q_raw16)
#else
#define ATTN_Q_RAW16(a) 0
#endif
static ATTN_TGT ATTN_INLINE T FN(q_elem)(const char *q, int raw16, ptrdiff_t idx)
{
#if ATTN_KIND == ATTN_F32_KVBF16 || ATTN_KIND == ATTN_F32_KV16
    if (raw16) return (T)KV_GET((const KV_T *)(const void *)q + idx);
#else
    (void)raw16;
#endif
    return ((const T *)(const void *)q)[idx];
}
/* Value e of the K or V row at `row` (d values): a vector of V_L from e (a
   multiple of V_L), or one. q8_0: times the scale of e's group (a vector
   never straddles two groups: V_L divides 32). */
#if KVQ8
#if ATTN_Q8_GROUP % V_L != 0
#error "attn_simd_impl.h: a q8_0 group must hold whole vectors"
#endif
static inline float FN(q8_scale)(const int8_t *row, ptrdiff_t d, ptrdiff_t e)
{
    float sc;
    memcpy(&sc, (const char *)row + d + 4 * (e / ATTN_Q8_GROUP), sizeof sc);
    return sc;
}
#define KV_VLOAD_AT(row, e, d) V_MUL(KV_VLOAD((row) + (e)), V_SET1(FN(q8_scale)((row), (d), (e))))
#define KV_GET_AT(row, e, d) ((float)(row)[e] * FN(q8_scale)((row), (d), (e)))
#define KV_ROW_BYTES(d) ((ptrdiff_t)attn_q8_row_bytes(d))
#else
#define KV_VLOAD_AT(row, e, d) KV_VLOAD((row) + (e))
#define KV_GET_AT(row, e, d) KV_GET((row) + (e))
#define KV_ROW_BYTES(d) ((d) * (ptrdiff_t)sizeof(KV_T))
#endif
#define ATTN_IS_F64 (ATTN_KIND == ATTN_F64)
#ifndef ATTN_DPBF16
#define ATTN_DPBF16 0  /* 1: the avx512-bf16 instance of ATTN_F32_KVBF16 (attn_simd_bf16dot.h), or the
                          avx512vbmi instance of ATTN_F32_KVE4M3 (with ATTN_E4M3_DOT) */
#endif
#ifndef ATTN_AMX
#define ATTN_AMX 0     /* 1: the avx512-amx instances of ATTN_F32_KVBF16 and (with ATTN_E4M3_DOT)
                          ATTN_F32_KVE4M3 (attn_simd_bf16dot.h) */
#endif
#ifndef ATTN_E4M3_DOT
#define ATTN_E4M3_DOT 0 /* 1: the avx512vbmi and avx512-amx instances of ATTN_F32_KVE4M3 (attn_simd_e4m3dot.h) */
#endif
#ifndef ATTN_Q8_VNNI
#define ATTN_Q8_VNNI 0 /* 1: the avx512-vnni instance of ATTN_F32_KVQ8 (attn_simd_q8dot.h) */
#endif

#include "attn_simd_exp.h"  /* FN(vexp) */

/* Every loop over a register tile's rows or vectors is unrolled before GCC
 * splits arrays into registers: left to its later unrolling, the tiles'
 * accumulators stayed an array on the stack, kept in registers across the
 * main loop only, then stored to the stack, reloaded and stored to S or O_i
 * at every tile's end (390 stack references in the AVX2 score tiles, 0
 * unrolled). T1024 H8 E64 dense float32, 1 thread, Zen 4, alternating
 * processes: 0.97 on AVX-512; prefill 2 x 1024 causal 0.98. */
#ifndef ATTN_UNROLL
#if defined(__GNUC__)
#define ATTN_UNROLL _Pragma("GCC unroll 16")
#else
#define ATTN_UNROLL
#endif
#endif

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
    ATTN_UNROLL
    for (r = 0; r < MR_QK; r++)
        ATTN_UNROLL
        for (v = 0; v < NR_QK; v++)
            c[r][v] = V_ZERO();
    /* rows r = 4g + u addressed as base[g] + off[u]: 3 + 3 registers instead of
       one per row (12 row pointers would spill) */
    const T *base[(MR_QK + 3) / 4];
    const ptrdiff_t off[4] = {0, k_rs, 2 * k_rs, 3 * k_rs};
    ATTN_UNROLL
    for (r = 0; r < (MR_QK + 3) / 4; r++) base[r] = k + 4 * r * k_rs;
    for (e = 0; e < d_k; e++) {
        V_T b[NR_QK];
        ATTN_UNROLL
        for (v = 0; v < NR_QK; v++)
            if (v < nv) b[v] = V_LOAD(qt + e * ldq + v * V_L);
        ATTN_UNROLL
        for (r = 0; r < MR_QK; r++) {
            if (r < nr) {
                V_T a = V_SET1(base[r / 4][off[r % 4]]);
                ATTN_UNROLL
                for (v = 0; v < NR_QK; v++)
                    if (v < nv) c[r][v] = V_FMA(a, b[v], c[r][v]);
            }
        }
        ATTN_UNROLL
        for (r = 0; r < (MR_QK + 3) / 4; r++) base[r] += k_cs;
    }
    ATTN_UNROLL
    for (r = 0; r < MR_QK; r++)
        if (r < nr)
            ATTN_UNROLL
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
    ATTN_UNROLL
    for (r = 0; r < MR_PV; r++) {
        if (r < nr) {
            V_T a = V_SET1(alpha[r]);
            ATTN_UNROLL
            for (w = 0; w < NR_PV; w++)
                if (w < nv) c[r][w] = V_MUL(V_LOAD(acc + r * lda + w * V_L), a);
        }
    }
    for (j = 0; j < nk; j++) {
        V_T b[NR_PV];
        const T *pj = p + j * ldp;
        ATTN_UNROLL
        for (w = 0; w < NR_PV; w++)
            if (w < nv) b[w] = V_LOAD(v + j * ldv + w * V_L);
        ATTN_UNROLL
        for (r = 0; r < MR_PV; r++) {
            if (r < nr) {
                V_T a = V_SET1(pj[r]);
                ATTN_UNROLL
                for (w = 0; w < NR_PV; w++)
                    if (w < nv) c[r][w] = V_FMA(a, b[w], c[r][w]);
            }
        }
    }
    ATTN_UNROLL
    for (r = 0; r < MR_PV; r++)
        if (r < nr)
            ATTN_UNROLL
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

/* Vectors of columns per call of FN(pv_rows) for nr rows: NR_PV, or with
 * ATTN_PVR_WIDE (16 registers) as many as keep at least eight independent
 * accumulators without spilling: one row 8 (a row of 64 floats in one pass,
 * eight chains instead of two waiting on the FMA latency), two 4, three 3,
 * four 2. Each column's sum over the keys is the same whatever the width. */
#if ATTN_PVR_WIDE
#define ATTN_PVR_W 8
#define ATTN_PVR_NV(nr) ((nr) == 1 ? 8 : (nr) == 2 ? 4 : (nr) == 3 ? 3 : 2)
#else
#define ATTN_PVR_W NR_PV
#define ATTN_PVR_NV(nr) NR_PV
#endif

/* Few query rows (decode), P in the rows layout: acc[r][c] = alpha[r] *
 * acc[r][c] + sum_j p[r][j] * v[j][c0 + c] for r < nr (<= ATTN_DOT_MAX_Q) rows and
 * c < nv * V_L columns (v at column 0 of rows of d_v), each V row read once (widened from float16 in
 * registers when V is half precision) for all nr rows. */
static ATTN_TGT ATTN_INLINE void FN(pv_rows)(const T *p, const KV_T *v, ptrdiff_t v_rs,
                                              ptrdiff_t c0, ptrdiff_t d_v,
                                              T *acc, ptrdiff_t lda, const T *alpha,
                                              ptrdiff_t nk, const int nr, const int nv,
                                              const char *pf, ptrdiff_t pf_rs, ptrdiff_t pf_n, ptrdiff_t pf_bytes)
{
    V_T c[ATTN_DOT_MAX_Q][ATTN_PVR_W];
    int r, w;
    ptrdiff_t j, b;
    for (r = 0; r < nr; r++) {
        V_T a = V_SET1(alpha[r]);
        for (w = 0; w < nv; w++) c[r][w] = V_MUL(V_LOAD(acc + r * lda + w * V_L), a);
    }
    for (j = 0; j < nk; j++) {
        V_T vb[ATTN_PVR_W];
        if (j < pf_n)
            for (b = 0; b < pf_bytes; b += 64) ATTN_PREFETCH_L2(pf + j * pf_rs + b);
#ifdef KV_VLOAD4
        if (nv == 4) KV_VLOAD4(v + j * v_rs + c0, vb);
        else
#endif
        for (w = 0; w < nv; w++) vb[w] = KV_VLOAD_AT(v + j * v_rs, c0 + w * V_L, d_v);
        for (r = 0; r < nr; r++) {
            V_T a = V_SET1(p[r * ATTN_ROWS_LD + j]);
            for (w = 0; w < nv; w++) c[r][w] = V_FMA(a, vb[w], c[r][w]);
        }
    }
    for (r = 0; r < nr; r++)
        for (w = 0; w < nv; w++) V_STORE(acc + r * lda + w * V_L, c[r][w]);
}

#if ATTN_DOT_MAX_Q != 4
#error "attn_simd_impl.h: FN(pv_rows_any) has cases for ATTN_DOT_MAX_Q = 4"
#endif
#define ATTN_PVR_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(pv_rows)(p, v, v_rs, c0, d_v, acc, lda, alpha, nk, NR_, NV_, pf, pf_rs, pf_n, pf_bytes); break;
#if NR_PV > 2
#define ATTN_PVR_CASES(NR_) ATTN_PVR_CASE(NR_, 1) ATTN_PVR_CASE(NR_, 2) ATTN_PVR_CASE(NR_, 3) \
    ATTN_PVR_CASE(NR_, 4)
#else
#define ATTN_PVR_CASES(NR_) ATTN_PVR_CASE(NR_, 1) ATTN_PVR_CASE(NR_, 2)
#endif
static ATTN_TGT void FN(pv_rows_any)(const T *p, const KV_T *v, ptrdiff_t v_rs, ptrdiff_t c0,
                                     ptrdiff_t d_v, T *acc, ptrdiff_t lda, const T *alpha,
                                     ptrdiff_t nk, int nr, int nv,
                                     const char *pf, ptrdiff_t pf_rs, ptrdiff_t pf_n, ptrdiff_t pf_bytes)
{
#if ATTN_PVR_WIDE
#undef ATTN_PVR_CASE
#define ATTN_PVR_CASE(NR_, NV_) case (NR_) * 16 + (NV_): \
    FN(pv_rows)(p, v, v_rs, c0, d_v, acc, lda, alpha, nk, NR_, NV_, pf, pf_rs, pf_n, pf_bytes); break;
    switch (nr * 16 + nv) {
        ATTN_PVR_CASE(1, 1) ATTN_PVR_CASE(1, 2) ATTN_PVR_CASE(1, 3) ATTN_PVR_CASE(1, 4)
        ATTN_PVR_CASE(1, 5) ATTN_PVR_CASE(1, 6) ATTN_PVR_CASE(1, 7) ATTN_PVR_CASE(1, 8)
        ATTN_PVR_CASE(2, 1) ATTN_PVR_CASE(2, 2) ATTN_PVR_CASE(2, 3) ATTN_PVR_CASE(2, 4)
        ATTN_PVR_CASE(3, 1) ATTN_PVR_CASE(3, 2) ATTN_PVR_CASE(3, 3)
        ATTN_PVR_CASE(4, 1) ATTN_PVR_CASE(4, 2)
        default: break;
    }
#else
    switch (nr * 8 + nv) {
        ATTN_PVR_CASES(1) ATTN_PVR_CASES(2) ATTN_PVR_CASES(3) ATTN_PVR_CASES(4)
        default: break;
    }
#endif
}
#undef ATTN_PVR_CASE
#undef ATTN_PVR_CASES

/* The scores of four key rows k4[0..3] for nq rows: s[i][u] = qr[i] . k4[u]
 * (s rows lds apart), nq x 4 accumulators whose horizontal sums share their
 * shuffles (V_HSUM4; one V_HSUM per key cost more than the FMAs at d_k = 64).
 * V_HSUM4 sums each of its four vectors alike, so a key's score does not
 * depend on its place among the four, nor on which keys are beside it. */
static ATTN_TGT ATTN_INLINE void FN(qk_dot4)(const KV_T *const k4[4], const T *qr, ptrdiff_t d_k,
                                              T *s, ptrdiff_t lds, const int nq)
{
    const ptrdiff_t dv = d_k / V_L * V_L;
    V_T acc[ATTN_DOT_MAX_Q][4];
    ptrdiff_t e;
    int i, u;
    for (i = 0; i < nq; i++)
        for (u = 0; u < 4; u++) acc[i][u] = V_ZERO();
    e = 0;
#ifdef KV_VLOAD4   /* four vectors of a key at a time: the same products, in the same order */
    for (; e + 4 * V_L <= dv; e += 4 * V_L)
        for (u = 0; u < 4; u++) {
            V_T kv4[4];
            int c;
            KV_VLOAD4(k4[u] + e, kv4);
            for (i = 0; i < nq; i++)
                for (c = 0; c < 4; c++) acc[i][u] = V_FMA(kv4[c], V_LOAD(qr + i * d_k + e + c * V_L), acc[i][u]);
        }
#endif
    for (; e < dv; e += V_L) {
        V_T kv[4];
        for (u = 0; u < 4; u++) kv[u] = KV_VLOAD_AT(k4[u], e, d_k);
        for (i = 0; i < nq; i++) {
            const V_T qv = V_LOAD(qr + i * d_k + e);
            for (u = 0; u < 4; u++) acc[i][u] = V_FMA(kv[u], qv, acc[i][u]);
        }
    }
    for (i = 0; i < nq; i++)   /* the four keys of row i are adjacent in s */
        V_HSUM4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], s + i * lds);
    if (dv < d_k)
        for (i = 0; i < nq; i++)
            for (u = 0; u < 4; u++) {
                T sum = s[i * lds + u];
                for (e = dv; e < d_k; e++) sum += (T)KV_GET_AT(k4[u], e, d_k) * qr[i * d_k + e];
                s[i * lds + u] = sum;
            }
}

#if ATTN_DPBF16   /* (attn_simd_bf16dot.h, with ATTN_E4M3_DOT attn_simd_e4m3dot.h, included below) */
static ATTN_TGT ATTN_INLINE void FN(qk_dot_bf16_4)(const KV_T *const k4[4], const uint32_t *qp, ptrdiff_t d_k,
                                                   float scale, float *s, ptrdiff_t lds, const int nq);
#endif

/* The scores of four key rows for nq rows: by bfloat16 pairs when qp is given (a bfloat16
 * query's, ws->bf16_dot: FN(qk_dot_bf16_4), times scale), else FN(qk_dot4) on qr (pre-scaled). */
static ATTN_TGT ATTN_INLINE void FN(qk_four)(const KV_T *const k4[4], const T *qr, const uint32_t *qp, T scale,
                                              ptrdiff_t d_k, T *s, ptrdiff_t lds, const int nq)
{
#if ATTN_DPBF16
    if (qp != NULL) {
        FN(qk_dot_bf16_4)(k4, qp, d_k, scale * (T)KV_UNIT, s, lds, nq);   /* (K in 1 / KV_UNIT) */
        return;
    }
#else
    (void)qp; (void)scale;
#endif
    FN(qk_dot4)(k4, qr, d_k, s, lds, nq);
}

/* Few query rows (decode): s[i][j] = qr[i] . k[j] as dot products along d_k,
 * each key row read once with full vector loads (widened from float16 in
 * registers when K is half precision) for all nq rows. qr: [nq][d_k]; s is
 * row-major (the "rows" layout, see FN(scores)). nq is a compile-time
 * constant in each copy (see FN(qk_dot_any)), so the accumulators live in
 * registers. Keys go four at a time (FN(qk_dot4)), the last one to three
 * too, with the last key standing in for the missing ones: every key's
 * score is the same sum, wherever the key rows are cut (pages read in place
 * give the bits of a contiguous cache). Prefetches K's rows k_pf keys ahead
 * (0: none, the caller prefetches) and V's rows of the keys it scores (into
 * L2: see ATTN_PREFETCH_PAGED_KEYS). With qp
 * (contiguous rows only), the four keys' scores by bfloat16 pairs (FN(qk_four)). */
static ATTN_TGT ATTN_INLINE void FN(qk_dot)(const KV_T *k, ptrdiff_t k_rs, ptrdiff_t k_cs,
                                             const T *qr, const uint32_t *qp, T scale, ptrdiff_t d_k,
                                             T *s, ptrdiff_t lds, ptrdiff_t nk, const int nq, const KV_T *v,
                                             ptrdiff_t v_rs, ptrdiff_t v_bytes, ptrdiff_t k_pf)
{
    const ptrdiff_t k_bytes = KV_ROW_BYTES(d_k);
    ptrdiff_t j = 0, b;
    int i, u;
    if (k_cs == 1) {
        for (; j + 4 <= nk; j += 4) {
            const KV_T *kr = k + j * k_rs;
            const KV_T *const k4[4] = {kr, kr + k_rs, kr + 2 * k_rs, kr + 3 * k_rs};
            for (u = 0; u < 4; u++) {
                const char *kp = (const char *)(kr + (k_pf + u) * k_rs);
                const char *vp = (const char *)(v + (j + u) * v_rs);
                if (k_pf > 0)
                    for (b = 0; b < k_bytes; b += 64) ATTN_PREFETCH(kp + b);
                for (b = 0; b < v_bytes; b += 64) ATTN_PREFETCH_L2(vp + b);
            }
            FN(qk_four)(k4, qr, qp, scale, d_k, s + j, lds, nq);
        }
        if (j < nk) {   /* the last keys */
            const ptrdiff_t left = nk - j;
            const KV_T *const k4[4] = {k + j * k_rs, k + (left > 1 ? j + 1 : nk - 1) * k_rs,
                                       k + (left > 2 ? j + 2 : nk - 1) * k_rs, k + (nk - 1) * k_rs};
            T four[ATTN_DOT_MAX_Q * 4];
            FN(qk_four)(k4, qr, qp, scale, d_k, four, 4, nq);
            for (i = 0; i < nq; i++)
                for (u = 0; u < left; u++) s[i * lds + j + u] = four[i * 4 + u];
        }
        return;
    }
#if !KVQ8   /* (q8_0 rows are contiguous: attn._kernels.attention checks) */
    for (; j < nk; j++) {      /* strided columns */
        const KV_T *kr = k + j * k_rs;
        for (i = 0; i < nq; i++) {
            T sum = 0;
            ptrdiff_t e;
            for (e = 0; e < d_k; e++) sum += (T)KV_GET(kr + e * k_cs) * qr[i * d_k + e];
            s[i * lds + j] = sum;
        }
    }
#endif
}

#if ATTN_Q8_VNNI
#include "attn_simd_q8dot.h"
#endif

#if ATTN_DOT_MAX_Q != 4
#error "attn_simd_impl.h: FN(qk_dot_any) has cases for ATTN_DOT_MAX_Q = 4"
#endif
static ATTN_TGT void FN(qk_dot_any)(const KV_T *k, ptrdiff_t k_rs, ptrdiff_t k_cs, const T *qr,
                                    const uint32_t *qp, T scale, ptrdiff_t d_k, T *s, ptrdiff_t lds,
                                    ptrdiff_t nk, int nq, const KV_T *v, ptrdiff_t v_rs, ptrdiff_t v_bytes,
                                    ptrdiff_t k_pf)
{
    switch (nq) {
    case 1: FN(qk_dot)(k, k_rs, k_cs, qr, qp, scale, d_k, s, lds, nk, 1, v, v_rs, v_bytes, k_pf); break;
    case 2: FN(qk_dot)(k, k_rs, k_cs, qr, qp, scale, d_k, s, lds, nk, 2, v, v_rs, v_bytes, k_pf); break;
    case 3: FN(qk_dot)(k, k_rs, k_cs, qr, qp, scale, d_k, s, lds, nk, 3, v, v_rs, v_bytes, k_pf); break;
    default: FN(qk_dot)(k, k_rs, k_cs, qr, qp, scale, d_k, s, lds, nk, 4, v, v_rs, v_bytes, k_pf); break;
    }
}

/* Widen (or copy) rows [0, nk) x columns [0, n) (all n of a row) of a K or V
 * tile into pack, row length ldp; used for 16-bit and q8_0 tiles and for
 * strided / badly aligned ones. */
static ATTN_TGT void FN(pack_tile)(const KV_T *x, ptrdiff_t rs, ptrdiff_t cs, ptrdiff_t nk,
                                   ptrdiff_t n, T *pack, ptrdiff_t ldp)
{
    const ptrdiff_t nv = n / V_L * V_L;
    ptrdiff_t j, e;
    for (j = 0; j < nk; j++) {
        const KV_T *xr = x + j * rs;
        T *p = pack + j * ldp;
        if (cs == 1) {
            for (e = 0; e < nv; e += V_L) V_STORE(p + e, KV_VLOAD_AT(xr, e, n));
            for (; e < n; e++) p[e] = (T)KV_GET_AT(xr, e, n);
        } else {
#if !KVQ8   /* (q8_0 rows are contiguous: attn._kernels.attention checks) */
            for (e = 0; e < n; e++) p[e] = (T)KV_GET(xr + e * cs);
#endif
        }
    }
}

#if ATTN_DPBF16   /* (with ATTN_E4M3_DOT, attn_simd_e4m3dot.h through it) */
#include "attn_simd_bf16dot.h"
#endif

/* ------------------------------------------------------------- block state */
static ATTN_TGT void FN(begin)(const attn_problem *a, attn_ws *ws, int64_t nq)
{
    const ptrdiff_t bqp = (nq + V_L - 1) / V_L * V_L;
    /* leading dimension of qt and s: one vector more than bqp, so that rows
       are not a power of two apart (1 KiB strides in float64 put the rows of
       a tile in 4 of the 64 L1 sets and measured 30 % slower) */
    const ptrdiff_t ld = bqp + V_L;
    T *m = (T *)ws->m, *l = (T *)ws->l;
    ptrdiff_t i, e;
    ws->nq = nq; ws->bqp = bqp; ws->ld = ld;
    for (i = 0; i < bqp; i++) { m[i] = -ATTN_INF; l[i] = 0; }
    memset(ws->acc, 0, sizeof(T) * (size_t)(nq * a->d_v));
    if (nq > ATTN_DOT_MAX_Q) {  /* the register tiles read the padding rows of qt */
        T *qt = (T *)ws->qt;
        for (e = 0; e < a->d_k; e++)
            for (i = nq; i < bqp; i++) qt[e * ld + i] = 0;
    }
    ws->amx = 0;
    ws->s_scale = 1;
    ws->p_pairs = 0;
    ws->q8_dot = ATTN_Q8_VNNI && nq <= ATTN_DOT_MAX_Q && ATTN_Q8_DOT_SHAPE(a);
#if ATTN_DPBF16
    ws->bf16_dot = nq <= ATTN_DOT_MAX_Q && ATTN_BF16_DOT_SHAPE(a);
#else
    ws->bf16_dot = 0;
#endif
#if ATTN_DPBF16
    {
        const int s_unscaled = a->mask_kind != ATTN_MASK_ADD && !(a->softcap > 0) && ws->alibi_slope == 0
                               && a->weights == NULL && a->scale > 0;
        if (ATTN_BF16_BLOCK(a, ws) && a->weights == NULL) {
            ws->p_pairs = a->d_v % 16 != 0 ? 2 : 1;
            if (s_unscaled) ws->s_scale = (float)a->scale * (float)KV_UNIT;   /* (K in 1 / KV_UNIT) */
        }
#if ATTN_AMX
        if (ATTN_AMX_BLOCK(a, ws)) {
            ws->amx = a->d_v % 16 != 0 ? 2 : 1;
            ws->p_pairs = 0;
            ws->s_scale = s_unscaled ? (float)a->scale * (float)KV_UNIT : 1;   /* (K in 1 / KV_UNIT) */
            FN(amx_begin)(a, ws);
        }
#endif
    }
#endif
}

static ATTN_TGT void FN(load_q)(const attn_problem *a, attn_ws *ws, const char *qc, int64_t n,
                                int64_t row0)
{
    const T scale = (T)a->scale * (T)KV_UNIT;   /* (K read in units of 1 / KV_UNIT) */
    const ptrdiff_t d_k = a->d_k, q_rs = a->q.s_row, q_cs = a->q.s_col, ld = ws->ld;
    const int raw16 = ATTN_Q_RAW16(a);   /* (q is then bfloat16: read through FN(q_elem)) */
    T *qt = (T *)ws->qt;
    ptrdiff_t i, e;
#if ATTN_DPBF16
    if (ATTN_BF16_BLOCK(a, ws)) {
        FN(load_q_bf16)(a, ws, qc, n, row0);
        return;
    }
#endif
    if (ws->nq <= ATTN_DOT_MAX_Q) {          /* rows [nq][d_k] for FN(qk_dot) */
        for (i = 0; i < n; i++)
            for (e = 0; e < d_k; e++) qt[(row0 + i) * d_k + e] = FN(q_elem)(qc, raw16, i * q_rs + e * q_cs) * scale;
#if ATTN_Q8_VNNI
        if (ws->q8_dot) FN(q8q_rows)(qt, d_k, row0, n);   /* for FN(qk_dot_q8) */
#endif
#if ATTN_DPBF16
        if (ws->bf16_dot) FN(bf16q_rows)(a, ws, qc, n, row0);   /* for FN(qk_dot_bf16) */
#endif
    } else {                                 /* transposed [d_k][ld] for the register tiles */
        /* 16 rows at a time: rows far apart (FlashAttention's [.., L, H, E] puts H E elements
           between them) then stay in L1 and the TLB while their d_k columns are read, where a
           walk down all n rows per column missed both for every element (prefill 2 x 1024, H32
           E128, float32: the [L, H, E] call took 1.11x the [H, L, E] one on a 2-core Zen 4) */
        ptrdiff_t i0, i1;
        for (i0 = 0; i0 < n; i0 += 16) {
            i1 = i0 + 16 < n ? i0 + 16 : n;
            e = 0;
#if ATTN_X86_DISPATCH && V_L == 16 && !ATTN_IS_F64   /* AVX-512 float32: 16 x 16 in registers */
            if (i1 - i0 == 16 && q_cs == 1 && !raw16)
                for (; e + 16 <= d_k; e += 16)
                    attn_scaled_transpose_16x16_f32_avx512((const T *)(const void *)qc + i0 * q_rs + e, q_rs, scale,
                                                           qt + e * ld + row0 + i0, ld);
#if ATTN_KIND == ATTN_F32_KVBF16 || ATTN_KIND == ATTN_F32_KV16
            if (i1 - i0 == 16 && q_cs == 1 && raw16)   /* 16 x 16 widened (exactly) first */
                for (; e + 16 <= d_k; e += 16) {
                    T wide[16 * 16];
                    for (i = 0; i < 16; i++)
                        V_STORE(wide + i * 16, KV_VLOAD((const KV_T *)(const void *)qc + (i0 + i) * q_rs + e));
                    attn_scaled_transpose_16x16_f32_avx512(wide, 16, scale, qt + e * ld + row0 + i0, ld);
                }
#endif
#endif
            for (; e < d_k; e++)
                for (i = i0; i < i1; i++) qt[e * ld + row0 + i] = FN(q_elem)(qc, raw16, i * q_rs + e * q_cs) * scale;
        }
#if ATTN_Q8_VNNI
        if (ATTN_Q8_DOT_SHAPE(a)) FN(q8q_round_columns)(qt, ld, d_k, row0, n);   /* (a decode call) */
#endif
    }
}

/* ---------------------------------------------------------------- S tile
 * Two layouts of S, chosen by the block's row count:
 *   key-major  s[j * ld + i] (nq > ATTN_DOT_MAX_Q): the register tiles' output;
 *              the softmax runs V_L query rows at a time.
 *   rows       s[i * ATTN_ROWS_LD + j] (nq <= ATTN_DOT_MAX_Q, decode): the dot
 *              products' output; the softmax runs V_L keys at a time, and
 *              keys [nk, nk rounded up to V_L) hold -inf (exp gives 0).
 * FN(online_softmax), FN(pv) and FN(weights) read the same layout. */

/* The variants on a score tile (attn_problem's softcap and ALiBi), element
 * (row i0 + i, key kb + j) at s[i * rs + j * cs] for i < nq, j < nk; after
 * the products, before the mask (attn/_variants.py):
 *   s = softcap tanh(s / softcap);  s -= slope |i0 + i + alibi_offset - (kb + j)|. */
static ATTN_TGT void FN(score_mods)(const attn_problem *a, const attn_ws *ws, int64_t kb,
                                    int64_t nk, T *s, ptrdiff_t rs, ptrdiff_t cs)
{
    const ptrdiff_t nq = ws->nq;
    const T cap = (T)a->softcap, slope = (T)ws->alibi_slope;
    ptrdiff_t i, j;
    if (cap > 0) {  /* along the contiguous direction: rows (key-major) or keys (rows layout) */
        if (rs == 1)
            for (j = 0; j < nk; j++) FN(softcap_run)(s + j * cs, nq, cap);
        else
            for (i = 0; i < nq; i++) FN(softcap_run)(s + i * rs, nk, cap);
    }
    if (slope != 0) {
        /* distance d = (i0 + alibi_offset - kb) + i - j, along the contiguous direction */
        const T d00 = (T)(ws->i0 + a->alibi_offset - kb);
        if (rs == 1)  /* key-major: rows contiguous, d = (d00 - j) + i */
            for (j = 0; j < nk; j++) FN(alibi_run)(s + j * cs, nq, d00 - (T)j, (T)1, slope);
        else          /* rows layout: keys contiguous, d = (d00 + i) - j */
            for (i = 0; i < nq; i++) FN(alibi_run)(s + i * rs, nk, d00 + (T)i, (T)-1, slope);
    }
}

/* The sliding window on a score tile (layout as FN(score_mods): the
 * contiguous direction is rows when rs == 1, else keys, cs == 1): key kb + j
 * outside [i0 + i + win_lo, i0 + i + win_hi] gets -inf. Only tiles crossing
 * an edge of the window have anything to do. */
static ATTN_TGT void FN(window_tile)(const attn_problem *a, const attn_ws *ws, int64_t kb,
                                     int64_t nk, T *s, ptrdiff_t rs, ptrdiff_t cs)
{
    const ptrdiff_t nq = ws->nq, i0 = ws->i0;
    ptrdiff_t i, j;
    if (kb >= i0 + nq - 1 + a->win_lo && kb + nk - 1 <= i0 + a->win_hi)
        return;  /* every key of the tile inside every row's window */
    /* Row i sees keys j in [lo0 + i, hi0 + i]: along the contiguous direction the
     * invisible entries are two runs, filled without a branch per entry */
    const ptrdiff_t lo0 = i0 + a->win_lo - kb, hi0 = i0 + a->win_hi - kb;
    if (rs == 1) {  /* key-major: key j hides rows i > j - lo0 and rows i < j - hi0 */
        for (j = 0; j < nk; j++) {
            T *sc = s + j * cs;
            const ptrdiff_t after = j - lo0 + 1, before = j - hi0;
            for (i = after < 0 ? 0 : after; i < nq; i++) sc[i] = -ATTN_INF;
            for (i = 0; i < (before < nq ? before : nq); i++) sc[i] = -ATTN_INF;
        }
    } else {        /* rows layout: row i hides keys j < lo0 + i and keys j > hi0 + i */
        for (i = 0; i < nq; i++) {
            T *sr = s + i * rs;
            const ptrdiff_t lo = lo0 + i, hi = hi0 + i + 1;
            for (j = 0; j < (lo < nk ? lo : nk); j++) sr[j] = -ATTN_INF;
            for (j = hi < 0 ? 0 : hi; j < nk; j++) sr[j] = -ATTN_INF;
        }
    }
}

/* Rows layout, the products: s[i][j] = q[i] . k[j] for the nk key rows at k
 * (V's rows at v prefetched as they go, when contiguous and pf_v), K's rows
 * prefetched k_pf keys ahead (0: none). */
static ATTN_TGT void FN(scores_dot)(const attn_problem *a, const attn_ws *ws, const KV_T *k, const KV_T *v,
                                    T *s, ptrdiff_t nk, ptrdiff_t k_pf, int pf_v)
{
    const ptrdiff_t v_bytes = a->v.s_col == 1 && pf_v ? KV_ROW_BYTES(a->d_v) : 0;
#if ATTN_Q8_VNNI
    if (ws->q8_dot) {
        FN(qk_dot_q8_any)((const int8_t *)k, a->k.s_row, (const T *)ws->qt, a->d_k, s, ATTN_ROWS_LD, nk,
                          (int)ws->nq, (const int8_t *)v, a->v.s_row, v_bytes, k_pf);
        return;
    }
#endif
    const uint32_t *qp = NULL;   /* a bfloat16 query's pairs (ws->bf16_dot): products by pairs */
#if ATTN_DPBF16
    if (ws->bf16_dot && a->k.s_col == 1) qp = FN(bf16q_base)(ws->qt, a->d_k);
#endif
    FN(qk_dot_any)(k, a->k.s_row, a->k.s_col, (const T *)ws->qt, qp, (T)a->scale, a->d_k, s, ATTN_ROWS_LD, nk,
                   (int)ws->nq, v, a->v.s_row, v_bytes, k_pf);
}

/* Key row j of the block's K (V: v = 1) from the row of key kb, as FN(scores_rows) reads it. */
static ATTN_INLINE const char *FN(kv_row)(const attn_problem *a, const attn_ws *ws, int v, int64_t j)
{
    const char *base = v ? ws->v : ws->k;
    const int64_t rs = v ? a->v.s_row : a->k.s_row;
    if (ws->pages != NULL) return attn_paged_row(a, ws->pages, base, v ? a->v_page : a->k_page, rs, j);
    return base + j * rs * (int64_t)sizeof(KV_T);
}

/* Rows layout, after the products of keys [kb, kb + nk): the variants, the
 * mask, the causal diagonal and the window; keys [nk, nk rounded up to V_L)
 * and every invisible one -inf. */
static ATTN_TGT void FN(scores_rows_edges)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, i0 = ws->i0, nkp = (nk + V_L - 1) / V_L * V_L;
    T *s = (T *)ws->s;
    ptrdiff_t i, j;
    if (a->softcap > 0 || ws->alibi_slope != 0) FN(score_mods)(a, ws, kb, nk, s, ATTN_ROWS_LD, 1);
    for (i = 0; i < nq; i++) {
        T *sr = s + i * ATTN_ROWS_LD;
        if (a->mask_kind != ATTN_MASK_NONE) {
            /* row i's mask (m_rs = 0: one row shared by the block's heads) */
            const ptrdiff_t m_cs = a->mask.s_col, at = (i0 + i) * ws->m_rs + kb * m_cs;
            if (a->mask_kind == ATTN_MASK_BOOL) {
                /* masked: -inf, whatever the score (NaN too) */
                const uint8_t *mr = (const uint8_t *)ws->mask + at;
                for (j = 0; j < nk; j++) sr[j] = mr[j * m_cs] != 0 ? sr[j] : -ATTN_INF;
            } else {
                const T *mr = (const T *)ws->mask + at;
                for (j = 0; j < nk; j++) sr[j] += mr[j * m_cs];
            }
        }
        j = nk;
        if (ws->causal) {   /* key kb + j is visible to row i0 + i iff kb + j <= i0 + i + offset */
            const ptrdiff_t end = i0 + i + a->causal_offset + 1 - kb;
            j = end < 0 ? 0 : end < nk ? end : nk;
        }
        for (; j < nkp; j++) sr[j] = -ATTN_INF;
    }
    if (ws->window) FN(window_tile)(a, ws, kb, nk, s, ATTN_ROWS_LD, 1);
}

/* Rows layout: s[i][j] = scale * q[i] . k[kb + j] (+ mask), invisible -inf. */
static ATTN_TGT void FN(scores_rows)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    /* (the int8 dot products read further ahead: each key costs less) */
    const ptrdiff_t k_pf = ws->q8_dot ? 2 * ATTN_PREFETCH_KEYS : ATTN_PREFETCH_KEYS;
    T *s = (T *)ws->s;
    if (ws->pages == NULL) {
        FN(scores_dot)(a, ws, (const KV_T *)ws->k + kb * a->k.s_row, (const KV_T *)ws->v + kb * a->v.s_row,
                       s, nk, k_pf, kb >= ws->v_pf_end);
    } else {
        /* a paged K/V read in place: runs of one page's keys, as many as hold
           ATTN_PAGED_RUN_BYTES of K's rows (a multiple of 4 from 4 to 16),
           each prefetching K's rows up to ATTN_PREFETCH_PAGED_KEYS keys past
           it into L2 (in whatever pages they lie), and V's rows of its keys
           (save those the last tile's P V prefetched: ws->v_pf_end). The rows
           are walked a page at a time (one look-up in the page list a page:
           three a run cost more than a run's products with E64 heads). */
        const ptrdiff_t kvsz = (ptrdiff_t)attn_kind_kv_size(a->kind), k_bytes = KV_ROW_BYTES(a->d_k);
        const ptrdiff_t k_step = a->k.s_row * kvsz, v_step = a->v.s_row * kvsz;
        const char *kp = NULL, *vp = NULL, *fp = NULL;    /* key kb + j0's K and V rows; key f's K row */
        int64_t left = 0, f = kb + ATTN_PREFETCH_PAGED_KEYS, f_left = 0;   /* the rows from them in their page */
        ptrdiff_t run_keys = ATTN_PAGED_RUN_BYTES / k_bytes / 4 * 4, j0, n, b;
        if (run_keys < 4) run_keys = 4;
        if (run_keys > 16) run_keys = 16;
        for (j0 = 0; j0 < nk; j0 += n) {
            const int64_t key = kb + j0;
            if (left == 0) {
                kp = FN(kv_row)(a, ws, 0, key);
                vp = FN(kv_row)(a, ws, 1, key);
                left = attn_paged_run(a, key);
            }
            n = nk - j0 < left ? nk - j0 : (ptrdiff_t)left;
            if (n > run_keys) n = run_keys;
            for (; f < key + n + ATTN_PREFETCH_PAGED_KEYS && f < ws->kv_end; f++, f_left--, fp += k_step) {
                if (f_left == 0) {
                    fp = FN(kv_row)(a, ws, 0, f);
                    f_left = attn_paged_run(a, f);
                }
                for (b = 0; b < k_bytes; b += 64) ATTN_PREFETCH_L2(fp + b);
            }
            FN(scores_dot)(a, ws, (const KV_T *)(const void *)kp, (const KV_T *)(const void *)vp, s + j0, n, 0,
                           key >= ws->v_pf_end);
            kp += n * k_step;
            vp += n * v_step;
            left -= n;
        }
    }
    FN(scores_rows_edges)(a, ws, kb, nk);
}

/* Key-major layout: s[j][i] for j < nk keys and i < bqp (padded) rows. */
static ATTN_TGT void FN(scores)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, bqp = ws->bqp, ld = ws->ld, nvq = bqp / V_L, d_k = a->d_k;
    const ptrdiff_t i0 = ws->i0;
    const KV_T *k = (const KV_T *)ws->k + kb * a->k.s_row;
    const T *qt = (const T *)ws->qt;
    T *s = (T *)ws->s, *mt = (T *)ws->mt;
    ptrdiff_t i, j, it, jt;
    if (nq <= ATTN_DOT_MAX_Q) {
        FN(scores_rows)(a, ws, kb, nk);
        return;
    }
#if ATTN_DPBF16
    if (ATTN_BF16_BLOCK(a, ws))
        FN(qk_bf16)(a, ws, kb, nk);
    else
#endif
    {
        /* Tile t covers key rows jt and query strip it. d_k < STRIPS_OUTER_DK:
         * key rows outermost, so each group of MR_QK key rows stays in L1
         * while every query strip passes; else query strips outermost (see
         * attn_kernel.h). */
        const ptrdiff_t n_jt = (nk + MR_QK - 1) / MR_QK, n_it = (nvq + NR_QK - 1) / NR_QK;
        const int strips_outer = d_k >= ATTN_STRIPS_OUTER_DK;
        const T *kt;
        ptrdiff_t k_rs = a->k.s_row, k_cs = a->k.s_col, t;
#if KV_PACKED
        if (ws->kwide != NULL) {   /* widened once, into the thread's copy of the keys */
            kt = (const T *)ws->kwide + kb * (d_k + ATTN_VL_MAX);
        } else {
            FN(pack_tile)(k, k_rs, k_cs, nk, d_k, (T *)ws->kpack, d_k + ATTN_VL_MAX);
            kt = (const T *)ws->kpack;
        }
        k_rs = d_k + ATTN_VL_MAX;
        k_cs = 1;
#else
        kt = k;
#endif
        const int edges = ws->causal || ws->window;
        for (t = 0; t < n_jt * n_it; t++) {
            ptrdiff_t mr, iv0, iv1, r0, r1;
            jt = (strips_outer ? t % n_jt : t / n_it) * MR_QK;
            it = (strips_outer ? t / n_jt : t % n_it) * NR_QK;
            mr = nk - jt < MR_QK ? nk - jt : MR_QK;
            iv0 = it;
            iv1 = nvq - it < NR_QK ? nvq : it + NR_QK;
            if (edges) {  /* only the vectors of rows that see one of these keys */
                attn_rows_seeing(a, ws, kb, jt, jt + mr, &r0, &r1);
                if (r0 / V_L > iv0) iv0 = r0 / V_L;
                if ((r1 + V_L - 1) / V_L < iv1) iv1 = (r1 + V_L - 1) / V_L;
                if (iv1 <= iv0) continue;
            }
            FN(qk_tile_any)(kt + jt * k_rs, k_rs, k_cs,
                            qt + iv0 * V_L, ld, s + jt * ld + iv0 * V_L, ld, d_k,
                            (int)mr, (int)(iv1 - iv0));
        }
    }
    if (a->softcap > 0 || ws->alibi_slope != 0) FN(score_mods)(a, ws, kb, nk, s, 1, ld);
    if (a->mask_kind != ATTN_MASK_NONE) {
        /* The mask tile is row-major ([query][key]) and s key-major. Whole
         * 16 x 16 tiles (x86, contiguous keys) are transposed in registers
         * and applied to s at once; the rest is first transposed into mt
         * (bool: 0 = takes part, -inf = masked; float: the bias; padding
         * lanes 0), then applied a vector at a time. A branch per masked
         * entry into s (mispredicted half the time on a random mask) made
         * random bool masks 2x slower than torch. A mask whose rows are all
         * the same (m_rs = 0: a key padding mask broadcast over L) needs no
         * transpose: one value per key. */
        static const T bool_bias[2] = {-ATTN_INF, 0};
        const int is_bool = a->mask_kind == ATTN_MASK_BOOL, rows_differ = ws->m_rs != 0;
        const ptrdiff_t m_rs = ws->m_rs, m_cs = a->mask.s_col;
        ptrdiff_t iv, i_full = 0, j_full = 0;  /* rows x keys already masked in s */
        if (rows_differ) {
            /* full 16 x 16 tiles of a mask with contiguous keys: applied to s
             * by SIMD transposes in registers (attn_simd.h); the rest through
             * the bias tile mt */
#if ATTN_BOOL_MASK_16X16
            if (m_cs == 1) {
                i_full = nq / 16 * 16;
                j_full = nk / 16 * 16;
                for (i = 0; i < i_full; i += 16)
                    for (j = 0; j < j_full; j += 16) {
                        const ptrdiff_t at = (i0 + i) * m_rs + kb + j;
                        const uint8_t *mb = (const uint8_t *)ws->mask + at;
                        const T *mf = (const T *)ws->mask + at;
#if ATTN_IS_F64 && V_L == 8      /* the AVX-512 paths */
                        if (is_bool) attn_bool_mask_16x16_f64_avx512(mb, m_rs, s + j * ld + i, ld);
                        else attn_float_mask_16x16_f64_avx512(mf, m_rs, s + j * ld + i, ld);
#elif ATTN_IS_F64
                        if (is_bool) attn_bool_mask_16x16_f64(mb, m_rs, s + j * ld + i, ld);
                        else attn_float_mask_16x16_f64(mf, m_rs, s + j * ld + i, ld);
#elif V_L == 16      /* the AVX-512 paths */
                        if (is_bool) attn_bool_mask_16x16_f32_avx512(mb, m_rs, s + j * ld + i, ld);
                        else attn_float_mask_16x16_f32_avx512(mf, m_rs, s + j * ld + i, ld);
#elif ATTN_BOOL_MASK_AVX2      /* the avx2-fma path */
                        if (is_bool) attn_bool_mask_16x16_f32_avx2(mb, m_rs, s + j * ld + i, ld);
                        else attn_float_mask_16x16_f32(mf, m_rs, s + j * ld + i, ld);
#else
                        if (is_bool) attn_bool_mask_16x16_f32(mb, m_rs, s + j * ld + i, ld);
                        else attn_float_mask_16x16_f32(mf, m_rs, s + j * ld + i, ld);
#endif
                    }
            }
#endif
            for (i = 0; i < nq; i++) {
                T *mc = mt + i;
                if (is_bool) {
                    const uint8_t *mr = (const uint8_t *)ws->mask + (i0 + i) * m_rs + kb * m_cs;
                    for (j = i < i_full ? j_full : 0; j < nk; j++) mc[j * ld] = bool_bias[mr[j * m_cs] != 0];
                } else {
                    const T *mr = (const T *)ws->mask + (i0 + i) * m_rs + kb * m_cs;
                    for (j = i < i_full ? j_full : 0; j < nk; j++) mc[j * ld] = mr[j * m_cs];
                }
            }
            for (j = 0; j < nk; j++)
                for (i = nq; i < bqp; i++) mt[j * ld + i] = 0;
        }
        for (j = 0; j < nk; j++) {
            const ptrdiff_t at = (i0 * m_rs) + (kb + j) * m_cs;  /* key j in the shared row */
            const V_T mrow = V_SET1(rows_differ ? (T)0
                                    : is_bool ? bool_bias[((const uint8_t *)ws->mask)[at] != 0]
                                    : ((const T *)ws->mask)[at]);
            for (iv = j < j_full ? i_full / V_L : 0; iv < nvq; iv++) {
                T *sv = s + j * ld + iv * V_L;
                V_T mv = mrow;
                if (rows_differ) mv = V_LOAD(mt + j * ld + iv * V_L);
                if (is_bool)  /* masked (-inf < 0): -inf, whatever the score (NaN too) */
                    V_STORE(sv, V_SEL_LT(mv, V_ZERO(), V_SET1(-ATTN_INF), V_LOAD(sv)));
                else
                    V_STORE(sv, V_ADD(V_LOAD(sv), mv));
            }
        }
    }
    if (ws->causal && kb + nk - 1 > i0 + a->causal_offset) {
        /* a tile crossing the diagonal: key kb + j is visible to row i0 + i
           iff kb + j <= i0 + i + causal_offset. Rows i < first get -inf by
           vector selects, one store per vector of rows (row indices are
           exact in T, < 2^24). */
        const V_T vlane = V_LOAD(FN(lanes));
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
    if (ws->window) FN(window_tile)(a, ws, kb, nk, s, 1, ld);
}

/* ------------------------------------------------- online softmax update
 * V_L rows at a time. While m_new = -inf (nothing visible yet) exponents are
 * taken against 0 instead: exp(-inf - 0) = 0, never exp(-inf + inf) = NaN. */
static ATTN_TGT void FN(online_softmax_rows)(attn_ws *ws, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, nkv = (nk + V_L - 1) / V_L;
    T *m = (T *)ws->m, *l = (T *)ws->l, *alpha = (T *)ws->alpha;
    ptrdiff_t i, jv;
    for (i = 0; i < nq; i++) {
        T *sr = (T *)ws->s + i * ATTN_ROWS_LD, mnew, msafe, al[V_L];
        V_T mx = V_SET1(-ATTN_INF), ls = V_ZERO(), vms;
        for (jv = 0; jv < nkv; jv++) mx = V_MAX(mx, V_LOAD(sr + jv * V_L));
        mnew = V_HMAX(mx);
        if (m[i] > mnew) mnew = m[i];   /* (a NaN score reaches l_i through exp either way) */
        msafe = mnew == -ATTN_INF ? (T)0 : mnew;
        V_STORE(al, FN(vexp)(V_SET1(m[i] - msafe)));
        vms = V_SET1(msafe);
        for (jv = 0; jv < nkv; jv++) {
            V_T p = FN(vexp)(V_SUB(V_LOAD(sr + jv * V_L), vms));
            V_STORE(sr + jv * V_L, p);
            ls = V_ADD(ls, p);
        }
        l[i] = l[i] * al[0] + V_HSUM(ls);
        m[i] = mnew;
        alpha[i] = al[0];
    }
}

static ATTN_TGT void FN(online_softmax)(attn_ws *ws, int64_t nk)
{
    const ptrdiff_t ld = ws->ld, nvq = ws->bqp / V_L;
    T *s = (T *)ws->s, *m = (T *)ws->m, *l = (T *)ws->l, *alpha = (T *)ws->alpha;
    ptrdiff_t iv, j;
    if (ws->nq <= ATTN_DOT_MAX_Q) {
        FN(online_softmax_rows)(ws, nk);
        return;
    }
#if ATTN_AMX
    if (ws->amx) {
        FN(online_softmax_amx)(ws, nk);
        return;
    }
#endif
#if ATTN_DPBF16
    if (ws->p_pairs) {
        FN(online_softmax_pairs)(ws, nk);
        return;
    }
#endif
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
            V_T p0 = FN(vexp_shifted)(V_LOAD(sc + j * ld), msafe);
            V_T p1 = FN(vexp_shifted)(V_LOAD(sc + (j + 1) * ld), msafe);
            V_STORE(sc + j * ld, p0);
            V_STORE(sc + (j + 1) * ld, p1);
            ls0 = V_ADD(ls0, p0);
            ls1 = V_ADD(ls1, p1);
        }
        if (j < nk) {
            V_T p0 = FN(vexp_shifted)(V_LOAD(sc + j * ld), msafe);
            V_STORE(sc + j * ld, p0);
            ls0 = V_ADD(ls0, p0);
        }
        V_STORE(l + iv * V_L, V_FMA(V_LOAD(l + iv * V_L), al, V_ADD(ls0, ls1)));
        V_STORE(m + iv * V_L, mnew);
        V_STORE(alpha + iv * V_L, al);
    }
}

/* Rows layout: acc = diag(alpha) acc + P V for the nk keys of p (rows
 * ATTN_ROWS_LD apart) and the V rows at v, every column of d_v, column strip
 * by column strip. pf: V's rows of pf_n other keys (contiguous, v's stride;
 * NULL with pf_n = 0: none), prefetched into L2 as the strips go, each strip
 * its own columns of them a key at a time: a few prefetches between the
 * products, where a burst of them before a strip stalled on the miss buffers. */
static ATTN_TGT void FN(pv_rows_all)(const attn_problem *a, const T *p, const KV_T *v, T *acc, const T *alpha,
                                     ptrdiff_t nk, ptrdiff_t nq, const KV_T *pf, ptrdiff_t pf_n)
{
    const ptrdiff_t d_v = a->d_v, dvv = d_v / V_L * V_L, v_rs = a->v.s_row, wmax = ATTN_PVR_NV(nq);
    const ptrdiff_t row_bytes = KV_ROW_BYTES(d_v), pf_rs = v_rs * (ptrdiff_t)sizeof(KV_T);
    ptrdiff_t dt, i, j;
    for (dt = 0; dt < dvv; dt += wmax * V_L) {
        int nv = (int)((dvv - dt) / V_L < wmax ? (dvv - dt) / V_L : wmax);
        /* the strip's bytes of a row (the last strip's to the row's end) */
        const ptrdiff_t b0 = row_bytes * dt / d_v;
        const ptrdiff_t b1 = dt + nv * V_L < dvv ? row_bytes * (dt + nv * V_L) / d_v : row_bytes;
        FN(pv_rows_any)(p, v, v_rs, dt, d_v, acc + dt, d_v, alpha, nk, (int)nq, nv,
                        pf == NULL ? NULL : (const char *)pf + b0, pf_rs, pf_n, b1 - b0);
    }
    for (dt = dvv; dt < d_v; dt++) {       /* columns past the last vector */
        for (i = 0; i < nq; i++) {
            T sum = acc[i * d_v + dt] * alpha[i];
            for (j = 0; j < nk; j++) sum += p[i * ATTN_ROWS_LD + j] * (T)KV_GET_AT(v + j * v_rs, dt, d_v);
            acc[i * d_v + dt] = sum;
        }
    }
}

/* ---------------------------------------------------------------- P.V tile
 * acc = diag(alpha) acc + P^T V for keys [kb, kb + nk). */

/* V rows a multiple of 1 KiB apart (FlashAttention's [.., S, H_kv, E] with
 * H_kv E = 256 k) read in place by the register tiles, not copied: on the
 * AVX-512 float32 instances, where a tile's strip of a row is 4 cache lines and
 * the copy, made again for every block and query head, cost more than the set
 * conflicts (causal prefill 2 x 1024, H32/8 E128, Zen 4, paired medians of
 * the time in place over the copy's: 1 thread 0.95-0.97, 2 threads 0.92,
 * contiguous and paged). With 8-wide vectors (a strip of one line a row) in
 * place took 1.14-1.25x: copied. */
#define ATTN_V_IN_PLACE_1K (V_L == 16 && !ATTN_IS_F64)
/* Rows of the next P V register tile with r rows left: MR_PV, save that 7 or 8 rows
 * (MR_PV = 6) go as 4 + 3 or 4 + 4. A tile of one or two rows reloads V's vectors
 * for every one or two FMAs: blocks of 32 rows (5 x 6 + 2) spent 12 % of their
 * P V time in their last tile, for 6 % of the products (prefill chunks of 256
 * rows, H32/8 E128, Zen 4). Each output element's sum is the same either way. */
static ATTN_INLINE int FN(pv_tile_rows)(ptrdiff_t r)
{
    if (MR_PV >= 6 && r > MR_PV && r < MR_PV + 3) return 4;
    return r < MR_PV ? (int)r : MR_PV;
}

static ATTN_TGT void FN(pv)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk)
{
    const ptrdiff_t nq = ws->nq, ld = ws->ld, d_v = a->d_v, dvv = d_v / V_L * V_L;
    const ptrdiff_t v_rs = a->v.s_row, v_cs = a->v.s_col;
    const KV_T *v = (const KV_T *)ws->v + kb * v_rs;
    const T *s = (const T *)ws->s, *alpha = (const T *)ws->alpha, *vb;
    T *acc = (T *)ws->acc;
    ptrdiff_t ldv, dt, it, i, j;
#if ATTN_DPBF16
    if (ATTN_BF16_BLOCK(a, ws)) {
        FN(pv_bf16)(a, ws, kb, nk);
        return;
    }
#endif
#if ATTN_DPBF16
    if (nq <= ATTN_DOT_MAX_Q && ATTN_BF16_PV_ROWS(a, ws)) {   /* rows layout by pairs of keys */
        const KV_T *rows[ATTN_BK];
        FN(v_row_ptrs)(a, ws, kb, nk, rows);
        FN(pv_rows_pairs)(s, rows, nk, d_v, acc, alpha, (int)nq);
        return;
    }
#endif
    if (nq <= ATTN_DOT_MAX_Q && v_cs == 1) {
        /* rows layout, V read in place (float16 widened in registers) */
        if (ws->pages != NULL) {
            /* a paged V, page by page: alpha rescales O_i once, before the
               first page's keys (the later pages' factor 1 is exact, so the
               sums are those of one pass). Each page's P V prefetches V's rows
               of as many keys one tile (ATTN_BK) further on, in one page and
               below the block's end (the scores then skip their V: ws->v_pf_end),
               so that P V, too, keeps the memory busy. In-process alternating
               medians (16 decode rows over 1k-4k keys, H32/8 E128, vLLM's layout,
               2 threads, Zen 4, float32) against the same share prefetched in a
               burst before each column strip: pages of 32/128/256 0.90/0.89/0.91,
               one 16k sequence 0.87; against none (the scores prefetching every
               V row) 0.88, SmolLM2's heads with 8 layers' caches cycled 0.95. A V
               of the compute type only: float16's (widened in the same strips)
               took 1.03x so. */
            static const T ones[ATTN_DOT_MAX_Q] = {1, 1, 1, 1};
            ptrdiff_t n;
            for (j = 0; j < nk; j += n) {
                const int64_t run = attn_paged_run(a, kb + j), t0 = kb + j + ATTN_BK, t0_run = attn_paged_run(a, t0);
                ptrdiff_t pf_n;
                n = nk - j < run ? nk - j : (ptrdiff_t)run;
                pf_n = KV_PACKED ? 0 : attn_v_prefetch_keys(ws, t0, n < t0_run ? n : (ptrdiff_t)t0_run);
                FN(pv_rows_all)(a, s + j, (const KV_T *)attn_paged_row(a, ws->pages, ws->v, a->v_page, v_rs, kb + j),
                                acc, j == 0 ? alpha : ones, n, nq,
                                pf_n ? (const KV_T *)attn_paged_row(a, ws->pages, ws->v, a->v_page, v_rs, t0) : NULL,
                                pf_n);
            }
            return;
        }
        {   /* (V's rows of the next tile's keys prefetched as a page's, above) */
            const ptrdiff_t pf_n = KV_PACKED ? 0 : attn_v_prefetch_keys(ws, kb + ATTN_BK, nk);
            FN(pv_rows_all)(a, s, v, acc, alpha, nk, nq, pf_n ? v + ATTN_BK * v_rs : NULL, pf_n);
        }
        return;
    }
    if (nq <= ATTN_DOT_MAX_Q) {
        /* rows layout with strided V columns (rare): P key-major into mt for
           the tiles below */
        T *pt = (T *)ws->mt;
        for (j = 0; j < nk; j++)
            for (i = 0; i < nq; i++) pt[j * ld + i] = s[i * ATTN_ROWS_LD + j];
        s = pt;
    }
    if (!KV_PACKED && v_cs == 1 && (ATTN_V_IN_PLACE_1K || (v_rs * (ptrdiff_t)sizeof(T)) % 1024 != 0)) {
        vb = (const T *)(const void *)v;
        ldv = v_rs;
    } else {
        /* 16-bit or q8_0 (widened here), strided columns, or rows a multiple
           of 1 KiB apart (float64 d_v = 128: a tile's rows would share 16 of
           the 64 L1 sets), save on AVX-512 float32 (ATTN_V_IN_PLACE_1K): a
           copy with a padded row length */
        ldv = d_v + ATTN_VL_MAX;
        if (KV_PACKED && ws->vwide != NULL) {   /* widened once, into the thread's copy */
            vb = (const T *)ws->vwide + kb * ldv;
        } else {
            FN(pack_tile)(v, v_rs, v_cs, nk, d_v, (T *)ws->vpack, ldv);
            vb = (const T *)ws->vpack;
        }
    }
    /* column strips outermost: a strip of the value tile (nk x NR_PV
       vectors; at ATTN_BK_TILES keys, 64 KiB of float32 on AVX-512: L2)
       stays in cache while all row tiles pass over it */
    const int edges = ws->causal || ws->window;
    for (dt = 0; dt < dvv; dt += NR_PV * V_L) {
        int nv = (int)((dvv - dt) / V_L < NR_PV ? (dvv - dt) / V_L : NR_PV), nr;
        for (it = 0; it < nq; it += nr) {
            ptrdiff_t k0 = 0, k1 = nk;   /* only the keys these rows see */
            nr = FN(pv_tile_rows)(nq - it);
            if (edges) attn_keys_seen(a, ws, kb, nk, it, it + nr, &k0, &k1);
            FN(pv_tile_any)(s + k0 * ld + it, ld, vb + k0 * ldv + dt, ldv, acc + it * d_v + dt, d_v,
                            alpha + it, k1 - k0, nr, nv);
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

/* ------------------------------------------------- several heads' tile
 * One key tile, keys [kb, kb + nk), of an item's n blocks (units) whose K/V
 * heads lie side by side in every key row ([.., S, H_kv, E], paged or not;
 * attn._kernels' _flash_heads): unit u's scratch at ws0 + u * ws_bytes, its
 * K and V rows unit 0's plus u rows of values. Each unit's S, softmax and
 * P V are FN(scores), FN(online_softmax) and FN(pv)'s, sum for sum, so its
 * bits are; only the order of the reads changes: the products go
 * ATTN_HEADS_KEYS keys at a time through every unit, so K's rows, then V's,
 * are read whole and in address order (a head at a time they are a strided
 * walk, one head's values per key row). Each run of keys prefetches its
 * unit's rows ATTN_HEADS_AHEAD keys further on, into L2 (ATTN_PREFETCH_L2):
 * K's, then past the tile's last key V's first rows; V's, then the next
 * tile's K rows (keys below end, the item's last). Rows layout only (every
 * unit's block has <= ATTN_DOT_MAX_Q rows), V's columns contiguous. */
static ATTN_INLINE void FN(prefetch_unit)(const attn_problem *a, const attn_ws *ws, int v, int64_t j0, int64_t j1)
{
    const ptrdiff_t bytes = v ? KV_ROW_BYTES(a->d_v) : KV_ROW_BYTES(a->d_k);
    const ptrdiff_t step = (v ? a->v.s_row : a->k.s_row) * (ptrdiff_t)sizeof(KV_T);
    while (j0 < j1) {   /* a page's rows at a time (one look-up in the page list each) */
        const int64_t run = ws->pages != NULL ? attn_paged_run(a, j0) : j1 - j0, n = run < j1 - j0 ? run : j1 - j0;
        const char *p = FN(kv_row)(a, ws, v, j0);
        ptrdiff_t b;
        int64_t t;
        for (t = 0; t < n; t++, p += step)
            for (b = 0; b < bytes; b += 64) ATTN_PREFETCH_L2(p + b);
        j0 += n;
    }
}

/* Keys [kb + j0, kb + j0 + n) of the tile's nk: the run's own rows (v) ATTN_HEADS_AHEAD
   keys on, past the tile's end the rows the tile reads next (K: V's first; V: the next
   tile's K, keys below end). */
static ATTN_INLINE void FN(prefetch_ahead)(const attn_problem *a, const attn_ws *ws, int v, int64_t kb,
                                           int64_t nk, int64_t end, int64_t j0, int64_t n)
{
    int64_t f0 = j0 + ATTN_HEADS_AHEAD, f1 = f0 + n, in = f1 < nk ? f1 : nk;
    if (f0 < in) FN(prefetch_unit)(a, ws, v, kb + f0, kb + in);
    if (f1 > nk) {   /* the keys past the tile's end, counted from the first one they stand for */
        f0 = (f0 > nk ? f0 : nk) - nk;
        f1 = f1 - nk;
        if (v) {         /* the next tile's, from kb + nk, below end */
            f0 += nk;
            f1 = nk + f1 < end - kb ? nk + f1 : end - kb;
        } else if (f1 > nk) {
            f1 = nk;     /* this tile's V */
        }
        if (f0 < f1) FN(prefetch_unit)(a, ws, !v, kb + f0, kb + f1);
    }
}

/* The run of keys from kb + j0 the products take for every unit in turn: ATTN_HEADS_KEYS, fewer
   at the tile's end (nk) or, paged, at the page's end (a run's rows are contiguous). */
static ATTN_INLINE ptrdiff_t FN(heads_run)(const attn_problem *a, const attn_ws *ws0, int64_t kb, ptrdiff_t j0,
                                           int64_t nk)
{
    ptrdiff_t run = nk - j0 < ATTN_HEADS_KEYS ? (ptrdiff_t)(nk - j0) : ATTN_HEADS_KEYS;
    if (ws0->pages != NULL && run > attn_paged_run(a, kb + j0)) run = (ptrdiff_t)attn_paged_run(a, kb + j0);
    return run;
}

static ATTN_TGT void FN(heads_tile)(const attn_problem *a, attn_ws *ws0, int64_t ws_bytes, int64_t n,
                                    int64_t kb, int64_t nk, int64_t end)
{
#define ATTN_UNIT(u) ((attn_ws *)(void *)((char *)ws0 + (u) * ws_bytes))
    static const T ones[ATTN_DOT_MAX_Q] = {1, 1, 1, 1};
    ptrdiff_t j0, run;
    int64_t u;
    /* S = Q_i K_j^T, every unit's ATTN_HEADS_KEYS keys in turn */
    for (j0 = 0; j0 < nk; j0 += run) {
        run = FN(heads_run)(a, ws0, kb, j0, nk);
        for (u = 0; u < n; u++) {
            attn_ws *ws = ATTN_UNIT(u);
            FN(prefetch_ahead)(a, ws, 0, kb, nk, end, j0, run);
            FN(scores_dot)(a, ws, (const KV_T *)FN(kv_row)(a, ws, 0, kb + j0),
                           (const KV_T *)FN(kv_row)(a, ws, 1, kb + j0), (T *)ws->s + j0, run, 0, 0);
        }
    }
    for (u = 0; u < n; u++) {
        FN(scores_rows_edges)(a, ATTN_UNIT(u), kb, nk);   /* (+ mask); invisible -> -inf */
        FN(online_softmax_rows)(ATTN_UNIT(u), nk);        /* P, m_i, l_i, alpha */
    }
    /* O_i = diag(alpha) O_i + P V_j, every unit's ATTN_HEADS_KEYS keys in turn:
       alpha rescales O_i before the first run (the later runs' 1 is exact) */
#if ATTN_DPBF16
    if (ATTN_BF16_PV_ROWS(a, ws0)) {   /* by pairs of keys: runs of ATTN_HEADS_KEYS, pages or not */
        for (j0 = 0; j0 < nk; j0 += run) {
            const KV_T *rows[ATTN_HEADS_KEYS];
            run = nk - j0 < ATTN_HEADS_KEYS ? (ptrdiff_t)(nk - j0) : ATTN_HEADS_KEYS;
            for (u = 0; u < n; u++) {
                attn_ws *ws = ATTN_UNIT(u);
                FN(prefetch_ahead)(a, ws, 1, kb, nk, end, j0, run);
                FN(v_row_ptrs)(a, ws, kb + j0, run, rows);
                FN(pv_rows_pairs)((const float *)ws->s + j0, rows, run, a->d_v, (float *)ws->acc,
                                  j0 == 0 ? (const float *)ws->alpha : ones, (int)ws->nq);
            }
        }
        return;
    }
#endif
    for (j0 = 0; j0 < nk; j0 += run) {
        run = FN(heads_run)(a, ws0, kb, j0, nk);
        for (u = 0; u < n; u++) {
            attn_ws *ws = ATTN_UNIT(u);
            FN(prefetch_ahead)(a, ws, 1, kb, nk, end, j0, run);
            FN(pv_rows_all)(a, (const T *)ws->s + j0, (const KV_T *)FN(kv_row)(a, ws, 1, kb + j0), (T *)ws->acc,
                            j0 == 0 ? (const T *)ws->alpha : ones, run, ws->nq, NULL, 0);
        }
    }
#undef ATTN_UNIT
}

#if !ATTN_IS_F64
/* y = x rounded to the 16-bit out's type (attn_problem.out16): attn_narrow16's bits,
   float16 by F16C's conversion (attn_f16c_run, the array cast's) on the x86 paths (the
   instances with V_STREAM, whose targets include F16C). */
static ATTN_TGT ATTN_INLINE void FN(narrow16)(const T *x, uint16_t *y, ptrdiff_t n, int out16)
{
#ifdef V_STREAM
    if (out16 == ATTN_OUT_F16) {
        attn_f16c_run(x, y, n, 1);
        return;
    }
#endif
    attn_narrow16(x, y, n, out16);
}
#endif

/* ------------------------------------------------------------- block end */
static ATTN_TGT void FN(finish)(const attn_problem *a, attn_ws *ws, void *outp, int64_t o_rs,
                                void *lsep)
{
    const ptrdiff_t nq = ws->nq, d_v = a->d_v, dvv = d_v / V_L * V_L;
    const T *acc = (const T *)ws->acc;
    T *m = (T *)ws->m, *l = (T *)ws->l, *alpha = (T *)ws->alpha;
    T *out = (T *)outp, *lse = (T *)lsep;
    ptrdiff_t i, e;
    if (ws->sinks != NULL)
        /* each row's sink joins its sum; m, l become the final ones (the weights
           pass reads them) and alpha (free after the last P.V) the output's factor */
        for (i = 0; i < nq; i++) {
            double mi = m[i], li = l[i];
            alpha[i] = (T)attn_sink_join(&mi, &li, ws->sinks[i / ws->sink_rows]);
            m[i] = (T)mi;
            l[i] = (T)li;
        }
    if (lse != NULL)
        for (i = 0; i < nq; i++)
            lse[i] = l[i] != 0 ? m[i] + (T)log((double)l[i])
                   : ws->sinks != NULL ? (T)ws->sinks[i / ws->sink_rows] : -ATTN_INF;
#ifdef V_STREAM
    /* whole cache lines of out by non-temporal stores (ATTN_STREAM_OUT_BYTES):
       rows that start on a line and fill whole lines (a bfloat16 out's rows
       rounded into s first, free after the last P.V) */
    const ptrdiff_t o_bytes = d_v * (a->out16 ? 2 : (ptrdiff_t)sizeof(T));
    const int stream = a->out_stream && o_bytes % 64 == 0;
    int streamed = 0;
#endif
    for (i = 0; i < nq; i++) {
        /* a 16-bit out: the row in float32 in its own acc row, then rounded once */
        T *o = a->out16 ? (T *)ws->acc + i * d_v : out + i * o_rs;
        const T *ar = acc + i * d_v;
        if (l[i] == 0) {
            for (e = 0; e < d_v; e++) o[e] = 0;
        } else {
            const T inv = (ws->sinks != NULL ? alpha[i] : (T)1) / l[i] * (T)KV_UNIT;   /* (V in 1 / KV_UNIT) */
            V_T vinv = V_SET1(inv);
#ifdef V_STREAM
            if (stream && !a->out16 && ((uintptr_t)o & 63) == 0) {
                for (e = 0; e < d_v; e += V_L) V_STREAM(o + e, V_MUL(V_LOAD(ar + e), vinv));
                streamed = 1;
                continue;
            }
#endif
            for (e = 0; e < dvv; e += V_L) V_STORE(o + e, V_MUL(V_LOAD(ar + e), vinv));
            for (; e < d_v; e++) o[e] = ar[e] * inv;
        }
#if !ATTN_IS_F64
        if (a->out16) {
            uint16_t *orow = (uint16_t *)outp + i * o_rs;
#ifdef V_STREAM
            if (stream && ((uintptr_t)orow & 63) == 0) {
                uint16_t *r16 = (uint16_t *)ws->s;
                FN(narrow16)(o, r16, d_v, a->out16);
                for (e = 0; e < o_bytes / (ptrdiff_t)sizeof(T); e += V_L)
                    V_STREAM((T *)(void *)orow + e, V_LOAD((const T *)(const void *)r16 + e));
                streamed = 1;
                continue;
            }
#endif
            FN(narrow16)(o, orow, d_v, a->out16);
        }
#endif
    }
#ifdef V_STREAM
    if (streamed) _mm_sfence();   /* the stores above before any later ones (the caller's reads) */
#endif
}

static ATTN_TGT void FN(save_part)(const attn_problem *a, attn_ws *ws, void *partp)
{
    const ptrdiff_t nq = ws->nq;
    const T *m = (const T *)ws->m, *l = (const T *)ws->l;
    T *part = (T *)partp;
    ptrdiff_t i;
    for (i = 0; i < nq; i++) { part[i] = m[i]; part[nq + i] = l[i]; }
    memcpy(part + 2 * nq, ws->acc, sizeof(T) * (size_t)(nq * a->d_v));
}

/* weights of the nk keys just scored, with the final m and l: exp(S - m) / l
 * (0 for invisible keys and for rows that saw nothing: inv = 0, msafe = 0) */
static ATTN_TGT void FN(weights)(attn_ws *ws, int64_t nk, void *wp, int64_t w_rs)
{
    const ptrdiff_t nq = ws->nq, ld = ws->ld, nvq = ws->bqp / V_L;
    const T *m = (const T *)ws->m, *l = (const T *)ws->l;
    T *s = (T *)ws->s, *w = (T *)wp;
    ptrdiff_t iv, i, j;
    if (nq <= ATTN_DOT_MAX_Q) {   /* rows layout */
        for (i = 0; i < nq; i++) {
            const T mi = m[i] == -ATTN_INF ? (T)0 : m[i], inv = l[i] == 0 ? (T)0 : (T)1 / l[i];
            T *sr = s + i * ATTN_ROWS_LD;
            for (j = 0; j < nk; j += V_L)
                V_STORE(sr + j, V_MUL(FN(vexp)(V_SUB(V_LOAD(sr + j), V_SET1(mi))), V_SET1(inv)));
            for (j = 0; j < nk; j++) w[i * w_rs + j] = sr[j];
        }
        return;
    }
    for (iv = 0; iv < nvq; iv++) {
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
        for (j = 0; j < nk; j++) w[i * w_rs + j] = s[j * ld + i];
}

/* ------------------------------------------------------- split-key merge
 * parts: n_chunks partial states of rows [0, nq) (attn_part_elems each),
 * merged in chunk order 0, 1, ...:
 *   M = max_c m_c, L = sum_c exp(m_c - M) l_c, O = sum_c exp(m_c - M) O_c,
 *   out = O / L (0 when L = 0, i.e. nothing visible; NaN propagates),
 *   lse = M + log L; with sinks (row i's is sinks[i / sink_rows]), M and L
 *   first take the row's sink (attn_sink_join), as FN(finish) does. */
static ATTN_TGT void FN(merge)(const void *partsp, int64_t n_chunks, int64_t nq, int64_t d_v,
                               void *outp, int64_t o_rs, void *lsep, const double *sinks,
                               int64_t sink_rows)
{
    const ptrdiff_t stride = attn_part_elems(nq, d_v);
    const T *parts = (const T *)partsp;
    T *out = (T *)outp, *lse = (T *)lsep;
    ptrdiff_t i, c, e;
    for (i = 0; i < nq; i++) {
        T M = -ATTN_INF, L = 0, *o = out + i * o_rs;
        for (c = 0; c < n_chunks; c++) {
            T mc = parts[c * stride + i];
            if (mc > M || mc != mc) M = mc;
        }
        for (e = 0; e < d_v; e++) o[e] = 0;
        for (c = 0; c < n_chunks; c++) {
            const T *pc = parts + c * stride;
            T w;
            if (pc[i] == -ATTN_INF) {
                /* the chunk saw nothing of row i (l = 0), or only NaN scores
                   (l = NaN, which max() passed over): NaN must still win */
                L += pc[nq + i];
                continue;
            }
            w = (T)exp((double)(pc[i] - M));
            L += w * pc[nq + i];
            for (e = 0; e < d_v; e++) o[e] += w * pc[2 * nq + i * d_v + e];
        }
        T f = 1;
        if (sinks != NULL) {  /* row i's sink joins the merged sum (attn_sink_join) */
            double mm = M, ll = L;
            f = (T)attn_sink_join(&mm, &ll, sinks[i / sink_rows]);
            M = (T)mm;
            L = (T)ll;
        }
        if (lse != NULL)
            lse[i] = L != 0 ? M + (T)log((double)L) : sinks != NULL ? (T)sinks[i / sink_rows] : -ATTN_INF;
        if (L == 0) { for (e = 0; e < d_v; e++) o[e] = 0; }
        else if (L != L) { for (e = 0; e < d_v; e++) o[e] = (T)ATTN_NAN; }
        else { T inv = f / L * (T)KV_UNIT; for (e = 0; e < d_v; e++) o[e] *= inv; }   /* (V in 1 / KV_UNIT) */
    }
}

#if !KV_PACKED
/* ------------------------------------------------------------ softmax row
 * out[j] = softmax(x[j] (+ mask[j]))_j over one row of n; a row with nothing
 * visible is all 0; NaN anywhere in the row makes the row NaN. */
static ATTN_TGT void FN(softmax_row)(const void *xp, int64_t xs, const void *mask, int kind,
                                     int64_t ms, void *outp, int64_t n)
{
    const T *x = (const T *)xp;
    T *out = (T *)outp;
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

#endif

#if KV_PACKED
#define ATTN_SOFTMAX_ROW NULL   /* the masked softmax has no 16-bit or q8_0 storage */
#else
#define ATTN_SOFTMAX_ROW FN(softmax_row)
#endif
static ATTN_TGT void FN(widen_rows)(const void *x, int64_t rs, int64_t nk, int64_t n, void *dst, int64_t ldp)
{
    FN(pack_tile)((const KV_T *)x, rs, 1, nk, n, (T *)dst, ldp);
}

static const attn_kernels FN(table) = {
    FN(begin), FN(load_q), FN(scores), FN(online_softmax), FN(pv), FN(finish),
    FN(save_part), FN(weights), FN(merge), ATTN_SOFTMAX_ROW, FN(heads_tile), FN(widen_rows),
};
#undef ATTN_SOFTMAX_ROW

#undef T
#undef KV_T
#undef KV16
#undef KVF8
#undef KVQ8
#undef KV_PACKED
#undef ATTN_Q_RAW16
#undef KV_VLOAD_AT
#undef KV_VLOAD4
#undef KV_GET_AT
#undef KV_ROW_BYTES
#undef KV_VLOAD
#undef KV_GET
#undef KV_UNIT
#undef ATTN_IS_F64
#undef ATTN_V_IN_PLACE_1K
#undef ATTN_KIND
#undef FN
#undef ATTN_DPBF16
#undef ATTN_E4M3_DOT
#undef ATTN_BF16_BLOCK
#undef ATTN_PAIRS_ON_PATH
#undef ATTN_BF16_DOT_SHAPE
#undef ATTN_BF16_PV_ROWS
#undef ATTN_AMX
#undef ATTN_AMX_BLOCK
#undef ATTN_Q8_VNNI
#undef ATTN_Q8_PAIRS_MAX
#undef ATTN_PVR_W
#undef ATTN_PVR_NV
