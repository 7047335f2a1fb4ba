"""torch.distributed underneath the ring: the group, timed waits, point-to-point transfers.

Every wait goes through :meth:`Comm.wait`, which gives up after the user's
``timeout`` and raises :class:`RingTimeoutError` naming the operation, the
peer rank and the timeout; a transport failure (a peer that died: "connection
reset", "connection closed") becomes :class:`RingError` naming the same. No
call here blocks without a timeout.
"""

import datetime
import numbers

import numpy as np

DEFAULT_TIMEOUT_S = 120.0


class RingError(RuntimeError):
    """A rank of the ring failed or went away during a transfer."""


class RingTimeoutError(RingError, TimeoutError):
    """A transfer did not complete within ``timeout`` seconds."""


def torch_dist():
    """``torch.distributed``, imported on first use (``import attn`` needs only NumPy)."""
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a test dependency
        raise ImportError("attn.distributed needs PyTorch (torch.distributed): pip install torch") from exc
    return dist


def check_timeout(timeout):
    """``timeout`` (seconds, a real > 0, or a ``datetime.timedelta``) as a timedelta."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a positive number) or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0 or not np.isfinite(seconds):
        raise ValueError(f"timeout must be positive and finite, got {seconds} s")
    return datetime.timedelta(seconds=seconds)


class Comm:
    """One process group as the ring uses it: this rank, its neighbours, timed transfers.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        None: the default (world) group; torch.distributed must be initialized.
    timeout : float or datetime.timedelta
        The longest any single wait may take.
    what : str
        The public function's name, for error messages.
    """

    def __init__(self, group, timeout, what):
        dist = torch_dist()
        self.dist, self.what = dist, what
        self.timeout = check_timeout(timeout)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{what}: torch.distributed is not initialized; call torch.distributed.init_process_group "
                "(e.g. under torchrun, backend='gloo') first, or use attn.scaled_dot_product_attention "
                "in a single process")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError(f"{what}: this process is not a member of group {group!r}")
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.bytes_sent = 0

    def _global(self, group_rank):
        if self.group is self.dist.group.WORLD:
            return group_rank
        return self.dist.get_global_rank(self.group, group_rank)

    def _error(self, exc, op, peer):
        """The RingError (RingTimeoutError for a timeout) of torch.distributed's ``exc`` in ``op``."""
        seconds = self.timeout.total_seconds()
        where = f"{self.what}: rank {self.rank} of {self.size}, {op} " + (
            f"with rank {peer}" if peer is not None else "with every rank")
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return RingTimeoutError(
                f"{where} did not complete within timeout={seconds:g} s (a rank is slower, stuck, "
                f"or did not make the same call); raise `timeout=` if the work is that long. "
                f"torch.distributed said: {text.splitlines()[0]}")
        return RingError(
            f"{where} failed (timeout={seconds:g} s): a rank probably died or left the group. "
            f"torch.distributed said: {text.splitlines()[0]}")

    def wait(self, work, op, peer):
        """Wait for ``work`` at most ``timeout``; errors name ``op`` and the ``peer`` group rank."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error(exc, op, peer) from None

    def send(self, tensor, peer, tag):
        """Post a send of a contiguous CPU tensor to group rank ``peer``; None for an empty one.
        (Posting fails at once when the peer's connection is already gone: the same RingError.)"""
        if tensor.numel() == 0:
            return None
        self.bytes_sent += tensor.numel() * tensor.element_size()
        try:
            return self.dist.isend(tensor, dst=self._global(peer), group=self.group, tag=tag)
        except RuntimeError as exc:
            raise self._error(exc, "posting a send", peer) from None

    def recv(self, tensor, peer, tag):
        """Post a receive into ``tensor`` from group rank ``peer``; None for an empty one."""
        if tensor.numel() == 0:
            return None
        try:
            return self.dist.irecv(tensor, src=self._global(peer), group=self.group, tag=tag)
        except RuntimeError as exc:
            raise self._error(exc, "posting a receive", peer) from None

    def wait_all(self, works, op):
        """Wait for ``[(work or None, peer)]`` in order."""
        for work, peer in works:
            if work is not None:
                self.wait(work, op, peer)

    def all_gather_int64(self, values, op):
        """Every rank's int64 vector of equal length: an array [size, len(values)]."""
        import torch

        mine = torch.tensor(np.asarray(values, np.int64))
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.wait(self.all_gather(out, mine, op), op, None)
        return np.stack([t.numpy() for t in out])

    def all_gather(self, out, tensor, op):
        """Post an all_gather of ``tensor`` into the list ``out``; the work to :meth:`wait` for."""
        try:
            return self.dist.all_gather(out, tensor, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self._error(exc, op, None) from None
