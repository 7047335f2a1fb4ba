"""Public API surface: backends(), thread control, argument errors."""

import numpy as np
import pytest

import attn
from conftest import make_qkv


def test_backends_reports_build():
    info = attn.backends()
    assert info["loop"] and info["numpy"]
    assert info["cython"], info["cython_error"]  # CI builds the extension
    assert isinstance(info["openmp"], bool)
    assert info["num_threads"] >= 1 and info["max_threads"] >= 1
    assert isinstance(info["simd"], str)


def test_set_num_threads_and_bitwise_identical_results(rng):
    q, k, v = make_qkv(rng, (3, 4), 130, 150, 32)
    before = attn.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            attn.set_num_threads(n)
            assert attn.get_num_threads() == n
            outs.append(attn.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cython"))
        assert all(np.array_equal(outs[0], o) for o in outs[1:])
        with pytest.raises(ValueError, match="num_threads"):
            attn.set_num_threads(0)
        with pytest.raises(TypeError, match="num_threads"):
            attn.set_num_threads(1.5)
    finally:
        attn.set_num_threads(None)
    assert attn.get_num_threads() == before


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(backend="fast"), ValueError, ["backend", "fast"]),
        (dict(dropout_p=1.0), ValueError, ["dropout_p"]),
        (dict(num_threads=0), ValueError, ["num_threads"]),
        (dict(is_causal="diagonal"), ValueError, ["is_causal"]),
        (dict(attn_mask=np.ones((4, 4), np.int64)), TypeError, ["attn_mask", "int64"]),
        (dict(attn_mask=np.ones((3, 4), bool)), ValueError, ["attn_mask", "(3, 4)", "(4, 6)"]),
    ],
)
def test_bad_arguments(kwargs, exc, words, rng):
    q, k, v = make_qkv(rng, (), 4, 6, 8)
    with pytest.raises(exc) as info:
        attn.scaled_dot_product_attention(q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_arrays(rng):
    q, k, v = make_qkv(rng, (), 4, 6, 8)
    with pytest.raises(TypeError, match="query.*float32"):
        attn.scaled_dot_product_attention(q.astype(np.float32), k, v)
    with pytest.raises(TypeError, match="key.*int64"):
        attn.scaled_dot_product_attention(q, k.astype(np.int64), v)
    with pytest.raises(ValueError, match=r"query with shape \(4, 8\).*key with shape \(6, 7\)"):
        attn.scaled_dot_product_attention(q, k[:, :7], v)
    with pytest.raises(ValueError, match=r"key with shape \(6, 8\).*value with shape \(5, 8\)"):
        attn.scaled_dot_product_attention(q, k, v[:5])
    with pytest.raises(ValueError, match="query.*at least 2 dims"):
        attn.scaled_dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="enable_gqa"):
        attn.scaled_dot_product_attention(
            np.zeros((3, 4, 8)), np.zeros((2, 6, 8)), np.zeros((2, 6, 8)), enable_gqa=True
        )
