"""Random problems (hypothesis): every backward form agrees with torch.autograd in float64.

Shapes, leading dims, GQA, masks (bool, float, broadcast), causal alignment,
scale and strides drawn at random; the reference is torch.autograd.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attn
from test_backward import assert_close64, torch_grads


@st.composite
def problems(draw):
    L, S = draw(st.integers(1, 150)), draw(st.integers(1, 150))
    E, Ev = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    h_kv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    batch = draw(st.sampled_from([(), (2,)]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(batch + (h_kv * group, L, E))
    k = rng.standard_normal(batch + (h_kv, S, E))
    v = rng.standard_normal(batch + (h_kv, S, Ev))
    if draw(st.booleans()):  # a transposed view: non-contiguous rows
        k = np.ascontiguousarray(np.swapaxes(k, -1, -2)).swapaxes(-1, -2)
    kind = draw(st.sampled_from(["none", "bool", "float", "float_keys", "causal", "lower_right"]))
    mask, causal = None, False
    if kind == "bool":
        mask = rng.random((L, S)) < 0.7
    elif kind == "float":
        mask = rng.standard_normal((h_kv * group, L, S))
    elif kind == "float_keys":
        mask = rng.standard_normal((1, S))  # broadcast over heads and rows
    elif kind in ("causal", "lower_right"):
        causal = True if kind == "causal" else "lower_right"
    scale = draw(st.sampled_from([None, 0.3]))
    g = rng.standard_normal(q.shape[:-1] + (Ev,))
    return q, k, v, g, mask, causal, scale, group > 1


@given(problems(), st.sampled_from(["numpy", "online", "cython"]))
def test_random_problems_match_torch(problem, backend):
    q, k, v, g, mask, causal, scale, gqa = problem
    out, backward = attn.scaled_dot_product_attention_vjp(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa, backend=backend)
    mask_grad = mask is not None and mask.dtype != bool
    got = (out,) + backward(g, mask_grad=mask_grad)
    ref = torch_grads(q, k, v, g, mask, causal, scale, gqa)
    mx = lambda a: float(np.max(np.abs(a)))
    floor = mx(g) * mx(v) * max(mx(q), mx(k), 1.0)  # see assert_close64
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), got, ref):
        assert a.shape == b.shape, name
        assert_close64(a, b, f"{backend} {name}", floor)
