"""A preallocated key/value cache for one attention layer (autoregressive decoding).

Decoding a sequence one token (or one chunk) at a time recomputes nothing:
the keys and values of earlier positions are kept in two buffers allocated
once at their maximum length, new ones are written in place behind them, and
attention runs over the valid prefix, a view of the buffers. An 8-bit cache
(``dtype="int8"``) quantizes on append (q8_0, :mod:`attn._quantized`) and
hands attention :class:`attn.Q8Tensor` views, which the fused kernel reads in
place. With the cache
holding ``S`` positions of which the newest ``L`` are the queries, the causal
alignment is bottom-right: ``is_causal="lower_right"`` in
:func:`attn.scaled_dot_product_attention` (query ``i`` sees keys ``0..S-L+i``).
"""

import numbers

import numpy as np

from .. import _dtypes, _quantized
from .._integers import check_int
from .._validation import as_float_array, describe_array


def _batch_tuple(batch):
    """``batch`` as a tuple of ints: an int, a tuple of ints, or () for no batch dim."""
    if isinstance(batch, numbers.Integral) and not isinstance(batch, bool):
        batch = (batch,)
    if not isinstance(batch, tuple):
        raise TypeError(f"batch must be an int or a tuple of ints, got {batch!r}")
    return tuple(check_int(b, "batch", minimum=0) for b in batch)


class KVCache:
    """Keys and values of one attention layer, preallocated for ``max_len`` positions.

    Parameters
    ----------
    batch : int or tuple of int
        Leading dims of the cached arrays (``()`` for unbatched inputs).
    num_kv_heads : int
        Key/value heads (``n_head`` for multi-head, fewer for grouped-query).
    max_len : int
        Positions the buffers hold; appending beyond raises ``ValueError``.
    head_dim : int
        ``d_k``, the size of one key head.
    value_dim : int, optional
        ``d_v``, the size of one value head (default ``head_dim``).
    dtype : float16, bfloat16, float32, float64 or int8, default float32
        A NumPy dtype, its name or a torch dtype; ``"bfloat16"`` is
        ``ml_dtypes.bfloat16``. A 16-bit cache under float32 queries is read
        in place by the fused kernel (widened in registers). ``"int8"``
        (or ``np.int8``, ``torch.int8``): llama.cpp's q8_0, 8-bit values with
        a float32 scale per 32 (:class:`attn.Q8Tensor`); ``append`` takes
        keys and values of any float dtype and quantizes them; queries are
        float32, float16 or bfloat16, computed in float32. Its error is
        bounded in docs/kv_cache_int8.md.

    Attributes
    ----------
    k_buffer : ndarray, shape [*batch, num_kv_heads, max_len, head_dim]
    v_buffer : ndarray, shape [*batch, num_kv_heads, max_len, value_dim]
        The whole preallocated storage; positions ``>= len(cache)`` are unused.
        int8: uint8 q8_0 rows, shape [..., max_len, d + 4 ceil(d / 32)].

    Examples
    --------
    >>> import numpy as np, attn
    >>> cache = attn.KVCache(1, 2, max_len=8, head_dim=4, dtype=np.float64)
    >>> k, v = cache.append(np.ones((1, 2, 3, 4)), np.ones((1, 2, 3, 4)))
    >>> k.shape, len(cache), np.shares_memory(k, cache.k_buffer)
    ((1, 2, 3, 4), 3, True)
    """

    def __init__(self, batch, num_kv_heads, max_len, head_dim, *, value_dim=None, dtype=np.float32):
        self.batch = _batch_tuple(batch)
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", minimum=1)
        self.max_len = check_int(max_len, "max_len", minimum=1)
        self.head_dim = check_int(head_dim, "head_dim", minimum=1)
        self.value_dim = self.head_dim if value_dim is None else check_int(value_dim, "value_dim", minimum=1)
        lead = self.batch + (self.num_kv_heads, self.max_len)
        if str(dtype) in ("int8", "torch.int8") or (isinstance(dtype, (type, np.dtype)) and np.dtype(dtype) == np.int8):
            # q8_0 rows: values, then scales (attn._quantized)
            self.dtype = np.dtype(np.int8)
            self.k_buffer = np.zeros(lead + (_quantized.row_bytes(self.head_dim),), np.uint8)
            self.v_buffer = np.zeros(lead + (_quantized.row_bytes(self.value_dim),), np.uint8)
        else:
            try:
                self.dtype = _dtypes.as_dtype(dtype)
            except TypeError:
                raise TypeError(f"dtype must be float16, bfloat16, float32, float64 or int8 (q8_0), "
                                f"got {dtype!r}") from None
            self.k_buffer = np.zeros(lead + (self.head_dim,), dtype=self.dtype)  # [*batch, h_kv, max_len, d_k]
            self.v_buffer = np.zeros(lead + (self.value_dim,), dtype=self.dtype)  # [*batch, h_kv, max_len, d_v]
        self._length = 0

    def __len__(self):
        return self._length

    @property
    def quantized(self):
        """Whether this is an int8 (q8_0) cache."""
        return self.dtype == np.int8

    def __repr__(self):
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
            f"length={self._length}/{self.max_len}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, dtype={self.dtype})"
        )

    @property
    def free(self):
        """Positions still available."""
        return self.max_len - self._length

    @property
    def k(self):
        """Valid keys, a view: shape [*batch, num_kv_heads, len(cache), head_dim] (int8: a Q8Tensor)."""
        return self._valid(self.k_buffer, self.head_dim)

    @property
    def v(self):
        """Valid values, a view: shape [*batch, num_kv_heads, len(cache), value_dim] (int8: a Q8Tensor)."""
        return self._valid(self.v_buffer, self.value_dim)

    def _valid(self, buffer, dim):
        prefix = buffer[..., : self._length, :]
        return _quantized.Q8Tensor(prefix, dim) if self.quantized else prefix

    def append(self, k, v):
        """Write ``T`` new positions behind the valid prefix, in place.

        Parameters
        ----------
        k : array_like, shape [*batch, num_kv_heads, T, head_dim]
        v : array_like, shape [*batch, num_kv_heads, T, value_dim]
            The cache's dtype exactly (no silent casts); ``T >= 0``. An int8
            cache takes any float dtype and quantizes (finite values only).

        Returns
        -------
        k, v : ndarray views of all valid positions (``len(cache)`` is now
            the old length plus ``T``), as :attr:`k` and :attr:`v`.

        Raises
        ------
        TypeError
            ``k`` or ``v`` is not an array of the cache's dtype.
        ValueError
            Wrong shape, or fewer than ``T`` free positions (nothing is written).
        """
        k, v = self._check_new(k, "k", self.head_dim), self._check_new(v, "v", self.value_dim)
        n_new = k.shape[-2]
        if v.shape[-2] != n_new:
            raise ValueError(
                f"k and v must add the same number of positions (dim -2); got k {describe_array(k)} "
                f"and v {describe_array(v)}"
            )
        if n_new > self.free:
            raise ValueError(
                f"KVCache is full: cannot append {n_new} positions to {self._length} of "
                f"max_len={self.max_len} ({self.free} free); allocate a longer cache or reset() it"
            )
        end = self._length + n_new
        if self.quantized:  # (a refused v leaves k's rows past len(cache): unused)
            _quantized.quantize_into(k, self.k_buffer[..., self._length : end, :], "k")
            _quantized.quantize_into(v, self.v_buffer[..., self._length : end, :], "v")
        else:
            self.k_buffer[..., self._length : end, :] = k
            self.v_buffer[..., self._length : end, :] = v
        self._length = end
        return self.k, self.v

    def _check_new(self, a, name, dim):
        a = as_float_array(a, name)
        if a.dtype != self.dtype and not self.quantized:
            raise TypeError(f"{name} must have the cache's dtype {self.dtype}; got {describe_array(a)}")
        want = self.batch + (self.num_kv_heads, None, dim)
        if a.ndim != len(want) or any(w is not None and s != w for s, w in zip(a.shape, want)):
            shown = ", ".join("T" if w is None else str(w) for w in want)
            raise ValueError(f"{name} must have shape ({shown}), T new positions; got {describe_array(a)}")
        return a

    def reset(self, length=0):
        """Forget every position from ``length`` on (default: all); no memory is freed."""
        length = check_int(length, "length", minimum=0)
        if length > self._length:
            raise ValueError(f"length must be <= len(cache) = {self._length}, got {length}")
        self._length = length
