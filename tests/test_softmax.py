"""attn.softmax and attn.masked_softmax against torch.softmax."""

import numpy as np
import pytest
import torch

import attn

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
    tol = 1e-15 if dtype == np.float64 else 1e-6
    assert np.max(np.abs(w - ref)) <= tol


def test_softmax_large_logits_no_overflow():
    x = np.array([[1000.0, 1001.0, 999.0], [-1802.8, -1790.0, -1800.0]], dtype=np.float32)
    w = attn.softmax(x)
    assert np.all(np.isfinite(w))
    ref = torch.softmax(torch.from_numpy(x.astype(np.float64)), dim=-1).numpy()
    assert np.max(np.abs(w - ref)) <= 1e-6


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
    tol = 1e-15 if dtype == np.float64 else 1e-6
    assert np.max(np.abs(w - ref)) <= tol


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_masked_softmax_fully_masked_row_is_zero(backend, rng):
    x = rng.standard_normal((4, 9))
    mask = np.ones((4, 9), dtype=bool)
    mask[1] = False
    fmask = np.where(mask, 0.0, -np.inf)
    for m in (mask, fmask):
        w = attn.masked_softmax(x, m, backend=backend)
        assert np.all(w[1] == 0.0)
        np.testing.assert_allclose(w.sum(axis=-1), [1, 0, 1, 1], atol=1e-15)
        assert np.max(np.abs(w - torch_masked_softmax(x, m))) <= 1e-15


@pytest.mark.parametrize("backend", SOFTMAX_BACKENDS)
def test_masked_softmax_nan_stays_in_its_row(backend, rng):
    x = rng.standard_normal((3, 5))
    x[1, 2] = np.nan
    w = attn.masked_softmax(x, backend=backend)
    assert np.all(np.isnan(w[1]))
    assert np.max(np.abs(w[[0, 2]] - torch_masked_softmax(x[[0, 2]]))) <= 1e-15
