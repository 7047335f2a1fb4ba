"""Every memory layout through the public API, including the compiled fast path.

A plain ``attn.scaled_dot_product_attention(q, k, v)`` on ndarrays is validated
and described to the kernel in compiled code (``sdpa_fast``); these tests feed
it what NumPy can express (transposes, negative, zero and overlapping strides,
broadcast batch dims, 16-bit queries read as they are, GQA with one
query row, padding masks) and hold the result to the numpy backend computed
in float64 on the same values. CI also runs them in the debug and
AddressSanitizer builds, which take the same path as a release build.

Regression: a float16 query converted with ``astype`` kept its memory order,
and the fast path then read the copy as if its batch dims were C-ordered
(wrong rows, or reads past the copy's end).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attn
from attn._build import HAVE_CYTHON

from _bounds import assert_sdpa_close

pytestmark = pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")


def numpy_reference(q, k, v, **kw):
    """The numpy backend in float64 on the values attn reads."""
    f64 = lambda a: np.asarray(a, np.float64)
    mask = kw.pop("attn_mask", None)
    if mask is not None and mask.dtype != bool:
        mask = f64(mask)
    return attn.scaled_dot_product_attention(f64(q), f64(k), f64(v), attn_mask=mask, backend="numpy", **kw)


def check(q, k, v, **kw):
    out = attn.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:-1] + v.shape[-1:]
    ref = numpy_reference(q, k, v, **kw)
    gqa = kw.pop("enable_gqa", False)
    if gqa and q.shape[-3] != k.shape[-3]:
        k, v = (np.repeat(a, q.shape[-3] // a.shape[-3], axis=-3) for a in (k, v))
    assert_sdpa_close(out, ref, q, k, v, **kw)


# --------------------------------------------------------------------------
# The reported cases

@pytest.mark.parametrize("B,E", [(2, 4), (64, 64), (16384, 128)])
def test_float16_query_with_its_batch_dim_innermost(B, E):
    """[B, 1, 1, E] stored E-major (an ordinary transpose): crashed or answered wrong."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((E, B, 1, 1)).astype(np.float16).transpose(1, 2, 3, 0)
    k = rng.standard_normal((B, 1, 16, E)).astype(np.float16)
    v = rng.standard_normal((B, 1, 16, E)).astype(np.float16)
    if B > 64:  # the crash: compare with the contiguous query (same values)
        assert np.array_equal(attn.scaled_dot_product_attention(q, k, v),
                              attn.scaled_dot_product_attention(q.copy(), k, v))
        return
    check(q, k, v)


def test_overlapping_float16_query():
    rng = np.random.default_rng(1)
    buf = rng.standard_normal(16).astype(np.float16)
    q = np.lib.stride_tricks.as_strided(buf, shape=(2, 2, 2, 1), strides=(4, 2, 4, 2))
    k = rng.standard_normal((2, 2, 3, 1)).astype(np.float16)
    v = rng.standard_normal((2, 2, 3, 1)).astype(np.float16)
    check(q, k, v)
    assert np.array_equal(attn.scaled_dot_product_attention(q, k, v),
                          attn.scaled_dot_product_attention(q.copy(), k, v))


# --------------------------------------------------------------------------
# Random layouts

def strided_view(rng, shape, dtype, strides):
    """An array of ``shape`` over a random buffer with element ``strides`` (any sign, 0 = broadcast
    or overlapping), via as_strided: every layout NumPy can express."""
    lo = sum(s * (n - 1) for n, s in zip(shape, strides) if s < 0)
    hi = sum(s * (n - 1) for n, s in zip(shape, strides) if s > 0)
    buf = rng.standard_normal(hi - lo + 1).astype(dtype)
    isz = buf.itemsize
    return np.lib.stride_tricks.as_strided(buf[-lo:], shape=shape, strides=[s * isz for s in strides])


def layout_of(draw, shape):
    """Element strides for ``shape``: C order, a transposed C order, or random (negative, zero,
    overlapping)."""
    kind = draw(st.sampled_from(["c", "permuted", "random"]))
    nd = len(shape)
    if kind == "random":
        return [draw(st.integers(-3, 3)) for _ in range(nd)], kind
    order = list(range(nd))
    if kind == "permuted":
        order = draw(st.permutations(order))
    strides, step = [0] * nd, 1
    for d in reversed(order):           # dims in memory order, innermost last
        strides[d] = step
        step *= shape[d]
    return strides, kind


DTYPES = [("float32", "float32"), ("float64", "float64"), ("float16", "float16"), ("float32", "float16")]


@st.composite
def problems(draw):
    B, Hkv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    L = draw(st.sampled_from([1, 1, 2, 5]))
    S, E, Ev = draw(st.integers(1, 40)), draw(st.integers(1, 20)), draw(st.integers(1, 12))
    q_dtype, kv_dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    lay = {}
    arrays = {}
    for name, shape, dtype in (("query", (B, Hkv * group, L, E), q_dtype), ("key", (B, Hkv, S, E), kv_dtype),
                               ("value", (B, Hkv, S, Ev), kv_dtype)):
        strides, lay[name] = layout_of(draw, shape)
        arrays[name] = strided_view(rng, shape, dtype, strides)
    kw = dict(enable_gqa=group > 1)
    mask = draw(st.sampled_from(["none", "causal", "lower_right", "pad_bool", "pad_float", "pad_bool_1d"]))
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "lower_right":
        kw["is_causal"] = "lower_right"
    elif mask.startswith("pad"):
        keep = rng.random((B, 1, 1, S)) < 0.7
        if mask == "pad_float":
            dt = np.float64 if q_dtype == "float64" else np.float32
            kw["attn_mask"] = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(dt)
        elif mask == "pad_bool_1d":
            kw["attn_mask"] = keep[0, 0, 0]
        else:
            kw["attn_mask"] = keep
    return arrays, kw, (mask, lay)


@settings(max_examples=300)
@given(problems())
def test_random_layouts_equal_the_numpy_backend(problem):
    arrays, kw, _ = problem
    check(arrays["query"], arrays["key"], arrays["value"], **kw)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_query_read_as_it_is(dtype, simd, monkeypatch):
    """A float16 or bfloat16 query over keys and values of its dtype goes to the kernel as it is from
    the fast path (attn_problem.q_raw16: no float32 copy, its values widened exactly where the kernel
    loads them), in any layout: contiguous, heads and rows swapped, E-major, GQA, one query row. The
    out is, bit for bit, that of the full path (CHECK_MEMORY_ABOVE 0 sends every call there), which
    hands the kernel a float32 copy of the query; on every SIMD path."""
    from attn import _memory

    dt = attn._dtypes.bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    B, H, L, S, E = 2, 8, 40, 300, 64
    g = lambda *shape: rng.standard_normal(shape).astype(dt)   # noqa: E731
    cases = [
        (g(B, H, L, E), g(B, H, S, E), g(B, H, S, E), {}),
        (g(B, L, H, E).transpose(0, 2, 1, 3), g(B, S, H, E).transpose(0, 2, 1, 3), g(B, H, S, E), {}),
        (g(E, B, H, L).transpose(1, 2, 3, 0), g(B, H, S, E), g(B, H, S, E), {"is_causal": True}),
        (g(B, H, L, E), g(B, 2, S, E), g(B, 2, S, E), {"enable_gqa": True}),
        (g(B, H, 1, E), g(B, 2, S, E), g(B, 2, S, E), {"enable_gqa": True}),
    ]
    fast = [attn.scaled_dot_product_attention(q, k, v, **kw) for q, k, v, kw in cases]
    monkeypatch.setattr(_memory, "CHECK_MEMORY_ABOVE", 0)
    for (q, k, v, kw), got in zip(cases, fast):
        full = attn.scaled_dot_product_attention(q, k, v, **kw)
        assert got.dtype == full.dtype == dt
        np.testing.assert_array_equal(got.view(np.uint16), full.view(np.uint16), f"{q.strides} {kw} on {simd}")
