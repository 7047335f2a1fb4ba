"""attn.effective_keys: 1 / sum(w**2) per row."""

import numpy as np
import pytest
import torch

import attn
from _bounds import gamma


def test_uniform_and_one_hot():
    # 1 / sum(w^2): the rounded 1/7, 7 squares, a sum of 7 terms and a reciprocal, in any order
    assert attn.effective_keys(np.full(7, 1 / 7)) == pytest.approx(7.0, rel=gamma(2 + 1 + 6 + 1, np.float64))
    assert attn.effective_keys(np.eye(4)).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_against_torch_per_row_and_axis():
    w = torch.softmax(torch.from_numpy(np.random.default_rng(3).normal(size=(2, 5, 9))), dim=-1)
    expected = (1 / (w ** 2).sum(dim=-1)).numpy()  # [2, 5]
    got = attn.effective_keys(w.numpy())
    assert got.shape == (2, 5)
    # same weights on both sides: squares, a 9-term sum (any order) and a reciprocal, each side
    rtol = 2 * gamma(1 + 8 + 1, np.float64)
    np.testing.assert_allclose(got, expected, rtol=rtol)
    moved = np.moveaxis(w.numpy(), -1, 1)  # [2, 9, 5]: keys on axis 1
    np.testing.assert_allclose(attn.effective_keys(moved, axis=1), expected, rtol=rtol)


def test_float32_and_all_zero_rows():
    w = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    got = attn.effective_keys(w)
    assert got.dtype == np.float32
    assert got.tolist() == [2.0, 0.0]  # a fully masked row attends to no key, not inf


def test_validation():
    with pytest.raises(TypeError, match="weights must have dtype float"):
        attn.effective_keys(np.ones(3, dtype=int))
    with pytest.raises(ValueError, match="axis 2 is out of range for weights"):
        attn.effective_keys(np.ones((2, 2)), axis=2)
    with pytest.raises(ValueError, match="at least 1 dim"):
        attn.effective_keys(np.float64(1.0))
