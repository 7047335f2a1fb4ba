/* Backward template: included by attn_backward.h once per (instruction set, dtype).
 *
 * Expects ATTN_KIND (ATTN_F32 / ATTN_F64), FN(name), the V_* operations of attn_simd_ops.h, the
 * register tile MR x NR and ATTN_TGT.
 *
 * FlashAttention-2's backward for one matrix (notation of attn/_backward.py):
 * for a query block i (rows [i0, i0 + nq)) and key block j (keys [j0, j0 + nk))
 *
 *   S_ij  = (scale Q_i) K_j^T           product 1   [nq x BK]
 *   P_ij  = exp(S_ij + B_ij - lse_i)                (0 where invisible)
 *   dP_ij = dO_i V_j^T                  product 2   [nq x BK]
 *   dS_ij = P_ij o (dP_ij - D_i),  D_i = rowsum(dO_i o O_i)
 *   dV_j += P_ij^T dO_i                 product 3   [BK x Ev]
 *   dK_j += dS_ij^T (scale Q_i)         product 4   [BK x E]
 *   dQ_i += dS_ij K_j                   product 5   [nq x E]   (times scale at the end)
 *
 * S + B is the forward's score bit for bit, so that P's rows sum to 1
 * against the forward's lse to a few u however large the scores: the
 * forward multiplies q by scale before its product (FN(load_q),
 * attn_simd_impl.h) and sums each score over e in order, one multiply-add
 * per term (FN(qk_tile)); so does product 1, from Q packed times scale;
 * then the same variants (FN(bw_mods)) and the mask, added with its own
 * rounding. (scale (Q K^T) rounds differently: at |s| ~ 40 in float32 the
 * two scores differed by ~1e-5, and so did P's row sums from 1.) The
 * forward's blocks of at most ATTN_DOT_MAX_Q rows (decode shapes, or a
 * matrix's last block that short) sum their scores in vector lanes instead
 * (FN(qk_dot)): the backward's agree with those to the dot product's
 * rounding only.
 *
 * P is recomputed from the saved lse, one [BQ x BK] tile at a time: no L x S
 * array, O(L E) extra memory (the packed operands below). Two schedules,
 * with the same operations in the same order, hence bitwise the same result:
 *   FN(bw_matrix)    one thread takes a whole matrix: key blocks j outermost,
 *                    query blocks i inside; dK_j, dV_j complete after the
 *                    inner loop, dQ_i accumulated over j in order;
 *   FN(bw_kv_block)  + FN(bw_q_block): FA2's two passes for few matrices:
 *                    items (matrix, j) compute dK_j, dV_j (over i in order),
 *                    then items (matrix, i) recompute S, P, dP, dS of their
 *                    row block and sum dQ_i over j in order.
 * Every product is the register-tiled micro-kernel FN(bw_mk):
 * C[M x N] (+)= A[M x K] B[K x N] with B's rows contiguous vectors and A
 * read a scalar at a time with any strides (A^T for products 3 and 4).
 *
 * With ATTN_BW_BF16DOT (a bfloat16 problem on avx512-bf16, float32 kind),
 * the products' operands are bfloat16 pairs along the reduction index (one
 * 32-bit word per pair, attn_backward.h's layout) and the micro-kernel's
 * multiply-add is vdpbf16ps: Q, K, V and dO are bfloat16 values already
 * (exact), P and dS are rounded to bfloat16 for products 3 to 5, as torch's
 * bfloat16 backward rounds them before its GEMMs. Sums, P, dS, D and the
 * accumulators stay float32. Q is packed unscaled (scale is rarely a
 * bfloat16) and product 1's sums are multiplied by scale, as the forward's
 * vdpbf16ps tiles do (FN(qk_tile_bf16)), so product 4 gives dK / scale. (The
 * avx512-amx forward's AMX tiles sum the same pairs with other roundings,
 * which no instruction here reproduces: far below the bfloat16 rounding of
 * P that follows.)
 */

#define ATTN_IS_F64 (ATTN_KIND == ATTN_F64)
#if ATTN_IS_F64
#define T double
#define LOGF log
#else
#define T float
#define LOGF logf
#endif
#define ARGS FN(bw_mat)
#define BQ ATTN_BW_BQ
#define BK ATTN_BW_BK
#define NEG_INF (-(T)INFINITY)
#if defined(ATTN_BW_BF16DOT)
#define BW_PAIRS 1
#define OP uint32_t   /* a product operand's element: a bfloat16 pair */
#define BW_BV __m512i
#define BW_LOADB(p) _mm512_loadu_si512((const void *)(p))
#define BW_SET1A(x) _mm512_set1_epi32((int)(x))
#define BW_DOT(x, b, c) _mm512_dpbf16_ps((c), (__m512bh)(x), (__m512bh)(b))
#else
#define BW_PAIRS 0
#define OP T
#define BW_BV V_T
#define BW_LOADB(p) V_LOAD(p)
#define BW_SET1A(x) V_SET1(x)
#define BW_DOT(x, b, c) V_FMA((x), (b), (c))
#endif
#define HALF(n) (BW_PAIRS ? ((n) + 1) / 2 : (n))  /* operand elements along a reduction of n */

#include "attn_simd_exp.h"  /* FN(vexp), the forward's exp */

/* ------------------------------------------------------------ one matrix
 * Matrix b of an attn_bw_problem in this instance's type T: pointers at
 * element [0, 0], element strides (any sign; 0 for broadcast). out, dout:
 * [n_q][d_v] contiguous; lse: [n_q]; dq [n_q][d_k], dk [n_k][d_k],
 * dv [n_k][d_v], ds [n_q][n_k] (or NULL) contiguous; work: its packed
 * operands. Built by FN(bw_view) at each entry point, read by everything
 * below. */
typedef struct {
    const T *q; ptrdiff_t q_rs, q_cs;
    const T *k; ptrdiff_t k_rs, k_cs;
    const T *v; ptrdiff_t v_rs, v_cs;
    const void *mask; ptrdiff_t m_rs, m_cs; int mask_kind;
    const T *out; const T *dout; const T *lse;
    T *dq; T *dk; T *dv; T *ds;
    ptrdiff_t n_q, n_k, d_k, d_v;
    int causal; ptrdiff_t causal_offset; /* key j visible to row i iff j <= i + offset */
    T scale;
    T *work;
    /* the variants (attn_kernel.h): window [i + win_lo, i + win_hi]; softcap; ALiBi slope */
    int window; ptrdiff_t win_lo, win_hi, alibi_offset;
    T softcap, slope;
} FN(bw_mat);

static inline const T *FN(bw_at)(const attn_operand *o, int64_t b)
{
    return o->base == NULL ? NULL : (const T *)(const void *)(o->base + o->offsets[b] * (int64_t)sizeof(T));
}

static inline ARGS FN(bw_view)(const attn_bw_problem *p, int64_t b)
{
    const attn_problem *f = &p->fw;
    ARGS a;
    a.q = FN(bw_at)(&f->q, b);
    a.q_rs = f->q.s_row;
    a.q_cs = f->q.s_col;
    a.k = FN(bw_at)(&f->k, b);
    a.k_rs = f->k.s_row;
    a.k_cs = f->k.s_col;
    a.v = FN(bw_at)(&f->v, b);
    a.v_rs = f->v.s_row;
    a.v_cs = f->v.s_col;
    a.mask_kind = f->mask_kind;
    a.mask = f->mask_kind == ATTN_MASK_NONE ? NULL
             : f->mask.base + f->mask.offsets[b] * (f->mask_kind == ATTN_MASK_ADD ? (int64_t)sizeof(T) : 1);
    a.m_rs = f->mask.s_row;
    a.m_cs = f->mask.s_col;
#define ATTN_BW_ROWS(ptr, n) ((ptr) == NULL ? NULL : (T *)(void *)(ptr) + b * (n))
    a.out = ATTN_BW_ROWS(f->out, f->n_q * f->d_v);
    a.dout = ATTN_BW_ROWS(p->dout, f->n_q * f->d_v);
    a.lse = ATTN_BW_ROWS(f->lse, f->n_q);
    a.dq = ATTN_BW_ROWS(p->dq, f->n_q * f->d_k);
    a.dk = ATTN_BW_ROWS(p->dk, f->n_k * f->d_k);
    a.dv = ATTN_BW_ROWS(p->dv, f->n_k * f->d_v);
    a.ds = ATTN_BW_ROWS(p->ds, f->n_q * f->n_k);
    a.work = ATTN_BW_ROWS(p->work, p->work_elems);
#undef ATTN_BW_ROWS
    a.n_q = f->n_q;
    a.n_k = f->n_k;
    a.d_k = f->d_k;
    a.d_v = f->d_v;
    a.causal = f->causal;
    a.causal_offset = f->causal_offset;
    a.scale = (T)f->scale;
    a.window = f->window;
    a.win_lo = f->win_lo;
    a.win_hi = f->win_hi;
    a.alibi_offset = f->alibi_offset;
    a.softcap = (T)f->softcap;
    a.slope = f->alibi == NULL ? (T)0 : (T)f->alibi[b];
    if (f->varlen != NULL) {  /* a packed sequence: its lengths and offsets (outputs stay uniform) */
        const int64_t shift = f->varlen[2 * f->n_batch + b];
        a.n_q = f->varlen[b];
        a.n_k = f->varlen[f->n_batch + b];
        a.causal_offset += shift;
        a.win_lo += shift;
        a.win_hi += shift;
        a.alibi_offset += shift;
    }
    return a;
}

/* ------------------------------------------------------ product micro-kernel
 * C[r][c] (+)= sum_k A[r * a_rs + k * a_cs] * B[k * ldb + c] for r < nr rows
 * and c < nv * V_L columns (acc: add to C, else overwrite); with bfloat16
 * pairs, k counts pairs and each term is a pair's two products. */
static ATTN_TGT ATTN_INLINE void FN(bw_mk)(const OP *A, ptrdiff_t a_rs, ptrdiff_t a_cs,
                                              const OP *B, ptrdiff_t ldb, T *C, ptrdiff_t ldc,
                                              ptrdiff_t K, const int acc, const int nr, const int nv)
{
    V_T c[MR][NR];
    int r, w;
    ptrdiff_t k;
    for (r = 0; r < MR; r++)
        for (w = 0; w < NR; w++)
            c[r][w] = (acc && r < nr && w < nv) ? V_LOAD(C + r * ldc + w * V_L) : V_ZERO();
    for (k = 0; k < K; k++) {
        BW_BV b[NR];
        const OP *ak = A + k * a_cs;
        for (w = 0; w < NR; w++)
            if (w < nv) b[w] = BW_LOADB(B + k * ldb + w * V_L);
        for (r = 0; r < MR; r++) {
            if (r < nr) {
                BW_BV x = BW_SET1A(ak[r * a_rs]);
                for (w = 0; w < NR; w++)
                    if (w < nv) c[r][w] = BW_DOT(x, b[w], c[r][w]);
            }
        }
    }
    for (r = 0; r < MR; r++)
        if (r < nr)
            for (w = 0; w < NR; w++)
                if (w < nv) V_STORE(C + r * ldc + w * V_L, c[r][w]);
}

#if MR > 6 || NR > 4
#error "attn_backward_impl.h: add switch cases for this register tile shape"
#endif
#define BW_CASE(NR_, NV_) case (NR_) * 8 + (NV_): \
    FN(bw_mk)(A, a_rs, a_cs, B, ldb, C, ldc, K, acc, NR_, NV_); break;
#define BW_CASES(NR_) BW_CASE(NR_, 1) BW_CASE(NR_, 2) BW_CASE(NR_, 3) BW_CASE(NR_, 4)

static ATTN_TGT void FN(bw_mk_any)(const OP *A, ptrdiff_t a_rs, ptrdiff_t a_cs, const OP *B,
                                   ptrdiff_t ldb, T *C, ptrdiff_t ldc, ptrdiff_t K, int acc,
                                   int nr, int nv)
{
    switch (nr * 8 + nv) {
        BW_CASES(1) BW_CASES(2) BW_CASES(3) BW_CASES(4)
#if MR > 4
        BW_CASES(5) BW_CASES(6)
#endif
        default: break;
    }
}
#undef BW_CASE
#undef BW_CASES

/* C[M x nvec * V_L] (+)= A[M x K] B[K x nvec * V_L]: column strips of NR
 * vectors outermost (a strip of B, K x NR vectors, stays in L1 while the
 * row tiles pass), then tiles of MR rows. */
static ATTN_TGT void FN(bw_gemm)(const OP *A, ptrdiff_t a_rs, ptrdiff_t a_cs, const OP *B,
                                 ptrdiff_t ldb, T *C, ptrdiff_t ldc, ptrdiff_t M, ptrdiff_t nvec,
                                 ptrdiff_t K, int acc)
{
    ptrdiff_t m0, v0;
    for (v0 = 0; v0 < nvec; v0 += NR) {
        const int nv = (int)(nvec - v0 < NR ? nvec - v0 : NR);
        for (m0 = 0; m0 < M; m0 += MR)
            FN(bw_mk_any)(A + m0 * a_rs, a_rs, a_cs, B + v0 * V_L, ldb, C + m0 * ldc + v0 * V_L,
                          ldc, K, acc, (int)(M - m0 < MR ? M - m0 : MR), nv);
    }
}

/* ------------------------------------------------------------ work layout
 * Matrix b's work regions and this thread's scratch regions, where
 * attn_bw_layout_of (attn_backward.h) puts them for this path's V_L. */
typedef struct {
    OP *qp, *kt, *dop, *kp, *vt, *qpp, *dopp;  /* product operands */
    T *dd, *dqa;
    ptrdiff_t ep, evp, nkb;
    ptrdiff_t dkh, dvh;  /* kt's and vt's rows per key block (the layout's dkw, dvw) */
    attn_bw_layout at;  /* and the scratch offsets */
} FN(bw_ptrs);

static FN(bw_ptrs) FN(bw_bind)(const ARGS *a)
{
    FN(bw_ptrs) w;
    w.at = attn_bw_layout_of(a->n_q, a->n_k, a->d_k, a->d_v, V_L, BW_PAIRS);
    w.ep = w.at.ep;
    w.evp = w.at.evp;
    w.nkb = w.at.nkb;
    w.dkh = w.at.dkw;
    w.dvh = w.at.dvw;
    /* (a pair takes one float's slot: the offsets count both in elements of T) */
    w.qp = (OP *)(void *)(a->work + w.at.qp);
    w.kt = (OP *)(void *)(a->work + w.at.kt);
    w.dop = (OP *)(void *)(a->work + w.at.dop);
    w.dd = a->work + w.at.dd;
    w.kp = (OP *)(void *)(a->work + w.at.kp);
    w.vt = (OP *)(void *)(a->work + w.at.vt);
    w.dqa = a->work + w.at.dqa;
    w.qpp = (OP *)(void *)(a->work + w.at.qpp);
    w.dopp = (OP *)(void *)(a->work + w.at.dopp);
    return w;
}

#if BW_PAIRS
/* x[i][e] of x [n][d] (element strides rs, cs), zero outside */
static inline T FN(bw_el)(const T *x, ptrdiff_t rs, ptrdiff_t cs, ptrdiff_t n, ptrdiff_t d,
                          ptrdiff_t i, ptrdiff_t e)
{
    return i < n && e < d ? x[i * rs + e * cs] : (T)0;
}

/* dst [rows][cols] pairs of x [n][d] (strides rs, cs; zero outside), each
 * element rounded by attn_narrow_bf16 (exact for a bfloat16 call's q, k, v and dout):
 * by_rows 0, pairs along d:  word (i, t) = (x[i][2t], x[i][2t + 1]);
 * by_rows 1, pairs of rows:  word (r, e) = (x[2r][e], x[2r + 1][e]).
 * Vectors where the pair's two elements lie in contiguous runs (cs == 1
 * along d; rs == 1 for pairs of rows: K^T and V^T), rounded to nearest even
 * by vcvtne2ps2bf16 as attn_narrow_bf16 rounds; elements one at a time otherwise. */
static ATTN_TGT void FN(bw_pack_pairs)(const T *x, ptrdiff_t rs, ptrdiff_t cs, ptrdiff_t n, ptrdiff_t d,
                                       ptrdiff_t rows, ptrdiff_t cols, int by_rows, OP *dst)
{
    ptrdiff_t r, c;
    if (!by_rows && cs == 1) {  /* 32 elements of row r -> 16 words, in order */
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c += 16) {
                const ptrdiff_t e = 2 * c, left = r < n ? d - e : 0;
                const __mmask16 lo = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
                const __mmask16 hi = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                const __mmask16 st = cols - c >= 16 ? 0xffff : (__mmask16)((1u << (cols - c)) - 1);
                const float *xr = x + r * rs + e;
                _mm512_mask_storeu_epi32((void *)(dst + r * cols + c), st, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_maskz_loadu_ps(hi, xr + 16), _mm512_maskz_loadu_ps(lo, xr)));
            }
        return;
    }
    if (by_rows && cs == 1) {  /* rows 2r, 2r + 1, 16 columns at a time */
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c += 16) {
                const ptrdiff_t left = d - c;
                const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
                const __mmask16 m0 = 2 * r < n ? m : 0, m1 = 2 * r + 1 < n ? m : 0;
                const __mmask16 st = cols - c >= 16 ? 0xffff : (__mmask16)((1u << (cols - c)) - 1);
                const float *x0 = x + 2 * r * rs + c;
                _mm512_mask_storeu_epi32((void *)(dst + r * cols + c), st, attn_bf16_pairs_avx512(
                    _mm512_maskz_loadu_ps(m0, x0), _mm512_maskz_loadu_ps(m1, x0 + rs)));
            }
        return;
    }
    if (by_rows && rs == 1) {  /* K^T, V^T: column c of dst from x's column c (contiguous) */
        const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)cols));
        for (c = 0; c < cols; c++)
            for (r = 0; r < rows; r += 16) {
                const ptrdiff_t left = c < d ? n - 2 * r : 0;  /* elements of the column from row 2r */
                const __mmask16 lo = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
                const __mmask16 hi = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
                const __mmask16 st = rows - r >= 16 ? 0xffff : (__mmask16)((1u << (rows - r)) - 1);
                const float *xc = x + c * cs + 2 * r;
                _mm512_mask_i32scatter_epi32((void *)(dst + r * cols + c), st, idx, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_maskz_loadu_ps(hi, xc + 16), _mm512_maskz_loadu_ps(lo, xc)), 4);
            }
        return;
    }
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) {
            const ptrdiff_t i = by_rows ? 2 * r : r, e = by_rows ? c : 2 * c;
            const float lohi[2] = {(float)FN(bw_el)(x, rs, cs, n, d, i, e),
                                   (float)FN(bw_el)(x, rs, cs, n, d, i + by_rows, e + !by_rows)};
            uint16_t h[2];
            attn_narrow_bf16(lohi, h, 2);
            dst[r * cols + c] = (uint32_t)h[0] | (uint32_t)h[1] << 16;
        }
}

/* Pack one matrix's operands as pairs (attn_bw_layout, attn_backward.h); D; zero dQ's accumulator. */
static ATTN_TGT void FN(bw_pack)(const attn_bw_problem *p, int64_t b)
{
    const ARGS av = FN(bw_view)(p, b), *a = &av;
    const FN(bw_ptrs) w = FN(bw_bind)(a);
    ptrdiff_t i, e, jb;
    FN(bw_pack_pairs)(a->q, a->q_rs, a->q_cs, a->n_q, a->d_k, a->n_q, w.ep / 2, 0, w.qp);
    FN(bw_pack_pairs)(a->q, a->q_rs, a->q_cs, a->n_q, a->d_k, HALF(a->n_q), w.ep, 1, w.qpp);
    FN(bw_pack_pairs)(a->dout, a->d_v, 1, a->n_q, a->d_v, a->n_q, w.evp / 2, 0, w.dop);
    FN(bw_pack_pairs)(a->dout, a->d_v, 1, a->n_q, a->d_v, HALF(a->n_q), w.evp, 1, w.dopp);
    FN(bw_pack_pairs)(a->k, a->k_rs, a->k_cs, a->n_k, a->d_k, w.nkb * BK / 2, w.ep, 1, w.kp);
    for (jb = 0; jb < w.nkb; jb++) {  /* K^T, V^T of block jb: element (e, j) = x[j0 + j][e] */
        const ptrdiff_t j0 = jb * BK;
        FN(bw_pack_pairs)(a->k + j0 * a->k_rs, a->k_cs, a->k_rs, a->d_k, a->n_k - j0, w.dkh, BK, 1,
                          w.kt + jb * w.dkh * BK);
        FN(bw_pack_pairs)(a->v + j0 * a->v_rs, a->v_cs, a->v_rs, a->d_v, a->n_k - j0, w.dvh, BK, 1,
                          w.vt + jb * w.dvh * BK);
    }
    for (i = 0; i < a->n_q; i++) {
        const T *dr = a->dout + i * a->d_v, *orow = a->out + i * a->d_v;
        T d = 0;
        for (e = 0; e < a->d_v; e++) d += dr[e] * orow[e];
        w.dd[i] = d;
    }
    memset(w.dqa, 0, sizeof(T) * (size_t)(a->n_q * w.ep));
}

/* The tile's P and dS (float32, [nq][BK]) as the pairs products 3 to 5 read:
 * kv: p2, ds2 [BQ/2][BK], word (r, c) = (x[2r][c], x[2r + 1][c]) (a row past
 * nq as zero); q: dsb [BQ][BK/2], word (r, t) = (dS[r][2t], dS[r][2t + 1]). */
static ATTN_TGT void FN(bw_round)(const T *P, const T *dS, ptrdiff_t nq, OP *p2, OP *ds2, OP *dsb,
                                  int kv, int q)
{
    ptrdiff_t r, c;
    if (kv)
        for (r = 0; r < nq; r += 2) {
            const int two = r + 1 < nq;
            for (c = 0; c < BK; c += V_L) {
                _mm512_storeu_si512((void *)(p2 + r / 2 * BK + c), attn_bf16_pairs_avx512(
                    V_LOAD(P + r * BK + c), two ? V_LOAD(P + (r + 1) * BK + c) : V_ZERO()));
                _mm512_storeu_si512((void *)(ds2 + r / 2 * BK + c), attn_bf16_pairs_avx512(
                    V_LOAD(dS + r * BK + c), two ? V_LOAD(dS + (r + 1) * BK + c) : V_ZERO()));
            }
        }
    if (q)
        for (r = 0; r < nq; r++)
            for (c = 0; c < BK; c += 2 * V_L)  /* 32 in order: pairs of neighbours */
                _mm512_storeu_si512((void *)(dsb + r * (BK / 2) + c / 2),
                                    (__m512i)_mm512_cvtne2ps_pbh(V_LOAD(dS + r * BK + c + V_L),
                                                                 V_LOAD(dS + r * BK + c)));
}
#else
/* Rows [0, n) of x (element strides rs, cs; d columns) times c into dst
 * [n_pad][ld] (c = 1: a copy): columns past d and rows past n zero. */
static ATTN_TGT void FN(bw_pack_rows)(const T *x, ptrdiff_t rs, ptrdiff_t cs, ptrdiff_t n,
                                      ptrdiff_t n_pad, ptrdiff_t d, ptrdiff_t ld, T c, T *dst)
{
    ptrdiff_t i, e;
    for (i = 0; i < n_pad; i++) {
        T *o = dst + i * ld;
        e = 0;
        if (i < n) {
            const T *xr = x + i * rs;
            for (; e < d; e++) o[e] = xr[e * cs] * c;
        }
        for (; e < ld; e++) o[e] = 0;
    }
}

/* x [n][d] (strides rs, cs) transposed per key block: block jb of dst is
 * [d][BK], keys past n zero. */
static ATTN_TGT void FN(bw_pack_t)(const T *x, ptrdiff_t rs, ptrdiff_t cs, ptrdiff_t n,
                                   ptrdiff_t d, ptrdiff_t nkb, T *dst)
{
    ptrdiff_t jb, e, j;
    for (jb = 0; jb < nkb; jb++) {
        const ptrdiff_t j0 = jb * BK, nk = n - j0 < BK ? n - j0 : BK;
        T *t = dst + jb * d * BK;
        for (e = 0; e < d; e++) {
            const T *xc = x + j0 * rs + e * cs;
            for (j = 0; j < nk; j++) t[e * BK + j] = xc[j * rs];
            for (; j < BK; j++) t[e * BK + j] = 0;
        }
    }
}

/* Pack one matrix's operands (attn_bw_layout, attn_backward.h); D; zero dQ's accumulator. */
static ATTN_TGT void FN(bw_pack)(const attn_bw_problem *p, int64_t b)
{
    const ARGS av = FN(bw_view)(p, b), *a = &av;
    const FN(bw_ptrs) w = FN(bw_bind)(a);
    ptrdiff_t i, e;
    /* scale Q, rounded as the forward's FN(load_q) rounds it */
    FN(bw_pack_rows)(a->q, a->q_rs, a->q_cs, a->n_q, a->n_q, a->d_k, w.ep, a->scale, w.qp);
    FN(bw_pack_t)(a->k, a->k_rs, a->k_cs, a->n_k, a->d_k, w.nkb, w.kt);
    for (i = 0; i < a->n_q; i++) {
        const T *dr = a->dout + i * a->d_v, *orow = a->out + i * a->d_v;
        T *o = w.dop + i * w.evp, d = 0;
        for (e = 0; e < a->d_v; e++) { o[e] = dr[e]; d += dr[e] * orow[e]; }
        for (; e < w.evp; e++) o[e] = 0;
        w.dd[i] = d;
    }
    FN(bw_pack_rows)(a->k, a->k_rs, a->k_cs, a->n_k, w.nkb * BK, a->d_k, w.ep, (T)1, w.kp);
    FN(bw_pack_t)(a->v, a->v_rs, a->v_cs, a->n_k, a->d_v, w.nkb, w.vt);
    memset(w.dqa, 0, sizeof(T) * (size_t)(a->n_q * w.ep));
}

/* (float32 and float64: the products read P and dS themselves) */
static inline void FN(bw_round)(const T *P, const T *dS, ptrdiff_t nq, OP *p2, OP *ds2, OP *dsb,
                                int kv, int q)
{
    (void)P; (void)dS; (void)nq; (void)p2; (void)ds2; (void)dsb; (void)kv; (void)q;
}
#endif

/* ------------------------------------------------------------ visibility */
static inline ptrdiff_t FN(bw_visible)(const ARGS *a, ptrdiff_t i, ptrdiff_t j0, ptrdiff_t nk)
{
    /* keys [j0, j0 + result) of block j0 are not excluded by n_k or causality for row i */
    ptrdiff_t lim = nk;
    if (a->causal) {
        ptrdiff_t c = i + a->causal_offset - j0 + 1;
        if (c < lim) lim = c;
        if (lim < 0) lim = 0;
    }
    if (a->window) {  /* (and the window's right edge) */
        ptrdiff_t c = i + a->win_hi - j0 + 1;
        if (c < lim) lim = c;
        if (lim < 0) lim = 0;
    }
    return lim;
}

static inline int FN(bw_tile_visible)(const ARGS *a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0)
{
    if (a->window && (j0 > i0 + nq - 1 + a->win_hi || j0 + BK - 1 < i0 + a->win_lo))
        return 0;  /* the tile is outside every row's window */
    return !a->causal || j0 <= i0 + nq - 1 + a->causal_offset;
}

/* Whether row scores need FN(bw_mods): a softcap, ALiBi or a window. */
static inline int FN(bw_has_mods)(const ARGS *a) { return a->softcap > 0 || a->slope != 0 || a->window; }

/* The variants on row i's scores sr[c] = (scale Q_i) . K_{j0 + c} for c < lim
 * (bfloat16 pairs: Q_i . K_{j0 + c}, multiplied by scale here first, as the
 * forward's tiles do) (attn/_variants.py): sr = cap(sr) - slope |i +
 * alibi_offset - j0 - c|, -inf before the window's left edge; dc[c] = d cap /
 * d s = 1 - tanh^2 (1 without a cap). Past lim, up to a whole vector: sr as
 * it was, dc = 0. The caller then adds the mask. */
static void FN(bw_mods)(const ARGS *a, ptrdiff_t i, ptrdiff_t j0, ptrdiff_t lim, T *sr, T *dc)
{
    const ptrdiff_t limv = (lim + V_L - 1) / V_L * V_L, d0 = i + a->alibi_offset - j0;
    const ptrdiff_t first = a->window ? i + a->win_lo - j0 : 0;
    ptrdiff_t c;
    if (BW_PAIRS)
        for (c = 0; c < lim; c++) sr[c] *= a->scale;
    if (a->softcap > 0) {
        FN(softcap_run)(sr, lim, a->softcap);  /* the forward's cap */
        for (c = 0; c < lim; c++) {
            const T t = sr[c] / a->softcap;
            dc[c] = 1 - t * t;
        }
    } else {
        for (c = 0; c < lim; c++) dc[c] = 1;
    }
    if (a->slope != 0) FN(alibi_run)(sr, lim, (T)d0, (T)-1, a->slope);  /* the forward's bias */
    for (c = 0; c < lim && c < first; c++) sr[c] = NEG_INF;
    for (c = lim; c < limv; c++) dc[c] = 0;
}

/* mrow[c] for c < lim rounded up to a vector: the additive mask of row i
 * (bool: 0 visible, -inf masked; float: the bias); -inf past lim. */
static inline void FN(bw_mask_row)(const ARGS *a, ptrdiff_t i, ptrdiff_t j0, ptrdiff_t lim, T *mrow)
{
    const ptrdiff_t limv = (lim + V_L - 1) / V_L * V_L;
    ptrdiff_t c;
    if (a->mask_kind == ATTN_MASK_BOOL) {
        const uint8_t *m = (const uint8_t *)a->mask + i * a->m_rs + j0 * a->m_cs;
        for (c = 0; c < lim; c++) mrow[c] = m[c * a->m_cs] ? (T)0 : NEG_INF;
    } else {
        const T *m = (const T *)a->mask + i * a->m_rs + j0 * a->m_cs;
        for (c = 0; c < lim; c++) mrow[c] = m[c * a->m_cs];
    }
    for (; c < limv; c++) mrow[c] = NEG_INF;
}

/* --------------------------------------------------------------- one tile
 * P and dS of query block (i0, nq) x key block jb: on return P [nq][BK] holds
 * P_ij and dS [nq][BK] holds dS_ij (unscaled), both 0 where invisible. */
static ATTN_TGT void FN(bw_tile)(const ARGS *a, const FN(bw_ptrs) *w, ptrdiff_t i0, ptrdiff_t nq,
                                 ptrdiff_t jb, T *P, T *dS, T *mrow, T *dc)
{
    const ptrdiff_t j0 = jb * BK, nk = a->n_k - j0 < BK ? a->n_k - j0 : BK;
    const int mods = FN(bw_has_mods)(a), capped = a->softcap > 0;
    /* bfloat16 pairs without variants: the sums times scale below (FN(bw_mods) scales them itself) */
    const int scale_here = BW_PAIRS && !mods;
    const V_T vs = V_SET1(a->scale);
    const V_T vlane = V_LOAD(FN(lanes));
    ptrdiff_t r, c;
    /* product 1: S = (scale Q_i) K_j^T (pairs: Q_i K_j^T);  product 2: dP = dO_i V_j^T */
    FN(bw_gemm)(w->qp + i0 * HALF(w->ep), HALF(w->ep), 1, w->kt + jb * w->dkh * BK, BK, P, BK, nq,
                BK / V_L, w->dkh, 0);
    FN(bw_gemm)(w->dop + i0 * HALF(w->evp), HALF(w->evp), 1, w->vt + jb * w->dvh * BK, BK, dS, BK,
                nq, BK / V_L, w->dvh, 0);
    for (r = 0; r < nq; r++) {
        const ptrdiff_t i = i0 + r, lim = FN(bw_visible)(a, i, j0, nk);
        const T lse = a->lse[i];
        T *pr = P + r * BK, *dr = dS + r * BK;
        if (lim == 0 || lse == NEG_INF) {  /* nothing visible: P = dS = 0 */
            memset(pr, 0, sizeof(T) * BK);
            memset(dr, 0, sizeof(T) * BK);
            continue;
        }
        {
            const int masked = a->mask_kind != ATTN_MASK_NONE;
            const V_T vl = V_SET1(lse), vd = V_SET1(w->dd[i]), vlim = V_SET1((T)lim);
            if (masked) FN(bw_mask_row)(a, i, j0, lim, mrow);
            if (mods) FN(bw_mods)(a, i, j0, lim, pr, dc);
            for (c = 0; c < lim; c += V_L) {
                /* P = exp(S + B - lse);  dS = P o (dP - D) (o dcap / ds: through a softcap) */
                V_T x = scale_here ? V_MUL(V_LOAD(pr + c), vs) : V_LOAD(pr + c), p, g;
                if (masked) x = V_ADD(x, V_LOAD(mrow + c));  /* (rounded apart, as the forward's) */
                p = FN(vexp)(V_SUB(x, vl));
                if (c + V_L > lim)  /* lanes past the visible keys */
                    p = V_SEL_LT(V_ADD(vlane, V_SET1((T)c)), vlim, p, V_ZERO());
                V_STORE(pr + c, p);
                g = V_MUL(p, V_SUB(V_LOAD(dr + c), vd));
                V_STORE(dr + c, capped ? V_MUL(g, V_LOAD(dc + c)) : g);
            }
            for (; c < BK; c += V_L) {
                V_STORE(pr + c, V_ZERO());
                V_STORE(dr + c, V_ZERO());
            }
        }
    }
}

/* dS tile into the float mask's gradient ds [n_q][n_k] */
static void FN(bw_store_ds)(const ARGS *a, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t j0, const T *dS)
{
    const ptrdiff_t nk = a->n_k - j0 < BK ? a->n_k - j0 : BK;
    ptrdiff_t r;
    for (r = 0; r < nq; r++)
        memcpy(a->ds + (i0 + r) * a->n_k + j0, dS + r * BK, sizeof(T) * (size_t)nk);
}

/* products 3 and 4 of tile (i0, nq) x jb into the key block's accumulators
 * (P, dS: the tile's [nq][BK], or its pairs p2, ds2; i0 is even) */
static ATTN_TGT void FN(bw_acc_kv)(const FN(bw_ptrs) *w, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t nk,
                                   const OP *P, const OP *dS, T *dka, T *dva)
{
    /* dV_j += P^T dO_i: A = P^T (a_rs = 1, a_cs = BK) */
    FN(bw_gemm)(P, 1, BK, (BW_PAIRS ? w->dopp : w->dop) + HALF(i0) * w->evp, w->evp, dva, w->evp,
                nk, w->evp / V_L, HALF(nq), 1);
    /* dK_j += dS^T Q_i */
    FN(bw_gemm)(dS, 1, BK, (BW_PAIRS ? w->qpp : w->qp) + HALF(i0) * w->ep, w->ep, dka, w->ep, nk,
                w->ep / V_L, HALF(nq), 1);
}

/* product 5: dQ_i += dS K_j (dS: the tile, or its pairs dsb) */
static ATTN_TGT void FN(bw_acc_q)(const FN(bw_ptrs) *w, ptrdiff_t i0, ptrdiff_t nq, ptrdiff_t jb,
                                  ptrdiff_t nk, const OP *dS)
{
    FN(bw_gemm)(dS, HALF(BK), 1, w->kp + HALF(jb * BK) * w->ep, w->ep, w->dqa + i0 * w->ep, w->ep,
                nq, w->ep / V_L, HALF(nk), 1);
}

/* dK_j = acc (pairs, whose Q is unscaled: scale * acc), dV_j = acc into the outputs */
static void FN(bw_store_kv)(const ARGS *a, const FN(bw_ptrs) *w, ptrdiff_t j0, ptrdiff_t nk,
                            const T *dka, const T *dva)
{
    const T c_k = BW_PAIRS ? a->scale : (T)1;
    ptrdiff_t c, e;
    for (c = 0; c < nk; c++) {
        T *dk = a->dk + (j0 + c) * a->d_k, *dv = a->dv + (j0 + c) * a->d_v;
        for (e = 0; e < a->d_k; e++) dk[e] = c_k * dka[c * w->ep + e];
        for (e = 0; e < a->d_v; e++) dv[e] = dva[c * w->evp + e];
    }
}

static void FN(bw_store_q)(const ARGS *a, const FN(bw_ptrs) *w, ptrdiff_t i0, ptrdiff_t nq)
{
    ptrdiff_t r, e;
    for (r = i0; r < i0 + nq; r++)
        for (e = 0; e < a->d_k; e++) a->dq[r * a->d_k + e] = a->scale * w->dqa[r * w->ep + e];
}

/* this thread's scratch regions (attn_bw_layout_of), 64-byte aligned */
/* and the products' A operands: P, dS themselves, or their pairs (FN(bw_round)) */
#define BW_SCRATCH(w_)                                                              \
    T *P = scratch + (w_).at.p, *dS = scratch + (w_).at.ds, *mrow = scratch + (w_).at.mrow, \
      *dka = scratch + (w_).at.dka, *dva = scratch + (w_).at.dva, *dc = scratch + (w_).at.dc; \
    OP *Pa = (OP *)(void *)(BW_PAIRS ? scratch + (w_).at.p2 : P),                    \
       *dSa = (OP *)(void *)(BW_PAIRS ? scratch + (w_).at.ds2 : dS),                 \
       *dSq = (OP *)(void *)(BW_PAIRS ? scratch + (w_).at.dsb : dS);                 \
    (void)dva; (void)dka; (void)Pa; (void)dSa; (void)dSq

/* Key block jb of one matrix: dK_j, dV_j over all query blocks in order. */
static ATTN_TGT void FN(bw_kv_block)(const attn_bw_problem *p, int64_t b, int64_t jb, void *vscratch)
{
    const ARGS av = FN(bw_view)(p, b), *a = &av;
    T *scratch = (T *)vscratch;
    const FN(bw_ptrs) w = FN(bw_bind)(a);
    const ptrdiff_t j0 = jb * BK, nk = a->n_k - j0 < BK ? a->n_k - j0 : BK;
    ptrdiff_t i0;
    BW_SCRATCH(w);
    if (j0 >= a->n_k) return;  /* past a packed sequence's keys */
    memset(dka, 0, sizeof(T) * (size_t)(BK * w.ep));
    memset(dva, 0, sizeof(T) * (size_t)(BK * w.evp));
    for (i0 = 0; i0 < a->n_q; i0 += BQ) {
        const ptrdiff_t nq = a->n_q - i0 < BQ ? a->n_q - i0 : BQ;
        if (!FN(bw_tile_visible)(a, i0, nq, j0)) continue;
        FN(bw_tile)(a, &w, i0, nq, jb, P, dS, mrow, dc);
        if (a->ds != NULL) FN(bw_store_ds)(a, i0, nq, j0, dS);
        FN(bw_round)(P, dS, nq, Pa, dSa, dSq, 1, 0);
        FN(bw_acc_kv)(&w, i0, nq, nk, Pa, dSa, dka, dva);
    }
    FN(bw_store_kv)(a, &w, j0, nk, dka, dva);
}

/* Query block ib of one matrix: dQ_i over all key blocks in order (P, dS recomputed). */
static ATTN_TGT void FN(bw_q_block)(const attn_bw_problem *p, int64_t b, int64_t ib, void *vscratch)
{
    const ARGS av = FN(bw_view)(p, b), *a = &av;
    T *scratch = (T *)vscratch;
    const FN(bw_ptrs) w = FN(bw_bind)(a);
    const ptrdiff_t i0 = ib * BQ, nq = a->n_q - i0 < BQ ? a->n_q - i0 : BQ;
    ptrdiff_t jb;
    BW_SCRATCH(w);
    if (i0 >= a->n_q) return;  /* past a packed sequence's rows */
    for (jb = 0; jb < w.nkb; jb++) {
        const ptrdiff_t j0 = jb * BK, nk = a->n_k - j0 < BK ? a->n_k - j0 : BK;
        if (!FN(bw_tile_visible)(a, i0, nq, j0)) continue;  /* (a window's: earlier blocks too) */
        FN(bw_tile)(a, &w, i0, nq, jb, P, dS, mrow, dc);
        FN(bw_round)(P, dS, nq, Pa, dSa, dSq, 0, 1);
        FN(bw_acc_q)(&w, i0, nq, jb, nk, dSq);
    }
    FN(bw_store_q)(a, &w, i0, nq);
}

/* A whole matrix on one thread: the same tiles, products and sums in the
 * same order as FN(bw_kv_block) for every jb, then FN(bw_q_block) for every ib. */
static ATTN_TGT void FN(bw_matrix)(const attn_bw_problem *p, int64_t b, void *vscratch)
{
    const ARGS av = FN(bw_view)(p, b), *a = &av;
    T *scratch = (T *)vscratch;
    const FN(bw_ptrs) w = FN(bw_bind)(a);
    ptrdiff_t jb, i0;
    BW_SCRATCH(w);
    for (jb = 0; jb < w.nkb; jb++) {
        const ptrdiff_t j0 = jb * BK, nk = a->n_k - j0 < BK ? a->n_k - j0 : BK;
        memset(dka, 0, sizeof(T) * (size_t)(BK * w.ep));
        memset(dva, 0, sizeof(T) * (size_t)(BK * w.evp));
        for (i0 = 0; i0 < a->n_q; i0 += BQ) {
            const ptrdiff_t nq = a->n_q - i0 < BQ ? a->n_q - i0 : BQ;
            if (!FN(bw_tile_visible)(a, i0, nq, j0)) continue;
            FN(bw_tile)(a, &w, i0, nq, jb, P, dS, mrow, dc);
            if (a->ds != NULL) FN(bw_store_ds)(a, i0, nq, j0, dS);
            FN(bw_round)(P, dS, nq, Pa, dSa, dSq, 1, 1);
            FN(bw_acc_kv)(&w, i0, nq, nk, Pa, dSa, dka, dva);
            FN(bw_acc_q)(&w, i0, nq, jb, nk, dSq);
        }
        FN(bw_store_kv)(a, &w, j0, nk, dka, dva);
    }
    FN(bw_store_q)(a, &w, 0, a->n_q);
}

static const attn_bw_kernels FN(bw_table) = {
    V_L, BW_PAIRS, FN(bw_pack), FN(bw_matrix), FN(bw_kv_block), FN(bw_q_block),
};

#undef BW_SCRATCH
#undef BW_PAIRS
#undef OP
#undef BW_BV
#undef BW_LOADB
#undef BW_SET1A
#undef BW_DOT
#undef HALF
#undef LOGF
#undef T
#undef ARGS
#undef BQ
#undef BK
#undef NEG_INF
#undef ATTN_IS_F64
#undef ATTN_KIND
#undef FN
