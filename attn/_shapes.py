"""The batch shape of an attention call, computed in one place.

Used by validation (:mod:`attn._validation`), the online backend and the
torch operator's fake (meta) implementation, which passes
``torch.broadcast_shapes`` so that symbolic sizes trace.
"""

import numpy as np


def batch_shape(q_shape, k_shape, v_shape, gqa=False, broadcast=np.broadcast_shapes):
    """The output's leading (batch) dims: those of query, key and value, broadcast.

    Parameters
    ----------
    q_shape, k_shape, v_shape : tuple of int
        Shapes [..., L, E], [..., S, E], [..., S, Ev].
    gqa : bool
        Grouped-query attention: key's and value's head dim (-3) counts as
        query's (each key/value head serves a group of query heads). Ignored
        unless all three have a head dim.
    broadcast : callable
        The broadcasting rule: ``np.broadcast_shapes`` (raises ValueError
        when the dims do not broadcast) or ``torch.broadcast_shapes``.

    Returns
    -------
    tuple
    """
    lead_q, lead_k, lead_v = tuple(q_shape[:-2]), tuple(k_shape[:-2]), tuple(v_shape[:-2])
    if lead_q == lead_k == lead_v:
        return lead_q  # the common case (GQA's included when the heads are equal), without more work
    if gqa and lead_q and lead_k and lead_v:
        lead_k = lead_k[:-1] + lead_q[-1:]
        lead_v = lead_v[:-1] + lead_q[-1:]
    if lead_q == lead_k == lead_v:
        return lead_q  # the common case, without the broadcast's cost
    return tuple(broadcast(lead_q, lead_k, lead_v))
