"""The inverted-causal-mask guard: warns for exactly that mask, silent for legitimate ones."""

import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import attn
from attn import _mask_warning
from _bounds import assert_sdpa_close
from conftest import make_qkv, torch_sdpa


def inverted(L, S=None):
    """A causal mask written True = masked (strictly upper triangular)."""
    return np.triu(np.ones((L, L if S is None else S), dtype=bool), k=1)


def qkv(L=6, S=6, E=4, lead=()):
    return make_qkv(np.random.default_rng(0), lead, L, S, E)


@pytest.mark.parametrize("n", [2, 5, 64])
def test_warns_for_inverted_causal_and_points_at_the_caller(n):
    q, k, v = qkv(n, n)
    with pytest.warns(UserWarning, match="attn_mask is strictly upper triangular") as record:
        out = attn.scaled_dot_product_attention(q, k, v, attn_mask=inverted(n))
    assert len(record) == 1
    assert record[0].filename == __file__  # the user's line, not attn's internals
    # the guard only warns: the result is still SDPA's reading of the mask (torch's)
    assert_sdpa_close(out, torch_sdpa(q, k, v, attn_mask=inverted(n)), q, k, v, attn_mask=inverted(n))
    assert np.all(out[-1] == 0)  # the last query sees no key


def test_warns_for_batched_broadcast_and_non_square_masks():
    q, k, v = qkv(4, 7, lead=(2, 3))
    for mask in (np.broadcast_to(inverted(4, 7), (2, 3, 4, 7)), inverted(4, 7),
                 np.triu(np.ones((4, 7), bool), k=7 - 4 + 1)):  # lower-right aligned
        with pytest.warns(UserWarning, match="strictly upper"):
            attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_warns_in_masked_softmax_naming_the_argument():
    with pytest.warns(UserWarning, match="^mask is strictly upper") as record:
        attn.masked_softmax(np.zeros((5, 5)), inverted(5))
    assert record[0].filename == __file__


def test_masked_softmax_over_another_axis_is_not_checked():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.masked_softmax(np.zeros((5, 5)), inverted(5), axis=0)  # keys on axis 0: not [L, S]


def _legit_masks(rng, n):
    padding = np.ones((2, 1, 1, n), bool)
    padding[0, ..., n - 2:] = False  # batch 0 has 2 padded keys
    some_upper = inverted(n)
    some_upper[0, 0] = True  # one entry off
    return {
        "causal (tril)": np.tril(np.ones((n, n), bool)),
        "causal batched": np.broadcast_to(np.tril(np.ones((n, n), bool)), (3, n, n)),
        "padding [B,1,1,S]": padding,
        "padding [L,S]": np.broadcast_to(padding[0, 0], (n, n)),
        "random": rng.random((3, n, n)) < 0.5,
        "all True": np.ones((n, n), bool),
        "upper incl. diagonal": np.triu(np.ones((n, n), bool)),
        "strictly upper but one entry": some_upper,
        "inverted in head 0 only": np.stack([inverted(n)] + 2 * [np.tril(np.ones((n, n), bool))]),
        "one query row": inverted(1, n),
    }


@pytest.mark.parametrize("n", [5, 33])
def test_silent_for_legitimate_masks(n):
    q, k, v = qkv(n, n, lead=(2, 3))
    masks = _legit_masks(np.random.default_rng(1), n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, mask in masks.items():
            L = mask.shape[-2]
            attn.scaled_dot_product_attention(q[..., :L, :], k, v, attn_mask=mask)
            assert not _mask_warning.is_inverted_causal(mask), name
        float_mask = np.where(inverted(n), -np.inf, 0.0)  # additive masks have no convention to flip
        attn.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)


def test_cheap_probe_rejects_before_the_full_comparison(monkeypatch):
    def full_comparison(*args):
        raise AssertionError("full comparison run")

    monkeypatch.setattr(_mask_warning, "_matches", full_comparison)
    n = 512
    rng = np.random.default_rng(2)
    for mask in (np.tril(np.ones((n, n), bool)), rng.random((n, n)) < 0.5, np.ones((4, 1, 1, n), bool)):
        assert not _mask_warning.is_inverted_causal(mask)


def _run(code):
    """Python with the default warnings filters (pytest's are not inherited)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True)
    return proc.stderr


SETUP = """
import numpy as np, attn
q = k = v = np.zeros((4, 3))
m = np.triu(np.ones((4, 4), bool), 1)
"""


def test_once_per_call_site_with_default_filters():
    stderr = _run(SETUP + """
for _ in range(3):
    attn.scaled_dot_product_attention(q, k, v, attn_mask=m)  # one site, three calls
attn.scaled_dot_product_attention(q, k, v, attn_mask=m)  # a second site
""")
    assert stderr.count("UserWarning: attn_mask is strictly upper triangular") == 2
    assert len(set(re.findall(r"<string>:(\d+): UserWarning", stderr))) == 2


def test_silenceable_with_the_standard_filter():
    stderr = _run(SETUP + """
import warnings
warnings.filterwarnings("ignore", message="attn_mask is strictly upper")
attn.scaled_dot_product_attention(q, k, v, attn_mask=m)
""")
    assert stderr == ""


def test_broadcast_views_are_compared_once():
    view = np.broadcast_to(inverted(64), (10_000, 8, 64, 64))  # 328M entries, 4 KiB of memory
    assert _mask_warning._distinct(view).shape == (64, 64)
    assert _mask_warning.is_inverted_causal(view)


def test_warning_points_at_the_caller_from_multi_head_entry_points():
    """multi_head_attention reaches the guard through more attn frames than SDPA: the
    warning must still name this file, not attn's internals."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 8))
    w = [rng.normal(size=(8, 8)) for _ in range(4)]
    with pytest.warns(UserWarning, match="strictly upper") as record:
        attn.multi_head_attention(x, x, x, *w, 2, attn_mask=inverted(5))
    assert [r.filename for r in record] == [__file__]
