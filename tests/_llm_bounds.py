"""The float32 rounding bound of a transformer's logits, shared by the model tests.

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
"""

import math

U32 = 2.0**-24
LAMBDA = 5.4


def float32_logit_bound(n_layer, d_model, d_ff, scale, implementations=2):
    """Bound on |logits_a - logits_b| of ``implementations`` float32 evaluations (1: vs exact)."""
    n = n_layer * (d_model + d_ff) + d_model
    return implementations * LAMBDA * math.sqrt(n) * U32 * scale
