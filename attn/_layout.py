"""Describe any NumPy layout to the kernels without copying.

The kernels see an operand as a base pointer plus, for every matrix of the
(broadcast) batch, an element offset, and element strides for rows and
columns. Broadcast dims have stride 0, negative strides give negative offsets,
and a grouped-query head dim maps query head ``h`` to key/value head
``h // group``. Nothing is copied unless a stride is not a whole number of
elements (a view into a structured array), which the kernels cannot express,
or the data is not aligned to its itemsize.
"""

import math

import numpy as np


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


def _c_order_step(shape, strides):
    """The stride of the last dim when ``shape``/``strides`` are C-ordered, else None.

    C-ordered: every dim of size > 1 steps over the whole of the dims after it,
    so matrix ``b`` of the flattened dims starts at ``b * step``.
    """
    if not shape:
        return 0
    step = expected = strides[-1]
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return step


def matrix_offsets(a, batch, n_inner=2, group=1, strides=None):
    """Element offset of every inner block of ``a`` over the broadcast ``batch``.

    Parameters
    ----------
    a : ndarray, shape [*lead, *inner] with ``len(inner) == n_inner`` and
        ``lead`` broadcastable to ``batch`` (with ``group > 1``, ``lead[-1]``
        times ``group`` equals ``batch[-1]``).
    batch : tuple of int
    group : int
        Grouped-query factor of the head dim (the last dim of ``lead``).
    strides : tuple of int, optional
        ``element_strides(a)``, when the caller has it already.

    Returns
    -------
    ndarray of int64, shape [prod(batch)], C order over ``batch``.
    """
    if strides is None:
        strides = element_strides(a)
    lead, lead_strides = a.shape[: a.ndim - n_inner], strides[: a.ndim - n_inner]
    if group == 1 and lead == tuple(batch):
        step = _c_order_step(lead, lead_strides)  # the common case: one arange
        n = math.prod(batch)
        if step:
            return np.arange(0, n * step, step, dtype=np.int64)  # [n]: b * step
        if step == 0:
            return np.zeros(n, dtype=np.int64)
    offsets = np.zeros(batch, dtype=np.int64)
    first = len(batch) - len(lead)  # lead is right-aligned with batch
    for d, (size, stride) in enumerate(zip(lead, lead_strides)):
        if size == 1 or stride == 0:
            continue  # broadcast dim: every index reads the same matrix
        n = batch[first + d]
        index = np.arange(n, dtype=np.int64)
        if group > 1 and d == len(lead) - 1:
            index //= group  # query head h reads key/value head h // group
        shape = [1] * len(batch)
        shape[first + d] = n
        offsets += (index * stride).reshape(shape)
    return offsets.reshape(math.prod(batch))


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
    offsets = matrix_offsets(a, batch, n_inner, group, strides=strides)
    return a, offsets, strides[a.ndim - n_inner:]
