"""The seed article's experiments, one function per experiment, returning data.

Each demo module has ``run()`` (returns a dataclass or a list of them) and
``report(result)`` (the text the CLI prints); ``scaling`` and ``masks`` also
have a plot in :mod:`attn.apps.demos.plots`. Run them with
``python -m attn demo NAME [--plot FILE.png]``.

>>> from attn.apps import demos
>>> rows = demos.scaling.run()
>>> round(rows[1].max_weight_raw, 6)
0.921946
"""

from dataclasses import dataclass
from typing import Callable, Optional

from . import backward, masks, parity, pitfalls, precision, ring, scaling, serving, timing, training


@dataclass(frozen=True)
class Demo:
    """One experiment of the article, as the CLI sees it."""

    name: str
    summary: str
    run: Callable
    report: Callable
    plot: Optional[str] = None  # name of the function in attn.apps.demos.plots, or None
    needs_torch: bool = False
    nproc: bool = False  # takes --nproc (run(nproc=...))


DEMOS = {
    d.name: d
    for d in (
        Demo("scaling", "the sqrt(d_k) experiment: softmax with and without scaling, d_k = 16, 64, 512",
             scaling.run, scaling.report, plot="plot_scaling"),
        Demo("masks", "causal mask: -inf vs -1e9 (float32), row 2, and the bool-convention flip",
             masks.run, masks.report, plot="plot_masks"),
        Demo("pitfalls", "the article's five errors reproduced live, messages as installed",
             pitfalls.run, pitfalls.report),
        Demo("parity", "float64 parity with torch SDPA and nn.MultiheadAttention (needs torch)",
             parity.run, parity.report, needs_torch=True),
        Demo("loop-vs-matmul", "T=128, E=64: per-row loop vs matrix vs Cython kernel, timed now",
             timing.run, timing.report),
        Demo("backward", "the gradient of attention by hand on the 5 tokens, vs autograd and finite differences",
             backward.run, backward.report),
        Demo("train", "2-layer char transformer, 300 steps: torch SDPA vs attn through the torch bridge",
             training.run, training.report, plot="plot_training", needs_torch=True),
        Demo("precision", "decode over float32, float16, bfloat16 and int8 (q8_0) caches: error against float64",
             precision.run, precision.report),
        Demo("serving", "a paged KV cache: three requests prefilled in chunks and decoded together (attn.flash)",
             serving.run, serving.report),
        Demo("ring", "ring attention on --nproc processes (gloo): difference from one process, times, bytes sent",
             ring.run, ring.report, needs_torch=True, nproc=True),
    )
}

__all__ = ["DEMOS", "Demo", "backward", "masks", "parity", "pitfalls", "precision", "ring", "scaling", "serving",
           "timing", "training"]
