"""Every bad argument is a clear exception, raised before any kernel runs.

The message must name the argument and, for arrays, its shape and dtype.
Covers what exists on this branch: scaled_dot_product_attention,
masked_softmax, softmax and set_num_threads.
"""

import re

import numpy as np
import pytest

import attn
from attn import _backends as backends
from conftest import make_qkv


class KernelCalled(AssertionError):
    pass


@pytest.fixture
def no_kernel(monkeypatch):
    """Any call into a backend fails the test: errors must come from validation."""

    def boom(*args, **kwargs):
        raise KernelCalled("a kernel ran before the bad argument was rejected")

    class Stub:
        attention = masked_softmax = staticmethod(boom)

    monkeypatch.setattr(backends.fused, "_kernels", Stub)
    for impl in backends.ATTENTION.values():
        monkeypatch.setattr(impl, "forward", boom)
        if hasattr(impl, "masked_softmax_forward"):
            monkeypatch.setattr(impl, "masked_softmax_forward", boom)


Q, K, V = make_qkv(np.random.default_rng(0), (2,), 5, 6, 4, 3, np.float32)

# (id, kwargs for scaled_dot_product_attention, exception, regexes the message must match)
SDPA_CASES = [
    ("query_1d", dict(query=np.zeros(4, np.float32)), ValueError,
     [r"query", r"\(4,\)", "float32"]),
    ("key_0d", dict(key=np.float32(1.0)), ValueError, [r"key", r"\(\)", "float32"]),
    ("value_1d", dict(value=np.zeros(6, np.float32)), ValueError, [r"value", r"\(6,\)"]),
    ("E_mismatch", dict(key=np.zeros((2, 6, 5), np.float32)), ValueError,
     [r"query", r"\(2, 5, 4\)", r"key", r"\(2, 6, 5\)", "float32"]),
    ("S_mismatch", dict(value=np.zeros((2, 7, 3), np.float32)), ValueError,
     [r"key", r"\(2, 6, 4\)", r"value", r"\(2, 7, 3\)"]),
    ("lead_no_broadcast", dict(key=np.zeros((3, 6, 4), np.float32), value=np.zeros((3, 6, 3), np.float32)),
     ValueError, [r"query", r"\(2, 5, 4\)", r"key", r"\(3, 6, 4\)"]),
    ("mask_no_broadcast", dict(attn_mask=np.ones((5, 7), bool)), ValueError,
     [r"attn_mask", r"\(5, 7\)", "bool", r"\(2, 5, 6\)"]),
    ("mask_too_many_dims", dict(attn_mask=np.ones((3, 2, 5, 6), bool)), ValueError,
     [r"attn_mask", r"\(3, 2, 5, 6\)"]),
    ("mask_int", dict(attn_mask=np.ones((5, 6), np.int64)), TypeError, [r"attn_mask", "int64", r"\(5, 6\)"]),
    ("mask_uint8", dict(attn_mask=np.ones((5, 6), np.uint8)), TypeError, [r"attn_mask", "uint8"]),
    ("mask_complex", dict(attn_mask=np.ones((5, 6), complex)), TypeError, [r"attn_mask", "complex128"]),
    ("mask_object", dict(attn_mask=np.ones((5, 6), object)), TypeError, [r"attn_mask", "object"]),
    ("mask_str", dict(attn_mask="causal"), TypeError, [r"attn_mask", "<U6"]),
    ("mask_ragged", dict(attn_mask=[[True], [True, False]]), TypeError, [r"attn_mask"]),
    ("query_int", dict(query=np.ones((2, 5, 4), np.int32)), TypeError, [r"query", "int32", r"\(2, 5, 4\)"]),
    ("key_bool", dict(key=np.ones((2, 6, 4), bool)), TypeError, [r"key", "bool"]),
    ("value_complex", dict(value=np.ones((2, 6, 3), np.complex64)), TypeError, [r"value", "complex64"]),
    ("query_object", dict(query=np.ones((2, 5, 4), object)), TypeError, [r"query", "object"]),
    ("query_str", dict(query="hello"), TypeError, [r"query", "<U5"]),
    ("query_ragged", dict(query=[[1.0, 2.0], [3.0]]), TypeError, [r"query"]),
    ("query_none", dict(query=None), TypeError, [r"query", "None"]),
    ("query_longdouble", dict(query=np.ones((2, 5, 4), np.longdouble)), TypeError, [r"query"]),
    ("dtype_mix", dict(key=K.astype(np.float64)), TypeError,
     [r"query", "float32", r"key", "float64", r"value"]),
    ("dtype_mix_f16", dict(value=V.astype(np.float16)), TypeError, [r"value", "float16"]),
    ("gqa_not_divisible", dict(query=np.zeros((2, 3, 5, 4), np.float32), key=np.zeros((2, 2, 6, 4), np.float32),
                               value=np.zeros((2, 2, 6, 3), np.float32), enable_gqa=True),
     ValueError, [r"enable_gqa", r"query", r"\(2, 3, 5, 4\)", r"key", r"\(2, 2, 6, 4\)"]),
    ("gqa_kv_heads_differ", dict(query=np.zeros((2, 4, 5, 4), np.float32), key=np.zeros((2, 2, 6, 4), np.float32),
                                 value=np.zeros((2, 1, 6, 3), np.float32), enable_gqa=True),
     ValueError, [r"enable_gqa", r"key", r"value", r"\(2, 1, 6, 3\)"]),
    ("gqa_zero_kv_heads", dict(query=np.zeros((2, 4, 5, 4), np.float32), key=np.zeros((2, 0, 6, 4), np.float32),
                               value=np.zeros((2, 0, 6, 3), np.float32), enable_gqa=True),
     ValueError, [r"enable_gqa", r"\(2, 0, 6, 4\)"]),
    ("heads_differ_without_gqa", dict(query=np.zeros((2, 4, 5, 4), np.float32), key=np.zeros((2, 2, 6, 4), np.float32),
                                      value=np.zeros((2, 2, 6, 3), np.float32)),
     ValueError, [r"query", r"\(2, 4, 5, 4\)", r"key", r"\(2, 2, 6, 4\)"]),
    ("dropout_1", dict(dropout_p=1.0), ValueError, [r"dropout_p", r"1\.0"]),
    ("dropout_neg", dict(dropout_p=-0.1), ValueError, [r"dropout_p", r"-0\.1"]),
    ("dropout_nan", dict(dropout_p=float("nan")), ValueError, [r"dropout_p", "nan"]),
    ("dropout_str", dict(dropout_p="0.1"), TypeError, [r"dropout_p"]),
    ("dropout_cython", dict(dropout_p=0.1, backend="cython"), ValueError, [r"cython", "dropout"]),
    ("dropout_bad_rng", dict(dropout_p=0.1, backend="numpy", rng=42), TypeError, [r"rng", "int"]),
    ("backend_unknown", dict(backend="torch"), ValueError, [r"backend", "'torch'"]),
    ("backend_case", dict(backend="Cython"), ValueError, [r"backend", "'Cython'"]),
    ("backend_none", dict(backend=None), ValueError, [r"backend", "None"]),
    ("threads_0", dict(num_threads=0), ValueError, [r"num_threads", "0"]),
    ("threads_neg", dict(num_threads=-2), ValueError, [r"num_threads", "-2"]),
    ("threads_huge", dict(num_threads=2**31), ValueError, [r"num_threads", "2147483648"]),
    ("threads_float", dict(num_threads=2.0), TypeError, [r"num_threads", r"2\.0"]),
    ("threads_bool", dict(num_threads=True), TypeError, [r"num_threads", "True"]),
    ("mask_and_causal", dict(attn_mask=np.ones((5, 6), bool), is_causal=True), ValueError,
     [r"attn_mask", r"is_causal"]),
    ("mask_and_lower_right", dict(attn_mask=np.zeros((5, 6), np.float32), is_causal="lower_right"),
     ValueError, [r"attn_mask", r"is_causal"]),
    ("causal_unknown", dict(is_causal="upper"), ValueError, [r"is_causal", "'upper'"]),
    ("causal_int", dict(is_causal=1), ValueError, [r"is_causal", "1"]),
    ("scale_nan", dict(scale=float("nan")), ValueError, [r"scale", "nan"]),
    ("scale_inf", dict(scale=float("inf")), ValueError, [r"scale", "inf"]),
    ("scale_str", dict(scale="1"), TypeError, [r"scale"]),
    ("scale_array", dict(scale=np.ones(2)), TypeError, [r"scale"]),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_rejects(case, no_kernel):
    _, kwargs, exc, patterns = case
    args = dict(query=Q, key=K, value=V)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        attn.scaled_dot_product_attention(**args)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)


@pytest.mark.parametrize("backend", ["auto", "loop", "numpy", "cython"])
def test_return_weights_too_large_is_memory_error(backend, no_kernel):
    """L x S weights that cannot fit: MemoryError stating the size, not an OS kill.

    Broadcast inputs make the huge shape free to describe.
    """
    q = np.broadcast_to(np.float32(1), (4, 10**6, 8))  # [B, L, E], stride 0
    k = np.broadcast_to(np.float32(1), (4, 10**6, 8))
    with pytest.raises(MemoryError, match=r"GiB.*4000000000000 elements x 4 bytes"):
        attn.scaled_dot_product_attention(q, k, k, backend=backend, return_weights=True)


def test_numpy_backend_checks_memory_without_weights(no_kernel):
    """The matrix version builds L x S scores even when the weights are not returned."""
    q = np.broadcast_to(np.float32(1), (4, 10**6, 8))
    with pytest.raises(MemoryError, match="backend='numpy'.*GiB"):
        attn.scaled_dot_product_attention(q, q, q, backend="numpy")


def test_loop_backend_without_weights_keeps_one_row():
    """The loop holds one row of weights at a time unless they are returned."""
    import tracemalloc

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1500, 4))  # L x S float64 weights would be 18 MB
    tracemalloc.start()
    try:
        attn.scaled_dot_product_attention(q, q, q, backend="loop")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak


def test_output_too_large_is_memory_error(no_kernel):
    q = np.broadcast_to(np.float32(1), (10**6, 10**4, 1))
    v = np.broadcast_to(np.float32(1), (10**6, 2, 10**4))
    with pytest.raises(MemoryError, match="output"):
        attn.scaled_dot_product_attention(q, q[:, :2], v, backend="cython")


X = np.zeros((3, 5), np.float32)
SOFTMAX_CASES = [
    ("x_0d", dict(x=np.float32(1)), ValueError, [r"\bx\b", r"\(\)", "float32"]),
    ("x_int", dict(x=np.ones((3, 5), np.int16)), TypeError, [r"\bx\b", "int16", r"\(3, 5\)"]),
    ("x_complex", dict(x=np.ones((3, 5), complex)), TypeError, [r"\bx\b", "complex128"]),
    ("x_object", dict(x=np.ones((3, 5), object)), TypeError, [r"\bx\b", "object"]),
    ("x_str", dict(x="abc"), TypeError, [r"\bx\b", "<U3"]),
    ("x_ragged", dict(x=[[1.0], [1.0, 2.0]]), TypeError, [r"\bx\b"]),
    ("x_none", dict(x=None), TypeError, [r"\bx\b"]),
    ("mask_int", dict(mask=np.ones((3, 5), np.int8)), TypeError, [r"mask", "int8", r"\(3, 5\)"]),
    ("mask_shape", dict(mask=np.ones((4, 5), bool)), ValueError, [r"mask", r"\(4, 5\)", "bool", r"\(3, 5\)"]),
    ("mask_more_dims", dict(mask=np.ones((2, 3, 5), bool)), ValueError, [r"mask", r"\(2, 3, 5\)"]),
    ("axis_range", dict(axis=2), ValueError, [r"axis", "2", r"\(3, 5\)"]),
    ("axis_neg_range", dict(axis=-3), ValueError, [r"axis", "-3"]),
    ("axis_float", dict(axis=1.0), TypeError, [r"axis"]),
    ("backend_loop", dict(backend="loop"), ValueError, [r"backend", "'loop'"]),
    ("threads_0", dict(num_threads=0), ValueError, [r"num_threads"]),
    ("threads_huge", dict(num_threads=10**6), ValueError, [r"num_threads"]),
]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=[c[0] for c in SOFTMAX_CASES])
def test_masked_softmax_rejects(case, no_kernel):
    _, kwargs, exc, patterns = case
    args = dict(x=X)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        attn.masked_softmax(**args)
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))


@pytest.mark.parametrize("bad", [np.ones(3, np.int32), "abc", None])
def test_softmax_rejects(bad):
    with pytest.raises(TypeError, match=r"\bx\b"):
        attn.softmax(bad)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (10**9, ValueError),
                                     (1.5, TypeError), ("2", TypeError), (True, TypeError)])
def test_set_num_threads_rejects(bad, exc):
    before = attn.get_num_threads()
    with pytest.raises(exc, match="num_threads"):
        attn.set_num_threads(bad)
    assert attn.get_num_threads() == before  # a refused value changes nothing


def test_set_num_threads_roundtrip():
    try:
        attn.set_num_threads(np.int64(3))
        assert attn.get_num_threads() == 3 and type(attn.get_num_threads()) is int
    finally:
        attn.set_num_threads(None)


def test_numpy_bool_is_causal_is_accepted(no_kernel):
    """np.False_ is 'not causal' (it used to collide with attn_mask); np.True_ is causal."""
    with pytest.raises(KernelCalled):  # validation passed: the (stubbed) kernel ran
        attn.scaled_dot_product_attention(Q, K, V, attn_mask=np.ones((5, 6), bool), is_causal=np.False_)
    with pytest.raises(ValueError, match="is_causal"):
        attn.scaled_dot_product_attention(Q, K, V, attn_mask=np.ones((5, 6), bool), is_causal=np.True_)
