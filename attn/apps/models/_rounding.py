"""How far two float32 evaluations of one transformer may differ: logits and greedy tokens.

Shared by the model tests (tests/) and the end-to-end benchmark
(attn/apps/bench/test_bench_e2e.py), which compare two implementations of the
same model.

Two float32 evaluations of the same model (different BLAS, summation orders,
fused or not) differ from the exact logits by the rounding errors accumulated
along the computation of each logit. Along the residual stream a logit depends
on a chain of about ``n = n_layer * (d_model + d_ff) + d_model`` accumulated
products and sums (per layer: the inner products of the attention and
feed-forward projections, of length ``d_model`` and ``d_ff``; then the output
projection). Rounding errors of such a chain behave as independent random
variables (Higham & Mary, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 2019): with probability at least
``1 - 2 exp(-lambda^2 / 2)`` the relative error is below ``lambda * sqrt(n) * u``,
u = 2^-24. lambda = 5.4 gives a failure probability below 1e-6 per logit.
Errors are relative to the magnitude the values carry, for a logit the logit
scale ``max |logit|``; the model is assumed well conditioned (no amplification
of relative perturbations by more than O(1)), which the tests check against a
float64 evaluation. Two implementations: twice the bound.

Greedy decoding picks the largest logit; two evaluations whose logits differ
by at most ``bound`` pick the same token unless the top-2 gap is within
``2 * bound`` (:func:`tie_threshold`). After a tie the two sequences may part
for good, so greedy tokens are compared up to the first such step
(:func:`compare_greedy`).
"""

import math

import numpy as np

U32 = 2.0**-24
LAMBDA = 5.4


def float32_logit_bound(n_layer, d_model, d_ff, scale, implementations=2):
    """Bound on ``|logits_a - logits_b|`` of ``implementations`` float32 evaluations (1: vs exact).

    Parameters
    ----------
    n_layer, d_model, d_ff : int
        The model's depth, width and feed-forward width.
    scale : float
        The logit scale, ``max |logit|``.
    implementations : int
        2 for two float32 evaluations compared with each other, 1 for one against the exact logits.

    Returns
    -------
    float
    """
    n = n_layer * (d_model + d_ff) + d_model
    return implementations * LAMBDA * math.sqrt(n) * U32 * scale


def logit_bound(config, scale, implementations=2):
    """:func:`float32_logit_bound` of a :class:`attn.apps.models.gguf.LlamaConfig`."""
    return float32_logit_bound(config.n_layer, config.d_model, config.d_ff, scale, implementations)


def tie_threshold(bound):
    """Greedy tokens of two evaluations whose logits differ by at most ``bound`` agree when the
    top-2 gap exceeds ``2 * bound``: top1 - bound > other + bound."""
    return 2 * bound


def greedy_stats(logits):
    """Over the last axis of ``logits``: the greedy token, the top-2 logit gap and the logit
    scale ``max |logit|`` (over finite logits: a suppressed token is -inf).

    Returns
    -------
    tokens, gaps, scales : ndarray
        Of ``logits.shape[:-1]`` (0-d for one step's logits).
    """
    logits = np.asarray(logits)
    top2 = np.partition(logits, -2, axis=-1)[..., -2:]  # [..., 1] the largest, [..., 0] the next
    scales = np.max(np.abs(np.where(np.isfinite(logits), logits, 0)), axis=-1)
    return np.argmax(logits, axis=-1), top2[..., 1] - top2[..., 0], scales


def compare_greedy(tokens_a, tokens_b, gaps, scales=None, config=None, *, margin=None):
    """Compare two greedy sequences up to the first step whose top-2 gap is within rounding.

    Parameters
    ----------
    tokens_a, tokens_b : sequence of int
        The tokens of the two evaluations, step by step.
    gaps, scales : sequence of float
        Per step, evaluation A's top-2 logit gap and logit scale ``max |logit|``.
    config : attn.apps.models.gguf.LlamaConfig
        The model (its sizes give the bound, :func:`logit_bound`): a step is a
        near-tie when its gap is within :func:`tie_threshold` of the bound.
    margin : float, optional
        Instead of ``scales`` and ``config``: a step is a near-tie when its gap is at
        most ``margin`` (e.g. a measured spread between two implementations).

    Returns
    -------
    compared : int
        How many steps were compared: all, or those before the first near-tie.
    differs_at : int or None
        The first compared step whose tokens differ (None: they all agree).
    """
    for t, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        tie = margin if margin is not None else tie_threshold(logit_bound(config, scales[t]))
        if gaps[t] <= tie:
            return t, None
        if a != b:
            return t + 1, t
    return min(len(tokens_a), len(tokens_b)), None
