"""End-to-end speed of SmolLM2-135M on attn: prefill and decode tokens/s, and where the time goes.

Contenders (all float32, batch 1, greedy):

- ``hf-attn`` / ``hf-sdpa``: transformers' LlamaForCausalLM from the GGUF with
  ``attn_implementation="attn"`` (attn's kernel) or ``"sdpa"`` (torch's SDPA);
- ``np-cython`` / ``np-numpy``: :mod:`attn.apps.models.llama` (NumPy) with attn's
  cython or numpy backend for the attention.

Each run: a prefill of ``n_prompt`` token ids (one forward, last logits only),
then ``n_decode`` single-token steps through the KV cache. The time inside the
attention function (transformers' attention interface, or
:func:`attn.scaled_dot_product_attention` for the NumPy model) is accumulated
to give attention's share. :func:`paired` alternates two contenders run by run
(the machine's speed drifts) and reports medians of the per-pair ratios.

``python -m attn.apps.models.e2e --threads 1 --markdown docs/e2e.md --plot docs/img/e2e_tokens_per_s.png
--json docs/e2e.json`` regenerates the benchmark page (figures and plot) from a new run.
"""

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

import attn

from . import gguf as attn_gguf
from . import llama
from ._rounding import greedy_stats

CONTENDERS = ("hf-attn", "hf-sdpa", "np-cython", "np-numpy")
SEED = 20261130


class Timer:
    """Seconds accumulated inside the wrapped function."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def prompt_ids(n, vocab=49152):
    """``n`` fixed pseudo-random token ids (the speed does not depend on the text)."""
    return np.random.default_rng(SEED).integers(100, vocab, n)


# -------------------------------------------------------------------- the NumPy model


def _progress(line):
    print(line, file=sys.stderr, flush=True)


def load_numpy_model(path=None):
    config, weights, _ = attn_gguf.load(path, progress=_progress)
    return config, weights


def _greedy_step(logits, steps):
    """The greedy token of ``logits`` [n_vocab] (float32 NumPy), its top-2 gap and logit scale into ``steps``."""
    token, gap, scale = greedy_stats(logits)
    steps["tokens"].append(int(token))
    steps["gaps"].append(float(gap))
    steps["scales"].append(float(scale))
    return int(token)


def run_numpy(model, ids, n_decode, backend):
    """Prefill ``ids`` then decode ``n_decode`` tokens greedily.

    Returns
    -------
    dict
        Seconds: "prefill", "decode" and the attention's share of each ("prefill_attn",
        "decode_attn"); per decode step: "tokens", the top-2 logit "gaps" and the logit "scales".
    """
    config, weights = model
    timer = Timer(attn.scaled_dot_product_attention)
    caches = llama.new_caches(config, 1, len(ids) + n_decode + 1)
    steps = {"tokens": [], "gaps": [], "scales": []}
    with _patched(attn, "scaled_dot_product_attention", timer):  # llama.py calls attn.<name> at run time
        t0 = time.perf_counter()
        logits = llama.forward(np.asarray([ids]), weights, config, caches, last_only=True, backend=backend)
        prefill, prefill_attn = time.perf_counter() - t0, timer.seconds
        timer.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(n_decode):
            token = _greedy_step(logits[0, -1], steps)
            logits = llama.forward(np.asarray([[token]]), weights, config, caches, backend=backend)
        decode = time.perf_counter() - t0
    return {"prefill": prefill, "prefill_attn": prefill_attn, "decode": decode, "decode_attn": timer.seconds,
            **steps}


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# -------------------------------------------------------------------- transformers


def load_hf_model(path=None):
    """transformers' float32 model from the GGUF, with ``attn-timed`` and ``sdpa-timed`` registered."""
    import os

    import torch
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from attn.integrations import transformers as attn_hf

    path = attn_gguf.default_model_path() if path is None else path
    folder, name = os.path.split(path)
    _progress(f"loading {name} into transformers (dequantizing to float32)...")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.timers = {}
    for impl, fn in (("attn", attn_hf.attention_forward), ("sdpa", sdpa_attention_forward)):
        model.timers[impl] = Timer(fn)
        transformers.AttentionInterface.register(f"{impl}-timed", model.timers[impl])
        AttentionMaskInterface.register(f"{impl}-timed", sdpa_mask)
    return model


def run_hf(model, ids, n_decode, impl):
    """As :func:`run_numpy`, for transformers with ``attn_implementation=impl`` ("attn" or "sdpa")."""
    import torch
    from transformers import DynamicCache

    model.set_attn_implementation(f"{impl}-timed")
    timer = model.timers[impl]
    timer.seconds = 0.0
    cache = DynamicCache(config=model.config)
    steps = {"tokens": [], "gaps": [], "scales": []}
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(torch.as_tensor(ids)[None], cache=cache, use_cache=True, logits_to_keep=1).logits
        prefill, prefill_attn = time.perf_counter() - t0, timer.seconds
        timer.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(n_decode):
            token = _greedy_step(logits[0, -1].numpy(), steps)
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits
        decode = time.perf_counter() - t0
    return {"prefill": prefill, "prefill_attn": prefill_attn, "decode": decode, "decode_attn": timer.seconds,
            **steps}


# -------------------------------------------------------------------- measurements


def runner(name, hf_model=None, np_model=None):
    """A function (ids, n_decode) -> seconds dict for contender ``name``."""
    kind, impl = name.split("-")
    if kind == "hf":
        return lambda ids, n: run_hf(hf_model, ids, n, impl)
    return lambda ids, n: run_numpy(np_model, ids, n, impl)


def paired(run_a, run_b, ids, n_decode, repeats=3, with_runs=False):
    """Alternate A and B ``repeats`` times (order flipping); medians and per-pair ratio medians.

    Returns
    -------
    dict: for "a" and "b" the median prefill/decode tokens/s and attention shares (with
    ``with_runs``, also the "runs" themselves: :func:`run_numpy`'s dicts, with the greedy tokens);
    "prefill_ratio" and "decode_ratio": median over pairs of tokens/s of A / tokens/s of B
    (time of B / time of A).
    """
    run_a(ids[:16], 2), run_b(ids[:16], 2)  # warm up (first-call costs, thread pools)
    res = {"a": [], "b": []}
    for i in range(repeats):
        order = (("a", run_a), ("b", run_b)) if i % 2 == 0 else (("b", run_b), ("a", run_a))
        for key, fn in order:
            time.sleep(0.2)
            res[key].append(fn(ids, n_decode))
    out = {key: dict(summarize(runs, len(ids), n_decode), **({"runs": runs} if with_runs else {}))
           for key, runs in res.items()}
    for phase in ("prefill", "decode"):
        out[f"{phase}_ratio"] = statistics.median(b[phase] / a[phase] for a, b in zip(res["a"], res["b"]))
    return out


def summarize(runs, n_prompt, n_decode):
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    return {"prefill_tok_s": n_prompt / med("prefill"), "decode_tok_s": n_decode / med("decode"),
            "prefill_attn_share": statistics.median(r["prefill_attn"] / r["prefill"] for r in runs),
            "decode_attn_share": statistics.median(r["decode_attn"] / r["decode"] for r in runs)}


def profile_numpy_decode(model, n_context=256, n_steps=32, backend="cython"):
    """Share of a NumPy-model decode step per part: attention kernel, attention projections and RoPE,
    SwiGLU feed-forward, RMSNorm, and the rest (embedding, logits matmul, Python)."""
    config, weights = model
    parts = {"attn.scaled_dot_product_attention": (attn, "scaled_dot_product_attention"),
             "attention (projections, RoPE, cache)": (llama, "attention"),
             "SwiGLU feed-forward": (llama, "swiglu"), "RMSNorm": (llama, "rms_norm")}
    timers = {k: Timer(getattr(obj, name)) for k, (obj, name) in parts.items()}
    caches = llama.new_caches(config, 1, n_context + n_steps)
    llama.forward(prompt_ids(n_context)[None], weights, config, caches, last_only=True, backend=backend)
    with contextlib.ExitStack() as stack:
        for k, (obj, name) in parts.items():
            stack.enter_context(_patched(obj, name, timers[k]))
        t0 = time.perf_counter()
        for i in range(n_steps):
            llama.forward(np.asarray([[100 + i]]), weights, config, caches, backend=backend)
        total = time.perf_counter() - t0
    shares = {k: t.seconds / total for k, t in timers.items()}
    # attn.scaled_dot_product_attention runs inside attention()
    shares["attention (projections, RoPE, cache)"] -= shares["attn.scaled_dot_product_attention"]
    shares["logits matmul, embedding, Python"] = 1 - sum(shares.values())
    return shares, n_steps / total


def sweep(contenders, lengths, n_decode_steps, hf_model=None, np_model=None, rounds=3, numpy_max_context=None):
    """tokens/s of prefill (at each prompt length) and of decode (at that context) per contender.

    At each length the contenders take turns ``rounds`` times (the order rotating), and each
    contender's median over its rounds is kept: a slow spell of the machine hits one round of
    every contender rather than all rounds of one. ``np-numpy`` (whose backend materialises each
    head's L x S weights: 2.4 GB a layer at 8,192 tokens, and a quadratic prefill) runs up to
    ``numpy_max_context`` only (None: everywhere).

    Returns
    -------
    (rows, ratios): a row per contender and length; per length, the median over rounds of
    transformers' attn / sdpa tokens/s (prefill and decode), the two taken in the same round.
    """
    rows, ratios = [], []
    for n in lengths:
        ids = prompt_ids(n)
        here = [c for c in contenders if c != "np-numpy" or numpy_max_context is None or n <= numpy_max_context]
        runs = {name: [] for name in here}
        for r in range(rounds):
            for name in here[r % len(here):] + here[:r % len(here)]:
                time.sleep(0.2)
                runs[name].append(runner(name, hf_model, np_model)(ids, n_decode_steps))
        for name in here:
            rows.append({"contender": name, "context": n,
                         "prefill_tok_s": n / statistics.median(x["prefill"] for x in runs[name]),
                         "decode_tok_s": n_decode_steps / statistics.median(x["decode"] for x in runs[name]),
                         "decode_steps": n_decode_steps})
            print(f"  {name:>9}  context {n:>4}: prefill {rows[-1]['prefill_tok_s']:8.1f} tok/s, "
                  f"decode {rows[-1]['decode_tok_s']:6.1f} tok/s", file=sys.stderr, flush=True)
        if "hf-attn" in runs and "hf-sdpa" in runs:
            ratios.append({"context": n, **{
                f"{phase}_ratio": statistics.median(s[phase] / a[phase] for a, s in zip(runs["hf-attn"], runs["hf-sdpa"]))
                for phase in ("prefill", "decode")}})
    return rows, ratios


def plot(rows, path):
    """Two panels: prefill and decode tokens/s against context length, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"),
                              ("prefill (prompt of N tokens)", "decode (one token after N)")):
        for name in dict.fromkeys(r["contender"] for r in rows):
            pts = [(r["context"], r[key]) for r in rows if r["contender"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", xlabel="context length N (tokens)", ylabel="tokens/s", title=title)
        ax.set_ylim(bottom=0)
        ax.set_xticks([r["context"] for r in rows if r["contender"] == rows[0]["contender"]])
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, float32, batch 1: transformers (attn vs sdpa) and the NumPy model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(pairs, shares, decode_rate, rows, plot_path, env, ratios=()):
    """The benchmark page (figures from this run only)."""
    lines = ["# End to end: SmolLM2-135M on attn", "",
             "Generated by `python -m attn.apps.models.e2e` (do not edit by hand); one run on: " + env, "",
             f"Prefill of {pairs['n_prompt']} tokens, then decode of {pairs['n_decode']} tokens, batch 1, "
             "float32, greedy. Each pair of contenders ran alternately "
             f"{pairs['repeats']} times; tokens/s are medians, the ratio is the median of the per-pair ratios. "
             "Attention share: time inside the attention function (transformers' attention interface, "
             "or attn.scaled_dot_product_attention for the NumPy model) over the phase's time.", "",
             "| contender | prefill tok/s | decode tok/s | attention share (prefill / decode) |",
             "|---|---:|---:|---:|"]
    for label, key, side in (("transformers + attn", "hf", "a"), ("transformers + sdpa", "hf", "b"),
                             ("NumPy model, cython backend", "np", "a"), ("NumPy model, numpy backend", "np", "b")):
        r = pairs[key][side]
        lines.append(f"| {label} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{100 * r['prefill_attn_share']:.1f}% / {100 * r['decode_attn_share']:.1f}% |")
    lines += ["", "Paired ratios (tokens/s of the first over the second):", "",
              f"- transformers, attn / sdpa: prefill {pairs['hf']['prefill_ratio']:.2f}x, "
              f"decode {pairs['hf']['decode_ratio']:.2f}x",
              f"- NumPy model, cython / numpy backend: prefill {pairs['np']['prefill_ratio']:.2f}x, "
              f"decode {pairs['np']['decode_ratio']:.2f}x", "",
              f"Where a NumPy-model decode step goes (context {shares['context']}, cython backend, "
              f"{decode_rate:.1f} tok/s while timed):", ""]
    lines += [f"- {k}: {100 * v:.1f}%" for k, v in shares["parts"].items()]
    lines += ["", "Against context length N: a prefill of N tokens, then "
              f"{env_sweep_steps(rows)} decode steps after it; at each N the contenders took turns "
              "(medians over the rounds)" + _numpy_cap_note(rows) + ".", "", f"![tokens/s against context length]({plot_path})", "",
              "| contender | context | prefill tok/s | decode tok/s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['contender']} | {r['context']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} |"
              for r in rows]
    if ratios:
        lines += ["", "transformers + attn over transformers + sdpa at each context length (tokens/s of attn / "
                  "tokens/s of sdpa, the two of one round paired, median over the rounds; above 1: attn is faster):",
                  "", "| context | prefill | decode |", "|---:|---:|---:|"]
        lines += [f"| {r['context']} | {r['prefill_ratio']:.2f}x | {r['decode_ratio']:.2f}x |" for r in ratios]
    return "\n".join(lines) + "\n"


def _numpy_cap_note(rows):
    """How far np-numpy ran, when it skipped the longest contexts."""
    mine = [r["context"] for r in rows if r["contender"] == "np-numpy"]
    longest = max((r["context"] for r in rows), default=0)
    if not mine or max(mine) >= longest:
        return ""
    return (f"; np-numpy up to N = {max(mine)} only (its backend materialises every head's N x N weights "
            f"and its prefill is quadratic in memory traffic)")


def env_sweep_steps(rows):
    return rows[0].get("decode_steps", "?") if rows else "?"


def environment():
    import os
    import platform

    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    parts = [f"{platform.machine()}, {os.cpu_count()} cores, attn threads: {attn.get_num_threads()}",
             f"numpy {np.__version__} (BLAS threads: {blas})"]
    with contextlib.suppress(ImportError):
        import torch
        import transformers

        parts += [f"torch {torch.__version__} (threads: {torch.get_num_threads()})",
                  f"transformers {transformers.__version__}"]
    return ", ".join(parts)


def _reexec_with_threads(n, argv):
    """Re-run this script with the thread-count variables set to ``n``; False if they already are."""
    import os
    import subprocess

    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    if all(os.environ.get(v) == str(n) for v in names):
        return False
    env = dict(os.environ, **{v: str(n) for v in names})
    sys.exit(subprocess.call([sys.executable, "-m", "attn.apps.models.e2e", *argv], env=env))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn.apps.models.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--markdown", metavar="FILE.md", help="write the benchmark page")
    p.add_argument("--plot", metavar="FILE.png", help="write the tokens/s vs context plot")
    p.add_argument("--json", metavar="FILE.json", help="write every measured figure")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192",
                   help="context lengths of the sweep (SmolLM2's limit: 8192)")
    p.add_argument("--numpy-max-context", type=int, default=2048,
                   help="the longest context np-numpy runs at (its L x S weights; 0: every length)")
    p.add_argument("--sweep-decode", type=int, default=8, help="decode steps timed at each context length")
    p.add_argument("--rounds", type=int, default=3, help="turns of every contender at each context length")
    p.add_argument("--threads", type=int, help="threads of torch, attn and NumPy's BLAS (re-runs the "
                   "script with OMP_NUM_THREADS and OPENBLAS_NUM_THREADS set, before NumPy loads its BLAS)")
    args = p.parse_args(argv)
    if args.threads and _reexec_with_threads(args.threads, sys.argv[1:] if argv is None else argv):
        return
    hf, npm = load_hf_model(), load_numpy_model()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        attn.set_num_threads(args.threads)
    ids = prompt_ids(args.prompt)
    pairs = {"n_prompt": args.prompt, "n_decode": args.decode, "repeats": args.repeats}
    for key, (a, b) in {"hf": ("hf-attn", "hf-sdpa"), "np": ("np-cython", "np-numpy")}.items():
        _progress(f"timing {a} vs {b}: prefill {args.prompt} + decode {args.decode} tokens, {args.repeats} pairs...")
        pairs[key] = paired(runner(a, hf, npm), runner(b, hf, npm), ids, args.decode, args.repeats)
        print(f"{a} vs {b}: {pairs[key]}", file=sys.stderr, flush=True)
    parts, rate = profile_numpy_decode(npm)
    shares = {"context": 256, "parts": parts}
    print(f"NumPy decode profile: {parts}", file=sys.stderr)
    _progress(f"sweeping context lengths {args.lengths}...")
    lengths = [int(n) for n in args.lengths.split(",")]
    limit = npm[0].n_ctx
    if limit and max(lengths) > limit:
        p.error(f"--lengths: {max(lengths)} is past the model's context length ({limit})")
    rows, ratios = sweep(CONTENDERS, lengths, args.sweep_decode, hf, npm, args.rounds, args.numpy_max_context or None)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "pairs": pairs, "decode_profile": shares,
                       "decode_profile_tok_s": rate, "sweep": rows, "sweep_ratios": ratios}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    if args.markdown:
        import os

        rel = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.markdown))) if args.plot else ""
        with open(args.markdown, "w") as f:
            f.write(markdown(pairs, shares, rate, rows, rel, environment(), ratios))
    print(markdown(pairs, shares, rate, rows, args.plot or "", environment(), ratios))


if __name__ == "__main__":
    main()
