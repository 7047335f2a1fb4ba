"""Torch tensors in the core API: torch in, torch out (NumPy in, NumPy out), held to torch's own functions."""

import numpy as np
import pytest
import torch

import attn
from attn import _interop

F = torch.nn.functional


def tensors(*shapes, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("backend", ["loop", "numpy", "cython"])
def test_sdpa_torch_in_torch_out(backend):
    q, k, v = tensors((2, 6, 5, 8), (2, 2, 7, 8), (2, 2, 7, 3))
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    out = attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend=backend)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.shape == (2, 6, 5, 3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)


def test_sdpa_strided_views_and_weights():
    """Transposed (non-contiguous) tensors are read in place; weights come back as torch too."""
    (base,) = tensors((2, 3, 8, 5))
    q = k = v = base.transpose(-1, -2)  # [2, 3, 5, 8], strided
    out, w = attn.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    assert isinstance(w, torch.Tensor) and w.shape == (2, 3, 5, 5)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=1e-13)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 5, dtype=w.dtype))


def test_inputs_are_views_not_copies(monkeypatch):
    """The kernel receives NumPy views of the tensors' storage."""
    seen = []
    real = attn._api.validate_attention
    monkeypatch.setattr(attn._api, "validate_attention", lambda *a: seen.append(a[:3]) or real(*a))
    fast = attn._backends.fused.fast_forward  # the common call's compiled path sees them first
    monkeypatch.setattr(attn._backends.fused, "fast_forward", lambda *a: seen.append(a[:3]) or fast(*a))
    q, k, v = tensors((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    attn.scaled_dot_product_attention(q, k.transpose(-1, -2).transpose(-1, -2), v)
    assert all(isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr() for a, t in zip(seen[0], (q, k, v)))


def test_output_shares_memory_with_the_numpy_result():
    (x,) = tensors((3, 7))
    y = attn.softmax(x)
    assert isinstance(y, torch.Tensor)
    y.numpy()[0, 0] = 5.0  # one buffer: the tensor is a view of NumPy's result, no copy was made
    assert y[0, 0].item() == 5.0


def test_softmax_and_masked_softmax():
    (x,) = tensors((4, 9), dtype=torch.float32)
    assert torch.allclose(attn.softmax(x), torch.softmax(x, -1), rtol=0, atol=4 * 2**-24)
    mask = torch.arange(9) < 6
    out = attn.masked_softmax(x, mask)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    ref = torch.softmax(x.masked_fill(~mask, -torch.inf), -1)
    assert torch.allclose(out, ref, rtol=0, atol=4 * 2**-24)


def test_multi_head_attention_torch_weights():
    x, wq, wk, wv, wo = tensors((2, 5, 16), (16, 16), (16, 8), (16, 8), (16, 16))
    out = attn.multi_head_attention(x, x, x, wq, wk, wv, wo, 4, 2, is_causal=True)
    assert isinstance(out, torch.Tensor)
    ref_np = attn.multi_head_attention(*(t.numpy() for t in (x, x, x, wq, wk, wv, wo)), 4, 2, is_causal=True)
    assert isinstance(ref_np, np.ndarray) and np.array_equal(out.numpy(), ref_np)


def test_numpy_in_numpy_out():
    q = np.ones((2, 3, 4))
    assert isinstance(attn.scaled_dot_product_attention(q, q, q), np.ndarray)
    assert isinstance(attn.softmax(q), np.ndarray)


def test_requires_grad_says_what_to_do():
    q = torch.randn(2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"query requires grad.*query\.detach\(\)"):
        attn.scaled_dot_product_attention(q, q.detach(), q.detach())
    with torch.no_grad():  # nothing is recorded: accepted
        assert isinstance(attn.scaled_dot_product_attention(q, q, q), torch.Tensor)


def test_bfloat16_tensor_read_in_place_and_returned_as_bfloat16():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)[..., ::2]   # strided: still no copy
    view = _interop.to_numpy(x, "x")
    assert view.dtype.name == "bfloat16" and view.shape == tuple(x.shape)
    assert view.__array_interface__["data"][0] == x.data_ptr()
    assert np.array_equal(view.astype(np.float32), x.float().numpy())
    out = attn.softmax(x)
    assert out.dtype == torch.bfloat16
    ref = torch.softmax(x.double(), -1)
    assert (out.double() - ref).abs().max() <= 2 ** -8   # one bfloat16 rounding of values <= 1


def test_bfloat16_tensors_off_the_common_case_get_the_same_checks():
    """bfloat16 takes its own short path to NumPy: a lazy negation, a grad
    requirement or another device still get the float32 path's handling."""
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    assert np.array_equal(_interop.to_numpy(neg, "x").astype(np.float32), (-x).float().numpy())
    g = x.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"query requires grad"):
        attn.scaled_dot_product_attention(g, x, x)
    with pytest.raises(ValueError, match=r"key is a torch tensor on device 'meta'"):
        attn.scaled_dot_product_attention(x, torch.empty(2, 3, 8, dtype=torch.bfloat16, device="meta"), x)


def test_unsupported_tensor_dtype_names_the_supported_ones():
    with pytest.raises(TypeError, match=r"x must have dtype float16, bfloat16, float32 or float64"):
        attn.softmax(torch.ones(2, 3, dtype=torch.int32))


def test_meta_tensor_says_cpu():
    q = torch.empty(2, 3, 4, device="meta")
    with pytest.raises(ValueError, match=r"key is a torch tensor on device 'meta'.*key\.cpu\(\)"):
        attn.scaled_dot_product_attention(np.ones((2, 3, 4), np.float32), q, q)


def test_mask_tensor_with_numpy_inputs_returns_torch():
    q = np.random.default_rng(0).standard_normal((3, 4, 8))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    out = attn.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert isinstance(out, torch.Tensor)
    t = torch.from_numpy(q)
    assert torch.allclose(out, F.scaled_dot_product_attention(t, t, t, is_causal=True), rtol=0, atol=1e-13)
