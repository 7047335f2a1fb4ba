"""Per-row loop vs matrix version vs fused Cython kernel, T = 128, E = 64, float64.

Times are measured on the machine that runs the demo: ``repeat`` rounds, each
timing ``number`` calls of every backend in turn (interleaved, so a burst of
load elsewhere hits all of them), best round kept. Nothing here is a stored
figure. The Cython kernel runs on one thread by default, like the loop: on
a busy machine OpenMP workers that spin between calls compete with NumPy's
BLAS threads and make every timing meaningless.
"""

import timeit
from dataclasses import dataclass

import numpy as np

from attn._api import scaled_dot_product_attention
from attn._build import HAVE_CYTHON
from attn._threads import get_num_threads
from ._common import SEED, max_abs_diff

T = 128
E = 64


@dataclass
class TimingResult:
    t: int
    e: int
    number: int  # calls per round
    repeat: int  # rounds; the best round is kept
    num_threads: int  # threads of the cython backend
    seconds: dict  # backend -> seconds per call ("loop", "numpy", "cython" if built)
    max_diff: dict  # backend -> max |out - out(numpy)|

    def speedup(self, backend):
        """How many times faster ``backend`` is than the loop."""
        return self.seconds["loop"] / self.seconds[backend]


def time_calls(calls, number, repeat):
    """Best seconds per call of each function, rounds interleaved across functions.

    Parameters
    ----------
    calls : dict of name -> zero-argument callable (already warmed up)
    number, repeat : int
        Calls per timing, and rounds.

    Returns
    -------
    dict of name -> seconds per call (the best round)
    """
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for name, fn in calls.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number)
    return best


def run(t=T, e=E, number=10, repeat=7, seed=SEED, num_threads=1):
    """Time the three backends on the same q, k, v [t, e] and compare their outputs.

    ``num_threads`` is the cython backend's; None means :func:`attn.get_num_threads`.
    """
    num_threads = get_num_threads() if num_threads is None else num_threads
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(t, e)) for _ in range(3))  # [t, e] each
    backends = ("loop", "numpy") + (("cython",) if HAVE_CYTHON else ())
    calls = {b: (lambda b=b: scaled_dot_product_attention(q, k, v, backend=b, num_threads=num_threads))
             for b in backends}
    outs = {b: call() for b, call in calls.items()}  # also the warm-up
    seconds = time_calls(calls, number, repeat)
    return TimingResult(
        t=t, e=e, number=number, repeat=repeat, num_threads=num_threads, seconds=seconds,
        max_diff={b: max_abs_diff(outs[b], outs["numpy"]) for b in backends if b != "numpy"},
    )


def report(r):
    """Times, speedups and differences as text."""
    lines = [f"T={r.t}, E={r.e}, float64, best of {r.repeat} interleaved rounds x {r.number} calls "
             "(measured now)"]
    labels = {"loop": "per-row loop", "numpy": "matrix (NumPy)",
              "cython": f"fused Cython kernel ({r.num_threads} thread{'s' * (r.num_threads > 1)})"}
    for b, s in r.seconds.items():
        tail = "" if b == "loop" else f"   {r.speedup(b):.1f}x faster than the loop"
        lines.append(f"{labels[b]:<36} {s * 1e3:8.3f} ms{tail}")
    lines += [f"max |{b} - matrix|: {d:.2e}" for b, d in r.max_diff.items()]
    if "cython" not in r.seconds:
        lines.append("(the compiled kernel is not built: cython skipped)")
    return "\n".join(lines)
