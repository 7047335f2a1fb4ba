"""pytest configuration of the `attn` benchmark suite (run: `pytest bench`).

Plain `pytest` runs only tests/ (the repository's testpaths); this directory
is collected only when named on the command line.  Needs pytest-benchmark.

Options (each also settable through the environment variable named):

  --bench-grid default|full   ATTN_BENCH_GRID      which groups (see _attn_bench.py)
  --bench-backends a,b,...    ATTN_BENCH_BACKENDS  subset of torch,cython,numpy,loop
  --bench-pause SECONDS       ATTN_BENCH_PAUSE     idle time before each benchmark (0.3)
  --bench-loop-max N          ATTN_BENCH_LOOP_MAX  run the loop backend only where
                                                   B*H*L*S <= N (2**24: T <= 1024 at H=8)
  --bench-threads N           ATTN_BENCH_THREADS   threads for torch and attn ($OMP_NUM_THREADS
                                                   or all cores)
  --bench-memory-large        ATTN_BENCH_MEMORY_LARGE=1  add the L=S=16384 memory case
                                                   (always on with the full grid)

pytest-benchmark's own --benchmark-max-time (default 1 s) and
--benchmark-min-rounds (default 5) set how long each contender is timed;
--benchmark-disable runs every contender once (a fast smoke test).

Select with -k on the test ids, e.g. `-k headline` (the seed's single head),
`-k "T1024 and f32"`, `-k causal` / `-k dense`, `-k mask`, `-k torch`; `-m "not memory"`
leaves out the memory subprocesses.

Hygiene: after a call NumPy's OpenBLAS threads keep spinning for ~0.1-0.15 s
(measured here: CPU time burnt while the caller sleeps), torch's and attn's
OpenMP threads for ~10 ms.  On 2 cores the next contender would pay for
that, so within a group the order is torch, cython, numpy, loop, and every
benchmark's timing starts after its correctness call, gc.collect() and a
--bench-pause sleep (0.3 s), then one untimed calibration call (and one
untimed warm-up round for calls under 50 ms).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # works under any --import-mode
    sys.path.insert(0, _HERE)

import _attn_bench as ab  # noqa: E402

_SETTINGS = pytest.StashKey()
_RESULTS = pytest.StashKey()
_ENV = pytest.StashKey()


# --------------------------------------------------------------------------
# options and settings
# --------------------------------------------------------------------------


def pytest_addoption(parser):
    g = parser.getgroup("attn-bench", "attn benchmark suite (bench/)")
    g.addoption("--bench-grid", choices=("default", "full"), default=None,
                help="benchmark groups: 'default' (seed + T=1024) or 'full' (issue 3's grid). "
                     "Env: ATTN_BENCH_GRID.")
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


class Settings:
    def __init__(self, config):
        opt = config.getoption
        self.grid = opt("--bench-grid") or os.environ.get("ATTN_BENCH_GRID", "default")
        if self.grid not in ("default", "full"):
            raise pytest.UsageError(f"ATTN_BENCH_GRID={self.grid!r}: expected 'default' or 'full'")
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
        threads = opt("--bench-threads")
        if threads is None:
            threads = os.environ.get("ATTN_BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
        self.threads = int(threads) if threads else ab.n_cores()

    def as_dict(self):
        return {k: v for k, v in vars(self).items()}


def _getopt(config, name, default):
    try:
        return config.getoption(name)
    except (ValueError, AttributeError):
        return default


class Results:
    def __init__(self):
        self.timings = []  # dicts, in run order
        self.memory = []
        self.paired = {}  # group -> paired_ratio() result (test_bench_paired.py)
        self.loadavg = {"start": _loadavg(), "end": None}


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def pytest_configure(config):
    config.addinivalue_line("markers", "memory: peak-RSS measurement in a fresh subprocess (bench/)")
    config.stash[_SETTINGS] = Settings(config)
    config.stash[_RESULTS] = Results()


def _env(config):
    """Import attn and torch once; set torch to use every core."""
    if _ENV in config.stash:
        return config.stash[_ENV]
    env = {"error": None}
    try:
        import attn

        env["attn"] = attn
        if hasattr(attn, "set_num_threads"):
            attn.set_num_threads(config.stash[_SETTINGS].threads)
        env["backends"] = _jsonable(attn.backends())
    except Exception as exc:  # reported in the header and by the fixture
        env["error"] = f"cannot import attn ({exc!r}); run `pip install -e .` first"
        env["attn"] = None
        env["backends"] = {}
    try:
        import numpy as np
        import torch

        torch.set_num_threads(config.stash[_SETTINGS].threads)
        env["torch"] = torch
        env["torch_version"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        try:
            env["torch_cpu"] = torch.backends.cpu.get_cpu_capability()
        except Exception:  # older torch
            env["torch_cpu"] = "?"
        env["numpy_version"] = np.__version__
    except Exception as exc:
        env["torch"] = None
        env["error"] = (env["error"] or "") + f" cannot import torch ({exc!r})"
    config.stash[_ENV] = env
    return env


def _jsonable(x):
    return json.loads(json.dumps(x, default=repr))


def pytest_report_header(config):
    s = config.stash[_SETTINGS]
    env = _env(config)
    lines = [
        f"attn bench: grid={s.grid} backends={','.join(s.backends)} pause={s.pause:g}s "
        f"max-time={s.max_time:g}s min-rounds={s.min_rounds} loop-max={s.loop_max} "
        f"memory-large={s.memory_large} threads={s.threads} timing={'off' if s.disabled else 'on'}",
        f"attn bench: {ab.peak_description()}",
    ]
    if env.get("torch"):
        lines.append(f"attn bench: torch {env['torch_version']} threads={env['torch_threads']} "
                     f"cpu-capability={env['torch_cpu']}, numpy {env['numpy_version']}")
    if env["error"]:
        lines.append(f"attn bench: ERROR {env['error']}")
    else:
        lines.append(f"attn bench: attn.backends() = {env['backends']}")
    return lines


# --------------------------------------------------------------------------
# parametrization: one (case, backend) pair per test, in run order
# --------------------------------------------------------------------------


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
    return pytestconfig.stash[_SETTINGS]


@pytest.fixture(scope="session")
def bench_results(pytestconfig):
    return pytestconfig.stash[_RESULTS]


@pytest.fixture(scope="session")
def bench_env(pytestconfig):
    env = _env(pytestconfig)
    if env["error"]:
        pytest.fail(env["error"], pytrace=False)
    return env


class CaseData:
    """Inputs of one case and torch's answers, computed once per case."""

    def __init__(self, case):
        self.case = case
        self.q, self.k, self.v = ab.make_inputs(case)
        self.mask = ab.make_mask(case)
        self._torch = None
        self._ref64 = None

    @property
    def torch_out(self):
        if self._torch is None:
            self._torch = ab.torch_reference(self.q, self.k, self.v, self.case.causal, mask=self.mask)
        return self._torch

    @property
    def ref64(self):
        """torch in float64 on the same (upcast) inputs."""
        if self._ref64 is None:
            if self.case.dtype == "f64":
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
    case = request.getfixturevalue("case" if "case" in request.fixturenames else "paired_case")
    data = _case_cache.get(case)
    if data is None:
        _case_cache.clear()  # keep one case's arrays alive at a time
        data = _case_cache[case] = CaseData(case)
    return data


# --------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------


def _targets(group_rows, paired=None):
    """Issue 3's targets that apply to one group, as 'name: ok/MISS (value)'.

    The time ratio is judged on the paired measurement when there is one.
    """
    by = {r["backend"]: r for r in group_rows if r.get("median")}
    case = group_rows[0]["case_obj"]
    out = []
    if case.kind == "seed" or case.mask != "none":  # not among the targets
        return out
    cy, th, npy = by.get("cython"), by.get("torch"), by.get("numpy")
    if paired:
        r = paired["ratio"]
        out.append(f"cy/torch<=0.8 (paired) {'ok' if r <= 0.8 else 'MISS'} ({r:.2f})")
    elif cy and th:
        r = cy["median"] / th["median"]
        out.append(f"cy/torch<=0.8 {'ok' if r <= 0.8 else 'MISS'} ({r:.2f})")
    if cy and case.kind == "grid" and case.L >= 1024 and not case.causal:
        pct = cy["pct_peak"]
        out.append(f">=60% peak {'ok' if pct >= 60 else 'MISS'} ({pct:.0f}%)")
    if cy and npy and case.L >= 1024:
        r = npy["median"] / cy["median"]
        out.append(f"np/cy>=5 {'ok' if r >= 5 else 'MISS'} ({r:.1f})")
    if cy and case.kind == "decode":
        bw = cy["kv_gbps"]
        out.append(f"K+V>=15 GB/s {'ok' if bw >= 15 else 'MISS'} ({bw:.1f})")
    return out


def _other_benchmarks(config):
    """pytest-benchmark records of bench/ tests other than test_bench_sdpa (e.g. decode)."""
    bs = getattr(config, "_benchmarksession", None) if config is not None else None
    out = []
    for b in getattr(bs, "benchmarks", None) or []:
        info = getattr(b, "extra_info", {}) or {}
        if "case" in info or not b:
            continue
        out.append(b)
    return out


def other_lines(benchmarks, paired=None):
    groups = {}
    for b in benchmarks:
        groups.setdefault(b.group or b.name, []).append(b)
    lines = []
    for name, rows in groups.items():
        lines.append("")
        lines.append(f"[{name}]")
        med = {}
        for b in rows:
            info = b.extra_info
            who = info.get("backend") or info.get("contender") or b.name
            med[who] = b.stats.median
            extra = "  ".join(
                f"{label} {fmt(info[key])}" for key, label, fmt in (
                    ("kv_gbps", "K+V GB/s", lambda x: f"{x:.1f}"),
                    ("max_abs_diff_vs_torch", "max|d| torch", ab.fmt_diff),
                    ("max_abs_diff_vs_torch_f64", "f64", ab.fmt_diff)) if key in info)
            lines.append(f"  {who:<7} {ab.fmt_time(b.stats.median):>11} (min {ab.fmt_time(b.stats.min)})  "
                         f"{extra}  rounds {b.stats.rounds}")
        if med.get("cython") and med.get("torch"):
            lines.append(f"  cython/torch {ab.fmt_ratio(med['cython'], med['torch'])}")
        pr = (paired or {}).get(name)
        if pr:  # e.g. test_bench_backward.py's paired ratios
            target = pr.get("target")
            lines.append(
                f"  paired: torch {ab.fmt_time(pr['torch'])}, cython {ab.fmt_time(pr['cython'])}, "
                f"cython/torch {pr['ratio']:.2f}x (quartiles {pr['ratio_q1']:.2f}-{pr['ratio_q3']:.2f})"
                + (f"  target <= {target}: {'ok' if pr['ratio'] <= target else 'MISS'}" if target else ""))
    return lines


def summary_lines(settings, results, config=None):
    lines = []
    timed = [r for r in results.timings]
    if timed:
        title = "attn bench summary: medians of one side-by-side run"
        if settings.disabled:
            title = "attn bench summary: timing disabled (--benchmark-disable); correctness only"
        lines.append(title)
        lines.append(ab.peak_description())
        la = results.loadavg
        lines.append(f"load average (1, 5, 15 min) at start {la['start']}, at end {la['end'] or _loadavg()} "
                     f"on {ab.n_cores()} cores; max|d| = max abs diff vs torch (same dtype) / "
                     f"vs torch float64 on the same inputs")
        groups = {}
        for r in timed:
            groups.setdefault(r["group"], []).append(r)
        for name, rows in groups.items():
            case = rows[0]["case_obj"]
            lines.append("")
            lines.append(f"[{name}]  {case.flops / 1e9:.3g} GFLOP/call"
                         + (f", K+V {case.kv_bytes / 2**20:.0f} MiB" if case.kind == "decode" else ""))
            for r in sorted(rows, key=lambda r: ab.BACKEND_ORDER.index(r["backend"])):
                if r.get("skipped"):
                    lines.append(f"  {r['backend']:<7} skipped: {r['skipped']}")
                    continue
                rate = ""
                if r.get("median"):
                    rate = f"{r['gflops']:7.1f} GFLOP/s ({r['pct_peak']:3.0f}% of {r['peak']:.0f})"
                    if case.kind == "decode":
                        rate += f"  K+V {r['kv_gbps']:.1f} GB/s"
                mn = f"(min {ab.fmt_time(r['min'])})" if r.get("min") else ""
                lines.append(
                    f"  {r['backend']:<7} {ab.fmt_time(r.get('median')):>11} {mn:<16} {rate:<32} "
                    f"max|d| {ab.fmt_diff(r.get('diff_torch')):>7} / {ab.fmt_diff(r.get('diff_ref64')):>7}"
                    + (f"  rounds {r['rounds']}" if r.get("rounds") else ""))
            med = {r["backend"]: r.get("median") for r in rows}
            if not settings.disabled:
                lines.append(
                    f"  loop/numpy {ab.fmt_ratio(med.get('loop'), med.get('numpy'))}   "
                    f"numpy/cython {ab.fmt_ratio(med.get('numpy'), med.get('cython'))}   "
                    f"cython/torch {ab.fmt_ratio(med.get('cython'), med.get('torch'))}")
                pr = results.paired.get(name)
                if pr:
                    lines.append(
                        f"  paired: torch {ab.fmt_time(pr['torch'])}, cython {ab.fmt_time(pr['cython'])}, "
                        f"cython/torch {pr['ratio']:.2f}x (quartiles {pr['ratio_q1']:.2f}-{pr['ratio_q3']:.2f}; "
                        f"{pr['blocks']} alternating blocks of {pr['calls_per_block']} calls)")
                if case.kind == "seed":
                    lines.append("  (the seed article measured loop/matrix 5.4x: 5.669 ms vs 1.050 ms on its machine)")
                t = _targets(rows, results.paired.get(name))
                if t:
                    lines.append("  targets: " + "; ".join(t))
        if not settings.disabled and len(groups) > 1:
            lines.append("")
            lines.extend(compact_table(groups, results.paired))
    others = [] if settings.disabled else _other_benchmarks(config)
    if others:
        lines.append("")
        lines.append("other benchmarks in bench/ (medians)")
        lines.extend(other_lines(others, results.paired))
    if results.memory:
        lines.append("")
        lines.append("attn bench memory: peak RSS growth of ONE call, fresh subprocess per row "
                     "(VmHWM after - VmRSS before; inputs allocated before the baseline); "
                     "extra = growth - output")
        lines.append(f"  {'shape':<30} {'backend':<7} {'growth':>10} {'extra':>10} {'output':>9} "
                     f"{'inputs':>9} {'call':>10}")
        for m in results.memory:
            if m.get("skipped"):
                lines.append(f"  {m['label']:<30} {m['backend']:<7} skipped: {m['skipped']}")
                continue
            note = ""
            if m["backend"] == "cython" and (m["L"] >= 16384 or m["label"].startswith("backward")):
                note = f"  target extra<=64 MiB {'ok' if m['extra_mib'] <= 64 else 'MISS'}"
            if not m.get("hwm_reset", True):
                note += "  (VmHWM not resettable: lower bound)"
            lines.append(
                f"  {m['label']:<30} {m['backend']:<7} {m['growth_mib']:>7.1f} MiB {m['extra_mib']:>6.1f} MiB "
                f"{m['output_mib']:>5.1f} MiB {m['inputs_mib']:>5.1f} MiB {ab.fmt_time(m['seconds']):>10}{note}")
    return lines


def compact_table(groups, paired=None):
    paired = paired or {}
    head = (f"{'group':<44} {'torch':>10} {'cython':>10} {'numpy':>10} {'loop':>10} "
            f"{'loop/np':>7} {'np/cy':>6} {'cy/torch':>8} {'paired':>6} {'cy GFLOP/s':>10}")
    out = ["attn bench table (medians; paired = median cython/torch ratio of alternating blocks)", head]
    for name, rows in groups.items():
        med = {r["backend"]: r.get("median") for r in rows}
        cy = next((r for r in rows if r["backend"] == "cython" and r.get("median")), None)
        out.append(
            f"{name[:44]:<44} "
            + " ".join(f"{ab.fmt_time(med.get(b)):>10}" for b in ("torch", "cython", "numpy", "loop"))
            + f" {ab.fmt_ratio(med.get('loop'), med.get('numpy')):>7}"
            + f" {ab.fmt_ratio(med.get('numpy'), med.get('cython')):>6}"
            + f" {ab.fmt_ratio(med.get('cython'), med.get('torch')):>8}"
            + (f" {paired[name]['ratio']:>5.2f}x" if name in paired else f" {'-':>6}")
            + (f" {cy['gflops']:>5.1f} ({cy['pct_peak']:.0f}%)" if cy else f" {'-':>10}"))
    return out


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SETTINGS not in config.stash:
        return
    results = config.stash[_RESULTS]
    results.loadavg["end"] = _loadavg()
    lines = summary_lines(config.stash[_SETTINGS], results, config)
    if not lines:
        return
    terminalreporter.write_sep("-", "attn benchmark summary")
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
        "torch_threads": env.get("torch_threads"),
        "numpy": env.get("numpy_version"),
        "cores": ab.n_cores(),
        "peak_gflops": {"f32": ab.peak_gflops("f32"), "f64": ab.peak_gflops("f64")},
        "peak": ab.peak_description(),
        "torch_cpu_capability": env.get("torch_cpu"),
        "loadavg": config.stash[_RESULTS].loadavg,
    }


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config, benchmarks, output_json):
    s = config.stash[_SETTINGS]
    r = config.stash[_RESULTS]
    output_json["attn"] = {
        "settings": _jsonable(s.as_dict()),
        "memory": _jsonable(r.memory),
        "paired": _jsonable(r.paired),
        "summary": summary_lines(s, r, config),
    }
