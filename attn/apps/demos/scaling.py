"""The sqrt(d_k) experiment: how dividing the scores by sqrt(d_k) keeps softmax spread out.

Exactly the seed article's run: for each d_k a fresh
``numpy.random.default_rng(7)`` draws ``q`` (``normal(size=d_k)``) and then
2000 keys from the same generator; the dot products ``k . q`` go through
softmax once as they are and once divided by ``sqrt(d_k)``.
"""

from dataclasses import dataclass

import numpy as np

from attn._api import softmax
from attn._effective_keys import effective_keys

SEED = 7
D_KS = (16, 64, 512)
N_KEYS = 2000


@dataclass
class ScalingRow:
    """One d_k of the experiment."""

    d_k: int
    dot_std: float  # standard deviation of the 2000 dot products (~ sqrt(d_k))
    max_weight_raw: float  # largest softmax weight, scores not scaled
    max_weight_scaled: float  # largest softmax weight, scores / sqrt(d_k)
    effective_raw: float  # 1 / sum(w**2), not scaled
    effective_scaled: float  # 1 / sum(w**2), scaled
    weights_raw: np.ndarray  # [n_keys]
    weights_scaled: np.ndarray  # [n_keys]


def dot_products(d_k, seed=SEED, n_keys=N_KEYS):
    """The seed's draw: ``q`` then the keys from one fresh generator; returns ``k @ q``.

    Returns
    -------
    ndarray, shape [n_keys], float64
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(d_k,))  # [d_k]
    k = rng.normal(size=(n_keys, d_k))  # [n_keys, d_k]
    return k @ q  # [n_keys]


def run_one(d_k, seed=SEED, n_keys=N_KEYS):
    """Softmax of the dot products with and without the 1/sqrt(d_k) scale."""
    dots = dot_products(d_k, seed, n_keys)
    w_raw = softmax(dots)
    w_scaled = softmax(dots / np.sqrt(d_k))
    return ScalingRow(
        d_k=d_k, dot_std=float(dots.std()),
        max_weight_raw=float(w_raw.max()), max_weight_scaled=float(w_scaled.max()),
        effective_raw=float(effective_keys(w_raw)), effective_scaled=float(effective_keys(w_scaled)),
        weights_raw=w_raw, weights_scaled=w_scaled,
    )


def run(d_ks=D_KS, seed=SEED, n_keys=N_KEYS):
    """The whole table.

    Returns
    -------
    list of ScalingRow, one per d_k.
    """
    return [run_one(d_k, seed, n_keys) for d_k in d_ks]


def format_row(row):
    """One line with the seed's number formats (std .2f, weights .6f, effective keys 7.2f)."""
    return (
        f"d_k={row.d_k:4d}  dot std={row.dot_std:6.2f}  "
        f"max weight unscaled={row.max_weight_raw:.6f}  scaled={row.max_weight_scaled:.6f}  "
        f"effective keys unscaled={row.effective_raw:7.2f}  scaled={row.effective_scaled:7.2f}"
    )


def report(rows):
    """The table as text."""
    head = (
        f"softmax over {N_KEYS} keys, q and keys ~ N(0, 1) from numpy.random.default_rng({SEED}); "
        "effective keys = 1 / sum(w**2)"
    )
    return "\n".join([head] + [format_row(r) for r in rows])
