"""Memory layouts for the tests: the same values stored every way NumPy allows.

One place for every layout the suite feeds to attn (test_edges, test_layouts,
test_properties, the offsets test). Imported by the test modules directly,
not through conftest.
"""

import numpy as np

# Layouts that keep the values (relayout(a, name) == a elementwise).
SAME_VALUES = ("c", "fortran", "negative", "strided", "row_padded", "row_strided", "transposed",
               "read_only", "big_endian", "misaligned")
# Plus the ones that need a directory (memmap) or change the values (row_broadcast: every row = row 0).
ALL = SAME_VALUES + ("memmap", "row_broadcast")


def misaligned(a):
    """A copy of ``a`` whose data starts 1 byte past an aligned address (legal NumPy)."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = np.frombuffer(buf.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    return out


def relayout(a, layout, tmp_path=None, name="a"):
    """``a`` stored in ``layout`` (one of ``ALL``; "memmap" needs ``tmp_path``, a directory).

    Layouts a 0-d or empty array cannot take, or that need 2 dims, fall back
    to a contiguous copy.
    """
    a = np.asarray(a)
    if layout == "c" or a.ndim == 0 or a.size == 0:
        return np.ascontiguousarray(a)
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "negative":  # every stride < 0, same values
        flip = (slice(None, None, -1),) * a.ndim
        return np.ascontiguousarray(a[flip])[flip]
    if layout == "strided":  # every other column: column stride 2 items
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if layout == "row_padded":  # contiguous rows, row stride 2 * (row length)
        return np.concatenate([a, a], axis=-1)[..., : a.shape[-1]]
    if layout == "row_strided" and a.ndim >= 2:  # every third row of a larger array
        return np.repeat(a, 3, axis=-2)[..., ::3, :]
    if layout == "transposed" and a.ndim >= 2:  # last two dims column-major
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(a, -1, -2)), -1, -2)
    if layout == "read_only":
        out = a.copy()
        out.flags.writeable = False
        return out
    if layout == "big_endian":  # non-native byte order (on a little-endian machine)
        return a.astype(a.dtype.newbyteorder(">" if np.little_endian else "<"))
    if layout == "misaligned":
        return misaligned(a)
    if layout == "memmap":  # read-only file mapping
        path = tmp_path / f"{name}-{layout}.bin"
        np.ascontiguousarray(a).tofile(path)
        return np.memmap(path, dtype=a.dtype, mode="r", shape=a.shape)
    if layout == "row_broadcast" and a.ndim >= 2:  # stride 0 over rows: CHANGES the values
        return np.broadcast_to(a[..., :1, :], a.shape)
    if layout in ALL:
        return np.ascontiguousarray(a)
    raise ValueError(f"unknown layout {layout!r}")


def layouts(arrays, names=SAME_VALUES, tmp_path=None):
    """``(name, relaid arrays)`` for each layout in ``names``, every array in that layout.

    ``arrays`` is a tuple (e.g. q, k, v); "mixed" in ``names`` gives q
    row_padded, k row_strided, v strided (three different strides at once).
    """
    mixed = ("row_padded", "row_strided", "strided")
    for layout in names:
        per_array = mixed if layout == "mixed" else (layout,) * len(arrays)
        yield layout, tuple(relayout(a, lay, tmp_path, f"{i}") for i, (a, lay) in enumerate(zip(arrays, per_array)))


def offset_layouts(rng):
    """``(name, operand, batch, group)``: leading dims that take every path of ``matrix_offsets``."""
    base = rng.standard_normal((2, 3, 4, 5))
    yield "contiguous", base, (2, 3), 1
    yield "heads_swapped", base.transpose(1, 0, 2, 3).copy().transpose(1, 0, 2, 3), (2, 3), 1
    yield "negative", base[::-1, ::-1], (2, 3), 1
    yield "size_one_dim_odd_stride", np.lib.stride_tricks.as_strided(
        base, (2, 1, 4, 5), (base.strides[0], 8 * 999, *base.strides[2:])), (2, 1), 1
    yield "broadcast_batch", base[:1], (2, 3), 1
    yield "stride_zero_heads", np.broadcast_to(base[:, :1], (2, 3, 4, 5)), (2, 3), 1
    yield "fewer_dims", base[0], (2, 3), 1
    yield "every_other_matrix", rng.standard_normal((2, 6, 4, 5))[:, ::2], (2, 3), 1
    yield "gqa", base, (2, 6), 2
    yield "no_lead", base[0, 0], (), 1
