"""The training demo: its text is the standard library's ``this`` text; both models train alike."""

import codecs
import contextlib
import io

import numpy as np

from attn.apps.demos import training


def test_text_is_the_zen_of_python_from_the_standard_library():
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this
    assert training.TEXT_PATH.read_text(encoding="utf-8") == codecs.decode(this.s, "rot13") + "\n"


def test_loss_curves_agree_to_float64_rounding():
    res = training.run(steps=4)
    torch_loss, attn_loss = np.array(res.losses["torch"]), np.array(res.losses["attn"])
    assert torch_loss.shape == (4,) and np.all(np.isfinite(torch_loss))
    assert torch_loss[-1] < torch_loss[0]  # it learns
    # cross-entropy of ~4 from sums of ~1e3 float64 terms: a few ulps of 4 per step
    assert res.max_abs_diff <= 1e-12 and np.max(np.abs(attn_loss - torch_loss)) == res.max_abs_diff
