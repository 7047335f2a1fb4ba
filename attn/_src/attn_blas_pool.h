/* One pool of threads for attn and NumPy's OpenBLAS (attn/_blas_pool.py).

   OpenBLAS's pthreads build keeps a worker per extra core that, after each
   job, spins on that core (a loop of nops reading the time stamp counter,
   no pause, no yield) for 2^28 time-stamp ticks, about 0.1 s, before it
   sleeps. A NumPy program calls BLAS far more often than that, so the
   worker never sleeps; when attn's own OpenMP worker then needs a core for
   a parallel call (decode over 2k+ keys), three busy threads share two
   cores and each library's threads wait for the other's to be descheduled.

   OpenBLAS 0.3.27 and later run their parallel jobs through a callback when
   one is registered (openblas_set_threads_callback_function): attn registers
   attn_blas_pool_run, which runs the jobs on the calling thread's OpenMP
   team, the one attn's kernels use. OpenBLAS's own workers then sleep, and
   both libraries share one set of threads with one wait policy
   (attn/_openmp_wait.py). OpenBLAS splits the work as before (numjobs is
   its thread count), so its results are the same bits.

   The jobs of one call must run at the same time (a threaded GEMM's jobs
   wait for each other's packed panels): a team smaller than numjobs (a BLAS
   call inside an OpenMP region, or OMP_THREAD_LIMIT) gets the missing jobs
   on threads of their own, created for the call.

   libgomp's team cannot be used in a child process after fork (its first
   parallel region waits for threads the child does not have), so in a
   forked child every registered callback is removed again (pthread_atfork)
   and OpenBLAS runs its own threads there, as without attn. */

#ifndef ATTN_BLAS_POOL_H
#define ATTN_BLAS_POOL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef void (*attn_blas_dojob)(int thread_num, void *jobdata, int dojob_data);
typedef void (*attn_blas_threads_callback)(int sync, attn_blas_dojob dojob, int numjobs,
                                           size_t jobdata_elsize, void *jobdata, int dojob_data);
typedef void (*attn_blas_set_callback)(attn_blas_threads_callback callback);

enum { ATTN_BLAS_POOL_MAX_LIBS = 8 };

/* Setters that hold attn's callback (one per OpenBLAS library), and calls served. */
static attn_blas_set_callback attn_blas_pool_setters[ATTN_BLAS_POOL_MAX_LIBS];
static int attn_blas_pool_n_setters = 0;
static int64_t attn_blas_pool_calls = 0;        /* OpenBLAS calls run on the team */
static int64_t attn_blas_pool_extra_jobs = 0;   /* jobs given threads of their own */
static int attn_blas_pool_atfork_done = 0;

typedef struct {
    attn_blas_dojob dojob;
    char *jobdata;
    size_t elsize;
    int job, dojob_data;
} attn_blas_job;

static void *attn_blas_pool_thread(void *arg)
{
    attn_blas_job *j = (attn_blas_job *)arg;
    j->dojob(j->job, j->jobdata + (size_t)j->job * j->elsize, j->dojob_data);
    return NULL;
}

/* Jobs [first, numjobs) of a call, each on a thread of its own, while the
   caller runs job `own`; then joins them. (Rare: a team short of threads.) */
static void attn_blas_pool_spawn(attn_blas_dojob dojob, int first, int numjobs, size_t elsize,
                                 char *jobdata, int dojob_data, int own)
{
    const int n = numjobs - first;
    attn_blas_job *jobs = (attn_blas_job *)malloc(sizeof(attn_blas_job) * (size_t)n);
    pthread_t *tids = (pthread_t *)malloc(sizeof(pthread_t) * (size_t)n);
    char *started = (char *)malloc((size_t)n);
    int i;
    if (jobs == NULL || tids == NULL || started == NULL) {
        /* no memory for them: one after the other here (a threaded GEMM may then wait for ever) */
        free(jobs), free(tids), free(started);
        dojob(own, jobdata + (size_t)own * elsize, dojob_data);
        for (i = first; i < numjobs; i++)
            dojob(i, jobdata + (size_t)i * elsize, dojob_data);
        return;
    }
    for (i = 0; i < n; i++) {
        jobs[i].dojob = dojob;
        jobs[i].jobdata = jobdata;
        jobs[i].elsize = elsize;
        jobs[i].job = first + i;
        jobs[i].dojob_data = dojob_data;
        started[i] = pthread_create(&tids[i], NULL, attn_blas_pool_thread, &jobs[i]) == 0;
    }
    __atomic_add_fetch(&attn_blas_pool_extra_jobs, n, __ATOMIC_RELAXED);
    dojob(own, jobdata + (size_t)own * elsize, dojob_data);
    for (i = 0; i < n; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else   /* no thread to be had: run it here */
            attn_blas_pool_thread(&jobs[i]);
    }
    free(jobs), free(tids), free(started);
}

/* OpenBLAS's callback: run jobs 0..numjobs-1 at once, job t on team thread t. */
static void attn_blas_pool_run(int sync, attn_blas_dojob dojob, int numjobs, size_t elsize,
                               void *jobdata, int dojob_data)
{
    char *data = (char *)jobdata;
    (void)sync;   /* OpenBLAS passes 1: return when the jobs are done, as here always */
    __atomic_add_fetch(&attn_blas_pool_calls, 1, __ATOMIC_RELAXED);
    if (numjobs <= 1) {
        if (numjobs == 1)
            dojob(0, data, dojob_data);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(numjobs)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        if (n < numjobs && t == 0)
            attn_blas_pool_spawn(dojob, n, numjobs, elsize, data, dojob_data, 0);
        else
            dojob(t, data + (size_t)t * elsize, dojob_data);
    }
#else
    attn_blas_pool_spawn(dojob, 1, numjobs, elsize, data, dojob_data, 0);
#endif
}

/* In a forked child: OpenBLAS back on its own threads (libgomp's team is unusable there). */
static void attn_blas_pool_after_fork_child(void)
{
    int i;
    for (i = 0; i < attn_blas_pool_n_setters; i++)
        attn_blas_pool_setters[i](NULL);
    attn_blas_pool_n_setters = 0;
}

/* Register the callback through `setter` (an OpenBLAS library's
   openblas_set_threads_callback_function). Returns 0, or -1 when full. */
static int attn_blas_pool_install(attn_blas_set_callback setter)
{
    int i;
    for (i = 0; i < attn_blas_pool_n_setters; i++)
        if (attn_blas_pool_setters[i] == setter) {
            setter(attn_blas_pool_run);
            return 0;
        }
    if (attn_blas_pool_n_setters == ATTN_BLAS_POOL_MAX_LIBS)
        return -1;
    if (!attn_blas_pool_atfork_done) {
        if (pthread_atfork(NULL, NULL, attn_blas_pool_after_fork_child) != 0)
            return -1;
        attn_blas_pool_atfork_done = 1;
    }
    attn_blas_pool_setters[attn_blas_pool_n_setters++] = setter;
    setter(attn_blas_pool_run);
    return 0;
}

/* Give `setter`'s library its own threads back. */
static void attn_blas_pool_uninstall(attn_blas_set_callback setter)
{
    int i, j;
    for (i = 0; i < attn_blas_pool_n_setters; i++)
        if (attn_blas_pool_setters[i] == setter) {
            setter(NULL);
            for (j = i + 1; j < attn_blas_pool_n_setters; j++)
                attn_blas_pool_setters[j - 1] = attn_blas_pool_setters[j];
            attn_blas_pool_n_setters--;
            return;
        }
}

#endif
