"""attn in child processes: after os.fork() (libgomp's pool does not survive it), in
multiprocessing pools of every start method and in torch DataLoader workers.

Each scenario (tests/_fork_scenarios.py) runs in a subprocess killed after TIME_LIMIT
seconds, so that a hang fails its test instead of stalling the suite; the scenarios check
the children's results against float64 NumPy within the rounding bounds.
"""

import importlib.util
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import attn

pytestmark = [
    pytest.mark.skipif(not attn.backends()["cython"], reason="compiled kernel not built"),
    pytest.mark.skipif(not hasattr(os, "fork") or not sys.platform.startswith("linux"),
                       reason="fork() and /proc: Linux"),
]

TIME_LIMIT = 120  # seconds; each scenario takes a few (most of it imports)
SCENARIOS = Path(__file__).with_name("_fork_scenarios.py")


def run_scenario(*args):
    """Run a scenario in a session of its own: on a hang the whole session (children that
    hang included) is killed."""
    proc = subprocess.Popen([sys.executable, str(SCENARIOS), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"scenario {args} did not finish in {TIME_LIMIT} s (a hang); its output:\n{out}\n{err}")
    assert proc.returncode == 0 and out.strip().endswith("ok"), (
        f"scenario {args}: exit status {proc.returncode}\n{out}\n{err}")


def test_fork_after_a_threaded_forward():
    """The child (and a grandchild) compute at the full thread count, on threads of their own."""
    run_scenario("fork_after_forward")


def test_fork_after_a_threaded_backward():
    run_scenario("fork_after_backward")


def test_fork_without_a_master_thread_runs_single_threaded_with_one_warning():
    run_scenario("fork_without_master")


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_multiprocessing_pool(method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {method!r} not available here")
    run_scenario("pool", method)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_dataloader_workers_follow_torchs_thread_count():
    """Two workers (forked: Linux's default), two epochs; attn uses torch's one thread in each."""
    run_scenario("dataloader")
