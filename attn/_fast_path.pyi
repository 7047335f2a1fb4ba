"""Type stub of the compiled module attn._fast_path (see attn/_fast_path.pyx)."""

from typing import Optional

import numpy as np
import numpy.typing as npt

def bind_validation(decide: object, q8_tensor: type) -> None: ...
def sdpa_fast(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
    backend: object,
    return_weights: object,
    num_threads: object,
    check_memory_above: int,
) -> Optional[npt.NDArray[np.floating]]: ...
def flash_dense_fast(
    query: object,
    key: object,
    value: object,
    causal: bool,
    scale: float,
    threads: int,
    check_memory_above: int,
) -> Optional[npt.NDArray[np.floating]]: ...
