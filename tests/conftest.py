"""Shared helpers: random inputs and torch as the independent reference."""

import sys

import numpy as np
import pytest
import torch

import attn

BACKENDS = ("loop", "numpy", "online", "cython")
#: The backends that compute in Python and NumPy, not in attn's compiled kernels.
PYTHON_BACKENDS = ("loop", "numpy", "online")


def torch_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on NumPy arrays (float64 out)."""
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            t(q), t(k), t(v), attn_mask=t(attn_mask), is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    return out.numpy()


def torch_weights(q, k, attn_mask=None, is_causal=False, scale=None):
    """Explicit attention weights, computed with torch ops in float64.

    Fully masked rows are 0 (what torch's SDPA CPU kernels return).
    """
    q, k = torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(k))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        L, S = scores.shape[-2:]
        attn_mask = np.tril(np.ones((L, S), dtype=bool))
    if attn_mask is not None:
        m = torch.from_numpy(np.ascontiguousarray(attn_mask))
        scores = scores.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else scores + m
    w = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(w, nan=0.0).numpy()


@pytest.fixture
def rng():
    return np.random.default_rng(20261012)


def make_qkv(rng, lead, L, S, E, Ev=None, dtype=np.float64):
    Ev = E if Ev is None else Ev
    q = rng.standard_normal(lead + (L, E)).astype(dtype)
    k = rng.standard_normal(lead + (S, E)).astype(dtype)
    v = rng.standard_normal(lead + (S, Ev)).astype(dtype)
    return q, k, v


def mask_of_kind(kind, rng, lead, L, S):
    """A mask [*lead, L, S] of ``kind``: "bool" (random, every row keeps a key), "float"
    (normal noise added to the scores); None for any other kind (none, or causal by flag)."""
    if kind == "bool":
        return random_bool_mask(rng, lead + (L, S))
    if kind == "float":
        return rng.standard_normal(lead + (L, S))
    return None


@pytest.fixture(params=attn._kernels.simd_paths() if attn.backends()["cython"] else [])
def simd(request):
    """Run the test on each SIMD path this CPU has (the kernels' path switched, then restored)."""
    from attn import _kernels_testing  # built with the kernels (params is empty without them)

    previous = _kernels_testing.select_simd(request.param)
    yield request.param
    _kernels_testing.select_simd(previous)


def torch_sdpa64(q, k, v, attn_mask=None, **kw):
    """:func:`torch_sdpa` in float64 on exactly the values given (a float mask cast too: torch wants
    it in q's dtype), whatever their dtype: the reference for a float32/float16/bfloat16 result."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        attn_mask = f64(attn_mask)
    return torch_sdpa(f64(q), f64(k), f64(v), attn_mask=attn_mask, **kw)


def gradient_tolerance(ref, err_torch, rule=3.0, dtype=np.float32):
    """Largest max |attn - ref| accepted for a result whose exact value is ``ref`` (float64) when
    torch's result in ``dtype`` is off by ``err_torch``: ``rule`` times torch's error, or times
    one ``eps`` of the result's scale when torch happens to be (nearly) exact."""
    return rule * max(float(err_torch), float(np.finfo(dtype).eps) * float(np.max(np.abs(ref))))


#: Runs ``python -m attn`` with some modules made unimportable (None in sys.modules):
#: ``[sys.executable, "-c", BLOCKED, "mod1,mod2", *args]`` (:func:`attn_command`).
BLOCKED = (
    "import runpy, sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = ['attn'] + sys.argv[2:]\n"
    "runpy.run_module('attn', run_name='__main__')\n"
)


def attn_command(*args, without=None):
    """The command line of ``python -m attn ARGS``, ``without`` (module names) made unimportable."""
    if without:
        return [sys.executable, "-c", BLOCKED, ",".join(without), *args]
    return [sys.executable, "-m", "attn", *args]


def random_bool_mask(rng, shape):
    """Random True = takes part mask in which every row keeps at least one key."""
    m = rng.random(shape) < 0.7
    m[..., 0] = True
    return m


# --------------------------------------------------------------------------
# Hardening: hypothesis profiles and the `slow` marker (see README, "Hardening")

import os  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" (the default) keeps the whole pytest run fast; "dev" is for local soak
# runs: HYPOTHESIS_PROFILE=dev python -m pytest tests/test_properties.py
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False,
        help="also run tests marked slow (CI runs them in a separate step)",
    )
    parser.addoption(
        "--compiled-only", action="store_true", default=False,
        help="leave out the cases of a test parametrized on a pure-Python backend "
             f"(backend={'/'.join(PYTHON_BACKENDS)}): what a checked build (debug, sanitizers) adds "
             "is checks on compiled code, which those cases leave to NumPy (.ci/run)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes more than ~20 s (e.g. L*S > 2**31); skipped unless --run-slow"
    )


def pytest_collection_modifyitems(config, items):
    # The real model's tests first (in their order; the rest keep theirs): under pytest-xdist the
    # first worker then takes all of them at the start, and their module fixtures load the model
    # once, instead of the last tests of the run being split over the workers that each load it.
    items.sort(key=lambda item: item.get_closest_marker("model") is None)
    if config.getoption("--compiled-only"):
        python_only = [item for item in items if on_python_backend(item)]
        if python_only:
            config.hook.pytest_deselected(items=python_only)
            items[:] = [item for item in items if not on_python_backend(item)]
    if config.getoption("--run-slow") or os.environ.get("ATTN_RUN_SLOW", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (CI runs it with the README's suite)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def on_python_backend(item):
    """Whether ``item`` is a case of a test parametrized on a pure-Python ``backend``."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("backend") in PYTHON_BACKENDS


#: Set by CI's serving runs (.ci/run): a serving test that would be skipped for what its environment
#: lacks (transformers' serving extra, a kernels release that transformers accepts, the model wheel)
#: fails the run instead, so that a pair of releases transformers rejects cannot pass as skipped.
REQUIRE_SERVING = os.environ.get("ATTN_REQUIRE_SERVING") == "1"


def needs_serving(reason):
    """A skip mark for ``reason`` (None: nothing missing), or, under ATTN_REQUIRE_SERVING=1, a
    collection failure naming it."""
    if reason is not None and REQUIRE_SERVING:
        pytest.fail(f"ATTN_REQUIRE_SERVING=1 and this environment cannot run the serving tests: {reason}",
                    pytrace=False)
    return pytest.mark.skipif(reason is not None, reason=str(reason))
