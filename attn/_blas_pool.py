"""One pool of threads for attn's kernels and NumPy's OpenBLAS.

A NumPy program that calls attn runs two thread pools: OpenBLAS's (the matrix
products) and attn's OpenMP team (the kernels). OpenBLAS's pthreads workers
spin on their cores for about 0.1 s after each job (2^28 time-stamp ticks, a
loop of nops: no pause, no yield) before they sleep, so in a program that
calls BLAS every few milliseconds they never sleep. On a machine with as many
cores as OpenBLAS has threads, a parallel attn call then puts a third busy
thread on two cores: attn's worker waits for a spinning BLAS worker to be
descheduled, and the next product waits for attn's worker, which spins on
after the call (:mod:`attn._openmp_wait`). Decoding SmolLM2 at a context of
2,048+ tokens (where decode attention takes two threads) ran slower at the
default settings than on one thread.

OpenBLAS 0.3.27 and later let a program run OpenBLAS's parallel jobs on its
own threads (``openblas_set_threads_callback_function``). At import attn
registers a callback that runs them on attn's OpenMP team
(``attn/_src/attn_blas_pool.h``): both libraries then share one set of
threads, the products keep their thread count and their bits (OpenBLAS splits
the work as before), and OpenBLAS's own workers fall asleep.

Only the pthreads build of OpenBLAS is changed (an OpenMP build already runs
on an OpenMP team), only libraries already loaded when attn is imported
(NumPy's, which attn imports first; :func:`enable` again takes one loaded
later, such as SciPy's), and only where the compiled kernels have OpenMP. ``ATTN_SHARE_BLAS_THREADS=0`` in the environment keeps OpenBLAS on its
own threads; :func:`disable` and :func:`enable` switch it at run time (not
while another thread is inside a BLAS call). In a forked child OpenBLAS gets
its own threads back (libgomp's team does not survive a fork).
"""

import ctypes
import os
import sys

#: The environment variable that, set to 0, keeps OpenBLAS on its own threads.
ENV = "ATTN_SHARE_BLAS_THREADS"

#: What :func:`attn.backends` reports as ``"blas_threads"``.
state = "not shared (not set up)"

_installed = {}  # library path -> address of its setter, while the callback is registered


def _loaded_openblas_paths():
    """Paths of the shared libraries named like OpenBLAS that this process has loaded (Linux)."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                name = os.path.basename(path)
                if "openblas" in name.lower() and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _setter(path):
    """Address of ``openblas_set_threads_callback_function`` (with the library's symbol prefix
    and suffix) of the pthreads OpenBLAS at ``path``, or None (an OpenMP build, or older than 0.3.27)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_", "_64"):
            parallel = getattr(lib, f"{prefix}openblas_get_parallel{suffix}", None)
            setter = getattr(lib, f"{prefix}openblas_set_threads_callback_function{suffix}", None)
            if parallel is None or setter is None:
                continue
            parallel.restype = ctypes.c_int
            if parallel() != 1:  # 0: single-threaded build, 2: OpenMP build
                return None
            return ctypes.cast(setter, ctypes.c_void_p).value
    return None


def _libraries():
    """[(path, setter address)] of the pthreads OpenBLAS 0.3.27+ libraries loaded now."""
    return [(p, a) for p in _loaded_openblas_paths() for a in [_setter(p)] if a]


#: The compiled attn/_blas_callback.pyx, handed over by attn._build at its import
#: (enable_unless_disabled_by_env), or None: no compiled kernels with OpenMP, so no team to share.
_callback = None


def enable():
    """Run the loaded pthreads OpenBLAS libraries' parallel jobs on attn's OpenMP team.

    Returns
    -------
    bool : whether at least one library now runs on attn's team.
    """
    global state
    if _callback is None:
        state = "not shared (no compiled kernels with OpenMP)"
        return False
    if not sys.platform.startswith("linux"):
        state = "not shared (found only on Linux)"
        return False
    for path, setter in _libraries():
        if path not in _installed and _callback.install(setter):
            _installed[path] = setter
    names = ", ".join(os.path.basename(p) for p in _installed)
    state = f"shared with {names}" if _installed else "not shared (no pthreads OpenBLAS 0.3.27+ loaded)"
    return bool(_installed)


def disable(reason="disabled"):
    """Give every OpenBLAS library its own threads back."""
    global state
    for path, setter in list(_installed.items()):
        _callback.uninstall(setter)
        del _installed[path]
    state = f"not shared ({reason})"


def shared():
    """Paths of the OpenBLAS libraries whose jobs run on attn's team."""
    return list(_installed)


def counters():
    """(OpenBLAS calls attn's team has run, jobs that needed a thread of their own); (0, 0) without it."""
    return _callback.counters() if _callback is not None else (0, 0)


def enable_unless_disabled_by_env(callback):
    """At import (attn._build): :func:`enable`, unless ``ATTN_SHARE_BLAS_THREADS=0``.
    ``callback``: the compiled module attn._blas_callback when attn's kernels were built with
    OpenMP (their team is what OpenBLAS's jobs run on), else None."""
    global _callback
    _callback = callback
    if os.environ.get(ENV, "").strip() in ("0", "false", "no", "off"):
        disable(f"{ENV}={os.environ[ENV]}")
        return False
    return enable()
