"""Shared by the model tests: the float32 rounding bound of a transformer's logits, and the checked attention.

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


def tie_threshold(bound):
    """Greedy tokens of two evaluations whose logits differ by at most ``bound`` agree when the
    top-2 gap exceeds ``2 * bound``: top1 - bound > other + bound."""
    return 2 * bound


_CHECKED = {}


def register_checked(name="attn_checked"):
    """Register ``name``: attn's transformers attention, with torch's SDPA run on the same inputs.

    Returns the list that receives, per call, ``(max |attn - sdpa| of the output, of the weights or None)``.
    """
    if name in _CHECKED:  # one list per name, whichever test module registers first
        return _CHECKED[name]
    import torch
    import transformers
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    import attn.integrations.transformers as attn_hf

    calls = []

    def reference_weights(module, query, key, mask, scaling):
        """softmax(q k^T * scale + mask) in torch, keys repeated for GQA; fully masked rows 0."""
        k = repeat_kv(key, module.num_key_value_groups)
        scores = query @ k.transpose(-1, -2) * scaling
        if mask is None and query.shape[2] > 1:
            mask = torch.ones(query.shape[2], k.shape[2], dtype=torch.bool).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
        return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)

    def checked_forward(module, query, key, value, attention_mask, **kwargs):
        out, weights = attn_hf.attention_forward(module, query, key, value, attention_mask, **kwargs)
        ref, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        w_err = None
        if weights is not None:
            w_ref = reference_weights(module, query, key, attention_mask, kwargs["scaling"])
            w_err = (weights - w_ref).abs().max().item()
        calls.append(((out - ref).abs().max().item(), w_err))
        return out, weights

    attn_hf.register()
    _CHECKED[name] = calls
    transformers.AttentionInterface.register(name, checked_forward)
    transformers.masking_utils.AttentionMaskInterface.register(name, transformers.masking_utils.sdpa_mask)
    return calls
