"""``python -m attn demo NAME [--plot FILE.png]`` run in a subprocess, for every demo."""

import importlib.util
import subprocess

import pytest

from conftest import attn_command
from test_demos import SEED_TABLE

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args, without=None):
    return subprocess.run(attn_command(*args, without=without), capture_output=True, text=True, timeout=300)


EXPECTED = {
    "scaling": [f"dot std={std:>6}" for std, *_ in SEED_TABLE.values()]
    + [f"max weight unscaled={m}" for _, m, *_ in SEED_TABLE.values()],
    "masks": ["row 2 attends to positions [0, 1, 2] (3 weights > 0)", "does NOT reproduce",
              "raised: nothing", "attn warned: UserWarning: attn_mask is strictly upper triangular"],
    "pitfalls": ["ValueError: matmul: Input operand 1 has a mismatch",
                 "RuntimeError: mat1 and mat2 shapes cannot be multiplied (5x4 and 5x4)",
                 "ValueError: attn_mask and is_causal=True are mutually exclusive", "e/e = nan",
                 "axis=-1 row sums: [1.000000 1.000000 1.000000 1.000000 1.000000]"],
    "parity": ["vs nn.MultiheadAttention", "  cython "],
    "loop-vs-matmul": ["T=128, E=64", "per-row loop", "faster than the loop", "max |loop - matrix|"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_demo_runs(name):
    proc = cli("demo", name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no stray warnings
    for text in EXPECTED[name]:
        assert text in proc.stdout


def test_help_lists_every_demo():
    proc = cli("demo", "--help")
    assert proc.returncode == 0
    for name in EXPECTED:
        assert f"\n  {name} " in proc.stdout


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the 'plot' extra) is not installed")
@pytest.mark.parametrize("name", ["scaling", "masks"])
def test_demo_plot(name, tmp_path):
    path = tmp_path / f"{name}.png"
    proc = cli("demo", name, "--plot", str(path))
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {path}" in proc.stdout
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["scaling", "masks"])
def test_plot_without_matplotlib_prints_results_and_how_to_install(name, tmp_path):
    path = tmp_path / "x.png"
    proc = cli("demo", name, "--plot", str(path), without=["matplotlib"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[-1] == (
        'no plot written: --plot needs matplotlib (pip install matplotlib, or from a clone pip install ".[plot]")')
    assert EXPECTED[name][0] in proc.stdout  # the results are still printed
    assert not path.exists()


def test_plot_refused_for_demos_without_a_figure(tmp_path):
    proc = cli("demo", "parity", "--plot", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "--plot is available for scaling, masks, train, not parity" in proc.stderr


def test_without_torch():
    proc = cli("demo", "parity", without=["torch"])
    assert proc.returncode == 1
    assert proc.stdout.strip() == "parity: needs PyTorch, which is not installed: pip install torch (CPU build: see README)"
    proc = cli("demo", "masks", without=["torch"])
    assert proc.returncode == 0
    assert "torch is not installed: its side of the comparison is skipped" in proc.stdout
    proc = cli("demo", "pitfalls", without=["torch"])
    assert proc.returncode == 0 and "(torch is not installed: skipped)" in proc.stdout
    proc = cli("demo", "backward", without=["torch"])
    assert proc.returncode == 0 and "vs torch.autograd: torch is not installed" in proc.stdout
    assert "vs central finite differences" in proc.stdout
    proc = cli("demo", "train", without=["torch"])
    assert proc.returncode == 1 and proc.stdout.startswith("train: needs PyTorch")
