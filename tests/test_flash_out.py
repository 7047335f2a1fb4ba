"""flash_attn_varlen_func(..., out=): the result written into the caller's array (vLLM's flash-attention
takes ``out`` so), by the kernel itself where it can, else copied in; checked before anything runs.

Each result is held to torch float64 over the same values within float32's rounding bound
(tests/_bounds.py via test_flash's helpers), and ``out`` must be the very object returned.
"""

import numpy as np
import pytest
import torch

from attn.flash import flash_attn_varlen_func

from _bounds import assert_within
from test_flash import seq_bound, seq_reference
from test_flash_layout_memo import CASES, _batch, _call, _check


@pytest.mark.parametrize("batch", ["decode", "mixed", "chunks first"])
@pytest.mark.parametrize("case", list(CASES))
def test_out_is_written_and_returned(case, batch, rng):
    """Paged calls (twice: the first derives the layout's calls, the second runs them) into a C-contiguous
    out and into a strided view of a larger array (copied in): the same bits as without out, within the
    bound, the rest of the larger array untouched."""
    q, k, v, cu_q, cu_k, table = _batch(rng, case, batch)
    ref = _call(q, k, v, cu_q, cu_k, table)
    _check(ref, q, k, v, cu_q, cu_k, table, f"{case} {batch}")
    for call in range(2):
        out = np.full(ref.shape, np.nan, q.dtype)
        assert _call(q, k, v, cu_q, cu_k, table, out=out) is out
        np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8), f"call {call}")
        wide = np.full(ref.shape[:2] + (2 * ref.shape[2],), np.nan, q.dtype)
        view = wide[:, :, ::2]   # [total_q, H, Ev] with a column stride of 2
        assert _call(q, k, v, cu_q, cu_k, table, out=view) is view
        np.testing.assert_array_equal(np.ascontiguousarray(view).view(np.uint8), ref.view(np.uint8), f"call {call} strided")
        assert np.isnan(wide[:, :, 1::2].astype(np.float32)).all()


def test_packed_batch_and_attn_probs_into_out(rng):
    """Without a block_table (varlen_attention's path) and with return_attn_probs: out is the first result."""
    q_len, k_len, H, E = [3, 1, 6], [3, 40, 9], 4, 32
    cu_q, cu_k = np.cumsum([0] + q_len), np.cumsum([0] + k_len)
    q = rng.standard_normal((sum(q_len), H, E)).astype(np.float32)
    k, v = (rng.standard_normal((sum(k_len), 2, E)).astype(np.float32) for _ in range(2))
    out = np.empty((sum(q_len), H, E), np.float32)
    got, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 40, causal=True, return_attn_probs=True,
                                             out=out)
    assert got is out and lse.shape == (H, sum(q_len)) and probs.shape[:2] == (3, H)
    for s in range(3):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        ref = seq_reference(qs, ks, vs, causal=True)["out"]
        assert_within(out[cu_q[s]:cu_q[s + 1]], ref, seq_bound(qs, ks, vs, ref, dtype=np.float32, causal=True),
                      f"sequence {s}")


def test_torch_out_is_the_same_tensor(rng):
    """A torch bfloat16 out (vLLM's output buffer) is returned as that tensor, written in place."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "bfloat16", "mixed")
    ref = _call(q, k, v, cu_q, cu_k, table)
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (k, v))
    for _ in range(2):
        out = torch.full(tuple(ref.shape), float("nan"), dtype=torch.bfloat16)
        got = flash_attn_varlen_func(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 9, 200, causal=True,
                                     block_table=torch.from_numpy(table), out=out)
        assert got is out
        np.testing.assert_array_equal(out.view(torch.int16).numpy(), ref.view(np.int16))


def test_bad_out_raises_before_anything_is_written(rng):
    """Wrong shape, dtype, a read-only or overlapping out, and a bad argument beside a good out: a clear
    error naming it, and out as it was."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    total, H, Ev = q.shape[0], q.shape[1], v.shape[-1]
    with pytest.raises(ValueError, match=r"out must have q's dtype and the shape .* = \(4, 6, 64\)"):
        _call(q, k, v, cu_q, cu_k, table, out=np.empty((total, H, Ev + 1), np.float32))
    with pytest.raises(ValueError, match="out must have q's dtype"):
        _call(q, k, v, cu_q, cu_k, table, out=np.empty((total, H, Ev), np.float64))
    with pytest.raises(TypeError, match="out must be an array"):
        _call(q, k, v, cu_q, cu_k, table, out=[[0.0]])
    frozen = np.zeros((total, H, Ev), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        _call(q, k, v, cu_q, cu_k, table, out=frozen)
    with pytest.raises(ValueError, match="out overlaps q"):
        _call(q, k, v, cu_q, cu_k, table, out=q)
    out = np.full((total, H, Ev), 7.0, np.float32)
    bad = table.copy()
    bad[0, 0] = k.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]"):
        _call(q, k, v, cu_q, cu_k, bad, out=out)
    assert (out == 7.0).all()


def test_out_with_autograd_is_refused(rng):
    q = torch.randn(5, 2, 16, requires_grad=True)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="out= has no backward"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, out=torch.empty(5, 2, 16))


def test_out_that_requires_grad_is_refused_and_numpy_out_is_returned(rng):
    """A torch out that requires grad (autograd cannot record the in-place write) is refused; a NumPy out
    beside torch inputs is returned as itself."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    args = (torch.from_numpy(cu_q), torch.from_numpy(cu_k), 1, 300)
    with pytest.raises(ValueError, match="out requires grad"):
        flash_attn_varlen_func(tq, tk, tv, *args, causal=True, block_table=torch.from_numpy(table),
                               out=torch.empty(tuple(q.shape), requires_grad=True))
    out = np.empty(q.shape, np.float32)
    assert flash_attn_varlen_func(tq, tk, tv, *args, causal=True, block_table=torch.from_numpy(table), out=out) is out
    _check(out, q, k, v, cu_q, cu_k, table, "numpy out")
