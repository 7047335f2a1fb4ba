"""A padding-free training step with attn against the padded step with sdpa (paired, one process).

SmolLM2-135M's architecture (random weights, float32), 8 sequences of 128 to
512 tokens (lengths varying 4:1): one forward and backward of the causal
language-model loss, either

* packed: the 8 sequences concatenated into one row, ``position_ids``
  restarting per sequence, ``attn_implementation="attn/flash"`` (transformers
  passes ``cu_seqlens`` to attn.flash's varlen function and its backward; no
  L x S mask), or
* padded: a [8, 512] batch with an attention mask, ``attn_implementation="sdpa"``.

Needs the kernels route of attn.integrations.transformers.register_flash
(requirements/serving.txt). Prints the paired ratio packed / padded (below 1:
packed faster) with the CPU it ran on:

    python -m attn.apps.bench.packed_training
"""

import platform

import numpy as np


def _cpu():
    import attn

    name, family, model = platform.processor(), "?", "?"
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        name = info.get("model name\t", name).strip()
        family, model = info.get("cpu family\t", "?").strip(), info.get("model\t\t", "?").strip()
    except OSError:
        pass
    return f"{name} (family {family} model {model}), {attn.backends()['simd']} SIMD path"


def main():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import attn.integrations.transformers as attn_hf
    from attn.apps.bench._paired import paired_ratio

    name = attn_hf.register_flash()
    cfg = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                               max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    padded_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    packed_model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    packed_model.load_state_dict(padded_model.state_dict())
    lengths = np.linspace(128, 512, 8).astype(int)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (int(n),), generator=gen) for n in lengths]

    L = int(lengths.max())
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)], labels[i, :len(s)] = s, 1, s
    packed_ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    packed_labels = torch.cat([torch.cat([s[:1] * 0 - 100, s[1:]]) for s in seqs])[None]  # no label across a boundary

    def padded_step():
        padded_model.zero_grad(set_to_none=True)
        padded_model(ids, attention_mask=mask, labels=labels).loss.backward()

    def packed_step():
        packed_model.zero_grad(set_to_none=True)
        packed_model(packed_ids, position_ids=position_ids, labels=packed_labels).loss.backward()

    r = paired_ratio(padded_step, packed_step, blocks=5)
    print(f"CPU: {_cpu()}, {torch.get_num_threads()} torch threads")
    print(f"packed training step, 8 sequences {lengths.min()}..{lengths.max()} tokens, SmolLM2-135M shape "
          f"float32: attn packed {r['b'] * 1e3:.0f} ms, sdpa padded {r['a'] * 1e3:.0f} ms: "
          f"{r['ratio']:.3f}x (middle half {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})")


if __name__ == "__main__":
    main()
