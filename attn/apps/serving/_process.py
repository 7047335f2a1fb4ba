"""``python -m attn serve`` as a child process, for the tests and the load benchmark.

>>> with ServerProcess("--attn-implementation", "sdpa") as server:   # doctest: +SKIP
...     client = openai.OpenAI(base_url=server.base_url, api_key="none")
...     client.chat.completions.create(model=server.model, messages=[...])
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import HOST, MODEL_LINE, PREFIX, READY


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """Start ``python -m attn serve --port <free> ARGS``; wait until it says it is ready; stop it with SIGTERM.

    Its output (its own lines, transformers' or vLLM's and uvicorn's logs) goes to a temporary file:
    :meth:`log`. ``model`` and ``base_url`` are what a client passes; ``returncode`` is set by :meth:`stop`.

    Parameters
    ----------
    *args : str, the command's options
    python : str, the interpreter
    ready_timeout : float, seconds
    env : mapping, optional, variables set over this process's environment
    python_path : sequence of str, directories put on PYTHONPATH before this attn's (e.g. package metadata)
    cwd : path, optional, the command's working directory
    """

    def __init__(self, *args, python=sys.executable, ready_timeout=600, env=None, python_path=(), cwd=None):
        self.args, self.python, self.ready_timeout = list(args), python, ready_timeout
        self.env, self.python_path, self.cwd = dict(env or {}), [str(p) for p in python_path], cwd
        self.port = self.model = self.returncode = self._proc = None

    @property
    def pid(self):
        return self._proc.pid

    @property
    def base_url(self):
        return f"http://{HOST}:{self.port}/v1"

    def log(self):
        return Path(self._log.name).read_text(errors="replace")

    def said(self, start):
        """The rest of each line the command printed itself (``attn serve: ...``) that begins with ``start``."""
        head = f"{PREFIX} {start}"
        return [line[len(head):] for line in self.log().splitlines() if line.startswith(head)]

    def start(self):
        import attn

        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="attn-serve-", suffix=".log", delete=False)
        env = dict(os.environ, **self.env)  # the child imports this attn, wherever it was imported from
        root = str(Path(attn.__file__).resolve().parents[1])
        paths = self.python_path + [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        self._proc = subprocess.Popen([self.python, "-m", "attn", "serve", "--port", str(self.port), *self.args],
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      cwd=self.cwd)
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.said(READY):
                self.model, = self.said(MODEL_LINE)
                return self
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                output = self.log()[-4000:]
                self._log.close()
                os.unlink(self._log.name)
                raise RuntimeError(f"python -m attn serve {' '.join(self.args)} did not become ready "
                                   f"(exit status {self._proc.returncode}); its output:\n{output}")
            time.sleep(0.2)

    def stop(self, timeout=30, signum=signal.SIGTERM):
        """Send ``signum``, then wait at most ``timeout`` s; return the exit status (None: it had to be killed)."""
        if self._proc is None or self._proc.poll() is not None:
            return self._proc.returncode if self._proc else None
        self._proc.send_signal(signum)
        try:
            self.returncode = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.returncode = None
        return self.returncode

    def kill(self):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self):
        self.stop()
        self._log.close()
        os.unlink(self._log.name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
