"""Thread control: the thread count of the compiled kernels, checked in one place."""

from . import _blas_pool, _build, _openmp_wait
from ._integers import check_int

# OpenMP aborts the whole process (it does not raise) when it cannot create a
# thread, so absurd thread counts are refused here rather than attempted.
MAX_THREADS = 1024

_num_threads = None  # None: OpenMP's default (all cores, or OMP_NUM_THREADS)


def check_num_threads_value(num_threads):
    """``num_threads`` as an int in [1, MAX_THREADS]; None stays None."""
    return check_int(num_threads, "num_threads", 1, MAX_THREADS, allow_none=True)


def check_num_threads(num_threads):
    """The thread count of one call: ``num_threads`` checked, or the default."""
    if num_threads is None:
        return get_num_threads()
    return check_num_threads_value(num_threads)


def _default_threads():
    if _build.HAVE_CYTHON:
        return _build._kernels.max_threads()  # (per call: OMP_NUM_THREADS, omp_set_num_threads)
    return 1


def get_num_threads():
    """Threads the cython backend uses when a call does not say ``num_threads``."""
    return _default_threads() if _num_threads is None else _num_threads


def set_num_threads(num_threads):
    """Set the default thread count of the cython backend.

    Parameters
    ----------
    num_threads : int in [1, 1024], or None
        None restores the OpenMP default (``OMP_NUM_THREADS`` if set, else all
        cores). Results are bitwise identical for every thread count.
    """
    global _num_threads
    _num_threads = check_num_threads_value(num_threads)


def backends():
    """What is available: the compiled kernel, OpenMP, threads, SIMD path.

    Returns
    -------
    dict with keys ``"loop"``, ``"numpy"``, ``"online"`` (always True),
    ``"cython"`` (bool), ``"cython_error"`` (why it is missing, or None),
    ``"openmp"`` (bool), ``"num_threads"`` (int, the default the kernels use),
    ``"max_threads"``, ``"simd"`` (the kernel code path chosen for this CPU),
    ``"debug"`` (bounds-checked build), ``"omp_wait"`` (how the kernels'
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
            "num_threads": get_num_threads(), "max_threads": 1, "simd": None, "debug": False,
            "omp_wait": _openmp_wait.policy, "blas_threads": _blas_pool.state}
    if _build.HAVE_CYTHON:
        info.update(_build._kernels.build_info())
    return info
