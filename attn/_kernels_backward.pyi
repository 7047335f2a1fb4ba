"""Type stub of the compiled module attn._kernels_backward (see attn/_kernels_backward.pyx)."""

from typing import Optional, Tuple

import numpy as np
import numpy.typing as npt

from attn._variants import Variants

# the operands as attn._kernels.attention takes them (see attn/_backends/fused.py)
_Array = npt.NDArray[np.floating]
_Mask = Optional[npt.NDArray[np.generic]]
_Offsets = npt.NDArray[np.int64]
_Strides = Tuple[int, int]
_Variants = Optional[Variants]  # attn._variants.Variants

def backward(
    q: _Array, k: _Array, v: _Array, mask: _Mask,
    out: _Array, dout: _Array, lse: _Array, dq: _Array, dk: _Array, dv: _Array, ds: Optional[_Array],
    q_off: _Offsets, k_off: _Offsets, v_off: _Offsets, m_off: _Offsets,
    q_strides: _Strides, k_strides: _Strides, v_strides: _Strides, m_strides: _Strides,
    causal_offset: Optional[int], scale: float, num_threads: int, variants: _Variants = None,
    varlen: Optional[npt.NDArray[np.int64]] = None, n_k: int = 0, bf16: bool = False,
) -> None: ...
