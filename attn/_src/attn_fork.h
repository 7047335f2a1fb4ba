/* Parallel regions in a forked child (attn/_threads.py).

   GNU libgomp keeps its thread pool in the thread-local state of the thread
   that started a parallel region. fork() copies that thread, pool pointer
   included, but none of the pool's threads: in the child, the first parallel
   region of more than one thread waits at a barrier for workers that do not
   exist, forever (multiprocessing's fork start method, torch's DataLoader
   workers, pre-forking servers). A thread created in the child has no pool
   yet, and libgomp gives it a fresh one (its global state survives the fork:
   the parent's idle workers hold no lock).

   So in a forked child (a pthread_atfork handler says so) attn runs each
   multi-threaded call on a master thread of its own, created at the first
   such call and kept for the process; the calling thread waits for it with
   the GIL released. The master runs one call at a time (calls from several
   threads of the child queue on attn_fork_lock). A runtime that survives
   fork by itself (LLVM's libomp) is served the same way, at the cost of one
   hand-over a call. Single-threaded calls never start a parallel region and
   run where they are called. Where the master cannot be created, the call
   runs single-threaded on the calling thread (attn_fork_threads says 1, and
   attn/_threads.py warns once). */

#ifndef ATTN_FORK_H
#define ATTN_FORK_H

#include <pthread.h>

typedef int (*attn_fork_job)(void *arg);

static int attn_fork_in_child = 0;   /* this process is a fork() child of one that loaded attn */
static int attn_fork_registered = 0;
static int attn_fork_master_state = 0;   /* 0: not started, 1: running, -1: could not start */
static pthread_mutex_t attn_fork_lock = PTHREAD_MUTEX_INITIALIZER;   /* one call on the master at a time */
static pthread_mutex_t attn_fork_mutex = PTHREAD_MUTEX_INITIALIZER;  /* guards the fields below */
static pthread_cond_t attn_fork_cond = PTHREAD_COND_INITIALIZER;
static attn_fork_job attn_fork_fn = NULL;   /* the posted call (NULL: none) */
static void *attn_fork_arg = NULL;
static int attn_fork_result = 0, attn_fork_done = 0;

/* In the child: every field back to its initial value (a grandchild has no master either). */
static void attn_fork_after_fork_child(void)
{
    const pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    const pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    attn_fork_in_child = 1;
    attn_fork_master_state = 0;
    attn_fork_lock = m;
    attn_fork_mutex = m;
    attn_fork_cond = c;
    attn_fork_fn = NULL;
    attn_fork_arg = NULL;
    attn_fork_result = attn_fork_done = 0;
}

/* At the module's import. Returns 0, or -1 when the handler cannot be registered. */
static int attn_fork_register(void)
{
    if (!attn_fork_registered) {
        if (pthread_atfork(NULL, NULL, attn_fork_after_fork_child) != 0)
            return -1;
        attn_fork_registered = 1;
    }
    return 0;
}

static void *attn_fork_master_main(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&attn_fork_mutex);
    for (;;) {
        while (attn_fork_fn == NULL)
            pthread_cond_wait(&attn_fork_cond, &attn_fork_mutex);
        {
            attn_fork_job fn = attn_fork_fn;
            void *arg = attn_fork_arg;
            int r;
            pthread_mutex_unlock(&attn_fork_mutex);
            r = fn(arg);
            pthread_mutex_lock(&attn_fork_mutex);
            attn_fork_fn = NULL;
            attn_fork_result = r;
            attn_fork_done = 1;
            pthread_cond_broadcast(&attn_fork_cond);
        }
    }
    return NULL;
}

/* The threads a call may use: `threads`, or 1 in a forked child whose master
   thread cannot be created. Starts the master (in a child) when needed. */
static int attn_fork_threads(int threads)
{
    if (threads <= 1 || !attn_fork_in_child)
        return threads;
    pthread_mutex_lock(&attn_fork_mutex);
    if (attn_fork_master_state == 0) {
        pthread_t t;
        pthread_attr_t attr;
        int ok = pthread_attr_init(&attr) == 0;
        ok = ok && pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) == 0;
        ok = ok && pthread_create(&t, &attr, attn_fork_master_main, NULL) == 0;
        attn_fork_master_state = ok ? 1 : -1;
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&attn_fork_mutex);
    return attn_fork_master_state == 1 ? threads : 1;
}

/* The tests' hook: in a child whose master has not started, act as if it could not be created. */
static void attn_fork_refuse_master(void)
{
    pthread_mutex_lock(&attn_fork_mutex);
    if (attn_fork_in_child && attn_fork_master_state == 0)
        attn_fork_master_state = -1;
    pthread_mutex_unlock(&attn_fork_mutex);
}

/* fn(arg), on the master thread in a forked child when `threads` (from
   attn_fork_threads) is more than one, else here. Returns fn's result. */
static int attn_fork_run(attn_fork_job fn, void *arg, int threads)
{
    int r;
    if (threads <= 1 || !attn_fork_in_child || attn_fork_master_state != 1)
        return fn(arg);
    pthread_mutex_lock(&attn_fork_lock);
    pthread_mutex_lock(&attn_fork_mutex);
    attn_fork_done = 0;
    attn_fork_arg = arg;
    attn_fork_fn = fn;
    pthread_cond_broadcast(&attn_fork_cond);
    while (!attn_fork_done)
        pthread_cond_wait(&attn_fork_cond, &attn_fork_mutex);
    r = attn_fork_result;
    pthread_mutex_unlock(&attn_fork_mutex);
    pthread_mutex_unlock(&attn_fork_lock);
    return r;
}

#endif
