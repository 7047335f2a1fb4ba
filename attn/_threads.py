"""Thread control: the thread count of the compiled kernels, checked in one place.

Two kinds of process get a thread count the parent's settings do not give:

* a ``fork()`` child (multiprocessing's fork start method, pre-forking servers):
  libgomp's thread pool does not survive the fork, so the kernels run the child's
  parallel regions on a master thread of its own (attn/_src/attn_fork.h), at the
  full thread count; where that thread cannot be created, single-threaded, with one
  :class:`RuntimeWarning` per process;
* a torch ``DataLoader`` worker: torch sets one thread there (its workers are many
  processes already), and attn's default follows ``torch.get_num_threads()`` in the
  worker, unless :func:`set_num_threads` was called in that worker.
"""

import os
import sys
import warnings

from . import _blas_pool, _build, _openmp_wait
from ._integers import check_int

# OpenMP aborts the whole process (it does not raise) when it cannot create a
# thread, so absurd thread counts are refused here rather than attempted.
MAX_THREADS = 1024

_num_threads = None  # None: OpenMP's default (all cores, or OMP_NUM_THREADS)
_num_threads_pid = None  # the process that called set_num_threads (a DataLoader worker's own call wins)
_forked = False  # set in a fork() child (os.register_at_fork below)
_fork_warned = False


def _after_fork_in_child():
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_num_threads_value(num_threads):
    """``num_threads`` as an int in [1, MAX_THREADS]; None stays None."""
    return check_int(num_threads, "num_threads", 1, MAX_THREADS, allow_none=True)


def check_num_threads(num_threads):
    """The thread count of one call: ``num_threads`` checked, or the default."""
    n = get_num_threads() if num_threads is None else check_num_threads_value(num_threads)
    return _forked_child_threads(n) if _forked and n > 1 else n


def _forked_child_threads(n):
    """``n``, or 1 in a forked child where the kernels cannot run a parallel region
    (no master thread: attn/_src/attn_fork.h), with one warning per process."""
    global _fork_warned
    if not _build.HAVE_CYTHON or _build._kernels.fork_state()[1] > 1:
        return n
    if not _fork_warned:
        _fork_warned = True
        warnings.warn(
            f"attn runs single-threaded in this forked child (pid {os.getpid()}): the OpenMP "
            f"runtime's threads do not survive fork() and no thread could be created to start "
            f"new ones; use the 'spawn' or 'forkserver' start method for {n} threads",
            RuntimeWarning, stacklevel=3)
    return 1


def _torch_worker_threads():
    """torch's thread count inside a torch DataLoader worker (where torch sets 1), else None."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    if worker is None or getattr(worker, "_worker_info", None) is None:
        return None
    return sys.modules["torch"].get_num_threads()


def _default_threads():
    if _build.HAVE_CYTHON:
        return _build._kernels.max_threads()  # (per call: OMP_NUM_THREADS, omp_set_num_threads)
    return 1


def get_num_threads():
    """Threads the cython backend uses when a call does not say ``num_threads``.

    In a torch ``DataLoader`` worker: ``torch.get_num_threads()`` (1, as torch sets it
    there), unless :func:`set_num_threads` was called in that worker.
    """
    worker = _torch_worker_threads()
    if worker is not None and (_num_threads is None or _num_threads_pid != os.getpid()):
        return worker
    return _default_threads() if _num_threads is None else _num_threads


def set_num_threads(num_threads):
    """Set the default thread count of the cython backend.

    Parameters
    ----------
    num_threads : int in [1, 1024], or None
        None restores the OpenMP default (``OMP_NUM_THREADS`` if set, else all
        cores). Results are bitwise identical for every thread count.
    """
    global _num_threads, _num_threads_pid
    _num_threads = check_num_threads_value(num_threads)
    _num_threads_pid = os.getpid()


def backends():
    """What is available: the compiled kernel, OpenMP, threads, SIMD path.

    Returns
    -------
    dict with keys ``"loop"``, ``"numpy"``, ``"online"`` (always True),
    ``"cython"`` (bool), ``"cython_error"`` (why it is missing, or None),
    ``"openmp"`` (bool), ``"num_threads"`` (int, the default the kernels use),
    ``"max_threads"``, ``"simd"`` (the kernel code path chosen for this CPU),
    ``"e4m3_tables"`` (a float8 e4m3fn cache is looked up as bfloat16 by
    AVX512_VBMI's byte tables, and a bfloat16 query's products over it are
    bfloat16 pairs: docs/flash_api.md), ``"debug"`` (bounds-checked build), ``"omp_wait"`` (how the kernels'
    OpenMP threads wait between calls: a short spin unless the user set the
    policy or libgomp was loaded first, see :mod:`attn._openmp_wait`),
    ``"blas_threads"`` (whether NumPy's OpenBLAS runs its parallel jobs on
    the kernels' OpenMP team, one pool for both: :mod:`attn._blas_pool`),
    ``"cython_backward"`` (bool: the fused backward extension
    attn._kernels_backward is built) and ``"cython_backward_error"`` (why it
    is missing, or None).
    """
    info = {"loop": True, "numpy": True, "online": True, "cython": _build.HAVE_CYTHON,
            "cython_error": _build.CYTHON_IMPORT_ERROR, "cython_backward": _build.HAVE_BACKWARD,
            "cython_backward_error": _build.BACKWARD_IMPORT_ERROR, "openmp": False,
            "num_threads": get_num_threads(), "max_threads": 1, "simd": None, "e4m3_tables": False, "debug": False,
            "omp_wait": _openmp_wait.policy, "blas_threads": _blas_pool.state}
    if _build.HAVE_CYTHON:
        info.update(_build._kernels.build_info())
    return info
