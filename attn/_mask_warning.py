"""Warn when a boolean mask looks like a causal mask in the wrong convention.

A causal mask written "True = masked" (``np.triu(ones, k=1)``, what the seed
article's NumPy code and ``nn.MultiheadAttention`` use) is strictly upper
triangular. Passed to SDPA, whose bool convention is "True = takes part", it
lets every query row see only *future* keys and leaves the last row with no
key at all. Nothing raises; the model silently attends to the wrong tokens.

:func:`warn_if_inverted_causal` spots exactly that mask and emits one
``UserWarning`` per call site (the default warnings filter shows a warning
once per location). Cost: O(1) probes of a few entries reject almost every
other mask; only a mask that passes them is compared in full, block by block,
with temporaries no larger than the mask itself.
"""

import os
import sys
import warnings

import numpy as np

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BLOCKS = 4  # the full comparison walks the rows in this many blocks


def _strictly_upper_at(i, j, offset):
    """True where the inverted-causal pattern has True: key j is after row i (+ offset)."""
    return j > i + offset


def _probe(m2, offset):
    """Cheap test of a few entries of one [L, S] slice against the pattern."""
    n_q, n_k = m2.shape
    mid = n_q // 2
    points = {(0, 0), (0, n_k - 1), (n_q - 1, 0), (n_q - 1, n_k - 1), (mid, 0), (mid, n_k - 1)}
    diag = mid + offset  # the last key hidden from row `mid`, and the first one shown
    points.update((mid, j) for j in (diag, diag + 1) if 0 <= j < n_k)
    return all(bool(m2[i, j]) == _strictly_upper_at(i, j, offset) for i, j in points)


def _distinct(m):
    """``m`` without its broadcast (stride 0) leading dims: the slices that differ."""
    return m[tuple(0 if st == 0 else slice(None) for st in m.strides[:-2])]


def _matches(m, offset):
    """Full comparison of every distinct [..., L, S] slice, in row blocks."""
    m = _distinct(m)
    n_q, n_k = m.shape[-2:]
    cols = np.arange(n_k)
    step = -(-n_q // _BLOCKS)  # ceil(n_q / _BLOCKS) rows per block
    for start in range(0, n_q, step):
        rows = np.arange(start, min(start + step, n_q))[:, None]  # [b, 1]
        pattern = _strictly_upper_at(rows, cols, offset)  # [b, 1] vs [n_k] -> [b, n_k]
        if not np.array_equal(m[..., start:start + step, :], np.broadcast_to(
                pattern, m.shape[:-2] + pattern.shape)):
            return False
    return True


def is_inverted_causal(mask):
    """Whether a bool mask is exactly "key after query" (strictly upper triangular).

    Parameters
    ----------
    mask : ndarray of bool, shape [..., L, S]
        Every [L, S] slice is tested; leading dims may broadcast (stride 0).

    Returns
    -------
    bool
        True when each slice equals ``np.triu(np.ones((L, S), bool), k=1)``,
        or its lower-right aligned form ``k = S - L + 1``, with L, S >= 2.
    """
    if mask.dtype != np.bool_ or mask.ndim < 2 or min(mask.shape[-2:]) < 2 or mask.size == 0:
        return False
    n_q, n_k = mask.shape[-2:]
    first = mask[(0,) * (mask.ndim - 2)]  # [L, S], a view
    offsets = {0, n_k - n_q}
    return any(_probe(first, o) and _matches(mask, o) for o in offsets)


def caller_stacklevel():
    """The ``stacklevel`` that points a warning at the first frame outside attn.

    Every entry point (the functions, ``MultiheadAttention``, the demos' callers)
    reaches the check through a different number of attn frames; counting
    them makes the warning name the user's line from all of them.
    """
    frame, level = sys._getframe(1), 1  # level 1: the function calling warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_inverted_causal(mask, name="attn_mask"):
    """Emit a ``UserWarning`` at the user's call when ``mask`` is an inverted causal mask.

    Parameters
    ----------
    mask : ndarray
        The mask as the caller passed it (before broadcasting).
    name : str
        The argument's name, for the message.
    """
    if not is_inverted_causal(mask):
        return
    warnings.warn(
        f"{name} is strictly upper triangular: with the bool convention of SDPA "
        "(True = the key takes part) every query sees only keys after its own "
        "position, and the last query of a square mask sees none. This is what a causal mask written 'True = masked' (as for "
        "nn.MultiheadAttention) looks like. Pass its negation (~mask, i.e. "
        "np.tril(np.ones((L, S), bool))) or is_causal=True instead. Silence with "
        f"warnings.filterwarnings('ignore', message='{name} is strictly upper').",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )
