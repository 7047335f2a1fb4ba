"""Cutting a full sequence into this rank's shard, and gathering the shards back."""

import numpy as np

from .._integers import normalize_axis
from . import _layout
from ._comm import DEFAULT_TIMEOUT_S, Comm


def _check_dim(x, dim, name):
    return normalize_axis(dim, len(np.shape(x)), "dim", f"{name} with shape {tuple(np.shape(x))}")


def _take(x, dim, pieces):
    """The rows ``pieces`` [(start, length)] of ``x`` along ``dim``, concatenated (a copy)."""
    index = lambda s, n: (slice(None),) * dim + (slice(s, s + n),)
    parts = [x[index(s, n)] for s, n in pieces]
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim).contiguous()
    return np.ascontiguousarray(np.concatenate(parts, axis=dim))


def shard(x, dim, *, is_causal=False, group=None):
    """This rank's shard of ``x``, the full sequence along ``dim`` (every rank passes the same ``x``).

    Parameters
    ----------
    x : torch.Tensor or ndarray, shape [..., N, ...] (N along ``dim``)
    dim : int
        The sequence dim (2 for [B, H, L, E]).
    is_causal : bool or {"upper_left", "lower_right"}
        False: contiguous, rank r of n gets chunk r of n. Truthy: the zigzag
        (head-tail) layout, rank r gets chunks r and 2n - 1 - r of 2n, which
        balances causal attention's work; :func:`ring_attention` with a
        causal mask needs it.
    group : torch.distributed.ProcessGroup, optional
        Default: the world; a group of one rank gets all of ``x``.

    Returns
    -------
    A contiguous copy of the shard, same type as ``x``, with N_r rows along ``dim``.

    Uneven lengths are neither padded nor refused: the chunks are cut as
    ``numpy.array_split`` / ``torch.tensor_split`` cut them (the first
    ``N mod chunks`` chunks one row longer), and :func:`ring_attention`
    works out every rank's rows from the gathered shard lengths. N may even
    be shorter than the number of chunks (empty shards).
    """
    dim = _check_dim(x, dim, "x")
    comm = Comm(group, DEFAULT_TIMEOUT_S, "shard")
    n_rows = np.shape(x)[dim]
    return _take(x, dim, _layout.rank_chunks(n_rows, comm.size, comm.rank, bool(is_causal)))


def unshard(x_shard, dim, *, is_causal=False, group=None, timeout=DEFAULT_TIMEOUT_S):
    """The full sequence from every rank's shard along ``dim`` (an all-gather); the inverse of :func:`shard`.

    Parameters
    ----------
    x_shard : torch.Tensor or ndarray
        This rank's shard (as :func:`shard` or :func:`ring_attention` returns it).
    dim : int
    is_causal : bool or str
        The layout the shards are in: the same value given to :func:`shard`.
    group : torch.distributed.ProcessGroup, optional
    timeout : float or datetime.timedelta
        Seconds each of the two all-gathers may take (lengths, then rows).

    Returns
    -------
    The full tensor (same type as ``x_shard``), on every rank. Shards of
    different lengths are gathered padded to the longest and trimmed. Not
    recorded for autograd (the result is detached).
    """
    import torch

    dim = _check_dim(x_shard, dim, "x_shard")
    comm = Comm(group, timeout, "unshard")
    is_torch = type(x_shard).__module__.startswith("torch")
    t = x_shard if is_torch else torch.from_numpy(np.ascontiguousarray(x_shard))
    t = t.detach().movedim(dim, 0).contiguous()  # [N_r, ...]
    lengths = [int(n) for n in comm.all_gather_int64([t.shape[0]], "gathering shard lengths")[:, 0]]
    longest = max(lengths)
    padded = torch.zeros((longest,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(comm.size)]
    op = "gathering the shards (all_gather)"
    comm.wait(comm.all_gather(parts, padded, op), op, None)
    total = sum(lengths)
    full = torch.empty((total,) + tuple(t.shape[1:]), dtype=t.dtype)
    for r in range(comm.size):
        offset = 0
        for start, n in _layout.rank_chunks(total, comm.size, r, bool(is_causal)):
            full[start:start + n] = parts[r][offset:offset + n]
            offset += n
        if offset != lengths[r]:
            raise ValueError(
                f"unshard: rank {r}'s shard has {lengths[r]} rows, but {total} rows over {comm.size} ranks in the "
                f"{'zigzag' if is_causal else 'contiguous'} layout of shard() give it {offset}")
    full = full.movedim(0, dim)
    return full if is_torch else full.numpy()
