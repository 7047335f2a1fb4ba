"""Command line: ``python -m attn COMMAND ...``; alone, it lists the commands.

``demo NAME [--plot FILE.png] [--nproc N]``
    runs one of the seed article's experiments (:mod:`attn.apps.demos`) and prints
    its report; ``--plot`` also draws it (``scaling`` and ``masks``);
    ``--nproc``: the number of processes of ``ring``.
``bench [--quick | --full] [--backends ...] [--json FILE] [--plot FILE.png]``
    runs the benchmark suite (:mod:`attn.apps.bench`, needs the ``bench`` extra).
``generate "prompt" [--max-new-tokens N] [--temperature T] [--gguf PATH]``
    chats with SmolLM2-135M-Instruct written in NumPy on attn
    (:mod:`attn.apps.models`, needs the ``models`` extra and the model wheel).
``serve [--engine transformers|vllm] [--port N] [--model MODEL] [--attn-implementation ...]``
    runs an OpenAI-compatible server with attn as its attention, on 127.0.0.1
    (:mod:`attn.apps.serving`): transformers' (continuous batching on; needs the
    ``serving`` extra: requirements/serving.txt), or with ``--engine vllm``
    vLLM's, attn as its CPU attention (from vLLM's environment: docs/vllm.md).

All the work is in those packages, the applications built on the library (:mod:`attn.apps`);
this module only parses arguments and formats.
"""

import argparse
import sys

from . import __version__
from .apps import demos
from .apps import serving as serve_cli
from .apps.bench import _cli as bench_cli
from .apps.demos import plots
from .apps.models import generate as generate_cli

TORCH_HINT = "needs PyTorch, which is not installed: pip install torch (CPU build: see README)"


def _demo_list():
    width = max(map(len, demos.DEMOS))
    return "\n".join(f"  {d.name:<{width}}  {d.summary}" for d in demos.DEMOS.values())


def build_parser():
    """The ``attn`` argument parser (``demo``, ``bench``, ``generate`` and ``serve`` subcommands)."""
    parser = argparse.ArgumentParser(
        prog="python -m attn",
        description="attn: scaled dot-product attention for the CPU, held to PyTorch.",
        epilog="`python -m attn COMMAND --help` describes a command's options.")
    parser.add_argument("--version", action="version", version=f"attn {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="reproduce one of the seed article's experiments",
        description="Reproduce one of the seed article's experiments.",
        epilog="demos:\n" + _demo_list(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("name", choices=list(demos.DEMOS), metavar="NAME", help="one of the demos below")
    with_plot = ", ".join(d.name for d in demos.DEMOS.values() if d.plot)
    demo.add_argument("--plot", metavar="FILE.png", help=f"also draw the figure ({with_plot}); needs matplotlib")
    with_nproc = ", ".join(d.name for d in demos.DEMOS.values() if d.nproc)
    demo.add_argument("--nproc", type=int, metavar="N", help=f"processes (ranks) of {with_nproc} (default 4)")
    parser.demo_parser = demo  # for errors about demo arguments
    bench_cli.add_parser(sub)
    generate_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    return parser


def _draw(demo, result, path):
    """Write the figure; return the exit status.

    Without matplotlib the results are already printed: say in one line how to get
    the figure and return 0 (the command did what it could; the plot is an extra).
    """
    try:
        getattr(plots, demo.plot)(result, path)
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("matplotlib"):
            raise
        print(plots.INSTALL_HINT)
        return 0
    print(f"plot written to {path}")
    return 0


def run_demo(name, plot=None, nproc=None):
    """Run demo ``name``, print its report, draw it if asked; return the exit status."""
    demo = demos.DEMOS[name]
    try:
        result = demo.run() if nproc is None else demo.run(nproc=nproc)
    except ImportError as exc:
        if not (demo.needs_torch and exc.name == "torch"):
            raise
        print(f"{name}: {TORCH_HINT}")
        return 1
    print(demo.report(result))
    return _draw(demo, result, plot) if plot else 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `python -m attn`: say what there is
        parser.print_help()
        return 0
    if args.command == "bench":
        return bench_cli.run(args)
    if args.command == "generate":
        return generate_cli.run(args)
    if args.command == "serve":
        return serve_cli.run(args)
    if args.plot and not demos.DEMOS[args.name].plot:
        with_plot = ", ".join(d.name for d in demos.DEMOS.values() if d.plot)
        parser.demo_parser.error(f"--plot is available for {with_plot}, not {args.name}")
    if args.nproc is not None and not demos.DEMOS[args.name].nproc:
        with_nproc = ", ".join(d.name for d in demos.DEMOS.values() if d.nproc)
        parser.demo_parser.error(f"--nproc is available for {with_nproc}, not {args.name}")
    if args.nproc is not None and args.nproc < 1:
        parser.demo_parser.error(f"--nproc must be at least 1, got {args.nproc}")
    return run_demo(args.name, args.plot, args.nproc)


if __name__ == "__main__":
    sys.exit(main())
