"""8-bit keys and values: llama.cpp's q8_0 quantization, read in place by the fused kernel.

A row of ``E`` values is cut into groups of 32 (the last one shorter when
``E`` is not a multiple of 32). Group ``g`` keeps one scale and 32 signed
bytes::

    d_g = max |x_g| / 127   (rounded up to a float32, so |x / d_g| <= 127)
    q   = round(x / d_g)    (int8, in [-127, 127]; all 0 when d_g = 0)
    x^  = q * d_g           (what attention computes with)

A row is stored as its ``E`` int8 values followed by its ``ceil(E / 32)``
float32 scales: ``E + 4 ceil(E / 32)`` bytes, 1.125 bytes a value at E = 64 or
128 (float16: 2). The fused kernel reads these rows where they are and
multiplies each widened vector of 16 (AVX-512) or 8 (AVX2) values by its
group's scale in registers (attn/_src/attn_simd_impl.h, ``KV_VLOAD_AT``).

The scale is a float32 where llama.cpp's block_q8_0 keeps a float16: two
bytes more per 32 values (1.125 instead of 1.0625 bytes a value) buy a scale
with no rounding of its own and the range of float32 (a float16 scale
underflows below 6e-8 and overflows above 65504 x 127).

Error (docs/kv_cache_int8.md): each value is off by at most
``d_g (1/2 + 127 u)`` (u = 2**-24: the float32 product q d_g;
:func:`value_error`), which bounds each attention output as derived there
(:func:`attention_error`).
"""

import numpy as np

from . import _dtypes
from ._arrays import as_float_array

GROUP = 32  # values per scale (llama.cpp's QK8_0)


def row_bytes(dim):
    """Bytes of one quantized row of ``dim`` values: the values, then the float32 scales."""
    return dim + 4 * n_groups(dim)


def n_groups(dim):
    """Scales of a row of ``dim`` values: ``ceil(dim / 32)``."""
    return -(-dim // GROUP)


def _by_group(x, dtype):
    """``x`` [..., E] in ``dtype``, zero-padded to whole groups: [..., ceil(E / 32), 32]."""
    dim = x.shape[-1]
    g = n_groups(dim)
    padded = np.zeros(x.shape[:-1] + (g * GROUP,), dtype)
    padded[..., :dim] = x
    return padded.reshape(x.shape[:-1] + (g, GROUP))  # [..., E'] -> [..., G, 32]


class Q8Tensor:
    """Keys or values of shape ``[..., S, E]`` stored as q8_0 rows (8-bit values, a float32 scale per 32).

    Made by :meth:`quantize` or by ``attn.KVCache(..., dtype="int8")``, and
    passed as ``key`` and ``value`` of :func:`attn.scaled_dot_product_attention`
    (both quantized, the query float32, float16 or bfloat16; computed in
    float32). The fused kernel reads the rows in place; the other backends
    compute with :meth:`dequantize`'s values, which define the result.

    Parameters
    ----------
    data : ndarray of uint8, shape [..., S, E + 4 ceil(E / 32)]
        The rows (values, then scales); the last axis contiguous. Kept, not copied.
    dim : int
        E, the values per row.

    Attributes
    ----------
    data : ndarray of uint8
    shape : tuple, ``data.shape[:-1] + (E,)``
    """

    __slots__ = ("_data", "_dim")

    def __init__(self, data, dim):
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim < 2:
            raise TypeError("Q8Tensor data must be a uint8 ndarray [..., S, row bytes]; got "
                            f"{type(data).__name__} {getattr(data, 'dtype', '')}")
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"Q8Tensor dim must be a positive int, got {dim!r}")
        if data.shape[-1] != row_bytes(dim) or (data.strides[-1] != 1 and data.shape[-1] > 1):
            raise ValueError(f"Q8Tensor rows of {dim} values take {row_bytes(dim)} contiguous bytes; "
                             f"got data of shape {data.shape} and strides {data.strides}")
        self._data, self._dim = data, int(dim)

    # read-only: the kernel reads row_bytes(dim) bytes of every row of data
    data = property(lambda self: self._data, doc="The rows (values, then scales): uint8 [..., S, row bytes].")
    dim = property(lambda self: self._dim, doc="E, the values per row.")

    @classmethod
    def quantize(cls, x):
        """q8_0 of float array ``x`` [..., S, E] (float16, bfloat16, float32 or float64)."""
        x = as_float_array(x, "x")
        if x.ndim < 2:
            raise ValueError(f"x must have at least 2 dims [..., S, E]; got shape {x.shape}")
        out = np.empty(x.shape[:-1] + (row_bytes(x.shape[-1]),), np.uint8)
        quantize_into(x, out, "x")
        return cls(out, x.shape[-1])

    @property
    def shape(self):
        return self.data.shape[:-1] + (self.dim,)

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def dtype(self):
        """``int8``: the storage of the values (the scales are float32)."""
        return np.dtype(np.int8)

    @property
    def nbytes(self):
        return self.data.size

    @property
    def values(self):
        """The int8 values, a view: [..., S, E]."""
        return self.data[..., : self.dim].view(np.int8)

    @property
    def scales(self):
        """The float32 scales, [..., S, ceil(E / 32)] (a copy: they need not be 4-byte aligned)."""
        raw = np.ascontiguousarray(self.data[..., self.dim:])  # [..., S, 4 G]
        return raw.view(np.float32)  # [..., S, 4 G] -> [..., S, G]

    def dequantize(self):
        """The values attention computes with, ``q * d`` as float32: [..., S, E]."""
        x = _by_group(self.values, np.float32) * self.scales[..., None]  # float32 products, as the kernel's
        return x.reshape(x.shape[:-2] + (-1,))[..., : self.dim]  # [..., S, G, 32] -> [..., S, E]

    def __repr__(self):
        return f"Q8Tensor(shape={self.shape}, q8_0: {self.nbytes} bytes)"


def quantize_into(x, out, name):
    """Write q8_0 rows of float array ``x`` [..., E] into uint8 ``out`` [..., row_bytes(E)] (in place).

    ValueError naming ``name``, before anything is written, unless every value is
    finite and every group's scale fits a float32.
    """
    dim = x.shape[-1]
    xp = _by_group(x, np.float64)  # [..., G, 32]
    amax = np.abs(xp).max(axis=-1)  # [..., G]
    if not (np.isfinite(amax).all() and (amax / 127 <= np.finfo(np.float32).max).all()):
        raise ValueError(f"{name} must be finite to be quantized to int8 (q8_0); got inf or NaN "
                         f"in shape {tuple(x.shape)} and dtype {x.dtype}")
    with np.errstate(over="ignore"):
        d = (amax / 127).astype(np.float32)
    low = d.astype(np.float64) * 127 < amax  # rounded down: one float32 up, so |x / d| <= 127
    d[low] = np.nextafter(d[low], np.float32(np.inf))
    dd = d.astype(np.float64)[..., None]  # [..., G, 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(dd > 0, np.rint(xp / np.where(dd > 0, dd, 1.0)), 0.0)
    q = np.clip(q, -127, 127).astype(np.int8).reshape(x.shape[:-1] + (-1,))  # [..., G, 32] -> [..., E']
    out[..., :dim] = q[..., :dim].view(np.uint8)
    out[..., dim:] = np.ascontiguousarray(d).view(np.uint8)  # [..., G] float32 -> [..., 4 G] bytes


def is_q8(x):
    return isinstance(x, Q8Tensor)


def check_pair(query, key, value):
    """The rules of an int8 cache: key and value both Q8Tensor, the query a 16-bit or float32 array."""
    if not (is_q8(key) and is_q8(value)):
        other = "value" if is_q8(key) else "key"
        raise TypeError(f"key and value must both be int8 (attn.Q8Tensor) or neither; {other} is "
                        f"{type(key if other == 'key' else value).__name__}")
    if is_q8(query):
        raise TypeError("query must be a float array, not an attn.Q8Tensor (only key and value are quantized)")
    q = query
    if q.dtype != np.float32 and not _dtypes.is_16bit(q.dtype):
        raise TypeError(
            "an int8 (q8_0) key/value cache is computed in float32: query must be float32, float16 or "
            f"bfloat16; got query with shape {tuple(q.shape)} and dtype {q.dtype}"
        )


def value_error(x):
    """The bound on ``|x - x^|`` per value of ``x`` [..., E] quantized to q8_0 (float64, x's shape).

    ``d_g (1/2 + 127 u) + 2**-150`` with ``d_g`` the group's scale: half a step of
    the rounding to an integer, plus the float32 product ``q d_g`` (``|q| <= 127``,
    ``u = 2**-24``); ``d_g`` is ``max |x_g| / 127`` rounded up to a float32 (at most
    ``2u`` relative, or ``2**-149`` absolute for a subnormal scale, more).
    """
    x = np.abs(np.asarray(x, np.float64))
    u = 2.0 ** -24
    d = _by_group(x, np.float64).max(-1) / 127 * (1 + 2 * u) + 2.0 ** -149  # [..., G]
    return np.repeat(d * (0.5 + 127 * u) + 2.0 ** -150, GROUP, axis=-1)[..., : x.shape[-1]]  # [..., E]


def query_error(q):
    """The bound on ``|q - q^|`` per value of a query ``q`` [..., E] the kernel rounds to q8_0.

    On the paths with VNNI a decode call over a q8_0 key rounds its (scaled)
    query rows to q8_0 too and takes integer dot products
    (:func:`attn._kernels.q8_rounds_query`, attn/_src/attn_simd_q8dot.h):
    half a step, ``max |q_g| / 254`` per group of 32, times ``1 + 2**-13`` for
    the float32 steps around it (the scale, ``d = max / 127``, ``127 / max`` and
    the product before rounding: under 770 u relative), plus ``2**-140`` for a
    subnormal step. Float64, q's shape.
    """
    q = np.abs(np.asarray(q, np.float64))
    amax = _by_group(q, np.float64).max(-1)  # [..., G]
    return np.repeat(amax / 254 * (1 + 2.0 ** -13) + 2.0 ** -140, GROUP, axis=-1)[..., : q.shape[-1]]


def attention_error(q, k, v, scale=None, query_rounded=False):
    """The bound on what an int8 (q8_0) cache moves each attention output, all keys visible.

    For query rows ``q`` [..., L, E] over keys ``k`` [..., S, E] and values ``v``
    [..., S, Ev] (float, unquantized; leading dims broadcast, no GQA): with
    ``D_j = scale sum_e |q_e| dk_je`` the most a score can move (dk, dv from
    :func:`value_error`; with ``query_rounded``, the kernel's query rounding
    :func:`query_error` dq adds ``scale sum_e dq_e (|k_je| + dk_je)``, as
    :func:`attn._kernels.q8_rounds_query` says it applies) and the exact weights ``p_j``, the weights move by at
    most ``sum_j |p^_j - p_j| <= 2 W / (1 - W)``, ``W = sum_j p_j (e^{D_j} - 1)``,
    so each output element by at most ``2 W / (1 - W) r + max_j dv_j``, with
    ``r = (max_j v_j - min_j v_j) / 2`` (the weights' changes sum to 0, so the
    values count from the middle of their range; docs/kv_cache_int8.md). Exact
    arithmetic otherwise: the kernel's own float32 rounding comes on top. A
    worst case (every score error pushing the same way): typical errors are
    orders of magnitude smaller. Returns float64 [..., L, Ev] (inf where W >= 1).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ np.swapaxes(k, -1, -2)  # [..., L, S]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dk = np.swapaxes(value_error(k), -1, -2)  # [..., E, S]
    dscore = abs(scale) * np.abs(q) @ dk  # [..., L, S]
    if query_rounded:
        dscore = dscore + abs(scale) * query_error(q) @ (np.abs(np.swapaxes(k, -1, -2)) + dk)
    w = (p * np.expm1(dscore)).sum(-1, keepdims=True)  # [..., L, 1]
    with np.errstate(divide="ignore"):
        moved = np.where(w < 1, 2 * w / (1 - w), np.inf)
    half_range = (v.max(-2, keepdims=True) - v.min(-2, keepdims=True)) / 2  # [..., 1, Ev]
    return moved * half_range + value_error(v).max(-2, keepdims=True)
