"""Where each rank's rows sit in the global sequence, and which blocks a ring step computes.

Pure arithmetic on lengths (no torch, no arrays), shared by the ring, by
:func:`attn.distributed.shard` and by the tests.

A sequence of ``total`` rows is cut into chunks as ``numpy.array_split`` and
``torch.tensor_split`` cut it: ``c = n_chunks`` chunks, the first ``total % c``
of them one row longer. Uneven lengths are therefore never padded: shards
differ by at most one row per chunk.

* contiguous (``is_causal=False``): ``n`` chunks, rank ``r`` holds chunk ``r``.
* zigzag (``is_causal`` true): ``2n`` chunks, rank ``r`` holds chunks ``r`` and
  ``2n - 1 - r`` (head and tail), so that under a causal mask every rank sees
  the same number of (query, key) pairs: ring-flash-attention's zigzag,
  torch context parallel's head-tail load balancer.
"""


def chunk_bounds(total, n_chunks):
    """``[(start, length)]`` of ``n_chunks`` chunks of ``total`` rows (array_split's sizes)."""
    base, extra = divmod(total, n_chunks)
    bounds, start = [], 0
    for c in range(n_chunks):
        length = base + (c < extra)
        bounds.append((start, length))
        start += length
    return bounds


def rank_chunks(total, n, rank, zigzag):
    """The chunks ``[(global_start, length)]`` rank ``rank`` of ``n`` holds, in local order."""
    if not zigzag:
        return [chunk_bounds(total, n)[rank]]
    b = chunk_bounds(total, 2 * n)
    return [b[rank], b[2 * n - 1 - rank]]


def shard_lengths(total, n, zigzag):
    """Rows held by each rank, ``[len_0, ..., len_{n-1}]``."""
    return [sum(length for _, length in rank_chunks(total, n, r, zigzag)) for r in range(n)]


def global_causal_offset(alignment, n_q, n_k):
    """Key j is visible to query row i iff ``j <= i + offset``; None without a causal mask."""
    if alignment is None:
        return None
    return 0 if alignment == "upper_left" else n_k - n_q


def plan(q_chunks, k_chunks, offset):
    """The kernel calls of one (query shard, key block) pair.

    Parameters
    ----------
    q_chunks, k_chunks : list of (global_start, length)
        The query shard's and the key block's chunks, in local (memory) order.
    offset : int or None
        The global causal offset (:func:`global_causal_offset`); None: no mask.

    Returns
    -------
    list of ``(q_lo, q_hi, k_lo, k_hi, causal_offset)`` in local row indices:
    rows ``q_lo:q_hi`` against keys ``k_lo:k_hi``, with the call's own causal
    offset (key b visible to row a iff ``b <= a + causal_offset``) or None for
    a fully visible block. Invisible (query chunk, key chunk) pairs are left
    out; fully visible key chunks that follow each other become one call.
    """
    items = []
    q_lo = 0
    for qs, lq in q_chunks:
        run = None  # (k_lo, k_hi) of consecutive fully visible key chunks
        k_lo = 0
        for ks, lk in k_chunks:
            if lq and lk:
                d = None if offset is None else qs + offset - ks
                if d is None or d >= lk - 1:  # every row sees every key of the chunk
                    run = (run[0], k_lo + lk) if run else (k_lo, k_lo + lk)
                else:
                    if run:
                        items.append((q_lo, q_lo + lq, run[0], run[1], None))
                        run = None
                    if d + lq - 1 >= 0:  # some row sees some key: a diagonal block
                        items.append((q_lo, q_lo + lq, k_lo, k_lo + lk, d))
            k_lo += lk
        if run:
            items.append((q_lo, q_lo + lq, run[0], run[1], None))
        q_lo += lq
    return items
