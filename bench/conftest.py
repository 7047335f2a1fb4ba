"""Developers' entry to the benchmark suite: ``python -m pytest bench [options]``.

The suite lives in the package, ``attn/apps/bench/``, so that ``python -m attn bench``
runs it after a plain install; this file only loads its pytest plugin
(options: ``attn/apps/bench/plugin.py``) and points pytest there: the argument
``bench`` becomes ``attn/apps/bench``. Select groups with ``-k`` (``-k decode``,
``-k "T1024 and f32"``); a file of the suite directly:
``python -m pytest -p attn.apps.bench.plugin attn/apps/bench/test_bench_decode.py``.
Run from the clone's root with the extension built in place
(``python setup.py build_ext --inplace``) or an editable install.
"""

import os

import pytest

import attn.apps.bench

pytest_plugins = [attn.apps.bench.PLUGIN]

_HERE = os.path.dirname(os.path.abspath(__file__))


def _redirect(arg, invocation_dir):
    """``arg`` with a leading path inside this directory moved to the packaged suite."""
    path, sep, rest = arg.partition("::")
    full = os.path.abspath(os.path.join(invocation_dir, path))
    if os.path.commonpath([full, _HERE]) != _HERE:
        return arg  # not under bench/ (an option value or another path): unchanged
    rel = os.path.relpath(full, _HERE)
    target = attn.apps.bench.SUITE_DIR if rel == "." else os.path.join(attn.apps.bench.SUITE_DIR, rel)
    return target + sep + rest


def pytest_configure(config):
    stray = sorted(f for f in os.listdir(_HERE) if f.startswith("test_") and f.endswith(".py"))
    if stray:  # would silently never run: pytest is pointed at attn/apps/bench
        raise pytest.UsageError(
            f"bench/{', bench/'.join(stray)}: the suite's files live in attn/apps/bench/ (so that "
            "python -m attn bench runs them too); move them there and import the helpers as "
            "`from attn.apps.bench import _common as ab`, `from attn.apps.bench._paired import paired_ratio`")
    invocation_dir = str(config.invocation_params.dir)
    config.args[:] = [_redirect(a, invocation_dir) for a in config.args]
