"""Every backend against torch.nn.functional.scaled_dot_product_attention (float64)."""

import numpy as np
import pytest

import attn
from _bounds import assert_sdpa_close, assert_weights_close, matmul_error, sdpa_error, unit_roundoff
from conftest import BACKENDS, make_qkv, mask_of_kind, random_bool_mask, torch_sdpa, torch_weights

LENGTHS = [(1, 1), (7, 7), (7, 97), (97, 7), (97, 97), (1, 97)]
LEADS = [(), (2,), (2, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("L,S", LENGTHS)
@pytest.mark.parametrize("lead", LEADS, ids=str)
def test_matches_torch(backend, mask_kind, L, S, lead, rng):
    q, k, v = make_qkv(rng, lead, L, S, 16, Ev=8)
    mask = mask_of_kind(mask_kind, rng, lead, L, S)
    causal = mask_kind == "causal"
    out = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, backend=backend)
    ref = torch_sdpa(q, k, v, attn_mask=mask, is_causal=causal)
    assert out.shape == ref.shape == lead + (L, 8)
    assert out.dtype == np.float64
    assert_sdpa_close(out, ref, q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,Ev", [(1, 1), (4, 4), (64, 64), (128, 128), (64, 3), (1, 130)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(backend, E, Ev, causal, rng):
    q, k, v = make_qkv(rng, (2,), 97, 97, E, Ev)
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend)
    ref = torch_sdpa(q, k, v, is_causal=causal)
    assert_sdpa_close(out, ref, q, k, v, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_custom_scale(backend, scale, rng):
    q, k, v = make_qkv(rng, (3,), 7, 97, 4)
    out = attn.scaled_dot_product_attention(q, k, v, scale=scale, backend=backend)
    assert_sdpa_close(out, torch_sdpa(q, k, v, scale=scale), q, k, v, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (6, 3), (4, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(backend, h_q, h_kv, causal, rng):
    q = rng.standard_normal((2, h_q, 7, 16))
    k = rng.standard_normal((2, h_kv, 97, 16))
    v = rng.standard_normal((2, h_kv, 97, 5))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, backend=backend)
    ref = torch_sdpa(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == (2, h_q, 7, 5)
    assert_sdpa_close(out, ref, q, k, v, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_broadcast(backend, rng):
    q = rng.standard_normal((2, 1, 7, 8))
    k = rng.standard_normal((1, 3, 11, 8))
    v = rng.standard_normal((3, 11, 4))
    mask = random_bool_mask(rng, (3, 1, 11))  # broadcast over batch and rows
    out = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    qb, kb, vb = (np.broadcast_to(a, (2, 3) + a.shape[-2:]) for a in (q, k, v))
    ref = torch_sdpa(qb, kb, vb, attn_mask=np.broadcast_to(mask, (2, 3, 7, 11)))
    assert out.shape == (2, 3, 7, 4)
    assert_sdpa_close(out, ref, qb, kb, vb, attn_mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("L,S", [(7, 97), (97, 7), (33, 33)])
def test_return_weights(backend, mask_kind, L, S, rng):
    q, k, v = make_qkv(rng, (2,), L, S, 16)
    mask = mask_of_kind(mask_kind, rng, (2,), L, S)
    causal = mask_kind == "causal"
    out, w = attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, backend=backend, return_weights=True
    )
    w_ref = torch_weights(q, k, attn_mask=mask, is_causal=causal)
    assert w.shape == (2, L, S)
    assert_weights_close(w, w_ref, q, k, attn_mask=mask, is_causal=causal)
    ref = torch_sdpa(q, k, v, attn_mask=mask, is_causal=causal)
    assert_sdpa_close(out, ref, q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal"])
def test_float32_close_to_float64(backend, mask_kind, rng):
    q, k, v = make_qkv(rng, (2, 2), 97, 97, 64)
    mask = mask_of_kind(mask_kind, rng, (2, 2), 97, 97)
    causal = mask_kind == "causal"
    out64 = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, backend=backend)
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    out32 = attn.scaled_dot_product_attention(*f32, attn_mask=mask, is_causal=causal, backend=backend)
    assert out32.dtype == np.float32
    # float32 on the rounded inputs vs float64 on the originals: the casts are input errors
    dq, dk, dv = (unit_roundoff(np.float32) * np.abs(a) for a in (q, k, v))
    assert_sdpa_close(out32, out64, q, k, v, attn_mask=mask, is_causal=causal, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_computed_in_float32(backend, rng):
    q, k, v = (a.astype(np.float16) for a in make_qkv(rng, (2,), 9, 13, 8))
    out = attn.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.dtype == np.float16
    ref = torch_sdpa(*(a.astype(np.float64) for a in (q, k, v)))
    assert_sdpa_close(out, ref, q, k, v)  # computed in float32, stored in float16


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_and_empty_keys_are_zero(backend, rng):
    q, k, v = make_qkv(rng, (2,), 5, 6, 4)
    mask = random_bool_mask(rng, (2, 5, 6))
    mask[:, 2] = False  # row 2 sees nothing
    fmask = np.where(mask, 0.0, -np.inf)
    for m in (mask, fmask):
        out, w = attn.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend, return_weights=True)
        ref = torch_sdpa(q, k, v, attn_mask=m)
        assert not np.isnan(out).any()
        assert_sdpa_close(out, np.nan_to_num(ref), q, k, v, attn_mask=m)
        assert np.all(out[:, 2] == 0) and np.all(w[:, 2] == 0)
    out, w = attn.scaled_dot_product_attention(q, k[:, :0], v[:, :0], backend=backend, return_weights=True)
    assert out.shape == (2, 5, 4) and w.shape == (2, 5, 0)
    assert np.array_equal(out, torch_sdpa(q, k[:, :0], v[:, :0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L,S", [(3, 8), (8, 3), (5, 5)])
def test_lower_right_causal(backend, L, S, rng):
    """'lower_right': row i sees keys 0..S-L+i (torch.nn.attention.bias.causal_lower_right)."""
    from torch.nn.attention.bias import causal_lower_right
    import torch

    q, k, v = make_qkv(rng, (2,), L, S, 8)
    out = attn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", backend=backend)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    if L > S:  # the first L - S rows see no key: torch says so when the bias is made
        with pytest.warns(UserWarning, match="Lower right causal bias will produce NaNs"):
            bias = causal_lower_right(L, S)
    else:
        bias = causal_lower_right(L, S)
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias).numpy()
    ref = np.nan_to_num(ref)  # rows that see no key (L > S): torch's bias path gives NaN, attn gives 0
    assert_sdpa_close(out, ref, q, k, v, is_causal="lower_right")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout(backend, rng):
    q, k, v = make_qkv(rng, (2,), 7, 9, 4)
    if backend in ("cython", "online"):  # neither draws dropout
        with pytest.raises(ValueError, match="dropout"):
            attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
        return
    out, w = attn.scaled_dot_product_attention(
        q, k, v, dropout_p=0.25, backend=backend, return_weights=True, rng=np.random.default_rng(1)
    )
    # independent reconstruction: same draw, torch weights, kept / (1 - p)
    keep = np.random.default_rng(1).random((2, 7, 9)) >= 0.25
    w_ref = np.where(keep, torch_weights(q, k) / 0.75, 0)
    # each side: the weights' bound, divided by 0.75 (one more rounding), then the product with v
    w_err = 2 * sdpa_error(q, k, v, return_weights=True)[1] / 0.75 + 2 * unit_roundoff(np.float64) * w_ref
    assert np.all(np.abs(w - w_ref) <= w_err)
    assert np.all(np.abs(out - w_ref @ v) <= 2 * matmul_error(w_ref, v, dx=w_err / 2))
