"""Packed variable-length batches: FlashAttention's ``flash_attn_varlen_func`` layout.

The sequences of a batch are concatenated along the token axis, with no
padding: query ``[total_q, H, E]``, key and value ``[total_k, H_kv, E(v)]``,
and sequence s owns tokens ``cu_seqlens[s] : cu_seqlens[s + 1]``. Each
sequence is its own attention problem (causal alignment, window, ALiBi per
sequence; its queries never see another sequence's keys).

The backend layer chooses how (:func:`attn._backends.select_varlen`). A backend
that ``RUNS_VARLEN``, the fused kernel, runs the whole batch in one call
(``varlen_forward`` / ``varlen_backward``): each (sequence, head) is one matrix
of the kernel's operands, described by its per-matrix offsets into the packed
arrays, with its own lengths in a per-matrix table (attn_kernel.h's
``varlen``): no padding is computed, and the forward writes the packed output
directly. A batch with decode rows (sequences of a single query row, or every
sequence with the same few rows) runs as the contiguous cache it is, by
:mod:`attn._paged`'s plans: the query heads of a key/value head read each key
together. With the other backends each sequence is its own
:func:`attn.scaled_dot_product_attention` call (the reference).
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _api, _backends, _dtypes, _quantized, _threads, _variants
from ._integers import check_int
from ._validation import (
    _causal_alignment, as_float_array, astype_no_broadcast_copy, check_scale, compute_dtype, describe_array,
    validate_grad_out,
)


@dataclass
class VarlenProblem:
    q: np.ndarray  # [total_q, H, E], compute dtype
    k: np.ndarray  # [total_k, H_kv, E], compute dtype, or float16/bfloat16 as given (widened_kv)
    v: np.ndarray  # [total_k, H_kv, Ev], as k
    cu_q: np.ndarray  # int64 [B + 1]
    cu_k: np.ndarray
    max_q: int
    max_k: int
    alignment: Optional[str]  # None, "upper_left", "lower_right"
    scale: float
    variants: Optional[_variants.Variants]  # base offsets 0; alibi/sinks broadcast to [B, H]
    out_dtype: np.dtype
    backend: str
    num_threads: int

    @property
    def n_seq(self):
        return len(self.cu_q) - 1

    @property
    def heads(self):
        return self.q.shape[1]

    @property
    def group(self):
        return self.q.shape[1] // self.k.shape[1]

    def widened_kv(self):
        """This problem with K and V in the compute dtype (q's): for the paths that read one dtype."""
        if self.k.dtype == self.q.dtype:
            return self
        return dataclasses.replace(self, k=_dtypes.cast(self.k, self.q.dtype), v=_dtypes.cast(self.v, self.q.dtype))


def _cu_seqlens(cu, name, total):
    try:
        a = np.asarray(cu)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of ints; np.asarray({name}) failed: {exc}") from None
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of ints (int32 or int64); got {describe_array(a)}")
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must have shape [batch + 1]; got {describe_array(a)}")
    a = a.astype(np.int64)
    if a[0] != 0 or np.any(np.diff(a) < 0) or a[-1] != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the number of tokens ({total}); got {a.tolist()}"
        )
    return a


def _max_seqlen(given, lengths, name):
    actual = int(lengths.max()) if lengths.size else 0
    if given is None:
        return actual
    if check_int(given, name) < actual:
        raise ValueError(f"{name}={given} is less than the longest sequence ({actual} tokens)")
    return actual


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                    window, softcap, alibi_slopes, sinks, backend, num_threads):
    """Check every argument of :func:`varlen_attention`; a :class:`VarlenProblem`."""
    for name, a in (("k", k), ("v", v)):
        if _quantized.is_q8(a):
            raise TypeError(f"{name} is an int8 (q8_0) cache tensor, which varlen_attention does not take: "
                            "pass float16, bfloat16, float32 or float64 arrays (an int8 KVCache is read by "
                            "attn.scaled_dot_product_attention)")
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype; got q with {describe_array(q)}, "
                        f"k with {describe_array(k)}, v with {describe_array(v)}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"{name} must have 3 dims [total_tokens, heads, features]; got {describe_array(a)}")
    if q.shape[2] != k.shape[2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q [total_q, H, E], k [total_k, H_kv, E] and v [total_k, H_kv, Ev] do not match: "
                         f"q with {describe_array(q)}, k with {describe_array(k)}, v with {describe_array(v)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"the query heads must be a multiple of the key/value heads (dim 1); "
                         f"got q with {describe_array(q)} and k with {describe_array(k)}")
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; "
                         f"got {cu_q.shape[0] - 1} and {cu_k.shape[0] - 1}")
    max_q = _max_seqlen(max_seqlen_q, np.diff(cu_q), "max_seqlen_q")
    max_k = _max_seqlen(max_seqlen_k, np.diff(cu_k), "max_seqlen_k")
    alignment = _causal_alignment(is_causal)
    scale = check_scale(scale, q.shape[2])
    cdtype = compute_dtype(q.dtype)
    # base offsets 0 (n_q = n_k = 0): each sequence's shift is added per sequence
    variants = _variants.validate(window, softcap, alibi_slopes, sinks, batch=(len(cu_q) - 1, q.shape[1]),
                                  n_q=0, n_k=0, causal_offset=0 if alignment else None, cdtype=cdtype)
    _backends._check_name(backend, _backends.ATTENTION_NAMES)
    num_threads = _threads.check_num_threads(num_threads)
    conv = lambda a: astype_no_broadcast_copy(a, cdtype)
    # 16-bit K and V stay as they are: the fused kernel reads them (as a 16-bit cache, bfloat16 ones
    # by bfloat16 pairs), where widened copies cost as much as a third of a prefill's time and took
    # the float32 products; the backward and the per-sequence calls widen them (widened_kv)
    kv = (lambda a: a) if k.dtype.itemsize == 2 and cdtype == np.float32 else conv
    return VarlenProblem(q=conv(q), k=kv(k), v=kv(v), cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k,
                         alignment=alignment, scale=float(scale), variants=variants, out_dtype=q.dtype,
                         backend=backend, num_threads=num_threads)


# ------------------------------------------------------------------ per sequence (the reference)
def _sequence_kwargs(p, s, backend):
    """Sequence s as a scaled_dot_product_attention call with ``backend``: q [H, L, E], k, v [H_kv, S, .]
    and options."""
    q = p.q[p.cu_q[s]:p.cu_q[s + 1]].transpose(1, 0, 2)
    k = _dtypes.cast(p.k[p.cu_k[s]:p.cu_k[s + 1]], p.q.dtype).transpose(1, 0, 2)
    v = _dtypes.cast(p.v[p.cu_k[s]:p.cu_k[s + 1]], p.q.dtype).transpose(1, 0, 2)
    var = p.variants
    kw = dict(is_causal=p.alignment or False, scale=p.scale, enable_gqa=p.group > 1,
              backend=backend, num_threads=p.num_threads)
    if var is not None:
        kw.update(window=var.window, softcap=var.softcap,
                  alibi_slopes=None if var.alibi is None else var.alibi[s],
                  sinks=None if var.sinks is None else var.sinks[s])
    return _api, q, k, v, kw


def _forward_per_sequence(p, backend):
    out = np.zeros(p.q.shape[:2] + (p.v.shape[2],), p.q.dtype)  # [total_q, H, Ev]
    lse = np.full((p.heads, p.q.shape[0]), -np.inf, p.q.dtype)  # [H, total_q]
    for s in range(p.n_seq):
        api, q, k, v, kw = _sequence_kwargs(p, s, backend)
        o, l = api.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        out[p.cu_q[s]:p.cu_q[s + 1]] = o.transpose(1, 0, 2)
        lse[:, p.cu_q[s]:p.cu_q[s + 1]] = l
    return out, lse


# ------------------------------------------------------------------ public
def _forward(p, choice=None, narrow=False):
    """``(out [total_q, H, Ev], lse [H, total_q])`` of ``p``: nothing to compute without rows or heads;
    else ``choice`` = ``(impl, backend)`` of :func:`attn._backends.select_varlen` (asked here for the
    forward when None): the whole batch by ``impl`` in one call, or (None) each sequence with ``backend``.
    out in the compute dtype; with ``narrow``, ``impl`` may give it in ``p.out_dtype`` already."""
    if p.q.shape[0] == 0 or p.heads == 0:
        return np.zeros(p.q.shape[:2] + (p.v.shape[2],), p.q.dtype), np.full((p.heads, p.q.shape[0]), -np.inf, p.q.dtype)
    impl, backend = _backends.select_varlen(p) if choice is None else choice
    if impl is None:
        return _forward_per_sequence(p, backend)
    return impl.varlen_forward(p, narrow)  # (sinks included: the backend joins them)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     is_causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
                     backend="auto", return_lse=False, num_threads=None):
    """Attention over a packed batch of variable-length sequences (FlashAttention's ``flash_attn_varlen_func``).

    Parameters
    ----------
    q : array_like, shape [total_q, H, E]
    k : array_like, shape [total_k, H_kv, E]
    v : array_like, shape [total_k, H_kv, Ev]
        float16, bfloat16 (ml_dtypes), float32 or float64, one dtype; H a multiple of H_kv (GQA).
        Sequence s owns tokens ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q
        and ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape [B + 1]
        Cumulative sequence starts: 0, ..., total.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence (checked; computed when None).
    is_causal, scale, window, softcap, alibi_slopes, sinks
        As :func:`attn.scaled_dot_product_attention`, per sequence (the
        alignment offsets are each sequence's own S - L); ``alibi_slopes``
        [H] or [B, H], ``sinks`` [H].
    backend : {"auto", "loop", "numpy", "online", "cython"}
        "cython" (and "auto" when built): one call of the fused kernel over
        every (sequence, head), no padding computed (decode rows: the
        cache's decode plan, :mod:`attn._paged`); the others run each
        sequence as a :func:`attn.scaled_dot_product_attention` call.
    return_lse : bool
        Also return the log-sum-exp, shape [H, total_q] (FlashAttention's layout).
    num_threads : int, optional

    Returns
    -------
    out : ndarray, shape [total_q, H, Ev], q's dtype
    lse : ndarray, shape [H, total_q] (with ``return_lse``), the compute dtype
    """
    p = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                        window, softcap, alibi_slopes, sinks, backend, num_threads)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    out, lse = _forward(p, narrow=True)   # (a bfloat16 out may come from the kernel as it is)
    out = _dtypes.cast(out, p.out_dtype)
    return (out, lse) if return_lse else out


def varlen_attention_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                         is_causal=False, scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
                         backend="auto", num_threads=None):
    """:func:`varlen_attention` and its vector-Jacobian product.

    Returns
    -------
    out : ndarray, shape [total_q, H, Ev]
    backward : callable ``backward(grad_out)`` -> ``(grad_q, grad_k, grad_v)`` of q's, k's and
        v's shapes (and ``grad_sinks`` [H] with ``sinks``). The fused backward runs every
        (sequence, head) in one kernel call; its per-matrix buffers are as long as the
        longest sequence (the rows past a sequence are not computed).
    """
    p = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                        window, softcap, alibi_slopes, sinks, backend, num_threads)
    impl, name = _backends.select_varlen(p, gradients=True)
    if p.q.shape[0] == 0:  # no query row: each (empty) sequence as its own call
        impl = None
    if impl is not None:
        out, lse = _forward(p, (impl, name))
    else:
        seqs = [_sequence_kwargs(p, s, name) for s in range(p.n_seq)]
        vjps = [api.scaled_dot_product_attention_vjp(q_, k_, v_, **kw) for api, q_, k_, v_, kw in seqs]
        out = np.zeros(p.q.shape[:2] + (p.v.shape[2],), p.q.dtype)
        for s, (o, _) in enumerate(vjps):
            out[p.cu_q[s]:p.cu_q[s + 1]] = o.transpose(1, 0, 2)
    has_sinks = p.variants is not None and p.variants.sinks is not None

    def backward(grad_out):
        """(grad_q, grad_k, grad_v[, grad_sinks]) for ``grad_out`` = dLoss/d out [total_q, H, Ev]."""
        dout = _dtypes.cast(validate_grad_out(grad_out, out.shape, p.out_dtype), p.q.dtype)
        if impl is not None:
            dq, dk, dv = impl.varlen_backward(p, out, lse, dout)
            grads = (dq, dk, dv)
            if has_sinks:  # [H, total_q, Ev] views, summed over the tokens
                grads += (_variants.sinks_grad(p.variants, out.transpose(1, 0, 2), dout.transpose(1, 0, 2), lse,
                                               sinks=p.variants.sinks[0]),)
        else:
            dq, dk, dv = np.zeros(p.q.shape, p.q.dtype), np.zeros(p.k.shape, p.q.dtype), np.zeros(p.v.shape, p.q.dtype)
            dsinks = np.zeros(p.heads, p.q.dtype)
            for s, (_, bw) in enumerate(vjps):
                g = bw(np.ascontiguousarray(dout[p.cu_q[s]:p.cu_q[s + 1]].transpose(1, 0, 2)))
                dq[p.cu_q[s]:p.cu_q[s + 1]] = g[0].transpose(1, 0, 2)
                dk[p.cu_k[s]:p.cu_k[s + 1]] = g[1].transpose(1, 0, 2)
                dv[p.cu_k[s]:p.cu_k[s + 1]] = g[2].transpose(1, 0, 2)
                if has_sinks:
                    dsinks += g[3]
            grads = (dq, dk, dv) + ((dsinks,) if has_sinks else ())
        return tuple(_dtypes.cast(g, p.out_dtype) for g in grads)

    return _dtypes.cast(out, p.out_dtype), backward
