"""Every ```python block of README.md runs on its own, in a fresh interpreter.

A block may use only what it imports itself (no names from an earlier block). A block
that imports a module which is not installed is skipped, naming the module.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text):
    """``[(line number of the opening fence, code)]`` of the ```python blocks of ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in FENCE.finditer(text)]


def imported_modules(code):
    """Top-level names of the modules ``code`` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3  # Quick start, decoding, gradients: the parser finds them


def test_block_finder_on_a_known_text():
    text = "intro\n```python\nx = 1\n```\n\n```\nshell\n```\n```python\nimport numpy as np\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (9, "import numpy as np\n")]
    assert imported_modules("import numpy as np, attn\nfrom torch.nn import functional") == {"numpy", "attn", "torch"}


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs_alone(line, code, tmp_path):
    missing = sorted(m for m in imported_modules(code) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"README.md:{line} needs {', '.join(missing)}, which is not installed")
    # a fresh interpreter in an empty directory: only what the block defines and imports;
    # attn is the one this test session imports (an editable install or the clone on the path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README.md:{line} failed:\n{proc.stderr[-3000:]}"
