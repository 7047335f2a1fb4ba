"""Every demo's figures against independently computed values (mostly torch), and the CLI."""

import math
import re

import numpy as np
import pytest
import torch

from attn.apps.demos import masks, parity, pitfalls, scaling, timing
from _bounds import assert_within, gamma, mha_error, sdpa_error, softmax_error, unit_roundoff
from attn.apps.demos._common import SEED, five_tokens
from conftest import torch_sdpa, torch_weights

# The seed article's printed table (d_k: std, max unscaled, max scaled, eff. unscaled, eff. scaled).
SEED_TABLE = {
    16: ("2.47", "0.227685", "0.004241", "14.85", "1341.59"),
    64: ("7.32", "0.921946", "0.009399", "1.17", "829.74"),
    512: ("20.99", "0.933175", "0.005796", "1.15", "917.82"),
}


def _seed_draw(d_k):
    rng = np.random.default_rng(7)
    q = rng.normal(size=(d_k,))
    k = rng.normal(size=(2000, d_k))
    return q, k


def _scaling_bounds(row):
    """Rounding bounds of one table row's figures (any BLAS, any summation order; tests/_bounds.py)."""
    q, k = _seed_draw(row.d_k)
    v = np.zeros((len(k), 1))
    dots = k @ q
    n = len(dots)
    dot_err = gamma(row.d_k, np.float64) * (np.abs(k) @ np.abs(q))  # [2000]
    # std: the dots' errors move it by at most their max; the two-pass std's own rounding
    # (mean, deviations, squares, mean, sqrt) by ~2 gamma(n+1) max|dot| + gamma(n+2) std
    std_err = dot_err.max() + 2 * gamma(n + 1, np.float64) * np.abs(dots).max() + gamma(n + 2, np.float64) * dots.std()
    out = {"std": std_err}
    for name, scale in (("raw", 1.0), ("scaled", 1 / math.sqrt(row.d_k))):
        w_err = sdpa_error(q[None], k, v, scale=scale, return_weights=True)[1][0]  # [2000]
        w = getattr(row, f"weights_{name}")
        eff = 1 / np.sum(w ** 2)
        # 1 / sum(w^2): relative 2 sum(w dw) / sum(w^2) from the weights, gamma(n + 1) its own rounding
        out[name] = (w_err, eff * (2 * np.sum(w * w_err) / np.sum(w ** 2) + gamma(n + 2, np.float64)))
    return out


# --- scaling ---------------------------------------------------------------

def test_scaling_equals_the_seed_table_to_every_printed_digit():
    for row in scaling.run():
        got = (f"{row.dot_std:.2f}", f"{row.max_weight_raw:.6f}", f"{row.max_weight_scaled:.6f}",
               f"{row.effective_raw:.2f}", f"{row.effective_scaled:.2f}")
        assert got == SEED_TABLE[row.d_k]
        # and no CPU or BLAS can print other digits: every value stays on its side of the
        # printing boundaries within its rounding bound
        b = _scaling_bounds(row)
        for value, err, fmt in ((row.dot_std, b["std"], ".2f"),
                                (row.max_weight_raw, b["raw"][0].max(), ".6f"),
                                (row.max_weight_scaled, b["scaled"][0].max(), ".6f"),
                                (row.effective_raw, b["raw"][1], ".2f"),
                                (row.effective_scaled, b["scaled"][1], ".2f")):
            assert format(value - err, fmt) == format(value, fmt) == format(value + err, fmt), (value, err)


def test_scaling_against_torch():
    for row in scaling.run():
        q, k = (torch.from_numpy(a) for a in _seed_draw(row.d_k))
        dots = k @ q
        b = _scaling_bounds(row)
        for name, scale in (("raw", 1.0), ("scaled", 1 / math.sqrt(row.d_k))):
            ref = torch.softmax(dots * scale, dim=0).numpy()
            w_err = b[name][0]
            assert_within(getattr(row, f"weights_{name}"), ref, 2 * w_err, name)
        assert row.dot_std == pytest.approx(dots.std(unbiased=False).item(), abs=2 * b["std"])
        ref_raw = torch.softmax(dots, dim=0)
        assert row.effective_raw == pytest.approx(1 / (ref_raw ** 2).sum().item(), abs=2 * b["raw"][1])


# --- masks -----------------------------------------------------------------

@pytest.fixture(scope="module")
def masks_result():
    return masks.run()


@pytest.fixture(scope="module")
def five():
    rng = np.random.default_rng(20261012)
    return tuple(rng.normal(size=(5, 4)) for _ in range(3))


def test_masks_causal_against_torch(masks_result, five):
    q, k, v = five
    c = masks_result.causal
    w_err = sdpa_error(q, k, v, return_weights=True)[1]
    assert_within(c.weights, torch_weights(q, k), 2 * w_err)
    ref = torch_weights(q, k, is_causal=True)
    assert_within(c.causal_weights, ref, 2 * sdpa_error(q, k, v, is_causal=True, return_weights=True)[1])
    assert c.max_masked_weight == 0.0
    assert c.row2_attended == (0, 1, 2) == tuple(np.flatnonzero(ref[2] > 0))
    # |sum_j w_j - 1| <= sum_j |w_j - p_j| + the 5-term sum's rounding
    assert c.max_row_sum_error <= np.max(w_err.sum(axis=-1)) + gamma(5, np.float64)


def test_masks_minus_1e9_in_float32_is_exactly_zero(masks_result, five):
    q32, k32, v32 = (a.astype(np.float32) for a in five)
    q, k, v = (torch.from_numpy(a) for a in (q32, k32, v32))
    masked = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    ref = torch.softmax(q @ k.T / 2 + masked * torch.tensor(-1e9, dtype=torch.float32), dim=-1)
    assert torch.count_nonzero(ref[masked]).item() == 0  # torch agrees: exactly 0, not tiny
    b = masks_result.big_negative
    assert b.n_masked_nonzero == 0 and b.max_masked_weight == 0.0 and b.max_masked_weight_numpy == 0.0
    # the -1e9 weights are exactly 0 on both sides, so both are the causal softmax in float32
    w_err = sdpa_error(q32, k32, v32, is_causal=True, return_weights=True)[1]
    assert_within(b.weights, ref.numpy(), 2 * w_err)
    assert b.max_diff_vs_inf <= np.max(2 * w_err)


def test_masks_fully_masked_row(masks_result, five):
    q, k, _ = five
    s = torch.from_numpy((q @ k.T / 2)[0].astype(np.float32))
    b = masks_result.big_negative
    ref_big = torch.softmax(s + torch.tensor(-1e9, dtype=torch.float32), dim=0).numpy()
    assert np.array_equal(b.all_masked_big_f32, ref_big)
    assert np.all(b.all_masked_big_f32 == np.float32(1 / 5))  # uniform: attends everywhere
    assert np.all(np.isnan(b.all_masked_inf_softmax))
    assert np.all(b.all_masked_inf_attn == 0)
    s = (q @ k.T / 2)[0]
    s64 = torch.from_numpy(s)
    drift = (torch.softmax(s64 - 1e9, dim=0) - torch.softmax(s64, dim=0)).abs().max().item()
    # s - 1e9 rounds each score by <= u (1e9 + |s|): the weights move by <= expm1(2 that)
    shift = np.expm1(2 * unit_roundoff(np.float64) * (1e9 + np.abs(s).max()))
    both = 2 * (softmax_error(s - 1e9) + softmax_error(s)).max()  # each side's two softmaxes
    assert b.all_masked_big_f64_vs_unmasked == pytest.approx(drift, abs=both)
    assert drift <= shift + both


def test_masks_convention_flip(masks_result, five):
    q, k, v = five
    masked = np.triu(np.ones((5, 5), dtype=bool), 1)  # True = masked
    right, flipped = torch_sdpa(q, k, v, attn_mask=~masked), torch_sdpa(q, k, v, attn_mask=masked)
    expected = np.max(np.abs(flipped - right))
    f = masks_result.flip
    assert expected > 1
    # max |a - b| moves by at most the bounds of the four outputs involved
    err_right, err_flipped = sdpa_error(q, k, v, attn_mask=~masked), sdpa_error(q, k, v, attn_mask=masked)
    for name in ("attn", "torch"):
        assert f.inverted_vs_correct[name] == pytest.approx(expected, abs=2 * np.max(err_right + err_flipped))
        assert f.correct_vs_numpy[name] <= 2 * np.max(err_right)
        assert f.raised[name] is None
    assert "strictly upper triangular" in f.attn_warning
    w_err = sdpa_error(q, k, v, attn_mask=masked, return_weights=True)[1]
    assert_within(f.inverted_weights, torch_weights(q, k, attn_mask=masked), 2 * w_err)


# --- pitfalls --------------------------------------------------------------

@pytest.fixture(scope="module")
def pitfalls_result():
    return pitfalls.run()


def _message(fn):
    with pytest.raises(Exception) as info:
        fn()
    return f"{info.type.__name__}: {info.value}"


def test_pitfalls_transpose_messages(pitfalls_result):
    a = np.ones((5, 4))
    t = pitfalls_result.transpose
    assert t.numpy_error == _message(lambda: a @ a)
    assert t.numpy_error.startswith("ValueError") and "size 5 is different from 4" in t.numpy_error
    assert t.torch_error == _message(lambda: torch.ones(5, 4, dtype=torch.float64) @ torch.ones(5, 4, dtype=torch.float64))
    assert t.fixed_shape == (5, 5)


def test_pitfalls_mask_and_causal(pitfalls_result):
    m = pitfalls_result.mask_and_causal
    assert m.attn_error.startswith("ValueError: attn_mask and is_causal")
    assert "mutually exclusive" in m.attn_error
    x = torch.zeros(5, 4, dtype=torch.float64)
    try:
        torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool),
                                                         is_causal=True)
        expected = "no error"
    except Exception as exc:
        expected = f"{type(exc).__name__}: {exc}"
    assert m.torch_outcome == expected


def test_pitfalls_overflow(pitfalls_result):
    o = pitfalls_result.overflow
    rng = np.random.default_rng(20261012)
    q = (rng.normal(size=1024) * 10).astype(np.float32)
    k = (rng.normal(size=(8, 1024)) * 10).astype(np.float32)
    # Each score is a float32 dot product of 1024 terms that partly cancel, so
    # its error depends on the BLAS's summation order: compare with the exact
    # (float64) dot product, within the worst-case bound of any summation order,
    # |fl(k.q) - k.q| <= n u sum|k_i q_i| (u = 2**-24; the float32 inputs are
    # exact in float64, and float64's own error is 2**29 times smaller).
    exact = k.astype(np.float64) @ q.astype(np.float64)
    bound = q.size * 2.0**-24 * (np.abs(k.astype(np.float64)) @ np.abs(q.astype(np.float64)))
    assert np.all(np.abs(o.scores - exact) <= bound)
    assert np.isnan(o.naive).any() and np.isinf(o.exp_naive).any()
    assert any("overflow" in w for w in o.naive_warnings)
    ref = torch.softmax(torch.from_numpy(o.scores).double(), dim=0).numpy()  # same scores, float64
    w_err32, w_err64 = softmax_error(o.scores), softmax_error(o.scores, dtype=np.float64)
    assert_within(o.stable, ref, w_err32 + w_err64)
    assert o.stable_vs_float64 == pytest.approx(np.max(np.abs(o.stable - ref)), abs=2 * w_err64.max())
    assert o.stable.sum() == pytest.approx(1, abs=w_err32.sum() + gamma(len(o.stable), np.float32))
    assert o.lone_dot == o.scores.min()  # the article's single score: the most negative one
    assert abs(o.lone_dot - exact.min()) <= bound[np.argmin(exact)]
    assert o.lone_exp == 0.0 and math.isnan(o.lone_ratio)
    exp32 = lambda x: torch.exp(torch.tensor(x, dtype=torch.float32)).item()
    assert math.isfinite(exp32(o.overflow_above - 0.01)) and math.isinf(exp32(o.overflow_above + 0.01))
    assert exp32(o.zero_below + 0.01) > 0 and exp32(o.zero_below - 0.01) == 0


def test_pitfalls_wrong_axis(pitfalls_result, five):
    q, k, _ = five
    s = torch.from_numpy(q @ k.T / 2)
    wrong, right = torch.softmax(s, dim=0), torch.softmax(s, dim=-1)
    w = pitfalls_result.wrong_axis
    # scores: 4-term dot products and the /2; then each softmax's weights, then 5-term row sums
    v = np.zeros((5, 1))
    err_right = sdpa_error(q, k, v, scale=0.5, return_weights=True)[1]  # softmax over keys
    err_wrong = np.swapaxes(sdpa_error(k, q, v, scale=0.5, return_weights=True)[1], 0, 1)  # over queries
    sums = gamma(5, np.float64) * 1.5  # a row sum of weights <= 1.5 (the wrong axis)
    assert_within(w.row_sums_wrong, wrong.sum(dim=-1).numpy(), 2 * (err_wrong.sum(axis=-1) + sums))
    assert_within(w.row_sums_right, np.ones(5), err_right.sum(axis=-1) + sums)
    assert w.max_diff == pytest.approx((wrong - right).abs().max().item(), abs=2 * np.max(err_wrong + err_right))


# --- parity ----------------------------------------------------------------

def test_parity_within_rounding_bounds():
    # float64 attn vs torch: each is within its rounding bound of the exact
    # result (tests/_bounds.py), so they differ by at most twice the bound; a
    # fixed 1e-15 failed with another BLAS/CPU (1.1e-15 on AMD).
    r = parity.run()
    q, k, v = five_tokens()
    x, wq, wk, wv, wo = parity.mha_weights()
    for causal, single, multi in ((False, r.single_head, r.multi_head),
                                  (True, r.single_head_causal, r.multi_head_causal)):
        single_bound = 2 * sdpa_error(q, k, v, is_causal=causal).max()
        multi_bound = 2 * mha_error(x, x, x, wq, wk, wv, wo, parity.N_HEADS, is_causal=causal).max()
        assert single_bound < 1e-12 and multi_bound < 1e-11  # still float64-tight (the diffs are ~1e-15)
        for diffs, bound in ((single, single_bound), (multi, multi_bound)):
            assert set(diffs) == {"loop", "numpy", "online", "cython"}
            assert max(diffs.values()) <= bound, (diffs, bound)


def test_multi_head_attention_against_an_einsum_form():
    rng = np.random.default_rng(5)
    x, wq, wk, wv, wo = (rng.normal(size=s) for s in [(6, 8)] + 4 * [(8, 8)])
    h, d_k = 2, 4
    qh, kh, vh = (np.einsum("th,hnd->ntd", x, w.reshape(8, h, d_k)) for w in (wq, wk, wv))  # [h, T, d_k]
    w = torch.softmax(torch.from_numpy(np.einsum("ntd,nsd->nts", qh, kh) / 2), dim=-1).numpy()
    expected = np.einsum("nts,nsd->tnd", w, vh).reshape(6, 8) @ wo
    assert_within(parity.multi_head_attention(x, wq, wk, wv, wo, h), expected,
                  2 * mha_error(x, x, x, wq, wk, wv, wo, h))


# --- loop-vs-matmul --------------------------------------------------------

def test_timing_small_run():
    r = timing.run(t=32, e=16, number=1, repeat=1)
    assert set(r.seconds) == {"loop", "numpy", "cython"}
    assert all(s > 0 for s in r.seconds.values())
    rng = np.random.default_rng(SEED)  # the demo's inputs, drawn as it documents
    q, k, v = (rng.normal(size=(32, 16)) for _ in range(3))
    assert max(r.max_diff.values()) <= 2 * sdpa_error(q, k, v).max()
    text = timing.report(r)
    assert "T=32, E=16" in text and "ms" in text
    # the printed speedups are the printed times' ratios (to the printed precision)
    ms = dict(re.findall(r"^(per-row loop|matrix \(NumPy\)|fused Cython kernel).*?([0-9.]+) ms", text, re.M))
    for label, backend in (("matrix (NumPy)", "numpy"), ("fused Cython kernel", "cython")):
        line = next(x for x in text.splitlines() if x.startswith(label))
        shown = float(re.search(r"([0-9.]+)x faster than the loop", line).group(1))
        loop, this = float(ms["per-row loop"]), float(ms[label])
        assert abs(shown - loop / this) <= 0.05 + loop / this * 1e-3 / min(this, loop) + 1e-9, (shown, loop, this)


def test_serving_bookkeeping_and_results():
    """The serving demo's steps: prefill chunks cover each prompt, decode appends one key per request per
    step. Its outputs are checked inside against float64 over the gathered pages; a wrong page, length
    or alignment is off by O(1), far above float32 rounding of these sizes (tests/test_flash.py holds
    the same calls to the rounding bound)."""
    from attn.apps.demos import serving

    steps = serving.run()
    prefill = [s for s in steps if s.kind == "prefill"]
    decode = [s for s in steps if s.kind == "decode"]
    assert tuple(np.sum([s.rows for s in prefill], axis=0)) == serving.PROMPTS
    assert all(max(s.rows) <= serving.CHUNK for s in prefill)
    assert prefill[-1].keys == serving.PROMPTS
    assert [s.keys for s in decode] == [tuple(p + i for p in serving.PROMPTS) for i in range(1, serving.DECODE_STEPS + 1)]
    assert max(s.max_error for s in steps) < 1e-4
    assert "decode" in serving.report(steps)
