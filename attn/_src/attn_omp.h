/* OpenMP shim: the kernels compile unchanged without OpenMP (serial build). */
#ifndef ATTN_OMP_H
#define ATTN_OMP_H

#ifdef _OPENMP
#include <omp.h>
#define ATTN_HAVE_OPENMP 1
static inline int attn_omp_max_threads(void) { return omp_get_max_threads(); }
#else
#define ATTN_HAVE_OPENMP 0
static inline int attn_omp_max_threads(void) { return 1; }
#endif

/* Debug builds (ATTN_DEBUG_BUILD=1 at build time) check every row pointer
   the kernels dereference against the byte extent of its array. */
#ifdef ATTN_DEBUG
#define ATTN_DEBUG_ENABLED 1
#else
#define ATTN_DEBUG_ENABLED 0
#endif

#endif
