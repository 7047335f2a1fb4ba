"""Decode speed of ``python -m attn generate`` at each context length, at the default settings and
at the alternatives a user could pick instead: does the default ever lose?

Each setting is a separate ``python -m attn generate`` process (the thread-count variables act when
a library loads): a prompt of ``N - new`` tokens (``--prompt-tokens``), then ``new`` tokens decoded
past the end-of-sequence token (``--ignore-eos``), so the decode runs at contexts up to N. The
figure is the decode tokens/s that ``generate`` prints. Settings:

- ``defaults``: nothing set;
- ``--backend numpy``: attn's NumPy backend for the decode's attention (its prompt through the
  cython backend, ``--prefill-backend cython``: the NumPy backend's quadratic prefill would take
  minutes at 8192 tokens and does not change the decode);
- ``OMP_NUM_THREADS=1`` (attn and OpenBLAS on one thread each) and ``OPENBLAS_NUM_THREADS=1``;
- ``ATTN_SHARE_BLAS_THREADS=0``: OpenBLAS on its own threads, as before attn shared its pool
  (:mod:`attn._blas_pool`).

The settings take turns ``rounds`` times at each length (the order rotating), and each setting's
median over its rounds is kept. ``python -m attn.apps.models.contexts`` prints the Markdown table.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

#: (label, extra environment, extra generate arguments)
SETTINGS = (
    ("defaults", {}, []),
    ("--backend numpy", {}, ["--backend", "numpy", "--prefill-backend", "cython"]),
    ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}, []),
    ("OPENBLAS_NUM_THREADS=1", {"OPENBLAS_NUM_THREADS": "1"}, []),
    ("ATTN_SHARE_BLAS_THREADS=0", {"ATTN_SHARE_BLAS_THREADS": "0"}, []),
)
#: The alternatives the defaults are held to (the last setting is attn's previous default).
ALTERNATIVES = ("--backend numpy", "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1")

#: Variables that change threads or their waiting: none of them is passed on to the runs.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS",
                    "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_THREAD_LIMIT",
                    "OPENBLAS_THREAD_TIMEOUT", "ATTN_SHARE_BLAS_THREADS")

PROMPT = "Tell me about the sea."
DECODE = re.compile(r"decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)")


def command(n_context, new_tokens, extra_args):
    """The ``generate`` command line of one run (a prompt of ``n_context - new_tokens`` tokens)."""
    return ["-m", "attn", "generate", PROMPT, "--prompt-tokens", str(n_context - new_tokens),
            "--max-new-tokens", str(new_tokens), "--ignore-eos", *extra_args]


def run_once(n_context, new_tokens, env_extra, extra_args):
    """Decode tokens/s of one ``generate`` process, as it printed them."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, *command(n_context, new_tokens, extra_args)], env=env,
                          capture_output=True, text=True)
    m = DECODE.search(proc.stderr)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"generate failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return float(m[3])


def sweep(lengths, new_tokens, rounds, log=None):
    """{(length, label): [tokens/s per round]}."""
    rates = {}
    for n in lengths:
        for r in range(rounds):
            order = SETTINGS[r % len(SETTINGS):] + SETTINGS[:r % len(SETTINGS)]
            for label, env_extra, extra_args in order:
                rate = run_once(n, new_tokens, env_extra, extra_args)
                rates.setdefault((n, label), []).append(rate)
                if log:
                    print(f"  context {n:>5}, round {r + 1}: {label:<26} {rate:6.1f} tokens/s", file=log,
                          flush=True)
    return rates


def table(rates, lengths, new_tokens, rounds, load):
    """The Markdown table: median decode tokens/s per setting, and defaults over the best alternative."""
    labels = [s[0] for s in SETTINGS]
    head = ("| context | " + " | ".join(f"`{x}`" if x.startswith("-") else x for x in labels)
            + " | defaults / best alternative |")
    lines = [f"Decode tokens/s of `python -m attn generate` (a prompt of N - {new_tokens} tokens, then "
             f"{new_tokens} new tokens: `python -m attn generate \"{PROMPT}\" --prompt-tokens N-{new_tokens} "
             f"--max-new-tokens {new_tokens} --ignore-eos`), median of {rounds} rounds in which the settings "
             f"took turns; load average {load[0]} at the start, {load[1]} at the end.", "",
             head, "|" + "---|" * (len(labels) + 2)]
    for n in lengths:
        med = {x: statistics.median(rates[(n, x)]) for x in labels}
        best = max(ALTERNATIVES, key=lambda x: med[x])
        cells = " | ".join(f"{med[x]:.1f}" for x in labels)
        lines.append(f"| {n} | {cells} | {med['defaults'] / med[best]:.2f} (vs {best}) |")
    lines += ["", "Every round's figures (tokens/s), in the table's column order:", ""]
    for n in lengths:
        lines.append(f"- {n}: " + "; ".join(
            f"{x} " + ", ".join(f"{v:.1f}" for v in rates[(n, x)]) for x in labels))
    return "\n".join(lines) + "\n"


def _load():
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m attn.apps.models.contexts", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,2048,4096,8192", help="context lengths N (at most the model's 8192)")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens decoded at each length (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="turns of every setting at each length (default 3)")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n <= args.new_tokens for n in lengths):
        p.error("every length must exceed --new-tokens")
    start = _load()
    rates = sweep(lengths, args.new_tokens, args.rounds, log=sys.stderr)
    print(table(rates, lengths, args.new_tokens, args.rounds, (start, _load())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
