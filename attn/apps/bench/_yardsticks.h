/* The benchmark's yardsticks (attn/apps/bench/_yardsticks.pyx): the multiply-add
 * peak of each instruction-set path and the DRAM read bandwidth.
 *
 * The multiply-add throughput of the running core on each instruction-set
 * path: the benchmark's second yardstick (python -m attn bench prints each
 * group's GFLOP/s as a share of a GEMM measured in the same run and of this
 * peak). A GEMM's rate depends on the BLAS and its size (NumPy's OpenBLAS ran
 * at half a Zen 5's FMA peak), this one only on the core: ATTN_PEAK_CHAINS
 * independent chains acc = acc * x + y in vector registers, no memory
 * traffic, so the loop runs at the FMA ports' rate (two ports of 256 or 512
 * bits on the CPUs attn meets; 12 chains cover a 4-cycle latency on both).
 *
 * attn_fma_peak(path, dtype, iters) runs iters rounds on the calling thread
 * and returns the flops done (2 per lane per multiply-add; bfloat16: one
 * vdpbf16ps is 2 products and 2 sums per float32 lane); dtype 0 float32,
 * 1 float64, 2 bfloat16 products (avx512-bf16 and amx paths only; 0 flops
 * elsewhere), 3 bfloat16 products on AMX tiles (the amx path only). The
 * generic path is what the compiler makes of 16-byte vectors (SSE2 on
 * x86-64: a multiply and an add, no FMA). */
#ifndef ATTN_YARDSTICKS_H
#define ATTN_YARDSTICKS_H

#include <stdint.h>

#include "attn_dispatch.h"

#define ATTN_PEAK_CHAINS 12

/* The x, y of the chains come from a volatile so that nothing is folded; |x| < 1
   keeps every chain bounded. The sum of the chains is stored to a volatile. */
static volatile float attn_peak_f32_in[2] = {0.999999f, 1e-6f};
static volatile double attn_peak_f64_in[2] = {0.999999, 1e-6};
static volatile double attn_peak_sink;

#if ATTN_GVEC
typedef float attn_peak_v4f __attribute__((vector_size(16)));
typedef double attn_peak_v2d __attribute__((vector_size(16)));

#define ATTN_PEAK_LOOP(T, x, y, one)                                     \
    T c[ATTN_PEAK_CHAINS];                                               \
    int j;                                                               \
    int64_t i;                                                           \
    for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = (one);                  \
    for (i = 0; i < iters; i++)                                          \
        for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = c[j] * (x) + (y); \
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] += c[j];

static double attn_peak_generic_f32(int64_t iters)
{
    const attn_peak_v4f x = {attn_peak_f32_in[0], attn_peak_f32_in[0], attn_peak_f32_in[0], attn_peak_f32_in[0]};
    const attn_peak_v4f y = {attn_peak_f32_in[1], attn_peak_f32_in[1], attn_peak_f32_in[1], attn_peak_f32_in[1]};
    const attn_peak_v4f one = {1.0f, 1.0f, 1.0f, 1.0f};
    ATTN_PEAK_LOOP(attn_peak_v4f, x, y, one)
    attn_peak_sink = (double)c[0][0];
    return 2.0 * 4 * ATTN_PEAK_CHAINS * (double)iters;
}

static double attn_peak_generic_f64(int64_t iters)
{
    const attn_peak_v2d x = {attn_peak_f64_in[0], attn_peak_f64_in[0]};
    const attn_peak_v2d y = {attn_peak_f64_in[1], attn_peak_f64_in[1]};
    const attn_peak_v2d one = {1.0, 1.0};
    ATTN_PEAK_LOOP(attn_peak_v2d, x, y, one)
    attn_peak_sink = c[0][0];
    return 2.0 * 2 * ATTN_PEAK_CHAINS * (double)iters;
}
#else
static double attn_peak_generic_f32(int64_t iters)
{
    float c[ATTN_PEAK_CHAINS], x = attn_peak_f32_in[0], y = attn_peak_f32_in[1];
    int j;
    int64_t i;
    for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = (float)j;
    for (i = 0; i < iters; i++)
        for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = c[j] * x + y;
    attn_peak_sink = c[0] + c[ATTN_PEAK_CHAINS - 1];
    return 2.0 * ATTN_PEAK_CHAINS * (double)iters;
}

static double attn_peak_generic_f64(int64_t iters)
{
    double c[ATTN_PEAK_CHAINS], x = attn_peak_f64_in[0], y = attn_peak_f64_in[1];
    int j;
    int64_t i;
    for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = (double)j;
    for (i = 0; i < iters; i++)
        for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = c[j] * x + y;
    attn_peak_sink = c[0] + c[ATTN_PEAK_CHAINS - 1];
    return 2.0 * ATTN_PEAK_CHAINS * (double)iters;
}
#endif

#if ATTN_X86_DISPATCH
/* One explicit FMA chain loop per vector type; the intrinsics keep each
   multiply-add one instruction (the compiler may not contract c * x + y on
   its own). */
#define ATTN_PEAK_FMA(T, fma, set1, x, y, first)                          \
    T c[ATTN_PEAK_CHAINS];                                                \
    const T vx = set1(x), vy = set1(y);                                   \
    int j;                                                                \
    int64_t i;                                                            \
    for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = set1((first) * j);      \
    for (i = 0; i < iters; i++)                                           \
        for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = fma(c[j], vx, vy);

static __attribute__((target("avx2,fma"))) double attn_peak_avx2_f32(int64_t iters)
{
    ATTN_PEAK_FMA(__m256, _mm256_fmadd_ps, _mm256_set1_ps, attn_peak_f32_in[0], attn_peak_f32_in[1], 1.0f)
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] = _mm256_add_ps(c[0], c[j]);
    attn_peak_sink = (double)_mm256_cvtss_f32(c[0]);
    return 2.0 * 8 * ATTN_PEAK_CHAINS * (double)iters;
}

static __attribute__((target("avx2,fma"))) double attn_peak_avx2_f64(int64_t iters)
{
    ATTN_PEAK_FMA(__m256d, _mm256_fmadd_pd, _mm256_set1_pd, attn_peak_f64_in[0], attn_peak_f64_in[1], 1.0)
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] = _mm256_add_pd(c[0], c[j]);
    attn_peak_sink = _mm256_cvtsd_f64(c[0]);
    return 2.0 * 4 * ATTN_PEAK_CHAINS * (double)iters;
}

static __attribute__((target("avx512f"))) double attn_peak_avx512_f32(int64_t iters)
{
    ATTN_PEAK_FMA(__m512, _mm512_fmadd_ps, _mm512_set1_ps, attn_peak_f32_in[0], attn_peak_f32_in[1], 1.0f)
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] = _mm512_add_ps(c[0], c[j]);
    attn_peak_sink = (double)_mm512_reduce_add_ps(c[0]);
    return 2.0 * 16 * ATTN_PEAK_CHAINS * (double)iters;
}

static __attribute__((target("avx512f"))) double attn_peak_avx512_f64(int64_t iters)
{
    ATTN_PEAK_FMA(__m512d, _mm512_fmadd_pd, _mm512_set1_pd, attn_peak_f64_in[0], attn_peak_f64_in[1], 1.0)
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] = _mm512_add_pd(c[0], c[j]);
    attn_peak_sink = _mm512_reduce_add_pd(c[0]);
    return 2.0 * 8 * ATTN_PEAK_CHAINS * (double)iters;
}

/* vdpbf16ps: each float32 lane gains a pair of bfloat16 products (4 flops) */
static __attribute__((target("avx512f,avx512bw,avx512bf16"))) double attn_peak_avx512_bf16(int64_t iters)
{
    __m512 c[ATTN_PEAK_CHAINS];
    const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_set1_ps(attn_peak_f32_in[1]),
                                                       _mm512_set1_ps(attn_peak_f32_in[1]));
    int j;
    int64_t i;
    for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = _mm512_set1_ps((float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < ATTN_PEAK_CHAINS; j++) c[j] = _mm512_dpbf16_ps(c[j], (__m512bh)pairs, (__m512bh)pairs);
    for (j = 1; j < ATTN_PEAK_CHAINS; j++) c[0] = _mm512_add_ps(c[0], c[j]);
    attn_peak_sink = (double)_mm512_reduce_add_ps(c[0]);
    return 4.0 * 16 * ATTN_PEAK_CHAINS * (double)iters;
}

/* AMX tiles (the avx512-amx path only): tdpbf16ps multiplies a 16 x 32 bfloat16 A tile by a
 * 32 x 16 B tile (as 16 rows of pairs) into a 16 x 16 float32 C tile, 16 * 16 * 32 products and as
 * many sums (16384 flops). Four C tiles (0-3) from two A (4-5) and two B (6-7), the products attn's
 * FN(amx_tiles) issues per step: four independent chains cover the instruction's latency. The tile
 * data permission was asked for when the path was chosen (attn_amx_usable); this thread's tile
 * configuration is its own, the kernel's (attn_amx_config_16x64), released at the end. */
static __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16"))) double attn_peak_amx_bf16(int64_t iters)
{
    uint16_t ab[16 * 32];
    float c[16 * 16];
    const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_set1_ps(attn_peak_f32_in[1]),
                                                       _mm512_set1_ps(attn_peak_f32_in[1]));
    int t;
    int64_t i;
    for (t = 0; t < 16; t++) _mm512_storeu_si512(ab + 32 * t, pairs);
    attn_amx_config_16x64();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, ab, 64); _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64); _tile_loadd(7, ab, 64);
    for (i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    attn_peak_sink = (double)c[0];
    _tile_stored(3, c, 64);
    attn_peak_sink += (double)c[255];
    _tile_release();
    return 4.0 * 2 * 16 * 16 * 32 * (double)iters;
}
#endif

/* The flops of iters rounds on path `path` (ATTN_PATH_*) and dtype (0 f32, 1 f64, 2 bf16 products,
   3 bf16 products on AMX tiles); 0 when that path has no such loop. */
static inline double attn_fma_peak(int path, int dtype, int64_t iters)
{
#if ATTN_X86_DISPATCH
    if (path == ATTN_PATH_AVX512AMX && dtype == 3) return attn_peak_amx_bf16(iters);
    if (path >= ATTN_PATH_AVX512BF16 && dtype == 2) return attn_peak_avx512_bf16(iters);
    if (path >= ATTN_PATH_AVX512)
        return dtype == 0 ? attn_peak_avx512_f32(iters) : dtype == 1 ? attn_peak_avx512_f64(iters) : 0.0;
    if (path == ATTN_PATH_AVX2)
        return dtype == 0 ? attn_peak_avx2_f32(iters) : dtype == 1 ? attn_peak_avx2_f64(iters) : 0.0;
#endif
    (void)path;
    return dtype == 0 ? attn_peak_generic_f32(iters) : dtype == 1 ? attn_peak_generic_f64(iters) : 0.0;
}

/* The read yardstick: the sum of nbytes (a multiple of 64) at p, read once, front to back,
   in 16-byte vectors with four independent accumulators (integer adds: no latency chain worth
   the name, so the loop runs at the memory's rate, not the adder's). */
typedef unsigned long long attn_read_v2 __attribute__((vector_size(16)));

static inline uint64_t attn_read_sum(const void *p, int64_t nbytes)
{
    const attn_read_v2 *v = (const attn_read_v2 *)p;
    attn_read_v2 a0 = {0, 0}, a1 = {0, 0}, a2 = {0, 0}, a3 = {0, 0};
    int64_t i, n = nbytes / 16;
    for (i = 0; i + 4 <= n; i += 4) {
        a0 += v[i];
        a1 += v[i + 1];
        a2 += v[i + 2];
        a3 += v[i + 3];
    }
    a0 += a1 + a2 + a3;
    return a0[0] + a0[1];
}

#endif /* ATTN_YARDSTICKS_H */
