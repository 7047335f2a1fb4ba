"""The kernels' operands: any NumPy layout described to the kernels without copying.

The kernels see an operand as a base pointer plus, for every matrix of the
(broadcast) batch, an element offset, and element strides for rows and
columns. Broadcast dims have stride 0, negative strides give negative offsets,
and a grouped-query head dim maps query head ``h`` to key/value head
``h // group``. Nothing is copied unless a stride is not a whole number of
elements (a view into a structured array), which the kernels cannot express,
or the data is not aligned to its itemsize.
"""

import numpy as np

from . import _build


def element_strides(a):
    """Strides of ``a`` in elements, or None when not whole elements."""
    size, strides = a.itemsize, a.strides
    elements = tuple([s // size for s in strides])  # (list comprehensions: the fast path)
    if [e * size for e in elements] != list(strides):
        return None
    return elements


def expressible(a):
    """``a`` itself, or a copy when its strides are not whole elements or its data is misaligned.

    (A float64 view at an odd byte offset of a buffer is legal NumPy but a
    misaligned load in C, undefined behaviour.) The copy is of the distinct
    elements only: broadcast (stride-0) dims are copied at size 1 and
    broadcast again, so it is never larger than ``a``'s data.
    """
    if a.flags.aligned and element_strides(a) is not None:
        return a
    if 0 in a.strides and a.size > 0:
        core = a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]
        return np.broadcast_to(core.copy(order="C"), a.shape)
    return a.copy(order="C")  # a fresh allocation: aligned (ascontiguousarray may return ``a``)


def matrix_offsets(a, batch, n_inner=2, group=1):
    """Element offset of every inner block of ``a`` over the broadcast ``batch``.

    Computed by the compiled kernels' one offset routine
    (``attn._problem.fill_offsets``), which the per-call fast path runs too.

    Parameters
    ----------
    a : ndarray, shape [*lead, *inner] with ``len(inner) == n_inner`` and
        ``lead`` broadcastable to ``batch`` (with ``group > 1``, ``lead[-1]``
        times ``group`` equals ``batch[-1]``); strides in whole elements.
    batch : tuple of int
    group : int
        Grouped-query factor of the head dim (the last dim of ``lead``).

    Returns
    -------
    ndarray of int64, shape [prod(batch)], C order over ``batch``.
    """
    return _build._problem.matrix_offsets(a, tuple(batch), n_inner, group)


def describe(a, batch, n_inner=2, group=1):
    """Everything the kernels need of operand ``a``, computing its strides once.

    Returns
    -------
    (a or an expressible copy, int64 offsets [prod(batch)], the last ``n_inner`` element strides)
    """
    strides = element_strides(a) if a.flags.aligned else None
    if strides is None:
        a = expressible(a)
        strides = element_strides(a)
    offsets = matrix_offsets(a, batch, n_inner, group)
    return a, offsets, strides[a.ndim - n_inner:]
