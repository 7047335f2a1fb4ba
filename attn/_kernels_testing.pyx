# The tests' hook into the compiled kernels, kept out of the modules users run: the SIMD
# path switched in-process (tests/conftest.py's simd fixture runs a test on every path this
# CPU has), a forked child's master thread refused (tests/_fork_scenarios.py), and work items
# delayed per thread (tests/test_kernel_threads.py), and the portable float16 rounding
# (tests/test_kernel_paths.py). The path's state is attn._kernels'
# (attn_dispatch.h): the switch is its
# select_simd, cimported, so the forward and the backward both follow it.

from attn._kernels cimport refuse_fork_master as kernels_refuse_fork_master
from attn._kernels cimport select_simd as kernels_select_simd
from attn._kernels cimport select_vbmi as kernels_select_vbmi
from attn._kernels cimport set_test_delays

cimport numpy as cnp
import numpy as np

from attn._attn_kernel cimport ATTN_OUT_F16, attn_narrow16

cnp.import_array()

from attn._kernels import build_info, simd_paths


def select_simd(str name):
    """Switch the kernels, forward and backward, to another path this CPU runs
    (attn._kernels.simd_paths()); returns the previous one. Not thread-safe against
    kernels running concurrently."""
    previous = build_info()["simd"]
    if kernels_select_simd(name.encode("ascii")) != 0:
        raise ValueError(f"SIMD path {name!r} not available; this CPU has {simd_paths()}")
    return previous


def select_vbmi(bint on):
    """Whether a float8 e4m3 cache is widened by AVX512_VBMI's byte tables on the
    avx512-bf16 and avx512-amx paths (the default where the CPU has them) or as on a CPU
    without; returns the previous setting, or None where this CPU has no AVX512_VBMI."""
    previous = kernels_select_vbmi(on)
    return None if previous < 0 else bool(previous)


def refuse_fork_master():
    """In a forked child whose kernels have not yet started their master thread
    (attn/_src/attn_fork.h), act as if it could not be created: the child's calls then run
    single-threaded, as where thread creation fails."""
    kernels_refuse_fork_master()


def delay_items(int first_us, int others_us):
    """Make every work item of the forward kernel (and every matrix the backward packs)
    wait ``first_us`` microseconds before it runs on a parallel region's first thread,
    ``others_us`` on the other threads; (0, 0) turns it off. A test holds one thread's
    item this way while the other threads finish theirs: what runs after the items
    (the split keys' merge, the backward's blocks after its packing) must wait for it.
    Not thread-safe against kernels running concurrently."""
    if first_us < 0 or others_us < 0:
        raise ValueError(f"delays must be >= 0 microseconds; got {first_us} and {others_us}")
    set_test_delays(first_us, others_us)


def narrow_f16(x):
    """float32 array ``x`` rounded to float16 by the kernels' portable conversion
    (attn_narrow16 with ATTN_OUT_F16: the generic path's out and the split keys' merge;
    the x86 paths' out takes F16C's instruction), as the float16 bits (uint16)."""
    cdef cnp.ndarray[cnp.float32_t, ndim=1] src = np.ascontiguousarray(x, np.float32).reshape(-1)
    cdef cnp.ndarray[cnp.uint16_t, ndim=1] dst = np.empty(src.shape[0], np.uint16)
    if src.shape[0]:
        attn_narrow16(&src[0], &dst[0], src.shape[0], ATTN_OUT_F16)
    return dst
