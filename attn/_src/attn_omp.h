/* OpenMP shim: the kernels compile unchanged without OpenMP (serial build). */
#ifndef ATTN_OMP_H
#define ATTN_OMP_H

#ifdef _OPENMP
#include <omp.h>
#define ATTN_HAVE_OPENMP 1
static inline int attn_omp_max_threads(void) { return omp_get_max_threads(); }
static inline int attn_omp_thread_num(void) { return omp_get_thread_num(); }
/* Every thread of the innermost enclosing parallel region waits here for the
   others. Cython's prange inside a `with parallel()` block is an `omp for
   nowait`: the OpenMP program has no barrier at its end. GCC puts one at the
   start of each such loop (its index is firstprivate and lastprivate), which
   is what ordered a loop after the one whose results it reads; this states
   the order instead of leaving it to the compiler. */
static inline void attn_omp_barrier(void)
{
#pragma omp barrier
}
#else
#define ATTN_HAVE_OPENMP 0
static inline int attn_omp_max_threads(void) { return 1; }
static inline int attn_omp_thread_num(void) { return 0; }
static inline void attn_omp_barrier(void) {}
#endif

/* Debug builds (ATTN_DEBUG_BUILD=1 at build time) check every row pointer
   the kernels dereference against the byte extent of its array. */
#ifdef ATTN_DEBUG
#define ATTN_DEBUG_ENABLED 1
#else
#define ATTN_DEBUG_ENABLED 0
#endif

#endif
