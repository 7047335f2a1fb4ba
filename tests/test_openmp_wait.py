"""The kernels' OpenMP wait policy (attn/_openmp_wait.py), in fresh interpreters: a short spin when
attn loads the runtime, the user's variables when set, the runtime's own when torch loaded it first;
the variables attn sets for the load are gone afterwards (a runtime another library loads later on
its own keeps its defaults)."""

import os
import subprocess
import sys

import pytest

import attn

pytestmark = pytest.mark.skipif(not (attn.backends()["cython"] and attn.backends()["openmp"]),
                                reason="needs the kernels built with OpenMP")

PROBE = ("import os, sys\n"
         "{pre}\n"
         "import attn\n"
         "print(attn.backends()['omp_wait'])\n"
         "print(sorted(n for n in ('GOMP_SPINCOUNT', 'KMP_BLOCKTIME', 'OMP_WAIT_POLICY') if n in os.environ))\n")


def _probe(pre="", **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")}
    res = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=dict(clean, **env),
                         capture_output=True, text=True, timeout=120, check=True)
    policy, left = res.stdout.strip().splitlines()[-2:]
    return policy, left


def test_attn_loads_the_runtime_with_a_short_spin():
    from attn._openmp_wait import SPIN_COUNT

    policy, left = _probe()
    assert policy.startswith("short spin") and f"GOMP_SPINCOUNT={SPIN_COUNT}" in policy
    assert left == "[]"  # removed again after the load


def test_the_users_variables_win():
    policy, left = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert policy == "the user's: OMP_WAIT_POLICY=ACTIVE" and left == "['OMP_WAIT_POLICY']"


def test_a_runtime_loaded_before_attn_keeps_its_policy():
    pytest.importorskip("torch")
    policy, left = _probe(pre="import torch")
    assert policy.startswith("the runtime's default") and left == "[]"
