"""The variants (sliding window, soft-capping, ALiBi, sinks) on every backend, against torch float64.

The reference is written out here with torch ops, from an explicit mask or
bias (window, ALiBi) and the formulas (softcap, sinks): its gradients come
from torch's autograd, independent of attn's derivations.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import attn
from conftest import make_qkv, random_bool_mask
from _bounds import assert_within, sdpa_error


from conftest import BACKENDS


def offset_of(is_causal, L, S):
    """The alignment offset of the window and ALiBi (attn._variants)."""
    return 0 if is_causal in (True, "upper_left") else S - L


def window_mask(L, S, window, off):
    """Bool [L, S]: key j inside row i's window (left, right), -1 unbounded."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    left, right = window
    m = np.ones((L, S), bool)
    if left >= 0:
        m &= j >= i + off - left
    if right >= 0:
        m &= j <= i + off + right
    return m


def alibi_matrix(slopes, L, S, off, heads_shape):
    """-slope * |i + off - j| as [*heads_shape, L, S] (slopes [H] or [B, H] broadcast to heads_shape)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    s = np.broadcast_to(np.asarray(slopes, np.float64), heads_shape)
    return -s[..., None, None] * np.abs(i + off - j)


def reference(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, window=None,
              softcap=None, alibi_slopes=None, sinks=None, grad_out=None, dtype=torch.float64):
    """out (and with grad_out: dq, dk, dv, dsinks) by torch ops and autograd in ``dtype`` (float64 by
    default; test_bfloat16 computes torch's own bfloat16 error with it); lse too. Returned as float64."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(E) if scale is None else scale
    off = offset_of(is_causal, L, S)
    t = lambda a, g=False: torch.tensor(np.asarray(a, np.float64)).to(dtype).requires_grad_(g)
    tq, tk, tv = t(q, True), t(k, True), t(v, True)
    kk, vv = tk, tv
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        kk, vv = tk.repeat_interleave(g, dim=-3), tv.repeat_interleave(g, dim=-3)
    s = tq @ kk.transpose(-2, -1) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    batch = s.shape[:-2]
    if alibi_slopes is not None:
        s = s + t(alibi_matrix(alibi_slopes, L, S, off, batch))
    visible = torch.ones(s.shape, dtype=torch.bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == bool:
            visible = visible & torch.from_numpy(np.broadcast_to(m, s.shape).copy())
        else:
            s = s + t(m)
    if is_causal:
        visible = visible & torch.from_numpy(window_mask(L, S, (-1, 0), off))
    if window is not None:
        visible = visible & torch.from_numpy(window_mask(L, S, window, off))
    s = s.masked_fill(~visible, -torch.inf)
    ts = None
    if sinks is not None:
        ts = t(sinks, True)
        col = ts.reshape((1,) * (len(batch) - 1) + (-1, 1, 1)).expand(batch + (L, 1))
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = p @ vv
    f64 = lambda x: x.detach().double().numpy()
    res = {"out": f64(out), "lse": f64(lse)}
    if grad_out is not None:
        out.backward(t(grad_out))
        res.update(dq=f64(tq.grad), dk=f64(tk.grad), dv=f64(tv.grad))
        if ts is not None:
            res["dsinks"] = f64(ts.grad)
    return res


def close64(got, ref, what):
    """float64 results: rounding only (errors ~1e-15 relative to the values' scale)."""
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9, err_msg=what)


CASES = [
    dict(window=(3, 2)),
    dict(window=(5, -1), is_causal=True),
    dict(window=(0, 0)),
    dict(window=(-1, 4), is_causal="lower_right"),
    dict(window=(100, 100)),  # wider than S
    dict(softcap=1.5),
    dict(softcap=2.0, is_causal=True),
    dict(alibi_slopes="h"),
    dict(alibi_slopes="bh", is_causal="lower_right"),
    dict(sinks=True),
    dict(sinks=True, is_causal=True, window=(4, 0)),
    dict(window=(6, 1), softcap=3.0, alibi_slopes="h", sinks=True, is_causal=True),
    dict(window=(2, 2), softcap=1.0, mask="bool"),
    dict(window=(3, 3), alibi_slopes="h", mask="float"),
]


def build(case, rng, B=2, Hq=4, Hkv=2, L=13, S=21, E=8, dtype=np.float64):
    """Inputs and kwargs of one CASES entry (GQA when Hkv < Hq)."""
    case = dict(case)
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    kw = {"enable_gqa": Hkv != Hq}
    for name in ("window", "softcap", "is_causal"):
        if name in case:
            kw[name] = case[name]
    if case.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, Hq)
    elif case.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, Hq))
    if case.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq)
    if case.get("mask") == "bool":
        kw["attn_mask"] = random_bool_mask(rng, (B, 1, L, S))
    elif case.get("mask") == "float":
        kw["attn_mask"] = rng.standard_normal((B, Hq, L, S)).astype(dtype)
    return q, k, v, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_forward_backward_lse_float64(backend, case, rng):
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    q, k, v, kw = build(case, rng)
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    ref = reference(q, k, v, grad_out=dout, **kw)
    out, lse = attn.scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    close64(attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw), ref["out"], "out (no lse)")
    out2, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend=backend, **kw)
    close64(out2, ref["out"], "vjp out")
    grads = backward(dout)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        close64(g, ref[name], name)
    assert len(grads) == (4 if "sinks" in kw else 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_with_variants(backend, rng):
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    q, k, v, kw = build(CASES[11], rng)
    out, w = attn.scaled_dot_product_attention(q, k, v, backend=backend, return_weights=True, **kw)
    ref = reference(q, k, v, **kw)
    close64(out, ref["out"], "out")
    close64(w @ np.repeat(v, 2, axis=1), ref["out"], "weights @ v")


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_of_masked_keys_gives_zero(backend, rng):
    """Rows whose window holds only masked keys: output 0, lse -inf, zero gradients."""
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    q, k, v = make_qkv(rng, (1, 2), 8, 8, 4)
    mask = np.ones((8, 8), bool)
    mask[5, 3:8] = False  # row 5 sees keys 3..7 through its window (2, 2); all masked
    out, lse = attn.scaled_dot_product_attention(q, k, v, mask, window=(2, 2), backend=backend, return_lse=True)
    assert np.all(out[..., 5, :] == 0) and np.all(lse[..., 5] == -np.inf)
    ref = reference(q, k, v, attn_mask=mask, window=(2, 2))
    close64(out, ref["out"], "out")
    # a zero-width window (-1 .. -1 relative): no key at all, with causal
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, window=(0, 0), backend=backend)
    close64(out, v, "window (0, 0) causal: each row sees its own key only")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_within_bounds(backend, dtype, rng):
    """float32/float16 window + ALiBi + mask against float64, bounded by tests/_bounds.py (as a float mask)."""
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    B, H, L, S, E = 1, 3, 40, 70, 16
    q, k, v = make_qkv(rng, (B, H), L, S, E, dtype=dtype)
    slopes = rng.uniform(0.05, 0.3, H)
    off = S - L
    bias = alibi_matrix(slopes, L, S, off, (B, H)) + np.where(window_mask(L, S, (9, 3), off), 0, -np.inf)
    out = attn.scaled_dot_product_attention(q, k, v, window=(9, 3), alibi_slopes=slopes, backend=backend)
    ref = reference(q, k, v, window=(9, 3), alibi_slopes=slopes)["out"]
    cdtype = np.float32
    err = sdpa_error(q, k, v, attn_mask=bias, dtype=cdtype, out_dtype=dtype,
                     dmask=np.finfo(cdtype).eps * np.abs(np.where(np.isfinite(bias), bias, 0)))
    assert_within(out, ref, err, f"{backend} {np.dtype(dtype).name}")


def test_validation_errors():
    q = np.zeros((1, 2, 4, 8))
    sdpa = attn.scaled_dot_product_attention
    with pytest.raises(TypeError, match="window"):
        sdpa(q, q, q, window=3)
    with pytest.raises(ValueError, match="window"):
        sdpa(q, q, q, window=(-2, 0))
    with pytest.raises(TypeError, match="window"):
        sdpa(q, q, q, window=(1.5, 0))
    with pytest.raises(TypeError, match="softcap"):
        sdpa(q, q, q, softcap="big")
    with pytest.raises(ValueError, match="softcap"):
        sdpa(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[H\] or \[B, H\] with H = 2"):
        sdpa(q, q, q, alibi_slopes=np.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes"):
        sdpa(q, q, q, alibi_slopes=np.ones(2, bool))
    with pytest.raises(ValueError, match=r"sinks must have shape \[H\]"):
        sdpa(q, q, q, sinks=np.ones((1, 2)))
    with pytest.raises(ValueError, match="sinks must be finite"):
        sdpa(q, q, q, sinks=np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="heads dim"):
        sdpa(q[0, 0], q[0, 0], q[0, 0], sinks=np.ones(1))
    # softcap 0 is off (FlashAttention's default)
    np.testing.assert_array_equal(sdpa(q, q, q, softcap=0.0), sdpa(q, q, q))


@given(L=st.integers(1, 40), S=st.integers(1, 90), left=st.integers(-1, 100), right=st.integers(-1, 100),
       causal=st.sampled_from([False, True, "lower_right"]), seed=st.integers(0, 2**16),
       backend=st.sampled_from(BACKENDS))
def test_window_property(L, S, left, right, causal, seed, backend):
    """Random shapes and windows (wider than S, zero-width, empty rows) match the explicit mask."""
    if backend == "cython" and not attn.backends()["cython"]:
        backend = "numpy"
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, (2,), L, S, 8)
    out, lse = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, window=(left, right),
                                                 backend=backend, return_lse=True)
    ref = reference(q, k, v, is_causal=causal, window=(left, right))
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")


KERNEL_SHAPES = [  # (B, Hq, Hkv, L, S): decode (one row, split keys), rows layout, key-major blocks
    (1, 4, 2, 1, 1500), (2, 2, 1, 3, 700), (1, 2, 2, 16, 900), (1, 1, 1, 300, 520), (1, 2, 1, 130, 130),
]


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=str)
@pytest.mark.parametrize("case", [
    dict(window=(100, 0), is_causal="lower_right"), dict(window=(37, 5)), dict(window=(64, 64), is_causal=True),
    dict(softcap=1.0, alibi_slopes="h", sinks=True), dict(window=(200, 3), softcap=2.0, alibi_slopes="bh"),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_kernel_paths(simd, shape, case, rng):
    """Every SIMD path, both score layouts, decode's split keys, block skipping; 1 or 2 threads bitwise."""
    B, Hq, Hkv, L, S = shape
    q, k, v, kw = build(case, rng, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=24)
    dout = rng.standard_normal(q.shape)
    ref = reference(q, k, v, grad_out=dout, **kw)
    out, lse = attn.scaled_dot_product_attention(q, k, v, backend="cython", return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    _, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend="cython", **kw)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), backward(dout)):
        close64(g, ref[name], name)
    out32 = [attn.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                               backend="cython", num_threads=t, **kw) for t in (1, 2)]
    np.testing.assert_array_equal(out32[0], out32[1])
    g32 = [attn.scaled_dot_product_attention_vjp(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                                 backend="cython", num_threads=t, **kw)[1](dout.astype(np.float32))
           for t in (1, 2)]
    for a, b in zip(*g32):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
def test_float16_cache_and_mask_grad_with_softcap(rng):
    """A float16 KV cache with a window (the kernel's widening path); a float mask's gradient under a softcap."""
    q, k, v = make_qkv(rng, (1, 2), 5, 600, 16)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    out = attn.scaled_dot_product_attention(q.astype(np.float32), k16, v16, window=(50, 0),
                                            is_causal="lower_right", backend="cython")
    ref = reference(q, k16.astype(np.float64), v16.astype(np.float64), window=(50, 0), is_causal="lower_right")
    err = sdpa_error(q.astype(np.float32), k16, v16, attn_mask=np.where(window_mask(5, 600, (50, 0), 595), 0, -np.inf),
                     dtype=np.float32)
    assert_within(out, ref["out"], err, "float16 cache")
    mask = rng.standard_normal((1, 2, 5, 600))
    _, backward = attn.scaled_dot_product_attention_vjp(q, k, v, mask, softcap=3.0, backend="cython")
    dmask = backward(np.ones((1, 2, 5, 16)), mask_grad=True)[3]
    tm = torch.tensor(mask, requires_grad=True)
    tq, tk, tv = (torch.tensor(a) for a in (q, k, v))
    s = 3.0 * torch.tanh(tq @ tk.transpose(-2, -1) / 4 / 3.0) + tm
    (torch.softmax(s, -1) @ tv).sum().backward()
    close64(dmask, tm.grad.numpy(), "mask grad")


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
@pytest.mark.parametrize("L", [1, 2, 200])
def test_kernel_reads_only_the_window(L, rng):
    """Keys and values before the window (of the first row of a block) are never read: NaN there stays out."""
    S, left = 3000, 100
    q, k, v = make_qkv(rng, (1, 2), L, S, 16)
    start = S - L - left  # the first row's window starts here (lower-right)
    k[..., :start, :] = np.nan
    v[..., :start, :] = np.nan
    out = attn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", window=(left, 0), backend="cython")
    ref = reference(q[..., :, :], k[..., start:, :], v[..., start:, :], is_causal="lower_right", window=(left, 0))
    close64(out, ref["out"], "out")


@pytest.mark.parametrize("case", [dict(window=(3, 1)), dict(softcap=1.5, is_causal=True), dict(alibi_slopes="h"),
                                  dict(sinks=True, window=(4, 0), is_causal=True)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_torch_operator(case, rng):
    """attn::sdpa with the variants: forward and autograd (sinks included) against the torch reference;
    torch's gradcheck and opcheck."""
    from attn.integrations.torch import scaled_dot_product_attention as attn_sdpa

    q, k, v, kw = build(case, rng, B=1, Hq=2, Hkv=2, L=5, S=7, E=4)
    kw.pop("enable_gqa")
    kw["is_causal"] = bool(kw.get("is_causal", False))
    dout = rng.standard_normal(q.shape)
    ref = reference(q, k, v, grad_out=dout, **kw)
    t = lambda a: torch.tensor(a, requires_grad=True)
    tq, tk, tv = t(q), t(k), t(v)
    tkw = {n: (torch.tensor(x, requires_grad=n == "sinks") if n in ("alibi_slopes", "sinks") else x)
           for n, x in kw.items()}
    out = attn_sdpa(tq, tk, tv, **tkw)
    close64(out.detach().numpy(), ref["out"], "out")
    out.backward(torch.tensor(dout))
    for name, g in (("dq", tq.grad), ("dk", tk.grad), ("dv", tv.grad)):
        close64(g.numpy(), ref[name], name)
    if "sinks" in kw:
        close64(tkw["sinks"].grad.numpy(), ref["dsinks"], "dsinks")
    fn = lambda q, k, v, s=None: attn_sdpa(q, k, v, **dict(tkw, **({"sinks": s} if s is not None else {})))
    args = (tq, tk, tv) + ((tkw["sinks"],) if "sinks" in kw else ())
    assert torch.autograd.gradcheck(fn, args)
    window = None if "window" not in kw else list(kw["window"])
    torch.library.opcheck(torch.ops.attn.sdpa.default,
                          (tq, tk, tv, None, 0.0, kw["is_causal"], None, False, 0, window,
                           float(kw.get("softcap", 0.0)), tkw.get("alibi_slopes"), tkw.get("sinks")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softcap_and_sinks_low_precision_within_bounds(backend, dtype, rng):
    """float32/float16 softcap + sinks + GQA + causal against float64, bounded by tests/_bounds.py.

    The cap as a float mask: ``mask = cap(s) - s`` makes sdpa_error's scores the capped ones; its
    derivative is at most 1, so the dot product's error bound carries over, plus the cap's own
    rounding (a few u times the cap: ``dmask``). Sinks scale each row by exp(lse - lse') <= 1,
    computed to a few u: ``8 u |out|`` more.
    """
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    B, H, L, S, E, cap = 1, 4, 33, 47, 16, 1.5
    q, k, v = make_qkv(rng, (B, H), L, S, E, dtype=dtype)
    k, v = k[:, :2], v[:, :2]
    sinks = rng.standard_normal(H)
    kw = dict(is_causal="lower_right", softcap=cap, sinks=sinks, enable_gqa=True)
    out = attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    ref = reference(q, k, v, **kw)["out"]
    err = variants_bound(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), ref, dtype=dtype, **kw)
    assert_within(out, ref, err, f"{backend} {np.dtype(dtype).name}")


def variants_bound(q, k, v, ref, *, dtype, is_causal=False, window=None, softcap=None, alibi_slopes=None,
                   sinks=None, dq=None, dk=None, dv=None, **_):
    """Rounding bound (tests/_bounds.py) of a float32 computation of the variants, k and v one head
    per query head: the window and causality as -inf; the cap and ALiBi as the float mask
    ``cap(s) - s + alibi`` (the cap's derivative is at most 1, so the dot product's bound carries
    over), with a few u times the cap for its own rounding and 4 u |alibi| for the bias's (a float32
    slope times an exact distance); sinks' row scaling exp(lse - lse') <= 1 to a few u of ``ref``.
    ``dq``, ``dk``, ``dv``: errors already in q, k and v (e.g. float32 products of int8 values and
    scales, a query rounded to q8_0)."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    u = np.finfo(np.float32).eps / 2
    off = offset_of(is_causal, L, S)
    visible = window_mask(L, S, window or (-1, -1), off)
    if is_causal:
        visible &= window_mask(L, S, (-1, 0), off)
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / np.sqrt(E)
    capped = s if softcap is None else softcap * np.tanh(s / softcap)
    bias = 0.0 if alibi_slopes is None else alibi_matrix(alibi_slopes, L, S, off, s.shape[:-2])
    mask = np.where(visible, capped - s + bias, -np.inf)
    err = sdpa_error(q, k, v, attn_mask=mask, dtype=np.float32, out_dtype=dtype, dq=dq, dk=dk, dv=dv,
                     dmask=8 * (softcap or 0) * u + 4 * u * np.abs(bias) + np.zeros(mask.shape))
    if sinks is None:
        return err
    # sinks as a post-pass over the kernel's (out, lse): the float32 lse and lse' = logaddexp(lse, sink)
    # each rounded (u |lse|), then exp(lse - lse'): the row's scaling moves by 2 u (|lse| + |lse'|) + 8 u
    t = np.where(visible, capped + bias, -np.inf)
    top = np.max(t, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(np.sum(np.exp(t - np.where(np.isfinite(top), top, 0)), axis=-1)) + top[..., 0]
        lse2 = np.logaddexp(lse, np.broadcast_to(np.asarray(sinks, np.float64)[:, None], lse.shape))
        growth = np.where(np.isfinite(lse), 8 + 2 * (np.abs(lse) + np.abs(lse2)), 0.0)
    return err + growth[..., None] * u * np.abs(ref)


@given(L=st.integers(1, 24), S=st.integers(1, 70), left=st.integers(-1, 80), right=st.integers(-1, 80),
       causal=st.sampled_from([False, True, "lower_right"]), softcap=st.sampled_from([None, 0.7, 5.0]),
       alibi=st.booleans(), sinks=st.booleans(), seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_all_variants_property(L, S, left, right, causal, softcap, alibi, sinks, seed, backend):
    """Every combination on random shapes: forward, lse and gradients (sinks' too) against torch autograd."""
    if backend == "cython" and not attn.backends()["cython"]:
        backend = "numpy"
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, (1, 2), L, S, 4)
    kw = dict(is_causal=causal, window=(left, right), softcap=softcap,
              alibi_slopes=rng.uniform(0.05, 1.0, 2) if alibi else None, sinks=rng.standard_normal(2) if sinks else None)
    dout = rng.standard_normal((1, 2, L, 4))
    ref = reference(q, k, v, grad_out=dout, **kw)
    out, lse = attn.scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    _, backward = attn.scaled_dot_product_attention_vjp(q, k, v, backend=backend, **kw)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), backward(dout)):
        close64(g, ref[name], name)


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_softcap_accuracy(simd, dtype):
    """The kernel's cap on its own: with one key of value 1 (E = 1, scale 1) row i's log-sum-exp is
    its capped score cap(x_i) = c tanh(x_i / c), which must be within the few c u that
    variants_bound allows (8 c u) of float64's tanh, over tiny to saturated scores, on every SIMD
    path, for rows of the prefill tiles (key-major) and of decode blocks (rows layout)."""
    c = 3.0
    u = np.finfo(dtype).eps / 2
    mag = np.concatenate([np.geomspace(1e-9, 60 * c, 997), [0.0, 7.9 * c, 7.91 * c, 1e30]])
    x = np.concatenate([mag, -mag]).astype(dtype)  # [L] the scores
    k = np.ones((1, 1), dtype)
    for rows in (x, x[:3]):  # 3 rows: one decode block
        _, lse = attn.scaled_dot_product_attention(rows[:, None], k, k, scale=1.0, softcap=c, return_lse=True)
        ref = c * np.tanh(rows.astype(np.float64) / c)
        assert_within(lse, ref, 8 * c * u, f"softcap on {simd}, {np.dtype(dtype).name}")
    _, lse = attn.scaled_dot_product_attention(np.array([[np.nan], [np.inf], [-np.inf]], dtype), k, k, scale=1.0,
                                               softcap=c, return_lse=True)
    assert np.isnan(lse[0])  # NaN stays NaN; infinite scores saturate at +-c
    assert_within(lse[1:], [c, -c], 8 * c * u, f"softcap of +-inf on {simd}")
