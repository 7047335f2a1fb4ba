"""Type stub of the compiled module attn._kernels (see attn/_kernels.pyx)."""

from typing import Optional, Tuple, TypedDict

import numpy as np
import numpy.typing as npt

from attn._variants import Variants

class BuildInfo(TypedDict):
    openmp: bool
    max_threads: int
    debug: bool
    simd: str

def attention(
    q: npt.NDArray[np.floating],
    k: npt.NDArray[np.floating],
    v: npt.NDArray[np.floating],
    mask: Optional[npt.NDArray[np.generic]],
    out: npt.NDArray[np.floating],
    weights: Optional[npt.NDArray[np.floating]],
    q_off: npt.NDArray[np.int64],
    k_off: npt.NDArray[np.int64],
    v_off: npt.NDArray[np.int64],
    m_off: npt.NDArray[np.int64],
    q_strides: Tuple[int, int],
    k_strides: Tuple[int, int],
    v_strides: Tuple[int, int],
    m_strides: Tuple[int, int],
    causal_offset: Optional[int],  # None: not causal; else key j visible to row i iff j <= i + causal_offset
    scale: float,
    num_threads: int,
    lse: Optional[npt.NDArray[np.floating]] = None,
    variants: Optional[Variants] = None,
    varlen: Optional[npt.NDArray[np.int64]] = None,  # [5, n_batch]: n_q, n_k, shift, out and lse offsets
    out_rs: int = 0,
    dims: Optional[Tuple[int, int, int, int, int]] = None,  # (n_batch, n_q, n_k, d_k, d_v) with varlen
    q_bf16: bool = False,  # q holds bfloat16 values: the avx512-bf16 path's bfloat16 products
    # (pages int32, page_rows int64 [n_batch], page_size, k_page, v_page): a paged K/V
    paged: Optional[Tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], int, int, int]] = None,
    kv_len: Optional[npt.NDArray[np.int64]] = None,  # [n_batch] keys each matrix sees
) -> None: ...
def attention_overlapped(
    first: tuple,  # attention's arguments from q to kv_len, in order (no num_threads)
    second: tuple,  # the same for a call whose outputs do not overlap first's
    num_threads: int,
) -> None: ...
def masked_softmax(
    x: npt.NDArray[np.floating],
    mask: Optional[npt.NDArray[np.generic]],
    out: npt.NDArray[np.floating],
    x_off: npt.NDArray[np.int64],
    m_off: npt.NDArray[np.int64],
    x_stride: int,
    m_stride: int,
    num_threads: int,
) -> None: ...
def fork_state() -> tuple[bool, int]: ...
def max_threads() -> int: ...
def simd_caps() -> list[str]: ...
def simd_paths() -> list[str]: ...
def q8_rounds_query(n_q: int, d_k: int) -> bool: ...
def build_info() -> BuildInfo: ...
