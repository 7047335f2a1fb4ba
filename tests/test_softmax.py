"""attn.softmax and attn.masked_softmax against torch.softmax."""

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_within, gamma, softmax_error

SOFTMAX_BACKENDS = ("numpy", "cython")


def torch_masked_softmax(x, mask=None, axis=-1):
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    if mask is not None:
        m = torch.from_numpy(np.array(np.broadcast_to(mask, x.shape)))
        t = t.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else t + m.to(torch.float64)
    return torch.nan_to_num(torch.softmax(t, dim=axis), nan=0.0).numpy()


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_matches_torch(axis, dtype, rng):
    x = (rng.standard_normal((4, 5, 6)) * 10).astype(dtype)
    w = attn.softmax(x, axis=axis)
    ref = torch.softmax(torch.from_numpy(x.astype(np.float64)), dim=axis).numpy()
    assert w.dtype == dtype
    assert_within(w, ref, softmax_error(x, axis=axis) + softmax_error(x, axis=axis, dtype=np.float64))


def test_softmax_large_logits_no_overflow():
    x = np.array([[1000.0, 1001.0, 999.0], [-1802.8, -1790.0, -1800.0]], dtype=np.float32)
    w = attn.softmax(x)
    assert np.all(np.isfinite(w))
    ref = torch.softmax(torch.from_numpy(x.astype(np.float64)), dim=-1).numpy()
    assert_within(w, ref, softmax_error(x) + softmax_error(x, dtype=np.float64))


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
@pytest.mark.parametrize("kind", ["none", "bool", "float", "bool-broadcast"])
@pytest.mark.parametrize("axis", [-1, 0, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masked_softmax_matches_torch(backend, kind, axis, dtype, rng):
    x = (rng.standard_normal((3, 4, 37)) * 3).astype(dtype)
    mask = None
    if kind == "bool":
        mask = rng.random(x.shape) < 0.6
    elif kind == "float":
        mask = rng.standard_normal(x.shape).astype(dtype)
    elif kind == "bool-broadcast":
        mask = rng.random((1, 4, 1)) < 0.6
    w = attn.masked_softmax(x, mask, axis=axis, backend=backend)
    ref = torch_masked_softmax(x, mask, axis=axis)
    assert w.shape == x.shape and w.dtype == dtype
    assert_within(w, ref, softmax_error(x, mask, axis) + softmax_error(x, mask, axis, dtype=np.float64))


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_masked_softmax_fully_masked_row_is_zero(backend, rng):
    x = rng.standard_normal((4, 9))
    mask = np.ones((4, 9), dtype=bool)
    mask[1] = False
    fmask = np.where(mask, 0.0, -np.inf)
    for m in (mask, fmask):
        w = attn.masked_softmax(x, m, backend=backend)
        assert np.all(w[1] == 0.0)
        w_err = softmax_error(x, m)
        assert_within(w.sum(axis=-1), [1, 0, 1, 1], w_err.sum(axis=-1) + gamma(9, np.float64))
        assert_within(w, torch_masked_softmax(x, m), 2 * w_err)


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_masked_softmax_nan_stays_in_its_row(backend, rng):
    x = rng.standard_normal((3, 5))
    x[1, 2] = np.nan
    w = attn.masked_softmax(x, backend=backend)
    assert np.all(np.isnan(w[1]))
    assert_within(w[[0, 2]], torch_masked_softmax(x[[0, 2]]), 2 * softmax_error(x[[0, 2]]))
