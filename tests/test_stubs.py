"""The compiled modules' type stubs (.pyi) declare every function their .pyx defines."""

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "attn"


@pytest.mark.parametrize("module", ["_problem", "_kernels", "_kernels_backward", "_casts", "_cache_write", "_fast_path", "_blas_callback",
                                    "_kernels_testing", "apps/bench/_yardsticks"])
def test_stub_declares_every_python_level_function(module):
    pyx = (PKG / f"{module}.pyx").read_text(encoding="utf-8")
    defined = set(re.findall(r"^def (\w+)\(", pyx, re.M))  # module-level def: callable from Python
    stub = ast.parse((PKG / f"{module}.pyi").read_text(encoding="utf-8"))
    declared = {n.name for n in stub.body if isinstance(n, ast.FunctionDef)}
    assert defined, f"no def found in {module}.pyx"
    assert defined == declared, (f"{module}.pyi: missing {sorted(defined - declared)}, "
                                 f"not in the .pyx {sorted(declared - defined)}")
