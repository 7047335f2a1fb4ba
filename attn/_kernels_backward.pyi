"""Type stub of the compiled module attn._kernels_backward (see attn/_kernels_backward.pyx)."""

from typing import List, Optional, Tuple, TypedDict

import numpy as np
import numpy.typing as npt

class BuildInfo(TypedDict):
    openmp: bool
    max_threads: int
    debug: bool
    simd: str

def backward(
    q: npt.NDArray[np.floating],
    k: npt.NDArray[np.floating],
    v: npt.NDArray[np.floating],
    mask: Optional[npt.NDArray[np.generic]],
    out: npt.NDArray[np.floating],
    dout: npt.NDArray[np.floating],
    lse: npt.NDArray[np.floating],
    dq: npt.NDArray[np.floating],
    dk: npt.NDArray[np.floating],
    dv: npt.NDArray[np.floating],
    ds: Optional[npt.NDArray[np.floating]],
    q_off: npt.NDArray[np.int64],
    k_off: npt.NDArray[np.int64],
    v_off: npt.NDArray[np.int64],
    m_off: npt.NDArray[np.int64],
    q_strides: Tuple[int, int],
    k_strides: Tuple[int, int],
    v_strides: Tuple[int, int],
    m_strides: Tuple[int, int],
    causal: bool,
    causal_offset: int,
    scale: float,
    num_threads: int,
) -> None: ...
def lse(
    q: npt.NDArray[np.floating],
    k: npt.NDArray[np.floating],
    mask: Optional[npt.NDArray[np.generic]],
    lse: npt.NDArray[np.floating],
    q_off: npt.NDArray[np.int64],
    k_off: npt.NDArray[np.int64],
    m_off: npt.NDArray[np.int64],
    q_strides: Tuple[int, int],
    k_strides: Tuple[int, int],
    m_strides: Tuple[int, int],
    causal: bool,
    causal_offset: int,
    scale: float,
    num_threads: int,
) -> None: ...
def simd_paths() -> List[str]: ...
def simd_path() -> str: ...
def _select_simd(name: str) -> str: ...
def build_info() -> BuildInfo: ...
