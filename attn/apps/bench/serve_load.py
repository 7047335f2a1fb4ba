"""Load test of ``python -m attn serve``: concurrent streaming clients against the attn and the sdpa server.

    python -m attn.apps.bench.serve_load                 # 8 clients, 64 tokens each, attn then sdpa
    python -m attn.apps.bench.serve_load --clients 4 --max-tokens 32
    python -m attn.apps.bench.serve_load --context 1000  # each prompt after ~1000 tokens of notes
    python -m attn.apps.bench.serve_load --engine vllm --context 2000   # vLLM's server: attn vs CPU_ATTN

``--engine vllm`` (from vLLM's environment, docs/vllm.md) compares ``python -m attn
serve --engine vllm`` with attn as vLLM's attention (``ATTN_VLLM=1``, checked in the
server's log) against the same server with vLLM's own ``CPU_ATTN`` kernel, ``--dtype``
(bfloat16), ``--repeats`` paired rounds (3), the two alternating, each a fresh server
(whose first round is the untimed one below); it prints each round and the medians
of the paired ratios: throughput attn / vLLM and median first-token latency attn /
vLLM. vLLM caches prefixes: the warm-up prompts share none with the timed ones.

Run by hand, on a quiet machine (nothing else running: the two servers are
measured one after the other, so anything else that runs in between moves
the ratio). Needs what ``python -m attn serve`` needs (requirements/serving.txt)
and the ``openai`` client.

For each attention it starts the server (``ServerProcess``: a child process
on a free port of 127.0.0.1), sends one untimed round of requests like the
timed ones but with other prompts (it allocates what a batch of that size
needs; other prompts, so that transformers' prefix cache holds none of the
timed round's), then the timed round: ``--clients`` threads, each one streaming greedy chat completion of
``--max-tokens`` tokens with its own prompt, all sent at once. Printed per
server: the tokens generated (the server's ``usage``), the round's wall
time from the first request sent to the last token received, throughput
(tokens / wall time), and the median and maximum first-token latency (from
a client's request to its first streamed text); then the throughput ratio
and whether both servers wrote the same text. ``--context N`` puts about N
tokens of numbered notes (different for each client) before each question,
so that attention has long keys to read; the KV cache is sized for it.
"""

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holidays.",
    "Explain why the sky is blue.",
    "Describe the city of Paris to a child.",
    "Write a poem about the sea.",
    "Explain how bread is made.",
]


WORDS = ("red", "river", "stone", "window", "garden", "bird", "music", "winter", "bread", "lamp", "road", "cloud")


def notes(n_tokens, seed):
    """About ``n_tokens`` tokens of numbered notes, different for each seed."""
    state, lines = seed * 7919 + 1, []
    for i in range(max(0, n_tokens) // 15):  # a note is about 15 tokens
        state = (state * 1103515245 + 12345) % 2 ** 31
        a, b, c = (WORDS[(state >> k) % len(WORDS)] for k in (3, 9, 15))
        lines.append(f"Note {i + 1}: the {a} {b} is next to the {c}.")
    return ("Here are my notes.\n" + "\n".join(lines) + "\n\n") if lines else ""


def one_client(client, model, prompt, max_tokens, start, extra=None):
    """Stream one greedy completion; return (text, (prompt tokens, tokens), first-token latency, end, start)."""
    start.wait()
    t0 = time.perf_counter()
    first, chunks, tokens = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                **(extra or {})):
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter() - t0
                chunks.append(choice.delta.content)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    return "".join(chunks), tokens, first, time.perf_counter(), t0


def prompts(n_clients, context, warm_up=False):
    """Client i's message: about ``context`` tokens of notes, then a question. The warm-up round's
    messages start otherwise (and have other notes), so the timed round shares no cached prefix with it."""
    if warm_up:
        return [f"First, something else. {notes(context, 1000 + i)}{PROMPTS[(i + 3) % len(PROMPTS)]}"
                for i in range(n_clients)]
    return [notes(context, i) + PROMPTS[i % len(PROMPTS)] for i in range(n_clients)]


def run_round(server, messages, max_tokens, extra=None):
    """All clients at once, one per message (``extra``: more arguments of each request); return
    (texts, mean prompt tokens, total tokens, wall seconds, first-token latencies)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    n_clients = len(messages)
    start = threading.Barrier(n_clients)
    with ThreadPoolExecutor(n_clients) as pool:
        results = list(pool.map(lambda p: one_client(client, server.model, p, max_tokens, start, extra), messages))
    texts, tokens, firsts, ends, starts = zip(*results)
    if any(t is None for t in tokens):
        raise RuntimeError("the server's last streamed chunk carried no usage (completion_tokens)")
    return (list(texts), statistics.mean(p for p, _ in tokens), sum(n for _, n in tokens),
            max(ends) - min(starts), list(firsts))


def measure(implementation, args):
    from ..serving import DEFAULT_NUM_BLOCKS
    from ..serving._process import ServerProcess

    # the cache holds every client's prompt and answer (blocks of 256 tokens), with room to spare
    blocks = max(DEFAULT_NUM_BLOCKS, -(-args.clients * (args.context + args.max_tokens + 200) // 256) + 8)
    extra = ["--num-blocks", str(blocks)]
    extra += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    extra += ["--model", args.model] if args.model else []
    with ServerProcess("--attn-implementation", implementation, *extra) as server:
        run_round(server, prompts(args.clients, args.context, warm_up=True), args.max_tokens)  # untimed
        return run_round(server, prompts(args.clients, args.context), args.max_tokens)


def measure_vllm(implementation, args, env):
    """One fresh ``python -m attn serve --engine vllm`` server: (texts, mean prompt tokens, total tokens,
    wall seconds, first-token latencies) of its timed round, after the untimed one. ``env``'s PYTHONPATH
    (the plugin's metadata, from a source tree) goes before attn's own directory."""
    import os
    import tempfile

    from ..serving._process import ServerProcess

    max_len = max(2048, args.context + args.max_tokens + 512)
    extra = ["--engine", "vllm", "--attn-implementation", implementation, "--dtype", args.dtype,
             "--max-model-len", str(max_len)]
    extra += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    extra += ["--model", args.model] if args.model else []
    # (cwd: a directory of no package, so that a source tree's attn.egg-info does not shadow the plugin's metadata)
    env = dict(env)
    front = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    with ServerProcess(*extra, env=env, python_path=front, cwd=tempfile.gettempdir()) as server:
        announced = "computes vLLM's CPU attention (ATTN_VLLM=1)" in server.log()
        if announced != (implementation == "attn/flash"):
            raise SystemExit(f"the {implementation} server ran the other attention:\n{server.log()[-3000:]}")
        usage = {"stream_options": {"include_usage": True}}   # (vLLM streams the usage only when asked)
        run_round(server, prompts(args.clients, args.context, warm_up=True), args.max_tokens, usage)  # untimed
        return run_round(server, prompts(args.clients, args.context), args.max_tokens, usage)


def main_vllm(args):
    """--engine vllm: paired rounds of attn and vLLM's own attention, alternating; the medians of the ratios."""
    import os

    import attn

    from ._common import cpu_description
    from .vllm_e2e import _plugin_env
    from ..models.gguf import MODEL_FILE
    from ..serving._vllm import vllm_problem, vllm_version

    problem = vllm_problem()
    if problem:
        raise SystemExit(problem)
    env = dict(_plugin_env(), VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
    model = args.model.rstrip("/").rsplit("/", 1)[-1] if args.model else MODEL_FILE
    print(f"{args.clients} concurrent streaming clients, {args.max_tokens} tokens each (greedy) after about "
          f"{args.context} tokens of notes, {model} {args.dtype}, vLLM {vllm_version()}'s OpenAI server (python -m "
          f"attn serve --engine vllm), {args.repeats} paired rounds, attn {attn.__version__}")
    print(f"CPU: {cpu_description(attn.backends()['simd'])}; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'round':<7}{'attention':<12}{'prompt':>8}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}"
          f"{'first token median (s)':>24}{'max (s)':>9}", flush=True)
    names = {"attn/flash": "attn", "CPU_ATTN": "vLLM's own"}
    ratios, firsts_ratio, same = [], [], []
    for r in range(args.repeats):
        order = ("attn/flash", "CPU_ATTN") if r % 2 == 0 else ("CPU_ATTN", "attn/flash")
        got = {}
        for implementation in order:
            got[implementation] = measure_vllm(implementation, args, env)
            _, prompt, tokens, wall, firsts = got[implementation]
            print(f"{r + 1:<7}{names[implementation]:<12}{prompt:>8.0f}{tokens:>8}{wall:>9.2f}{tokens / wall:>10.1f}"
                  f"{statistics.median(firsts):>24.2f}{max(firsts):>9.2f}", flush=True)
        (ta, _, na, wa, fa), (tv, _, nv, wv, fv) = got["attn/flash"], got["CPU_ATTN"]
        ratios.append((na / wa) / (nv / wv))
        firsts_ratio.append(statistics.median(fa) / statistics.median(fv))
        same.append(sum(a == b for a, b in zip(ta, tv)))
    print(f"throughput attn / vLLM's own: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}); median first-token latency attn / vLLM's own: median "
          f"{statistics.median(firsts_ratio):.3f} ({min(firsts_ratio):.3f}-{max(firsts_ratio):.3f}); "
          f"answers with the same text: {', '.join(f'{n} of {args.clients}' for n in same)}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attn.apps.bench.serve_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, metavar="N", help="concurrent streaming clients (8)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (64)")
    parser.add_argument("--context", type=int, default=0, metavar="N",
                        help="about N tokens of notes before each question (0)")
    parser.add_argument("--model", help="passed to python -m attn serve (default: its default, SmolLM2-135M)")
    parser.add_argument("--cache-dir", help="passed to python -m attn serve")
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                        help="the server's engine: transformers (attn/flash vs sdpa) or vllm (attn vs CPU_ATTN)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--engine vllm: the "
                        "model's dtype (bfloat16)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="--engine vllm: paired rounds, each a fresh server per attention (3)")
    parser.add_argument("--kv-gib", type=int, default=2, metavar="N",
                        help="--engine vllm: VLLM_CPU_KVCACHE_SPACE of each server, GiB (2)")
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        return main_vllm(args)

    import transformers

    import attn

    from ._common import cpu_description
    from ..models.gguf import MODEL_FILE

    model = args.model.rstrip("/").rsplit("/", 1)[-1] if args.model else MODEL_FILE
    context = f" --context {args.context}" if args.context else ""
    print(f"python -m attn.apps.bench.serve_load --clients {args.clients} --max-tokens {args.max_tokens}{context}")
    print(f"{args.clients} concurrent streaming clients, {args.max_tokens} tokens each (greedy), {model}, "
          f"transformers {transformers.__version__} serve with continuous batching, attn {attn.__version__}")
    print(f"CPU: {cpu_description(attn.backends()['simd'])}")
    results = {}
    for implementation in ("attn/flash", "sdpa"):
        results[implementation] = measure(implementation, args)
    print("prompt: tokens per client (mean); tokens: generated, all clients")
    print(f"{'attention':<12}{'prompt':>8}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}"
          f"{'first token median (s)':>24}{'max (s)':>9}")
    for implementation, (_, prompt, tokens, wall, firsts) in results.items():
        print(f"{implementation:<12}{prompt:>8.0f}{tokens:>8}{wall:>9.2f}{tokens / wall:>10.1f}"
              f"{statistics.median(firsts):>24.2f}{max(firsts):>9.2f}")
    (t_attn, _, n_attn, w_attn, _), (t_sdpa, _, n_sdpa, w_sdpa, _) = results["attn/flash"], results["sdpa"]
    print(f"throughput attn/flash / sdpa: {(n_attn / w_attn) / (n_sdpa / w_sdpa):.2f}x; "
          f"same text from both servers: {'yes' if t_attn == t_sdpa else 'no'} "
          f"({sum(a == b for a, b in zip(t_attn, t_sdpa))} of {len(t_attn)} answers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
