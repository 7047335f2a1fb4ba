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
  the masks (bool, None when ``is_causal`` can be used) are sdpa's, except
  for a sliding window (below);
- the variants run natively: ``softcap`` (Gemma 2), sinks (``s_aux``,
  gpt-oss) and the sliding window of windowed layers (Mistral, Qwen2,
  Gemma 2/3, Starcoder2, gpt-oss). For the window the mask function builds
  the mask without it (:func:`mask_function`: None, no L x S mask, whenever
  the plain causal mask could be skipped) and :func:`attention_forward` reads
  the layer's ``sliding_window`` (transformers' ``q - kv < sliding_window``:
  ``window=(sliding_window - 1, 0)``). With padding the mask is built with
  the window in it, as sdpa's.

A model whose attention does not go through transformers' attention
interface (Bloom, Falcon, ...) would not run attn at all (and the masks the
registered mask function builds would change its answer): selecting attn
for it raises a ValueError naming the model (:func:`register` installs the
check). Inputs that need autograd raise. Dropout (training mode only) draws
from NumPy's generator, not torch's. ``output_attentions=True`` returns attn's weights.

An 8-bit KV cache: ``model.generate(..., cache=Q8Cache())``
(:class:`attn.integrations.transformers_q8.Q8Cache`, q8_0 rows that attn's
kernel reads in place).
"""

import inspect
import sys

import numpy as np

from .. import _interop, _quantized
from .._api import scaled_dot_product_attention

_NAMES = set()  # the names attn is registered under (register)


def _check_supported(module, query, key, value, kwargs):
    if kwargs.get("s_aux") is not None and kwargs.get("sinks") is not None:
        raise ValueError(
            f"both s_aux and sinks given (layer {getattr(module, 'layer_idx', '?')} of "
            f"{type(module).__name__}): pass one"
        )
    import torch

    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (query, key, value)):
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
    sliding_window : int, optional (keyword)
        The layer's window: key kv visible to query q only if q - kv < sliding_window;
        applied natively when there is no mask (see the module docstring).
    softcap : float, optional (keyword)
        Soft-capping of the scaled scores (Gemma 2).
    s_aux, sinks : Tensor [H_q], optional (keyword)
        Attention sinks (gpt-oss).

    Returns
    -------
    attn_output : Tensor [B, L, H_q, Ev], contiguous
    attn_weights : Tensor [B, H_q, L, S] with ``output_attentions=True``, else None
    """
    _check_supported(module, query, key, value, kwargs)
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    layer_causal = bool(is_causal)  # (a bidirectional layer's window stays in its mask)
    is_causal = q_length > 1 and attention_mask is None and is_causal  # sdpa's rule
    if is_causal and kv_length > q_length:  # a static cache's prefill: the keys after the queries are unused
        key, value = _first_positions(key, q_length), _first_positions(value, q_length)
        if position_bias is not None:
            position_bias = position_bias[:, :, :, :q_length]
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False

    window = None
    if kwargs.get("sliding_window") is not None and attention_mask is None and layer_causal:
        window = (int(kwargs["sliding_window"]) - 1, 0)  # q - kv < sliding_window, causal
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    sinks = _interop.to_numpy(sinks, "sinks", detach=True)  # a trained parameter: its values

    want_weights = bool(kwargs.get("output_attentions", False))
    q, k, v = (t if _quantized.is_q8(t) else _interop.to_numpy(t, n)  # (Q8Cache: q8_0 rows, read in place)
               for t, n in ((query, "query"), (key, "key"), (value, "value")))
    mask = _interop.to_numpy(attention_mask, "attention_mask")
    if mask is not None and mask.dtype.kind == "f" and mask.dtype != q.dtype:
        mask = mask.astype(q.dtype)  # attn wants one float dtype; transformers' float masks use the model's
    result = scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa,
        return_weights=want_weights, window=window, softcap=kwargs.get("softcap"), sinks=sinks,
    )
    out, weights = result if want_weights else (result, None)  # out: [B, H_q, L, Ev]
    out = _interop.to_torch(np.ascontiguousarray(out.transpose(0, 2, 1, 3)))  # -> [B, L, H_q, Ev]
    return out, (None if weights is None else _interop.to_torch(weights))


def _first_positions(t, n):
    """Positions [0, n) of keys or values [B, H, S, E] (a tensor, or a Q8Cache's attn.Q8Tensor)."""
    if _quantized.is_q8(t):
        return _quantized.Q8Tensor(t.data[:, :, :n], t.dim)
    return t[:, :, :n, :]


def __getattr__(name):
    """``Q8Cache`` (an 8-bit KV cache for ``generate``) from :mod:`attn.integrations.transformers_q8`."""
    if name in ("Q8Cache", "Q8Layer"):
        from . import transformers_q8  # imports transformers: only when asked for

        return getattr(transformers_q8, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_sliding_causal(mask_fn, window):
    """Whether transformers' ``mask_fn`` is its sliding-window causal mask of ``window``
    (compared at the positions around the window's edges, batch 0, head 0)."""
    import torch

    edges = (0, 1, window - 2, window - 1, window, window + 1, 2 * window - 1, 2 * window, 2 * window + 1)
    pos = torch.tensor(sorted({p for p in edges if p >= 0}))
    q, kv = pos[:, None], pos[None, :]
    expected = (kv <= q) & (kv > q - window)
    try:
        got = mask_fn(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
        return bool(torch.equal(torch.as_tensor(got).expand(expected.shape), expected))
    except Exception:  # a mask function that does not broadcast: not the plain window
        return False


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' ``sdpa_mask``, except that a plain sliding-window causal mask is not built.

    When the layer's window mask is transformers' sliding-window causal mask and
    the causal mask alone could be skipped (no padding, keys aligned with the
    last query), returns None: :func:`attention_forward` then applies the
    window natively from the layer's ``sliding_window``. Otherwise exactly
    ``sdpa_mask`` (arguments and result as there).
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip)
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and (
        q_offset - kv_offset == kv_length - q_length  # the last query sees the last key
        or (q_offset == 0 == kv_offset and 1 < q_length < kv_length))  # a static cache's prefill: keys sliced
    if (local_size is not None and allow_is_causal_skip and aligned
            and _is_sliding_causal(mask_function, local_size)):
        if sdpa_mask(mask_function=causal_mask_function, local_size=None, **args, **kwargs) is None:
            return None
    return sdpa_mask(mask_function=mask_function, local_size=local_size, **args, **kwargs)


def uses_attention_interface(model_class):
    """Whether transformers model class ``model_class`` computes attention through the
    attention interface (``ALL_ATTENTION_FUNCTIONS``), so that attn runs in it."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (KeyError, OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _install_model_check():
    """Make selecting attn for a model whose attention bypasses the interface a ValueError
    (transformers would otherwise fail with a KeyError, or silently run its own attention
    with attn's masks)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(original, "_attn_checks", False):
        return

    def checked(self, attn_implementation, *args, **kwargs):
        asked = attn_implementation.values() if isinstance(attn_implementation, dict) else [attn_implementation]
        if any(a in _NAMES for a in asked) and not uses_attention_interface(type(self)):
            model_type = getattr(getattr(self, "config", None), "model_type", "?")
            raise ValueError(
                f"{type(self).__name__} (model_type {model_type!r}) computes attention in its own code, "
                "not through transformers' attention interface, so attn_implementation="
                f"{attn_implementation!r} would not run attn (and attn's masks could change its answer); "
                "use attn_implementation='sdpa' or 'eager' for this model"
            )
        return original(self, attn_implementation, *args, **kwargs)

    checked._attn_checks = True
    PreTrainedModel._check_and_adjust_attn_implementation = checked


#: The implementation name transformers loads attn.flash under (:func:`register_flash`): shaped like a
#: hub repository and containing "flash", as transformers' FlashAttention path wants.
FLASH_NAME = "attn/flash"


def register_flash(name=FLASH_NAME):
    """Make ``attn_implementation=name`` load attn.flash through transformers' own FlashAttention path.

    transformers runs continuous batching (``generate_batch``, ``transformers
    serve``) and padding-free batches (``cu_seqlens``) only with a
    FlashAttention implementation, which it loads from the ``flash_attn``
    package or, for a name shaped like a hub repository, through the
    ``kernels`` package. This points the ``kernels`` package's documented
    local override (``LOCAL_KERNELS=repo_id=path``, kept with any entries it
    already has) at the kernel directory shipped inside attn
    (:mod:`attn.integrations.flash_kernel`): nothing is downloaded, no other
    project's name is claimed. Needs the ``kernels`` package in the version
    range the installed transformers accepts (docs/models.md).

    Returns
    -------
    str, the name to pass as ``attn_implementation``.
    """
    import os
    from pathlib import Path

    path = Path(__file__).resolve().parent / "flash_kernel"
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e and not e.startswith(name + "=")]
    os.environ["LOCAL_KERNELS"] = ":".join(entries + [f"{name}={path}"])
    return name


def register(name="attn"):
    """Register attn as ``attn_implementation=name`` with transformers (attention and mask functions).

    After this, ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs :func:`attention_forward` in
    every attention layer, with the masks of transformers' ``sdpa`` path
    (:func:`mask_function`: a plain sliding window is left to the kernel).
    Selecting it for a model that does not use the attention interface
    (Bloom, Falcon, ...) raises a ValueError naming the model.

    Returns
    -------
    str, the name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    _NAMES.add(name)
    _install_model_check()
    return name
