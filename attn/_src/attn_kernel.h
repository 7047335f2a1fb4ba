/* What Cython and C share: the operand descriptor, the tuning knobs, the
 * scratch layout and the type of the per-ISA dispatch table.
 *
 * attn/_attn_kernel.pxd declares it to Cython for both extensions. The
 * algorithm (FlashAttention-2's forward over one block of query rows, its
 * invariants) is written in attn/_kernels.pyx, which declares to Cython the
 * forward's own parts that this header and attn_simd.h define (the scratch
 * attn_ws, the dispatch table attn_kernels). The
 * C side (attn_simd*.h) holds only the micro-kernels Cython cannot express:
 * vector score and P.V tiles, the vector exp and the online-softmax update.
 */
#ifndef ATTN_KERNEL_H
#define ATTN_KERNEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ tuning knobs
 * Every constant the kernels' speed or work split depends on, once. Work is
 * split only as a function of the shape (never of the thread count or the
 * instruction set), so results are bitwise the same on 1 or n threads. */
enum {
    /* Query rows per block: larger blocks reuse each K/V tile more
       (single-thread sweeps BQ 32..128 x BK 32..256 on AVX-512). */
    ATTN_BQ = 128,
    /* Smallest block the scheduler shrinks to (for causal waste or to give
       every thread an item): below it the P.V tiles run mostly empty. */
    ATTN_BQ_MIN = 32,
    /* A sliding window of w keys: blocks of at most w / WINDOW_BLOCKS rows
       (a block of bq rows reads bq + w - 1 keys, w for each row). At w = 512,
       T = 8192 (python -m attn bench -k window): 64 rows, 0.16x the full
       causal call; 128 or 32 rows: 0.17x. Since the products of the window's
       edges are skipped (attn_rows_seeing), 64 and 128 rows ran alike
       (0.15x, within the noise of a shared machine). */
    ATTN_WINDOW_BLOCKS = 8,
    /* Keys per tile of a block of the rows layout (<= ATTN_DOT_MAX_Q rows:
       decode's dot products): the score rows and a V sub-block stay near L1. */
    ATTN_BK = 64,
    /* Keys per tile of a block on the register tiles (attn_key_tile): each
       tile's P V loads, rescales and stores O_i, and each runs the softmax's
       per-tile steps, which at 64 keys cost more than the L2 reads of a
       larger S. In-process alternating medians against 64 keys, 2 threads,
       Zen 4: prefill 2 x 1024 causal H32/8 E128 float32 0.95 (128 keys:
       0.97, 512: 0.95, 1024: 0.96), paged likewise (pages of 16/128/256:
       0.97/0.95/0.96), chunks of 256 rows over 512 keys 0.96; T1024 H8 E64
       causal float32 0.97, dense 0.97, float64 0.95, bfloat16 0.96, float16
       E128 0.98; T8192 window 512 0.965; a bool mask 0.95; capped AVX2 0.97-0.98;
       decode over vLLM's layout with 8 or 16 query heads a K/V head 0.92-0.94,
       FlashAttention's layout 1.01-1.02. */
    ATTN_BK_TILES = 256,
    /* Keys per tile of a block on AMX tiles (attn_key_tile): each P.V step
       loads and stores the block's O_i tiles, which at 64 keys cost more
       than the products they carry. T = 1024, H = 8, bfloat16 on the Xeon
       of docs/performance.md, 256 -> 512 keys: E = 64 2.66 -> 2.54 ms dense,
       1.84 -> 1.78 causal; E = 128 3.63 -> 3.54, 2.61 -> 2.43 (1024: as 512). */
    ATTN_BK_AMX = 512,
    /* An out of at least this many bytes is written by non-temporal stores
       (attn_problem.out_stream), where its rows fill whole cache lines: a
       store that misses the cache first reads the line it overwrites, and
       an output this large will not be read from the cache anyway. Prefill
       2 x 1024 causal H32/8 E128 float32 (32 MiB out), in-process medians
       against plain stores, Zen 4: 0.984 on 2 threads, 0.988 on 1. */
    ATTN_STREAM_OUT_BYTES = 4 << 20,
    /* Widest vector, in elements (AVX-512 float32): pads the scratch so one
       layout serves every instruction set. */
    ATTN_VL_MAX = 16,
    /* d_k >= 128: score tiles run query strips outermost, so a strip of the
       packed queries (64+ KiB in all) stays in L1 (1-9 % faster at 128). */
    ATTN_STRIPS_OUTER_DK = 128,
    /* Decode: blocks of <= 16 query rows (times the heads sharing a K/V
       head) against >= SPLIT_MIN_KEYS keys split the keys into chunks. */
    ATTN_SPLIT_MAX_Q = 16,
    /* Fewest keys per chunk: a chunk's partial state (m, l, O) costs about
       as much to merge as 64 keys cost to read. */
    ATTN_SPLIT_MIN_KEYS = 256,
    /* ... which only a call with few head groups takes: chunks are cut to
       ATTN_SPLIT_KEYS keys, smaller (down to SPLIT_MIN_KEYS) only until there
       are ATTN_SPLIT_ITEMS items to share out. Each item starts its stream of
       K/V rows cold (its first rows have no prefetch ahead of them, and its
       last ones' prefetches stop at its end): 16 decode rows over 1k-4k keys,
       H32/8 E128, float32 over pages of 128 (vLLM's layout), 2 threads,
       Zen 4, in-process alternating medians against chunks of 256 keys:
       1024 keys 0.92, 4096 0.94; bfloat16 0.97, float16 0.98; one sequence
       of 16k keys 0.96. */
    ATTN_SPLIT_KEYS = 1024,
    ATTN_SPLIT_ITEMS = 64,
    /* Chunk count cap: the merge reads n_chunks partial states per row. */
    ATTN_SPLIT_MAX_CHUNKS = 64,
    /* Decode over K/V rows holding several heads ([.., S, H_kv, E]): the
       most K/V heads one item reads together (each has its own scratch, a
       few hundred KiB of address space, mostly untouched). */
    ATTN_SPAN_MAX = 16,
    /* Smallest work worth another thread, in multiply-adds (~20-40 us on
       one core). attn's OpenMP threads sleep between calls (attn/_openmp_wait.py:
       spinning ones took the cores of the libraries around attn), so each
       parallel call first wakes them, tens of us when the cores are busy. */
    ATTN_GRAIN_FMA = 2000000,
    /* Decode streams K/V: another thread from 1 MiB of K/V per thread
       (~30 us of streaming on one core), for the same wake-up ... */
    ATTN_GRAIN_DECODE_BYTES = 1048576,
    /* ... or from 1M multiply-adds of the group's rows per thread (about
       60 us of one core's dot products): a GQA group's rows reuse each row
       read, and a 16-bit cache halves the bytes, not this work. H9/3 S2048
       E64 with a bfloat16 cache took 1 thread by its bytes: 76 us, 0.84x
       torch; 2 threads: 45 us. At 500k, H9/3 S1024 float32 took 2 threads
       too: 28 us quiet, but 1.09 ms beside a process busy on one core
       (bench/test_bench_interleaved.py), against 54 us on one thread. */
    ATTN_GRAIN_DECODE_FMA = 1000000,
    /* Decode reads K and V once, from memory when the cache is large: the dot
       path prefetches the K rows this many keys ahead and the V rows of the
       keys it scores (the P.V of the tile reads them next). */
    ATTN_PREFETCH_KEYS = 16,
    /* ... where it reads a paged cache in place, K's rows this many keys
       ahead into L2, as the V rows of the keys it scores (not into L1: with
       16 keys into L1, the prefetches waited for L1's miss buffers, and the
       decode read 17 GB/s of a 38 GB/s machine). 16 x ~2.1k keys of
       SmolLM2's heads, 30 layers' caches cycled, bfloat16, 2 threads, Zen 4,
       time over the L1 prefetches': K 16 keys ahead into L2 0.82, 32 0.72,
       64 0.75; then V into L2 as well 0.61-0.63 (without V's prefetch 0.77).
       Contiguous caches kept K's into L1 (into L2 took 1.03-1.06x). */
    ATTN_PREFETCH_PAGED_KEYS = 32,
    /* ... and scores the keys of a page in runs of as many as hold this many
       bytes of K's rows (a multiple of 4 keys from 4 to 16: float32 E128 4,
       16-bit E128 8, 16-bit E64 16), each run's prefetches just before its
       products. Runs of 4 keys, against 16: prefetches in bursts of 16 keys
       (128 lines of float32 E128, twice that with a prefetch of the same
       rows from L2 into L1 8 keys ahead) stalled on the miss buffers while
       no product ran. In-process alternating medians against runs of 16,
       16 decode rows over 1k-4k keys, H32/8 E128, vLLM's layout, 2 threads,
       Zen 4: float32 pages of 32/128/256 0.85/0.84/0.85, one 16k sequence
       0.80, bfloat16 0.95, float16 0.94; runs of 8: float32 0.93; runs of
       2: 1.09 (FN(qk_dot) computes four keys at a time). With runs of 4 the
       L1 prefetch (in since the last grids) cost more than it saved; without
       it: float32 0.98 (pages of 32 0.92, one 16k sequence 0.98, capped AVX2
       0.91), bfloat16 0.93, float16 0.98, SmolLM2's heads, 8 layers' caches
       cycled 0.98. K 16 or 64 keys ahead instead of 32: 1.03, 1.02. Then
       2 KiB a run against runs of 4 keys: SmolLM2's heads (E64) float16
       0.96, bfloat16 0.85, float32 0.93 (0.96, 0.96, 1.00 with 8 layers'
       caches cycled); H32/8 E128 16-bit 1.01-1.02 (1 KiB: float16 E64 0.98,
       bfloat16 0.89). */
    ATTN_PAGED_RUN_BYTES = 2048,
    /* ... and, where an item reads K/V rows of several heads (attn._kernels'
       _flash_heads, FN(heads_tile)), the keys each head's products take before
       the next head's: K's rows, then V's, are read in address order. */
    ATTN_HEADS_KEYS = 8,
    ATTN_HEADS_AHEAD = 8,
    /* A prefill over pages shorter than a key tile, or over strided key rows
       (FlashAttention's [S, H_kv, E]: attn._kernels' _pack_rows), reads each
       tile from a thread's copy of its matrix's keys (_Pack): at most this
       many bytes of K and V rows a thread (float32 E128: 4096 keys). With a
       copy per block and tile, prefill 2 x 1024 causal H32/8 E128 float32
       over pages of 16 (32) keys took 1.096x (1.098x) the contiguous call,
       with this copy 1.007x (1.009x) (paired, 2 threads, Zen 4). Debug
       builds keep 96 KiB, so that the suite's shorter sequences also start
       their copies afresh past its end (the bits are the same either way). */
#ifdef ATTN_DEBUG
    ATTN_PACK_MAX_BYTES = 98304,
#else
    ATTN_PACK_MAX_BYTES = 4194304,
#endif
    /* A float16 K/V's copy holds its rows widened to float32 (attn._kernels'
       _pack_wide) where a matrix's keys take at most this many bytes so (any
       build: a debug build's copy holds ATTN_PACK_MAX_BYTES and starts afresh). */
    ATTN_PACK_WIDE_MAX_BYTES = 4194304,
    /* Masked softmax: elements per thread, at least. */
    ATTN_GRAIN_SOFTMAX = 65536,
    /* Backward (attn_backward.h): query rows and keys per block, the same on
       every path and for any thread count (the order of every sum depends on
       these alone). */
    ATTN_BW_BQ = 64,
    ATTN_BW_BK = 64
};

/* Threads for `work` (in a grain's unit) when each must get at least `grain`
   of it: from 1 to max_threads (the forward, the backward, the softmax). */
static inline int attn_threads_for(double work, double grain, int max_threads)
{
    const double t = work / grain;
    return t < 1.0 ? 1 : t < (double)max_threads ? (int)t : max_threads;
}

/* Blocks of <= 4 query rows compute scores as dot products along d_k: the
   register tile would broadcast each K element for one useful lane. (A macro:
   the dot path's switch checks it with #if.) */
#define ATTN_DOT_MAX_Q 4
/* Such blocks keep S row-major ("rows" layout: s[i * ATTN_ROWS_LD + j]), so the
   softmax vectorizes along keys instead of running V_L-wide over 1-4 rows; one
   padding vector past ATTN_BK holds -inf up to the next vector boundary. */
#define ATTN_ROWS_LD (ATTN_BK + ATTN_VL_MAX)

/* Element kinds (the compute type T and the storage of K and V); macros, as
   the micro-kernel template selects on them with #if. */
#define ATTN_F32 0       /* float32 everything */
#define ATTN_F64 1       /* float64 everything */
#define ATTN_F32_KV16 2  /* float32 q/out/mask, float16 K and V widened in registers */
#define ATTN_F32_KVBF16 3 /* float32 q/out/mask, bfloat16 K and V widened in registers */
#define ATTN_F32_KVQ8 4   /* float32 q/out/mask, K and V in q8_0 rows (below), dequantized in registers */
#define ATTN_F32_KVE4M3 5 /* float32 q/out/mask, K and V in float8 e4m3fn (OCP FP8: no infinity,
                             0x7f/0xff NaN, largest finite 448), widened exactly in registers */
#define ATTN_F32_KVE5M2 6 /* float32 q/out/mask, K and V in float8 e5m2 (float16's top byte) */
#define ATTN_N_KINDS 7

/* A q8_0 row of d values (attn/_quantized.py, llama.cpp's q8_0 with a float32
   scale): d int8 values x_q, then ceil(d / 32) float32 scales, one per group
   of 32 values; value e is x_q[e] * scale[e / 32]. The operand's element is
   one int8 (s_col = 1, s_row = the row's bytes), so the scales of a row
   start d bytes past its value 0. */
#define ATTN_Q8_GROUP 32
static inline size_t attn_q8_row_bytes(int64_t d)
{
    return (size_t)d + 4 * (size_t)((d + ATTN_Q8_GROUP - 1) / ATTN_Q8_GROUP);
}

/* The problems that round their query to q8_0 on the paths with VNNI, in
   every block, and take integer dot products in blocks of <= ATTN_DOT_MAX_Q
   query rows (attn_simd_q8dot.h, attn_q8_rounds_query): q8_0 K, a decode plan
   (n_q <= ATTN_SPLIT_MAX_Q, no packed batch: attn._kernels' _plan) and d_k a
   multiple of 64 up to 512. */
#define ATTN_Q8_DOT_SHAPE(a) ((a)->kind == ATTN_F32_KVQ8 && (a)->n_q <= ATTN_SPLIT_MAX_Q \
                              && (a)->varlen == NULL && (a)->d_k % 64 == 0 && (a)->d_k <= 512)

/* Bytes of an element of a kind's compute type T (q, out, lse, weights, a
   float mask), and of its K and V as stored. */
static inline size_t attn_kind_size(int kind) { return kind == ATTN_F64 ? 8 : 4; }
static inline size_t attn_kind_kv_size(int kind)
{
    return kind == ATTN_F32_KVQ8 || kind == ATTN_F32_KVE4M3 || kind == ATTN_F32_KVE5M2 ? 1
        : kind == ATTN_F32_KV16 || kind == ATTN_F32_KVBF16 ? 2 : attn_kind_size(kind);
}

enum {
    ATTN_MASK_NONE = 0,
    ATTN_MASK_BOOL = 1, /* uint8, nonzero = takes part */
    ATTN_MASK_ADD = 2   /* of the compute type, added to the scaled scores */
};

/* ------------------------------------------------------ operand descriptor
 * One operand of a batched call: matrix b (b < n_batch) has element [i, j] at
 * base + (offsets[b] + i * s_row + j * s_col) * itemsize. Broadcast dims give
 * stride 0 / repeated offsets; any sign. */
typedef struct {
    const char *base;
    const int64_t *offsets;   /* [n_batch] */
    int64_t s_row, s_col;
    const char *lo, *hi;      /* debug builds: the array's byte extent [lo, hi) */
} attn_operand;

/* One attention call: out[b] = softmax(scale q[b] k[b]^T + mask[b]) v[b]. */
typedef struct {
    attn_operand q, k, v, mask;
    char *out;       /* C-contiguous [n_batch, n_q, d_v] */
    char *weights;   /* C-contiguous [n_batch, n_q, n_k], or NULL */
    char *lse;       /* C-contiguous [n_batch, n_q], or NULL: m_i + log(l_i) */
    int64_t n_batch, n_q, n_k, d_k, d_v;
    int kind;        /* ATTN_F32 / ATTN_F64 / ATTN_F32_KV16 / ATTN_F32_KVBF16 / ATTN_F32_KVQ8 /
                        ATTN_F32_KVE4M3 / ATTN_F32_KVE5M2 */
    int mask_kind;
    int causal;      /* key j visible to row i iff j <= i + causal_offset */
    int64_t causal_offset;
    double scale;
    /* The variants (attn/_variants.py), all off when zero / NULL:
       window: key j visible to row i only if i + win_lo <= j <= i + win_hi;
       softcap > 0: a scaled score s becomes softcap * tanh(s / softcap);
       alibi: [n_batch] slopes (double), adding -slope |i + alibi_offset - j|
       after the cap (before the mask);
       sinks: [n_batch] logits (double), one per matrix, joining each row's
       softmax sum at the end (attn_sink_join): out and lse include them. */
    int window;
    int64_t win_lo, win_hi;
    double softcap;
    const double *alibi;
    int64_t alibi_offset;
    const double *sinks;
    /* Packed variable-length batches (attn.varlen_attention), or NULL. For
       matrix b: varlen[b] and varlen[n_batch + b] are its n_q and n_k (the
       n_q, n_k above are the largest), varlen[2 n_batch + b] the shift added
       to its causal, window and ALiBi offsets, varlen[3 n_batch + b] and
       varlen[4 n_batch + b] the element offsets of its row 0 in out (rows
       out_rs elements apart) and in lse (rows contiguous). The backward
       keeps its uniform [n_batch, n_q, .] outputs and reads rows < n_q(b). */
    const int64_t *varlen;
    int64_t out_rs;
    /* q holds bfloat16 values (the caller's query was bfloat16, widened
       exactly): the avx512-bf16 path may then run Q.K^T and P.V as bfloat16
       dot products (vdpbf16ps), as torch's bfloat16 SDPA does; over a float8
       e4m3 cache (kind ATTN_F32_KVE4M3) its decode rows (attn_simd_e4m3dot.h);
       0 otherwise. */
    int q_bf16;
    /* q's elements are stored as 16-bit floats of K and V's own type (2 bytes
       each, offsets and strides in elements), read as they are (FN(load_q),
       FN(q_elem)), not a float32 copy: bfloat16 (with q_bf16) over kind
       ATTN_F32_KVBF16, float16 over kind ATTN_F32_KV16; 0: q is of type T. */
    int q_raw16;
    /* out holds 16-bit floats (float32 compute kinds only): ATTN_OUT_BF16
       bfloat16, ATTN_OUT_F16 float16; finish rounds each output row once
       (attn_narrow16) as it writes it; out's element offsets and out_rs count
       16-bit elements. 0: out is of type T. */
    int out16;
    /* 1: finish writes out's rows by non-temporal stores (V_STREAM) where a
       row starts on a cache line and fills whole lines (out of at least
       ATTN_STREAM_OUT_BYTES; attn._problem.build); 0: plain stores. */
    int out_stream;
    /* A paged K and V (FlashAttention's block_table), or pages == NULL. Key
       row j of matrix b is row j % page_size of page
       pg = pages[page_rows[b] + j / page_size]: its element e sits at
       base + (offsets[b] + pg * k_page + (j % page_size) * s_row + e * s_col)
       elements of operand k (v alike, with v_page). The caller checked every
       entry a matrix reads; the kernels see one page's rows at a time
       (attn._kernels' _flash_block cuts key tiles at page ends). */
    const int32_t *pages;
    const int64_t *page_rows;
    int64_t page_size, k_page, v_page;
    /* Per-matrix key lengths (flash_attn_with_kvcache's cache_seqlens), or
       NULL: matrix b sees keys [0, kv_len[b]) only (n_k above is the
       largest), and its causal, window and ALiBi offsets are shifted by
       kv_len[b] - n_k, so that each aligns to its own last key. */
    const int64_t *kv_len;
} attn_problem;

/* y[i] = x[i] rounded to bfloat16, to nearest even (ml_dtypes' and torch's
 * rule); a NaN becomes the quiet NaN 0x7fc0 with its sign (as ml_dtypes
 * gives). A select, not a branch, so that it vectorizes where inlined. */
static inline void attn_narrow_bf16(const float *x, uint16_t *y, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        y[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) & 0x8000u) | 0x7fc0u
                                                          : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* y[i] = x[i] rounded to float16, to nearest even: IEEE's conversion, as
 * F16C's vcvtps2ph gives it (attn_f16c_run, numpy's casts): overflow to inf
 * (from 65520 up: the tie goes to the even inf), subnormals kept, a NaN quiet
 * with its sign and its payload's top bits. */
static inline uint16_t attn_float_to_half(float f)
{
    uint32_t u, a, sign, e, m, sh, q, rem, half;
    memcpy(&u, &f, 4);
    sign = (u >> 16) & 0x8000u;
    a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));   /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                          /* inf */
    if (a >= 0x38800000u) {                                                           /* normal */
        a -= 0x38000000u;                                  /* exponent bias 127 -> 15 */
        return (uint16_t)(sign | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) return (uint16_t)sign;           /* <= 2^-25: 0 (the tie to even) */
    e = a >> 23;                                           /* 102..112: a subnormal half */
    m = (a & 0x7fffffu) | 0x800000u;
    sh = 126u - e;                                         /* f = m 2^(e - 150) = (m >> sh) 2^-24 */
    q = m >> sh;
    rem = m & ((1u << sh) - 1u);
    half = 1u << (sh - 1u);
    q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
    return (uint16_t)(sign | q);
}

#define ATTN_OUT_BF16 1  /* attn_problem.out16: a bfloat16 out */
#define ATTN_OUT_F16 2   /* attn_problem.out16: a float16 out */

/* y[i] = x[i] rounded to the 16-bit out's type (attn_problem.out16, not 0). */
static inline void attn_narrow16(const float *x, uint16_t *y, ptrdiff_t n, int out16)
{
    ptrdiff_t i;
    if (out16 == ATTN_OUT_BF16) {
        attn_narrow_bf16(x, y, n);
        return;
    }
    for (i = 0; i < n; i++) y[i] = attn_float_to_half(x[i]);
}

/* The same for whole arrays (attn._casts.cast_bf16): compiled for AVX-512
 * and AVX2 too where the toolchain picks among versions at load time (the
 * baseline x86-64 version ran at half the memory's pace). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default"), unused)) static
#else
static inline
#endif
void attn_narrow_bf16_array(const float *x, uint16_t *y, int64_t n)
{
    attn_narrow_bf16(x, y, (ptrdiff_t)n);
}

/* float16 <-> float32 of whole arrays (attn._casts.cast_f16) by the F16C
 * instructions, IEEE's conversions: widening exact, narrowing to nearest
 * even, overflow to inf, subnormals kept, NaN quiet with its sign (numpy's
 * scalar loop takes about 1 ns an element, as long as a small attention
 * call itself). 0 when the CPU has no F16C (the caller converts otherwise). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx,f16c"), unused)) static void attn_f16c_run(const void *x, void *y, int64_t n, int narrow)
{
    int64_t i = 0;
    if (narrow) {
        const float *f = (const float *)x;
        uint16_t *h = (uint16_t *)y;
        float tail[8] = {0};
        uint16_t out[8];
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(void *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
        if (i < n) {
            memcpy(tail, f + i, (size_t)(n - i) * sizeof(float));
            _mm_storeu_si128((__m128i *)(void *)out, _mm256_cvtps_ph(_mm256_loadu_ps(tail), _MM_FROUND_TO_NEAREST_INT));
            memcpy(h + i, out, (size_t)(n - i) * sizeof(uint16_t));
        }
    } else {
        const uint16_t *h = (const uint16_t *)x;
        float *f = (float *)y;
        uint16_t tail[8] = {0};
        float out[8];
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(h + i))));
        if (i < n) {
            memcpy(tail, h + i, (size_t)(n - i) * sizeof(uint16_t));
            _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)tail)));
            memcpy(f + i, out, (size_t)(n - i) * sizeof(float));
        }
    }
}

static inline int attn_f16_array(const void *x, void *y, int64_t n, int narrow)
{
    if (!__builtin_cpu_supports("f16c")) return 0;
    attn_f16c_run(x, y, n, narrow);
    return 1;
}

static inline int attn_has_f16c(void) { return __builtin_cpu_supports("f16c") != 0; }
#else
static inline int attn_f16_array(const void *x, void *y, int64_t n, int narrow)
{
    (void)x; (void)y; (void)n; (void)narrow;
    return 0;
}

static inline int attn_has_f16c(void) { return 0; }
#endif

/* V's rows as the AMX tiles read them (FN(pack_v_pairs)'s layout: pair row r
 * holds keys p0 + 2r and p0 + 2r + 1, d_v + 16 words apart), for the keys
 * [p0, hi) of one thread's copy of a matrix's keys (attn._kernels' _Pack,
 * which holds it and resets it with the copy): packed by the first tile that
 * reads them, then read by every later tile, block and query head of the same
 * keys in the call, where each packed its own. hi - p0 stays even; room for
 * cap keys. */
typedef struct {
    uint32_t *rows;
    int64_t p0, hi, cap;
} attn_vpairs;

/* ---------------------------------------------------------------- scratch
 * Per-thread working set of one block of query rows (the FlashAttention
 * state m, l, O and its tiles). attn_ws_layout() is the only place that
 * knows the layout. The block fields describe the rows being computed. */
typedef struct {
    void *qt;     /* scale * Q_i packed: [d_k][ld] transposed, or [nq][d_k] (dot path) */
    void *s;      /* [BK][ld] scores S_ij, then P_ij, key-major */
    void *mt;     /* [BK][ld] mask tile, key-major */
    void *acc;    /* [BQ][d_v] O_i, unnormalized */
    void *m;      /* [ld] running row max m_i */
    void *l;      /* [ld] running row sum l_i */
    void *alpha;  /* [ld] rescale of this key tile, exp(m_old - m_new) */
    void *kpack;  /* [BK][d_k + VL_MAX] K tile widened (16-bit or q8_0 K, register-tile path) */
    void *vpack;  /* [BK][d_v + VL_MAX] V tile copied / widened */
    /* the current block, set by the caller before begin() */
    const char *k, *v, *mask;  /* matrix b's element [0, 0] of K, V, mask */
    int64_t i0;         /* first query row (for causal and mask rows) */
    int64_t m_rs;       /* mask row stride for this block (0: one row for all) */
    int causal;         /* apply the diagonal inside tiles */
    /* set by begin(): rows, rows padded to the vector width, leading dim */
    int64_t nq, bqp, ld;
    /* the variants of this block (set with i0): apply the window inside
       tiles; the ALiBi slope of its matrix (0: none) */
    int window;
    double alibi_slope;
    /* the sinks of the block's rows (NULL: none): row i's is sinks[i / sink_rows]
       (one matrix, or several heads of sink_rows rows each) */
    const double *sinks;
    int64_t sink_rows;
    /* set by begin(): 0, or the block runs on AMX tiles (avx512-amx), its
       softmax writing P as A tiles; 2: P also kept in float32 in s, for the
       columns of V past the last 16 */
    int amx;
    /* set by begin() for a block on AMX or vdpbf16ps tiles: the factor its
       softmax applies to S, scale when the products (FN(qk_amx),
       FN(qk_bf16)) left S unscaled (nothing between the two reads the scaled
       values: no additive mask, cap, ALiBi or weights; scale > 0, so the
       row max commutes with it), else 1 */
    float s_scale;
    /* set by begin() for a block on the vdpbf16ps tiles (avx512-bf16, not
       AMX, no weights): 1 when its softmax writes P as FN(pv_bf16)'s
       bfloat16 pairs as it computes it (FN(online_softmax_pairs)); 2: P also
       kept in float32 in s, for the columns of V past the last 16; else 0 */
    int p_pairs;
    /* set by begin(): 1 when the block's scores come from FN(qk_dot_q8)
       (the avx512-vnni instance of q8_0, ATTN_Q8_DOT_SHAPE, <= ATTN_DOT_MAX_Q rows) */
    int q8_dot;
    /* set by begin(): 1 when the block's scores come from FN(qk_dot_bf16_4) (the
       avx512-bf16 and avx512-amx instances of a bfloat16 query over a bfloat16 K,
       ATTN_BF16_DOT_SHAPE, <= ATTN_DOT_MAX_Q rows, contiguous key rows) */
    int bf16_dot;
    /* A block of <= ATTN_DOT_MAX_Q rows over a paged cache reads its K and V
       rows in place through its matrix's page list (attn._kernels'
       _flash_block): pages = a->pages + a->page_rows[b], and key row j's
       element 0 is at k + (pages[j / page_size] * k_page + (j % page_size)
       * s_row) elements (v alike, v_page), k and v being matrix b's element
       [0, 0] of page 0. NULL: row j at k + j * s_row. Keys below kv_end
       only are read (the block's end, set for every block: the page list is
       checked that far, and P V's prefetch of V stops there). */
    const int32_t *pages;
    int64_t kv_end;
    /* such a block, paged or not: the keys below which V's rows were
       prefetched (P V prefetches the V rows of keys a tile further on, FN(pv);
       the scores prefetch the others as they go); 0 at the block's start */
    int64_t v_pf_end;
    /* A block on AMX tiles whose keys come from the thread's copy of its
       matrix's keys (attn._kernels' _Pack): that copy's V pairs (NULL: none;
       each tile then packs its own into vpack). */
    attn_vpairs *vpairs;
    /* A block of the register tiles over a 16-bit K/V whose keys come from the
       thread's copy widened to T (attn._kernels' _Pack, `wide`): key j's K row
       at kwide + j (d_k + ATTN_VL_MAX), its V row at vwide + j (d_v +
       ATTN_VL_MAX), as FN(pack_tile) would widen them into kpack and vpack (the
       tiles read them there instead); NULL: none. */
    const void *kwide, *vwide;
} attn_ws;

static inline int64_t attn_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Which entries of a block's tile can be visible (a window's edges, the causal
 * diagonal): rows [*r0, *r1) of the block that see some key of keys [j0, j1)
 * of the tile starting at kb, and keys [*k0, *k1) of that tile that rows
 * [r0, r1) see. Products of the other entries are skipped: the masks write
 * -inf over their scores, and their P (exp(-inf) = 0) adds nothing to P V.
 * Empty ranges come back as r0 == r1 or k0 == k1. */
static inline void attn_rows_seeing(const attn_problem *a, const attn_ws *ws, int64_t kb,
                                    ptrdiff_t j0, ptrdiff_t j1, ptrdiff_t *r0, ptrdiff_t *r1)
{
    /* key kb + j, row i0 + i: causal needs j <= i + off, the window i + lo <= j <= i + hi */
    const int64_t first = kb + j0 - ws->i0, last = kb + j1 - 1 - ws->i0;
    int64_t lo = 0, hi = ws->nq;
    if (ws->causal && first - a->causal_offset > lo) lo = first - a->causal_offset;
    if (ws->window) {
        if (first - a->win_hi > lo) lo = first - a->win_hi;
        if (last - a->win_lo + 1 < hi) hi = last - a->win_lo + 1;
    }
    if (hi < lo) hi = lo;
    *r0 = (ptrdiff_t)lo; *r1 = (ptrdiff_t)hi;
}

static inline void attn_keys_seen(const attn_problem *a, const attn_ws *ws, int64_t kb, int64_t nk,
                                  ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t *k0, ptrdiff_t *k1)
{
    const int64_t first = ws->i0 + r0 - kb, last = ws->i0 + r1 - 1 - kb;
    int64_t lo = 0, hi = nk;
    if (ws->causal && last + a->causal_offset + 1 < hi) hi = last + a->causal_offset + 1;
    if (ws->window) {
        if (first + a->win_lo > lo) lo = first + a->win_lo;
        if (last + a->win_hi + 1 < hi) hi = last + a->win_hi + 1;
    }
    if (lo > nk) lo = nk;
    if (hi < lo) hi = lo;
    *k0 = (ptrdiff_t)lo; *k1 = (ptrdiff_t)hi;
}

/* A block of nq query rows of problem a whose products the avx512-amx path
 * runs on AMX tiles (attn_simd_bf16dot.h): bfloat16 queries over a bfloat16
 * K, V or a float8 e4m3 one (looked up as bfloat16 into the packs) in the
 * register-tile layout, d_k filling a tile row (32 bfloat16) and d_v a
 * tile's 16 columns. */
static inline int attn_amx_shape(const attn_problem *a, int64_t nq)
{
    return (a->kind == ATTN_F32_KVBF16 || a->kind == ATTN_F32_KVE4M3) && a->q_bf16 && nq > ATTN_DOT_MAX_Q
           && a->d_k >= 32 && a->d_v >= 16;
}

/* nbytes of heap, 64-byte aligned (the micro-kernels' loads are unaligned:
 * this only keeps vectors from splitting cache lines), or NULL when out of
 * memory; freed by attn_aligned_free (the raw pointer sits just before it). */
static inline void *attn_aligned_alloc(size_t nbytes)
{
    char *raw = (char *)malloc(nbytes + 64 + sizeof(void *));
    uintptr_t addr;
    if (raw == NULL) return NULL;
    addr = ((uintptr_t)(raw + sizeof(void *)) + 63) & ~(uintptr_t)63;
    ((void **)addr)[-1] = raw;
    return (void *)addr;
}

static inline void attn_aligned_free(void *p)
{
    if (p != NULL) free(((void **)p)[-1]);
}


/* Sinks (attn/_variants.py): the sink logit s joins a row's softmax sum. The
 * row's running max m and sum l (of exp(score - m)) become m' = max(m, s) and
 * l' = l exp(m - m') + exp(s - m'); returns the factor exp(m - m') its
 * unnormalized output takes before the division by l'. A row that saw
 * nothing (l = 0: output 0, its lse is s) or NaN is left alone (factor 1). */
static inline double attn_sink_join(double *m, double *l, double s)
{
    double mn, f;
    if (!(*l > 0)) return 1;
    mn = *m > s ? *m : s;
    f = exp(*m - mn);
    *l = *l * f + exp(s - mn);
    *m = mn;
    return f;
}

/* A block of memory kept from one call for the next: a fresh block of more
 * than glibc's mmap threshold is mapped anew on every call (a freed large
 * block goes back to the system), so every page faults on first touch, which
 * on a virtual machine costs more than writing the page. One block of up to
 * `max` bytes is kept per attn_kept; a call that finds it in use (another
 * thread's call) or needs more than `max` allocates its own. Blocks are
 * 64-byte aligned (attn_aligned_alloc); the kept one lives until exit. */
typedef struct {
    void *block;
    size_t size;
    int busy;     /* taken with an atomic exchange */
} attn_kept;

static inline void *attn_kept_take(attn_kept *k, size_t nbytes, size_t max)
{
    if (nbytes <= max && __atomic_exchange_n(&k->busy, 1, __ATOMIC_ACQUIRE) == 0) {
        if (k->size < nbytes) {  /* (the holder alone changes the block) */
            attn_aligned_free(k->block);
            k->block = attn_aligned_alloc(nbytes);
            k->size = k->block == NULL ? 0 : nbytes;
        }
        if (k->block != NULL) return k->block;
        __atomic_store_n(&k->busy, 0, __ATOMIC_RELEASE);
        return NULL;
    }
    return attn_aligned_alloc(nbytes);
}

static inline void attn_kept_give(attn_kept *k, void *p)
{
    if (p != NULL && p == k->block)
        __atomic_store_n(&k->busy, 0, __ATOMIC_RELEASE);
    else
        attn_aligned_free(p);
}

/* The next item of a work queue shared by a parallel region's threads
 * (attn/_kernels.pyx, _Queue): *next, then *next + 1, atomically. */
static inline int64_t attn_take(int64_t *next)
{
    return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
}

/* The split-key decode's partial states (attn/_kernels.pyx): a few hundred
 * KiB to MiBs per call at long contexts (H32/8 S16384 E128: 1 MiB, whose
 * page faults were 13 % of a call on a virtual machine). */
#define ATTN_PARTS_KEEP_MAX ((size_t)16 << 20)
static inline attn_kept *attn_parts_kept(void)
{
    static attn_kept kept;
    return &kept;
}

/* Bytes of scratch for d_k, d_v and key tiles of up to bk keys; with
 * base != NULL also points ws's regions into base (64-byte aligned if base is). */
static inline size_t attn_ws_layout(attn_ws *ws, char *base, size_t itemsize,
                                    int64_t d_k, int64_t d_v, int64_t bk)
{
    const int64_t ld_max = ATTN_BQ + ATTN_VL_MAX;  /* bqp <= BQ (a multiple of every V_L) */
    int64_t off = 0;
#define ATTN_CARVE(field, n) do {                                         \
        if (base != NULL) ws->field = base + (size_t)off * itemsize;       \
        off += attn_round_up((n), ATTN_VL_MAX);                           \
    } while (0)
    ATTN_CARVE(qt, ld_max * d_k);
    ATTN_CARVE(s, bk * ld_max);  /* >= ATTN_DOT_MAX_Q * ATTN_ROWS_LD */
    ATTN_CARVE(mt, bk * ld_max);
    ATTN_CARVE(acc, (int64_t)ATTN_BQ * d_v);
    ATTN_CARVE(m, ld_max);
    ATTN_CARVE(l, ld_max);
    ATTN_CARVE(alpha, ld_max);
    ATTN_CARVE(kpack, bk * (d_k + ATTN_VL_MAX));
    ATTN_CARVE(vpack, bk * (d_v + ATTN_VL_MAX));
#undef ATTN_CARVE
    if (base != NULL) {
        ws->pages = NULL;
        ws->vpairs = NULL;
        ws->kwide = ws->vwide = NULL;
    }
    return (size_t)off * itemsize;
}

/* Elements of one split-key partial state of nq rows: m [nq], l [nq], O [nq][d_v]. */
static inline int64_t attn_part_elems(int64_t nq, int64_t d_v) { return 2 * nq + nq * d_v; }

/* ------------------------------------------------------- dispatch table
 * The micro-kernels of one (instruction set, element kind). Pointers are to
 * the compute type T of the kind (float or double) unless noted. */
typedef struct {
    /* m_i = -inf, l_i = 0, O_i = 0 for nq rows; padding of the packed Q */
    void (*begin)(const attn_problem *a, attn_ws *ws, int64_t nq);
    /* pack scale * q rows [0, n) (q at row 0 of them) as block rows [row0, row0 + n) */
    void (*load_q)(const attn_problem *a, attn_ws *ws, const char *q, int64_t n, int64_t row0);
    /* S = scale Q_i K_j^T (+ mask) for keys [kb, kb + nk); invisible -> -inf */
    void (*scores)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk);
    /* m_new = max(m_i, rowmax S); alpha = exp(m_i - m_new); P = exp(S - m_new);
       l_i = alpha l_i + rowsum P; m_i = m_new */
    void (*online_softmax)(attn_ws *ws, int64_t nk);
    /* O_i = diag(alpha) O_i + P V_j for keys [kb, kb + nk) */
    void (*pv)(const attn_problem *a, attn_ws *ws, int64_t kb, int64_t nk);
    /* out row r (stride o_rs) = O_i[r] / l_i[r] (0 if l = 0); lse[r] = m + log l */
    void (*finish)(const attn_problem *a, attn_ws *ws, void *out, int64_t o_rs, void *lse);
    /* the unnormalized state (m, l, O) into part (attn_part_elems) */
    void (*save_part)(const attn_problem *a, attn_ws *ws, void *part);
    /* w[r][j] = exp(S[j][r] - m_r) / l_r for the nk keys just scored (final m, l) */
    void (*weights)(attn_ws *ws, int64_t nk, void *w, int64_t w_rs);
    /* merge n_chunks partial states in chunk order into out rows and lse */
    void (*merge)(const void *parts, int64_t n_chunks, int64_t nq, int64_t d_v,
                  void *out, int64_t o_rs, void *lse, const double *sinks, int64_t sink_rows);
    /* softmax of one row of n (x stride xs, mask of kind, stride ms) */
    void (*softmax_row)(const void *x, int64_t xs, const void *mask, int kind, int64_t ms,
                        void *out, int64_t n);
    /* one key tile, keys [kb, kb + nk), of n blocks of <= ATTN_DOT_MAX_Q rows
       whose K/V heads lie side by side in every key row (scratch u at ws +
       u * ws_bytes): scores, online_softmax and pv of each, the reads in
       address order (prefetching rows of keys below end) */
    void (*heads_tile)(const attn_problem *a, attn_ws *ws, int64_t ws_bytes, int64_t n, int64_t kb, int64_t nk,
                       int64_t end);
    /* rows [0, nk) of n values (rs elements apart, each contiguous) of K or V
       as stored, widened to T into dst (rows ldp apart): FN(pack_tile) */
    void (*widen_rows)(const void *x, int64_t rs, int64_t nk, int64_t n, void *dst, int64_t ldp);
} attn_kernels;

#endif /* ATTN_KERNEL_H */
