"""attn inside Hugging Face transformers, on tiny randomly initialised models built here (no download).

The reference is transformers' own ``sdpa`` implementation (torch's SDPA) on
the same model: in float64 the two must agree to rounding, on every
attention call (within 1e-13, checked by a wrapper that runs both on the
same inputs) and end to end (logits, greedy tokens).
"""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")

import attn.integrations.transformers as attn_hf  # noqa: E402
from _llm_helpers import register_checked  # noqa: E402

from attn.apps.models._rounding import float32_logit_bound  # noqa: E402

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

CALLS = register_checked()  # (max |attn - sdpa| of the output, of the weights or None) per attention call


def tiny_llama(n_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=64,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().double()


def run(model, impl, fn, *args, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return fn(*args, **kwargs)


def padded_batch(seed=1):
    """Three prompts of lengths 9, 6, 3 left-padded to 9 (token 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 101, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, n_pad in ((1, 3), (2, 6)):
        ids[row, :n_pad], mask[row, :n_pad] = 0, 0
    return ids, mask


def assert_close_calls(n_min):
    assert len(CALLS) >= n_min
    assert max(e for e, _ in CALLS) <= 1e-13
    CALLS.clear()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_prefill_and_cached_decode_match_sdpa(n_kv_heads):
    model = tiny_llama(n_kv_heads)
    ids, mask = padded_batch()
    CALLS.clear()
    out = run(model, "attn_checked", model, ids, attention_mask=mask)
    assert_close_calls(2)  # one per layer
    ref = run(model, "sdpa", model, ids, attention_mask=mask)
    real = mask.bool()  # logits of padding positions are not compared
    assert torch.allclose(out.logits[real], ref.logits[real], rtol=0, atol=1e-12)
    # greedy decoding: a prefill of the padded batch, then one token per step through the DynamicCache
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    tokens = run(model, "attn_checked", model.generate, ids, **kw)
    assert_close_calls(2 * 12)
    assert torch.equal(tokens, run(model, "sdpa", model.generate, ids, **kw))


def test_no_padding_uses_is_causal_and_matches_sdpa():
    model = tiny_llama()
    ids = padded_batch()[0][:1]  # one unpadded prompt: sdpa_mask returns None, is_causal=True
    CALLS.clear()
    out = run(model, "attn_checked", model, ids).logits
    assert_close_calls(2)
    assert torch.allclose(out, run(model, "sdpa", model, ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_custom_4d_masks_match_sdpa(kind):
    """A 4-D mask passed to the model is used as is (bool: True takes part; float: added)."""
    model = tiny_llama()
    ids = padded_batch()[0]
    g = torch.Generator().manual_seed(5)
    allowed = (torch.rand(3, 1, 9, 9, generator=g) > 0.3) & torch.ones(9, 9, dtype=torch.bool).tril()
    allowed[..., 0] = True  # every row keeps a key
    mask = allowed if kind == "bool" else torch.where(allowed, torch.randn(3, 1, 9, 9, generator=g,
                                                                          dtype=torch.float64), -torch.inf)
    CALLS.clear()
    out = run(model, "attn_checked", model, ids, attention_mask=mask).logits
    assert_close_calls(2)
    assert torch.allclose(out, run(model, "sdpa", model, ids, attention_mask=mask).logits, rtol=0, atol=1e-12)


def test_sliding_window_is_in_the_mask():
    """Mistral with a 3-token window: transformers builds the window into the mask, as for sdpa."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=3, pad_token_id=0)
    model = MistralForCausalLM(cfg).eval().double()
    ids, mask = padded_batch()
    CALLS.clear()
    out = run(model, "attn_checked", model, ids, attention_mask=mask).logits
    assert_close_calls(2)
    ref = run(model, "sdpa", model, ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(out[real], ref[real], rtol=0, atol=1e-12)
    model.config.sliding_window = None  # the window really acts on these 9 tokens
    no_window = run(model, "attn", model, ids, attention_mask=mask).logits
    assert (no_window[0] - out[0]).abs().max() > 1e-3


def test_output_attentions_returns_attn_weights():
    model = tiny_llama()
    ids, mask = padded_batch()
    CALLS.clear()
    out = run(model, "attn_checked", model, ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (3, 4, 9, 9)
    assert len(CALLS) == 2 and max(w for _, w in CALLS) <= 1e-13
    CALLS.clear()
    w = out.attentions[0]
    assert torch.allclose(w.sum(-1)[mask.bool()[:, None].expand(3, 4, 9)], torch.tensor(1.0, dtype=w.dtype))


def test_set_attn_implementation_and_from_config():
    model = tiny_llama()
    model.set_attn_implementation("attn")
    assert model.config._attn_implementation == "attn"
    model2 = LlamaForCausalLM._from_config(model.config, attn_implementation="attn")
    assert model2.config._attn_implementation == "attn"


def _direct_call(**kwargs):
    module = tiny_llama().model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        return attn_hf.attention_forward(module, q, kv, kv, None, scaling=0.25, **kwargs)


@pytest.mark.parametrize("name, value", [("softcap", 0.5), ("s_aux", torch.randn(4)), ("sinks", torch.randn(4)),
                                         ("sliding_window", 2)])
def test_variant_arguments_run_natively(name, value):
    """softcap, sinks (s_aux or sinks), sliding_window: against the formula written out in torch."""
    module = tiny_llama().model.layers[0].self_attn
    torch.manual_seed(0)
    q = torch.randn(1, 4, 5, 16, dtype=torch.float64)
    kv = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _ = attn_hf.attention_forward(module, q, kv, kv, None, scaling=0.25, **{name: value})
    k = kv.repeat_interleave(2, dim=1)
    s = q @ k.transpose(-1, -2) * 0.25
    if name == "softcap":
        s = value * torch.tanh(s / value)
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    visible = (j <= i) & ((i - j < value) if name == "sliding_window" else True)
    s = s.masked_fill(~visible, -torch.inf)
    if name in ("s_aux", "sinks"):
        s = torch.cat([s, value.reshape(1, 4, 1, 1).expand(1, 4, 5, 1).double()], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :5]
    assert torch.allclose(out, (p @ k).transpose(1, 2), rtol=0, atol=1e-12)


def test_unused_kwargs_pass_like_sdpa():
    out, w = _direct_call(position_ids=torch.arange(5)[None], output_attentions=False, sliding_window=None)
    assert out.shape == (1, 5, 4, 16) and w is None and out.is_contiguous()


def test_grad_mode_raises_with_what_to_do():
    model = tiny_llama()
    model.set_attn_implementation("attn")
    with pytest.raises(ValueError, match="no backward.*torch.no_grad"):
        model(padded_batch()[0])


def test_float32_model_runs_in_float32():
    model = tiny_llama().float()
    ids, mask = padded_batch()
    out = run(model, "attn", model, ids, attention_mask=mask).logits
    ref = run(model, "sdpa", model, ids, attention_mask=mask).logits
    assert out.dtype == torch.float32
    real = mask.bool()
    cfg = model.config
    bound = float32_logit_bound(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                                ref[real].abs().max().item())
    assert (out[real] - ref[real]).abs().max().item() <= bound


def test_import_attn_imports_neither_torch_nor_transformers():
    code = ("import sys, attn, attn.integrations.transformers, attn.apps.models.llama, attn._interop; "
            "print(sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"



def test_q8_cache_decodes_over_its_dequantized_values():
    """``cache=Q8Cache()`` with attn: the cache holds the keys and values within the q8_0
    bound, and every step's logits equal sdpa's over a float cache of those dequantized values
    (float32 rounding only: both attend over the same numbers)."""
    import numpy as np
    from transformers.cache_utils import Cache, DynamicLayer

    import attn
    from _bounds import q8_error, q8_reference_dequantize

    class DequantizedLayer(DynamicLayer):  # a float cache of what the q8_0 rows stand for
        def update(self, key_states, value_states, *args, **kwargs):
            deq = [torch.from_numpy(q8_reference_dequantize(attn.Q8Tensor.quantize(t.numpy())).astype(np.float32))
                   for t in (key_states, value_states)]
            return super().update(*deq, *args, **kwargs)

    model = tiny_llama().float()
    ids = padded_batch()[0][:1]  # one unpadded prompt of 9 tokens
    q8, ref_cache = attn_hf.Q8Cache(), Cache(layer_class_to_replicate=DequantizedLayer)
    cfg = model.config
    step_ids = ids
    for _ in range(4):  # the prompt, then three tokens one at a time
        out = run(model, "attn", model, step_ids, cache=q8, use_cache=True)
        ref = run(model, "sdpa", model, step_ids, cache=ref_cache, use_cache=True)
        bound = float32_logit_bound(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                                    ref.logits.abs().max().item())
        assert (out.logits - ref.logits).abs().max().item() <= bound
        step_ids = ref.logits[:, -1:].argmax(-1)
    keys = q8.layers[0].keys
    assert isinstance(keys, attn.Q8Tensor) and q8.get_seq_length() == 12 == keys.shape[2]
    prompt_keys = run(model, "sdpa", model, ids, use_cache=True).cache.layers[0].keys.numpy()
    got = q8_reference_dequantize(keys)[:, :, :9]
    assert np.all(np.abs(got - prompt_keys) <= q8_error(prompt_keys))
