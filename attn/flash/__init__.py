"""FlashAttention 2's Python functions on the CPU: the same names, arguments, layouts and semantics.

>>> import numpy as np
>>> from attn.flash import flash_attn_func, flash_attn_with_kvcache
>>> q = np.random.default_rng(0).standard_normal((2, 128, 8, 64), dtype=np.float32)  # [batch, seqlen, nheads, headdim]
>>> out = flash_attn_func(q, q[:, :, :2], q[:, :, :2], causal=True)                   # GQA: 8 query heads, 2 kv heads

Code written against ``flash_attn`` runs here with ``from attn.flash import
...``: NumPy arrays or CPU torch tensors in, the same kind out (torch
tensors keep autograd through :func:`flash_attn_func`,
:func:`flash_attn_varlen_func` and their packed forms); float16, bfloat16,
float32 and float64.

Semantics (FlashAttention's): layouts ``[batch, seqlen, nheads, headdim]``
and, packed, ``[total_tokens, nheads, headdim]`` with ``cu_seqlens``;
``causal`` aligned to the bottom-right corner (row i of L sees key j of S
iff ``j <= i + S - L``); ``window_size=(left, right)`` (-1: unbounded) keeps
keys ``i + S - L - left <= j <= i + S - L + right``; ``softcap > 0`` caps the
scaled scores to ``softcap * tanh(s / softcap)``; ``alibi_slopes`` [nheads] or
[batch, nheads] adds ``-slope * |i + S - L - j|``; query head h reads
key/value head ``h // (nheads / nheads_k)``; a row that sees no key gives 0.
``softmax_lse`` is the log-sum-exp of each row's scaled scores, [batch,
nheads, seqlen] (varlen: [nheads, total_q]).

Paged caches: ``block_table`` [batch, max_blocks_per_seq] of int32 page
indices into ``k_cache``/``v_cache`` [num_blocks, page_block_size, nheads_k,
headdim], any page size (FlashAttention 3's rule; FlashAttention 2's
multiple of 256 is a CUDA limit). The kernel reads the pages in place
(:mod:`attn._paged`).

attn's extensions, keyword-only: ``sinks`` [nheads] (gpt-oss's attention
sinks, transformers' ``s_aux``), ``num_threads``; float32 queries over a
float16/bfloat16 cache. Not supported: dropout in the varlen and kvcache
functions (the kvcache one has none in FlashAttention either).
``deterministic`` is accepted and changes nothing (attn's backward is always
deterministic); ``num_splits`` is checked and the split is the kernel's own
(its results do not depend on it). See docs/flash_api.md.
"""

import numpy as np

from .. import _dtypes, _paged, _quantized
from .._interop import is_torch, to_numpy, to_torch
from . import _kvcache
from ._forward import dense_forward, varlen_forward

# ._autograd (torch.autograd.Function's) is imported in the two functions that need it, when a
# torch tensor that requires grad comes in: it imports torch, which `import attn` must not

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


# ------------------------------------------------------------------ torch in, torch out
def _numpy_args(named):
    """``(arguments as NumPy, whether any was a torch tensor)``; torch tensors viewed in place."""
    torch_in = any(is_torch(x) for x in named.values())
    if not torch_in:
        return named, False
    return {n: to_numpy(x, n, detach=True) if is_torch(x) else x for n, x in named.items()}, True


def _scalar(x):
    """A 0-d integer tensor or array (transformers passes max_seqlen so) as an int; anything else as it is."""
    if is_torch(x):
        return int(x) if x.ndim == 0 and not x.dtype.is_floating_point else x
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x)
    return x


def _needs_autograd(*tensors):
    """Whether torch autograd records a call with these arguments (then the autograd functions run)."""
    tensors = [t for t in tensors if is_torch(t)]
    if not tensors:
        return False
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ------------------------------------------------------------------ dense batches
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    sinks=None, num_threads=None, rng=None):
    """Attention over a batch of equal-length sequences (FlashAttention's ``flash_attn_func``).

    Parameters
    ----------
    q : array_like or torch.Tensor, shape [batch, seqlen_q, nheads, headdim]
    k : shape [batch, seqlen_k, nheads_k, headdim]
    v : shape [batch, seqlen_k, nheads_k, headdim_v]
        One dtype: float16, bfloat16, float32 or float64; nheads a multiple of nheads_k.
    dropout_p : float
        Dropout on the attention weights (drawn from ``rng``, a numpy.random.Generator).
    softmax_scale : float, optional
        Default ``1 / sqrt(headdim)``.
    causal, window_size, softcap, alibi_slopes
        See the module docstring (FlashAttention's semantics).
    deterministic : bool
        Accepted; attn's backward is deterministic anyway.
    return_attn_probs : bool
        Also return ``softmax_lse`` [batch, nheads, seqlen_q] and the weights
        [batch, nheads, seqlen_q, seqlen_k] (for testing, as in FlashAttention).
    sinks : array_like, shape [nheads], optional
        attn's extension: one logit per head joining each row's softmax sum.

    Returns
    -------
    out : shape [batch, seqlen_q, nheads, headdim_v], q's dtype
    (out, softmax_lse, S_dmask) with ``return_attn_probs``.

    Torch tensors that require grad (with grad recording on) get attn's
    fused backward through a ``torch.autograd.Function``.
    """
    if _needs_autograd(q, k, v, sinks):
        from . import _autograd  # imports torch (see the imports above)

        return _autograd.dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               return_attn_probs, sinks, num_threads, rng)
    a, torch_in = _numpy_args(dict(q=q, k=k, v=v, alibi_slopes=alibi_slopes, sinks=sinks))
    result = dense_forward(a["q"], a["k"], a["v"], dropout_p, softmax_scale, causal, window_size, softcap,
                           a["alibi_slopes"], return_attn_probs, a["sinks"], num_threads, rng)
    return to_torch(result) if torch_in else result


def _unpack(x, name, n, layout):
    """The n tensors packed along dim -3 of ``x`` (views; torch slicing keeps autograd)."""
    if len(x.shape) < 3 or x.shape[-3] != n:
        raise ValueError(f"{name} must have shape {layout}; got shape {tuple(x.shape)}")
    return tuple(x[..., i, :, :] for i in range(n))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              sinks=None, num_threads=None, rng=None):
    """:func:`flash_attn_func` with ``qkv`` [batch, seqlen, 3, nheads, headdim] (views, no copy)."""
    q, k, v = _unpack(qkv, "qkv", 3, "[batch, seqlen, 3, nheads, headdim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, num_threads=num_threads, rng=rng)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             sinks=None, num_threads=None, rng=None):
    """:func:`flash_attn_func` with ``kv`` [batch, seqlen_k, 2, nheads_k, headdim] (views, no copy)."""
    k, v = _unpack(kv, "kv", 2, "[batch, seqlen_k, 2, nheads_k, headdim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks, num_threads=num_threads, rng=rng)


# ------------------------------------------------------------------ packed variable-length batches
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sinks=None,
                           num_threads=None, k_descale=None, v_descale=None, out=None):
    """Attention over a packed batch of variable-length sequences (FlashAttention's ``flash_attn_varlen_func``).

    Parameters
    ----------
    q : shape [total_q, nheads, headdim]
    k, v : shape [total_k, nheads_k, headdim(_v)]; with ``block_table``, the
        pages [num_blocks, page_block_size, nheads_k, headdim(_v)]
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape [batch + 1]
        Cumulative sequence lengths: sequence s owns query tokens
        ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and ``cu_seqlens_k[s + 1] -
        cu_seqlens_k[s]`` keys (tokens of k, or the first keys of its pages).
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence (checked).
    block_table : array_like of int32, shape [batch, max_blocks_per_seq], optional
        Sequence s's keys are in pages ``block_table[s, 0], block_table[s, 1], ...``
        (read in place). Each sequence may mix prefill chunks and decode
        rows: L_s query rows aligned with its S_s keys.
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
        As :func:`flash_attn_func` (dropout_p must be 0).
    k_descale, v_descale : float or array_like [batch, nheads_k], optional
        A float8 k and v (``float8_e4m3fn``/``float8_e5m2``, ml_dtypes' or
        torch's; packed or paged, read in place): the real keys are the
        stored ones times ``k_descale`` (FlashAttention 3's names), values
        alike. Only with a float8 k, v (docs/flash_api.md).
    out : shape [total_q, nheads, headdim_v], q's dtype, optional
        Where the result goes (vLLM's flash-attention takes it so): written in place and returned
        (the very object given, array or tensor; not one that requires grad). With a ``block_table`` or a float8 k, v the kernel
        writes a C-contiguous float32 or bfloat16 ``out`` itself; otherwise the result is copied
        in. It may not overlap q, k or v.

    Returns
    -------
    out : shape [total_q, nheads, headdim_v]
    (out, softmax_lse [nheads, total_q], S_dmask [batch, nheads, max_seqlen_q, max_seqlen_k]) with
    ``return_attn_probs``.
    """
    max_seqlen_q, max_seqlen_k = _scalar(max_seqlen_q), _scalar(max_seqlen_k)
    if out is not None and _needs_autograd(out):
        raise ValueError("out requires grad: flash_attn_varlen_func writes it in place, which autograd cannot "
                         "record; pass a tensor that does not require grad (or call under torch.no_grad())")
    if _needs_autograd(q, k, v, sinks):
        if block_table is not None:
            raise ValueError("flash_attn_varlen_func with a block_table has no backward (as in FlashAttention): "
                             "call it under torch.no_grad(), or pass packed k and v")
        if out is not None:
            raise ValueError("flash_attn_varlen_func's out= has no backward: call it under torch.no_grad(), "
                             "or leave out unset")
        from . import _autograd  # imports torch (see the imports above)

        return _autograd.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                sinks, num_threads)
    a, torch_in = _numpy_args(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   alibi_slopes=alibi_slopes, block_table=block_table, sinks=sinks,
                                   k_descale=k_descale, v_descale=v_descale, out=out))
    result = varlen_forward(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, a["alibi_slopes"],
                            return_attn_probs, a["block_table"], a["sinks"], num_threads, a["k_descale"],
                            a["v_descale"], out=a["out"])
    if out is not None:   # the caller's array or tensor, written in place
        return (out,) + tuple(to_torch(r) if torch_in else r for r in result[1:]) if return_attn_probs else out
    return to_torch(result) if torch_in else result


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None, num_threads=None):
    """:func:`flash_attn_varlen_func` with ``qkv`` [total, 3, nheads, headdim] (views, no copy)."""
    q, k, v = _unpack(qkv, "qkv", 3, "[total, 3, nheads, headdim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sinks=sinks, num_threads=num_threads)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None,
                                    num_threads=None):
    """:func:`flash_attn_varlen_func` with ``kv`` [total_k, 2, nheads_k, headdim] (views, no copy)."""
    k, v = _unpack(kv, "kv", 2, "[total_k, 2, nheads_k, headdim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks, num_threads=num_threads)


# ------------------------------------------------------------------ a key/value cache
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            sinks=None, num_threads=None, k_descale=None, v_descale=None):
    """Decode or prefill against a key/value cache, appending the new keys in place
    (FlashAttention's ``flash_attn_with_kvcache``).

    Parameters
    ----------
    q : shape [batch, seqlen_q, nheads, headdim]
    k_cache, v_cache : shape [batch_cache, seqlen_cache, nheads_k, headdim(_v)], or with
        ``block_table`` [num_blocks, page_block_size, nheads_k, headdim(_v)]; any page size.
        Written in place when ``k``/``v`` are given (a torch tensor's storage too).
    k, v : shape [batch, seqlen_new, nheads_k, headdim(_v)], optional
        New keys and values, written at positions ``cache_seqlens[b] ...``
        (rotated first when ``rotary_cos``/``rotary_sin`` are given).
    rotary_cos, rotary_sin : shape [seqlen_ro, rotary_dim / 2], optional
        RoPE tables (:mod:`attn.flash._rotary`): the new k at its positions,
        q at ``cache_seqlens[b] + i`` (causal or windowed) or ``cache_seqlens[b]``.
    cache_seqlens : int or array_like of int [batch], optional
        Keys already in each row's cache (None: the whole cache).
    cache_batch_idx : array_like of int [batch], optional
        The cache's batch row of each q row (contiguous cache only).
    cache_leftpad : array_like of int [batch], optional
        Each row's keys start there (contiguous cache only).
    block_table : array_like of int32 [batch, max_blocks_per_seq], optional
        The pages of each row's keys, in order.
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As :func:`flash_attn_func` (rows aligned with each row's own last key).
    rotary_interleaved : bool
        GPT-J pairs (True) or GPT-NeoX halves (False).
    num_splits : int >= 0
        Checked; the key split is the kernel's own decision.
    return_softmax_lse : bool
        Also return ``softmax_lse`` [batch, nheads, seqlen_q].
    k_descale, v_descale : float or array_like [batch, nheads_k], optional
        A float8 cache (``float8_e4m3fn``/``float8_e5m2``, ml_dtypes' or
        torch's, read in place): the real keys are the stored ones times
        ``k_descale`` (FlashAttention 3's names), values alike; new ``k``,
        ``v`` (any float dtype) are stored divided by them, rounded to
        nearest even and saturated to the format's largest finite value
        (448 for e4m3fn, 57344 for e5m2). Only with a float8 cache.

    Returns
    -------
    out : shape [batch, seqlen_q, nheads, headdim_v], q's dtype
    (out, softmax_lse) with ``return_softmax_lse``.

    Every argument is checked before the cache is written: an error leaves it
    unchanged. Two rows may share pages (prefix caching) and read them
    correctly; appending into a shared page changes it for every row that
    reads it, which is the caller's decision. No backward (as FlashAttention).
    """
    a, torch_in = _numpy_args(dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale,
        v_descale=v_descale))
    if not isinstance(return_softmax_lse, (bool, np.bool_)):
        raise TypeError(f"return_softmax_lse must be True or False, got {return_softmax_lse!r}")
    for name in ("k_cache", "v_cache"):
        c = a[name].data if _quantized.is_q8(a[name]) else a[name]
        if a["k"] is not None and not (isinstance(c, np.ndarray) and c.flags.writeable):
            raise TypeError(f"{name} must be a writeable NumPy array, CPU torch tensor or attn.Q8Tensor: the new "
                            f"keys are written into it in place; got {type(a[name]).__name__}")
    p = _kvcache.prepare(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["rotary_cos"], a["rotary_sin"],
                         a["cache_seqlens"], a["cache_batch_idx"], a["cache_leftpad"], a["block_table"],
                         softmax_scale, causal, window_size, softcap, rotary_interleaved, a["alibi_slopes"],
                         num_splits, a["sinks"], num_threads, a["k_descale"], a["v_descale"])
    out, lse = _paged.forward(p, with_lse=bool(return_softmax_lse), narrow=True)
    out = _dtypes.cast(out, p.out_dtype)  # [B, L, H, Ev]
    result = (out, lse) if return_softmax_lse else out
    return to_torch(result) if torch_in else result
