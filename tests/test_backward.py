"""Gradients of every backward form against torch.autograd through F.scaled_dot_product_attention.

float64: within 1e-12 of torch relative to the gradient's scale (max |torch's
gradient|). float32: within 3x torch's own float32 error, both measured
against float64 torch. Plus a float64 finite-difference check that needs no
torch at all, and the errors of ``backward``'s own arguments.
"""

import numpy as np
import pytest
import torch

import attn
from attn import _backends
from conftest import BACKENDS, gradient_tolerance, make_qkv, mask_of_kind, random_bool_mask

REL64 = 1e-12


def torch_grads(q, k, v, g, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                dtype=torch.float64):
    """(out, dq, dk, dv[, dmask]) from torch.autograd; ``is_causal='lower_right'`` as an explicit mask."""
    t = lambda a: torch.tensor(np.array(a), dtype=dtype)  # (a copy: torch refuses negative strides)
    tq, tk, tv = (t(a).requires_grad_() for a in (q, k, v))
    tm = None
    if is_causal == "lower_right":
        L, S = q.shape[-2], k.shape[-2]
        attn_mask, is_causal = np.tril(np.ones((L, S), bool), S - L), False
    if attn_mask is not None:
        tm = torch.tensor(attn_mask) if attn_mask.dtype == bool else t(attn_mask).requires_grad_()
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tm, is_causal=bool(is_causal), scale=scale, enable_gqa=enable_gqa)
    out.backward(t(g))
    res = [out.detach(), tq.grad, tk.grad, tv.grad]
    if tm is not None and tm.requires_grad:
        res.append(tm.grad)
    return [np.nan_to_num(r.numpy().astype(np.float64)) for r in res]  # see test_fully_masked_rows


def assert_close64(got, ref, what="", floor=1e-300):
    """|got - ref| <= 1e-12 max|ref|; ``floor``: the scale when the exact gradient is ~0.

    (dQ of a one-key row is exactly 0, computed as P (dP - D) with dP = D up
    to rounding, whose size is |dO| |V| times |K|: the floor.)
    """
    scale = max(float(np.max(np.abs(ref), initial=0.0)), floor)
    err = float(np.max(np.abs(got - ref), initial=0.0))
    assert got.shape == ref.shape, what
    assert err <= REL64 * scale, f"{what}: max error {err:.3g} > 1e-12 x scale {scale:.3g}"


def check_all(backend, q, k, v, g, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    out, backward = attn.scaled_dot_product_attention_vjp(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        backend=backend)
    mask_grad = attn_mask is not None and attn_mask.dtype != bool
    got = (out,) + backward(g, mask_grad=mask_grad)
    ref = torch_grads(q, k, v, g, attn_mask, is_causal, scale, enable_gqa)
    assert len(got) == len(ref)
    mx = lambda a: float(np.max(np.abs(a), initial=0.0))
    floor = mx(g) * mx(v) * max(mx(q), mx(k), 1.0)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), got, ref):
        assert a.dtype == np.float64
        assert_close64(a, b, name, floor)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "lower_right"])
@pytest.mark.parametrize("L,S", [(1, 1), (7, 97), (97, 7), (33, 33), (130, 70)])
@pytest.mark.parametrize("lead", [(), (2, 3)], ids=str)
def test_matches_torch(backend, mask_kind, L, S, lead, rng):
    if backend == "loop" and lead and L * S > 5000:
        pytest.skip("the loop form is slow; covered at lead=()")
    q, k, v = make_qkv(rng, lead, L, S, 16, Ev=8)
    g = rng.standard_normal(lead + (L, 8))
    causal = {"causal": True, "lower_right": "lower_right"}.get(mask_kind, False)
    check_all(backend, q, k, v, g, mask_of_kind(mask_kind, rng, lead, L, S), causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E,Ev", [(1, 1), (64, 3), (3, 130), (128, 128), (65, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(backend, E, Ev, causal, rng):
    q, k, v = make_qkv(rng, (2,), 70, 81, E, Ev)
    check_all(backend, q, k, v, rng.standard_normal((2, 70, Ev)), is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_sums_over_groups(backend, h_q, h_kv, causal, rng):
    q = rng.standard_normal((2, h_q, 9, 16))
    k = rng.standard_normal((2, h_kv, 75, 16))
    v = rng.standard_normal((2, h_kv, 75, 5))
    _, dq, dk, dv = check_all(backend, q, k, v, rng.standard_normal((2, h_q, 9, 5)),
                              is_causal=causal, enable_gqa=True)
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_leading_dims_and_mask(backend, rng):
    """Gradients of broadcast inputs are summed over the broadcast dims; the float mask's too."""
    q = rng.standard_normal((2, 1, 7, 8))
    k = rng.standard_normal((1, 3, 11, 8))
    v = rng.standard_normal((3, 11, 4))
    mask = rng.standard_normal((3, 1, 11))  # one bias per key, per head; broadcast over batch and rows
    g = rng.standard_normal((2, 3, 7, 4))
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, attn_mask=mask, backend=backend)
    got = (out,) + backward(g, mask_grad=True)
    ref = torch_grads(q, k, v, g, attn_mask=mask)
    for name, a, b, shape in zip(("out", "dq", "dk", "dv", "dmask"), got, ref,
                                 ((2, 3, 7, 4), q.shape, k.shape, v.shape, mask.shape)):
        assert a.shape == shape, name
        assert_close64(a, b, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_broadcast(backend, rng):
    q, k, v = make_qkv(rng, (2, 3), 40, 70, 8)
    mask = random_bool_mask(rng, (3, 1, 70))  # key padding, per head
    check_all(backend, q, k, v, rng.standard_normal((2, 3, 40, 8)), attn_mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_have_zero_gradients(backend, kind, rng):
    """A row that sees no key has output 0 and contributes nothing: dq row 0, dk and dv unaffected."""
    q, k, v = make_qkv(rng, (2,), 70, 66, 4)
    mask = random_bool_mask(rng, (2, 70, 66))
    mask[:, 2] = False
    mask[1, 65] = False
    m = mask if kind == "bool" else np.where(mask, rng.standard_normal(mask.shape), -np.inf)
    g = rng.standard_normal((2, 70, 4))
    got = check_all(backend, q, k, v, g, attn_mask=m)
    assert np.all(got[1][:, 2] == 0) and np.all(got[1][1, 65] == 0)
    if kind == "float":
        assert np.all(got[4][:, 2] == 0)
    # the masked rows' grad_out does not matter
    g2 = g.copy()
    g2[:, 2] = 1e3
    got2 = attn.scaled_dot_product_attention_vjp(q, k, v, attn_mask=m, backend=backend)[1](g2)
    for a, b in zip(got[1:4], got2):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lower_right_rows_without_keys(backend, rng):
    """L > S lower-right: the first L - S rows see nothing (torch's explicit mask gives NaN there; attn 0)."""
    q, k, v = make_qkv(rng, (2,), 9, 4, 8)
    got = check_all(backend, q, k, v, rng.standard_normal((2, 9, 8)), is_causal="lower_right")
    assert np.all(got[1][:, :5] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_custom_scale(backend, scale, rng):
    q, k, v = make_qkv(rng, (3,), 7, 97, 4)
    check_all(backend, q, k, v, rng.standard_normal((3, 7, 4)), scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_read_only_inputs(backend, rng):
    big = rng.standard_normal((3, 2, 80, 40))
    q = big[:, :, ::2, 1:17]  # row stride 2, offset columns
    k = np.swapaxes(rng.standard_normal((3, 2, 16, 60)), -1, -2)  # column-major
    v = big[::-1, :, 10:70, ::-3]  # negative strides
    g = np.swapaxes(rng.standard_normal((3, 2, v.shape[-1], 40)), -1, -2)  # strided grad_out
    for a in (q, k, v, g, big):
        a.setflags(write=False)
    check_all(backend, q, k, v, g, is_causal=True)


@pytest.mark.parametrize("backend", ["loop", "numpy"])
def test_dropout_reuses_the_keep_mask(backend, rng):
    """The backward of W = P o Z / (1 - p) for the Z the forward drew: torch.autograd of the explicit formula."""
    q, k, v = make_qkv(rng, (2,), 7, 9, 4)
    g = rng.standard_normal((2, 7, 4))
    out, backward = attn.scaled_dot_product_attention_vjp(
        q, k, v, dropout_p=0.25, backend=backend, rng=np.random.default_rng(1))
    # the forward is the same draw as scaled_dot_product_attention's
    same = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.25, backend="numpy",
                                             rng=np.random.default_rng(1))
    assert_close64(out, same, "out")
    keep = torch.from_numpy(np.random.default_rng(1).random((2, 7, 9)) >= 0.25)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    w = torch.softmax(tq @ tk.transpose(-1, -2) / 2.0, dim=-1) * keep / 0.75
    (w @ tv).backward(torch.from_numpy(g))
    got = backward(g)
    for a, t in zip(got, (tq, tk, tv)):
        assert_close64(a, t.grad.numpy())
    # called again: the same keep mask, the same gradients
    for a, b in zip(got, backward(g)):
        assert np.array_equal(a, b)


def test_auto_with_dropout_uses_numpy(rng):
    q, k, v = make_qkv(rng, (2,), 7, 9, 4)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, dropout_p=0.5,
                                                          rng=np.random.default_rng(3))
    dq, dk, dv = backward(np.ones_like(out))
    assert np.all(np.isfinite(dq))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal", "float"])
def test_float32_within_3x_torch_error(backend, mask_kind, rng):
    lead, L, S = (2, 2), 97, 130
    q, k, v = make_qkv(rng, lead, L, S, 64)
    g = rng.standard_normal(lead + (L, 64))
    mask = mask_of_kind(mask_kind, rng, lead, L, S)
    causal = mask_kind == "causal"
    ref64 = torch_grads(q, k, v, g, mask, causal)
    f32 = lambda a: None if a is None else (a if a.dtype == bool else a.astype(np.float32))
    ref32 = torch_grads(*map(f32, (q, k, v, g, mask)), is_causal=causal, dtype=torch.float32)
    out, backward = attn.scaled_dot_product_attention_vjp(
        *map(f32, (q, k, v, mask)), is_causal=causal, backend=backend)
    got = (out,) + backward(f32(g), mask_grad=mask_kind == "float")
    for name, a, t, r in zip(("out", "dq", "dk", "dv", "dmask"), got, ref32, ref64):
        assert a.dtype == np.float32, name
        err_torch = float(np.max(np.abs(t - r)))
        err = float(np.max(np.abs(a - r)))
        assert err <= gradient_tolerance(r, err_torch), f"{name}: {err:.3g} vs torch's {err_torch:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_grads_in_input_dtype(backend, rng):
    q, k, v = (a.astype(np.float16) for a in make_qkv(rng, (2,), 5, 6, 8))
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend=backend)
    g = np.ones_like(out)
    grads = backward(g)
    assert out.dtype == np.float16 and all(d.dtype == np.float16 for d in grads)
    ref = torch_grads(*(a.astype(np.float64) for a in (q, k, v, g)))
    for a, b in zip(grads, ref[1:]):
        np.testing.assert_allclose(a.astype(np.float64), b, atol=4e-3 * max(1, np.max(np.abs(b))))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "float", "causal"])
def test_finite_differences(backend, mask_kind, rng):
    """<grad, d> equals the central difference (f(x + h d) - f(x - h d)) / 2h of f = sum(g o out).

    Independent of torch. The truncation error is O(h^2 f''') ~ 1e-10 here.
    """
    q, k, v = make_qkv(rng, (2,), 5, 6, 3, Ev=4)
    mask = rng.standard_normal((5, 6)) if mask_kind == "float" else None
    causal = mask_kind == "causal"
    g = rng.standard_normal((2, 5, 4))
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    out, backward = attn.scaled_dot_product_attention_vjp(
        q, k, v, attn_mask=mask, is_causal=causal, backend=backend)
    grads = backward(g, mask_grad=mask is not None)

    def f(args):
        m = args[3] if len(args) > 3 else None
        return float(np.sum(g * attn.scaled_dot_product_attention(
            *args[:3], attn_mask=m, is_causal=causal, backend="numpy")))

    h = 1e-5
    for i, grad in enumerate(grads):
        d = rng.standard_normal(inputs[i].shape)
        plus = [a + h * d if j == i else a for j, a in enumerate(inputs)]
        minus = [a - h * d if j == i else a for j, a in enumerate(inputs)]
        fd = (f(plus) - f(minus)) / (2 * h)
        assert abs(fd - np.sum(grad * d)) <= 1e-8 * max(1.0, abs(fd))


# ----------------------------------------------------------------- lse
def torch_lse(q, k, attn_mask=None, is_causal=False, scale=None):
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = tq @ tk.transpose(-1, -2) * scale
    if is_causal:
        attn_mask = np.tril(np.ones(s.shape[-2:], bool))
    if attn_mask is not None:
        m = torch.from_numpy(attn_mask)
        s = s.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else s + m
    return torch.logsumexp(s, dim=-1).numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
def test_return_lse(backend, mask_kind, rng):
    q, k, v = make_qkv(rng, (2, 3), 70, 97, 16)
    mask = mask_of_kind(mask_kind, rng, (2, 3), 70, 97)
    if mask is not None and mask.dtype == bool:
        mask[0, 1, 5] = False  # a row that sees nothing: lse = -inf
    causal = mask_kind == "causal"
    out, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 backend=backend, return_lse=True)
    ref = torch_lse(q, k, mask, causal)
    assert lse.shape == (2, 3, 70) and lse.dtype == np.float64
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.max(np.abs(lse[fin] - ref[fin])) <= 1e-13 * max(1, np.max(np.abs(ref[fin])))
    out2, w, lse2 = attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, backend=backend, return_weights=True,
        return_lse=True)
    assert w.shape == (2, 3, 70, 97)  # (with weights, lse may come from another pass: rounding)
    assert np.array_equal(np.isneginf(lse2), np.isneginf(lse))
    assert np.max(np.abs(lse2[fin] - lse[fin])) <= 1e-13 * max(1, np.max(np.abs(ref[fin])))


def test_return_lse_float16_is_float32(rng):
    q, k, v = (a.astype(np.float16) for a in make_qkv(rng, (2,), 5, 6, 8))
    out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (2, 5)


# -------------------------------------------------------------- errors
class KernelCalled(AssertionError):
    pass


@pytest.fixture
def no_backward_kernel(monkeypatch):
    def boom(*args, **kwargs):
        raise KernelCalled("a backward kernel ran before the bad argument was rejected")

    for impl in _backends.ATTENTION.values():
        monkeypatch.setattr(impl, "backward", boom)


def _vjp_of(mask=None, causal=False, dtype=np.float32):
    q, k, v = make_qkv(np.random.default_rng(0), (2,), 5, 6, 4, Ev=3, dtype=dtype)
    return attn.scaled_dot_product_attention_vjp(q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("g,exc,pattern", [
    (np.zeros((2, 5, 4), np.float32), ValueError, r"grad_out.*\(2, 5, 3\).*\(2, 5, 4\)"),
    (np.zeros((5, 3), np.float32), ValueError, r"grad_out.*\(2, 5, 3\).*\(5, 3\)"),
    (np.zeros((2, 5, 3), np.float64), TypeError, r"grad_out.*float32.*float64"),
    (np.zeros((2, 5, 3), np.int32), TypeError, r"grad_out.*int32"),
    (None, TypeError, r"grad_out"),
])
def test_bad_grad_out(no_backward_kernel, g, exc, pattern):
    out, backward = _vjp_of()
    with pytest.raises(exc, match=pattern):
        backward(g)


@pytest.mark.parametrize("mask,causal,pattern", [
    (None, False, "no attn_mask"),
    (np.ones((5, 6), bool), False, "dtype bool"),
    (None, True, "no attn_mask"),
])
def test_mask_grad_needs_float_mask(no_backward_kernel, mask, causal, pattern):
    out, backward = _vjp_of(mask, causal)
    with pytest.raises(ValueError, match=f"mask_grad=True needs a float attn_mask.*{pattern}"):
        backward(np.zeros_like(out), mask_grad=True)


def test_mask_grad_must_be_bool(no_backward_kernel):
    out, backward = _vjp_of(np.zeros((5, 6), np.float32))
    with pytest.raises(TypeError, match="mask_grad must be True or False"):
        backward(np.zeros_like(out), mask_grad="yes")


def test_bad_backend_and_return_lse(rng):
    q, k, v = make_qkv(rng, (2,), 5, 6, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        attn.scaled_dot_product_attention_vjp(q, k, v, backend="fast")
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        attn.scaled_dot_product_attention(q, k, v, return_lse=1)
    for backend in ("cython", "online"):
        with pytest.raises(ValueError, match="dropout"):
            attn.scaled_dot_product_attention_vjp(q, k, v, dropout_p=0.1, backend=backend)
    with pytest.raises(ValueError, match="query and key must have the same last dim"):
        attn.scaled_dot_product_attention_vjp(q, k[..., :3], v)


def test_empty_shapes(rng):
    q, k, v = make_qkv(rng, (2,), 5, 0, 4)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v)
    dq, dk, dv = backward(np.ones_like(out))
    assert np.all(out == 0) and np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    q, k, v = make_qkv(rng, (0,), 5, 7, 4)
    out, backward = attn.scaled_dot_product_attention_vjp(q, k, v)
    assert [a.shape for a in backward(np.ones_like(out))] == [q.shape, k.shape, v.shape]
