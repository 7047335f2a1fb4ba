"""Paired cython/torch ratio of every group: the contenders in alternating blocks.

A second, independent measurement of each group's cython/torch ratio (see
_paired.py for why): robust to the machine's speed drifting between
pytest-benchmark's per-contender stretches. The summary's one cython/torch
figure; the ratio of the medians is left to the details. Needs torch
and both torch and cython among --bench-backends. With --benchmark-disable it
runs one block of each (a smoke test of the code).
"""

from __future__ import annotations

import functools
import gc

import pytest

from attn.apps.bench import _common as ab
from attn.apps.bench._paired import paired_ratio
from attn.apps.bench.plugin import skip_without_torch

pytestmark = pytest.mark.bench_grids("quick", "default", "full")  # the cases follow the grid


def test_paired(paired_case, bench_data, bench_env, bench_settings, bench_results):
    case = paired_case
    skip_without_torch(bench_env)
    if not ab.cython_available(bench_env["backends"]):
        pytest.skip("attn's Cython extension is not built")
    torch_fn = ab.torch_sdpa_fn(bench_data.q, bench_data.k, bench_data.v, case.causal, bench_data.mask)
    cython_fn = functools.partial(bench_env["attn"].scaled_dot_product_attention,
                                  bench_data.q, bench_data.k, bench_data.v, attn_mask=bench_data.mask,
                                  is_causal=case.causal, backend="cython")
    gc.collect()
    with bench_env["torch"].inference_mode():
        r = paired_ratio(torch_fn, cython_fn, blocks=1 if bench_settings.disabled else None,
                         budget=bench_settings.paired_budget)
    bench_results.paired[case.group] = dict(r, torch=r["a"], cython=r["b"])
