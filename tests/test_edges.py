"""Edge inputs get defined results, the same on every backend, held to torch.

Empty dims, E = 1, fully masked rows, NaN/inf rows, huge logits, every memory
layout (non-contiguous, Fortran, negative strides, read-only, memory-mapped,
broadcast) without copying the inputs, and L*S > 2**31 on the cython backend.
"""

import math
import time
import tracemalloc

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_sdpa_close, assert_weights_close, assert_within, gamma, sdpa_error, softmax_error
from _layouts import layouts, misaligned, offset_layouts, relayout
from conftest import BACKENDS, make_qkv, random_bool_mask, torch_sdpa, torch_weights


def sdpa(*args, **kwargs):
    return attn.scaled_dot_product_attention(*args, **kwargs)


def f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


# ---------------------------------------------------------------------------
# empty and tiny dims

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead,L,S,E,Ev", [
    ((2,), 0, 6, 4, 3),   # L = 0: empty output of the right shape
    ((2,), 5, 0, 4, 3),   # S = 0: zeros, like torch
    ((2,), 0, 0, 4, 3),
    ((0,), 5, 6, 4, 3),   # empty batch
    ((2, 0), 5, 6, 4, 3),
    ((2,), 5, 6, 0, 3),   # E = 0: every score is 0, uniform weights (torch agrees)
    ((2,), 5, 6, 4, 0),   # Ev = 0: empty output, weights still real
    ((), 1, 1, 1, 1),
])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_dims(backend, lead, L, S, E, Ev, causal, rng):
    q, k, v = make_qkv(rng, lead, L, S, E, Ev)
    out, w = sdpa(q, k, v, is_causal=causal, backend=backend, return_weights=True)
    assert out.shape == lead + (L, Ev) and out.dtype == np.float64
    assert w.shape == lead + (L, S)
    ref = torch_sdpa(q, k, v, is_causal=causal)
    assert_sdpa_close(out, ref, q, k, v, is_causal=causal)
    if S == 0:
        assert np.all(out == 0)
    if E == 0 or Ev == 0:
        scale = 1.0 if E == 0 else None  # E = 0: scores are 0
        w_ref = torch_weights(q, k, is_causal=causal, scale=scale)
        assert_weights_close(w, w_ref, q, k, is_causal=causal, scale=scale)
        if E == 0 and not causal and L and S and math.prod(lead):
            assert np.allclose(w, 1 / S)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_E_equals_1(backend, causal, rng):
    q, k, v = make_qkv(rng, (3,), 70, 150, 1, 1)
    out = sdpa(q, k, v, is_causal=causal, backend=backend)
    if causal == "lower_right":
        mask = attn.causal_allowed(70, 150, 150 - 70)
        ref = torch_sdpa(q, k, v, attn_mask=mask)
    else:
        ref = torch_sdpa(q, k, v, is_causal=causal)
    assert_sdpa_close(out, ref, q, k, v, is_causal=causal)


@pytest.mark.parametrize("backend", ["numpy", "cython"])
@pytest.mark.parametrize("shape,axis", [((0,), -1), ((3, 0), -1), ((3, 0), 0), ((0, 4), -1), ((1,), 0)])
def test_masked_softmax_empty(backend, shape, axis):
    x = np.ones(shape, np.float32)
    out = attn.masked_softmax(x, axis=axis, backend=backend)
    ref = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
    assert out.shape == shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, ref)


# ---------------------------------------------------------------------------
# fully masked rows

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "neg_inf", "lower_right_L_gt_S", "mask_all_false"])
def test_fully_masked_rows_are_zero(backend, kind, rng):
    L, S = (9, 4) if kind == "lower_right_L_gt_S" else (6, 200)
    q, k, v = make_qkv(rng, (2,), L, S, 8)
    mask, causal, empty_rows = None, False, [2, 5]
    if kind == "lower_right_L_gt_S":  # rows 0..L-S-1 see no key
        causal, empty_rows = "lower_right", list(range(L - S))
    else:
        allowed = random_bool_mask(rng, (2, L, S))
        allowed[:, empty_rows] = False
        if kind == "mask_all_false":
            allowed[:] = False
            empty_rows = list(range(L))
        mask = allowed if kind != "neg_inf" else np.where(allowed, 0.0, -np.inf)
    out, w = sdpa(q, k, v, attn_mask=mask, is_causal=causal, backend=backend, return_weights=True)
    assert not np.isnan(out).any() and not np.isnan(w).any()
    assert np.all(out[:, empty_rows] == 0) and np.all(w[:, empty_rows] == 0)
    others = [i for i in range(L) if i not in empty_rows]
    if causal:
        ref = np.nan_to_num(torch_sdpa(q, k, v, attn_mask=attn.causal_allowed(L, S, S - L)))
    else:
        ref = torch_sdpa(q, k, v, attn_mask=mask)
    assert_sdpa_close(out, ref, q, k, v, attn_mask=mask, is_causal=causal)
    # a row of S weights sums to 1 within the rounding of the weights and of the sum
    w_err = sdpa_error(q, k, v, attn_mask=mask, is_causal=causal, return_weights=True)[1].sum(axis=-1)
    assert np.all(np.abs(w[:, others].sum(-1) - 1) <= w_err[:, others] + 2 * gamma(S, np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_huge_negative_mask_is_not_masking(backend, rng):
    """-1e30 everywhere is a constant shift, not a mask: uniform weights (torch agrees)."""
    q, k, v = make_qkv(rng, (2,), 5, 7, 4)
    bias = np.full((5, 7), -1e30)
    out = sdpa(q, k, v, attn_mask=bias, backend=backend)
    # |score| << ulp(1e30) / 2: every masked score rounds to exactly -1e30, so the
    # computed problem is attention with equal scores, i.e. the mean of v
    mean = np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape)
    bound = sdpa_error(np.zeros_like(q), k, v)  # equal scores
    assert_within(out, mean, 2 * bound)
    assert_within(torch_sdpa(q, k, v, attn_mask=bias), mean, 2 * bound, "torch")


@pytest.mark.parametrize("backend", ["numpy", "cython"])
def test_masked_softmax_fully_masked_and_nan(backend, rng):
    x = rng.standard_normal((4, 300))
    mask = random_bool_mask(rng, x.shape)
    mask[1] = False
    x[2, 17] = np.nan
    mask[2, 17] = True  # a masked NaN is excluded (as masked_fill would), an unmasked one spreads
    out = attn.masked_softmax(x, mask, backend=backend)
    assert np.all(out[1] == 0)
    assert np.all(np.isnan(out[2]))
    ref = torch.softmax(torch.from_numpy(np.where(mask, x, -np.inf)), -1).numpy()
    assert_within(out[[0, 3]], ref[[0, 3]], 2 * softmax_error(x, mask)[[0, 3]])


# ---------------------------------------------------------------------------
# NaN / inf and huge logits

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("S", [7, 300])  # one key tile, and several
def test_nonfinite_query_row(backend, bad, dtype, S, rng):
    """A NaN/inf in one query row makes that row NaN and leaves the others untouched."""
    q, k, v = make_qkv(rng, (2,), 70, S, 8, dtype=dtype)
    clean = sdpa(q, k, v, backend=backend)
    q[1, 66, 3] = bad
    out = sdpa(q, k, v, backend=backend)
    ref = torch_sdpa(q, k, v)
    assert np.isnan(ref[1, 66]).all()  # torch: that row is NaN
    assert np.isnan(out[1, 66]).all()
    untouched = np.ones(out.shape[:-1], bool)
    untouched[1, 66] = False
    np.testing.assert_array_equal(out[untouched], clean[untouched])
    assert not np.isnan(out[untouched]).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_key_or_value_matches_torch(backend, where, rng):
    q, k, v = make_qkv(rng, (2,), 5, 300, 4)
    (k if where == "key" else v)[0, 250, 1] = np.nan
    out = sdpa(q, k, v, backend=backend)
    assert_sdpa_close(out, torch_sdpa(q, k, v), q, k, v)  # NaN where torch has NaN, else within bounds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("magnitude", [1e4, 3e4])
def test_huge_logits_are_finite(backend, dtype, magnitude, rng):
    """Scores of magnitude 1e4 and more: max-subtraction keeps everything finite."""
    q, k, v = make_qkv(rng, (2,), 33, 150, 1, 4, dtype=np.float64)
    q = np.sign(q) * math.sqrt(magnitude)
    k = np.sign(k) * math.sqrt(magnitude)  # every score is exactly +-magnitude
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out = sdpa(q, k, v, scale=1.0, backend=backend)
    assert np.isfinite(out).all()
    ref = torch_sdpa(*(a.astype(np.float64) for a in (q, k, v)), scale=1.0)
    assert_sdpa_close(out, ref, q, k, v, scale=1.0)


@pytest.mark.parametrize("backend", ["numpy", "cython"])
def test_masked_softmax_huge_logits(backend):
    x = np.array([[1e4, -1e4, 1e4 - 1], [-3e38, 3e38, 0]], np.float32)
    out = attn.masked_softmax(x, backend=backend)
    ref = torch.softmax(torch.from_numpy(x), -1).numpy()  # torch in float32 too
    assert np.isfinite(out).all()
    assert_within(out, ref, 2 * softmax_error(x))


# ---------------------------------------------------------------------------
# memory layouts: same results, no copy of the inputs

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
def test_layouts_same_result(backend, dtype, mask_kind, rng, tmp_path):
    lead, L, S, E, Ev = (2, 3), 70, 150, 8, 5
    mask = None
    if mask_kind == "bool":
        mask = random_bool_mask(rng, (3, L, S))
        mask = relayout(mask, "fortran")  # a strided bool mask
    elif mask_kind == "float":
        mask = rng.standard_normal((1, L, 2 * S))[..., ::2].astype(dtype)  # row/col strided
    causal = mask_kind == "causal"
    q, k, v = make_qkv(rng, lead, L, S, E, Ev, dtype=dtype)
    ref_mask = None if mask is None else mask.astype(np.float64) if mask.dtype != bool else mask
    ref = torch_sdpa(*f64(q, k, v), attn_mask=ref_mask, is_causal=causal)
    names = ("c", "fortran", "negative", "mixed", "transposed", "read_only", "memmap")
    for name, (q2, k2, v2) in layouts((q, k, v), names, tmp_path):
        out = sdpa(q2, k2, v2, attn_mask=mask, is_causal=causal, backend=backend)
        assert out.shape == lead + (L, Ev) and out.dtype == dtype, name
        assert_sdpa_close(out, ref, q, k, v, attn_mask=ref_mask, is_causal=causal, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_broadcast_inputs(backend, dtype, rng):
    """Stride-0 inputs (np.broadcast_to) and a stride-0 mask, every dim."""
    q = np.broadcast_to(rng.standard_normal((1, 1, 9, 8)).astype(dtype), (4, 3, 9, 8))
    k = np.broadcast_to(rng.standard_normal((3, 1, 8)).astype(dtype), (4, 3, 140, 8))  # one key row
    v = np.broadcast_to(rng.standard_normal((4, 1, 140, 1)).astype(dtype), (4, 3, 140, 6))
    mask = np.broadcast_to(random_bool_mask(rng, (1, 140)), (4, 3, 9, 140))
    out = sdpa(q, k, v, attn_mask=mask, backend=backend)
    ref = torch_sdpa(*(np.ascontiguousarray(a, np.float64) for a in (q, k, v)), attn_mask=mask)
    assert_sdpa_close(out, ref, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("float_mask", [False, True])
def test_no_copy_larger_than_input_cython(dtype, float_mask, rng):
    """Broadcast inputs of huge virtual size: the cython backend allocates only the output.

    Every NumPy allocation is visible to tracemalloc. The inputs' real data
    is small; their broadcast shapes are 1000x larger. A float16 input is
    converted to float32 (2x its real bytes), never expanded.
    """
    base = rng.standard_normal((1, 64, 16)).astype(dtype)
    q = np.broadcast_to(base, (1000, 64, 16))
    mask = None
    if float_mask:  # a float64 mask with float32 inputs must be converted, not expanded
        mask = np.broadcast_to(rng.standard_normal((1, 64, 64)), (1000, 64, 64))
    out_bytes = 1000 * 64 * 16 * np.dtype(dtype).itemsize
    compute_out_bytes = 1000 * 64 * 16 * max(np.dtype(dtype).itemsize, 4)
    sdpa(q, q, q, attn_mask=mask, backend="cython")  # warm up (imports, caches)
    tracemalloc.start()
    try:
        out = sdpa(q, q, q, attn_mask=mask, backend="cython")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (1000, 64, 16)
    # output (+ its float16 cast) + offsets + converted real input data + slack
    allowed = out_bytes + compute_out_bytes + 4 * base.nbytes + 64 * 64 * 8 + 200_000
    assert peak <= allowed, (peak, allowed)


@pytest.mark.parametrize("layout", ["fortran", "negative", "strided", "row_strided", "memmap"])
def test_no_input_copy_for_strided_layouts(layout, rng, tmp_path):
    """float32 inputs in any layout: the cython backend makes no copy larger than an input.

    (Today it reads them in place; a kernel that packs one operand would still pass,
    copying all three would not.)"""
    q0, k0, v0 = make_qkv(rng, (8,), 256, 256, 64, dtype=np.float32)
    [(_, (q, k, v))] = layouts((q0, k0, v0), [layout], tmp_path)
    tracemalloc.start()
    try:
        out = sdpa(q, k, v, backend="cython")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The bound: no copy larger than an input (today there is none at all).
    assert peak <= out.nbytes + q.nbytes + 100_000, (peak, out.nbytes, q.nbytes)
    ref = torch_sdpa(*f64(q0, k0, v0))
    assert_sdpa_close(out, ref, q0, k0, v0)


@pytest.mark.parametrize("backend", ["numpy", "cython"])
def test_masked_softmax_layouts(backend, rng, tmp_path):
    x = rng.standard_normal((5, 7, 300))
    mask = random_bool_mask(rng, (7, 300))
    ref = torch.softmax(torch.from_numpy(np.where(mask, x, -np.inf)), -1).numpy()
    bound = 2 * softmax_error(x, mask)
    for name, (xv,) in layouts((x,), ("fortran", "negative", "strided", "big_endian", "memmap"), tmp_path):
        out = attn.masked_softmax(xv, np.broadcast_to(mask, x.shape), backend=backend)
        assert_within(out, ref, bound, name)
    for axis in (0, 1):  # softmax over a strided axis
        out = attn.masked_softmax(x, axis=axis, backend=backend)
        t = torch.softmax(torch.from_numpy(x), dim=axis).numpy()
        assert_within(out, t, 2 * softmax_error(x, axis=axis), f"axis {axis}")


# ---------------------------------------------------------------------------
# L * S > 2**31 (64-bit index arithmetic)

@pytest.mark.slow
def test_cython_more_than_2_31_scores():
    """L = S = 47000 (L*S = 2.2e9 > 2**31), E = 1, float32, no weights.

    The kernel must never form an L*S (or row*S) index in 32 bits. Rows are
    checked against float64 NumPy, including the last block of rows.
    """
    n = 47000
    assert n * n > 2**31
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((n, 1)).astype(np.float32) for _ in range(3))
    t0 = time.perf_counter()
    out = sdpa(q, k, v, backend="cython")
    elapsed = time.perf_counter() - t0
    assert out.shape == (n, 1) and np.isfinite(out).all()
    rows = np.r_[0:5, rng.integers(0, n, 60), n - 70:n]
    s = q[rows].astype(np.float64) @ k.astype(np.float64).T  # [rows, n], scale = 1/sqrt(1)
    w = np.exp(s - s.max(-1, keepdims=True))
    ref = (w @ v.astype(np.float64)) / w.sum(-1, keepdims=True)
    assert_sdpa_close(out[rows], ref, q[rows], k, v)
    print(f"L = S = {n}: {elapsed:.1f} s")


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_softmax_empty(shape):
    out = attn.softmax(np.ones(shape, np.float32))
    assert out.shape == shape and out.dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["big_endian", "misaligned"])
def test_byte_order_and_alignment(backend, dtype, kind, rng):
    """Non-native byte order is converted (it was read as native floats: garbage);
    misaligned data is copied before the kernel (a misaligned load is undefined
    behaviour in C; the UBSan run of CI fails on it)."""
    q, k, v = make_qkv(rng, (2,), 70, 150, 8, 4, dtype=dtype)
    mask = rng.standard_normal((70, 150)).astype(dtype)
    ref = torch_sdpa(*(a.astype(np.float64) for a in (q, k, v)), attn_mask=mask.astype(np.float64))
    qc, kc, vc, mc = (relayout(a, kind) for a in (q, k, v, mask))  # kind is a layout name
    assert (not qc.dtype.isnative) if kind == "big_endian" else (not qc.flags.aligned)
    out = sdpa(qc, kc, vc, attn_mask=mc, backend=backend)
    assert out.dtype == dtype and out.dtype.isnative
    assert_sdpa_close(out, ref, q, k, v, attn_mask=mask)
    if backend in ("numpy", "cython"):  # the masked_softmax backends
        sm = attn.masked_softmax(qc, backend=backend)
        ref_sm = torch.softmax(torch.from_numpy(q.astype(np.float64)), -1).numpy()
        assert sm.dtype.isnative
        assert_within(sm, ref_sm, softmax_error(q) + softmax_error(q, dtype=np.float64))


def test_misaligned_is_copied_for_the_kernel(rng):
    from attn import _operands

    a = misaligned(rng.standard_normal((3, 5)))
    b = _operands.expressible(a)
    assert b.flags.aligned and np.array_equal(a, b)
    bb = _operands.expressible(np.broadcast_to(a[:1], (1000, 5)))  # copied at size 1, not expanded
    assert bb.flags.aligned and bb.strides[0] == 0 and np.array_equal(bb[7], a[0])


@pytest.mark.parametrize("case", range(10))
def test_matrix_offsets_point_at_each_matrix(rng, case):
    """Offsets checked against NumPy's own address of every (broadcast) matrix."""
    from attn import _operands

    name, a, batch, group = list(offset_layouts(rng))[case]
    offsets = _operands.matrix_offsets(a, batch, group=group)
    assert offsets.dtype == np.int64 and offsets.shape == (math.prod(batch),)
    lead = a.shape[:-2]
    base_addr = a.__array_interface__["data"][0]
    for b, index in enumerate(np.ndindex(*batch)):
        index = index[len(index) - len(lead):]  # lead is right-aligned with batch
        if group > 1:
            index = index[:-1] + (index[-1] // group,)
        index = tuple(0 if n == 1 else i for i, n in zip(index, lead))
        addr = a[index].__array_interface__["data"][0]
        assert offsets[b] * a.itemsize == addr - base_addr, (name, b)
