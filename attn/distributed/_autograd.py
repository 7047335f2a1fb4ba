"""Ring attention as a torch autograd Function: the ring forward, and the ring backward for ``.backward()``."""

import numpy as np

from .._dtypes import compute_dtype
from .._interop import to_numpy


def _function():
    """The autograd Function class, defined on first use (torch is imported lazily)."""
    global _RingAttention
    if _RingAttention is not None:
        return _RingAttention
    import torch
    from torch.autograd.function import once_differentiable

    class RingAttentionFunction(torch.autograd.Function):
        """(query, key, value) shards -> (out, lse) shards; backward runs the ring again.

        Saves the local shards, ``out`` and ``lse`` (never a score matrix);
        ``lse`` is not differentiable. dK and dV travel with their key/value
        block around the ring and come back to the rank that owns it.
        bfloat16: ``out`` is returned rounded, and kept in float32 (with
        ``lse``) for the backward, whose gradients are rounded once at the end.
        """

        @staticmethod
        def forward(ctx, query, key, value, ring):
            q, k, v = (to_numpy(t, n, detach=True) for t, n in ((query, "query"), (key, "key"), (value, "value")))
            out, lse = ring.forward(q, k, v)  # compute dtype
            out_c, lse_t = torch.from_numpy(out), torch.from_numpy(lse)
            ctx.ring = ring
            ctx.save_for_backward(query, key, value, out_c, lse_t)
            ctx.mark_non_differentiable(lse_t)
            return out_c.to(query.dtype), lse_t

        @staticmethod
        @once_differentiable  # the ring backward runs in NumPy: no graph of its own
        def backward(ctx, grad_out, grad_lse):
            query, key, value, out, lse = ctx.saved_tensors
            q, k, v = (to_numpy(t, n, detach=True) for t, n in ((query, "query"), (key, "key"), (value, "value")))
            dout = np.asarray(to_numpy(grad_out, "grad_out", detach=True), dtype=compute_dtype(q.dtype))
            dq, dk, dv = ctx.ring.backward(q, k, v, to_numpy(out, "out"), to_numpy(lse, "lse"), dout)
            return (torch.from_numpy(dq).to(query.dtype), torch.from_numpy(dk).to(key.dtype),
                    torch.from_numpy(dv).to(value.dtype), None)

    _RingAttention = RingAttentionFunction
    return _RingAttention


_RingAttention = None


def apply(ring, query, key, value):
    """``(out, lse)`` tensors of ``ring`` on torch tensors, recorded for autograd."""
    return _function().apply(query, key, value, ring)
