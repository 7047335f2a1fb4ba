"""The benchmark suite: attn's loop, NumPy and fused (Cython) forms against PyTorch.

One implementation, two entry points:

* ``python -m attn bench [--quick | --full] ...`` (users, from any directory,
  after ``pip install ".[bench]"`` in a clone): runs this directory's ``test_bench_*.py``
  files through pytest with :mod:`attn.apps.bench.plugin`, a progress line and a
  summary table; see :mod:`attn.apps.bench._cli`.
* ``python -m pytest bench ...`` (developers, from a clone's root): the
  repository's ``bench/conftest.py`` loads the same plugin and points pytest
  at this directory.

Layout (a new group file drops in: name it ``test_bench_<what>.py``, use
pytest-benchmark's ``benchmark`` fixture and set ``benchmark.group``; the
plugin's fixtures ``bench_settings``, ``bench_env``, ``bench_results`` are
there if it needs them; mark it ``pytest.mark.bench_grids("quick", ...)`` to
choose the grids it runs in, the default being ``default`` and ``full``):

``plugin.py``
    pytest plugin: the ``--bench-*`` options, settings, parametrization,
    fixtures, progress line, summary, the JSON section.
``_common.py``
    the CPU's description, the GEMM yardstick, cases (groups), inputs, references, formatting.
``_paired.py``
    paired timing: two contenders in alternating blocks.
``_summary.py``
    the summary tables.
``_memprobe.py``
    peak memory of one call, run in a fresh process per measurement.
``plot.py``
    plot/tabulate a saved run (``python -m attn.apps.bench.plot FILE.json``).
``test_bench_*.py``
    the groups.

Importing this package imports neither pytest nor torch.
"""

import os

#: Directory holding the suite's test files (what pytest is pointed at).
SUITE_DIR = os.path.dirname(os.path.abspath(__file__))

#: The plugin module both entry points load.
PLUGIN = "attn.apps.bench.plugin"

#: How to get PyTorch for the torch column: on Linux a plain ``pip install torch``
#: fetches the multi-GB CUDA build; the CPU build comes from PyTorch's CPU wheel
#: index, named by what it is (as in the README), not by its address.
TORCH_CPU_COMMAND = "pip install torch --index-url <PyTorch's CPU wheel index>"
TORCH_CPU_WHERE = ("the --index-url that pytorch.org's install selector shows for Linux / Pip / CPU; "
                   "attn's README, Install")
