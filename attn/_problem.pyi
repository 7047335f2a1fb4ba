"""Type stub of the compiled module attn._problem (see attn/_problem.pyx): the one problem builder,
whose C-level functions the other compiled modules cimport; from Python the offsets and the outs' allocator."""

from typing import Tuple

import numpy as np
import numpy.typing as npt

def empty_out(shape: Tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[np.generic]: ...
def matrix_offsets(a: npt.NDArray[np.generic], batch: Tuple[int, ...], n_inner: int, group: int) -> npt.NDArray[np.int64]: ...
