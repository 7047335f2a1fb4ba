"""Past one machine: exact attention over a sequence sharded across torch.distributed ranks.

>>> from attn.distributed import ring_attention, shard, unshard   # doctest: +SKIP

:func:`ring_attention` (context parallelism, "ring attention"): every rank
holds a shard of the sequence; key/value blocks travel around the ring of
ranks while each rank runs the kernel on the block it holds, and the partial
results are merged by their log-sum-exp, the merge the fused kernel does
across threads when it splits the keys. Forward and backward (a torch
autograd Function: dK and dV travel with their blocks), causal or not,
grouped-query attention, float32 and float64, on any torch.distributed
backend that carries CPU tensors (gloo everywhere).

:func:`shard` and :func:`unshard` cut a full tensor into this rank's shard
(contiguous, or zigzag for a causal mask, which gives every rank the same
work) and gather it back. See docs/distributed.md.

Modules: :mod:`._layout` (who holds which rows, which blocks a step
computes), :mod:`._comm` (the group, timed waits), :mod:`._merge` (the
log-sum-exp merge), :mod:`._ring` (forward and backward over the ring),
:mod:`._autograd` (the torch Function), :mod:`._shard`, :mod:`._api`.

torch is imported on first use: ``import attn`` needs only NumPy.
"""

from ._api import ring_attention
from ._comm import RingError, RingTimeoutError
from ._shard import shard, unshard

__all__ = ["RingError", "RingTimeoutError", "ring_attention", "shard", "unshard"]
