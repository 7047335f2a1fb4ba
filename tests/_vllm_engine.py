"""Runs vLLM engines for tests/test_vllm.py, one process per call (``python tests/_vllm_engine.py JOB OUT``).

JOB is a JSON file: ``{"runs": [run, ...]}``; each run starts one ``vllm.LLM``
(its engine core and worker are fresh processes, which read ``run["env"]``
and load vLLM's plugins anew), generates, writes its results and shuts the
engine down. A run:

* ``env``: environment variables set (value null: removed) over this process's own environment
  before the engine starts (a run does not see an earlier run's);
* ``llm``: keyword arguments of ``vllm.LLM`` (model, dtype, enforce_eager, ...);
* ``prompts``: lists of token ids;
* ``calls``: the ``generate`` calls, in order, each ``{"prompts": [index, ...],
  "sampling": {...}}`` (keyword arguments of ``vllm.SamplingParams``, greedy
  with the top-2 log-probabilities of each generated token by default). An
  earlier call's requests fill the prefix cache a later call's reuse (vLLM
  reads no cached prefix for a request that asks for ``prompt_logprobs``).

OUT gets ``{"results": [...]}``, per run either ``{"error": "..."}`` (the
engine did not start or generate: the exception's type and message) or
``{"calls": [[output, ...], ...]}``, each call's outputs in its prompts' order: ``prompt_logprobs``
(the log-probability of each prompt token after the first), ``tokens``
(generated), ``top2`` (per generated step, the two largest log-probabilities)
and ``num_cached_tokens``.
"""

import json
import os
import sys


def _prompt_logprobs(out):
    """Log-probabilities of the prompt's own tokens (vLLM's first entry is None)."""
    ids, lps = out.prompt_token_ids, out.prompt_logprobs
    return [lps[i][ids[i]].logprob for i in range(1, len(ids))]


def _record(out):
    comp = out.outputs[0]
    top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in comp.logprobs]
    return {
        "prompt_logprobs": _prompt_logprobs(out) if out.prompt_logprobs is not None else None,
        "tokens": list(comp.token_ids),
        "top2": top2,
        "num_cached_tokens": out.num_cached_tokens,
    }


_BASE_ENV = dict(os.environ)  # each run's environment: this one, then its ``env``


def run_one(run):
    """Start one engine, generate, return ``{"calls": [...]}`` or ``{"error": ...}``."""
    os.environ.clear()
    os.environ.update(_BASE_ENV)
    for name, value in run.get("env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(**run["llm"])
    except Exception as exc:  # the engine refused to start: what the test checks, in some runs
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in run["prompts"]]
        calls = []
        for call in run["calls"]:
            params = SamplingParams(**dict(dict(temperature=0.0, logprobs=2), **call.get("sampling", {})))
            outs = llm.generate([prompts[i] for i in call["prompts"]], params, use_tqdm=False)
            calls.append([_record(out) for out in outs])
        return {"calls": calls}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def main(job_path, out_path):
    with open(job_path) as f:
        job = json.load(f)
    results = []
    for run in job["runs"]:
        results.append(run_one(run))
        print(f"[_vllm_engine] run {len(results)}/{len(job['runs'])} done", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
