"""The backward pass around the backends: log-sum-exp, dropout replay, reductions.

Each backend module (:mod:`attn._backends`) has ``forward_lse(p)`` and
``backward(p, out, lse, keep, dout, want_ds)``, which return gradients over the
broadcast batch with one key/value head per query head; the backend comes from
:func:`attn._backends.select` with ``gradients=True``. This module joins the
sinks, redraws dropout's keep mask, and reduces each gradient to its input's shape:
summed over broadcast leading dims and, with GQA, over each key/value head's
query heads.
"""

import numpy as np

from . import _dtypes, _variants


def forward_lse(p, impl, sinks=True):
    """lse [*batch, L] in the compute dtype: -inf for rows that see no key (all rows when S = 0).

    With ``p``'s sinks (unless ``sinks=False``) they join each row's sum (attn._variants).
    """
    shape = p.batch + (p.n_q,)
    joined = False  # the sinks already in lse (a backend that joins them itself)
    if p.n_k == 0 or 0 in shape:
        lse = np.full(shape, -np.inf, p.q.dtype)
    else:
        lse = impl.forward_lse(p).astype(p.q.dtype, copy=False)
        joined = impl.APPLIES_SINKS
        if lse.shape != shape:  # value had leading dims that query and key lack
            lse = np.array(np.broadcast_to(lse, shape))  # [*batch, L], writable
    if p.variants is not None and p.variants.sinks is not None and joined and not sinks:
        raise AssertionError("forward_lse(sinks=False) of a backend that joins the sinks itself")
    if sinks and not joined and p.variants is not None and p.variants.sinks is not None:
        lse = _variants.apply_sinks(p.variants, np.zeros(shape + (0,), lse.dtype), lse)[1]
    return lse


def forward(p, impl):
    """``(out [*batch, L, Ev], lse [*batch, L])`` in the compute dtype (no weights), sinks applied."""
    out_shape, lse_shape = p.batch + (p.n_q, p.d_v), p.batch + (p.n_q,)
    if 0 in out_shape or p.n_k == 0:
        return np.zeros(out_shape, p.q.dtype), forward_lse(p, impl)
    if impl.FORWARD_WRITES_LSE:  # one pass (online, and the fused kernel)
        out, lse = impl.forward_and_lse(p)
        if lse.shape != lse_shape:  # value had leading dims that query and key lack
            lse = np.array(np.broadcast_to(lse, lse_shape))
        lse = lse.astype(p.q.dtype, copy=False)
        if impl.APPLIES_SINKS:
            return out, lse
    else:
        out, _ = impl.forward(p)
        lse = forward_lse(p, impl, sinks=False)
    return _variants.apply_sinks(p.variants, out, lse)


def forward_weights(p, impl):
    """``(out, weights)`` of ``p`` (``return_weights``), the sinks applied to both."""
    out, w = impl.forward(p)
    if p.variants is None or p.variants.sinks is None or impl.APPLIES_SINKS:
        return out, w
    out, _, w = _variants.apply_sinks(p.variants, out, forward_lse(p, impl, sinks=False), w)
    return out, w


def rng_state(p):
    """What it takes to draw the forward's dropout keep mask again (None without dropout)."""
    return None if p.dropout_p == 0 else p.rng.bit_generator.state


def replay_keep(p, state):
    """The keep mask [*batch, L, S] the forward drew from ``p.rng`` in ``state``, or None.

    Every backend draws ``rng.random`` in C order over (batch, row, key) (the
    loop one row at a time: the same stream), so a generator restored to the
    state before the forward draws the same mask without it being kept.
    """
    if state is None:
        return None
    g = np.random.Generator(type(p.rng.bit_generator)())
    g.bit_generator.state = state
    return g.random(p.batch + (p.n_q, p.n_k)) >= p.dropout_p


def sum_to_shape(g, shape):
    """Sum ``g`` over the dims that were broadcast from ``shape`` (torch's ``sum_to_size``).

    g : [*batch, *inner], ``shape`` broadcastable to ``g.shape`` -> [*shape]
    """
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))  # leading dims the input did not have
    axes = tuple(d for d, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)  # dims of size 1 that were broadcast
    return g.reshape(shape)


def sum_groups(g, group):
    """GQA: each key/value head's gradient summed over its query heads.

    g : [..., H_q, S, F] -> [..., H_q / group, S, F]
    """
    if group == 1:
        return g
    g = g.reshape(g.shape[:-3] + (g.shape[-3] // group, group) + g.shape[-2:])  # [.., H_kv, g, S, F]
    return g.sum(axis=-3)


def gradients(p, impl, out, lse, keep, dout, want_ds):
    """dq, dk, dv over the batch (per query head) and dS or None; zeros when there is nothing to do."""
    if p.n_k == 0 or 0 in out.shape:
        zeros = lambda *inner: np.zeros(p.batch + inner, p.q.dtype)
        return (zeros(p.n_q, p.d_k), zeros(p.n_k, p.d_k), zeros(p.n_k, p.d_v),
                zeros(p.n_q, p.n_k) if want_ds else None)
    return impl.backward(p, out, lse, keep, dout, want_ds)


def sinks_grad(p, out, dout, lse):
    """d sinks of shape [H] in the output dtype (attn._variants.sinks_grad summed over the other dims)."""
    g = _variants.sinks_grad(p.variants, out, dout, lse)  # [*batch]
    return sum_to_shape(g, p.batch[-1:]).astype(p.out_dtype, copy=False)


def reduce(p, dq, dk, dv, ds, shapes, mask_shape, mask_dtype):
    """Gradients over the batch -> each input's own shape, in the input dtype.

    shapes: the (query, key, value) input shapes; ``ds`` is reduced to the
    float attn_mask's shape and dtype.
    """
    grads = (sum_to_shape(dq, shapes[0]),
             sum_to_shape(sum_groups(dk, p.group), shapes[1]),
             sum_to_shape(sum_groups(dv, p.group), shapes[2]))
    grads = tuple(_dtypes.cast(g, p.out_dtype) for g in grads)
    if ds is not None:
        grads += (sum_to_shape(ds, mask_shape).astype(mask_dtype, copy=False),)
    return grads


def vjp(p, impl, out, lse, keep, dout, want_ds, shapes, mask_shape=None, mask_dtype=None):
    """Every input's gradient for ``dout`` = dLoss/d out: the backward shared by all the vjps.

    Parameters
    ----------
    p, impl
        The validated problem and its backend module (:func:`attn._backends.select`).
    out, lse : ndarray
        The forward's output [*batch, L, Ev] and log-sum-exp [*batch, L], compute dtype.
    keep : ndarray or None
        The forward's dropout keep mask (:func:`replay_keep`).
    dout : ndarray
        dLoss/d out, checked (attn._validation.validate_grad_out), in the compute dtype.
    want_ds : bool
        Also the gradient of the float ``attn_mask``.
    shapes, mask_shape, mask_dtype
        As :func:`reduce`.

    Returns
    -------
    tuple of ndarray
        ``(grad_query, grad_key, grad_value[, grad_attn_mask][, grad_sinks])``, each in its
        input's shape (the sinks': [H]) and the output dtype (the mask's: its own).
    """
    dq, dk, dv, ds = gradients(p, impl, out, lse, keep, dout, want_ds)
    grads = reduce(p, dq, dk, dv, ds, shapes, mask_shape, mask_dtype)
    if p.variants is not None and p.variants.sinks is not None:
        grads += (sinks_grad(p, out, dout, lse),)
    return grads
