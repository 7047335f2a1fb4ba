"""The element types attn computes with: float16, bfloat16, float32 and float64.

NumPy has no bfloat16 of its own; attn takes ``ml_dtypes.bfloat16`` (the
bfloat16 of JAX and TensorFlow, a dependency of attn), recognised by its
dtype, and torch's ``torch.bfloat16`` tensors viewed as it (no copy,
:mod:`attn._interop`). 16-bit types are computed in float32 and rounded once
on output, as torch's CPU kernels do; a float16 or bfloat16 key/value cache is
read in place by the fused kernel and widened in registers.
"""

import functools

import numpy as np

from . import _build, _threads

#: How error messages name the supported floating dtypes.
SUPPORTED = "float16, bfloat16, float32 or float64"


def is_bfloat16(dtype):
    """True for ml_dtypes' bfloat16 (the only 2-byte float NumPy knows by that name)."""
    return dtype.name == "bfloat16" and dtype.itemsize == 2


@functools.cache
def bfloat16():
    """``np.dtype(ml_dtypes.bfloat16)`` (imports ml_dtypes on the first call)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


#: The float8 formats a key/value cache may hold (ml_dtypes' names; torch.float8_e4m3fn, torch.float8_e5m2).
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")

#: Largest finite value of each float8 format (e4m3fn has no infinity: it saturates here).
FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def is_float8(dtype):
    """True for ml_dtypes' float8_e4m3fn and float8_e5m2 (a cache's storage: read in place, widened exactly)."""
    return dtype.itemsize == 1 and dtype.name in FLOAT8


@functools.cache
def float8(name):
    """``np.dtype(ml_dtypes.<name>)`` for a name of :data:`FLOAT8`."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def is_float(dtype):
    """Whether attn computes with ``dtype``: float16/32/64 or bfloat16."""
    return (dtype.kind == "f" and dtype.itemsize in (2, 4, 8)) or is_bfloat16(dtype)


def is_16bit(dtype):
    """float16 or bfloat16: stored in 16 bits, computed in float32."""
    return dtype.itemsize == 2 and is_float(dtype)


def compute_dtype(dtype):
    """The dtype the kernels compute in: float16 and bfloat16 are computed in float32."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if is_16bit(dtype) else dtype


def unit_roundoff(dtype):
    """u = eps / 2 of a supported float dtype (bfloat16: 2**-8)."""
    dtype = np.dtype(dtype)
    if is_bfloat16(dtype):
        return 2.0 ** -8
    return float(np.finfo(dtype).eps) / 2


def as_dtype(dtype, name="dtype"):
    """A supported float dtype from a NumPy dtype, its name or a torch dtype
    (``"bfloat16"`` and ``torch.bfloat16`` give ml_dtypes' bfloat16); else TypeError naming ``name``."""
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    if text == "bfloat16":
        return bfloat16()
    try:
        dt = np.dtype(text if str(dtype).startswith("torch.") else dtype)
    except TypeError:
        dt = None
    if dt is None or not is_float(dt):
        raise TypeError(f"{name} must be {SUPPORTED}, got {dtype!r}")
    return dt


def cast(a, dtype):
    """``a.astype(dtype, copy=False)``, with float32 <-> bfloat16 and float32 <->
    float16 of a C-contiguous array by the compiled converters (the same
    rounding as ml_dtypes and numpy: to nearest even; NaN to a quiet NaN with
    its sign; ml_dtypes' and numpy's own casts take about 1 ns an element, as
    long as a small attention call itself; float16 needs F16C, else numpy's)."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if a.flags.c_contiguous and _build._casts is not None:
        if (a.dtype == np.float32 and is_bfloat16(dtype)) or (is_bfloat16(a.dtype) and dtype == np.float32):
            return _build._casts.cast_bf16(a, dtype, _threads.get_num_threads())
        if {a.dtype, dtype} == {np.dtype(np.float32), np.dtype(np.float16)}:
            out = _build._casts.cast_f16(a, dtype, _threads.get_num_threads())
            if out is not None:
                return out
    return a.astype(dtype)
