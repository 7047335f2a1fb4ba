# The benchmark's yardsticks, measured in the run they judge (python -m attn bench):
#
#   fma_peak        the multiply-add peak of the kernels' current SIMD path (float32, float64,
#                   bfloat16 products), every thread's chains in registers, no memory traffic;
#   softmax_rate    the kernel's own float32 tile softmax on that path (its table's online_softmax:
#                   exp, max, sums and rescale), over scores that stay in L1 on every thread;
#   read_bandwidth  the DRAM read bandwidth: a buffer read once, front to back, on every thread.
#
# Both run their threads from a barrier and time each thread on its own, so the rate is the work
# of all threads over the span from the first start to the last end: threads that do not overlap
# (a 16-thread team still being created while the first threads run, on a short loop) lower it
# instead of hiding behind a sum of per-thread rates. The loops are in _yardsticks.h.

from libc.stdint cimport int64_t, uint64_t
from cython.parallel cimport parallel, threadid

cimport numpy as cnp
import numpy as np

from attn._kernels cimport fork_threads, run_parallel, simd_path_id, tile_softmax_rounds

cnp.import_array()

cdef extern from "_yardsticks.h" nogil:
    double attn_fma_peak(int path, int dtype, int64_t iters)
    uint64_t attn_read_sum(const void* p, int64_t nbytes)

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static void attn_yard_barrier(void) {
        #pragma omp barrier
    }
    static int attn_yard_team(void) { return omp_get_num_threads(); }
    #else
    static void attn_yard_barrier(void) {}
    static int attn_yard_team(void) { return 1; }
    #endif
    #include <time.h>
    static double attn_yard_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    """
    void _barrier "attn_yard_barrier"() nogil
    int _team_size "attn_yard_team"() nogil
    double omp_get_wtime "attn_yard_now"() nogil


cdef enum:
    MAX_THREADS = 1024


cdef struct _Span:
    int threads, path, code
    int64_t iters
    const char* data
    int64_t nbytes
    double* t0
    double* t1
    double* work     # per thread: its flops or scores, or the sum it read (as a double: only kept, not exact)


cdef enum:
    SOFTMAX = 4      # _Span.code of the softmax rounds (0-3: attn_fma_peak's dtypes)


cdef int _rounds_job(void* arg) noexcept nogil:
    """Each thread's rounds from one barrier: FMA chains (code 0-3), or the tile softmax (SOFTMAX)."""
    cdef _Span* c = <_Span*>arg
    cdef int t = 0   # (each thread's own: firstprivate)
    with parallel(num_threads=c.threads):
        t = threadid()
        _barrier()
        c.t0[t] = omp_get_wtime()
        c.work[t] = tile_softmax_rounds(c.iters) if c.code == SOFTMAX else attn_fma_peak(c.path, c.code, c.iters)
        c.t1[t] = omp_get_wtime()
    return 0


cdef int _read_job(void* arg) noexcept nogil:
    cdef _Span* c = <_Span*>arg
    cdef int t = 0, n = 1   # (each thread's own: firstprivate)
    cdef int64_t lo = 0, hi = 0, per = 0
    with parallel(num_threads=c.threads):
        t = threadid()
        n = _team_size()
        per = (c.nbytes // n) // 64 * 64
        lo = t * per
        hi = c.nbytes // 64 * 64 if t == n - 1 else lo + per
        _barrier()
        c.t0[t] = omp_get_wtime()
        c.work[t] = <double>attn_read_sum(c.data + lo, hi - lo)   # kept: the reads are used
        c.t1[t] = omp_get_wtime()
    return 0


cdef double _span(_Span* c, int threads) noexcept nogil:
    """Seconds from the first thread's start to the last one's end."""
    cdef int t
    cdef double lo = c.t0[0], hi = c.t1[0]
    for t in range(1, threads):
        lo = min(lo, c.t0[t])
        hi = max(hi, c.t1[t])
    return hi - lo


cdef double _total(_Span* c, int threads) noexcept nogil:
    cdef int t
    cdef double s = 0.0
    for t in range(threads):
        s += c.work[t]
    return s


cdef double _rate(int code, int64_t iters, int threads) except -1.0:
    """The work of _rounds_job's ``code`` (flops, or SOFTMAX's scores) on ``threads`` threads, ``iters``
    rounds each, over the span from the first start to the last end; 0 when it did none."""
    cdef _Span c
    cdef double t0[MAX_THREADS]
    cdef double t1[MAX_THREADS]
    cdef double work[MAX_THREADS]
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    c.path, c.code, c.iters, c.t0, c.t1, c.work = simd_path_id(), code, iters, t0, t1, work
    with nogil:
        c.threads = fork_threads(threads)
        run_parallel(_rounds_job, &c, c.threads)
    span, total = _span(&c, c.threads), _total(&c, c.threads)
    return total / span if total > 0 and span > 0 else 0.0


def fma_peak(str dtype, int64_t iters, int threads):
    """GFLOP/s of multiply-add chains on the kernels' current SIMD path, or 0.

    Parameters
    ----------
    dtype : "f32", "f64", "bf16" (vdpbf16ps products: the avx512-bf16 and avx512-amx paths
        only, 0 elsewhere) or "amx" (tdpbf16ps on AMX tiles: the avx512-amx path only, 0 elsewhere)
    iters : int
        Rounds of the chains on each thread (attn/apps/bench/_common.py sizes them to run about
        0.2 s, so that thread start-up is a small part of the span).
    threads : int in [1, 1024]

    Returns
    -------
    float : the flops of all threads over the span from the first start to the last end.
    """
    code = {"f32": 0, "f64": 1, "bf16": 2, "amx": 3}.get(dtype, -1)
    if code < 0:
        raise ValueError(f"dtype must be 'f32', 'f64', 'bf16' or 'amx', got {dtype!r}")
    return _rate(code, iters, threads) / 1e9


def softmax_rate(int64_t iters, int threads):
    """Scores per second of the kernel's float32 tile softmax on its current SIMD path.

    Parameters
    ----------
    iters : int
        Rounds on each thread, each over a key-major tile of 256 keys and 16 query rows
        (attn_tile_softmax_rounds, attn/_src/attn_simd.h; attn/apps/bench/_common.py sizes them
        to run about 0.2 s).
    threads : int in [1, 1024]

    Returns
    -------
    float : the scores of all threads over the span from the first start to the last end.
    """
    return _rate(SOFTMAX, iters, threads)


def read_bandwidth(cnp.ndarray buffer, int threads):
    """Bytes per second of one read of ``buffer`` (C-contiguous, any dtype), split in equal
    slices over ``threads`` threads (first touch: fill the buffer on the same threads first).

    Returns
    -------
    (float, float) : the rate over the span from the first start to the last end, and the
    threads' sums of what they read (so that nothing is optimized away).
    """
    cdef _Span c
    cdef double t0[MAX_THREADS]
    cdef double t1[MAX_THREADS]
    cdef double work[MAX_THREADS]
    if not buffer.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
    if buffer.nbytes < 64 * threads:
        raise ValueError(f"buffer must hold at least 64 bytes a thread, got {buffer.nbytes} bytes")
    c.data, c.nbytes, c.t0, c.t1, c.work = <const char*>cnp.PyArray_DATA(buffer), buffer.nbytes, t0, t1, work
    with nogil:
        c.threads = fork_threads(threads)
        run_parallel(_read_job, &c, c.threads)
    return (c.nbytes // 64 * 64) / _span(&c, c.threads), _total(&c, c.threads)
