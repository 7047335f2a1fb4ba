"""The wait policy of attn's OpenMP threads: they sleep as soon as a kernel call ends.

By default an OpenMP runtime keeps its worker threads spinning on their cores
after a parallel region, so that the next region starts without waking them:
GNU libgomp for about 300,000 spins (milliseconds), LLVM's libomp for
``KMP_BLOCKTIME`` (200 ms). A program that alternates attn calls with another
library's threads (NumPy's OpenBLAS in attn's own Llama, torch's OpenMP pool in
transformers) then runs those threads on cores where attn's workers still spin:
on 2 cores, decoding SmolLM2 in NumPy ran 6 times slower with attn's kernel
than with attn's NumPy backend, and a loop of OpenBLAS products and attn
decode calls 40 times slower than its parts (``bench/``: the interleaved
group).

So attn loads its kernels with ``OMP_WAIT_POLICY=PASSIVE`` (honoured by libgomp
and libomp): the runtime reads it once, when the extension loads it, and the
variable is removed again right after, so runtimes that other libraries load
later (torch bundles its own libgomp) keep their defaults. A user's own
``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` wins. The price, a
thread wake-up at the start of each parallel call, is why the kernels add a
thread only for calls long enough to repay it (``attn_threads_for``, the
grains in ``attn/_src/attn_kernel.h``).
"""

import contextlib
import ctypes
import os
import sys

#: Variables that set the wait policy of libgomp or libomp; any of them set by the user wins.
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

#: What :func:`attn.backends` reports as ``"omp_wait"``, set by :func:`passive_while_loading`.
policy = "not loaded"


def _runtime_loaded():
    """Whether the OpenMP runtime attn links (libgomp) is already in the process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def passive_while_loading():
    """Import the kernels inside this block: their OpenMP runtime starts with passive waiting."""
    global policy
    user = {name: os.environ[name] for name in USER_VARIABLES if name in os.environ}
    if user:
        policy = "the user's: " + ", ".join(f"{k}={v}" for k, v in user.items())
        yield
        return
    if _runtime_loaded():
        # Another module loaded libgomp first: its policy was fixed then.
        policy = "the runtime's default (libgomp was loaded before attn)"
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]
    policy = "passive"
