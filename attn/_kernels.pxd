# What attn._kernels exports to the other compiled modules (Cython cimports it;
# at import the caller takes the functions from attn._kernels' __pyx_capi__): the SIMD
# path (attn._kernels_backward runs it), its switch (attn._kernels_testing, the tests'
# hook), the forward's run (attn._fast_path) and the fork-safe parallel run (attn._casts,
# attn._kernels_backward).

from libc.stdint cimport int64_t

from attn._attn_kernel cimport attn_problem

cdef int simd_path_id() noexcept nogil
cdef int select_simd(const char* name) noexcept nogil
cdef int select_vbmi(int on) noexcept nogil
cdef int run_attention(const attn_problem* a, int num_threads) except -1
# the benchmark's softmax yardstick (attn/apps/bench/_yardsticks.pyx): the current path's tile softmax
cdef double tile_softmax_rounds(int64_t iters) noexcept nogil
# the other modules' parallel regions, fork-safe (attn/_src/attn_fork.h): threads = fork_threads(n),
# then run_parallel(job, arg, threads) runs job(arg) here or on a forked child's master thread
ctypedef int (*parallel_job)(void* arg) noexcept nogil
cdef int fork_threads(int num_threads) noexcept nogil
cdef int run_parallel(parallel_job job, void* arg, int num_threads) noexcept nogil
cdef void refuse_fork_master() noexcept nogil   # the tests' hook
# the tests' hook (attn._kernels_testing.delay_items): each item waits before it runs
cdef void set_test_delays(int first_us, int others_us) noexcept nogil
cdef void test_delay() noexcept nogil
