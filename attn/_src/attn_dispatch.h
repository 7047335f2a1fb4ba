/* The instruction-set path. The forward (attn_simd.h) and the backward
 * (attn_backward.h) include this for the platform macros and the path ids;
 * the choice itself is attn._kernels' (attn_simd_init at its import,
 * attn_simd_select from its select_simd, which only the tests' hook
 * attn._kernels_testing calls), and attn._kernels_backward runs
 * whatever path that is (it cimports attn._kernels.simd_path_id and never
 * touches its own copy of the state below), so one switch moves both.
 * attn_simd_init() picks the widest path the running CPU supports
 * (__builtin_cpu_supports, which also checks that the OS saves the
 * registers; AMX also needs Linux's per-process permission for its tile
 * data, asked for once here); ATTN_SIMD=generic, avx2, avx512 or
 * avx512-bf16 caps the choice. */
#ifndef ATTN_DISPATCH_H
#define ATTN_DISPATCH_H

#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) \
    && !defined(ATTN_NO_SIMD)
#define ATTN_X86_DISPATCH 1
#include <immintrin.h>
#else
#define ATTN_X86_DISPATCH 0
#endif

#if ATTN_X86_DISPATCH
/* Two float32 vectors as 16 bfloat16 pairs, one 32-bit word per lane t:
 * (x0[t], x1[t]), x0's in the low half, each rounded to nearest even
 * (vcvtne2ps2bf16), the operand layout of vdpbf16ps and of AMX's B tiles.
 * The permutation takes 16-bit lane t to 2t and 16 + t to 2t + 1. */
static __attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512i
attn_bf16_pairs_avx512(__m512 x0, __m512 x1)
{
    const __m512i idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(ATTN_NO_SIMD)
#define ATTN_GVEC 1
#define ATTN_INLINE inline __attribute__((always_inline))
/* a hint: read-only, keep in all cache levels; never faults */
#define ATTN_PREFETCH(p) __builtin_prefetch((p), 0, 3)
/* the same, low temporal locality (prefetcht2): the line goes to L2, not L1, so
   the prefetches in flight are not bounded by L1's few miss buffers (decode's
   stream over a paged cache, FN(heads_tile): twice the read rate of the L1 hint
   on Zen 4) */
#define ATTN_PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#else
#define ATTN_GVEC 0
#define ATTN_INLINE inline
#define ATTN_PREFETCH(p) ((void)(p))
#define ATTN_PREFETCH_L2(p) ((void)(p))
#endif

/* FN(name) of a template instance: name_<suffix> */
#define ATTN_PASTE2(a, b) a##_##b
#define ATTN_PASTE(a, b) ATTN_PASTE2(a, b)

/* ----------------------------------------------------------------- dispatch */
#define ATTN_PATH_GENERIC 0
#define ATTN_PATH_AVX2 1
#define ATTN_PATH_AVX512 2
#define ATTN_PATH_AVX512BF16 3  /* avx512 + AVX512_BF16 + VNNI: bfloat16 problems' products by vdpbf16ps, q8_0 decode scores by vpdpbusd */
#define ATTN_PATH_AVX512AMX 4   /* avx512-bf16 + AMX-BF16: those products by AMX tiles (tdpbf16ps) */
#define ATTN_N_PATHS 5

static int attn_simd_path_id = ATTN_PATH_GENERIC;
static int attn_simd_best_id = ATTN_PATH_GENERIC;   /* widest the CPU runs */
/* 1: the CPU has AVX512_VBMI (with the avx512-bf16 path's BW and VL), whose byte tables
   widen an e4m3 cache on that path and avx512-amx (attn_table); the tests' switch turns
   it off (attn_simd_select_vbmi) to run the other widening on such a CPU too. */
static int attn_simd_vbmi = 0;
static int attn_simd_has_vbmi = 0;

static inline const char *attn_simd_name(int id)
{
    switch (id) {
    case ATTN_PATH_AVX512AMX: return "avx512-amx";
    case ATTN_PATH_AVX512BF16: return "avx512-bf16";
    case ATTN_PATH_AVX512: return "avx512";
    case ATTN_PATH_AVX2: return "avx2-fma";
    default: return ATTN_GVEC ? "generic" : "generic-scalar";
    }
}

#if ATTN_X86_DISPATCH && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
/* AMX-TILE and AMX-BF16 (CPUID.7.0:EDX bits 24 and 22), and Linux's leave to
 * use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA,
 * granted to the whole process; without it the first tile load faults). */
static inline int attn_amx_usable(void)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    if (!((edx >> 24) & 1u) || !((edx >> 22) & 1u)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}
#else
static inline int attn_amx_usable(void) { return 0; }
#endif

#if ATTN_X86_DISPATCH
/* This thread's AMX tiles, all eight 16 rows of 64 bytes (the kernel's blocks, FN(amx_begin), and
 * the benchmark's peak loop, attn/apps/bench/_yardsticks.h); the thread releases them when done. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} attn_amx_config;

static inline __attribute__((target("amx-tile"))) void attn_amx_config_16x64(void)
{
    attn_amx_config cfg;
    int t;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of cfg,
       which let it drop the stores above: make all 64 of them happen */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif

/* The values of ATTN_SIMD and the path each caps the choice at: the one list of
 * them (attn._kernels.simd_caps gives it to Python, whose attn._build warns about
 * any other value). NULL-terminated. */
typedef struct { const char *name; int path; } attn_simd_cap;
static const attn_simd_cap attn_simd_caps[] = {
    {"generic", ATTN_PATH_GENERIC},
    {"avx2", ATTN_PATH_AVX2},
    {"avx512", ATTN_PATH_AVX512},
    {"avx512-bf16", ATTN_PATH_AVX512BF16},
    {NULL, 0},
};

/* Choose the path once, at module import (before any kernel runs). */
static inline void attn_simd_init(void)
{
    int path = ATTN_PATH_GENERIC, i;
    const char *cap = getenv("ATTN_SIMD");
#if ATTN_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        path = ATTN_PATH_AVX2;
    if (path == ATTN_PATH_AVX2 && __builtin_cpu_supports("avx512f"))
        path = ATTN_PATH_AVX512;
    if (path == ATTN_PATH_AVX512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni"))
        path = ATTN_PATH_AVX512BF16;
    if (path == ATTN_PATH_AVX512BF16 && attn_amx_usable())
        path = ATTN_PATH_AVX512AMX;
    attn_simd_has_vbmi = path >= ATTN_PATH_AVX512BF16 && __builtin_cpu_supports("avx512vbmi");
    attn_simd_vbmi = attn_simd_has_vbmi;
#endif
    attn_simd_best_id = path;
    for (i = 0; cap != NULL && attn_simd_caps[i].name != NULL; i++)
        if (strcmp(cap, attn_simd_caps[i].name) == 0 && path > attn_simd_caps[i].path)
            path = attn_simd_caps[i].path;
    attn_simd_path_id = path;
}

static inline const char *attn_simd_path(void) { return attn_simd_name(attn_simd_path_id); }

/* Paths this CPU can run, widest first: n names into names[]. */
static inline int attn_simd_available(const char **names, int n)
{
    int id, k = 0;
    for (id = attn_simd_best_id; id >= ATTN_PATH_GENERIC && k < n; id--)
        names[k++] = attn_simd_name(id);
    return k;
}

/* Switch paths (tests only; not while a kernel runs). 0 = done, -1 = this
 * CPU cannot run it or no such path. */
static inline int attn_simd_select(const char *name)
{
    int id;
    for (id = attn_simd_best_id; id >= ATTN_PATH_GENERIC; id--) {
        if (strcmp(name, attn_simd_name(id)) == 0) {
            attn_simd_path_id = id;
            return 0;
        }
    }
    return -1;
}

/* Whether an e4m3 cache takes AVX512_VBMI's tables where the CPU has them (tests only; not
 * while a kernel runs): returns the previous setting, or -1 where the CPU has none. */
static inline int attn_simd_select_vbmi(int on)
{
    const int previous = attn_simd_vbmi;
    if (!attn_simd_has_vbmi) return -1;
    attn_simd_vbmi = on != 0;
    return previous;
}

#endif /* ATTN_DISPATCH_H */
