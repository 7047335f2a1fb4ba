"""The compiled modules, loaded here and nowhere else (each optional: a source tree without
build_ext has none), whether they are importable, and what they were built with.

Also checks ``ATTN_SIMD``: the kernel silently ignores a value it does not
know, so a typo would leave the widest SIMD path on while the user believes
it capped.
"""

import importlib
import os
import warnings

from . import _blas_pool, _openmp_wait

#: SIMD paths whose bfloat16 problems take bfloat16 dot products (vdpbf16ps or AMX
#: tiles, attn/_src/attn_simd_bf16dot.h): P is then rounded to bfloat16 before P V,
#: as in torch's bfloat16 SDPA; other paths keep it in float32.
BF16_PRODUCT_PATHS = ("avx512-bf16", "avx512-amx")


def check_simd_env(value, caps):
    """Warn when ``value`` (ATTN_SIMD's, or None) is not one of ``caps``, the values the kernel
    accepts (attn._kernels.simd_caps, from attn/_src/attn_dispatch.h).

    Returns
    -------
    bool
        True when ``value`` is unset, empty or valid.
    """
    if value is None or value == "" or value in caps:
        return True
    warnings.warn(
        f"ATTN_SIMD={value!r} is not a valid value and is ignored: use one of "
        f"{', '.join(repr(v) for v in caps)} to cap the kernel's SIMD path, or leave it unset "
        f"for the widest path this CPU supports",
        RuntimeWarning, stacklevel=2)
    return False


# the compiled forward, by role: the problem builder, the kernel, the fast path, the bfloat16 casts
try:
    with _openmp_wait.short_spin_while_loading():  # attn's threads spin briefly, then sleep (see there)
        _kernels = importlib.import_module("attn._kernels")
        _problem = importlib.import_module("attn._problem")
        _fast_path = importlib.import_module("attn._fast_path")
        _casts = importlib.import_module("attn._casts")
except ImportError as exc:  # not built (e.g. a source tree without build_ext)
    _kernels = _problem = _fast_path = _casts = None
    HAVE_CYTHON = False
    CYTHON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HAVE_CYTHON = True
    CYTHON_IMPORT_ERROR = None

# new keys and values into a paged cache in one call (the vLLM backend's cache update); optional: without
# it the caller indexes
try:
    _cache_write = importlib.import_module("attn._cache_write")
except ImportError:
    _cache_write = None

# the kernel ignores an ATTN_SIMD value it does not know (it read it at its import)
SIMD_ENV_OK = check_simd_env(os.environ.get("ATTN_SIMD"), _kernels.simd_caps()) if HAVE_CYTHON else True

# the fused backward (FlashAttention-2): its own extension, optional like attn._kernels,
# whose instruction-set path and operand descriptor it uses (it imports attn._kernels)
try:
    _kernels_backward = importlib.import_module("attn._kernels_backward")
except ImportError as exc:
    _kernels_backward = None
    HAVE_BACKWARD = False
    BACKWARD_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HAVE_BACKWARD = True
    BACKWARD_IMPORT_ERROR = None

# NumPy's OpenBLAS runs its parallel jobs on the kernels' OpenMP team: one pool of
# threads for both libraries, not two fighting for the cores (see attn/_blas_pool.py);
# the callback's extension is optional like the others, and of use only where the
# kernels run on OpenMP (their team is the pool)
try:
    _blas_callback = importlib.import_module("attn._blas_callback")
except ImportError:
    _blas_callback = None

_blas_pool.enable_unless_disabled_by_env(
    _blas_callback if HAVE_CYTHON and _kernels.build_info()["openmp"] else None)
