"""The wait policy of attn's OpenMP threads: a short spin after each kernel call, then sleep.

By default an OpenMP runtime keeps its worker threads spinning on their cores
after a parallel region, so that the next region starts without waking them:
GNU libgomp for 300,000 spins (about 4 ms on a 2-core Xeon here, where one
spin, an atomic load and a ``pause``, takes about 12 ns), LLVM's libomp for
``KMP_BLOCKTIME`` (200 ms). A program that alternates attn calls with another
library's threads (NumPy's OpenBLAS in attn's own Llama) then runs those
threads on cores where attn's workers still spin: on a 2-core Zen 4, decoding
SmolLM2 in NumPy ran 6 times slower with attn's kernel than with attn's NumPy
backend (``bench/``: the interleaved group).

Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``, attn's earlier choice) is no
answer either: there is one libgomp per process. torch's wheel ships its own
``libgomp.so.1``, and when attn's kernels load first the dynamic loader hands
torch the runtime attn started, passive policy included. torch's operators are
many short parallel regions, each of which then wakes its workers from sleep:
on that Xeon, 30 layers of SmolLM2's decode products and attention in torch ran
at 35 ms a token after ``import attn`` against 12-13 ms without it.

So attn loads its kernels with ``GOMP_SPINCOUNT=SPIN_COUNT`` (about 0.4 ms of
spinning there, a tenth of the default): long enough to bridge the gaps
between torch's operators and attn's calls among them (1,000 spins, 12 us, was
not: torch's products took 16 ms a token; 10,000 left attn's calls between
them at 1.26-1.28 times their parts), short enough that a spinning worker
delays the next OpenBLAS product by at most that much. libomp (a build with
clang) gets ``KMP_BLOCKTIME=1`` (1 ms). The
variables are removed again right after the load, so a runtime that another
library loads later and on its own keeps its defaults. A user's own
``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` wins, and a
runtime already loaded (torch imported first) keeps the policy it has. The
kernels add a thread only for calls long enough to repay a wake-up
(``attn_threads_for``, the grains in ``attn/_src/attn_kernel.h``).
"""

import contextlib
import ctypes
import os
import sys

#: Variables that set the wait policy of libgomp or libomp; any of them set by the user wins.
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

#: libgomp's spins (an atomic load and a ``pause`` each) before an idle worker sleeps.
SPIN_COUNT = 30_000

#: What :func:`attn.backends` reports as ``"omp_wait"``, set by :func:`short_spin_while_loading`.
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
def short_spin_while_loading():
    """Import the kernels inside this block: their OpenMP runtime starts with a short spin."""
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
    ours = {"GOMP_SPINCOUNT": str(SPIN_COUNT), "KMP_BLOCKTIME": "1"}
    os.environ.update(ours)
    try:
        yield
    finally:
        for name in ours:
            del os.environ[name]
    policy = f"short spin (GOMP_SPINCOUNT={SPIN_COUNT}, KMP_BLOCKTIME=1)"
