"""The fused backward kernel (attn._kernels_backward): every SIMD path, thread-count invariance.

Shapes here cross the kernel's 64 x 64 tiles (tails in every direction).
"""

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_within, sdpa_grad_error, unit_roundoff
from conftest import gradient_tolerance, make_qkv, random_bool_mask
from test_backward import assert_close64, torch_grads
from test_variants import alibi_matrix, offset_of, reference, window_mask

pytest.importorskip("attn._kernels_backward")


def _case(kind, rng, lead, L, S):
    if kind == "bool":
        return random_bool_mask(rng, lead + (L, S)), False
    if kind == "bool_keys":
        return random_bool_mask(rng, (S,)), False  # one row shared by all (stride 0)
    if kind == "float":
        return rng.standard_normal(lead + (L, S)), False
    if kind == "lower_right":
        return None, "lower_right"
    return None, kind == "causal"


@pytest.mark.parametrize("kind", ["none", "bool", "bool_keys", "float", "causal", "lower_right"])
@pytest.mark.parametrize("L,S,E,Ev", [(130, 70, 64, 64), (65, 200, 33, 17), (1, 129, 8, 8), (200, 1, 5, 3)])
def test_every_path_float64_matches_torch(simd, kind, L, S, E, Ev, rng):
    q, k, v = make_qkv(rng, (2,), L, S, E, Ev)
    g = rng.standard_normal((2, L, Ev))
    mask, causal = _case(kind, rng, (2,), L, S)
    out, backward = attn.scaled_dot_product_attention_vjp(
        q, k, v, attn_mask=mask, is_causal=causal, backend="cython")
    got = (out,) + backward(g, mask_grad=kind == "float")
    ref = torch_grads(q, k, v, g, mask, causal)
    floor = np.max(np.abs(g)) * np.max(np.abs(v)) * max(np.max(np.abs(q)), np.max(np.abs(k)))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), got, ref):
        assert_close64(a, b, f"{simd} {name}", floor)


@pytest.mark.parametrize("causal", [False, True])
def test_every_path_float32_within_3x_torch(simd, causal, rng):
    q, k, v = make_qkv(rng, (2, 2), 150, 170, 64)
    g = rng.standard_normal((2, 2, 150, 64))
    ref64 = torch_grads(q, k, v, g, None, causal)
    f32 = [a.astype(np.float32) for a in (q, k, v, g)]
    ref32 = torch_grads(*f32, is_causal=causal, dtype=torch.float32)
    out, backward = attn.scaled_dot_product_attention_vjp(*f32[:3], is_causal=causal, backend="cython")
    got = (out,) + backward(f32[3])
    for a, t, r in zip(got, ref32, ref64):
        err, err_torch = np.max(np.abs(a - r)), np.max(np.abs(t - r))
        assert err <= gradient_tolerance(r, err_torch), simd


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead,kv_lead,gqa", [((1,), (1,), False), ((3,), (3,), False),
                                               ((2, 4), (2, 2), True)])
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_identical_for_any_thread_count(simd, dtype, lead, kv_lead, gqa, causal, rng):
    """1 thread takes whole matrices; more threads than matrices run the two passes: same bits."""
    q = rng.standard_normal(lead + (190, 40)).astype(dtype)
    k = rng.standard_normal(kv_lead + (230, 40)).astype(dtype)
    v = rng.standard_normal(kv_lead + (230, 24)).astype(dtype)
    g = rng.standard_normal(lead + (190, 24)).astype(dtype)
    mask = rng.standard_normal((190, 230)).astype(dtype) if not causal else None
    results = []
    for threads in (1, 2, 3, 7):
        out, backward = attn.scaled_dot_product_attention_vjp(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, backend="cython",
            num_threads=threads)
        results.append(backward(g, mask_grad=mask is not None))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert np.array_equal(a, b)


def test_backward_runs_the_forward_path(rng):
    """attn._kernels_testing.select_simd switches the backward too: FMA paths and generic differ in bits."""
    from attn import _kernels, _kernels_testing

    paths = _kernels.simd_paths()
    if len(paths) < 2 or paths[-1] != "generic":
        pytest.skip(f"needs a vector path and generic: {paths}")
    q, k, v = make_qkv(rng, (2,), 130, 150, 40)
    g = rng.standard_normal((2, 130, 40))
    grads = {}
    for path in (paths[0], "generic"):
        previous = _kernels_testing.select_simd(path)
        try:
            grads[path] = attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython")[1](g)
        finally:
            _kernels_testing.select_simd(previous)
    assert not all(np.array_equal(a, b) for a, b in zip(grads[paths[0]], grads["generic"]))


def test_large_enough_for_threads_to_split(rng):
    """A call big enough that the grain allows several threads (the others may stay at 1)."""
    q, k, v = make_qkv(rng, (1,), 600, 600, 64, dtype=np.float32)
    g = rng.standard_normal((1, 600, 64)).astype(np.float32)
    res = [attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True, backend="cython",
                                                 num_threads=t)[1](g) for t in (1, 2, 4)]
    for other in res[1:]:
        for a, b in zip(res[0], other):
            assert np.array_equal(a, b)


def test_lse_every_path(simd, rng):
    q, k, v = make_qkv(rng, (2,), 130, 150, 24)
    mask = random_bool_mask(rng, (2, 130, 150))
    mask[1, 7] = False
    ref = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="numpy", return_lse=True)[1]
    lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="cython", return_lse=True)[1]
    assert np.isneginf(lse[1, 7]) and np.array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.max(np.abs(lse[fin] - ref[fin])) <= 1e-13 * np.max(np.abs(ref[fin]))


def test_nan_free_when_rows_see_nothing(simd, rng):
    q, k, v = make_qkv(rng, (2,), 100, 90, 16, dtype=np.float32)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal="lower_right", backend="cython")
    dq, dk, dv = backward(np.ones_like(out))
    assert np.all(np.isfinite(dq)) and np.all(dq[:, :10] == 0)


# ------------------------------------------------------------ large scores
# q times 12.5 makes |s| ~ 40 (as under a softcap of 30-50). L = 239 rows: every block of the
# forward (32, 64 or 128 rows) has more than ATTN_DOT_MAX_Q = 4 rows, so each score is the
# forward's register tiles' (attn_backward_impl.h: a block that short sums in vector lanes).
L_BIG, E_BIG, Q_GAIN = 239, 96, 12.5


def _one_key_per_row(kind, rng, dtype):
    """Each row of an [L_BIG, S] problem sees exactly one key: S, attn's keyword arguments and
    those of the bound (the mask as it sees it: a window as bool, ALiBi as a float bias)."""
    heads = (1, 2)
    if kind in ("one_key", "softcap30", "softcap50"):
        kw = {"softcap": float(kind[7:])} if kind.startswith("softcap") else {}
        return 1, kw, dict(kw)
    if kind == "bias":  # any finite bias on the one key
        mask = (3 * rng.standard_normal((L_BIG, 1))).astype(dtype)
        return 1, {"attn_mask": mask}, {"attn_mask": mask}
    if kind == "alibi":
        slopes = rng.uniform(0.1, 0.5, 2)
        bias = alibi_matrix(slopes, L_BIG, 1, offset_of(False, L_BIG, 1), heads)
        u = unit_roundoff(dtype)  # a slope in the working dtype times an exact distance (variants_bound)
        return 1, {"alibi_slopes": slopes}, {"attn_mask": bias, "dmask": 4 * u * np.abs(bias)}
    if kind == "window":  # row i sees key i
        return L_BIG, {"window": (0, 0)}, {"attn_mask": window_mask(L_BIG, L_BIG, (0, 0), 0)}
    S = 300  # one key per row, anywhere in 5 key blocks
    keys = rng.integers(0, S, L_BIG)
    if kind == "bool":
        mask = np.zeros((L_BIG, S), bool)
        mask[np.arange(L_BIG), keys] = True
    else:
        mask = np.full((L_BIG, S), -np.inf, dtype)
        mask[np.arange(L_BIG), keys] = 3 * rng.standard_normal(L_BIG)
    return S, {"attn_mask": mask}, {"attn_mask": mask}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["one_key", "softcap30", "softcap50", "bias", "alibi", "window", "bool",
                                  "float"])
def test_one_visible_key_has_weight_exactly_one(simd, kind, dtype, rng):
    """FlashAttention's P = exp(s - LSE) with LSE = log sum_j exp(s_j): a row that sees one key has
    LSE = s and P = 1 exactly, however large s (here |s| ~ 40), if the backward recomputes the
    score the forward took its lse from. Then dV_j = the sum of dO over the rows seeing key j,
    exact for integer dO, as is torch float64 autograd's; dQ, dK (0 in exact arithmetic: one key,
    no score can move the output) within the rounding bound of torch's."""
    S, kw, bound_kw = _one_key_per_row(kind, rng, dtype)
    q = (Q_GAIN * rng.standard_normal((1, 2, L_BIG, E_BIG))).astype(dtype)
    k = rng.standard_normal((1, 2, S, E_BIG)).astype(dtype)
    v = rng.standard_normal((1, 2, S, 80)).astype(dtype)
    dout = rng.integers(-3, 4, (1, 2, L_BIG, 80)).astype(dtype)
    ref = reference(q, k, v, grad_out=dout, **kw)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython", **kw)
    dq, dk, dv = backward(dout)
    np.testing.assert_array_equal(dv, ref["dv"], err_msg=f"{simd} dv: P != 1")
    err = sdpa_grad_error(q, k, v, dout, dtype=dtype, **bound_kw)
    err64 = sdpa_grad_error(q, k, v, dout, dtype=np.float64, **bound_kw)
    assert_within(dq, ref["dq"], err[0] + err64[0], f"{simd} dq")
    assert_within(dk, ref["dk"], err[1] + err64[1], f"{simd} dk")


@pytest.mark.parametrize("kind", ["plain", "causal", "softcap30", "softcap50", "float"])
def test_large_scores_within_rounding_bound(simd, kind, rng):
    """float32 gradients at |s| up to ~40 (capped to 30 or 50) against torch float64 autograd,
    within the sum of both rounding bounds of FlashAttention-2's backward (sdpa_grad_error)."""
    S = 150
    q = (Q_GAIN * rng.standard_normal((1, 2, L_BIG, E_BIG))).astype(np.float32)
    k = rng.standard_normal((1, 2, S, E_BIG)).astype(np.float32)
    v = rng.standard_normal((1, 2, S, 64)).astype(np.float32)
    dout = rng.standard_normal((1, 2, L_BIG, 64)).astype(np.float32)
    kw = {"is_causal": True} if kind == "causal" else {}
    if kind.startswith("softcap"):
        kw["softcap"] = float(kind[7:])
    if kind == "float":
        kw["attn_mask"] = (3 * rng.standard_normal((L_BIG, S))).astype(np.float32)
    ref = reference(q, k, v, grad_out=dout, **kw)
    dq, dk, dv = attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython", **kw)[1](dout)
    err = sdpa_grad_error(q, k, v, dout, dtype=np.float32, **kw)
    err64 = sdpa_grad_error(q, k, v, dout, dtype=np.float64, **kw)
    for name, got, i in (("dq", dq, 0), ("dk", dk, 1), ("dv", dv, 2)):
        assert_within(got, ref[name], err[i] + err64[i], f"{simd} {kind} {name}")


def test_backends_reports_the_backward_extension():
    info = attn.backends()
    assert info["cython_backward"], info["cython_backward_error"]  # CI builds it


def test_without_the_backward_extension(monkeypatch, rng):
    """auto falls back to numpy; an explicit cython is a clear RuntimeError before any kernel."""
    from attn import _build

    monkeypatch.setattr(_build, "HAVE_BACKWARD", False)
    monkeypatch.setattr(_build, "BACKWARD_IMPORT_ERROR", "ImportError: not built")
    q, k, v = make_qkv(rng, (2,), 5, 6, 4)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v)
    assert len(backward(np.ones_like(out))) == 3
    with pytest.raises(RuntimeError, match=r"attn._kernels_backward.*not importable.*not built"):
        attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython")
    with pytest.raises(RuntimeError, match="attn._kernels_backward"):
        attn.scaled_dot_product_attention(q, k, v, backend="cython", return_lse=True)
