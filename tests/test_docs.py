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
