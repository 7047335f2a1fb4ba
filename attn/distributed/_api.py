"""The public entry: :func:`ring_attention`."""

from .._interop import to_torch
from . import _autograd, _ring
from ._comm import DEFAULT_TIMEOUT_S


def ring_attention(query, key, value, *, group=None, is_causal=False, scale=None, enable_gqa=False,
                   return_lse=False, timeout=DEFAULT_TIMEOUT_S, overlap=True, backend="auto",
                   num_threads=None, stats=None):
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group.

    Every rank of ``group`` calls it with its shard of the queries, keys and
    values and gets its shard of the output: the same numbers as
    :func:`attn.scaled_dot_product_attention` on the whole sequence, up to
    rounding. Key/value blocks travel around the ring of ranks (torch.distributed
    ``isend`` / ``irecv``, any backend that carries CPU tensors: gloo, or MPI);
    the transfer of the next block overlaps the kernel call on the current one,
    and the partial results are merged by their log-sum-exp in a fixed order,
    so the output does not depend on timing.

    Parameters
    ----------
    query : torch.Tensor or ndarray, shape [..., L_r, E]
        This rank's query rows (shard of a global sequence of L rows).
    key : torch.Tensor or ndarray, shape [..., S_r, E]
    value : torch.Tensor or ndarray, shape [..., S_r, Ev]
        This rank's key and value rows. float32, float64 or bfloat16 (torch's,
        or ml_dtypes' for arrays; the same on every rank; other dtypes are a
        TypeError), CPU. bfloat16 is computed, merged and sent in float32
        (dK and dV too) and rounded once, at the end.
        Every dim but the sequence dim (-2) must be the same on every rank.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the sequence, in ring order (default: the world).
        torch.distributed must be initialized. A group of one rank computes
        the whole sequence in this process.
    is_causal : bool or {"upper_left", "lower_right"}
        As :func:`attn.scaled_dot_product_attention`, over the *global*
        positions (``"lower_right"`` aligns the diagonal with the last key:
        decoding L < S query rows against a sharded cache). With a causal mask
        the shards must be in the zigzag layout of
        :func:`attn.distributed.shard` (``is_causal=True``; queries and keys
        each laid out over their own length), which gives every rank the same
        work. Without one, any split in rank order (contiguous, as ``shard``
        makes it) works.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Grouped-query attention (query heads a multiple of key/value heads).
    return_lse : bool
        Also return the log-sum-exp [..., L_r] of the local rows over every
        key (-inf for a row that sees no key; not differentiable).
    timeout : float or datetime.timedelta
        Seconds any single wait (a transfer, the shape exchange) may take;
        then :class:`RingTimeoutError` names the step, the peer rank and the
        timeout. A rank that dies makes the others raise :class:`RingError`
        (or time out): never a hang.
    overlap : bool
        False waits for each transfer before the next kernel call (to measure
        what the overlap gains).
    backend, num_threads
        The backend and threads of each kernel call, as
        :func:`attn.scaled_dot_product_attention`.
    stats : dict, optional
        Filled with this rank's ``bytes_sent``, ``compute_s``, ``wait_s``,
        ``total_s``, ``calls`` (kernel calls) and ``steps`` of the forward;
        the backward adds the same keys prefixed ``backward_``.

    Returns
    -------
    out : same type and dtype as ``query`` (torch.Tensor or ndarray), shape [..., L_r, Ev]
    lse : shape [..., L_r] (only with ``return_lse=True``), float32 for bfloat16

    With torch tensors that require grad the call is recorded for autograd:
    ``out.backward(...)`` on every rank runs the ring backward (dK and dV
    travel with their blocks back to their owners) and fills each rank's
    shard gradients, equal to the single-process gradients up to rounding.

    Raises
    ------
    TypeError, ValueError
        Bad arguments on any rank, or ranks that disagree on shapes (other
        than the sequence dim), dtypes or options: every rank raises, the
        message naming the rank and its shapes and dtypes.
    RingError, RingTimeoutError
        A transfer failed or did not complete within ``timeout``.

    Examples
    --------
    Under ``torchrun --nproc-per-node 4 script.py``, with ``x`` the full
    sequence [B, H, L, E] on every rank::

        import torch.distributed as dist
        from attn.distributed import ring_attention, shard, unshard
        dist.init_process_group("gloo")
        q, k, v = (shard(t, 2, is_causal=True) for t in (x_q, x_k, x_v))
        out = ring_attention(q, k, v, is_causal=True)     # [B, H, L / 4, E] on each rank
        full = unshard(out, 2, is_causal=True)             # [B, H, L, E] on every rank
    """
    is_torch = type(query).__module__.startswith("torch")
    grad = False
    if is_torch:
        import torch

        grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value))
    ring, q, k, v = _ring.setup(query, key, value, group, is_causal, scale, enable_gqa, backend,
                                num_threads, overlap, timeout, grad, return_lse, stats)
    if grad:
        # the tensors themselves (their graph); an array among them as a tensor of the same memory
        out, lse = _autograd.apply(ring, *(t if isinstance(t, torch.Tensor) else to_torch(a)
                                           for t, a in ((query, q), (key, k), (value, v))))
    else:
        out, lse = ring.forward(q, k, v)  # compute dtype
        out = out.astype(q.dtype, copy=False)  # (bfloat16: rounded once)
        if is_torch:
            out, lse = to_torch(out), to_torch(lse)
    if stats is not None:
        stats.update(rank=ring.comm.rank, size=ring.comm.size, **ring.forward_stats.as_dict())
        ring.stats_sink = stats  # the backward adds its own
    return (out, lse) if return_lse else out
