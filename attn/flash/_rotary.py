"""Rotary position embedding (RoPE) as FlashAttention's ``flash_attn_with_kvcache`` applies it.

With ``cos``, ``sin`` of shape [seqlen_ro, rotary_dim / 2], the first
``rotary_dim`` features of a token at position t are rotated pairwise by the
angles of row t; the rest pass unchanged. The pairs are

* interleaved (GPT-J, ``rotary_interleaved=True``): features (2i, 2i + 1);
* not interleaved (GPT-NeoX): features (i, i + rotary_dim / 2);

and a pair (x1, x2) becomes (x1 cos_i - x2 sin_i, x1 sin_i + x2 cos_i).
Computed in float32 (float64 for float64 inputs) and rounded once to the
input's dtype.
"""

import numpy as np

from .. import _dtypes
from .._validation import as_float_array, describe_array


def check_tables(cos, sin, head_dim):
    """``(cos, sin)`` as float arrays [seqlen_ro, rotary_dim / 2], or a TypeError/ValueError."""
    cos, sin = as_float_array(cos, "rotary_cos"), as_float_array(sin, "rotary_sin")
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must both have shape [seqlen_ro, rotary_dim / 2]; got "
                         f"rotary_cos with {describe_array(cos)} and rotary_sin with {describe_array(sin)}")
    if not 0 < 2 * cos.shape[1] <= head_dim:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1] = {2 * cos.shape[1]}) must be in "
                         f"[2, headdim = {head_dim}]")
    return cos, sin


def apply(x, cos, sin, positions, interleaved):
    """``x`` [B, L, H, D] with its tokens rotated at ``positions`` [B, L] (int); a new array.

    The caller checked ``positions < len(cos)``.
    """
    cdtype = _dtypes.compute_dtype(x.dtype)
    rd = 2 * cos.shape[1]
    c = cos.astype(cdtype)[positions][:, :, None, :]  # [B, L, 1, rd / 2]
    s = sin.astype(cdtype)[positions][:, :, None, :]
    y = x.astype(cdtype)  # a copy: the caller's tokens are not changed
    r = y[..., :rd]
    if interleaved:
        x1, x2 = r[..., 0::2].copy(), r[..., 1::2].copy()
        r[..., 0::2], r[..., 1::2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = r[..., : rd // 2].copy(), r[..., rd // 2:].copy()
        r[..., : rd // 2], r[..., rd // 2:] = x1 * c - x2 * s, x1 * s + x2 * c
    return _dtypes.cast(y, x.dtype)
