"""pytest plugin of the attn benchmark suite (the ``test_bench_*.py`` files next to it).

Loaded by ``python -m attn bench`` (``-p attn.apps.bench.plugin``) and, in a clone,
by ``bench/conftest.py`` for ``python -m pytest bench``. Needs pytest-benchmark.

Options (each also settable through the environment variable named):

  --bench-grid quick|default|full  ATTN_BENCH_GRID   which groups (see _common.py)
  --bench-backends a,b,...    ATTN_BENCH_BACKENDS  subset of torch,cython,numpy,loop
  --bench-pause SECONDS       ATTN_BENCH_PAUSE     idle time before each benchmark (0.3)
  --bench-loop-max N          ATTN_BENCH_LOOP_MAX  run the loop backend only where
                                                   B*H*L*S <= N (2**24: T <= 1024 at H=8)
  --bench-threads N           ATTN_BENCH_THREADS   threads for torch and attn ($OMP_NUM_THREADS
                                                   or all cores)
  --bench-memory-large        ATTN_BENCH_MEMORY_LARGE=1  add the L=S=16384 memory case
                                                   (always on with the full grid)
  --bench-paired-budget SECONDS                    timed length of each paired measurement (4)
  --bench-ui                                       progress line instead of pytest's dots, no
                                                   pytest-benchmark tables, no per-group details
                                                   (what ``python -m attn bench`` shows)
  --bench-details                                  with --bench-ui: the per-group details too

pytest-benchmark's own --benchmark-max-time (default 1 s) and
--benchmark-min-rounds (default 5) set how long each contender is timed;
--benchmark-disable runs every contender once (a fast smoke test).

Select with -k on the test ids, e.g. `-k headline` (the seed's single head),
`-k "T1024 and f32"`, `-k causal` / `-k dense`, `-k mask`, `-k torch`; `-m "not memory"`
leaves out the memory subprocesses.

A group file chooses the grids it runs in with ``pytest.mark.bench_grids(...)``
(unmarked: default and full); the parametrized sdpa/paired/memory tests follow
the grid's case list instead.

Hygiene: after a call NumPy's OpenBLAS threads keep spinning for ~0.1-0.15 s
(measured here: CPU time burnt while the caller sleeps), torch's and attn's
OpenMP threads for ~10 ms.  On 2 cores the next contender would pay for
that, so within a group the order is torch, cython, numpy, loop, and every
benchmark's timing starts after its correctness call, gc.collect() and a
--bench-pause sleep (0.3 s), then one untimed calibration call (and one
untimed warm-up round for calls under 50 ms).

Without torch the attn backends still run (checked against a float64 NumPy
reference) and the summary says why the torch column is empty.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from . import _common as ab
from . import _summary
from ._progress import Progress

_SETTINGS = pytest.StashKey()
_RESULTS = pytest.StashKey()
_ENV = pytest.StashKey()

GRIDS = ("quick", "default", "full")
DEFAULT_FILE_GRIDS = ("default", "full")  # group files without a bench_grids marker


# --------------------------------------------------------------------------
# options and settings
# --------------------------------------------------------------------------


def pytest_addoption(parser):
    g = parser.getgroup("attn-bench", "attn benchmark suite (attn/apps/bench)")
    g.addoption("--bench-grid", choices=GRIDS, default=None,
                help="benchmark groups: 'quick' (three groups), 'default' (seed + T=1024) or "
                     "'full' (the T x E x dtype grid). Env: ATTN_BENCH_GRID.")
    g.addoption("--bench-backends", default=None,
                help="comma-separated subset of torch,cython,numpy,loop. Env: ATTN_BENCH_BACKENDS.")
    g.addoption("--bench-pause", type=float, default=None,
                help="seconds to sleep before each benchmark so the previous contender's "
                     "spinning thread pools go idle (default 0.3). Env: ATTN_BENCH_PAUSE.")
    g.addoption("--bench-loop-max", type=float, default=None,
                help="run the per-row loop backend only where B*H*L*S (score entries) is at "
                     "most this (default 2**24: up to T=1024 with H=8). Env: ATTN_BENCH_LOOP_MAX.")
    g.addoption("--bench-threads", type=int, default=None,
                help="threads for torch and attn alike (default: $OMP_NUM_THREADS, else all cores). "
                     "Env: ATTN_BENCH_THREADS.")
    g.addoption("--bench-memory-large", action="store_true", default=None,
                help="also measure peak memory at L=S=16384 (on with --bench-grid full). "
                     "Env: ATTN_BENCH_MEMORY_LARGE=1.")
    g.addoption("--bench-paired-budget", type=float, default=None,
                help="target timed seconds of each paired cython/torch measurement (default 4).")
    g.addoption("--bench-ui", action="store_true", default=False,
                help="show a progress line (group being timed) instead of pytest's per-test letters, "
                     "and leave out pytest-benchmark's tables and (unless --bench-details) the "
                     "per-group details (python -m attn bench).")
    g.addoption("--bench-details", action="store_true", default=False,
                help="with --bench-ui: print the per-group details after the summary table.")


class Settings:
    """The suite's settings: command line, else environment, else defaults."""

    def __init__(self, config):
        opt = config.getoption
        self.grid = opt("--bench-grid") or os.environ.get("ATTN_BENCH_GRID", "default")
        if self.grid not in GRIDS:
            raise pytest.UsageError(f"ATTN_BENCH_GRID={self.grid!r}: expected one of {', '.join(GRIDS)}")
        try:
            self.backends = ab.parse_list(
                opt("--bench-backends") or os.environ.get("ATTN_BENCH_BACKENDS"), ab.BACKEND_ORDER)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        pause = opt("--bench-pause")
        self.pause = float(os.environ.get("ATTN_BENCH_PAUSE", "0.3")) if pause is None else pause
        loop_max = opt("--bench-loop-max")
        self.loop_max = int(float(os.environ.get("ATTN_BENCH_LOOP_MAX", 2**24) if loop_max is None else loop_max))
        large = opt("--bench-memory-large")
        if large is None:
            large = os.environ.get("ATTN_BENCH_MEMORY_LARGE", "") not in ("", "0")
        self.memory_large = bool(large) or self.grid == "full"
        self.disabled = bool(_getopt(config, "benchmark_disable", False))
        self.max_time = float(_getopt(config, "benchmark_max_time", 1.0) or 1.0)
        self.min_rounds = int(_getopt(config, "benchmark_min_rounds", 5) or 5)
        self.max_rounds = 1000
        budget = opt("--bench-paired-budget")
        self.paired_budget = 4.0 if budget is None else float(budget)
        threads = opt("--bench-threads")
        if threads is None:
            threads = os.environ.get("ATTN_BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
        self.threads = int(threads) if threads else ab.n_cores()
        self.ui = bool(opt("--bench-ui"))
        self.details = bool(opt("--bench-details")) or not self.ui

    def as_dict(self):
        return dict(vars(self))


def _getopt(config, name, default):
    try:
        return config.getoption(name)
    except (ValueError, AttributeError):
        return default


class Results:
    """What the tests record for the summary (pytest-benchmark keeps the timings too)."""

    def __init__(self):
        self.timings = []  # dicts, in run order
        self.memory = []
        self.paired = {}  # group -> paired_ratio() result (test_bench_paired.py)
        self.gemm = {}  # "f32 n=1024" -> _common.gemm_rate() result, measured in this run
        self.peak = {}  # "f32" -> _common.fma_peak_rate() result, measured in this run
        self.vllm = []  # test_bench_vllm.py: one vllm_kernels report per build (rows, yardsticks, CPU)
        self.skipped = []  # (test, reason) of every skipped test, for the summary
        self.loadavg = {"start": _loadavg(), "end": None}


def gemm_yardstick(results, env, settings, dtype, flops):
    """The GEMM rate a group's GFLOP/s is compared with: square matrix products of about the
    group's flops, same dtype and threads, measured once per (dtype, size) in this run."""
    n = ab.gemm_size(flops)
    key = f"{dtype} n={n}"
    if key not in results.gemm:
        time.sleep(settings.pause)  # after the previous contender's thread pools went idle
        results.gemm[key] = ab.gemm_rate(dtype, n, env.get("torch"), settings.threads)
    return results.gemm[key]


def peak_yardstick(results, env, settings, dtype):
    """The CPU's measured FMA peak a group's GFLOP/s is compared with (attn's SIMD path, the
    group's dtype, the suite's threads), measured once per dtype in this run; None without attn's
    compiled kernels."""
    attn = env.get("attn")
    if attn is None or not attn.backends()["cython"]:
        return None
    if dtype not in results.peak:
        time.sleep(settings.pause)
        results.peak[dtype] = ab.fma_peak_rate(attn, dtype, settings.threads)
    return results.peak[dtype]


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def pytest_configure(config):
    config.addinivalue_line("markers", "memory: peak-RSS measurement in a fresh subprocess (attn bench)")
    config.addinivalue_line("markers", "bench_grids(*grids): the benchmark grids (quick, default, full) "
                                       "this group file runs in; unmarked: default and full")
    settings = config.stash[_SETTINGS] = Settings(config)
    config.stash[_RESULTS] = Results()
    if settings.ui:
        config.option.benchmark_quiet = True  # our summary instead of the 220-column tables
        config.pluginmanager.register(Progress(config, lambda: start_line(config)), "attn-bench-progress")


def _env(config):
    """Import attn and (if installed) torch once; give both the same thread count."""
    if _ENV in config.stash:
        return config.stash[_ENV]
    threads = config.stash[_SETTINGS].threads
    env = {"error": None, "torch": None, "torch_error": None}
    try:
        import attn

        env["attn"] = attn
        attn.set_num_threads(threads)
        env["backends"] = _jsonable(attn.backends())
        env["attn_version"] = attn.__version__
    except Exception as exc:  # reported in the header and by the fixture
        env["error"] = f"cannot import attn ({exc!r}); build it first (pip install -e .)"
        env["attn"] = None
        env["backends"] = {}
    import numpy as np

    env["numpy_version"] = np.__version__
    try:
        import torch
    except ImportError as exc:
        env["torch_error"] = f"PyTorch is not installed ({type(exc).__name__}: {exc})"
    else:
        torch.set_num_threads(threads)
        env["torch"] = torch
        env["torch_version"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        try:
            env["torch_cpu"] = torch.backends.cpu.get_cpu_capability()
        except Exception:  # older torch
            env["torch_cpu"] = "?"
    env["capped_avx2"] = os.environ.get("ATTN_BENCH_AVX2") == "1"
    if env["capped_avx2"] and not env["error"]:
        ran = (env["backends"].get("simd"), env.get("torch_cpu", "AVX2"))
        if ran != ("avx2-fma", "AVX2"):
            env["error"] = (f"the capped AVX2 proxy did not take: attn's SIMD path {ran[0]!r} and torch's CPU "
                            f"capability {ran[1]!r}, not 'avx2-fma' and 'AVX2'")
    config.stash[_ENV] = env
    return env


def _jsonable(x):
    return json.loads(json.dumps(x, default=repr))


def header_lines(config):
    """Settings, machine and versions: pytest's header, and the top of the CLI's output."""
    s = config.stash[_SETTINGS]
    env = _env(config)
    lines = [
        f"attn bench: grid={s.grid} backends={','.join(s.backends)} pause={s.pause:g}s "
        f"max-time={s.max_time:g}s min-rounds={s.min_rounds} loop-max={s.loop_max} "
        f"memory-large={s.memory_large} threads={s.threads} timing={'off' if s.disabled else 'on'}",
        f"attn bench: CPU {ab.cpu_description((env.get('backends') or {}).get('simd'))}; "
        "GFLOP/s are compared with a GEMM measured in the run",
    ]
    if env.get("torch"):
        lines.append(f"attn bench: torch {env['torch_version']} threads={env['torch_threads']} "
                     f"cpu-capability={env['torch_cpu']}, numpy {env['numpy_version']}")
    else:
        lines.append(f"attn bench: no torch column: {env['torch_error']}; numpy {env['numpy_version']}")
    if env["error"]:
        lines.append(f"attn bench: ERROR {env['error']}")
    else:
        lines.append(f"attn bench: attn {env['attn_version']}, attn.backends() = {env['backends']}")
    return lines


def start_line(config):
    """One line saying what is about to run (the progress display's first line)."""
    s = config.stash[_SETTINGS]
    env = _env(config)
    b = env.get("backends") or {}
    torch = f"torch {env['torch_version']}" if env.get("torch") else "no torch (see the summary)"
    return (f"attn bench, {s.grid} grid: attn {env.get('attn_version', '?')} (kernel {b.get('simd') or 'not built'}) "
            f"vs {torch}, {s.threads} threads on {ab.cpu_description(b.get('simd'))}")


def pytest_report_header(config):
    return header_lines(config)


# --------------------------------------------------------------------------
# collection: grids, parametrization (one (case, backend) pair per test, in run order)
# --------------------------------------------------------------------------


#: Run order of the group files: the main table's timings first, memory (subprocesses) last.
FILE_ORDER = {"test_bench_sdpa": 0, "test_bench_paired": 1, "test_bench_memory": 3}


def _file_rank(item):
    module = getattr(item, "module", None)
    return FILE_ORDER.get(getattr(module, "__name__", "").rsplit(".", 1)[-1], 2)


def pytest_collection_modifyitems(config, items):
    grid = config.stash[_SETTINGS].grid
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("bench_grids")
        grids = marker.args if marker else DEFAULT_FILE_GRIDS
        (keep if grid in grids else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = sorted(keep, key=_file_rank)  # stable: each file keeps its own order


def pytest_generate_tests(metafunc):
    s = metafunc.config.stash[_SETTINGS]
    names = metafunc.fixturenames
    if "case" in names and "backend" in names:
        params = [(c, b) for c in ab.cases_for(s.grid) for b in ab.BACKEND_ORDER if b in s.backends]
        metafunc.parametrize(("case", "backend"), params, ids=[f"{c.id}-{b}" for c, b in params])
    if "paired_case" in names:
        pcases = list(ab.cases_for(s.grid))
        if not {"torch", "cython"} <= set(s.backends):
            pcases = []
        metafunc.parametrize("paired_case", pcases, ids=[c.id for c in pcases])
    if "mem_case" in names and "mem_backend" in names:
        mcases = [ab.MEM_SMALL] + ([ab.MEM_LARGE] if s.memory_large else [])
        params = []
        for mc in mcases:
            for b in ab.BACKEND_ORDER:
                if b not in s.backends:
                    continue
                if b == "loop" and mc is not ab.MEM_SMALL:
                    continue  # 16384 Python-level rows; O(S) memory per row anyway
                params.append((mc, b))
        metafunc.parametrize(("mem_case", "mem_backend"), params,
                             ids=[f"{mc.id}-{b}" for mc, b in params])


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def bench_settings(pytestconfig):
    """The suite's :class:`Settings`."""
    return pytestconfig.stash[_SETTINGS]


@pytest.fixture(scope="session")
def bench_results(pytestconfig):
    """The run's :class:`Results` (what the summary prints)."""
    return pytestconfig.stash[_RESULTS]


@pytest.fixture(scope="session")
def bench_env(pytestconfig):
    """dict: ``attn`` (module), ``torch`` (module or None), ``torch_error``, ``backends``."""
    env = _env(pytestconfig)
    if env["error"]:
        pytest.fail(env["error"], pytrace=False)
    return env


def skip_without_torch(env):
    """Skip the calling test when torch is not installed, saying why."""
    if env["torch"] is None:
        pytest.skip(env["torch_error"])


class CaseData:
    """Inputs of one case and the references, computed once per case."""

    def __init__(self, case, have_torch):
        self.case = case
        self.have_torch = have_torch
        self.q, self.k, self.v = ab.make_inputs(case)
        self.mask = ab.make_mask(case)
        self._torch = None
        self._ref64 = None

    @property
    def torch_out(self):
        """torch SDPA on the same inputs (None without torch)."""
        if self._torch is None and self.have_torch:
            self._torch = ab.torch_reference(self.q, self.k, self.v, self.case.causal, mask=self.mask)
        return self._torch

    @property
    def ref64(self):
        """The exact answer to float64 rounding: torch in float64 on the same (upcast)
        inputs, or a float64 NumPy evaluation of the formula without torch."""
        if self._ref64 is None:
            if not self.have_torch:
                self._ref64 = ab.numpy_reference64(self.q, self.k, self.v, self.case.causal, self.mask)
            elif self.case.dtype == "f64":
                self._ref64 = self.torch_out
            else:
                self._ref64 = ab.torch_reference(self.q, self.k, self.v, self.case.causal, upcast=True,
                                                 mask=self.mask)
        return self._ref64


@pytest.fixture(scope="session")
def _case_cache():
    return {}


@pytest.fixture
def bench_data(request, _case_cache, bench_env):
    """:class:`CaseData` of the test's ``case`` (or ``paired_case``), one case alive at a time."""
    case = request.getfixturevalue("case" if "case" in request.fixturenames else "paired_case")
    data = _case_cache.get(case)
    if data is None:
        _case_cache.clear()  # keep one case's arrays alive at a time
        data = _case_cache[case] = CaseData(case, bench_env["torch"] is not None)
    return data


# --------------------------------------------------------------------------
# summary (before pytest-benchmark's tables, which --bench-ui leaves out)
# --------------------------------------------------------------------------


def skip_reason(report):
    """``(test, reason)`` of a skipped test's report: its id without the file, and pytest.skip's text."""
    test = report.nodeid.rsplit("::", 1)[-1]
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return test, reason.removeprefix("Skipped: ")


def _summary_lines(config, details):
    return _summary.summary_lines(config.stash[_SETTINGS], config.stash[_RESULTS], _env(config),
                                  getattr(config, "_benchmarksession", None), details=details)


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SETTINGS not in config.stash:
        return
    results = config.stash[_RESULTS]
    results.loadavg["end"] = _loadavg()
    results.skipped = [skip_reason(r) for r in terminalreporter.stats.get("skipped", [])]
    lines = _summary_lines(config, config.stash[_SETTINGS].details)
    if not lines:
        return
    terminalreporter.write_sep("=", "attn benchmark summary")
    for line in lines:
        terminalreporter.write_line(line)


# --------------------------------------------------------------------------
# pytest-benchmark JSON (--benchmark-json / --benchmark-autosave)
# --------------------------------------------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    env = _env(config)
    machine_info["attn"] = {
        "backends": env.get("backends"),
        "torch": env.get("torch_version"),
        "torch_error": env.get("torch_error"),
        "torch_threads": env.get("torch_threads"),
        "numpy": env.get("numpy_version"),
        "cores": ab.n_cores(),
        "cpu": ab.cpu_description((env.get("backends") or {}).get("simd")),
        "torch_cpu_capability": env.get("torch_cpu"),
        "loadavg": config.stash[_RESULTS].loadavg,
    }


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config, benchmarks, output_json):
    s = config.stash[_SETTINGS]
    r = config.stash[_RESULTS]
    r.loadavg["end"] = r.loadavg["end"] or _loadavg()
    output_json["attn"] = {
        "settings": _jsonable(s.as_dict()),
        "memory": _jsonable(r.memory),
        "paired": _jsonable(r.paired),
        "gemm": _jsonable(r.gemm),
        "peak": _jsonable(r.peak),
        "vllm": _jsonable(r.vllm),
        "summary": _summary_lines(config, details=True),
    }
