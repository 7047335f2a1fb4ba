"""Type stub of the compiled module attn._casts (see attn/_casts.pyx)."""

import numpy as np
import numpy.typing as npt

def cast_bf16(x: npt.NDArray[np.generic], dtype: np.dtype, num_threads: int) -> npt.NDArray[np.generic]: ...
def cast_f16(x: npt.NDArray[np.generic], dtype: np.dtype, num_threads: int) -> npt.NDArray[np.generic] | None: ...
