"""attn.multi_head_attention and attn.MultiheadAttention against torch (float64)."""

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_within, gamma, heads_error, matmul_error, mha_error, split_heads, unit_roundoff
from conftest import BACKENDS

# torch warns when key_padding_mask and attn_mask differ in type; mixing them is part of the parity grid
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")

E, H = 12, 3  # d_model, n_head (d_k = 4)


def _t(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def _torch_mha_from_numpy(w_q, w_k, w_v, w_o, b=None, batch_first=True):
    """A float64 torch MHA holding x @ W weights (torch stores W^T: rows q, k, v in in_proj_weight)."""
    kdim, vdim = w_k.shape[0], w_v.shape[0]
    m = torch.nn.MultiheadAttention(E, H, bias=b is not None, kdim=kdim, vdim=vdim,
                                    batch_first=batch_first, dtype=torch.float64).eval()
    with torch.no_grad():
        if kdim == vdim == E:
            m.in_proj_weight.copy_(_t(np.concatenate([w_q.T, w_k.T, w_v.T])))
        else:
            for p, w in ((m.q_proj_weight, w_q), (m.k_proj_weight, w_k), (m.v_proj_weight, w_v)):
                p.copy_(_t(w.T))
        m.out_proj.weight.copy_(_t(w_o.T))
        if b is not None:
            m.in_proj_bias.copy_(_t(np.concatenate(b[:3]))), m.out_proj.bias.copy_(_t(b[3]))
    return m


def _weights(rng, kdim=E, vdim=E, h_kv=H):
    d = E // H
    s = lambda n: 1 / np.sqrt(n)
    return (rng.standard_normal((E, E)) * s(E), rng.standard_normal((kdim, h_kv * d)) * s(kdim),
            rng.standard_normal((vdim, h_kv * d)) * s(vdim), rng.standard_normal((H * d, E)) * s(E))


def _biases(rng, h_kv=H):
    d = E // H
    return [rng.standard_normal(n) * 0.1 for n in (E, h_kv * d, h_kv * d, E)]


def _bias_kw(b):
    return {} if b is None else dict(b_q=b[0], b_k=b[1], b_v=b[2], b_o=b[3])


def _assert_mha_close(out, ref, *args, what="", **kwargs):
    """attn and torch each within the rounding bound of multi-head attention (tests/_bounds.py)."""
    assert np.shape(out) == np.shape(ref)
    assert_within(out, ref, 2 * mha_error(*args, **kwargs), what)


# ============================================================================ functional form


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_functional_self_attention_matches_torch(backend, causal, batched, bias, rng):
    w, b = _weights(rng), (_biases(rng) if bias else None)
    x = rng.standard_normal((2, 7, E) if batched else (7, E))
    m = _torch_mha_from_numpy(*w, b=b)
    mask = np.triu(np.ones((7, 7), bool), 1) if causal else None  # torch MHA: True = not allowed
    with torch.no_grad():
        ref, ref_w = m(_t(x), _t(x), _t(x), attn_mask=_t(mask), is_causal=causal, average_attn_weights=False)
    out, weights = attn.multi_head_attention(x, x, x, *w, H, **_bias_kw(b), is_causal=causal,
                                             backend=backend, return_weights=True)
    assert out.shape == x.shape and weights.shape == x.shape[:-2] + (H, 7, 7)
    out_err, w_err = mha_error(x, x, x, *w, H, **_bias_kw(b), is_causal=causal, return_weights=True)
    assert_within(out, ref.numpy(), 2 * out_err)
    assert_within(weights, ref_w.numpy(), 2 * w_err, "weights")
    out_fused = attn.multi_head_attention(x, x, x, *w, H, **_bias_kw(b), is_causal=causal, backend=backend)
    assert_within(out_fused, ref.numpy(), 2 * out_err, "fused")


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_cross_attention_matches_torch(backend, rng):
    """Queries from the decoder (L=5), keys/values from an encoder output (S=9, other widths)."""
    w, b = _weights(rng, kdim=6, vdim=10), _biases(rng)
    x = rng.standard_normal((2, 5, E))
    memory_k, memory_v = rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 10))
    m = _torch_mha_from_numpy(*w, b=b)
    with torch.no_grad():
        ref = m(_t(x), _t(memory_k), _t(memory_v), need_weights=False)[0].numpy()
    out = attn.multi_head_attention(x, memory_k, memory_v, *w, H, **_bias_kw(b), backend=backend)
    assert out.shape == (2, 5, E)
    _assert_mha_close(out, ref, x, memory_k, memory_v, *w, H, **_bias_kw(b))


def test_head_i_uses_column_block_i(rng):
    """The seed's split: head i is columns i*d_k..(i+1)*d_k-1 of x @ W (independent per-head math)."""
    w_q, w_k, w_v, w_o = _weights(rng)
    x = rng.standard_normal((6, E))
    d = E // H
    tx = _t(x)
    heads = []
    for i in range(H):
        cols = slice(i * d, (i + 1) * d)
        q, k, v = tx @ _t(w_q[:, cols]), tx @ _t(w_k[:, cols]), tx @ _t(w_v[:, cols])
        heads.append(torch.softmax(q @ k.T / np.sqrt(d), dim=-1) @ v)
    ref = (torch.cat(heads, dim=-1) @ _t(w_o)).numpy()
    _assert_mha_close(attn.multi_head_attention(x, x, x, w_q, w_k, w_v, w_o, H), ref, x, x, x, w_q, w_k, w_v, w_o, H)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_kv", [1, 3], ids=["mqa", "mha"])
@pytest.mark.parametrize("n_head", [6])
@pytest.mark.parametrize("causal", [False, True])
def test_functional_gqa_matches_torch(backend, h_kv, n_head, causal, rng):
    """Llama-style grouped-query attention: query head i uses key/value head i // (n_head / h_kv)."""
    d = 2
    w_q, w_k, w_v = (rng.standard_normal((E, n)) / 3 for n in (n_head * d, h_kv * d, h_kv * d))
    w_o = rng.standard_normal((n_head * d, E)) / 3
    x = rng.standard_normal((2, 7, E))
    tq, tk, tv = (_t(x) @ _t(w) for w in (w_q, w_k, w_v))
    heads = lambda y, n: y.view(2, 7, n, d).transpose(1, 2)  # [N, T, n*d] -> [N, n, T, d]
    tk_rep = heads(tk, h_kv).repeat_interleave(n_head // h_kv, dim=1)  # independent of enable_gqa
    tv_rep = heads(tv, h_kv).repeat_interleave(n_head // h_kv, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(heads(tq, n_head), tk_rep, tv_rep, is_causal=causal)
    ref = (o.transpose(1, 2).reshape(2, 7, -1) @ _t(w_o)).numpy()
    out = attn.multi_head_attention(x, x, x, w_q, w_k, w_v, w_o, n_head, h_kv, is_causal=causal,
                                    backend=backend)
    _assert_mha_close(out, ref, x, x, x, w_q, w_k, w_v, w_o, n_head, h_kv, is_causal=causal)


def test_functional_sdpa_mask_convention(rng):
    """attn_mask here is SDPA's (True = takes part): the inverse of torch MHA's."""
    w = _weights(rng)
    x = rng.standard_normal((2, 5, E))
    allowed = rng.random((5, 5)) < 0.6
    allowed[:, 0] = True
    m = _torch_mha_from_numpy(*w)
    with torch.no_grad():
        ref = m(_t(x), _t(x), _t(x), attn_mask=_t(~allowed), need_weights=False)[0].numpy()
    _assert_mha_close(attn.multi_head_attention(x, x, x, *w, H, attn_mask=allowed), ref, x, x, x, *w, H,
                      attn_mask=allowed)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(num_heads=5), ValueError, "w_q's width 12 is not a multiple of num_heads=5"),
        (dict(num_heads=0), ValueError, "num_heads must be >= 1"),
        (dict(num_heads=3.0), TypeError, "num_heads must be an int"),
        (dict(num_kv_heads=2), ValueError, "num_kv_heads=2 must divide num_heads=3"),
        (dict(w_q=np.zeros((5, 12))), ValueError, r"w_q must have shape \(12, width\)"),
        (dict(w_k=np.zeros((12, 8))), ValueError, r"w_k must have width num_kv_heads \* d_k = 3 \* 4"),
        (dict(w_o=np.zeros((11, 12))), ValueError, r"w_o must have shape \(12, width\)"),
        (dict(w_v=np.zeros((12, 12), np.float32)), TypeError, "w_v must have the inputs' dtype float64"),
        (dict(b_q=np.zeros(11)), ValueError, r"b_q must have shape \(12,\)"),
        (dict(key=np.zeros((3, 9, 12))), ValueError, "same leading"),
        (dict(value=np.zeros((2, 8, 12))), ValueError, "same sequence length"),
        (dict(query=np.zeros((2, 5, 12), np.float32)), TypeError, "same dtype"),
        (dict(query=np.zeros(12)), ValueError, "query must have at least 2 dims"),
        (dict(query=np.zeros((2, 5, 12), np.int64)), TypeError, "query must have dtype float16"),
    ],
)
def test_functional_validation(change, exc, match, rng):
    w_q, w_k, w_v, w_o = _weights(rng)
    x, mem = rng.standard_normal((2, 5, E)), rng.standard_normal((2, 9, E))
    args = dict(query=x, key=mem, value=mem, w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o, num_heads=H)
    args.update(change)
    with pytest.raises(exc, match=match):
        attn.multi_head_attention(**args)


# ============================================================================ MultiheadAttention

MH = 4  # heads of the module tests: even, so torch's batch_first self-attention fast path is covered too
CONFIGS = {
    "self": dict(cross=False),
    "cross": dict(cross=True),
    "no-bias": dict(cross=False, bias=False),
    "kdim-vdim": dict(cross=True, kdim=5, vdim=7),
    "bias-kv": dict(cross=False, add_bias_kv=True),
    "zero-attn": dict(cross=True, add_zero_attn=True),
    "all-extras": dict(cross=True, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=7, bias=False),
}
LAYOUTS = ["seq-first", "batch-first", "unbatched"]
MASKS = ["none", "kpm-bool", "kpm-float", "attn-bool", "attn-float", "attn-bool-3d", "attn-float-3d",
         "both-bool", "kpm-bool+attn-float", "causal", "causal+kpm"]
WEIGHTS = ["none", "average", "per-head"]
N, L, S_CROSS = 2, 5, 7


def _torch_module(config, layout, seed=0, dtype=torch.float64):
    kw = {k: v for k, v in config.items() if k != "cross"}
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, MH, batch_first=layout == "batch-first", dtype=dtype, **kw).eval()
    with torch.no_grad():  # torch initializes biases to 0: make them matter
        for name in ("in_proj_bias", "bias_k", "bias_v"):
            if getattr(m, name) is not None:
                getattr(m, name).normal_(0, 0.3)
        if m.out_proj.bias is not None:
            m.out_proj.bias.normal_(0, 0.3)
    return m


def _inputs(rng, config, layout):
    """query, key, value in the module's layout; the same array three times for self-attention."""
    s = S_CROSS if config["cross"] else L
    shape = lambda t, d: {"seq-first": (t, N, d), "batch-first": (N, t, d), "unbatched": (t, d)}[layout]
    x = rng.standard_normal(shape(L, E))
    if not config["cross"]:
        return x, x, x, s
    k = rng.standard_normal(shape(s, config.get("kdim", E)))
    return x, k, rng.standard_normal(shape(s, config.get("vdim", E))), s


def _masks(kind, rng, layout, s):
    """(key_padding_mask, attn_mask, is_causal) in torch MHA's convention (bool True = not allowed)."""
    n = () if layout == "unbatched" else (N,)
    kpm = am = None
    if "kpm" in kind:
        kpm = rng.random(n + (s,)) < 0.3
        kpm[..., 0] = False  # every batch row keeps a key (all-padded rows: see the NaN test)
        if kind == "kpm-float":
            kpm = np.where(kpm, -np.inf, rng.standard_normal(kpm.shape))
    if "attn" in kind or kind == "both-bool":
        lead = ((N if n else 1) * MH,) if kind.endswith("3d") else ()
        am = rng.random(lead + (L, s)) < 0.3
        am[..., 0] = False
        if "float" in kind:
            am = rng.standard_normal(am.shape)
    if kind.startswith("causal"):
        am = np.triu(np.ones((L, s), bool), 1)  # upper-left causal: row i sees keys 0..i
    return kpm, am, kind.startswith("causal")


def _run_torch(m, q, k, v, kpm, am, causal, weights):
    tq = _t(q)
    tk, tv = (tq, tq) if k is q else (_t(k), _t(v))  # self-attention: one tensor, as torch's fast path needs
    with torch.no_grad():
        out, w = m(tq, tk, tv, key_padding_mask=_t(kpm), need_weights=weights != "none", attn_mask=_t(am),
                   average_attn_weights=weights == "average", is_causal=causal)
    return out.numpy(), (None if w is None else w.numpy())


def _module_bound(tm, q, k, v, kpm, am, layout, weights):
    """Rounding bounds of torch MHA ``tm`` (and of any implementation of it) on these inputs.

    The module's computation in SDPA form, from its parameters: projections,
    bias_k/bias_v rows and add_zero_attn's zero rows appended to the keys and
    values (exact), key padding and attention masks merged into one additive
    mask (its sum rounded once more), heads, output projection
    (tests/_bounds.py). Returns (output bound, weights bound) in the layout of
    the module's results.
    """
    p = {name: t.detach().numpy() for name, t in tm.named_parameters()}
    dtype = p["out_proj.weight"].dtype
    to_bf = {"seq-first": lambda a: np.swapaxes(a, 0, 1), "batch-first": lambda a: a,
             "unbatched": lambda a: a[None]}[layout]
    xq, xk, xv = (to_bf(a) for a in (q, k, v))  # [N, T, width]
    if "in_proj_weight" in p:
        w_q, w_k, w_v = (p["in_proj_weight"][i * E:(i + 1) * E].T for i in range(3))
    else:
        w_q, w_k, w_v = (p[f"{n}_proj_weight"].T for n in "qkv")
    b_q, b_k, b_v = (None,) * 3 if "in_proj_bias" not in p else (p["in_proj_bias"][i * E:(i + 1) * E] for i in range(3))
    proj = []
    for x, w, b in ((xq, w_q, b_q), (xk, w_k, b_k), (xv, w_v, b_v)):
        x = x.astype(np.float64)
        proj.append((x @ w + (0 if b is None else b), matmul_error(x, w, b, dtype)))
    (pq, dq), (pk, dk), (pv, dv) = proj
    n_batch, s = pk.shape[0], pk.shape[1]
    extra = 0
    if "bias_k" in p:  # one more key/value row, exact
        pk = np.concatenate([pk, np.broadcast_to(p["bias_k"][0], (n_batch, 1, E))], axis=1)
        pv = np.concatenate([pv, np.broadcast_to(p["bias_v"][0], (n_batch, 1, E))], axis=1)
        extra += 1
    if tm.add_zero_attn:
        pk, pv = (np.concatenate([a, np.zeros((n_batch, 1, E))], axis=1) for a in (pk, pv))
        extra += 1
    dk, dv = (np.concatenate([a, np.zeros((n_batch, extra, E))], axis=1) for a in (dk, dv))
    mask = np.zeros((n_batch, MH, L, s + extra))  # torch's masks in SDPA form: -inf = not allowed
    for m, shape in ((kpm, (n_batch, 1, 1, s)), (am, (-1, L, s))):
        if m is None:
            continue
        m = np.where(m, -np.inf, 0.0) if m.dtype == bool else m.astype(np.float64)
        m = m.reshape(shape) if m.ndim == 3 or shape[0] != -1 else m
        m = m.reshape(n_batch, MH, L, s) if m.ndim == 3 else m
        mask[..., :s] += m
    h = lambda a: split_heads(a, MH)  # [N, T, E] -> [N, MH, T, d]
    out_err, w_err = heads_error(h(pq), h(pk), h(pv), h(dq), h(dk), h(dv), p["out_proj.weight"].T,
                                 p.get("out_proj.bias"), attn_mask=mask, dtype=dtype, return_weights=True,
                                 dmask=unit_roundoff(dtype) * np.abs(np.where(np.isfinite(mask), mask, 0)))
    if weights == "average":
        w_err = w_err.mean(axis=1) + gamma(MH + 1, dtype)  # a mean of MH weights <= 1
    from_bf = {"seq-first": lambda a: np.swapaxes(a, 0, 1), "batch-first": lambda a: a,
               "unbatched": lambda a: a[0]}[layout]
    return from_bf(out_err), (w_err[0] if layout == "unbatched" else w_err)


def _check_module(config, layout, mask, weights, backend, rng):
    tm = _torch_module(config, layout)
    m = attn.MultiheadAttention.from_torch(tm, backend=backend)
    q, k, v, s = _inputs(rng, config, layout)
    kpm, am, causal = _masks(mask, rng, layout, s)
    ref, ref_w = _run_torch(tm, q, k, v, kpm, am, causal, weights)
    out, w = m(q, k, v, key_padding_mask=kpm, need_weights=weights != "none", attn_mask=am,
               average_attn_weights=weights == "average", is_causal=causal)
    assert out.shape == ref.shape and out.dtype == np.float64
    out_err, w_err = _module_bound(tm, q, k, v, kpm, am, layout, weights)
    assert_within(out, ref, 2 * out_err)
    if weights == "none":
        assert w is None and ref_w is None
    else:
        assert w.shape == ref_w.shape
        assert_within(w, ref_w, 2 * w_err, "weights")


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_module_matches_torch(config, layout, mask, weights, rng):
    _check_module(CONFIGS[config], layout, mask, weights, "auto", rng)


@pytest.mark.parametrize("backend", ["loop", "numpy", "online"])
@pytest.mark.parametrize("weights", ["none", "per-head"])
@pytest.mark.parametrize("mask", ["none", "kpm-bool", "attn-float-3d", "kpm-bool+attn-float", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", ["self", "all-extras"])
def test_module_matches_torch_other_backends(config, layout, mask, weights, backend, rng):
    _check_module(CONFIGS[config], layout, mask, weights, backend, rng)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_all_padded_batch_row_is_zero_where_torch_gives_nan(backend, mask_kind, rng):
    """torch's softmax over keys that are all padded is NaN; attn's attention output is 0.

    The module output of such a row is therefore out_proj.bias (0 attention @ W_o + b_o), and its
    weights are 0. Every other row matches torch.
    """
    tm = _torch_module(CONFIGS["cross"], "batch-first")
    m = attn.MultiheadAttention.from_torch(tm, backend=backend)
    q, k, v, s = _inputs(rng, CONFIGS["cross"], "batch-first")
    kpm = np.zeros((N, s), bool)
    kpm[1] = True  # batch row 1 is entirely padding
    kpm[0, 3:] = True
    if mask_kind == "float":
        kpm = np.where(kpm, -np.inf, 0.0)
    ref, ref_w = _run_torch(tm, q, k, v, kpm, None, False, "per-head")
    assert np.isnan(ref[1]).all() and np.isnan(ref_w[1]).all()  # torch
    out_err, w_err = _module_bound(tm, q, k, v, kpm, None, "batch-first", "per-head")
    for need_weights in (True, False):
        out, w = m(q, k, v, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False)
        assert not np.isnan(out).any()
        assert_within(out[0], ref[0], 2 * out_err[0])
        assert np.array_equal(out[1], np.broadcast_to(m.b_o, out[1].shape))
        if need_weights:
            assert_within(w[0], ref_w[0], 2 * w_err[0], "weights")
            assert np.all(w[1] == 0)


def test_need_weights_false_runs_the_fused_kernel(monkeypatch, rng):
    """No L x S array: SDPA without return_weights, key_padding_mask passed as a [N, 1, 1, S] view."""
    import attn.nn.module as mod

    calls = []

    def spy(q, k, v, mask, **kw):
        calls.append((None if mask is None else mask.shape, kw))
        return attn.scaled_dot_product_attention(q, k, v, mask, **kw)

    monkeypatch.setattr(mod, "scaled_dot_product_attention", spy)
    m = attn.MultiheadAttention(E, MH, batch_first=True, dtype=np.float64)
    x = rng.standard_normal((N, L, E))
    kpm = np.zeros((N, L), bool)
    causal = np.triu(np.ones((L, L), bool), 1)
    m(x, x, x, key_padding_mask=kpm, need_weights=False)
    m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    m(x, x, x, key_padding_mask=kpm)
    (shape0, kw0), (shape1, kw1), (_, kw2) = calls
    assert shape0 == (N, 1, 1, L) and kw0["return_weights"] is False and kw0["backend"] == "auto"
    assert shape1 is None and kw1["is_causal"] is True and kw1["return_weights"] is False  # the causal hint
    assert kw2["return_weights"] is True


def test_merge_masks_converts_torch_convention_to_sdpa():
    from attn.nn.module import merge_masks

    kpm = np.array([[False, True, False], [False, False, True]])  # [N=2, S=3], True = padding
    am = np.array([[False, False, True], [True, False, False]])  # [L=2, S=3], True = not allowed
    # bool + bool: AND of the inverted masks, broadcast [N, 1, L, S]
    both = merge_masks(kpm, am, 2, 4, np.float64)
    assert both.dtype == np.bool_ and both.shape == (2, 1, 2, 3)
    assert both[0].tolist() == [[[True, False, False], [False, False, True]]]
    assert both[1].tolist() == [[[True, True, False], [False, True, False]]]
    # padding alone stays a broadcastable [N, 1, 1, S]; extra always-allowed keys (bias_k, zero attn)
    alone = merge_masks(kpm, None, 2, 4, np.float64, n_extra=2)
    assert alone.shape == (2, 1, 1, 5) and alone[0, 0, 0].tolist() == [True, False, True, True, True]
    # float + bool: torch's sum of float forms (bool True -> -inf)
    fam = np.array([[0.5, -1.0, 2.0], [0.0, 1.0, -np.inf]])
    mixed = merge_masks(kpm, fam, 2, 4, np.float64)
    assert mixed.dtype == np.float64
    assert mixed[0, 0].tolist() == [[0.5, -np.inf, 2.0], [0.0, -np.inf, -np.inf]]
    # 3-D attn_mask [N * n_head, L, S] -> [N, n_head, L, S]
    assert merge_masks(None, np.zeros((8, 2, 3), bool), 2, 4, np.float64).shape == (2, 4, 2, 3)


# ---------------------------------------------------------------- weights: torch <-> attn


@pytest.mark.parametrize("config", ["self", "kdim-vdim", "bias-kv", "all-extras"])
def test_state_dict_round_trip_with_torch(config):
    tm = _torch_module(CONFIGS[config], "seq-first", seed=3)
    m = attn.MultiheadAttention.from_torch(tm)
    sd = m.state_dict()
    assert list(sd) == list(tm.state_dict())  # torch's names, in torch's order
    for name, tensor in tm.state_dict().items():
        assert sd[name].shape == tuple(tensor.shape) and np.array_equal(sd[name], tensor.numpy())
    back = _torch_module(CONFIGS[config], "seq-first", seed=4)
    back.load_state_dict(m.state_dict(as_torch=True))  # torch accepts it (strict)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, tm.state_dict()[name])
    kw = {k: v for k, v in CONFIGS[config].items() if k != "cross"}
    again = attn.MultiheadAttention(E, MH, dtype=np.float64, **kw)
    again.load_state_dict(sd)  # numpy arrays work too
    assert all(np.array_equal(a, sd[name]) for name, a in again.state_dict().items())


def test_weights_are_x_at_w(rng):
    """The attributes are NumPy-convention projections: w_q = in_proj_weight[:E].T, etc."""
    tm = _torch_module(CONFIGS["self"], "seq-first")
    m = attn.MultiheadAttention.from_torch(tm)
    w_in, b_in = tm.in_proj_weight.detach().numpy(), tm.in_proj_bias.detach().numpy()
    assert np.array_equal(m.w_q, w_in[:E].T) and np.array_equal(m.w_k, w_in[E:2 * E].T)
    assert np.array_equal(m.w_v, w_in[2 * E:].T)
    assert np.array_equal(m.w_o, tm.out_proj.weight.detach().numpy().T)
    assert np.array_equal(m.b_k, b_in[E:2 * E])


def test_load_state_dict_errors():
    m = attn.MultiheadAttention(E, MH)
    sd = m.state_dict()
    with pytest.raises(KeyError, match=r"missing \['out_proj.bias'\], unexpected \[\]"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "out_proj.bias"})
    with pytest.raises(KeyError, match=r"unexpected \['bias_k'\]"):
        m.load_state_dict({**sd, "bias_k": np.zeros((1, 1, E))})
    with pytest.raises(ValueError, match=r"state_dict\['in_proj_weight'\] must have shape \(36, 12\)"):
        m.load_state_dict({**sd, "in_proj_weight": np.zeros((12, 36))})


@pytest.mark.parametrize("config", ["self", "kdim-vdim", "all-extras"])
def test_default_initialization_like_torch(config):
    kw = {k: v for k, v in CONFIGS[config].items() if k != "cross"}
    a = attn.MultiheadAttention(E, MH, **kw)
    b = attn.MultiheadAttention(E, MH, **kw)
    c = attn.MultiheadAttention(E, MH, rng=np.random.default_rng(1), **kw)
    t = torch.nn.MultiheadAttention(E, MH, **kw)
    sa, sc, st = a.state_dict(), c.state_dict(), t.state_dict()
    assert list(sa) == list(st) and a.dtype == np.float32
    assert all(np.array_equal(sa[n], x) for n, x in b.state_dict().items())  # deterministic
    for name, tensor in st.items():
        assert sa[name].shape == tuple(tensor.shape) and sa[name].dtype == np.float32
        if name.endswith("bias") and name != "bias_k":
            assert not sa[name].any()  # zeros, as torch
        elif name.endswith("weight"):
            fan_out, fan_in = sa[name].shape
            bound = (1 / np.sqrt(fan_in)) if name == "out_proj.weight" else np.sqrt(6 / (fan_in + fan_out))
            assert np.abs(sa[name]).max() <= bound and np.abs(sa[name]).max() > 0.8 * bound
            assert np.abs(tensor.numpy()).max() <= bound  # torch's own draw obeys the same bound
            assert not np.array_equal(sa[name], sc[name])


def test_float32_module_close_to_torch(rng):
    tm = _torch_module(CONFIGS["cross"], "batch-first", dtype=torch.float32)
    m = attn.MultiheadAttention.from_torch(tm)
    assert m.dtype == np.float32
    q, k, v, _ = _inputs(rng, CONFIGS["cross"], "batch-first")
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    ref, ref_w = _run_torch(tm, q, k, v, None, None, False, "average")
    out, w = m(q, k, v)
    assert out.dtype == w.dtype == np.float32
    out_err, w_err = _module_bound(tm, q, k, v, None, None, "batch-first", "average")  # float32 bounds
    assert_within(out, ref, 2 * out_err)
    assert_within(w, ref_w, 2 * w_err, "weights")


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (dict(query=np.zeros((L, N, 12), np.float32)), TypeError, "query must have the module's dtype"),
        (dict(query=np.zeros((L, N, 8))), ValueError, "query must have last dim 12; got shape"),
        (dict(key=np.zeros((L, N))), ValueError, "all be 3-D .* or all 2-D"),
        (dict(value=np.zeros((L + 1, N, 12))), ValueError, "agree on batch size"),
        (dict(query=np.zeros((L, N + 1, 12))), ValueError, "agree on batch size"),
        (dict(key_padding_mask=np.zeros((L, N), bool)), ValueError, r"key_padding_mask must have shape \(2, 5\)"),
        (dict(key_padding_mask=np.zeros((N, L), np.int64)), TypeError, "key_padding_mask must be a bool"),
        (dict(attn_mask=np.zeros((N, L, L), bool)), ValueError, r"attn_mask must have shape \(5, 5\) or \(8, 5, 5"),
        (dict(attn_mask=np.zeros((L, L), np.int8)), TypeError, "attn_mask must be a bool array"),
        (dict(is_causal=True), ValueError, "is_causal=True is a hint that attn_mask is the causal mask"),
    ],
)
def test_module_validation(call, exc, match):
    m = attn.MultiheadAttention(E, MH, dtype=np.float64)
    x = np.zeros((L, N, E))
    args = dict(query=x, key=x, value=x)
    args.update(call)
    with pytest.raises(exc, match=match):
        m(**args)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(embed_dim=12, num_heads=5), ValueError, "embed_dim=12 must be divisible by num_heads=5"),
        (dict(embed_dim=0, num_heads=1), ValueError, "embed_dim must be >= 1"),
        (dict(embed_dim=12, num_heads=4, dtype=np.int32), TypeError, "dtype must be float16"),
        (dict(embed_dim=12, num_heads=4, dtype=torch.complex64), TypeError, "dtype must be float16, bfloat16"),
        (dict(embed_dim=12, num_heads=4, dropout=1.5), ValueError, "dropout must be a float in"),
        (dict(embed_dim=12, num_heads=4, rng=0), TypeError, "rng must be a numpy.random.Generator"),
    ],
)
def test_module_constructor_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attn.MultiheadAttention(**kwargs)


def test_torch_dtype_and_positional_signature():
    m = attn.MultiheadAttention(12, 4, 0.0, False, True, True, 5, 7, True, None, torch.float64)
    got = (m.bias, m.add_bias_kv, m.add_zero_attn, m.kdim, m.vdim, m.batch_first)
    assert got == (False, True, True, 5, 7, True)
    assert m.dtype == np.float64 and m.eval() is m


def _python_blocks(path, heading=None):
    """The ```python blocks of a markdown file (of one ``## heading`` section if given)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / path).read_text(encoding="utf-8")
    if heading is not None:
        start = text.index(heading)
        end = text.find("\n## ", start + 1)
        text = text[start:] if end < 0 else text[start:end]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_section_examples_run():
    """The python blocks of docs/multi_head.md (the module ported from torch, then the functional
    form), then the README's multi-head section (the KV cache), in one namespace."""
    blocks = _python_blocks("README.md", "## Multi-head attention and KV-cache decoding")
    extra = _python_blocks("docs/multi_head.md")
    assert len(blocks) == 1 and len(extra) == 2
    namespace = {}
    for block, where in ((extra[0], "docs/multi_head.md"), (extra[1], "docs/multi_head.md"), (blocks[0], "README.md")):
        exec(compile(block, where, "exec"), namespace)


def test_readme_quick_start_and_gradients_run():
    """The Quick start and Gradients blocks of the README run (one namespace, in order)."""
    namespace = {}
    for heading in ("## Quick start", "## Gradients"):
        (block,) = _python_blocks("README.md", heading)
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["dq"].shape == namespace["q"].shape and namespace["lse"].shape == (2, 8, 128)
