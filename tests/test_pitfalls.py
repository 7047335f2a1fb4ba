"""The seed article's pitfalls, as tests of what really happens."""

import warnings

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_sdpa_close, assert_within, gamma, sdpa_error, softmax_error
from conftest import BACKENDS, make_qkv, torch_sdpa


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipped_mask_convention_is_silent_and_large(backend, rng):
    """torch MHA's causal mask (True = masked) passed where SDPA wants True = takes part.

    Nothing raises and the output has the right shape, but every row attends
    to exactly the wrong keys (the future only; the last row to nothing), so
    the answer is far from the causal one. Only a check of the result shows it.
    """
    q, k, v = make_qkv(rng, (), 5, 5, 4)
    mha_style = np.triu(np.ones((5, 5), dtype=bool), k=1)  # True = masked
    right = attn.scaled_dot_product_attention(q, k, v, attn_mask=~mha_style, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attn may warn about this very mistake
        wrong = attn.scaled_dot_product_attention(q, k, v, attn_mask=mha_style, backend=backend)
    assert_sdpa_close(right, torch_sdpa(q, k, v, is_causal=True), q, k, v, is_causal=True)
    assert wrong.shape == right.shape
    assert np.max(np.abs(wrong - right)) > 0.5


def test_softmax_over_wrong_axis_breaks_row_sums(rng):
    s = rng.standard_normal((5, 5))
    right = attn.softmax(s, axis=-1)
    wrong = attn.softmax(s, axis=0)  # normalizes columns: runs, no warning
    # each weight within its bound of the exact one, and the row sum's own rounding
    assert np.all(np.abs(right.sum(axis=-1) - 1.0) <= softmax_error(s).sum(axis=-1) + gamma(5, np.float64))
    assert np.max(np.abs(wrong.sum(axis=-1) - 1.0)) > 0.05
    assert np.max(np.abs(wrong - right)) > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_masks_to_exact_zero(backend, rng):
    q, k, v = make_qkv(rng, (), 5, 5, 4)
    causal = np.tril(np.ones((5, 5), dtype=bool))
    _, w = attn.scaled_dot_product_attention(
        q, k, v, attn_mask=np.where(causal, 0.0, -np.inf), backend=backend, return_weights=True
    )
    assert np.all(w[~causal] == 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_1e9_in_float32_is_not_a_mask(backend, rng):
    """-1e9 is a large number, not -inf: a row whose keys are all "masked"
    with it still gets weights (uniform, 1/S each), where -inf gives zeros.
    (In a row with any unmasked key, exp(-1e9 - max) underflows to exactly 0
    in float32 too, so the difference shows only on fully masked rows.)"""
    q, k, v = make_qkv(rng, (), 3, 4, 4, dtype=np.float32)
    keep = np.ones((3, 4), dtype=bool)
    keep[1] = False  # row 1: every key masked
    big = np.where(keep, 0, -1e9).astype(np.float32)
    inf = np.where(keep, 0, -np.inf).astype(np.float32)
    _, w_big = attn.scaled_dot_product_attention(q, k, v, attn_mask=big, backend=backend, return_weights=True)
    _, w_inf = attn.scaled_dot_product_attention(q, k, v, attn_mask=inf, backend=backend, return_weights=True)
    assert np.all(w_inf[1] == 0.0)
    assert np.all(w_big[1] > 0.0)
    # -1e9 + score rounds to exactly -1e9 in float32 (|score| < ulp(1e9) / 2 = 32): equal logits
    assert np.all(np.abs(w_big[1] - 0.25) <= softmax_error(np.zeros(4, np.float32)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_logits_near_1800_no_nan(backend):
    """The seed's overflow case: 1024-dim float32 vectors times 10 give dots
    near +-1800; exp of those over/underflows unless the max is subtracted."""
    r = np.random.default_rng(7)
    q = (r.standard_normal((4, 1024)) * 10).astype(np.float32)
    k = (r.standard_normal((6, 1024)) * 10).astype(np.float32)
    v = r.standard_normal((6, 3)).astype(np.float32)
    dots = q.astype(np.float64) @ k.T.astype(np.float64)
    assert np.abs(dots).max() > 1000
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.exp(dots.astype(np.float32))
        naive = naive / naive.sum(-1, keepdims=True)
    assert np.isnan(naive).any()  # the unguarded formula really fails here
    out, w = attn.scaled_dot_product_attention(q, k, v, scale=1.0, backend=backend, return_weights=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))
    ref = torch_sdpa(*(a.astype(np.float64) for a in (q, k, v)), scale=1.0)
    # A 1024-term float32 dot product of these magnitudes may be off by ~4 in the
    # worst case (gamma_1024 sum|q_i k_i|): row 1's two top scores are only ~8 apart,
    # so no rounding analysis pins its weights; it is still a convex combination of v.
    # The other rows' top scores are >= 140 apart: compared within the bounds.
    bound = sdpa_error(q, k, v, scale=1.0, strict=False) + sdpa_error(q, k, v, scale=1.0, dtype=np.float64)
    pinned = np.isfinite(bound).all(axis=-1)
    assert pinned.sum() == 3 and not pinned[1]
    assert_within(out[pinned], ref[pinned], bound[pinned])
    slack = (2 * gamma(2 * 6, np.float32) + 2**-23) * np.abs(v).max(axis=0)  # the weighted sum's rounding
    assert np.all((out >= v.min(axis=0) - slack) & (out <= v.max(axis=0) + slack))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [5, 70, 130])
def test_causal_row_i_sees_i_plus_1_keys(backend, T, rng):
    q, k, v = make_qkv(rng, (), T, T, 8)
    _, w = attn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend, return_weights=True)
    assert [int(np.count_nonzero(row > 0)) for row in w] == list(range(1, T + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_sum_to_one(backend, rng):
    q, k, v = make_qkv(rng, (2, 3), 33, 77, 16)
    _, w = attn.scaled_dot_product_attention(q, k, v, backend=backend, return_weights=True)
    w_err = sdpa_error(q, k, v, return_weights=True)[1]
    assert np.all(np.abs(w.sum(axis=-1) - 1.0) <= w_err.sum(axis=-1) + gamma(77, np.float64))


def test_k_not_transposed_is_a_shape_error(rng):
    """Q @ K instead of Q @ K^T: NumPy raises ValueError, torch RuntimeError.
    attn takes K as [S, E] and transposes itself, so the same arrays work."""
    q, k, v = make_qkv(rng, (), 5, 5, 4)
    with pytest.raises(ValueError, match="mismatch"):
        q @ k  # [5, 4] @ [5, 4]
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.from_numpy(q) @ torch.from_numpy(k)
    out = attn.scaled_dot_product_attention(q, k, v)
    assert_sdpa_close(out, torch_sdpa(q, k, v), q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attn_mask_with_is_causal_raises(backend, rng):
    q, k, v = make_qkv(rng, (), 4, 4, 4)
    with pytest.raises(ValueError, match="attn_mask.*is_causal"):
        attn.scaled_dot_product_attention(
            q, k, v, attn_mask=np.ones((4, 4), bool), is_causal=True, backend=backend
        )
