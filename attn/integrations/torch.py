"""attn's attention as a PyTorch operator, with its backward: ``attn::sdpa``.

>>> import torch
>>> from attn.integrations.torch import scaled_dot_product_attention
>>> q = torch.randn(2, 4, 16, 8, requires_grad=True)
>>> out = scaled_dot_product_attention(q, q, q, is_causal=True)
>>> out.sum().backward()          # q.grad from attn's fused backward

Two custom operators (``torch.library.custom_op``), opaque to autograd and to
``torch.compile``:

``attn::sdpa``           (query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa, seed, window=None, softcap=0.0,
                          alibi_slopes=None, sinks=None) -> (out, lse)
``attn::sdpa_backward``  (grad_out, query, key, value, attn_mask, out, lse, dropout_p,
                          is_causal, scale, enable_gqa, seed, mask_grad, window,
                          softcap, alibi_slopes, sinks)
                          -> (grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks)

The autograd formula (``register_autograd``) saves the inputs, ``out`` and
the log-sum-exp ``lse`` [..., L] (not the L x S weights) and calls the second
operator; both have fake (meta) implementations for tracing. CPU tensors go
to NumPy and back without copies (``Tensor.numpy()`` / ``torch.from_numpy``).

Dropout: when ``dropout_p > 0`` the wrapper draws a 62-bit ``seed`` from
torch's default generator (so ``torch.manual_seed`` governs it), the keep mask
is drawn from ``numpy.random.default_rng(seed)`` in the forward and drawn
again, identically, in the backward; each operator stays a pure function of
its arguments. ``grad_attn_mask`` is an empty tensor unless a float mask
requires grad, ``grad_sinks`` unless there are sinks. ``lse`` (sinks
included) is not differentiable, nor are the ALiBi slopes. The variants
(``window``, ``softcap``, ``alibi_slopes``, ``sinks``) are
:func:`attn.scaled_dot_product_attention`'s.
"""

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import _backends, _dtypes, _gradients
from .._integers import check_int
from .._interop import to_numpy, to_torch
from .._shapes import batch_shape
from .._validation import validate_attention, validate_grad_out

__all__ = ["scaled_dot_product_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _torch(a):
    """A NumPy result as a contiguous CPU tensor (bfloat16 back as torch's)."""
    return to_torch(np.ascontiguousarray(a))


def _problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
             window=None, softcap=0.0, alibi_slopes=None, sinks=None):
    rng = np.random.default_rng(seed) if dropout_p > 0 else None
    q, k, v, mask, slopes, sinks = (to_numpy(t, n, detach=True) for t, n in (
        (query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask"),
        (alibi_slopes, "alibi_slopes"), (sinks, "sinks")))
    p = validate_attention(
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, "auto", False, rng, None,
        None if window is None else tuple(window), softcap or None, slopes, sinks,
    )
    return p, _backends.select(p, gradients=True)


@torch.library.custom_op("attn::sdpa", mutates_args=(), device_types="cpu")
def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
          dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
          seed: int, window: Optional[list[int]] = None, softcap: float = 0.0,
          alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    p, impl = _problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                       window, softcap, alibi_slopes, sinks)
    out, lse = _gradients.forward(p, impl)
    return _torch(_dtypes.cast(out, p.out_dtype)), _torch(lse)


@_sdpa.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
               window=None, softcap=0.0, alibi_slopes=None, sinks=None):
    batch = batch_shape(query.shape, key.shape, value.shape, enable_gqa, torch.broadcast_shapes)
    lse_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    return (query.new_empty(batch + (query.shape[-2], value.shape[-1])),
            query.new_empty(batch + (query.shape[-2],), dtype=lse_dtype))


@torch.library.custom_op("attn::sdpa_backward", mutates_args=(), device_types="cpu")
def _sdpa_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                   attn_mask: Optional[Tensor], out: Tensor, lse: Tensor, dropout_p: float,
                   is_causal: bool, scale: Optional[float], enable_gqa: bool, seed: int,
                   mask_grad: bool, window: Optional[list[int]] = None, softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None,
                   sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    p, impl = _problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                       window, softcap, alibi_slopes, sinks)
    keep = _gradients.replay_keep(p, _gradients.rng_state(p))  # the forward's draw, from the same seed
    dout = validate_grad_out(to_numpy(grad_out, "grad_out", detach=True), p.batch + (p.n_q, p.d_v), p.out_dtype)
    dout = _dtypes.cast(dout, p.q.dtype)   # (bfloat16: widened by the compiled cast)
    o = _dtypes.cast(to_numpy(out, "out", detach=True), p.q.dtype)
    grads = _gradients.vjp(
        p, impl, o, to_numpy(lse, "lse", detach=True), keep, dout, bool(mask_grad),
        (tuple(query.shape), tuple(key.shape), tuple(value.shape)),
        None if attn_mask is None else tuple(attn_mask.shape),
        None if attn_mask is None else to_numpy(attn_mask, "attn_mask", detach=True).dtype,
    )
    dmask = _torch(grads[3]) if mask_grad else query.new_empty((0,))
    dsinks = query.new_empty((0,))
    if sinks is not None:  # the sinks' own dtype
        dsinks = _torch(grads[-1].astype(to_numpy(sinks, "sinks", detach=True).dtype, copy=False))
    return tuple(_torch(g) for g in grads[:3]) + (dmask, dsinks)


@_sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, attn_mask, out, lse, dropout_p, is_causal,
                        scale, enable_gqa, seed, mask_grad, window=None, softcap=0.0, alibi_slopes=None,
                        sinks=None):
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty((0,))
    dsinks = query.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask,
            dsinks)


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
     window, softcap, alibi_slopes, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, alibi_slopes, sinks)
    ctx.args = (dropout_p, is_causal, scale, enable_gqa, seed)
    ctx.variants = (window, softcap)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, attn_mask, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dmask, dsinks = _sdpa_backward(grad_out, query, key, value, attn_mask, out, lse,
                                               *ctx.args, mask_grad, *ctx.variants, alibi_slopes, sinks)
    return (dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None, None, None,
            (dsinks if sinks is not None and ctx.needs_input_grad[12] else None))


_sdpa.register_autograd(_backward, setup_context=_setup_context)


def _check_tensor(name, t, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (attn is a CPU library); got device {t.device}")
    if t.dtype not in _DTYPES and not (optional and t.dtype == torch.bool):
        raise TypeError(
            f"{name} must have dtype float16, bfloat16, float32 or float64"
            + (" (or bool)" if optional else "") + f"; got shape {tuple(t.shape)} and dtype {t.dtype}"
        )


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, window=None, softcap=None,
                                 alibi_slopes=None, sinks=None):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by attn (forward and backward).

    Parameters
    ----------
    query : Tensor [..., L, E];  key : Tensor [..., S, E];  value : Tensor [..., S, Ev]
        CPU tensors of float16, bfloat16, float32 or float64 (any strides: read in
        place; 16-bit types computed in float32 and rounded once).
    attn_mask : Tensor of bool or of query's dtype, broadcastable to [..., L, S], optional
        torch's convention (bool True = takes part; float added to the scores).
        A float mask that requires grad gets its gradient (reduced to its shape).
    dropout_p, is_causal, scale, enable_gqa
        As torch's (``is_causal`` is upper-left aligned, torch's alignment).
    window, softcap : (int, int) and float, optional
        As :func:`attn.scaled_dot_product_attention` (FlashAttention's
        ``window_size`` and ``softcap``).
    alibi_slopes : Tensor [H] or [B, H], optional (not differentiated)
    sinks : Tensor [H], optional
        One logit per head in each row's softmax denominator (gpt-oss);
        differentiable.

    Returns
    -------
    Tensor [..., L, Ev], differentiable with respect to query, key, value
    (a float attn_mask and the sinks). Rows that see no key give 0 (and zero gradients).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    _check_tensor("attn_mask", attn_mask, optional=True)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints (-1 = unbounded), got {window!r}")
        window = [check_int(window[0], "window[0] (left)"), check_int(window[1], "window[1] (right)")]
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool (torch's signature), got {is_causal!r}")
    seed = 0
    if dropout_p > 0:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    out, _ = _sdpa(query, key, value, attn_mask, float(dropout_p), is_causal,
                   None if scale is None else float(scale), bool(enable_gqa), seed,
                   window, float(softcap or 0.0), alibi_slopes, sinks)
    return out
