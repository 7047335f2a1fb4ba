"""The forward computations behind :mod:`attn.flash`, on NumPy arrays (the torch layer wraps them).

* dense batches ``[batch, seqlen, nheads, headdim]``: more than 16 query rows, the kernel's packed
  plan through :mod:`attn._paged` (read and written in place; the common call recognized in
  compiled code, attn._fast_path.flash_dense_fast); else (decode rows, dropout, the weights)
  :func:`attn.scaled_dot_product_attention` on views with the heads before the tokens;
* packed variable-length batches: :func:`attn.varlen_attention`;
* paged keys (a block table): :mod:`attn._paged`, the kernel reading the pages in place.
"""

import numpy as np

from .. import _backends, _dtypes, _paged, _quantized, _threads
from .._api import scaled_dot_product_attention
from .._validation import as_float_array, check_scale, describe_array
from .._varlen import _cu_seqlens, varlen_attention
from . import _kvcache, _layout_memo


def _window(window_size):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints (-1 = unbounded), got {window_size!r}")
    return None if tuple(window_size) == (-1, -1) else tuple(window_size)


def _four_dims(x, name, layout):
    x = as_float_array(x, name)
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape {layout}; got {describe_array(x)}")
    return x


def dense_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, sinks, num_threads, rng=None):
    """flash_attn_func on NumPy arrays: ``out`` or ``(out, softmax_lse, S_dmask)``."""
    if (type(q) is np.ndarray and q.ndim == 4 and dropout_p == 0 and not return_attn_probs
            and isinstance(causal, (bool, np.bool_)) and _window(window_size) is None and not softcap
            and alibi_slopes is None and sinks is None):
        # the common call, recognized and run in compiled code: the fused backend's own entry point
        # (as attn._api's fast path), the kernel problem the path below builds for it, without its
        # Python (None: not built, or not the common call)
        out = _backends.fused.flash_dense_fast(q, k, v, bool(causal), check_scale(softmax_scale, q.shape[3]),
                                               _threads.check_num_threads(num_threads))
        if out is not None:
            return out
    q = _four_dims(q, "q", "[batch, seqlen_q, nheads, headdim]")
    k = _four_dims(k, "k", "[batch, seqlen_k, nheads_k, headdim]")
    v = _four_dims(v, "v", "[batch, seqlen_k, nheads_k, headdim_v]")
    if (q.shape[1] > _paged.DECODE_MAX_Q and dropout_p == 0 and not return_attn_probs
            and _backends.select_cache("auto") is not None):
        # more rows than a decode, and a backend reads the cache in place: the kernel writes out in
        # place in [B, L, H, Ev] (attn._paged's packed plan), where the [B, H, L, Ev] result of
        # scaled_dot_product_attention would need a transposing copy
        p = _dense_problem(q, k, v, softmax_scale, causal, _window(window_size), softcap, alibi_slopes, sinks,
                           num_threads)
        return _dtypes.cast(_paged.forward(p, with_lse=False, narrow=True)[0], p.out_dtype)
    qt, kt, vt = (np.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, L, H, E] -> [B, H, L, E] (views)
    result = scaled_dot_product_attention(
        qt, kt, vt, dropout_p=dropout_p, is_causal="lower_right" if causal else False, scale=softmax_scale,
        enable_gqa=qt.shape[1] != kt.shape[1], window=_window(window_size), softcap=softcap or None,
        alibi_slopes=alibi_slopes, sinks=sinks, return_weights=bool(return_attn_probs),
        return_lse=bool(return_attn_probs), rng=rng, num_threads=num_threads,
    )
    out, extra = (result[0], result[1:]) if return_attn_probs else (result, ())
    out = np.ascontiguousarray(np.swapaxes(out, 1, 2))  # [B, H, L, Ev] -> [B, L, H, Ev]
    if not return_attn_probs:
        return out
    weights, lse = extra
    return out, lse, weights


def _dense_problem(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, sinks, num_threads):
    """flash_attn_func's batch as an :class:`attn._paged.CacheProblem`: batch row b's queries over its own
    keys, every operand read in place."""
    if not (q.shape[0] == k.shape[0] == v.shape[0] and k.shape[:3] == v.shape[:3] and k.shape[3] == q.shape[3]):
        raise ValueError(f"q [B, L, H, E], k [B, S, H_kv, E] and v [B, S, H_kv, Ev] do not match: q with "
                         f"{describe_array(q)}, k with {describe_array(k)}, v with {describe_array(v)}")
    _paged.check_cache_dtypes(q, k, v, "k and v")
    B, L, H, E = q.shape
    if k.shape[2] == 0 or H % k.shape[2] != 0:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's and v's ({k.shape[2]})")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    _kvcache._paged_variants_check(window, softcap, alibi_slopes, sinks, B, H, q.dtype)
    rows, zeros = np.arange(B, dtype=np.int64), np.zeros(B, np.int64)
    return _paged.CacheProblem(
        q=_paged.kernel_query(q, k, v), q_batch=rows, q_start=zeros,
        q_len=np.full(B, L, np.int64), k=k, v=v, k_batch=rows, k_start=zeros, k_len=np.full(B, k.shape[1], np.int64),
        block_table=None, causal=bool(causal), scale=check_scale(softmax_scale, E), window=window,
        softcap=float(softcap) if softcap else None, alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=q.dtype,
        q_bf16=_dtypes.is_bfloat16(q.dtype), num_threads=_threads.check_num_threads(num_threads),
    )


def _no_dropout(dropout_p, where):
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 in {where}: attn's variable-length and cache kernels have no "
                         f"dropout (run flash_attn_func per sequence for dropout); got {dropout_p!r}")


def _varlen_probs(q, k, v, cu_q, cu_k, block_table, alibi_slopes, **kw):
    """S_dmask [batch, nheads, max_seqlen_q, max_seqlen_k] of a varlen call (rows, keys past a sequence: 0),
    one :func:`attn.scaled_dot_product_attention` per sequence over its gathered keys."""
    B, H = len(cu_q) - 1, q.shape[1]
    k, v = (x.dequantize() if _quantized.is_q8(x) else x for x in (k, v))  # (int8 pages: their values)
    q_len, k_len = np.diff(cu_q), np.diff(cu_k)
    w = np.zeros((B, H, int(q_len.max(initial=0)), int(k_len.max(initial=0))), _dtypes.compute_dtype(q.dtype))
    slopes = None if alibi_slopes is None else np.broadcast_to(np.asarray(alibi_slopes), (B, H))
    for s in range(B):
        n, m = int(q_len[s]), int(k_len[s])
        if block_table is None:
            ks, vs = k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        else:
            pages = block_table[s, : -(-m // k.shape[1])]
            ks = k[pages].reshape((-1,) + k.shape[2:])[:m]  # [pages, page, H_kv, E] -> [m, H_kv, E]
            vs = v[pages].reshape((-1,) + v.shape[2:])[:m]
        qt, kt, vt = (np.swapaxes(x, 0, 1) for x in (q[cu_q[s]:cu_q[s + 1]], ks, vs))  # [T, H, E] -> [H, T, E]
        _, ws = scaled_dot_product_attention(qt, kt, vt, enable_gqa=qt.shape[0] != kt.shape[0], return_weights=True,
                                             alibi_slopes=None if slopes is None else slopes[s], **kw)
        w[s, :, :n, :m] = ws
    return w


def _is_float8(x):
    return isinstance(x, np.ndarray) and _dtypes.is_float8(x.dtype)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, sinks, num_threads,
                   k_descale=None, v_descale=None, out=None):
    """flash_attn_varlen_func on NumPy arrays (a float8 k, v: read in place as a cache, packed or paged);
    the result written into ``out`` when given (:func:`_check_out`)."""
    _no_dropout(dropout_p, "flash_attn_varlen_func")
    if out is not None:
        q = as_float_array(q, "q")   # (q's own errors first: out is checked against its shape and dtype)
        _check_out(out, q, k, v)
    result = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             _window(window_size), softcap, alibi_slopes, return_attn_probs, block_table, sinks,
                             num_threads, k_descale, v_descale, out)
    if out is None:
        return result
    first = result[0] if return_attn_probs else result
    if first is not out:  # (the kernel did not write it itself)
        out[...] = first
    return (out,) + result[1:] if return_attn_probs else out


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                    softcap, alibi_slopes, return_attn_probs, block_table, sinks, num_threads, k_descale, v_descale,
                    into):
    """varlen_forward's result; ``into`` (the caller's checked out, or None) where the memoized kernel calls
    write it themselves, else a new array that varlen_forward copies in."""
    if (block_table is None and not _is_float8(k) and not _is_packed_cache(q, k, v) and k_descale is None
            and v_descale is None):
        out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    is_causal="lower_right" if causal else False, scale=softmax_scale,
                                    window=window, softcap=softcap or None, alibi_slopes=alibi_slopes,
                                    sinks=sinks, return_lse=True, num_threads=num_threads)
    else:
        memo_key = None   # (set: this call's layout is derived and remembered)
        if not return_attn_probs and k_descale is None and v_descale is None and alibi_slopes is None \
                and sinks is None:
            # the layout of every layer of a decode step: its kernel calls derived once (_layout_memo)
            layout = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap)
            memo_key = _layout_memo.key(q, k, v, cu_seqlens_q, cu_seqlens_k, *layout, block_table, num_threads)
            entry = _layout_memo.calls_of(memo_key)
            if entry:
                return _layout_memo.run(entry, q, k, v, into)
            if memo_key is not None and entry is None:   # (derived from copies whose bytes are the key's)
                cu_seqlens_q, cu_seqlens_k, block_table = _layout_memo.snapshot(cu_seqlens_q, cu_seqlens_k,
                                                                                block_table)
                memo_key = _layout_memo.key(q, k, v, cu_seqlens_q, cu_seqlens_k, *layout, block_table, num_threads)
            else:   # (not memoized, or known to take this full path)
                memo_key = None
        p = _paged_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                  causal, window, softcap, alibi_slopes, block_table, sinks, num_threads)
        if memo_key is not None:
            _layout_memo.remember(memo_key, p)
        H_kv = p.k.shape[2]
        p = _paged.apply_descale(p, _paged.check_descale(k_descale, "k_descale", p.n_seq, H_kv, p.k),
                                 _paged.check_descale(v_descale, "v_descale", p.n_seq, H_kv, p.v))
        out, lse = _paged.forward(p, with_lse=bool(return_attn_probs), narrow=True)
        out = _dtypes.cast(out[0], p.out_dtype)  # [1, total_q, H, Ev] -> [total_q, H, Ev]
        lse = None if lse is None else lse[0]
    if not return_attn_probs:
        return out
    if _is_float8(k):
        raise ValueError("return_attn_probs is not supported over a float8 k and v (its S_dmask is computed from "
                         "the gathered keys, which take no k_descale)")
    w = _varlen_probs(as_float_array(q, "q"), _paged.as_cache(k, "k"), _paged.as_cache(v, "v"),
                      np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64),
                      None if block_table is None else np.asarray(block_table), alibi_slopes,
                      is_causal="lower_right" if causal else False, scale=softmax_scale, window=window,
                      softcap=softcap or None, sinks=sinks)
    return out, lse, w


def _check_out(out, q, k, v):
    """``out`` of flash_attn_varlen_func: a writeable ndarray [total_q, H, Ev] of q's dtype that overlaps
    none of q, k and v (ValueError/TypeError naming it otherwise; shapes as q's and v's). Where q or v
    has not the dims of a varlen call, their own checks raise first (nothing runs before them)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be an array (or a torch tensor) of shape [total_q, nheads, headdim_v]; "
                        f"got {type(out).__name__}")
    if q.ndim != 3 or np.ndim(v) < 3:
        return
    shape = q.shape[:2] + np.shape(v)[-1:]
    if out.shape != shape or out.dtype.newbyteorder("=") != q.dtype:   # (q in native order: as_float_array)
        raise ValueError(f"out must have q's dtype and the shape [total_q, nheads, headdim_v] = {shape}; got "
                         f"{describe_array(out)} (q with {describe_array(q)})")
    if not out.flags.writeable:
        raise ValueError(f"out is read-only: {describe_array(out)}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if isinstance(a, np.ndarray) and np.may_share_memory(out, a):
            raise ValueError(f"out overlaps {name}: the kernel reads {name} while it writes out")


def _is_packed_cache(q, k, v):
    """Packed q, k, v [total, heads, headdim] ndarrays of one float dtype, with keys: run as one
    contiguous cache row (the packed float8 call's route), the same plans as over pages, and the
    memoized layout of a decode step (attn.flash._layout_memo). A 16-bit query is read as it is
    (attn._paged.kernel_query), where varlen_attention's float32 copy took a prefill 2 x 1024 causal
    H32/8 E128 1.3x the time; anything else (mixed dtypes, no keys) keeps varlen_attention's route."""
    return (all(type(x) is np.ndarray and x.ndim == 3 and x.dtype == q.dtype for x in (q, k, v))
            and (q.dtype in (np.float16, np.float32, np.float64) or _dtypes.is_bfloat16(q.dtype))
            and k.shape[0] > 0)


def _paged_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          window, softcap, alibi_slopes, block_table, sinks, num_threads):
    """The :class:`attn._paged.CacheProblem` of a varlen call whose k, v are pages [num_blocks, page, H_kv, E]
    (or, without a block_table, a packed float8 k, v [total_k, H_kv, E]: one contiguous cache row)."""
    q = as_float_array(q, "q")
    k, v = _paged.as_cache(k, "k"), _paged.as_cache(v, "v")
    if q.ndim != 3:
        raise ValueError(f"q must have shape [total_q, nheads, headdim]; got {describe_array(q)}")
    packed = block_table is None
    if packed:
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3:
                raise ValueError(f"{name} must have shape [total_k, nheads_k, headdim]; got {describe_array(a)}")
        k, v = k[None], v[None]  # [total_k, H_kv, E] -> [1, total_k, H_kv, E]
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape [num_blocks, page_block_size, nheads_k, headdim] with a "
                             f"block_table; got {describe_array(a)}")
    _paged.check_cache_dtypes(q, k, v, "the pages")
    if k.shape[:3] != v.shape[:3] or k.shape[3] != q.shape[2] or k.shape[1] == 0:
        raise ValueError(f"q [total_q, H, E], k [num_blocks, page_block_size, H_kv, E] and v [.., .., H_kv, Ev] do "
                         f"not match: q with {describe_array(q)}, k with {describe_array(k)}, v with {describe_array(v)}")
    if k.shape[2] == 0 or q.shape[1] % k.shape[2] != 0:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of the pages' ({k.shape[2]})")
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k_raw = _paged.as_index_array(cu_seqlens_k, "cu_seqlens_k", "[batch + 1]")
    cu_k = _cu_seqlens(cu_k_raw, "cu_seqlens_k", int(cu_k_raw[-1]) if cu_k_raw.size else 0)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; "
                         f"got {cu_q.shape[0] - 1} and {cu_k.shape[0] - 1}")
    q_len, k_len = np.diff(cu_q), np.diff(cu_k)
    for name, given, actual in (("max_seqlen_q", max_seqlen_q, q_len), ("max_seqlen_k", max_seqlen_k, k_len)):
        if given is not None and int(given) < int(actual.max(initial=0)):
            raise ValueError(f"{name}={given} is less than the longest sequence ({int(actual.max())} tokens)")
    if packed:
        if int(cu_k[-1]) != k.shape[1]:
            raise ValueError(f"cu_seqlens_k[-1] ({int(cu_k[-1])}) must equal k's total_k ({k.shape[1]})")
        table = None
    else:
        table = _paged.check_block_table(block_table, len(q_len), k.shape[0], k.shape[1], k_len)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    B, H = len(q_len), q.shape[1]
    _kvcache._paged_variants_check(window, softcap, alibi_slopes, sinks, B, H, q.dtype)
    zeros = np.zeros(B, np.int64)
    return _paged.CacheProblem(
        q=_paged.kernel_query(q, k, v)[None], q_batch=zeros, q_start=cu_q[:-1], q_len=q_len,
        k=k, v=v, k_batch=zeros, k_start=cu_k[:-1] if packed else zeros, k_len=k_len, block_table=table,
        causal=bool(causal),
        scale=check_scale(softmax_scale, q.shape[2]), window=window, softcap=float(softcap) if softcap else None,
        alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=q.dtype, q_bf16=_dtypes.is_bfloat16(q.dtype),
        num_threads=_threads.check_num_threads(num_threads),
    )
