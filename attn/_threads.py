"""Thread count used by the compiled kernels."""

from . import _dispatch_info

_num_threads = None  # None: OpenMP's default (all cores, or OMP_NUM_THREADS)


def _default_threads():
    if _dispatch_info.HAVE_CYTHON:
        return int(_dispatch_info._kernels.build_info()["max_threads"])
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
    from ._validation import check_num_threads_value  # the one place that validates

    global _num_threads
    _num_threads = check_num_threads_value(num_threads)


def backends():
    """What is available: the compiled kernel, OpenMP, threads, SIMD path.

    Returns
    -------
    dict with keys ``"loop"``, ``"numpy"`` (always True), ``"cython"`` (bool),
    ``"cython_error"`` (why it is missing, or None), ``"openmp"`` (bool),
    ``"num_threads"`` (int, the default the kernels use), ``"max_threads"``,
    ``"simd"`` (the kernel code path chosen for this CPU), ``"debug"``
    (bounds-checked build).
    """
    info = {"loop": True, "numpy": True, "cython": _dispatch_info.HAVE_CYTHON,
            "cython_error": _dispatch_info.CYTHON_IMPORT_ERROR, "openmp": False,
            "num_threads": get_num_threads(), "max_threads": 1, "simd": None, "debug": False}
    if _dispatch_info.HAVE_CYTHON:
        info.update(_dispatch_info._kernels.build_info())
    return info
