"""Paired timing: two contenders in alternating short blocks.

This machine is shared, and its speed drifts by tens of percent over seconds.
pytest-benchmark times each contender of a group in one stretch (torch's
rounds, then cython's), so a slow spell that hits only one of the stretches
moves the ratio of their medians. Here the contenders take turns instead:
block i times ``n`` back-to-back calls of A and then ``n`` calls of B (the
order flips every block, and each block follows a short pause, so neither
pays for the other's spinning thread pool). Each block pair gives one ratio
B/A from two stretches a fraction of a second apart, and the result is the
median of those ratios.
"""

from __future__ import annotations

import statistics
import time

BLOCK_S = 0.1     # target length of one block of calls
BUDGET_S = 4.0    # target total timed length per pair of contenders
MIN_BLOCKS, MAX_BLOCKS = 5, 15
PAUSE_S = 0.03    # idle time before each block (OpenMP pools spin ~10 ms)


def _block(fn, n):
    """Mean seconds per call over ``n`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def paired_ratio(fa, fb, *, blocks=None, pause=PAUSE_S, budget=BUDGET_S):
    """Time ``fa`` and ``fb`` in alternating blocks.

    ``blocks`` block pairs (default: as many as fit in ``budget`` seconds of
    timed calls, between MIN_BLOCKS and MAX_BLOCKS).

    Returns
    -------
    dict with ``ratio`` (median over block pairs of time(fb) / time(fa)),
    ``a``/``b`` (median seconds per call), ``calls_per_block``, ``blocks``
    and ``ratio_q1``/``ratio_q3`` (quartiles of the per-pair ratios).
    """
    fa(), fb()  # warm: first-call costs are not part of either timing
    per_call = max(_block(fa, 1), _block(fb, 1), 1e-9)
    n = max(1, int(BLOCK_S / per_call))
    if blocks is None:
        blocks = min(MAX_BLOCKS, max(MIN_BLOCKS, int(budget / (2 * n * per_call))))
    ta, tb, ratios = [], [], []
    for i in range(blocks):
        order = ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta))
        for fn, times in order:
            time.sleep(pause)
            times.append(_block(fn, n))
        ratios.append(tb[-1] / ta[-1])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "a": statistics.median(ta), "b": statistics.median(tb),
            "calls_per_block": n, "blocks": blocks}
