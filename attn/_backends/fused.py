"""The fused kernel (attn._kernels): describe each operand to the kernel and run it.

The kernel reads every operand in place: a base pointer, one element offset
per matrix of the (broadcast) batch and element strides (:mod:`attn._layout`).
It never builds the L x S scores unless the weights are asked for.
"""

import math

import numpy as np

from .. import _layout, _memory, _threads
from .._build import _kernels

# the fast path's entry (validates before it runs anything; bound once, so a
# test stubbing the kernels out still sees bad arguments rejected in Python)
_fast = None if _kernels is None else _kernels.sdpa_fast
_NO_OFFSETS = np.zeros(0, np.int64)  # no mask: the kernel never reads its offsets


def fast_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
                 return_weights, num_threads):
    """The output of the common call, validated and run in compiled code; or None.

    The common case is what decoding and most layers call: ndarrays of float32
    or float64 (or a float16 cache) without mask, dropout or weights, batch
    dims C-ordered (a KV cache's prefix view is). For anything else, and for
    every bad argument, this returns None and the caller runs the full
    validation (which raises its usual errors). Costs about a microsecond.
    """
    if _fast is None or attn_mask is not None:
        return None
    return _fast(
        query, key, value, dropout_p, is_causal, scale, enable_gqa, backend, return_weights,
        num_threads, _threads.get_num_threads() if num_threads is None else 0,
        _memory.CHECK_MEMORY_ABOVE,
    )


def cannot_run(p):
    """What the kernel does not do: dropout."""
    return "apply dropout (dropout_p > 0)" if p.dropout_p > 0 else None


def check_memory(p):
    """The output, and the L x S weights only when they are returned."""
    _memory.check_output_and_weights(p)


def forward(p):
    """``(out, weights or None)`` of validated problem ``p``."""
    batch, n_batch = p.batch, math.prod(p.batch)
    q, q_off, q_strides = _layout.describe(p.q, batch)  # q first: the canary tests shift it
    k, k_off, k_strides = _layout.describe(p.k, batch, group=p.group)
    v, v_off, v_strides = _layout.describe(p.v, batch, group=p.group)
    out = np.empty((n_batch, p.n_q, p.d_v), dtype=q.dtype)  # [N, L, Ev]
    w = np.empty((n_batch, p.n_q, p.n_k), dtype=q.dtype) if p.return_weights else None
    mask = p.allowed if p.allowed is not None else p.bias
    m_off, m_strides = _NO_OFFSETS, (0, 0)
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (p.n_q, p.n_k))  # a view, stride 0
        mask, m_off, m_strides = _layout.describe(mask, batch)
    _kernels.attention(
        q, k, v, mask, out, w, q_off, k_off, v_off, m_off,
        q_strides, k_strides, v_strides, m_strides,
        p.causal_offset is not None, p.causal_offset or 0, p.scale, p.num_threads,
    )
    out = out.reshape(batch + (p.n_q, p.d_v))  # [N, L, Ev] -> [*batch, L, Ev]
    return out, (None if w is None else w.reshape(batch + (p.n_q, p.n_k)))


def masked_softmax_forward(p):
    """Masked softmax of validated problem ``p`` along its last axis, one kernel row per slice."""
    x, mask = p.x, p.allowed if p.allowed is not None else p.bias
    lead, n = x.shape[:-1], x.shape[-1]
    x, x_off, (x_stride,) = _layout.describe(x, lead, n_inner=1)
    out = np.empty((math.prod(lead), n), dtype=x.dtype)  # [rows, n]
    m_off, m_stride = x_off, 0
    if mask is not None:
        mask, m_off, (m_stride,) = _layout.describe(mask, lead, n_inner=1)
    _kernels.masked_softmax(x, mask, out, x_off, m_off, x_stride, m_stride, p.num_threads)
    return out.reshape(x.shape)  # [rows, n] -> [..., n]
