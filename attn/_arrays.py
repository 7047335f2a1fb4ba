"""Arrays as attn takes them: a float ndarray in native byte order, or a TypeError naming the argument.

The lowest layer of the argument checks (only :mod:`attn._dtypes` below it):
:mod:`attn._validation` and :mod:`attn._quantized` both build on it.
"""

import numpy as np

from . import _dtypes


def describe_array(a):
    """``'shape (..) and dtype ..'``: how every error message names an array."""
    return f"shape {tuple(a.shape)} and dtype {a.dtype}"


def as_array(x, name):
    """``np.asarray(x)``; a ragged or otherwise unconvertible input is a TypeError naming ``name``."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:  # e.g. ragged nested lists
        raise TypeError(f"{name} must be an array; np.asarray({name}) failed: {exc}") from None


def as_float_array(x, name):
    """``x`` as an ndarray of float16/bfloat16/float32/float64 in native byte order, else TypeError
    naming ``name``."""
    if x is None:
        raise TypeError(f"{name} must be an array of floats, got None")
    a = as_array(x, name)
    if _dtypes.is_float8(a.dtype):
        raise TypeError(f"{name} is float8 ({describe_array(a)}): attn reads float8 as a key/value cache, in "
                        f"attn.flash.flash_attn_with_kvcache and flash_attn_varlen_func (with k_descale, "
                        f"v_descale); elsewhere pass {_dtypes.SUPPORTED}")
    if not _dtypes.is_float(a.dtype):
        raise TypeError(
            f"{name} must have dtype {_dtypes.SUPPORTED} (bfloat16: ml_dtypes.bfloat16); "
            f"got {describe_array(a)}"
        )
    if not a.dtype.isnative:  # e.g. big-endian data: the kernels read native floats
        a = astype_no_broadcast_copy(a, a.dtype.newbyteorder("="))
    return a


def astype_no_broadcast_copy(a, dtype):
    """``a.astype(dtype)``, converting each distinct element once.

    A broadcast (stride-0) dim is converted at size 1 and broadcast again, so
    the copy is never larger than the memory ``a`` really spans (times the
    itemsize ratio), however large its broadcast shape.
    """
    if a.dtype == dtype:
        return a
    if 0 in a.strides and a.size > 0:
        core = a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]
        return np.broadcast_to(_dtypes.cast(core, dtype), a.shape)
    return _dtypes.cast(a, dtype)
