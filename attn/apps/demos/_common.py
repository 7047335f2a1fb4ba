"""Inputs and helpers shared by the demos."""

import numpy as np

SEED = 20261012  # the seed article's fixed seed for its 5-token example
N_TOKENS = 5
D_K = 4


def five_tokens(seed=SEED, n_tokens=N_TOKENS, d_k=D_K):
    """q, k, v for the 5-token, d_k = 4 example, float64, drawn in that order.

    The article fixes the seed but does not print how it drew q, k and v, so
    these are not its numbers; they are drawn as ``normal(size=(5, 4))`` each.

    Returns
    -------
    q, k, v : ndarray, shape [n_tokens, d_k]
    """
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(n_tokens, d_k)) for _ in range(3))


def scores(q, k):
    """``q k^T / sqrt(d_k)``: shape [n_q, d_k] x [n_k, d_k] -> [n_q, n_k]."""
    return q @ k.T / np.sqrt(q.shape[-1])


def causal_true_masked(n):
    """The seed's causal mask, True = masked: ``np.triu(ones, k=1)``, shape [n, n]."""
    return np.triu(np.ones((n, n), dtype=bool), k=1)


def optional_torch():
    """The ``torch`` module, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def max_abs_diff(a, b):
    """``max |a - b|`` as a Python float."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def error_text(exc):
    """``"TypeName: message"``, the way Python prints an exception's last line."""
    return f"{type(exc).__name__}: {exc}"
