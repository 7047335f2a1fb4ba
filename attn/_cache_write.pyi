"""Type stub of the compiled module attn._cache_write (see attn/_cache_write.pyx)."""

import numpy as np
import numpy.typing as npt

def write_pages(k_new: npt.NDArray[np.generic], v_new: npt.NDArray[np.generic], k_pages: npt.NDArray[np.generic],
                v_pages: npt.NDArray[np.generic], block: npt.NDArray[np.int64], row: npt.NDArray[np.int64]) -> None: ...
