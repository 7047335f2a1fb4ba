"""Grouped-query attention without copies, for the matrix forms.

Query head ``h`` uses key/value head ``h // group``. Instead of repeating
each key/value head ``group`` times, the query head dim (-3) is split into
``[H_kv, group]`` and the key/value heads get a size-1 dim, so that NumPy's
broadcasting pairs them: every array keeps its own memory.
"""


def split_head_dim(a, group):
    """[..., H, X, Y] -> [..., H / group, group, X, Y]; [..., 1, X, Y] -> [..., 1, 1, X, Y].

    Arrays with fewer than 3 dims broadcast as they are and are returned unchanged.
    """
    if a is None or a.ndim < 3:
        return a
    h = a.shape[-3]
    heads = (1, 1) if h == 1 else (h // group, group)
    return a.reshape(a.shape[:-3] + heads + a.shape[-2:])  # [.., H, X, Y] -> [.., H/g, g, X, Y]


def add_group_dim(a):
    """[..., H_kv, S, E] -> [..., H_kv, 1, S, E]: one key/value head for ``group`` query heads."""
    return a.reshape(a.shape[:-2] + (1,) + a.shape[-2:])


def grouped(p):
    """q, k, v, allowed, bias of problem ``p`` shaped so that broadcasting does GQA.

    Returns them unchanged when ``p.group == 1``. Undo on the result with
    :func:`merge_group_dim`.
    """
    if p.group == 1:
        return p.q, p.k, p.v, p.allowed, p.bias
    g = p.group
    return (split_head_dim(p.q, g), add_group_dim(p.k), add_group_dim(p.v),
            split_head_dim(p.allowed, g), split_head_dim(p.bias, g))


def merge_group_dim(a, p):
    """[..., H_kv, group, L, X] -> batch + [L, X] (the inverse of :func:`grouped` on a result)."""
    if p.group == 1:
        return a
    return a.reshape(p.batch + a.shape[-2:])  # [.., H_kv, g, L, X] -> [.., H_q, L, X]
