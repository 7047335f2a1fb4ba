"""README.md and docs/*.md: generated blocks and links are consistent (no runs, no timings)."""

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_marker_has_a_block_and_every_block_a_marker(regenerate):
    where = regenerate.check_markers(regenerate.markdown_files())  # SystemExit on a mismatch
    assert set(where) == set(regenerate.BLOCKS)


def test_a_block_is_replaced_between_its_markers_only(regenerate, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- BEGIN generated:demo-help -->\nold\n<!-- END generated:demo-help -->\nafter\n")

    class FakeRuns:
        pass

    block = regenerate.BLOCKS["demo-help"]
    regenerate.BLOCKS["demo-help"] = regenerate.Block("demos", lambda runs: "new\n")
    try:
        changed = regenerate.rewrite([page], {"demo-help"}, FakeRuns())
    finally:
        regenerate.BLOCKS["demo-help"] = block
    assert changed == [page]
    assert page.read_text() == "before\n<!-- BEGIN generated:demo-help -->\nnew\n<!-- END generated:demo-help -->\nafter\n"


def test_relative_links_point_at_files(regenerate):
    missing = []
    for path in regenerate.markdown_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" not in target and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing


class _Runs:
    """Stands in for regenerate.Runs: a fixed machine and one fake benchmark run."""

    quick = False

    def __init__(self, data):
        self.data = data

    def machine(self):
        return {"cpu": "AMD EPYC (family 25 model 17)", "cores": 2, "python": "3.11.7", "numpy": "2.4.6",
                "torch": "2.13.0+cpu", "attn": "0.1.0", "simd": "avx512", "threads": 2}

    def bench(self, grid):
        return self.data


def test_stamp_names_the_cpu_the_simd_path_and_the_cores(regenerate):
    line = regenerate.stamp(_Runs({}), "demos")
    assert " on AMD EPYC (family 25 model 17), avx512 SIMD path, 2 cores; " in line


def test_cpu_model_has_the_family_where_proc_cpuinfo_has_it(regenerate):
    name = regenerate._cpu_model()
    if pathlib.Path("/proc/cpuinfo").exists() and "cpu family" in pathlib.Path("/proc/cpuinfo").read_text():
        assert re.search(r" \(family \d+ model \d+\)$", name), name


def test_readme_performance_prints_percent_of_the_runs_gemm(regenerate):
    group = "B=1 H=8 T=1024 E=64 f32 dense"
    gemm = {"gflops": 200.0, "n": 1024, "dtype": "f32", "by": "torch.matmul"}
    bench = [{"group": group, "stats": {"median": m},
              "extra_info": {"backend": b, "gflops": g, "pct_gemm": 100 * g / 200.0 if g else None}}
             for b, m, g in (("torch", 10e-3, None), ("cython", 5e-3, 420.0), ("numpy", 30e-3, None))]
    data = {"benchmarks": bench, "_seconds": 61, "_command": "python -m attn bench --full",
            "attn": {"paired": {group: {"ratio": 0.46, "ratio_q1": 0.45, "ratio_q3": 0.47}},
                     "gemm": {"f32 n=1024": gemm}}}
    text = regenerate.readme_performance(_Runs(data))
    assert "cython GFLOP/s (% of GEMM)" in text and "peak" not in text
    assert f"| {group} | 10 ms | 5 ms | 30 ms | 0.46 (0.45–0.47) | 420 (210 %: faster than the GEMM) |" in text
    assert "f32 n=1024 torch.matmul 200 GFLOP/s" in text


def test_readme_stays_short():
    """The README is the short way in (at most 300 lines); the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"
