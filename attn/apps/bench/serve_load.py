"""Load test of ``python -m attn serve``: concurrent streaming clients against the attn and the sdpa server.

    python -m attn.apps.bench.serve_load                 # 8 clients, 64 tokens each, attn then sdpa
    python -m attn.apps.bench.serve_load --clients 4 --max-tokens 32
    python -m attn.apps.bench.serve_load --context 1000  # each prompt after ~1000 tokens of notes

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


def one_client(client, model, prompt, max_tokens, start):
    """Stream one greedy completion; return (text, (prompt tokens, tokens), first-token latency, end, start)."""
    start.wait()
    t0 = time.perf_counter()
    first, chunks, tokens = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True):
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


def run_round(server, messages, max_tokens):
    """All clients at once, one per message; return
    (texts, mean prompt tokens, total tokens, wall seconds, first-token latencies)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
    n_clients = len(messages)
    start = threading.Barrier(n_clients)
    with ThreadPoolExecutor(n_clients) as pool:
        results = list(pool.map(lambda p: one_client(client, server.model, p, max_tokens, start), messages))
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attn.apps.bench.serve_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, metavar="N", help="concurrent streaming clients (8)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (64)")
    parser.add_argument("--context", type=int, default=0, metavar="N",
                        help="about N tokens of notes before each question (0)")
    parser.add_argument("--model", help="passed to python -m attn serve (default: its default, SmolLM2-135M)")
    parser.add_argument("--cache-dir", help="passed to python -m attn serve")
    args = parser.parse_args(argv)

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
