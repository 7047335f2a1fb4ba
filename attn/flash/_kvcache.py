"""``flash_attn_with_kvcache``: check the cache call, append the new keys in place, describe the rest.

Order, as FlashAttention's kernel does it: the new ``k``/``v`` [B, L_new,
H_kv, E] (rotated when ``rotary_cos``/``rotary_sin`` are given) are written
into the cache at positions ``cache_seqlens[b] ...`` of batch row b (the
cache's row ``cache_batch_idx[b]``, or the pages of ``block_table[b]``), and
the query rows attend to the keys ``[cache_leftpad[b], cache_seqlens[b] +
L_new)``. Everything is checked before the first write, so a call that
raises leaves the cache as it was.

Rotary positions are cache indices, as in FlashAttention: new key i of row b
sits at ``cache_seqlens[b] + i``; query row i at the same position when
``causal`` or a window is on, else every query row at ``cache_seqlens[b]``.
"""

import numpy as np

from .. import _dtypes, _paged, _quantized, _threads, _variants
from .._integers import check_int
from .._validation import as_float_array, check_scale, describe_array
from . import _rotary


def _lengths(cache_seqlens, batch, capacity):
    """cache_seqlens as int64 [batch] (None: every row full; an int: broadcast)."""
    if cache_seqlens is None:
        return np.full(batch, capacity, np.int64)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        return np.full(batch, check_int(cache_seqlens, "cache_seqlens", 0), np.int64)
    a = _paged.as_index_array(cache_seqlens, "cache_seqlens", "[batch]")
    if a.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have shape [batch] with batch = {batch} (q's dim 0); got shape {a.shape}")
    if (a < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0; got {a.tolist()}")
    return a


def _per_row(x, name, batch, low, high, high_doc):
    """An int64 [batch] index argument, each value in [low, high] (high may be per row)."""
    a = _paged.as_index_array(x, name, "[batch]")
    if a.shape[0] != batch:
        raise ValueError(f"{name} must have shape [batch] with batch = {batch} (q's dim 0); got shape {a.shape}")
    bad = np.flatnonzero((a < low) | (a > high))
    if bad.size:
        b = int(bad[0])
        hi = high if np.ndim(high) == 0 else high[b]
        raise ValueError(f"{name}[{b}] = {int(a[b])} must be in [{low}, {int(hi)}] ({high_doc})")
    return a


def _check_new(x, name, batch, heads_k, width, dtype):
    """New keys or values [batch, seqlen_new, nheads_k, width] of the cache's dtype (an int8 cache:
    any float dtype, quantized as they are written)."""
    x = as_float_array(x, name)
    if x.ndim != 4 or x.shape[0] != batch or x.shape[2] != heads_k or x.shape[3] != width:
        raise ValueError(f"{name} must have shape [batch, seqlen_new, nheads_k, headdim] = "
                         f"[{batch}, *, {heads_k}, {width}]; got {describe_array(x)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have the cache's dtype {dtype}; got {describe_array(x)}")
    return x


def _positions(start, n):
    return start[:, None] + np.arange(n)[None, :]  # [B, n]


def prepare(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            sinks, num_threads, k_descale=None, v_descale=None):
    """Check a ``flash_attn_with_kvcache`` call, append ``k``/``v`` in place; the :class:`attn._paged.CacheProblem`
    (a float8 cache's descales applied: :func:`attn._paged.apply_descale`)."""
    q = as_float_array(q, "q")
    k_cache, v_cache = _paged.as_cache(k_cache, "k_cache"), _paged.as_cache(v_cache, "v_cache")
    if q.ndim != 4:
        raise ValueError(f"q must have shape [batch, seqlen_q, nheads, headdim]; got {describe_array(q)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 4:
            raise ValueError(f"{name} must have shape [batch_cache, seqlen_cache, nheads_k, headdim] or, with a "
                             f"block_table, [num_blocks, page_block_size, nheads_k, headdim]; got {describe_array(c)}")
    _paged.check_cache_dtypes(q, k_cache, v_cache, "the cache")
    q8 = _quantized.is_q8(k_cache)
    f8 = not q8 and _dtypes.is_float8(k_cache.dtype)
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache [.., .., H_kv, E], v_cache [.., .., H_kv, Ev] and q [.., .., H, E] do not match: "
                         f"q with {describe_array(q)}, k_cache with {describe_array(k_cache)}, "
                         f"v_cache with {describe_array(v_cache)}")
    B, Lq, H, E = q.shape
    Hkv, Ev = k_cache.shape[2], v_cache.shape[3]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q's heads ({H}) must be a multiple of the cache's ({Hkv})")
    paged = block_table is not None
    n_rows, row_len = k_cache.shape[:2]
    if paged and row_len == 0:
        raise ValueError(f"k_cache's page_block_size (dim 1) must be >= 1; got {describe_array(k_cache)}")
    if paged:
        bt = np.asarray(block_table)
        capacity = bt.shape[1] * row_len if bt.ndim == 2 else 0
    else:
        capacity = row_len
    seqlens = _lengths(cache_seqlens, B, capacity)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append) or both None")
    n_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens (each row's current length)")
        k = _check_new(k, "k", B, Hkv, E, None if q8 or f8 else k_cache.dtype)
        v = _check_new(v, "v", B, Hkv, Ev, None if q8 or f8 else k_cache.dtype)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have one seqlen_new; got k with {describe_array(k)} and v with "
                             f"{describe_array(v)}")
        n_new = k.shape[1]
    total = seqlens + n_new
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx indexes a contiguous cache; with a block_table each row's pages say "
                             "where its keys are")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad is not supported with a block_table (as in FlashAttention): "
                             "a paged sequence starts at its first page")
        table = _paged.check_block_table(block_table, B, n_rows, row_len, total)
        batch_idx = start = np.zeros(B, np.int64)
    else:
        over = np.flatnonzero(total > capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(f"batch row {b}: cache_seqlens ({int(seqlens[b])}) + seqlen_new ({n_new}) = "
                             f"{int(total[b])} keys exceed the cache's seqlen_cache ({capacity})")
        batch_idx = (np.arange(B, dtype=np.int64) if cache_batch_idx is None
                     else _per_row(cache_batch_idx, "cache_batch_idx", B, 0, n_rows - 1, "the cache's batch rows"))
        if cache_batch_idx is None and B > n_rows:
            raise ValueError(f"q has {B} batch rows but k_cache only {n_rows}: pass cache_batch_idx")
        start = (np.zeros(B, np.int64) if cache_leftpad is None
                 else _per_row(cache_leftpad, "cache_leftpad", B, 0, seqlens, "0 to cache_seqlens"))
        table = None
    window = None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints (-1 = unbounded), got {window_size!r}")
    if tuple(window_size) != (-1, -1):
        window = tuple(window_size)
    local = window is not None
    check_int(num_splits, "num_splits", 0)
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be True or False, got {rotary_interleaved!r}")
    q_rot = q
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin rotate the new k and q: pass k and v (as FlashAttention)")
        cos, sin = _rotary.check_tables(rotary_cos, rotary_sin, E)
        k_pos = _positions(seqlens, n_new)
        q_pos = _positions(seqlens, Lq) if (causal or local) else np.repeat(seqlens[:, None], Lq, axis=1)
        last = max(int(k_pos.max(initial=-1)), int(q_pos.max(initial=-1)))
        if last >= cos.shape[0]:
            raise ValueError(f"rotary_cos/rotary_sin have {cos.shape[0]} positions but the call needs position {last}")
        k = _rotary.apply(k, cos, sin, k_pos, rotary_interleaved)
        q_rot = _rotary.apply(q, cos, sin, q_pos, rotary_interleaved)
    scale = check_scale(softmax_scale, E)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    num_threads = _threads.check_num_threads(num_threads)
    # the variants' own checks (window, softcap, slopes, sinks), before anything is written
    _paged_variants_check(window, softcap, alibi_slopes, sinks, B, H, q.dtype)
    k_descale = _paged.check_descale(k_descale, "k_descale", B, Hkv, k_cache)
    v_descale = _paged.check_descale(v_descale, "v_descale", B, Hkv, v_cache)
    if k is not None and n_new > 0:  # every check passed: write the new rows
        if f8:
            k, v = _to_float8(k, k_descale, k_cache.dtype), _to_float8(v, v_descale, v_cache.dtype)
        _append(k_cache, k, table, batch_idx, _positions(seqlens, n_new), row_len)
        _append(v_cache, v, table, batch_idx, _positions(seqlens, n_new), row_len)
    p = _paged.CacheProblem(
        q=_paged.kernel_query(q_rot, k_cache, v_cache), q_batch=np.arange(B, dtype=np.int64), q_start=np.zeros(B, np.int64),
        q_len=np.full(B, Lq, np.int64), k=k_cache, v=v_cache, k_batch=batch_idx, k_start=start,
        k_len=total - start, block_table=table, causal=bool(causal), scale=scale, window=window,
        softcap=float(softcap) if softcap else None, alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=q.dtype,
        q_bf16=_dtypes.is_bfloat16(q.dtype), num_threads=num_threads,
    )
    return _paged.apply_descale(p, k_descale, v_descale)


def _to_float8(rows, descale, dtype):
    """New rows [B, n, H_kv, F] as a float8 cache stores them: divided by their row's descale
    ([B, H_kv] or None), saturated to the format's largest finite value, rounded to nearest even
    (NaN stays NaN)."""
    x = rows.astype(np.float32)
    if descale is not None:
        x = x / descale[:, None, :, None].astype(np.float32)
    top = _dtypes.FLOAT8_MAX[dtype.name]
    return np.clip(x, -top, top).astype(dtype)


def _append(cache, rows, table, batch_idx, pos, page_size):
    """Write ``rows`` [B, n, H_kv, F] into ``cache`` at cache positions ``pos`` [B, n]: pages of
    ``table`` (paged) or batch rows ``batch_idx``; an int8 cache gets their q8_0 rows."""
    if _quantized.is_q8(cache):
        cache, rows = cache.data, _quantized.Q8Tensor.quantize(rows).data
    if table is not None:
        cache[table[np.arange(pos.shape[0])[:, None], pos // page_size], pos % page_size] = rows
    else:
        cache[batch_idx[:, None], pos] = rows


def _paged_variants_check(window, softcap, alibi_slopes, sinks, batch, heads, dtype):
    _variants.validate(window, softcap, alibi_slopes, sinks, batch=(batch, heads), n_q=0, n_k=0,
                       causal_offset=None, cdtype=_dtypes.compute_dtype(dtype))
