"""The NumPy Llama (attn.apps.models.llama) against transformers' LlamaForCausalLM on a tiny random model.

No download: the model is built here, its weights copied into the NumPy
model's layout. transformers computes RMSNorm in float32 even in a float64
model, so the comparison bound is the float32 one (attn/apps/models/_rounding.py).
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")


from attn.apps.models import llama  # noqa: E402
from attn.apps.models._rounding import logit_bound  # noqa: E402
from attn.apps.models.gguf import LlamaConfig  # noqa: E402


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, pad_token_id=0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval().double()
    with torch.no_grad():  # non-trivial norm gains
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    names = {"w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj", "w_v": "self_attn.v_proj",
             "w_o": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj", "g_attn": "input_layernorm", "g_ffn": "post_attention_layernorm"}
    weights = {"wte": sd["model.embed_tokens.weight"], "g_final": sd["model.norm.weight"],
               "lm_head": sd["lm_head.weight"],
               "layers": [{ours: sd[f"model.layers.{i}.{theirs}.weight"] for ours, theirs in names.items()}
                          for i in range(cfg.num_hidden_layers)]}
    config = LlamaConfig(n_layer=3, d_model=64, d_ff=96, n_head=4, n_kv_head=2, rope_theta=10000.0,
                         norm_eps=1e-5, n_vocab=101, n_ctx=64)
    return model, weights, config


def bound(config, ref):
    return logit_bound(config, np.abs(ref).max())


@pytest.mark.parametrize("backend", ["cython", "numpy"])
def test_prefill_then_cached_decode_match_transformers(backend):
    model, weights, config = tiny()
    ids = np.random.default_rng(1).integers(3, 101, (1, 12))
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits[0].numpy()  # [12, n_vocab], all positions at once
    caches = llama.new_caches(config, 1, 12, np.float64)
    prefill = llama.forward(ids[:, :8], weights, config, caches, backend=backend)[0]  # [8, n_vocab]
    steps = [llama.forward(ids[:, t:t + 1], weights, config, caches, backend=backend)[0, 0] for t in range(8, 12)]
    ours = np.concatenate([prefill, np.stack(steps)])
    assert np.abs(ours - ref).max() <= bound(config, ref)
    assert len(caches[0]) == 12


def test_left_padded_batch_matches_transformers():
    model, weights, config = tiny()
    rng = np.random.default_rng(2)
    ids = rng.integers(3, 101, (3, 10))
    valid = np.ones((3, 10), bool)
    valid[1, :4] = valid[2, :7] = False
    ids[~valid] = 0
    pos = np.maximum(np.cumsum(valid, 1) - 1, 0)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(valid.astype(np.int64)),
                    position_ids=torch.from_numpy(pos)).logits.numpy()
    caches = llama.new_caches(config, 3, 10, np.float64)
    ours = llama.forward(ids, weights, config, caches, positions=pos, key_valid=valid)
    assert np.abs(ours[valid] - ref[valid]).max() <= bound(config, ref[valid])
    # the padded rows' real tokens get the logits of the same prompt alone
    alone = llama.forward(ids[2:, 7:], weights, config, llama.new_caches(config, 1, 3, np.float64))
    assert np.abs(alone[0] - ours[2, 7:]).max() <= 1e-12 * np.abs(alone).max()


def test_last_only_is_the_last_row():
    _, weights, config = tiny()
    ids = np.arange(3, 10)[None]
    full = llama.forward(ids, weights, config, llama.new_caches(config, 1, 7, np.float64))
    last = llama.forward(ids, weights, config, llama.new_caches(config, 1, 7, np.float64), last_only=True)
    assert last.shape == (1, 1, 101)
    # the same float64 dot products of length d_model, blocked differently by BLAS: each within
    # d_model u sum_i |h_i w_i| (h the final normed hidden state, got with an identity lm_head)
    h = llama.forward(ids, dict(weights, lm_head=np.eye(64)), config, llama.new_caches(config, 1, 7, np.float64),
                      last_only=True)[0, 0]
    bound = 64 * 2.0**-53 * (np.abs(h) @ np.abs(weights["lm_head"]).T)
    assert np.all(np.abs(last[0, 0] - full[0, -1]) <= bound)
