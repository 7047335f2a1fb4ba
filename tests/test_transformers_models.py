"""attn in tiny random transformers models of many architectures, built here (no download).

Each model runs in float32 with ``attn_implementation="attn"`` and with
transformers' own implementation (sdpa where the model has it, eager
otherwise): logits within the float32 rounding bound of attn/apps/models/_rounding.py,
the same greedy tokens. The variants run natively: Gemma 2's softcap,
gpt-oss's sinks, the sliding windows (short windows here, so that they act).
Architectures whose routing changes between transformers releases (Falcon's variants, Bloom) are
observed on the installed transformers, with a spy function in its attention registry: attn runs
those routed through the interface and matches eager there, and refuses those that bypass it.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")

import attn.integrations.transformers as attn_hf  # noqa: E402
from attn.apps.models._rounding import float32_logit_bound, tie_threshold  # noqa: E402

from transformers import (  # noqa: E402
    AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM,
)

attn_hf.register()

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 4  # shorter than the prompts: the window acts
MODELS = {  # model_type: (config overrides, model class)
    "llama": ({}, AutoModelForCausalLM),
    "mistral": (dict(sliding_window=WINDOW), AutoModelForCausalLM),
    "qwen2": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), AutoModelForCausalLM),
    "qwen3": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), AutoModelForCausalLM),
    "gemma": ({}, AutoModelForCausalLM),
    "gemma2": (dict(sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                    query_pre_attn_scalar=8), AutoModelForCausalLM),
    "gemma3_text": (dict(sliding_window=WINDOW, query_pre_attn_scalar=8,
                         layer_types=["sliding_attention", "full_attention"]), AutoModelForCausalLM),
    "phi3": (dict(sliding_window=WINDOW), AutoModelForCausalLM),
    "olmo2": ({}, AutoModelForCausalLM),
    "granite": ({}, AutoModelForCausalLM),
    "starcoder2": (dict(sliding_window=WINDOW), AutoModelForCausalLM),
    "gpt_oss": (dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"]), AutoModelForCausalLM),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48), AutoModelForCausalLM),
    "gpt_neox": (dict(rotary_pct=0.5), AutoModelForCausalLM),
    "bert": ({}, AutoModelForMaskedLM),
    "t5": (dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0), AutoModelForSeq2SeqLM),
}
#: Architectures (per config) that bypassed the attention interface in some transformers release
#: (Falcon until 5.24, every variant; Bloom): whether they do now is observed (routes_through_interface).
OBSERVED = {
    "bloom": ("bloom", dict(n_embed=32, n_layer=2, n_head=4)),
    "falcon": ("falcon", dict(num_kv_heads=4)),
    "falcon-new-decoder": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon-multi-query": ("falcon", dict(multi_query=True)),
    "falcon-alibi": ("falcon", dict(alibi=True)),
}


def build(model_type, overrides, cls=AutoModelForCausalLM):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **dict(TINY, **overrides))
    return cls.from_config(cfg).eval()


def prompts():
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 97, (2, 11), generator=g)


def logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kw).logits


def reference_impl(model):
    return "sdpa" if type(model)._supports_sdpa else "eager"


@pytest.mark.parametrize("model_type", list(MODELS))
def test_logits_and_greedy_tokens_match_transformers(model_type):
    overrides, cls = MODELS[model_type]
    model = build(model_type, overrides, cls)
    cfg = model.config
    ids = prompts()
    kw = {"decoder_input_ids": ids[:, :7]} if cls is AutoModelForSeq2SeqLM else {}
    ref_impl = reference_impl(model)
    ref = logits(model, ref_impl, ids, **kw)
    out = logits(model, "attn", ids, **kw)
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model")
    ff = getattr(cfg, "intermediate_size", None) or getattr(cfg, "d_ff", None) or getattr(cfg, "n_inner", None) or 4 * d
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers")
    bound = float32_logit_bound(2 * n_layers, d, ff, ref.abs().max().item())
    err = (out - ref).abs().max().item()
    assert err <= bound, f"{model_type}: attn vs {ref_impl}: {err:.3g} > {bound:.3g}"
    if cls is AutoModelForMaskedLM:
        return
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation(ref_impl)
    with torch.no_grad():
        ref_tokens = model.generate(ids, **gen)
    model.set_attn_implementation("attn")
    with torch.no_grad():
        tokens = model.generate(ids, **gen)
    if not torch.equal(tokens, ref_tokens):  # allowed only at a near tie of the top two logits
        model.set_attn_implementation(ref_impl)
        with torch.no_grad():
            scores = model.generate(ids, output_scores=True, return_dict_in_generate=True, **gen).scores
        top2 = torch.stack(scores).topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min().item() <= tie_threshold(bound), model_type


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gpt_oss"])
def test_variants_act(model_type):
    """The window, softcap and sinks change the logits (so the test above checks them)."""
    overrides, cls = MODELS[model_type]
    model = build(model_type, overrides, cls)
    ids = prompts()
    out = logits(model, "attn", ids)
    if model_type == "gemma2":
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    elif model_type == "gpt_oss":
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
    model.config.sliding_window = 10**6
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 10**6
    assert (logits(model, "attn", ids) - out).abs().max().item() > 1e-3


def test_native_window_builds_no_mask():
    """An unpadded prompt through Mistral's window layers: attn's mask function returns None."""
    overrides, cls = MODELS["mistral"]
    model = build("mistral", overrides, cls)
    seen = []
    original = attn_hf.attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("sliding_window")))
        return original(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("attn_spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register("attn_spy", attn_hf.mask_function)
    logits(model, "attn_spy", prompts())
    assert seen and all(m is None and w == WINDOW for m, w in seen)


def observed_config(case):
    model_type, overrides = OBSERVED[case]
    tiny = {k: v for k, v in TINY.items() if k != "head_dim"}
    return AutoConfig.for_model(model_type, **dict(tiny, **overrides))


def routes_through_interface(case):
    """Whether the installed transformers runs this architecture's attention through its attention
    registry: a spy registered there, set on an eager model's configs directly (transformers' and
    attn's checks bypassed), is called or not. attn's own code is not asked."""
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append(type(module).__name__)
        return transformers.integrations.sdpa_attention.sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("routing_spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register("routing_spy", transformers.masking_utils.sdpa_mask)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(observed_config(case), attn_implementation="eager").eval()
    for config in {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
                   if c is not None}.values():
        config._attn_implementation = "routing_spy"
    with torch.no_grad():
        model(prompts())
    return bool(calls)


@pytest.mark.parametrize("case", list(OBSERVED))
def test_models_follow_the_installed_transformers(case):
    """Routed through the interface (observed): attn runs it, logits within the float32 bound of
    eager's; bypassing it: selecting attn is a ValueError, and set_attn_implementation keeps eager."""
    if routes_through_interface(case):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(observed_config(case), attn_implementation="eager").eval()
        ids = prompts()
        ref = logits(model, "eager", ids)
        out = logits(model, "attn", ids)
        assert model.config._attn_implementation == "attn"
        cfg = model.config
        bound = float32_logit_bound(2 * cfg.num_hidden_layers, cfg.hidden_size, 4 * cfg.hidden_size,
                                    ref.abs().max().item())
        err = (out - ref).abs().max().item()
        assert err <= bound, f"{case}: attn vs eager: {err:.3g} > {bound:.3g}"
        return
    with pytest.raises(ValueError, match=r"computes attention in its own code.*'sdpa' or 'eager'"):
        AutoModelForCausalLM.from_config(observed_config(case), attn_implementation="attn")
    model = AutoModelForCausalLM.from_config(observed_config(case), attn_implementation="eager")
    model.set_attn_implementation("attn")  # transformers declines (a warning): the model keeps its own
    assert model.config._attn_implementation == "eager"


BF16_MODELS = ["llama", "qwen2", "gemma3_text", "mistral", "gpt2", "bert"]


@pytest.mark.parametrize("model_type", BF16_MODELS)
def test_bfloat16_models_within_the_spread_of_sdpa(model_type):
    """bfloat16 models (what transformers 5 loads by default): attn's logits are within the bfloat16
    spread of sdpa's, measured as sdpa against eager on the same model; greedy tokens agree wherever
    sdpa's top two logits are further apart than that spread."""
    overrides, cls = MODELS[model_type]
    model = build(model_type, overrides, cls).to(torch.bfloat16)
    ids = prompts()
    sdpa, eager, ours = (logits(model, impl, ids).float() for impl in ("sdpa", "eager", "attn"))
    spread = (sdpa - eager).abs().max().item()
    err = (ours - sdpa).abs().max().item()
    assert err <= spread, f"{model_type}: attn vs sdpa {err:.3g} > sdpa vs eager {spread:.3g}"
    if cls is AutoModelForMaskedLM:
        return
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(ids, **gen)
    model.set_attn_implementation("attn")
    with torch.no_grad():
        tokens = model.generate(ids, **gen).sequences
    top2 = torch.stack(ref.scores).float().topk(2, dim=-1).values      # [steps, batch, 2]
    clear = (top2[..., 0] - top2[..., 1]) > spread                     # steps where sdpa's choice is clear
    new = ids.shape[1]
    for b in range(ids.shape[0]):
        for step in range(len(ref.scores)):
            if not clear[step, b]:
                break                                                  # after a near tie the texts may differ
            assert tokens[b, new + step] == ref.sequences[b, new + step], (model_type, b, step)
