"""Whether the compiled kernels are importable, and what they were built with.

Also checks ``ATTN_SIMD`` before the kernel reads it: the kernel silently
ignores a value it does not know, so a typo would leave the widest SIMD path
on while the user believes it capped.
"""

import importlib
import os
import warnings

from . import _openmp_wait

#: Values of ATTN_SIMD the kernel accepts (attn/_src/attn_simd.h, attn_simd_init):
#: each caps the SIMD path the kernel picks; unset or empty, it takes the widest the CPU has.
SIMD_ENV_VALUES = ("generic", "avx2", "avx512", "avx512-bf16")

#: SIMD paths whose bfloat16 problems take bfloat16 dot products (vdpbf16ps or AMX
#: tiles, attn/_src/attn_simd_bf16dot.h): P is then rounded to bfloat16 before P V,
#: as in torch's bfloat16 SDPA; other paths keep it in float32.
BF16_PRODUCT_PATHS = ("avx512-bf16", "avx512-amx")


def check_simd_env(value):
    """Warn when ``value`` (ATTN_SIMD's, or None) is not one the kernel accepts.

    Returns
    -------
    bool
        True when ``value`` is unset, empty or valid.
    """
    if value is None or value == "" or value in SIMD_ENV_VALUES:
        return True
    warnings.warn(
        f"ATTN_SIMD={value!r} is not a valid value and is ignored: use one of "
        f"{', '.join(repr(v) for v in SIMD_ENV_VALUES)} to cap the kernel's SIMD path, or leave it unset "
        f"for the widest path this CPU supports",
        RuntimeWarning, stacklevel=2)
    return False


SIMD_ENV_OK = check_simd_env(os.environ.get("ATTN_SIMD"))

try:
    with _openmp_wait.short_spin_while_loading():  # attn's threads spin briefly, then sleep (see there)
        _kernels = importlib.import_module("attn._kernels")
except ImportError as exc:  # not built (e.g. a source tree without build_ext)
    _kernels = None
    HAVE_CYTHON = False
    CYTHON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HAVE_CYTHON = True
    CYTHON_IMPORT_ERROR = None

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
# threads for both libraries, not two fighting for the cores (see attn/_blas_pool.py)
from . import _blas_pool  # noqa: E402

_blas_pool.enable_unless_disabled_by_env()
