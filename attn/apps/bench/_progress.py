"""Progress line of ``python -m attn bench``: the group being timed and a bar.

On a terminal one line is redrawn in place
(``[#######.............] 12/31  0:42  B=1 H=8 T=1024 E=64 f32 causal: cython``);
otherwise (a pipe, a log file) one line is printed per group. pytest's
per-test letters are suppressed meanwhile; failures are printed as they come
and pytest reports them in full at the end.
"""

from __future__ import annotations

import time

import pytest

BAR = 20


def item_label(item):
    """``(group, what)`` of a test item: the case's group and the contender, else the test's id."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key, what_key, prefix in (("case", "backend", ""), ("paired_case", None, "paired cython/torch: "),
                                  ("mem_case", "mem_backend", "memory: ")):
        if key in params:
            case = params[key]
            group = getattr(case, "group", None) or getattr(case, "label", None) or str(case)
            what = params.get(what_key, "alternating blocks") if what_key else "alternating blocks"
            return prefix + group, what
    name = (getattr(item, "originalname", None) or item.name).removeprefix("test_")
    callspec_id = getattr(getattr(item, "callspec", None), "id", "")
    return (f"{name}: {callspec_id}" if callspec_id else name), "running"


def _clock(seconds):
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


class Progress:
    """pytest plugin object registered by attn.apps.bench.plugin with --bench-ui."""

    def __init__(self, config, start_line=None):
        self.config = config
        self.start_line = start_line
        self.total = 0
        self.done = 0
        self.start = time.monotonic()
        self.group = None
        self.line_open = False

    @property
    def tr(self):
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def _bar(self):
        filled = BAR * self.done // max(self.total, 1)
        return "[" + "#" * filled + "." * (BAR - filled) + "]"

    def _draw(self, group, what):
        tr = self.tr
        if tr is None:
            return
        head = f"{self._bar()} {self.done:>{len(str(self.total))}}/{self.total}  {_clock(time.monotonic() - self.start)}  "
        if tr.isatty:
            text = head + f"{group}: {what}"
            width = tr._tw.fullwidth - 1
            tr._tw.write("\r" + text[:width].ljust(width))
            tr._tw.flush()
            self.line_open = True
        elif group != self.group:
            tr._tw.line(head + group)
        self.group = group

    def _close_line(self):
        tr = self.tr
        if self.line_open and tr is not None:
            tr._tw.write("\r" + " " * (tr._tw.fullwidth - 1) + "\r")
            self.line_open = False

    def pytest_collection_finish(self, session):
        self.total = len(session.items)
        self.start = time.monotonic()
        tr = self.tr
        if tr is not None:
            if self.start_line is not None:
                tr._tw.line(self.start_line())
            tr._tw.line(f"{self.total} benchmarks; progress shows the group being timed and the contender")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._draw(*item_label(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(self, report, config):
        res = yield
        category = res[0]
        return category, "", ""  # no letters: the progress line says what is running

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self._close_line()
            tr = self.tr
            if tr is not None:
                tr._tw.line(f"FAILED {report.nodeid} ({report.when})", red=True)
        if report.when == "teardown":
            self.done += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self._close_line()
        tr = self.tr
        if tr is not None and self.total:
            tr._tw.line(f"{self._bar()} {self.done}/{self.total}  {_clock(time.monotonic() - self.start)}  done")
