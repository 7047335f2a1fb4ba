"""Argument checking for every public entry point: the one place that validates.

Everything here runs before any kernel. A bad argument raises ``TypeError``
(wrong kind or dtype) or ``ValueError`` (wrong shape or value) whose message
names the argument, its shape and its dtype. What comes out is a normalized
problem description that the backends can trust: compute dtype chosen
(float16 and bfloat16 are computed in float32), one mask with its kind
(bool: True = takes part; float: added to the scores), causal alignment
turned into a diagonal offset. The problem is immutable.

Which backend runs a problem is decided in :mod:`attn._backends`, whether it
fits in memory in :mod:`attn._memory`, thread counts in :mod:`attn._threads`.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _dtypes, _mask_warning, _quantized, _threads, _variants
from ._arrays import as_array as _as_array, as_float_array, astype_no_broadcast_copy, describe_array  # noqa: F401
from ._integers import normalize_axis
from ._shapes import batch_shape

CAUSAL_ALIGNMENTS = {True: "upper_left", "upper_left": "upper_left", "lower_right": "lower_right"}


compute_dtype = _dtypes.compute_dtype  # float16 and bfloat16 are computed in float32


MASK_BOOL, MASK_ADD = "bool", "add"  # the kinds of mask: True = takes part / added to the scores


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call: the one description every backend runs from.

    Arrays are in the compute dtype, except float16 or bfloat16 k and v (a
    16-bit cache), which are kept as they are, and int8 ones
    (:class:`attn.Q8Tensor`, an 8-bit cache). Immutable: choosing a backend
    (attn._backends.select) reads it and never rewrites it.
    """

    q: np.ndarray  # [..., n_q, d_k]
    k: np.ndarray  # [..., n_kv_head?, n_k, d_k] (or an attn.Q8Tensor of that shape)
    v: np.ndarray  # [..., n_kv_head?, n_k, d_v] (or an attn.Q8Tensor of that shape)
    batch: tuple  # broadcast leading dims of the output
    n_q: int
    n_k: int
    d_k: int
    d_v: int
    group: int  # query heads per key/value head (GQA); 1 without GQA
    mask: Optional[np.ndarray]  # broadcastable to [*batch, n_q, n_k], of kind mask_kind; or None
    mask_kind: Optional[str]  # MASK_BOOL (True = takes part), MASK_ADD (added to the scores) or None
    causal_offset: Optional[int]  # key j visible to row i iff j <= i + offset
    scale: float
    dropout_p: float
    rng: Optional[np.random.Generator]
    out_dtype: np.dtype
    backend: str  # as asked ("auto" included); attn._backends.select names the one that runs
    return_weights: bool
    num_threads: int
    variants: Optional[_variants.Variants] = None  # window, softcap, ALiBi, sinks (attn._variants)

    @property
    def allowed(self):
        """The bool mask (True = takes part), or None: the NumPy forms' view of ``mask``."""
        return self.mask if self.mask_kind == MASK_BOOL else None

    @property
    def bias(self):
        """The float mask added to the scores, or None: the NumPy forms' view of ``mask``."""
        return self.mask if self.mask_kind == MASK_ADD else None


def _batch_shape(q, k, v, group):
    """Broadcast leading dims; with GQA the key/value head dim (-3) is expanded."""
    try:
        return batch_shape(q.shape, k.shape, v.shape, gqa=group > 1)
    except ValueError:
        raise ValueError(
            "the leading (batch) dims of query, key and value do not broadcast: "
            f"query with {describe_array(q)}, key with {describe_array(k)}, value with {describe_array(v)}"
        ) from None


def _gqa_group(q, k, v, enable_gqa):
    """Query heads per key/value head (dim -3), or 1."""
    if not enable_gqa or q.ndim < 3 or k.ndim < 3 or v.ndim < 3:
        return 1
    h_q, h_k, h_v = q.shape[-3], k.shape[-3], v.shape[-3]
    if h_k != h_v:
        raise ValueError(
            f"enable_gqa: key and value must have the same number of heads (dim -3); "
            f"got key with {describe_array(k)} and value with {describe_array(v)}"
        )
    if h_k == 0 or h_q % h_k != 0:
        raise ValueError(
            f"enable_gqa: query heads (dim -3) must be a multiple of key/value heads; "
            f"got query with {describe_array(q)} and key with {describe_array(k)}"
        )
    return h_q // h_k


def _check_mask(attn_mask, mask_shape, dtype, name="attn_mask", keys_last=True):
    """Return (mask, kind) of an SDPA-convention mask: (None, None), a bool mask
    (MASK_BOOL) or a float one in the compute ``dtype`` (MASK_ADD).

    ``keys_last``: the last axis is the key axis, so a bool mask is laid out
    [..., L, S] and is checked for the inverted causal pattern.
    """
    if attn_mask is None:
        return None, None
    m = _as_array(attn_mask, name)
    if m.dtype != np.bool_ and not _dtypes.is_float(m.dtype):
        raise TypeError(
            f"{name} must be a bool array (True = takes part) or a float array "
            f"(added to the scores); got {describe_array(m)}"
        )
    try:
        full = np.broadcast_shapes(m.shape, mask_shape)
    except ValueError:
        full = None
    if full != mask_shape:
        raise ValueError(
            f"{name} with {describe_array(m)} does not broadcast to the scores' shape {mask_shape}"
        )
    if m.dtype == np.bool_:
        if keys_last:
            _mask_warning.warn_if_inverted_causal(m, name)
        return m, MASK_BOOL
    return astype_no_broadcast_copy(m, dtype), MASK_ADD


def _causal_alignment(is_causal):
    """None (not causal), 'upper_left' or 'lower_right'; anything else is a ValueError."""
    if is_causal is None:
        return None
    if isinstance(is_causal, (bool, np.bool_)):
        return "upper_left" if is_causal else None
    if isinstance(is_causal, str) and is_causal in CAUSAL_ALIGNMENTS:
        return CAUSAL_ALIGNMENTS[is_causal]
    raise ValueError(
        "is_causal must be False, True (= 'upper_left': row i sees keys 0..i, as torch) "
        f"or 'lower_right' (row i sees keys 0..n_k-n_q+i); got {is_causal!r}"
    )


def _causal_offset(alignment, n_q, n_k):
    if alignment is None:
        return None
    return 0 if alignment == "upper_left" else n_k - n_q


def check_scale(scale, d_k):
    """``scale`` as a float (None: ``1 / sqrt(d_k)``, 1 when d_k = 0); TypeError/ValueError otherwise."""
    if scale is None:
        return 1.0 / math.sqrt(d_k) if d_k > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def decide_shapes_and_options(q, k, v, is_causal, scale, enable_gqa, num_threads):
    """What every attention call decides from its operands' shapes and its options, in one place.

    Called by :func:`validate_attention` and by the compiled fast path
    (``attn._fast_path.sdpa_fast``, for the calls it takes), so the two never
    decide differently: the broadcast batch, the GQA group, the causal
    offset, the scale and the thread count, each raising the same error.

    Parameters
    ----------
    q, k, v : ndarray, at least 2-d, q and k with one last dim, k and v with one dim -2

    Returns
    -------
    (batch, group, causal_offset or None, scale, num_threads)
    """
    group = _gqa_group(q, k, v, enable_gqa)
    batch = _batch_shape(q, k, v, group)
    alignment = None if is_causal is False else _causal_alignment(is_causal)  # (False: the common case)
    causal_offset = None if alignment is None else _causal_offset(alignment, q.shape[-2], k.shape[-2])
    return batch, group, causal_offset, check_scale(scale, q.shape[-1]), _threads.check_num_threads(num_threads)


def validate_attention(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    backend, return_weights, rng, num_threads, window=None, softcap=None, alibi_slopes=None, sinks=None,
):
    """Check every argument of :func:`attn.scaled_dot_product_attention`."""
    q = as_float_array(query, "query")
    int8_cache = _quantized.is_q8(key) or _quantized.is_q8(value)  # q8_0 rows (attn.Q8Tensor)
    if int8_cache:
        _quantized.check_pair(q, key, value)
        k, v = key, value
    else:
        k = as_float_array(key, "key")
        v = as_float_array(value, "value")
    # a 16-bit KV cache (float16 or bfloat16) under a float32 query
    half_cache = q.dtype == np.float32 and k.dtype == v.dtype and _dtypes.is_16bit(k.dtype)
    if not (q.dtype == k.dtype == v.dtype or half_cache or int8_cache):
        raise TypeError(
            "query, key and value must have the same dtype (or a float32 query with float16 or "
            f"bfloat16 key and value); got query with {describe_array(q)}, "
            f"key with {describe_array(k)}, value with {describe_array(v)}"
        )
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims [..., seq, features]; got {describe_array(a)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dim E; got query with {describe_array(q)} "
            f"and key with {describe_array(k)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must have the same sequence length S (dim -2); "
            f"got key with {describe_array(k)} and value with {describe_array(v)}"
        )
    batch, group, causal_offset, scale, num_threads = decide_shapes_and_options(
        q, k, v, is_causal, scale, enable_gqa, num_threads)
    n_q, n_k, d_k, d_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if attn_mask is not None and causal_offset is not None:
        raise ValueError(
            f"attn_mask and is_causal={is_causal!r} are mutually exclusive (torch documents an "
            "error for both); pass a causal attn_mask, or is_causal=True without attn_mask"
        )
    cdtype = compute_dtype(q.dtype)
    mask, mask_kind = _check_mask(attn_mask, batch + (n_q, n_k), cdtype)

    if type(dropout_p) is not float and (  # (a plain float skips the slow ABC check)
        isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real)
    ):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        if rng is None:
            rng = np.random.default_rng()
        elif not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")

    variants = _variants.validate(window, softcap, alibi_slopes, sinks, batch=batch, n_q=n_q, n_k=n_k,
                                  causal_offset=causal_offset, cdtype=cdtype)

    return AttentionProblem(
        # float16/bfloat16 keys and values stay as they are (the fused kernel
        # widens them in registers; the NumPy forms promote them when they
        # multiply), and so do int8 ones (attn._backends.read_by)
        q=astype_no_broadcast_copy(q, cdtype), k=k, v=v,
        batch=batch, n_q=n_q, n_k=n_k, d_k=d_k, d_v=d_v, group=group,
        mask=mask, mask_kind=mask_kind, causal_offset=causal_offset, scale=scale,
        dropout_p=dropout_p, rng=rng, out_dtype=q.dtype, backend=backend,
        return_weights=bool(return_weights), num_threads=num_threads, variants=variants,
    )


def check_axis(a, axis, name):
    """``axis`` as a non-negative int valid for ``a`` (at least 1-d), else TypeError/ValueError."""
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dim; got {describe_array(a)}")
    return normalize_axis(axis, a.ndim, "axis", f"{name} with {describe_array(a)}")


def validate_effective_keys(weights, axis):
    """Check the arguments of :func:`attn.effective_keys`; return (weights, axis)."""
    w = as_float_array(weights, "weights")
    return w, check_axis(w, axis, "weights")


@dataclass(frozen=True)
class SoftmaxProblem:
    """A validated masked-softmax call (immutable, as AttentionProblem)."""

    x: np.ndarray  # compute dtype, softmax axis moved last
    mask: Optional[np.ndarray]  # broadcast to x.shape, axis moved last, of kind mask_kind; or None
    mask_kind: Optional[str]  # MASK_BOOL, MASK_ADD or None
    axis: int
    out_dtype: np.dtype
    backend: str  # as asked; attn._backends.select_softmax names the one that runs
    num_threads: int

    allowed = AttentionProblem.allowed
    bias = AttentionProblem.bias


def validate_masked_softmax(x, mask, axis, backend, num_threads):
    """Check every argument of :func:`attn.masked_softmax`."""
    a = as_float_array(x, "x")
    axis = check_axis(a, axis, "x")
    cdtype = compute_dtype(a.dtype)
    mask, mask_kind = _check_mask(mask, a.shape, cdtype, name="mask", keys_last=axis == a.ndim - 1)
    num_threads = _threads.check_num_threads(num_threads)
    if mask is not None:
        mask = np.moveaxis(np.broadcast_to(mask, a.shape), axis, -1)  # [..., n] (a view)
    return SoftmaxProblem(
        x=np.moveaxis(astype_no_broadcast_copy(a, cdtype), axis, -1), mask=mask, mask_kind=mask_kind,
        axis=axis, out_dtype=a.dtype, backend=backend, num_threads=num_threads,
    )


def validate_grad_out(grad_out, out_shape, out_dtype):
    """``grad_out`` of a vjp's ``backward``: exactly the output's shape and dtype."""
    g = as_float_array(grad_out, "grad_out")
    if tuple(g.shape) != tuple(out_shape):
        raise ValueError(
            f"grad_out must have the output's shape {tuple(out_shape)}; got {describe_array(g)}"
        )
    if g.dtype != out_dtype:
        raise TypeError(
            f"grad_out must have the output's dtype {np.dtype(out_dtype)}; got {describe_array(g)}"
        )
    return g


def validate_mask_grad(mask_grad, attn_mask_dtype):
    """``mask_grad`` of a vjp's ``backward``: a bool, True only with a float ``attn_mask``."""
    if not isinstance(mask_grad, (bool, np.bool_)):
        raise TypeError(f"mask_grad must be True or False, got {mask_grad!r}")
    if mask_grad and (attn_mask_dtype is None or attn_mask_dtype.kind != "f"):
        have = "no attn_mask" if attn_mask_dtype is None else f"an attn_mask of dtype {attn_mask_dtype}"
        raise ValueError(
            "mask_grad=True needs a float attn_mask (a bool mask or is_causal has no gradient); "
            f"the forward had {have}"
        )
    return bool(mask_grad)
