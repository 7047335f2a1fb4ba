"""Causal masking on the 5-token example: -inf vs -1e9, and the bool-convention flip.

Three experiments:

* the causal mask as ``-inf`` added to the scores (the paper's way);
* the same mask as ``-1e9`` in float32, which the seed article says leaves
  "tiny non-zero weights" -- it does not: ``exp(-1e9 - m)`` underflows to
  exactly 0 whenever the row has a key that takes part. ``-1e9`` and ``-inf``
  differ only on a row whose keys are *all* masked;
* the causal mask passed to SDPA in its convention (True = takes part) and
  inverted (the seed's True = masked array passed as is).
"""

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from attn._api import masked_softmax, scaled_dot_product_attention, softmax
from ._common import causal_true_masked, error_text, five_tokens, max_abs_diff, optional_torch, scores

BIG_NEGATIVE = -1e9


@dataclass
class CausalResult:
    """Weights with and without the causal mask (-inf), float64."""

    weights: np.ndarray  # [5, 5], no mask
    max_row_sum_error: float  # max |sum_j w_ij - 1|, no mask
    causal_weights: np.ndarray  # [5, 5], causal, masked scores = -inf
    max_masked_weight: float  # largest weight at a masked position (-inf)
    row2_attended: tuple  # positions with weight > 0 in row 2


@dataclass
class BigNegativeResult:
    """The causal mask as -1e9 in float32, and a row with every key masked."""

    weights: np.ndarray  # [5, 5] float32, attn with a -1e9 float mask
    max_masked_weight: float  # attn
    n_masked_nonzero: int  # masked positions whose weight is not exactly 0 (attn)
    max_masked_weight_numpy: float  # plain softmax(scores + mask), the seed's form
    max_diff_vs_inf: float  # max |w(-1e9) - w(-inf)|, float32
    all_masked_big_f32: np.ndarray  # [5] a row with every key at -1e9, float32
    all_masked_inf_softmax: np.ndarray  # [5] every key -inf, plain softmax -> NaN
    all_masked_inf_attn: np.ndarray  # [5] every key -inf, attn.masked_softmax -> 0
    all_masked_big_f64_vs_unmasked: float  # float64: max |softmax(s - 1e9) - softmax(s)|


@dataclass
class FlipResult:
    """The causal mask in SDPA's convention vs inverted, for attn and torch."""

    correct_vs_numpy: dict  # impl -> max |out(correct) - seed-style NumPy reference|
    inverted_vs_correct: dict  # impl -> max |out(inverted) - out(correct)|
    raised: dict  # impl -> None, or "Type: message" if the inverted call raised
    attn_warning: Optional[str]  # the UserWarning attn emitted for the inverted mask
    inverted_weights: np.ndarray  # [5, 5] attn's weights with the inverted mask
    torch_version: Optional[str]  # None when torch is not installed


@dataclass
class MasksResult:
    causal: CausalResult
    big_negative: BigNegativeResult
    flip: FlipResult


def _weights(q, k, v, mask=None):
    """attn's attention weights [n_q, n_k] for a float or bool mask."""
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True)[1]


def run_causal(q, k, v):
    """Weights without a mask and with the causal mask as -inf (float64)."""
    w = _weights(q, k, v)
    masked = causal_true_masked(len(q))  # [5, 5], True = masked
    wc = _weights(q, k, v, np.where(masked, -np.inf, 0.0))
    return CausalResult(
        weights=w, max_row_sum_error=float(np.max(np.abs(w.sum(axis=-1) - 1))),
        causal_weights=wc, max_masked_weight=float(wc[masked].max()),
        row2_attended=tuple(int(j) for j in np.flatnonzero(wc[2] > 0)),
    )


def _all_masked_row(s_row):
    """One row of scores [n] with every key masked: -1e9 (float32, float64) vs -inf."""
    s32 = s_row.astype(np.float32)
    big32 = softmax(s32 + np.float32(BIG_NEGATIVE))  # -1e9 swallows every score: all equal
    with np.errstate(invalid="ignore"):
        inf_plain = softmax(s32 + np.float32(-np.inf))  # -inf - (-inf) = NaN
    inf_attn = masked_softmax(s32, np.zeros_like(s_row, dtype=bool))
    drift64 = max_abs_diff(softmax(s_row + BIG_NEGATIVE), softmax(s_row))
    return big32, inf_plain, inf_attn, drift64


def run_big_negative(q, k, v):
    """The causal mask as -1e9 in float32, next to -inf."""
    masked = causal_true_masked(len(q))  # [5, 5], True = masked
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    w_big = _weights(q32, k32, v32, np.where(masked, BIG_NEGATIVE, 0.0).astype(np.float32))
    w_inf = _weights(q32, k32, v32, np.where(masked, -np.inf, 0.0).astype(np.float32))
    s32 = scores(q32, k32)  # [5, 5] float32
    w_numpy = softmax(s32 + np.where(masked, BIG_NEGATIVE, 0.0).astype(np.float32))
    big32, inf_plain, inf_attn, drift64 = _all_masked_row(scores(q, k)[0])
    return BigNegativeResult(
        weights=w_big, max_masked_weight=float(w_big[masked].max()),
        n_masked_nonzero=int(np.count_nonzero(w_big[masked])),
        max_masked_weight_numpy=float(w_numpy[masked].max()),
        max_diff_vs_inf=max_abs_diff(w_big, w_inf),
        all_masked_big_f32=big32, all_masked_inf_softmax=inf_plain, all_masked_inf_attn=inf_attn,
        all_masked_big_f64_vs_unmasked=drift64,
    )


def seed_numpy_attention(q, k, v, masked):
    """The seed's NumPy attention: ``np.where(mask, -inf, scores)``, mask True = masked."""
    w = softmax(np.where(masked, -np.inf, scores(q, k)))  # [n_q, n_k]
    return w @ v  # [n_q, n_k] @ [n_k, d_v] -> [n_q, d_v]


def _attn_flip(q, k, v, masked):
    """attn with the correct mask (~masked) and the inverted one (masked), warnings caught."""
    correct = scaled_dot_product_attention(q, k, v, attn_mask=~masked)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inverted, w_inv = scaled_dot_product_attention(q, k, v, attn_mask=masked, return_weights=True)
    text = next((str(c.message) for c in caught if issubclass(c.category, UserWarning)), None)
    return correct, inverted, w_inv, text


def _torch_flip(torch, q, k, v, masked):
    """torch's SDPA with the correct and the inverted bool mask."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    with torch.no_grad():
        correct = sdpa(tq, tk, tv, attn_mask=torch.from_numpy(~masked)).numpy()
        try:
            inverted = sdpa(tq, tk, tv, attn_mask=torch.from_numpy(masked)).numpy()
        except Exception as exc:  # report whatever the installed torch does
            return correct, None, error_text(exc)
    return correct, inverted, None


def run_flip(q, k, v):
    """The same causal mask in SDPA's convention and inverted, attn and (if installed) torch."""
    masked = causal_true_masked(len(q))  # [5, 5], True = masked
    reference = seed_numpy_attention(q, k, v, masked)
    correct, inverted, w_inv, warning = _attn_flip(q, k, v, masked)
    result = FlipResult(
        correct_vs_numpy={"attn": max_abs_diff(correct, reference)},
        inverted_vs_correct={"attn": max_abs_diff(inverted, correct)},
        raised={"attn": None}, attn_warning=warning, inverted_weights=w_inv, torch_version=None,
    )
    torch = optional_torch()
    if torch is not None:
        t_correct, t_inverted, t_raised = _torch_flip(torch, q, k, v, masked)
        result.torch_version = torch.__version__
        result.correct_vs_numpy["torch"] = max_abs_diff(t_correct, reference)
        result.raised["torch"] = t_raised
        if t_inverted is not None:
            result.inverted_vs_correct["torch"] = max_abs_diff(t_inverted, t_correct)
    return result


def run():
    """All three experiments on the 5-token example."""
    q, k, v = five_tokens()
    return MasksResult(causal=run_causal(q, k, v), big_negative=run_big_negative(q, k, v),
                       flip=run_flip(q, k, v))


def _vec(a):
    return np.array2string(np.asarray(a), precision=6, floatmode="fixed", suppress_small=False)


def _report_causal(c):
    return [
        "5 tokens, d_k = 4, q, k, v ~ N(0, 1) from numpy.random.default_rng(20261012), float64",
        f"no mask, row 0 weights: {_vec(c.weights[0])}",
        f"no mask, max |row sum - 1|: {c.max_row_sum_error!r}",
        f"causal mask as -inf: max weight at a masked position = {c.max_masked_weight!r}",
        f"causal mask as -inf: row 2 attends to positions {list(c.row2_attended)} "
        f"({len(c.row2_attended)} weights > 0)",
    ]


def _report_big_negative(b):
    claim = ("the article's claim of tiny non-zero weights does NOT reproduce"
             if b.n_masked_nonzero == 0 else "non-zero masked weights, as the article says")
    return [
        "",
        "causal mask as -1e9 in float32:",
        f"  max weight at a masked position: {b.max_masked_weight!r} (attn), "
        f"{b.max_masked_weight_numpy!r} (plain NumPy softmax); "
        f"non-zero masked weights: {b.n_masked_nonzero} -> {claim}:",
        "  exp(-1e9 - row max) underflows to exactly 0 whenever a row has a key that takes part",
        f"  max |weights(-1e9) - weights(-inf)|: {b.max_diff_vs_inf!r}",
        "where -1e9 and -inf really differ: a row whose keys are ALL masked (row 0 below)",
        f"  float32, every key -1e9:            {_vec(b.all_masked_big_f32)}  (uniform: attends everywhere)",
        f"  float32, every key -inf, softmax:   {_vec(b.all_masked_inf_softmax)}",
        f"  float32, every key -inf, attn:      {_vec(b.all_masked_inf_attn)}  (attn.masked_softmax, like torch SDPA)",
        f"  float64, every key -1e9: max |w - softmax(unmasked row)| = {b.all_masked_big_f64_vs_unmasked:.2e}"
        " (the constant almost cancels: the row attends as if unmasked)",
    ]


def _report_flip(f):
    lines = ["", "the same causal mask in SDPA's bool convention (True = takes part) vs inverted:"]
    names = ["attn"] + (["torch"] if f.torch_version else [])
    for name in names:
        label = name if name == "attn" else f"torch {f.torch_version}"
        inv = f.inverted_vs_correct.get(name)
        lines += [
            f"  {label}: convention right (~mask): max |out - seed NumPy| = {f.correct_vs_numpy[name]!r}",
            f"  {label}: convention flipped (mask): max |out - right| = "
            + (f"{inv!r}" if inv is not None else "n/a")
            + f"; raised: {f.raised[name] or 'nothing'}",
        ]
    if not f.torch_version:
        lines.append("  torch is not installed: its side of the comparison is skipped")
    lines.append("  attn warned: " + (f"UserWarning: {f.attn_warning}" if f.attn_warning else "no"))
    return lines


def report(result):
    """All three experiments as text."""
    return "\n".join(_report_causal(result.causal) + _report_big_negative(result.big_negative)
                     + _report_flip(result.flip))
