"""attn.multi_head_attention and attn.MultiheadAttention against torch (float64)."""

import numpy as np
import pytest
import torch

import attn
from conftest import BACKENDS

TOL = 1e-13
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
            m.q_proj_weight.copy_(_t(w_q.T)), m.k_proj_weight.copy_(_t(w_k.T)), m.v_proj_weight.copy_(_t(w_v.T))
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
    assert np.max(np.abs(out - ref.numpy())) <= TOL
    assert np.max(np.abs(weights - ref_w.numpy())) <= TOL
    out_fused = attn.multi_head_attention(x, x, x, *w, H, **_bias_kw(b), is_causal=causal, backend=backend)
    assert np.max(np.abs(out_fused - ref.numpy())) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_cross_attention_matches_torch(backend, rng):
    """Queries from the decoder (L=5), keys/values from an encoder output (S=9, other widths)."""
    w, b = _weights(rng, kdim=6, vdim=10), _biases(rng)
    x, memory_k, memory_v = rng.standard_normal((2, 5, E)), rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 10))
    m = _torch_mha_from_numpy(*w, b=b)
    with torch.no_grad():
        ref = m(_t(x), _t(memory_k), _t(memory_v), need_weights=False)[0].numpy()
    out = attn.multi_head_attention(x, memory_k, memory_v, *w, H, **_bias_kw(b), backend=backend)
    assert out.shape == (2, 5, E)
    assert np.max(np.abs(out - ref)) <= TOL


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
    assert np.max(np.abs(attn.multi_head_attention(x, x, x, w_q, w_k, w_v, w_o, H) - ref)) <= TOL


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
    out = attn.multi_head_attention(x, x, x, w_q, w_k, w_v, w_o, n_head, h_kv, is_causal=causal, backend=backend)
    assert np.max(np.abs(out - ref)) <= TOL


def test_functional_sdpa_mask_convention(rng):
    """attn_mask here is SDPA's (True = takes part): the inverse of torch MHA's."""
    w = _weights(rng)
    x = rng.standard_normal((2, 5, E))
    allowed = rng.random((5, 5)) < 0.6
    allowed[:, 0] = True
    m = _torch_mha_from_numpy(*w)
    with torch.no_grad():
        ref = m(_t(x), _t(x), _t(x), attn_mask=_t(~allowed), need_weights=False)[0].numpy()
    assert np.max(np.abs(attn.multi_head_attention(x, x, x, *w, H, attn_mask=allowed) - ref)) <= TOL


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
