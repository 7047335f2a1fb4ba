"""Multi-head attention as functions on arrays: the seed article's algorithm.

Project the inputs (``x @ W``, NumPy's convention), split ``d_model`` into
``n_head`` heads by a reshape (head 0 gets columns ``0..d_k-1``), attend in
every head with :func:`attn.scaled_dot_product_attention`, concatenate the
heads and project once more. Grouped-query attention (fewer key/value heads,
as in Llama) uses the kernel's ``enable_gqa`` path; a :class:`attn.KVCache`
turns the same function into an incremental decoder.
"""

import numpy as np

from .._api import scaled_dot_product_attention
from .._integers import check_int
from .._interop import accepts_torch
from .kv_cache import KVCache
from .._validation import as_float_array, compute_dtype, describe_array


def split_heads(x, n_head):
    """Split the last dim into ``n_head`` heads.

    Parameters
    ----------
    x : ndarray, shape [..., T, n_head * d_head]
    n_head : int

    Returns
    -------
    ndarray view, shape [..., n_head, T, d_head]; head ``h`` holds columns
    ``h * d_head .. (h + 1) * d_head - 1`` of ``x``.
    """
    *lead, n_t, width = x.shape
    x = x.reshape(*lead, n_t, n_head, width // n_head)  # [.., T, n_head * d_head] -> [.., T, n_head, d_head]
    return np.swapaxes(x, -3, -2)  # [.., T, n_head, d_head] -> [.., n_head, T, d_head]


def merge_heads(x):
    """Concatenate the heads: the inverse of :func:`split_heads`.

    Parameters
    ----------
    x : ndarray, shape [..., n_head, T, d_head]

    Returns
    -------
    ndarray, shape [..., T, n_head * d_head]
    """
    x = np.swapaxes(x, -3, -2)  # [.., n_head, T, d_head] -> [.., T, n_head, d_head]
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])  # -> [.., T, n_head * d_head]


def project(x, w, b=None):
    """``x @ w + b``: shape [..., T, d_in] @ [d_in, d_out] -> [..., T, d_out].

    float16 and bfloat16 are multiplied in float32 and rounded once, as torch's
    CPU ``linear`` does (and NumPy has no fast bfloat16 product).
    """
    ct = compute_dtype(x.dtype)
    if ct != x.dtype:
        y = x.astype(ct) @ w.astype(ct)    # [..., T, d_out] in float32
        if b is not None:
            y += b.astype(ct)
        return y.astype(x.dtype)
    y = x @ w
    return y if b is None else y + b


def _matrix(w, name, dtype, rows):
    w = as_float_array(w, name)
    if w.dtype != dtype:
        raise TypeError(f"{name} must have the inputs' dtype {dtype}; got {describe_array(w)}")
    if w.ndim != 2 or w.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows}, width) (used as x @ {name}); got {describe_array(w)}")
    return w


def _vector(b, name, dtype, width):
    if b is None:
        return None
    b = as_float_array(b, name)
    if b.dtype != dtype:
        raise TypeError(f"{name} must have the inputs' dtype {dtype}; got {describe_array(b)}")
    if b.shape != (width,):
        raise ValueError(f"{name} must have shape ({width},); got {describe_array(b)}")
    return b


def _check_inputs(query, key, value):
    q, k, v = (as_float_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value")))
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"query, key and value must have the same dtype; got query {q.dtype}, key {k.dtype}, "
            f"value {v.dtype}"
        )
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims [..., seq, features]; got {describe_array(a)}")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            f"query, key and value must have the same leading (batch) dims; got query {q.shape}, "
            f"key {k.shape}, value {v.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must have the same sequence length (dim -2); got key {k.shape} and "
            f"value {v.shape}"
        )
    return q, k, v


def _check_cache(cache, q, n_new, n_kv_head, d_k, d_v, is_causal):
    if not isinstance(cache, KVCache):
        raise TypeError(f"kv_cache must be an attn.KVCache or None, got {type(cache).__name__}")
    # an int8 cache quantizes keys and values of any float dtype (attn._quantized) and is read
    # under float32 or 16-bit queries (computed in float32)
    if cache.quantized and q.dtype == np.float64:
        raise TypeError("an int8 kv_cache computes in float32: query, key and value must be float32, "
                        f"float16 or bfloat16, got {q.dtype}")
    want = (q.shape[:-2], n_kv_head, d_k, d_v, cache.dtype if cache.quantized else q.dtype)
    have = (cache.batch, cache.num_kv_heads, cache.head_dim, cache.value_dim, cache.dtype)
    if want != have:
        raise ValueError(
            "kv_cache does not fit this call: (batch, num_kv_heads, head_dim, value_dim, dtype) "
            f"must be {want}, the cache has {have}"
        )
    if n_new > cache.free:
        raise ValueError(
            f"KVCache is full: cannot append {n_new} positions to {len(cache)} of "
            f"max_len={cache.max_len} ({cache.free} free)"
        )
    if len(cache) > 0 and (is_causal is True or is_causal == "upper_left"):
        raise ValueError(
            "with a non-empty kv_cache the new queries are the last positions of the sequence: "
            "use is_causal='lower_right' (is_causal=True aligns them with the first keys)"
        )


def _check_weights(q, k, v, w_q, w_k, w_v, w_o, n_head, n_kv_head):
    """Validated weights and the head sizes ``(d_k, d_v)``."""
    w_q = _matrix(w_q, "w_q", q.dtype, q.shape[-1])
    w_k = _matrix(w_k, "w_k", q.dtype, k.shape[-1])
    w_v = _matrix(w_v, "w_v", q.dtype, v.shape[-1])
    if w_q.shape[1] % n_head:
        raise ValueError(f"w_q's width {w_q.shape[1]} is not a multiple of num_heads={n_head}")
    d_k = w_q.shape[1] // n_head
    if w_k.shape[1] != n_kv_head * d_k:
        raise ValueError(
            f"w_k must have width num_kv_heads * d_k = {n_kv_head} * {d_k} (d_k from w_q); "
            f"got {describe_array(w_k)}"
        )
    if w_v.shape[1] % n_kv_head:
        raise ValueError(f"w_v's width {w_v.shape[1]} is not a multiple of num_kv_heads={n_kv_head}")
    d_v = w_v.shape[1] // n_kv_head
    w_o = _matrix(w_o, "w_o", q.dtype, n_head * d_v)
    return (w_q, w_k, w_v, w_o), d_k, d_v


def _attend_through_cache(cache, q, k, v, attn_mask, kw):
    """Append ``k``, ``v`` to ``cache`` and attend over all of it; on error the cache is unchanged."""
    n_before = len(cache)
    k_all, v_all = cache.append(k, v)  # views [.., n_kv_head, S_total, d]
    try:
        return scaled_dot_product_attention(q, k_all, v_all, attn_mask, **kw)
    except Exception:
        cache.reset(n_before)  # e.g. a bad attn_mask: leave the cache as it was
        raise


@accepts_torch("query", "key", "value", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "attn_mask")
def multi_head_attention(
    query, key, value, w_q, w_k, w_v, w_o, num_heads, num_kv_heads=None, *,
    b_q=None, b_k=None, b_v=None, b_o=None, attn_mask=None, is_causal=False, scale=None,
    kv_cache=None, backend="auto", return_weights=False, num_threads=None,
):
    """Multi-head (or grouped-query) attention with weights in NumPy's ``x @ W`` convention.

    ``concat(head_1, ..., head_h) @ w_o`` with
    ``head_i = attention(query @ w_q[:, i], key @ w_k[:, g(i)], value @ w_v[:, g(i)])``,
    where ``g(i) = i // (num_heads // num_kv_heads)`` and ``[:, i]`` is the
    i-th block of ``d_k`` (or ``d_v``) columns.

    Parameters
    ----------
    query : array_like, shape [..., L, d_model]
    key : array_like, shape [..., S, d_key_in]
    value : array_like, shape [..., S, d_value_in]
        Pass the same array three times for self-attention; for
        cross-attention ``key`` and ``value`` are the encoder output (any
        length ``S``). Leading dims must be equal; one dtype for everything.
    w_q : array_like, shape [d_model, num_heads * d_k]
    w_k : array_like, shape [d_key_in, num_kv_heads * d_k]
    w_v : array_like, shape [d_value_in, num_kv_heads * d_v]
    w_o : array_like, shape [num_heads * d_v, d_out]
    num_heads : int
        ``n_head``, the query heads.
    num_kv_heads : int, optional
        Key/value heads, dividing ``num_heads`` (default ``num_heads``:
        multi-head attention; fewer: grouped-query attention).
    b_q, b_k, b_v, b_o : array_like, shape [width of the matching weight], optional
        Biases added after each projection.
    attn_mask : array_like of bool or float, broadcastable to [..., num_heads, L, S], optional
        SDPA's convention: bool True = the key takes part; float is added.
    is_causal : bool or {"upper_left", "lower_right"}
        As in :func:`attn.scaled_dot_product_attention`. With a non-empty
        ``kv_cache`` use "lower_right".
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(d_k)``.
    kv_cache : attn.KVCache, optional
        The projected keys and values of this call are appended to it and
        attention runs over everything cached (a view, nothing copied). Its
        batch is ``query``'s leading dims, its heads ``num_kv_heads``.
    backend : {"auto", "loop", "numpy", "cython"}
    return_weights : bool
        Also return the per-head attention weights.
    num_threads : int, optional

    Returns
    -------
    out : ndarray, shape [..., L, d_out]
    weights : ndarray, shape [..., num_heads, L, S_total] (only with ``return_weights``)
        ``S_total`` is ``len(kv_cache)`` after the append, else ``S``.
    """
    n_head = check_int(num_heads, "num_heads", minimum=1)
    n_kv_head = n_head if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
    if n_head % n_kv_head:
        raise ValueError(f"num_kv_heads={n_kv_head} must divide num_heads={n_head}")
    q_in, k_in, v_in = _check_inputs(query, key, value)
    (w_q, w_k, w_v, w_o), d_k, d_v = _check_weights(q_in, k_in, v_in, w_q, w_k, w_v, w_o, n_head, n_kv_head)
    dt = q_in.dtype
    b_q, b_k = _vector(b_q, "b_q", dt, w_q.shape[1]), _vector(b_k, "b_k", dt, w_k.shape[1])
    b_v, b_o = _vector(b_v, "b_v", dt, w_v.shape[1]), _vector(b_o, "b_o", dt, w_o.shape[1])
    if kv_cache is not None:
        _check_cache(kv_cache, q_in, k_in.shape[-2], n_kv_head, d_k, d_v, is_causal)

    q = split_heads(project(q_in, w_q, b_q), n_head)  # [.., L, d_model] -> [.., n_head, L, d_k]
    k = split_heads(project(k_in, w_k, b_k), n_kv_head)  # [.., S, d_key_in] -> [.., n_kv_head, S, d_k]
    v = split_heads(project(v_in, w_v, b_v), n_kv_head)  # [.., S, d_value_in] -> [.., n_kv_head, S, d_v]
    kw = dict(is_causal=is_causal, scale=scale, enable_gqa=n_kv_head != n_head, backend=backend,
              return_weights=return_weights, num_threads=num_threads)
    if kv_cache is None:
        res = scaled_dot_product_attention(q, k, v, attn_mask, **kw)
    else:
        res = _attend_through_cache(kv_cache, q, k, v, attn_mask, kw)
    heads, weights = res if return_weights else (res, None)  # [.., n_head, L, d_v]
    out = project(merge_heads(heads), w_o, b_o)  # [.., L, n_head * d_v] -> [.., L, d_out]
    return (out, weights) if return_weights else out
