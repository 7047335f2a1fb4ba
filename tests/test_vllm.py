"""attn as vLLM's CPU attention backend (attn.integrations.vllm), held to vLLM's own kernel (CPU_ATTN).

Run from vLLM's environment (docs/vllm.md), attn from the repository:

    PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest -q tests/test_vllm.py

Without vllm the engine tests skip (with the reason); the plan and import
tests run anywhere torch does. Engines run in subprocesses
(tests/_vllm_engine.py), several per subprocess, one per configuration,
shared by the tests of a module-scoped fixture; SmolLM2's subprocess and the
tiny models' run side by side (EngineJob); attn's plugin is found
through package metadata written from pyproject.toml
(tests/_vllm_models.py).

Bounds. float32: two float32 evaluations of one model differ in a logit by at
most :func:`attn.apps.models._rounding.float32_logit_bound` (the logit scale
``max |logit|`` taken from transformers' evaluation of the same weights), so
a log-probability ``z_i - logsumexp(z)`` by at most twice that, and greedy
tokens agree while the top-2 gap exceeds ``tie_threshold`` (compared up to the
first near tie). bfloat16 has no useful derived bound of that kind (a chain
of ~64k roundings at u = 2^-8); as tests/test_transformers_models.py does,
its bound is a measured spread: vLLM's own bfloat16 evaluation against its
float32 one, times two (two implementations), in the largest and in the mean
deviation.
"""

import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import attn
from attn.apps.models._rounding import float32_logit_bound, tie_threshold

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _vllm_models  # noqa: E402  (tests/ helper)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed: run from vLLM's environment (docs/vllm.md: .venv-vllm)")
ANNOUNCED = f"attn {attn.__version__} (SIMD path {attn.backends()['simd']}) computes vLLM's CPU attention"
ENGINE = Path(__file__).resolve().parent / "_vllm_engine.py"
ENGINE_TIMEOUT = 900  # seconds for one subprocess of engines (a hung engine fails the fixture, not the suite)
PAGE = 128  # vLLM's CPU block size (platforms/cpu.py), the prefix-cache granularity


# ------------------------------------------------------------------ anywhere: imports and switches
def test_import_attn_imports_neither_vllm_nor_torch():
    code = ("import sys, attn, attn.integrations.vllm as v; "
            "assert not {'vllm', 'torch'} & set(sys.modules), sorted({'vllm', 'torch'} & set(sys.modules)); "
            "assert not v.enabled({})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_attn_vllm_values():
    from attn.integrations.vllm import enabled

    assert enabled({"ATTN_VLLM": "1"}) and not enabled({}) and not enabled({"ATTN_VLLM": "0"})
    assert not enabled({"ATTN_VLLM": ""})
    with pytest.raises(ValueError, match="ATTN_VLLM='on'.*ATTN_VLLM=1"):
        enabled({"ATTN_VLLM": "on"})


def test_tested_versions():
    from attn.integrations.vllm import tested_version

    assert tested_version("0.32.0") and tested_version("0.32.11") and tested_version("0.32")
    assert not tested_version("0.33.0") and not tested_version("0.320.0") and not tested_version("0.31.2")


# ------------------------------------------------------------------ anywhere torch is: the step plan
def test_cache_pages_split_each_block_as_cpu_attn():
    """K and V pages of a [num_blocks, H_kv, page, 2E] cache: element (b, j, h, e) of K is the
    block's head-h key row j (the first page * E elements of the head's 2 * page * E), of V the
    row after the page's keys, as CPU_ATTN's forward views it; views of the tensor, numpy and torch."""
    torch = pytest.importorskip("torch")
    from attn.integrations import _vllm_plan

    n_blocks, H_kv, page, E = 3, 2, 4, 5
    cache = np.arange(n_blocks * H_kv * page * 2 * E, dtype=np.float32).reshape(n_blocks, H_kv, page, 2 * E)
    flat = cache.reshape(-1)
    b, j, h, e = np.meshgrid(*(np.arange(n) for n in (n_blocks, page, H_kv, E)), indexing="ij")
    head = (b * H_kv + h) * 2 * page * E                                 # where block b's head h starts
    for pages in (_vllm_plan.cache_pages(cache, E), _vllm_plan.cache_pages(torch.from_numpy(cache), E)):
        k, v = (np.asarray(x) for x in pages)
        np.testing.assert_array_equal(k, flat[head + j * E + e])
        np.testing.assert_array_equal(v, flat[head + (page + j) * E + e])
    kc, vc = torch.from_numpy(cache).view(n_blocks, H_kv, 2 * page, E).chunk(2, dim=2)   # CPU_ATTN's split
    k, v = _vllm_plan.cache_pages(torch.from_numpy(cache), E)
    assert torch.equal(k, kc.transpose(1, 2)) and torch.equal(v, vc.transpose(1, 2))
    k[1, 2, 0, 3] = -1.0                                                 # a view: written through
    assert flat[(1 * H_kv + 0) * 2 * page * E + 2 * E + 3] == -1.0
    with pytest.raises(ValueError, match="2 \\* head_size = 8"):
        _vllm_plan.cache_pages(cache, 4)


def _random_step(torch, rng, dtype, E=64, H=8, H_kv=2, page=32, decode_first=False):
    """A mixed batch over a [num_blocks, H_kv, page, 2E] cache (vLLM's tensor): decode rows, prefill
    chunks with cached keys before them, a whole prompt; pages in a shuffled order. ``decode_first``:
    the decode rows lead, in vLLM's order (the builder's reorder_batch_threshold)."""
    q_len = np.array([1, 37, 1, 64, 5, 1])
    k_len = np.array([70, 100, 33, 64, 129, 1])
    if decode_first:
        order = np.argsort(q_len > 1, kind="stable")
        q_len, k_len = q_len[order], k_len[order]
    pages_per = -(-k_len // page)
    num_blocks = int(pages_per.sum()) + 3
    order = rng.permutation(num_blocks)
    table = np.zeros((len(k_len), pages_per.max() + 2), np.int32)
    at = 0
    for s, n in enumerate(pages_per):
        table[s, :n] = order[at:at + n]
        at += n
    cache = torch.from_numpy(rng.standard_normal((num_blocks, H_kv, page, 2 * E), np.float32)).to(dtype)
    q = torch.from_numpy(rng.standard_normal((int(q_len.sum()), H, E), np.float32)).to(dtype)
    return q, cache, np.concatenate([[0], np.cumsum(q_len)]), k_len, table


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_step_plan_is_flash_attn_varlen_func(dtype_name):
    """One layer run from a step's plan (what the backend runs) equals attn.flash.flash_attn_varlen_func
    over the same pages bit for bit, with every variant: GQA, window, softcap, ALiBi, sinks."""
    torch = pytest.importorskip("torch")
    from attn._interop import to_numpy
    from attn.flash import flash_attn_varlen_func
    from attn.integrations import _vllm_plan

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(47)
    q, cache, cu_q, k_len, table = _random_step(torch, rng, dtype)
    E, H, page = q.shape[2], q.shape[1], cache.shape[2]
    k_pages, v_pages = _vllm_plan.cache_pages(cache, E)
    plan = _vllm_plan.plan_step(torch.from_numpy(cu_q.astype(np.int32)), torch.from_numpy(k_len.astype(np.int32)),
                                torch.from_numpy(table), cache.shape[0], page, True, 2)
    cu_k = np.concatenate([[0], np.cumsum(k_len)])
    sinks = torch.from_numpy(rng.standard_normal(H, np.float32)).to(dtype)
    slopes = list(rng.uniform(0.01, 0.3, H))
    for sw, cap, alibi, sink in [(None, None, None, None), (17, None, None, None), (None, 20.0, None, None),
                                 (None, None, slopes, None), (None, None, None, sinks), (9, 15.0, slopes, sinks)]:
        spec = _vllm_plan.layer_spec(H, E, to_numpy(q, "q").dtype, 0.17, sw, cap, alibi, sink)
        ours = torch.empty_like(q)
        ours.copy_(torch.from_numpy(_vllm_plan.run_layer(plan, spec, q, k_pages, v_pages)))
        ref = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(np.diff(cu_q).max()), int(k_len.max()),
                                     softmax_scale=0.17, causal=True,
                                     window_size=(-1, -1) if sw is None else (sw - 1, 0), softcap=cap or 0.0,
                                     alibi_slopes=None if alibi is None else np.asarray(alibi, np.float32),
                                     block_table=table, sinks=None if sink is None else sink.float(), num_threads=2)
        assert torch.equal(ours, ref), (dtype_name, sw, cap, alibi is not None, sink is not None)


@pytest.mark.parametrize("decode_only", [False, True])
def test_layers_of_one_step_each_get_their_own_result(decode_only):
    """The layers of a step share the plan's derived offsets (attn._backends.fused's memo), not its
    arrays: interleaved calls over different queries and caches (two layers, then a strided query, then
    the first again) each equal flash_attn_varlen_func over their own arrays, bit for bit."""
    torch = pytest.importorskip("torch")
    from attn.flash import flash_attn_varlen_func
    from attn.integrations import _vllm_plan

    rng = np.random.default_rng(50)
    q1, cache1, cu_q, k_len, table = _random_step(torch, rng, torch.float32)
    if decode_only:
        cu_q = np.arange(len(k_len) + 1)
        q1 = q1[: len(k_len)]
    q2 = torch.from_numpy(rng.standard_normal(tuple(q1.shape), np.float32))
    cache2 = torch.from_numpy(rng.standard_normal(tuple(cache1.shape), np.float32))
    q3 = torch.from_numpy(rng.standard_normal((q1.shape[0], q1.shape[1], 2 * q1.shape[2]), np.float32))[..., ::2]
    E, H, page = q1.shape[2], q1.shape[1], cache1.shape[2]
    plan = _vllm_plan.plan_step(torch.from_numpy(cu_q.astype(np.int32)), torch.from_numpy(k_len.astype(np.int32)),
                                torch.from_numpy(table), cache1.shape[0], page, True, 2)
    spec = _vllm_plan.layer_spec(H, E, np.dtype(np.float32), 0.2, None, None, None, None)
    cu_k = np.concatenate([[0], np.cumsum(k_len)])
    for q, cache in [(q1, cache1), (q2, cache2), (q3, cache2), (q1, cache1)]:
        k_pages, v_pages = _vllm_plan.cache_pages(cache, E)
        ours = _vllm_plan.run_layer(plan, spec, q, k_pages, v_pages)
        ref = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(np.diff(cu_q).max()), int(k_len.max()),
                                     softmax_scale=0.2, causal=True, block_table=table, num_threads=2)
        np.testing.assert_array_equal(ours, ref.numpy())


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("batch", ["decode_first", "mixed_order", "decode_only", "prefill_only"])
def test_run_layer_writes_into_out(dtype_name, batch):
    """run_layer(..., out=) (what the backend runs: vLLM's output buffer) equals flash_attn_varlen_func bit
    for bit, layer after layer of one step over different caches and queries (a strided one too), each
    result in its own out. The kernel writes out itself (the step's calls derived once per layout) for
    vLLM's order of decode rows then chunks in float32, bfloat16 and float16 (each row rounded once as
    it is written); another order is copied in; a window takes the same calls, sinks are copied in."""
    torch = pytest.importorskip("torch")
    from attn.flash import flash_attn_varlen_func
    from attn.integrations import _vllm_plan

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(51)
    q1, cache1, cu_q, k_len, table = _random_step(torch, rng, dtype, decode_first=batch != "mixed_order")
    q_len = np.diff(cu_q)
    if batch == "decode_only":
        keep = q_len == 1
    elif batch == "prefill_only":
        keep = q_len > 1
    else:
        keep = np.ones(len(q_len), bool)
    rows = np.concatenate([np.arange(cu_q[s], cu_q[s + 1]) for s in np.flatnonzero(keep)])
    q1, k_len, table = q1[torch.from_numpy(rows)], k_len[keep], table[keep]
    cu_q = np.concatenate([[0], np.cumsum(q_len[keep])])
    E, H, page = q1.shape[2], q1.shape[1], cache1.shape[2]
    q2 = torch.from_numpy(rng.standard_normal(tuple(q1.shape), np.float32)).to(dtype)
    q3 = torch.from_numpy(rng.standard_normal((q1.shape[0], H, 2 * E), np.float32)).to(dtype)[..., ::2]
    cache2 = torch.from_numpy(rng.standard_normal(tuple(cache1.shape), np.float32)).to(dtype)
    plan = _vllm_plan.plan_step(torch.from_numpy(cu_q.astype(np.int32)), torch.from_numpy(k_len.astype(np.int32)),
                                torch.from_numpy(table), cache1.shape[0], page, True, 2)
    cu_k = np.concatenate([[0], np.cumsum(k_len)])
    sinks = torch.from_numpy(rng.standard_normal(H, np.float32))
    for sw, sink in [(None, None), (17, None), (None, sinks)]:
        spec = _vllm_plan.layer_spec(H, E, np.dtype(np.float32), 0.2, sw, None, None, sink)
        for q, cache in [(q1, cache1), (q2, cache2), (q3, cache2), (q1, cache2)]:
            k_pages, v_pages = _vllm_plan.cache_pages(cache, E)
            out = torch.full(tuple(q.shape), float("nan"), dtype=dtype)
            got = _vllm_plan.run_layer(plan, spec, q, k_pages, v_pages, out=out)
            ref = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(np.diff(cu_q).max()),
                                         int(k_len.max()), softmax_scale=0.2, causal=True, window_size=(
                                             (-1, -1) if sw is None else (sw - 1, 0)), block_table=table,
                                         sinks=sink, num_threads=2)
            assert torch.equal(out, ref), (dtype_name, batch, sw, sink is not None)
            assert np.shares_memory(got, out.view(torch.int16).numpy() if dtype != torch.float32 else out.numpy())
    into = [calls for calls in plan.calls.values() if calls is not False]
    assert bool(into) == (batch != "mixed_order"), (batch, dtype_name)


def test_run_layer_refuses_an_out_of_another_shape_or_dtype():
    """out must be the query's shape and dtype: a ValueError naming both, before any kernel runs."""
    torch = pytest.importorskip("torch")
    from attn.integrations import _vllm_plan

    rng = np.random.default_rng(52)
    q, cache, cu_q, k_len, table = _random_step(torch, rng, torch.float32, decode_first=True)
    E, H = q.shape[2], q.shape[1]
    k_pages, v_pages = _vllm_plan.cache_pages(cache, E)
    plan = _vllm_plan.plan_step(torch.from_numpy(cu_q.astype(np.int32)), torch.from_numpy(k_len.astype(np.int32)),
                                torch.from_numpy(table), cache.shape[0], cache.shape[2], True, 2)
    spec = _vllm_plan.layer_spec(H, E, np.dtype(np.float32), 0.2, None, None, None, None)
    for out, what in [(torch.empty(q.shape[0], H, E + 1), r"shape \(\d+, 8, 64\).*\(\d+, 8, 65\)"),
                      (torch.empty(tuple(q.shape), dtype=torch.float64), "dtype float32.*float64")]:
        with pytest.raises(ValueError, match=what):
            _vllm_plan.run_layer(plan, spec, q, k_pages, v_pages, out=out)
    assert not plan.calls


@pytest.mark.parametrize("scales", [(0.3, 2.5), (1.0, 1.0)])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_step_plan_over_float8_pages_is_flash_attn_varlen_func(fmt, scales):
    """A layer over a float8 cache (vLLM's bytes viewed as torch's float8) with vLLM's k_scale and
    v_scale equals flash_attn_varlen_func with k_descale / v_descale over the same pages, bit for bit
    (the float8 kernel itself is held to float64 in tests/test_kv_cache_float8.py). Scales of 1 (vLLM's
    default) are none to apply: the kernel writes vLLM's output itself (plan.calls), as without float8."""
    torch = pytest.importorskip("torch")
    from attn.flash import flash_attn_varlen_func
    from attn.integrations import _vllm_plan

    rng = np.random.default_rng(48)
    q, cache, cu_q, k_len, table = _random_step(torch, rng, torch.float32)
    cache = cache.to(getattr(torch, fmt))   # [num_blocks, H_kv, page, 2E]
    E, H, page = q.shape[2], q.shape[1], cache.shape[2]
    k_pages, v_pages = _vllm_plan.cache_pages(cache, E)
    plan = _vllm_plan.plan_step(torch.from_numpy(cu_q.astype(np.int32)), torch.from_numpy(k_len.astype(np.int32)),
                                torch.from_numpy(table), cache.shape[0], page, True, 2)
    spec = _vllm_plan.layer_spec(H, E, np.dtype(np.float32), 0.125, None, None, None, None)
    ours = _vllm_plan.run_layer(plan, spec, q, k_pages, v_pages, *scales, out=torch.empty(tuple(q.shape)))
    assert bool(plan.calls) == (scales == (1.0, 1.0))
    cu_k = np.concatenate([[0], np.cumsum(k_len)])
    ref = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(np.diff(cu_q).max()), int(k_len.max()),
                                 softmax_scale=0.125, causal=True, block_table=table, num_threads=2,
                                 k_descale=scales[0], v_descale=scales[1])
    np.testing.assert_array_equal(ours, ref.numpy())


@needs_vllm
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_float8_cache_holds_vllm_writers_bytes(kv_cache_dtype):
    """attn's cache update stores, for every value (zeros, saturated, subnormal, scaled), the byte vLLM's
    own writer (cpu_attn_reshape_and_cache, read back from its layout) stores: the cache holds the same
    numbers whichever kernel runs. Skipped where vLLM has no float8 writer (no AVX-512)."""
    torch = pytest.importorskip("torch")
    import vllm._custom_ops as ops

    from attn.integrations._vllm_backend import _FLOAT8, float8_bytes_as_cpu_attn

    if not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM writes float8 caches only on AVX-512 or AMX CPUs")
    rng = np.random.default_rng(49)
    T, H_kv, E, page, n_blocks = 50, 2, 64, 32, 4
    for scale in (1.0, 0.3, 7.0):
        x = rng.standard_normal((T, H_kv, E)) * np.exp(rng.uniform(-12, 8, (T, H_kv, E)))
        x[0, 0, :4] = [0.0, -0.0, 1e9, -1e9]
        k, v = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(x[::-1].astype(np.float32))
        cache = torch.zeros(n_blocks, H_kv, page, 2 * E, dtype=torch.uint8)
        k_cache, v_cache = cache.view(n_blocks, H_kv, 2 * page, E).chunk(2, dim=2)
        slots = torch.from_numpy(rng.permutation(n_blocks * page)[:T]).long()
        ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, "vec", k_scale=scale, v_scale=scale,
                                       kv_cache_dtype=kv_cache_dtype)
        block, offset = slots // page, slots % page
        theirs_v = v_cache[block, :, offset]                                                   # [T, H_kv, E]
        theirs_k = k_cache.reshape(n_blocks, H_kv, E, page)[block, :, :, offset]   # (K: [E, page] per block, head)
        fmt = _FLOAT8[kv_cache_dtype]
        assert torch.equal(float8_bytes_as_cpu_attn(k, scale, fmt), theirs_k), (kv_cache_dtype, scale)
        assert torch.equal(float8_bytes_as_cpu_attn(v, scale, fmt), theirs_v), (kv_cache_dtype, scale)


def test_step_plan_refuses_inconsistent_steps():
    torch = pytest.importorskip("torch")
    from attn.integrations import _vllm_plan

    table = torch.zeros((2, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 1 has 5 new tokens but only 4 keys"):
        _vllm_plan.plan_step([0, 1, 6], [3, 4], table, 4, 32, True, 1)
    with pytest.raises(ValueError, match="not a page of the cache"):
        _vllm_plan.plan_step([0, 1, 2], [3, 40], torch.tensor([[0, 0], [1, 9]], dtype=torch.int32), 4, 32, True, 1)


# ------------------------------------------------------------------ vLLM: registration
@needs_vllm
def test_register_follows_attn_vllm_and_the_version(monkeypatch, caplog):
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from attn.integrations import vllm as plugin

    cpu = AttentionBackendEnum.CPU_ATTN
    try:
        monkeypatch.delenv("ATTN_VLLM", raising=False)
        assert plugin.register() is False and not cpu.is_overridden()
        monkeypatch.setenv("ATTN_VLLM", "1")
        monkeypatch.setattr(vllm, "__version__", "0.33.0")
        with caplog.at_level("WARNING", logger="vllm.attn"):
            assert plugin.register() is False and not cpu.is_overridden()
        assert "tested with vLLM 0.32.x, not 0.33.0: vLLM's own CPU attention runs" in caplog.text
        monkeypatch.setattr(vllm, "__version__", "0.32.0")
        assert plugin.register() is True
        backend = cpu.get_class()
        assert backend is plugin.AttnBackend and backend.get_name() == "CPU_ATTN"
        assert AttentionBackendEnum[backend.get_name()] is cpu
    finally:
        cpu.clear_override()


# ------------------------------------------------------------------ vLLM: engines
def _engine_env(meta):
    """The engines' environment: attn's metadata and the repository first on the path, a small KV
    cache, offline; ATTN_VLLM and VLLM_PLUGINS as each run sets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATTN_VLLM", "VLLM_PLUGINS")}
    paths = [str(meta), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


class EngineJob:
    """``runs`` (tests/_vllm_engine.py's format) in one subprocess, started at once; :meth:`wait` for them.

    The module's two sets of engines (SmolLM2's, the tiny models') each run in their own subprocess,
    started together (fixture ``engine_jobs``): an engine spends much of its time on one core (loading,
    compiling, a step's Python), so two beside each other finish sooner than one after the other."""

    def __init__(self, runs, folder, meta):
        folder.mkdir(parents=True, exist_ok=True)
        self.n, self.out, self.log = len(runs), folder / "out.json", folder / "log.txt"
        self.deadline = time.monotonic() + ENGINE_TIMEOUT   # (from the start: the jobs run side by side)
        job = folder / "job.json"
        job.write_text(json.dumps({"runs": runs}))
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(ENGINE), str(job), str(self.out)], env=_engine_env(meta),
                                         cwd=folder, stdout=f, stderr=subprocess.STDOUT)

    def wait(self):
        """Returns
        -------
        results : list of dict, one per run
        logs : list of str, the output printed while each run ran
        """
        try:
            code = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the engines' subprocess ran past {ENGINE_TIMEOUT} s ({self.log}):\n"
                        f"{self.log.read_text()[-4000:]}")
        text = self.log.read_text()
        assert code == 0, f"the engines' subprocess failed ({self.log}):\n{text[-4000:]}"
        logs = text.split("[_vllm_engine] run ")[: self.n]
        return json.loads(self.out.read_text())["results"], logs

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _runs(model, prompts, calls, variants, **llm):
    """One run per (name, env, llm overrides) of ``variants``."""
    return {name: {"env": env, "llm": dict(llm, model=str(model), **extra), "prompts": prompts, "calls": calls}
            for name, env, extra in variants}


ATTN, NATIVE = {"ATTN_VLLM": "1"}, {"ATTN_VLLM": None}


def _text_tokens(tokenizer_dir):
    """Token ids of a long natural text that does not change with this repository (argparse's source)."""
    import argparse

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)(inspect.getsource(argparse))["input_ids"]


def hf_logit_scales(model_dir, sequences):
    """``max |logit|`` at each position of each sequence, by transformers in float32 (the bounds' scale)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0].abs().amax(-1).numpy() for seq in sequences]


def _model_sizes(model_dir):
    """(n_layer, d_model, d_ff) of a checkpoint for the float32 bound (a mixture of experts: the experts a
    token goes through, summed)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    d_ff = c["intermediate_size"] * c.get("num_experts_per_tok", 1)
    return c["num_hidden_layers"], c["hidden_size"], d_ff


def assert_float32_close(ours, ref, prompts, scales, sizes, what):
    """Prompt log-probabilities within twice the float32 logit bound at each position; greedy tokens equal
    up to the first step whose top-2 gap is within the tie threshold. ``scales[i]``: per position of
    prompt i + its generated tokens."""
    worst, compared = 0.0, 0
    for i, (a, b) in enumerate(zip(ours["logprobs"], ref["logprobs"])):
        bound = 2 * np.array([float32_logit_bound(*sizes, s) for s in scales[i][: len(prompts[i]) - 1]])
        err = np.abs(np.array(a) - np.array(b))
        assert (err <= bound).all(), f"{what} prompt {i}: log-probability off by {err.max():.3g} at token " \
                                     f"{int(np.argmax(err / bound))} (bound {bound[np.argmax(err / bound)]:.3g})"
        worst = max(worst, float((err / bound).max()))
    for i, (a, b) in enumerate(zip(ours["greedy"], ref["greedy"])):
        n = len(prompts[i])
        gaps = [t[0] - t[1] for t in b["top2"]]
        steps = scales[i][n - 1: n - 1 + len(gaps)]
        ties = [tie_threshold(float32_logit_bound(*sizes, s)) for s in steps]
        c, differs = _compare(a["tokens"], b["tokens"], gaps, ties)
        assert differs is None, f"{what} prompt {i}: greedy token {differs} differs ({a['tokens']} vs {b['tokens']})"
        compared += c
    return worst, compared


def _compare(tokens_a, tokens_b, gaps, ties):
    """attn.apps.models._rounding.compare_greedy with a tie threshold per step: ``(compared, differs_at)``."""
    for t, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if gaps[t] <= ties[t]:
            return t, None
        if a != b:
            return t + 1, t
    return min(len(tokens_a), len(tokens_b)), None


def _calls(first, rest, new_tokens):
    """Greedy generation of prompt ``first`` (filling the prefix cache), then of ``rest`` (reading it,
    their prefills chunked and batched with decode rows), then every prompt's teacher-forced
    log-probabilities (vLLM reads no cached prefix for those)."""
    everyone = [first] + list(rest)
    return [{"prompts": [first], "sampling": {"max_tokens": new_tokens}},
            {"prompts": list(rest), "sampling": {"max_tokens": new_tokens}},
            {"prompts": sorted(everyone), "sampling": {"max_tokens": 1, "prompt_logprobs": 1}}]


def views(result):
    """One run's outputs by prompt: ``greedy`` (tokens, top2, num_cached_tokens) and ``logprobs``."""
    assert "error" not in result, result.get("error")
    first, rest, forced = result["calls"]
    return {"greedy": first + rest, "logprobs": [o["prompt_logprobs"] for o in forced]}


def _shared_prefix_prompts(tokens, prefix, lengths, short):
    """Prompts of ``lengths`` tokens that start with the same ``prefix`` tokens (their continuations
    differ), then ``short`` prompts of their own."""
    prompts = [tokens[:prefix] + tokens[prefix + 500 * i: prefix + 500 * i + n - prefix] for i, n in enumerate(lengths)]
    at = prefix + 500 * len(lengths) + 1000
    for n in short:
        prompts.append(tokens[at: at + n])
        at += n + 100
    return prompts


# SmolLM2-135M-Instruct, real weights: 10 prompts of 20-1,000 tokens, 8 sharing a 200-token prefix
# (one full page of 128), prefills chunked at 512 tokens
SMOL_LENGTHS, SMOL_SHORT, SMOL_PREFIX, SMOL_BATCH = [1000, 800, 640, 512, 400, 300, 256, 210], [20, 64], 200, 512


@pytest.fixture(scope="module")
def smol_model(tmp_path_factory):
    """SmolLM2-135M-Instruct's checkpoint, converted once per run (its tokenizer also serves the tiny models)."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed: run from vLLM's environment (docs/vllm.md: .venv-vllm)")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed in vLLM's environment (pip install gguf accelerate): "
                        "SmolLM2's GGUF cannot be converted")
    try:
        return _vllm_models.smollm2(tmp_path_factory.mktemp("vllm_models"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def engine_jobs(request, smol_model, tmp_path_factory):
    """The engines' subprocesses of the fixtures the collected tests use (``smol``, ``tiny``), started
    together (EngineJob): ``{name: (job, what its fixture needs to read the results)}``."""
    used = {name for item in request.session.items for name in ("smol", "tiny")
            if name in getattr(item, "fixturenames", ())}
    base = tmp_path_factory.mktemp("vllm_engines")
    meta = _vllm_models.plugin_metadata(base / "meta")
    jobs = {}
    try:
        if "smol" in used:
            jobs["smol"] = _smol_job(smol_model, base / "smol", meta)
        if "tiny" in used:
            jobs["tiny"] = _tiny_job(smol_model, base / "tiny", meta)
        yield jobs
    finally:
        for job, _ in jobs.values():
            job.stop()


def _smol_job(model, base, meta):
    """SmolLM2's engines: float32 and bfloat16, vLLM's kernel (ATTN_VLLM unset, enforce_eager) and attn's
    (float32: vLLM's default compiled mode; bfloat16: enforce_eager)."""
    prompts = _shared_prefix_prompts(_text_tokens(model), SMOL_PREFIX, SMOL_LENGTHS, SMOL_SHORT)
    calls = _calls(0, range(1, len(prompts)), 16)
    runs = _runs(model, prompts, calls, [
        ("f32_native", NATIVE, dict(dtype="float32", enforce_eager=True)),
        ("f32_attn", ATTN, dict(dtype="float32")),
        ("bf16_native", NATIVE, dict(dtype="bfloat16", enforce_eager=True)),
        ("bf16_attn", ATTN, dict(dtype="bfloat16", enforce_eager=True)),
    ], max_model_len=2048, max_num_batched_tokens=SMOL_BATCH, enable_prefix_caching=True, seed=0)
    return EngineJob(list(runs.values()), base / "engines", meta), (list(runs), prompts)


@pytest.fixture(scope="module")
def smol(smol_model, engine_jobs):
    """SmolLM2's engines' results (_smol_job), with transformers' logit scales for the float32 bound."""
    job, (names, prompts) = engine_jobs["smol"]
    results, logs = job.wait()
    out = {name: dict(result=r, log=log) for name, r, log in zip(names, results, logs)}
    greedy = views(out["f32_native"]["result"])["greedy"]
    sequences = [p + g["tokens"] for p, g in zip(prompts, greedy)]
    return dict(runs=out, prompts=prompts, model=smol_model, scales=hf_logit_scales(smol_model, sequences))


def test_smollm2_attn_runs_only_when_asked(smol):
    """attn's announcement (version, SIMD path) is printed by the engines with ATTN_VLLM=1, and only by them."""
    for name, run in smol["runs"].items():
        assert (ANNOUNCED in run["log"]) == name.endswith("_attn"), name


def test_smollm2_prefix_caching_and_chunked_prefill_ran(smol):
    """The prompts sharing the first one's prefix found its full pages cached, in every engine; the longest
    prompts were longer than a step's token budget (their prefills chunked)."""
    assert max(SMOL_LENGTHS) > SMOL_BATCH
    for name, run in smol["runs"].items():
        cached = [g["num_cached_tokens"] for g in views(run["result"])["greedy"]]
        assert all(c >= PAGE for c in cached[1:len(SMOL_LENGTHS)]), (name, cached)


def test_smollm2_float32_matches_vllm_kernel(smol):
    """float32: prompt log-probabilities within the derived bound, greedy tokens equal up to a near tie."""
    runs = smol["runs"]
    worst, compared = assert_float32_close(views(runs["f32_attn"]["result"]), views(runs["f32_native"]["result"]),
                                           smol["prompts"], smol["scales"], _model_sizes(smol["model"]), "SmolLM2")
    assert compared >= 16, f"only {compared} greedy steps were clear of a near tie"


def test_smollm2_bfloat16_within_the_spread_of_vllm_kernel(smol):
    """bfloat16: attn's log-probabilities deviate from vLLM's bfloat16 kernel by at most twice vLLM's own
    bfloat16 spread around its float32 evaluation (largest and mean); greedy tokens equal while vLLM's
    top-2 gap exceeds twice the largest spread."""
    runs = {name: views(run["result"]) for name, run in smol["runs"].items()}
    flat = lambda name: np.concatenate([np.array(x) for x in runs[name]["logprobs"]])
    spread = np.abs(flat("bf16_native") - flat("f32_native"))
    err = np.abs(flat("bf16_attn") - flat("bf16_native"))
    assert err.max() <= 2 * spread.max(), f"largest deviation {err.max():.3g} > 2 x {spread.max():.3g}"
    assert err.mean() <= 2 * spread.mean(), f"mean deviation {err.mean():.3g} > 2 x {spread.mean():.3g}"
    for i, (a, b) in enumerate(zip(runs["bf16_attn"]["greedy"], runs["bf16_native"]["greedy"])):
        gaps = [t[0] - t[1] for t in b["top2"]]
        _, differs = _compare(a["tokens"], b["tokens"], gaps, [2 * spread.max()] * len(gaps))
        assert differs is None, f"prompt {i}: greedy token {differs} differs"


# Tiny random-weight models (tests/_vllm_models.py's TINY): windows, softcap, MQA, sinks; float32, enforce_eager
TINY_LENGTHS, TINY_SHORT, TINY_PREFIX, TINY_BATCH = [300, 260, 200, 150], [33], 140, 128


def _tiny_job(tokenizer, base, meta):
    """Per tiny model: vLLM's kernel (ATTN_VLLM unset) and attn's; Gemma 2 also with VLLM_PLUGINS=""
    (attn's plugin not loaded) and with attn in non-causal mode (refused: its sliding windows);
    gpt-oss also with an fp8 cache (each kernel)."""
    prompts = _shared_prefix_prompts(_text_tokens(tokenizer), TINY_PREFIX, TINY_LENGTHS, TINY_SHORT)
    calls = _calls(0, range(1, len(prompts)), 8)
    common = dict(dtype="float32", enforce_eager=True, max_model_len=1024, max_num_batched_tokens=TINY_BATCH,
                  enable_prefix_caching=True, seed=0)
    runs, models = {}, {}
    for kind in _vllm_models.TINY:
        models[kind] = _vllm_models.tiny(kind, base / kind, tokenizer)
        variants = [(f"{kind}_native", NATIVE, {}), (f"{kind}_attn", ATTN, {})]
        if kind == "gemma2":
            variants.append(("gemma2_excluded", {"VLLM_PLUGINS": ""}, {}))
        runs.update(_runs(models[kind], prompts, calls, variants, **common))
    # (vLLM's float8 kernel needs head sizes divisible by 32: gpt-oss's 64, not Gemma's 80 and 112)
    runs.update(_runs(models["gpt_oss"], prompts, calls, [("gpt_oss_fp8_native", NATIVE, dict(kv_cache_dtype="fp8")),
                                                          ("gpt_oss_fp8_attn", ATTN, dict(kv_cache_dtype="fp8"))],
                      **common))
    runs.update(_runs(models["gemma2"], prompts, calls,
                      [("gemma2_noncausal", ATTN, dict(attention_config={"use_non_causal": True}))], **common))
    return EngineJob(list(runs.values()), base / "engines", meta), (list(runs), prompts, models)


@pytest.fixture(scope="module")
def tiny(engine_jobs):
    """The tiny models' engines' results (_tiny_job), with transformers' logit scales for the float32 bound."""
    job, (names, prompts, models) = engine_jobs["tiny"]
    results, logs = job.wait()
    out = {name: dict(result=r, log=log) for name, r, log in zip(names, results, logs)}
    scales = {}
    for kind, model in models.items():
        greedy = views(out[f"{kind}_native"]["result"])["greedy"]
        scales[kind] = hf_logit_scales(model, [p + g["tokens"] for p, g in zip(prompts, greedy)])
    return dict(runs=out, prompts=prompts, models=models, scales=scales)


@pytest.mark.parametrize("kind", list(_vllm_models.TINY))
def test_tiny_models_match_vllm_kernel(tiny, kind):
    """Gemma 2 (windows every other layer, softcap, head size 80), Gemma 3 (5 windowed layers to 1 global, MQA,
    head size 112), gpt-oss (sinks, windows): float32 log-probabilities within the derived bound, greedy
    tokens equal up to a near tie; attn announced by attn's engine only."""
    runs = tiny["runs"]
    assert ANNOUNCED in runs[f"{kind}_attn"]["log"] and ANNOUNCED not in runs[f"{kind}_native"]["log"]
    _, compared = assert_float32_close(views(runs[f"{kind}_attn"]["result"]),
                                       views(runs[f"{kind}_native"]["result"]), tiny["prompts"], tiny["scales"][kind],
                                       _model_sizes(tiny["models"][kind]), kind)
    assert compared >= 8, f"{kind}: only {compared} greedy steps were clear of a near tie"


def test_attn_vllm_unset_leaves_vllm_untouched(tiny):
    """With ATTN_VLLM unset (attn's plugin loaded, doing nothing) the outputs are bit for bit those of an
    engine that does not load attn's plugin at all (VLLM_PLUGINS="")."""
    runs = tiny["runs"]
    assert ANNOUNCED not in runs["gemma2_native"]["log"] + runs["gemma2_excluded"]["log"]
    assert runs["gemma2_native"]["result"] == runs["gemma2_excluded"]["result"]


def test_fp8_cache_matches_vllm_kernel(tiny):
    """gpt-oss (sinks, windows) with kv_cache_dtype="fp8" (e4m3fn, k_scale = v_scale = 1): both kernels
    read a cache of the same bytes
    (test_float8_cache_holds_vllm_writers_bytes), so their outputs differ by float32 rounding alone:
    within the float32 bound, as the float caches are. Where vLLM has no float8 kernel (no AVX-512),
    its engine refuses to start and attn's serves (the kernel is then held to float64 by
    tests/test_kv_cache_float8.py on this CPU's paths)."""
    runs = tiny["runs"]
    attn_run, native = runs["gpt_oss_fp8_attn"], runs["gpt_oss_fp8_native"]
    assert ANNOUNCED in attn_run["log"] and "error" not in attn_run["result"], attn_run["log"][-3000:]
    if "error" in native["result"]:
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in native["log"], native["log"][-3000:]
        pytest.skip("vLLM's own kernel has no float8 cache on this CPU (no AVX-512): attn's ran alone")
    _, compared = assert_float32_close(views(attn_run["result"]), views(native["result"]), tiny["prompts"],
                                       tiny["scales"]["gpt_oss"], _model_sizes(tiny["models"]["gpt_oss"]),
                                       "gpt-oss fp8")
    assert compared >= 8, f"gpt-oss fp8: only {compared} greedy steps were clear of a near tie"


def test_unserved_configuration_refused_at_engine_start(tiny):
    """Gemma 2's sliding windows in non-causal attention with ATTN_VLLM=1: the engine does not start, and
    says what is not served and what to do."""
    run = tiny["runs"]["gemma2_noncausal"]
    assert "error" in run["result"]
    assert ("UnservedConfigurationError: attn's vLLM attention backend (ATTN_VLLM=1) does not serve "
            "a sliding window in non-causal attention") in run["log"], run["log"][-3000:]
    assert "Unset ATTN_VLLM to run vLLM's own CPU attention" in run["log"]
