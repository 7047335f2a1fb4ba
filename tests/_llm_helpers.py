"""Shared by the model tests: attn's transformers attention checked against torch's SDPA call by call.

The float32 rounding bound of a transformer's logits, and the comparison of
greedy tokens up to a near-tie, are :mod:`attn.apps.models._rounding` (the
end-to-end benchmark uses them too).
"""

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
