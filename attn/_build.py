"""Whether the compiled kernels are importable, and what they were built with."""

import importlib

try:
    _kernels = importlib.import_module("attn._kernels")
except ImportError as exc:  # not built (e.g. a source tree without build_ext)
    _kernels = None
    HAVE_CYTHON = False
    CYTHON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HAVE_CYTHON = True
    CYTHON_IMPORT_ERROR = None

try:  # the fused backward (FlashAttention-2): its own extension, optional like attn._kernels
    _kernels_backward = importlib.import_module("attn._kernels_backward")
except ImportError as exc:
    _kernels_backward = None
    HAVE_BACKWARD = False
    BACKWARD_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    HAVE_BACKWARD = True
    BACKWARD_IMPORT_ERROR = None
