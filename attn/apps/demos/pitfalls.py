"""The seed article's five errors, reproduced live.

1. K not transposed, NumPy: ``q @ k`` with q, k both [5, 4] -> ValueError.
2. K not transposed, torch: the same -> RuntimeError.
3. ``attn_mask`` together with ``is_causal``: attn's ValueError, and whatever
   the installed torch does.
4. float32 softmax without subtracting the max: exp overflows/underflows and
   the weights become NaN; with the max subtracted they are right.
5. softmax over the wrong axis: no error, wrong numbers.

Messages are the installed versions' own, caught and kept as text.
"""

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from attn._api import scaled_dot_product_attention, softmax
from ._common import SEED, error_text, five_tokens, max_abs_diff, optional_torch, scores

N_DIMS = 1024
FACTOR = 10.0
N_KEYS = 8


@dataclass
class TransposeResult:
    """Errors 1 and 2: ``q @ k`` instead of ``q @ k^T`` (q, k both [5, 4])."""

    numpy_error: str
    torch_error: Optional[str]  # None: torch not installed
    fixed_shape: tuple  # shape of q @ k.T


@dataclass
class MaskAndCausalResult:
    """Error 3: ``attn_mask`` and ``is_causal=True`` in one call."""

    attn_error: str
    torch_outcome: Optional[str]  # "Type: message", or "no error"; None: torch not installed


@dataclass
class OverflowResult:
    """Error 4: float32 softmax of dot products of 1024-dim vectors scaled by 10."""

    scores: np.ndarray  # [N_KEYS] float32, k @ q
    exp_naive: np.ndarray  # [N_KEYS] float32, np.exp(scores)
    naive: np.ndarray  # [N_KEYS] exp(s) / sum(exp(s))
    naive_warnings: list  # RuntimeWarning messages NumPy printed
    stable: np.ndarray  # [N_KEYS] attn.softmax (max subtracted), float32
    stable_vs_float64: float  # max |stable - softmax of the float64 scores|
    lone_dot: float  # the most negative score, on its own (the seed's single-score case)
    lone_exp: float  # exp(lone_dot) in float32
    lone_ratio: float  # exp(lone_dot) / exp(lone_dot)
    lone_warnings: list
    overflow_above: float  # float32 exp(x) is inf above this x
    zero_below: float  # float32 exp(x) rounds to 0 below this x (half the smallest subnormal)


@dataclass
class WrongAxisResult:
    """Error 5: ``np.exp(s) / np.exp(s).sum(axis=0)`` on the 5-token scores."""

    row_sums_wrong: np.ndarray  # [5]
    row_sums_right: np.ndarray  # [5]
    max_diff: float  # max |wrong - right|


@dataclass
class PitfallsResult:
    transpose: TransposeResult
    mask_and_causal: MaskAndCausalResult
    overflow: OverflowResult
    wrong_axis: WrongAxisResult


def _raised(fn):
    """Run ``fn``; return "Type: message" of what it raised, or None."""
    try:
        fn()
    except Exception as exc:  # the point is to show whatever is raised
        return error_text(exc)
    return None


def run_transpose(q, k, torch):
    """``q @ k`` in NumPy and torch."""
    numpy_error = _raised(lambda: q @ k)
    torch_error = None
    if torch is not None:
        torch_error = _raised(lambda: torch.from_numpy(q) @ torch.from_numpy(k))
    return TransposeResult(numpy_error, torch_error, (q @ k.T).shape)  # [5, 4] @ [4, 5] -> [5, 5]


def run_mask_and_causal(q, k, v, torch):
    """A causal bool mask and ``is_causal=True`` together."""
    allowed = np.tril(np.ones((len(q), len(k)), dtype=bool))  # [5, 5], True = takes part
    attn_error = _raised(lambda: scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=True))
    torch_outcome = None
    if torch is not None:
        t = [torch.from_numpy(a) for a in (q, k, v, allowed)]
        torch_outcome = _raised(lambda: torch.nn.functional.scaled_dot_product_attention(
            *t[:3], attn_mask=t[3], is_causal=True)) or "no error"
    return MaskAndCausalResult(attn_error, torch_outcome)


def _with_warnings(fn):
    """Run ``fn`` and return (its value, the messages of the RuntimeWarnings it emitted)."""
    with warnings.catch_warnings(record=True) as caught, np.errstate(
            over="warn", invalid="warn", divide="warn", under="ignore"):  # NumPy's defaults
        warnings.simplefilter("always")
        value = fn()
    return value, [f"RuntimeWarning: {c.message}" for c in caught if c.category is RuntimeWarning]


def naive_softmax(s):
    """``(exp(s), exp(s) / sum(exp(s)))``: softmax without subtracting the max."""
    e = np.exp(s)
    return e, e / e.sum()


def _exp_ratio(x):
    """``(exp(x), exp(x) / exp(x))``: the article's single-score softmax."""
    e = np.exp(x)
    return e, e / e


def run_overflow(seed=SEED, n_dims=N_DIMS, n_keys=N_KEYS, factor=FACTOR):
    """float32 scores of size ~1e3: naive softmax gives NaN, the stable one does not."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(n_dims,)) * factor).astype(np.float32)  # [n_dims]
    k = (rng.normal(size=(n_keys, n_dims)) * factor).astype(np.float32)  # [n_keys, n_dims]
    s = k @ q  # [n_keys] float32
    (e, naive), naive_warnings = _with_warnings(lambda: naive_softmax(s))
    stable = softmax(s)
    lone = s[np.argmin(s)]  # a single float32 score, as in the article
    (lone_exp, ratio), lone_warnings = _with_warnings(lambda: _exp_ratio(lone))
    tiny = np.finfo(np.float32).smallest_subnormal
    return OverflowResult(
        overflow_above=float(np.log(np.finfo(np.float32).max)), zero_below=float(np.log(float(tiny) / 2)),
        scores=s, exp_naive=e, naive=naive, naive_warnings=naive_warnings, stable=stable,
        stable_vs_float64=max_abs_diff(stable, softmax(s.astype(np.float64))),
        lone_dot=float(lone), lone_exp=float(lone_exp), lone_ratio=float(ratio), lone_warnings=lone_warnings,
    )


def run_wrong_axis(q, k):
    """Normalizing the columns instead of the rows."""
    s = scores(q, k)  # [5, 5]
    wrong = np.exp(s) / np.exp(s).sum(axis=0)
    right = softmax(s, axis=-1)
    return WrongAxisResult(wrong.sum(axis=-1), right.sum(axis=-1), max_abs_diff(wrong, right))


def run():
    """All five errors (torch's parts are None when torch is not installed)."""
    q, k, v = five_tokens()
    torch = optional_torch()
    return PitfallsResult(
        transpose=run_transpose(q, k, torch), mask_and_causal=run_mask_and_causal(q, k, v, torch),
        overflow=run_overflow(), wrong_axis=run_wrong_axis(q, k),
    )


def _vec(a, fmt="{:.6f}"):
    return "[" + " ".join(fmt.format(x) for x in np.asarray(a).tolist()) + "]"


NO_TORCH = "(torch is not installed: skipped)"


def _report_transpose(t):
    return [
        "1. K not transposed, NumPy: q (5, 4) @ k (5, 4)",
        f"   {t.numpy_error}",
        "2. K not transposed, torch: the same",
        f"   {t.torch_error or NO_TORCH}",
        f"   fix: q @ k.T (k.transpose(-2, -1) in torch) -> shape {t.fixed_shape}",
    ]


def _report_mask_and_causal(m):
    return [
        "3. attn_mask and is_causal=True together",
        f"   attn:  {m.attn_error}",
        f"   torch: {m.torch_outcome or NO_TORCH}",
        "   fix: one or the other: is_causal=True for the square causal mask, attn_mask for any other",
    ]


def _report_overflow(o):
    fmt = "{:.6g}"
    return [
        f"4. float32 softmax without subtracting the max ({N_DIMS}-dim q and {N_KEYS} keys ~ N(0, 1) x {FACTOR:g})",
        f"   scores k @ q:           {_vec(o.scores, '{:.3f}')}",
        f"   exp(scores):            {_vec(o.exp_naive, fmt)}",
        f"   exp(s) / sum(exp(s)):   {_vec(o.naive, fmt)}",
        *(f"   {w}" for w in o.naive_warnings),
        f"   one score alone: dot = {o.lone_dot:.3f}, exp(dot) = {o.lone_exp!r}, e/e = {o.lone_ratio!r}",
        *(f"   {w}" for w in o.lone_warnings),
        f"   why: float32 exp(x) is inf above x = {o.overflow_above:.2f} and exactly 0 below about "
        f"x = {o.zero_below:.2f}; inf/inf and 0/0 are NaN",
        "   fix: subtract the row max first: the largest exponent is exp(0) = 1, the sum is >= 1",
        f"   with the max subtracted (attn.softmax): {_vec(o.stable, fmt)}",
        f"   max |that - float64 softmax|: {o.stable_vs_float64!r}",
    ]


def _report_wrong_axis(w):
    return [
        "5. softmax over the wrong axis (np.exp(s) / np.exp(s).sum(axis=0)), 5-token scores",
        f"   axis=0 row sums:  {_vec(w.row_sums_wrong)}",
        f"   axis=-1 row sums: {_vec(w.row_sums_right)}",
        f"   max |axis=0 - axis=-1|: {w.max_diff!r}  (no error raised: only a row-sum check catches it)",
    ]


def report(result):
    """The five errors as text."""
    return "\n".join(
        _report_transpose(result.transpose) + _report_mask_and_causal(result.mask_and_causal)
        + _report_overflow(result.overflow) + _report_wrong_axis(result.wrong_axis)
    )
