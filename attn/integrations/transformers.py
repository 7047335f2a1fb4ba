"""attn as an attention implementation of Hugging Face transformers.

>>> import attn.integrations.transformers as attn_hf
>>> attn_hf.register()                                        # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attn")  # doctest: +SKIP

:func:`attention_forward` follows ``transformers.integrations.sdpa_attention.
sdpa_attention_forward`` line by line (same ``is_causal`` rule, same key
slicing for a static cache's prefill, same position-bias mask, same scaling and
dropout, same output layout) with attn's kernel in place of torch's SDPA:

- no copies: query, key, value and the mask are NumPy views of the tensors'
  CPU storage, whatever their strides, and the output is a tensor over the
  NumPy result's memory;
- grouped-query attention runs natively (``enable_gqa=True``): no
  ``repeat_kv``, no ``pack_gqa``;
- the mask function registered with it is transformers' own ``sdpa_mask``, so
  the masks (bool, None when ``is_causal`` can be used) are sdpa's.

What attn cannot honour raises (the message names the argument): a
``softcap`` (logit soft-capping), attention sinks (``s_aux``/``sinks``), inputs
that need autograd. A sliding window needs nothing: as in sdpa's path it is
part of the mask transformers builds. Dropout (training mode only) draws from
NumPy's generator, not torch's. ``output_attentions=True`` returns attn's weights.
"""

import numpy as np

from .. import _interop
from .._api import scaled_dot_product_attention

# keyword arguments that change the attention and that attn has no way to honour
# (a sliding window is not among them: as for sdpa, it is in the mask transformers builds)
UNSUPPORTED = ("softcap", "s_aux", "sinks")


def _check_supported(module, query, key, value, kwargs):
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn's attention implementation does not support {name}={kwargs[name]!r} "
                f"(layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__}); "
                "use attn_implementation='sdpa' or 'eager' for this model"
            )
    import torch

    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(
            "attn's transformers attention has no backward: run the model under torch.no_grad() or "
            "torch.inference_mode() (generate() does), or use attn_implementation='sdpa' to train"
        )


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      position_bias=None, **kwargs):
    """transformers' attention-function signature, computed by :func:`attn.scaled_dot_product_attention`.

    Parameters
    ----------
    module : torch.nn.Module, the calling attention layer
    query : Tensor [B, H_q, L, E]
    key : Tensor [B, H_kv, S, E]
    value : Tensor [B, H_kv, S, Ev]
    attention_mask : bool or float Tensor broadcastable to [B, H_q, L, S], or None
    dropout : float, dropout probability (transformers passes 0 in eval mode)
    scaling : float or None (None: ``1 / sqrt(E)``)
    is_causal : bool or None (None: ``module.is_causal``, default True)
    position_bias : Tensor broadcastable to [B, H_q, L, S], optional, added to the scores

    Returns
    -------
    attn_output : Tensor [B, L, H_q, Ev], contiguous
    attn_weights : Tensor [B, H_q, L, S] with ``output_attentions=True``, else None
    """
    _check_supported(module, query, key, value, kwargs)
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal  # sdpa's rule
    if is_causal and kv_length > q_length:  # a static cache's prefill: the keys after the queries are unused
        key, value = key[:, :, :q_length, :], value[:, :, :q_length, :]
        if position_bias is not None:
            position_bias = position_bias[:, :, :, :q_length]
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False

    want_weights = bool(kwargs.get("output_attentions", False))
    q, k, v = (_interop.to_numpy(t, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
    mask = None if attention_mask is None else _interop.to_numpy(attention_mask, "attention_mask")
    if mask is not None and mask.dtype.kind == "f" and mask.dtype != q.dtype:
        mask = mask.astype(q.dtype)  # attn wants one float dtype; transformers' float masks use the model's
    result = scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa,
        return_weights=want_weights,
    )
    out, weights = result if want_weights else (result, None)  # out: [B, H_q, L, Ev]
    out = _interop.to_torch(np.ascontiguousarray(out.transpose(0, 2, 1, 3)))  # -> [B, L, H_q, Ev]
    return out, (None if weights is None else _interop.to_torch(weights))


def register(name="attn"):
    """Register attn as ``attn_implementation=name`` with transformers (attention and mask functions).

    After this, ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs :func:`attention_forward` in
    every attention layer, with the masks of transformers' ``sdpa`` path.

    Returns
    -------
    str, the name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
