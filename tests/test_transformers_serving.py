"""Continuous batching through transformers' FlashAttention path with attn.flash (attn_implementation="attn/flash").

transformers loads a FlashAttention implementation named like a hub
repository through the ``kernels`` package; attn registers its own kernel
directory with ``LOCAL_KERNELS`` (attn.integrations.transformers.register_flash).
These tests need a ``kernels`` release in the range the installed transformers
accepts: on this project's registry that is transformers 5.22.2 with kernels
0.17.2 (transformers 5.24 wants kernels 0.18.2, which the registry lacks), so
CI runs this file in a second environment (.ci/run, "serving"); elsewhere it
is skipped (under ``ATTN_REQUIRE_SERVING=1``, as in CI, it fails). The references are transformers' own sdpa path and plain
``generate``: the greedy tokens must be the same.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from attn.apps.serving import kernels_problem  # noqa: E402
from conftest import needs_serving  # noqa: E402

pytestmark = needs_serving(kernels_problem())

import attn.flash  # noqa: E402
from attn.apps.models._rounding import float32_logit_bound  # noqa: E402
import attn.integrations.transformers as attn_hf  # noqa: E402

NAME = attn_hf.FLASH_NAME


@pytest.fixture(autouse=True, scope="module")
def _registered():
    attn_hf.register_flash()


def tiny(model_type="llama", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=512, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def greedy(max_new_tokens=6):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


class Calls:
    """Counts the attn.flash calls transformers makes (the kernel module looks them up at call time)."""

    def __init__(self, monkeypatch):
        self.n = {}
        for fn in ("flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_func"):
            real = getattr(attn.flash, fn)
            monkeypatch.setattr(attn.flash, fn, self._counting(fn, real))

    def _counting(self, name, real):
        def call(*args, **kwargs):
            self.n[name] = self.n.get(name, 0) + 1
            return real(*args, **kwargs)
        return call


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", dict(sliding_window=4, use_sliding_window=True,
                                                                             max_window_layers=0))])
def test_generate_batch_same_tokens_as_sdpa(model_type, extra, monkeypatch):
    """generate_batch (continuous batching) with attn gives sdpa's greedy tokens and plain generate's,
    and attn.flash's varlen function is what ran."""
    model = tiny(model_type, **extra)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 45)), [3] * 12]
    ref = model.generate_batch(prompts, generation_config=greedy())
    calls = Calls(monkeypatch)
    model.set_attn_implementation(NAME)
    got = model.generate_batch(prompts, generation_config=greedy())
    assert calls.n.get("flash_attn_varlen_func", 0) > 0
    for k in ref:
        assert got[k].generated_tokens == ref[k].generated_tokens, k
    for i, p in enumerate(prompts):  # and plain generate, one prompt at a time
        out = model.generate(torch.tensor([p]), generation_config=greedy())
        assert out[0, len(p):].tolist() == got[f"req_{i}"].generated_tokens


def test_packed_batch_without_mask(monkeypatch):
    """A padding-free packed batch (position_ids restarting per sequence): attn runs it through
    cu_seqlens (flash_attn_varlen_func, no L x S mask) and its logits equal sdpa's on each sequence."""
    model = tiny()
    lengths = [5, 11, 3]
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        refs = [model(ids[:, a:a + n]).logits for a, n in zip(np.cumsum([0] + lengths[:-1]), lengths)]
        calls = Calls(monkeypatch)
        model.set_attn_implementation(NAME)
        packed = model(ids, position_ids=pos).logits
    assert calls.n.get("flash_attn_varlen_func", 0) > 0
    ref = torch.cat(refs, dim=1)
    cfg = model.config  # two float32 implementations of the same model: attn.apps.models._rounding's bound
    bound = float32_logit_bound(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, ref.abs().max().item())
    assert (packed - ref).abs().max().item() <= bound


def test_packed_training_gradients(monkeypatch):
    """Padding-free training: a packed batch (lengths 12, 3, 7, position_ids restarting) through attn's
    flash_attn_varlen_func and its backward gives the parameter gradients of the padded batch with sdpa,
    held to float64 (conftest.gradient_tolerance: within 3x float32 torch's own error)."""
    import copy

    from conftest import gradient_tolerance

    lengths = [12, 3, 7]
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    weights = [torch.randn(n, 128, generator=gen) for n in lengths]  # a linear loss on every logit

    def padded_grads(model):
        L = max(lengths)
        ids = torch.zeros(len(lengths), L, dtype=torch.long)
        mask = torch.zeros(len(lengths), L, dtype=torch.long)
        w = torch.zeros(len(lengths), L, 128, dtype=model.dtype)
        for i, (s, wt) in enumerate(zip(seqs, weights)):
            ids[i, :len(s)], mask[i, :len(s)], w[i, :len(s)] = s, 1, wt.to(model.dtype)
        model.zero_grad()
        (model(ids, attention_mask=mask).logits * w).sum().backward()
        return {n: p.grad.double().clone() for n, p in model.named_parameters()}

    base = tiny()
    ref = padded_grads(copy.deepcopy(base).double())
    torch32 = padded_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    calls = Calls(monkeypatch)
    model.set_attn_implementation(NAME)
    model.zero_grad()
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    (model(ids, position_ids=pos).logits[0] * torch.cat(weights)).sum().backward()
    assert calls.n.get("flash_attn_varlen_func", 0) > 0
    for name, p in model.named_parameters():
        r = ref[name].numpy()
        err_torch = float((torch32[name] - ref[name]).abs().max())
        err = float((p.grad.double() - ref[name]).abs().max())
        assert err <= gradient_tolerance(r, err_torch), f"{name}: {err:.3g} vs torch's {err_torch:.3g}"
