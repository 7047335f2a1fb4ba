"""Autograd for :func:`attn.flash.flash_attn_func` and :func:`attn.flash.flash_attn_varlen_func`.

Two ``torch.autograd.Function``\\ s, as flash_attn's own: the forward runs
attn's vector-Jacobian product (:func:`attn.scaled_dot_product_attention_vjp`,
:func:`attn.varlen_attention_vjp`; the fused kernel's forward, keeping out and
the log-sum-exp, never the L x S weights) and keeps its ``backward`` closure;
the backward calls it. Gradients flow to q, k, v and the sinks; ALiBi slopes
are not differentiated (as in FlashAttention). Imported only when a torch
tensor that requires grad comes in.
"""

import numpy as np
import torch

from .._api import scaled_dot_product_attention_vjp
from .._interop import to_numpy, to_torch
from .._varlen import varlen_attention_vjp
from ._forward import _no_dropout, _window, dense_forward, varlen_forward


def _np(t, name):
    return None if t is None else to_numpy(t, name, detach=True)


def _tensor(a):
    return to_torch(np.ascontiguousarray(a))


class _DenseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        qt, kt, vt = (np.swapaxes(_np(t, n), 1, 2) for t, n in ((q, "q"), (k, "k"), (v, "v")))  # -> [B, H, T, E]
        out, backward = scaled_dot_product_attention_vjp(
            qt, kt, vt, dropout_p=options["dropout_p"], is_causal="lower_right" if options["causal"] else False,
            scale=options["softmax_scale"], enable_gqa=qt.shape[1] != kt.shape[1],
            window=_window(options["window_size"]), softcap=options["softcap"] or None,
            alibi_slopes=_np(options["alibi_slopes"], "alibi_slopes"), sinks=_np(sinks, "sinks"),
            rng=options["rng"], num_threads=options["num_threads"],
        )
        ctx.backward_fn, ctx.has_sinks = backward, sinks is not None
        return _tensor(np.swapaxes(out, 1, 2))  # [B, H, L, Ev] -> [B, L, H, Ev]

    @staticmethod
    def backward(ctx, grad_out):
        dout = np.swapaxes(_np(grad_out.contiguous(), "grad_out"), 1, 2)
        grads = ctx.backward_fn(dout)
        dq, dk, dv = (_tensor(np.swapaxes(g, 1, 2)) for g in grads[:3])
        dsinks = _tensor(grads[3]) if ctx.has_sinks else None
        return dq, dk, dv, dsinks, None


class _VarlenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        out, backward = varlen_attention_vjp(
            _np(q, "q"), _np(k, "k"), _np(v, "v"), _np(options["cu_seqlens_q"], "cu_seqlens_q"),
            _np(options["cu_seqlens_k"], "cu_seqlens_k"), options["max_seqlen_q"], options["max_seqlen_k"],
            is_causal="lower_right" if options["causal"] else False, scale=options["softmax_scale"],
            window=_window(options["window_size"]), softcap=options["softcap"] or None,
            alibi_slopes=_np(options["alibi_slopes"], "alibi_slopes"), sinks=_np(sinks, "sinks"),
            num_threads=options["num_threads"],
        )
        ctx.backward_fn, ctx.has_sinks = backward, sinks is not None
        return _tensor(out)

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.backward_fn(_np(grad_out.contiguous(), "grad_out"))
        dq, dk, dv = (_tensor(g) for g in grads[:3])
        return dq, dk, dv, _tensor(grads[3]) if ctx.has_sinks else None, None


def dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, sinks,
          num_threads, rng):
    """flash_attn_func with autograd (softmax_lse and the weights, when asked, are not differentiable)."""
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, rng=rng, num_threads=num_threads)
    if rng is None and dropout_p > 0:  # one generator draws the forward's mask and replays it in the backward
        options["rng"] = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
    out = _DenseFunction.apply(q, k, v, sinks, options)
    if not return_attn_probs:
        return out
    _, lse, weights = dense_forward(_np(q, "q"), _np(k, "k"), _np(v, "v"), 0.0, softmax_scale, causal, window_size,
                                    softcap, _np(alibi_slopes, "alibi_slopes"), True, _np(sinks, "sinks"),
                                    num_threads)
    return out, _tensor(lse), _tensor(weights)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
           window_size, softcap, alibi_slopes, return_attn_probs, sinks, num_threads):
    """flash_attn_varlen_func with autograd (packed k and v)."""
    _no_dropout(dropout_p, "flash_attn_varlen_func")
    options = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, num_threads=num_threads)
    out = _VarlenFunction.apply(q, k, v, sinks, options)
    if not return_attn_probs:
        return out
    _, lse, weights = varlen_forward(_np(q, "q"), _np(k, "k"), _np(v, "v"), _np(cu_seqlens_q, "cu_seqlens_q"),
                                     _np(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k, 0.0,
                                     softmax_scale, causal, window_size, softcap, _np(alibi_slopes, "alibi_slopes"),
                                     True, None, _np(sinks, "sinks"), num_threads)
    return out, _tensor(lse), _tensor(weights)
