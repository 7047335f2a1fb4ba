"""Property-based differential tests (hypothesis).

Random shapes (crossing the kernel's 64-row / 128-key blocks), dtypes, masks
(bool, float with -inf, causal, lower-right, broadcast), scales, GQA,
broadcast leading dims and memory layouts (Fortran, negative strides,
strided, big-endian, misaligned, stride 0): every backend against a float64 NumPy matrix reference
built here from the inputs, and against torch.

Example counts come from the hypothesis profile (tests/conftest.py):
HYPOTHESIS_PROFILE=ci (default, bounded) or dev (1000 per test).
"""

import numpy as np
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import attn
from _bounds import assert_sdpa_close, assert_weights_close, assert_within, softmax_error
from _layouts import SAME_VALUES, relayout

BACKENDS = ["loop", "numpy", "online"] + (["cython"] if attn.backends()["cython"] else [])
# operands may also be broadcast over rows (stride 0: changes the values; the references use them)
LAYOUTS = SAME_VALUES + ("row_broadcast",)
MASK_LAYOUTS = SAME_VALUES


def _lead_for(batch, rng_draw):
    """A leading shape that broadcasts to ``batch``: some dims set to 1, some dropped."""
    lead = [1 if rng_draw() else n for n in batch]
    while lead and lead[0] == 1 and rng_draw():
        lead.pop(0)
    return tuple(lead)


@st.composite
def attention_problems(draw):
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    gqa = draw(st.booleans())
    n_lead = draw(st.integers(1 if gqa else 0, 2))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=n_lead, max_size=n_lead)))
    if gqa:  # query heads (dim -3) that key/value heads can divide
        batch = batch[:-1] + (draw(st.sampled_from([2, 4, 6])),)
    # half the time past the kernel's blocks (64 query rows, 128 keys)
    L = draw(st.integers(60, 70)) if draw(st.booleans()) else draw(st.integers(0, 9))
    S = draw(st.integers(120, 140)) if draw(st.booleans()) else draw(st.integers(0, 9))
    E = draw(st.integers(1, 17))
    Ev = draw(st.integers(1, 9))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "causal", "lower_right"]))
    scale = draw(st.one_of(st.none(), st.floats(-3, 3, allow_nan=False)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    flip = lambda: draw(st.booleans())

    q_lead = _lead_for(batch, flip) if not gqa else batch
    kv_lead = _lead_for(batch, flip)
    group = 1
    if gqa:  # key/value heads divide query heads
        h_q = batch[-1]
        h_kv = draw(st.sampled_from([d for d in range(1, h_q + 1) if h_q % d == 0]))
        group = h_q // h_kv
        kv_lead = tuple(1 if flip() else n for n in batch[:-1]) + (h_kv,)
    kv_full = kv_lead[:-1] + (batch[-1],) if gqa else kv_lead
    batch = np.broadcast_shapes(q_lead, kv_full)  # dims every operand dropped are gone
    q = rng.standard_normal(q_lead + (L, E)) * draw(st.sampled_from([0.5, 1.0, 3.0]))
    k = rng.standard_normal(kv_lead + (S, E))
    v = rng.standard_normal(kv_lead + (S, Ev))
    q, k, v = (a.astype(dtype) for a in (q, k, v))

    mask = None
    if mask_kind in ("bool", "float"):
        m_shape = _lead_for(batch, flip) + (1 if flip() else L, 1 if flip() else S)
        if mask_kind == "bool":
            mask = rng.random(m_shape) < draw(st.sampled_from([0.0, 0.3, 0.9]))
        else:
            mask = rng.standard_normal(m_shape) * 2
            mask[rng.random(m_shape) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -np.inf
            mask = mask.astype(draw(st.sampled_from([np.float64, np.float32, dtype])))
        mask = relayout(mask, draw(st.sampled_from(MASK_LAYOUTS)))
    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    q, k, v = (relayout(a, lay) for a, lay in zip((q, k, v), layouts))
    causal = {"causal": True, "lower_right": "lower_right"}.get(mask_kind, False)
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, scale=scale, gqa=gqa, group=group,
                batch=batch, L=L, S=S, Ev=Ev, dtype=dtype, layouts=layouts)


def reference(p):
    """float64 (out, weights) from plain NumPy, on contiguous copies of exactly the inputs."""
    q, k, v = (np.ascontiguousarray(a, dtype=np.float64) for a in (p["q"], p["k"], p["v"]))
    if p["group"] > 1:
        k, v = np.repeat(k, p["group"], axis=-3), np.repeat(v, p["group"], axis=-3)
    batch, L, S = p["batch"], p["L"], p["S"]
    q, k, v = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k, v))
    E = q.shape[-1]
    scale = 1 / np.sqrt(E) if p["scale"] is None else p["scale"]
    scores = np.einsum("...ie,...je->...ij", q, k) * scale  # [*batch, L, S]
    allowed = np.ones(batch + (L, S), bool)
    if p["causal"]:
        offset = 0 if p["causal"] is True else S - L
        allowed &= np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    if p["mask"] is not None:
        m = np.asarray(p["mask"])
        if m.dtype == bool:
            allowed &= m
        else:
            scores = scores + m.astype(p["dtype"] if p["dtype"] != np.float16 else np.float32).astype(np.float64)
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isneginf(row_max), 0, row_max)
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    w = e / np.where(total == 0, 1, total)  # nothing visible: weights 0
    return w @ v, w


def torch_reference(p):
    """torch SDPA in float64 on materialized inputs, with the causal variants as bool masks."""
    out, _ = reference(p)  # only for shapes
    q, k, v = (np.ascontiguousarray(a, dtype=np.float64) for a in (p["q"], p["k"], p["v"]))
    batch, L, S = p["batch"], p["L"], p["S"]
    if p["group"] > 1:
        k, v = np.repeat(k, p["group"], axis=-3), np.repeat(v, p["group"], axis=-3)
    q, k, v = (torch.from_numpy(np.array(np.broadcast_to(a, batch + a.shape[-2:]))) for a in (q, k, v))
    mask = p["mask"]
    if p["causal"]:
        mask = attn.causal_allowed(L, S, 0 if p["causal"] is True else S - L)
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (L, S))
        if mask.dtype != bool:
            mask = mask.astype(p["dtype"] if p["dtype"] != np.float16 else np.float32).astype(np.float64)
        mask = torch.from_numpy(np.array(mask))
    if 0 in (L, S) or 0 in batch:
        return np.zeros(out.shape)
    with torch.no_grad():
        t = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p["scale"])
    return t.numpy()


def _compute_dtype(p):
    return np.float32 if p["dtype"] == np.float16 else p["dtype"]


def _mask_as_computed(p):
    """The mask as attn applies it: a float mask in the computing dtype."""
    m = p["mask"]
    if m is None or np.asarray(m).dtype == bool:
        return m
    return np.asarray(m).astype(_compute_dtype(p))


def _describe(p):
    return {key: (val.shape, val.dtype, val.strides) if isinstance(val, np.ndarray) else val
            for key, val in p.items() if key not in ()}


@given(attention_problems(), st.booleans())
def test_sdpa_backends_agree_with_reference_and_torch(p, return_weights):
    note(repr(_describe(p)))
    event(f"dtype={np.dtype(p['dtype']).name}")
    event(f"mask={'none' if p['mask'] is None else p['mask'].dtype.kind} causal={p['causal']}")
    event(f"gqa={p['gqa']}")
    event(f"L>64={p['L'] > 64} S>128={p['S'] > 128}")
    for layout in set(p["layouts"]):
        event(f"layout={layout}")
    ref_out, ref_w = reference(p)
    t_out = torch_reference(p)
    # every comparison within the rounding bounds of its two sides (tests/_bounds.py)
    problem = dict(attn_mask=_mask_as_computed(p), is_causal=p["causal"], scale=p["scale"])
    q, k, v = p["q"], p["k"], p["v"]
    # torch and the NumPy reference agree (rows torch leaves NaN are the fully masked ones)
    assert_sdpa_close(np.nan_to_num(t_out), ref_out, q, k, v, dtype=np.float64, out_dtype=np.float64,
                      what="torch", **problem)
    outs = {}
    for backend in BACKENDS:
        res = attn.scaled_dot_product_attention(
            p["q"], p["k"], p["v"], attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"],
            enable_gqa=p["gqa"], backend=backend, return_weights=return_weights,
        )
        out, w = res if return_weights else (res, None)
        assert out.shape == p["batch"] + (p["L"], p["Ev"]), backend
        assert out.dtype == p["dtype"], backend
        assert not np.isnan(out).any(), backend
        assert_sdpa_close(out, ref_out, q, k, v, what=backend, **problem)
        if return_weights:
            assert w.shape == p["batch"] + (p["L"], p["S"]) and w.dtype == p["dtype"]
            assert_weights_close(w, np.broadcast_to(ref_w, w.shape), q, k, what=backend, **problem)
        outs[backend] = out
    if "cython" in outs:  # thread count never changes a bit
        one = attn.scaled_dot_product_attention(
            p["q"], p["k"], p["v"], attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"],
            enable_gqa=p["gqa"], backend="cython", num_threads=1)
        two = attn.scaled_dot_product_attention(
            p["q"], p["k"], p["v"], attn_mask=p["mask"], is_causal=p["causal"], scale=p["scale"],
            enable_gqa=p["gqa"], backend="cython", num_threads=2)
        assert one.tobytes() == two.tobytes() == outs["cython"].tobytes()


@st.composite
def softmax_problems(draw):
    dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    long_axis = st.one_of(st.integers(0, 5), st.integers(120, 135))  # only the softmax axis is long
    shape = tuple(draw(long_axis if d == axis % ndim else st.integers(0, 5)) for d in range(ndim))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0]))).astype(dtype)
    x = relayout(x, draw(st.sampled_from(LAYOUTS)))
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if kind != "none":
        m_shape = tuple(1 if draw(st.booleans()) else n for n in shape)[draw(st.integers(0, ndim)):]
        if kind == "bool":
            mask = rng.random(m_shape) < draw(st.sampled_from([0.0, 0.5, 1.0]))
        else:
            mask = rng.standard_normal(m_shape)
            mask[rng.random(m_shape) < 0.3] = -np.inf
        mask = relayout(mask, draw(st.sampled_from(MASK_LAYOUTS)))
    return dict(x=x, mask=mask, axis=axis, dtype=dtype)


@given(softmax_problems())
def test_masked_softmax_backends_agree_with_torch(p):
    note(repr(_describe(p)))
    x = np.ascontiguousarray(p["x"], dtype=np.float64)
    if p["mask"] is not None and p["mask"].dtype != bool:
        cdtype = np.float32 if p["dtype"] != np.float64 else np.float64
        x = x + np.asarray(p["mask"]).astype(cdtype).astype(np.float64)
    elif p["mask"] is not None:
        x = np.where(p["mask"], x, -np.inf)
    ref = torch.softmax(torch.from_numpy(np.array(x)), dim=p["axis"]).numpy()
    ref = np.nan_to_num(ref, nan=0.0)  # a slice with nothing taking part is 0 in attn
    mask = _mask_as_computed(p)
    bound = softmax_error(p["x"], mask, p["axis"], dtype=_compute_dtype(p), out_dtype=p["dtype"])
    bound = bound + softmax_error(p["x"], mask, p["axis"], dtype=np.float64)
    for backend in [b for b in BACKENDS if b in ("numpy", "cython")]:  # the masked_softmax backends
        out = attn.masked_softmax(p["x"], p["mask"], axis=p["axis"], backend=backend)
        assert out.shape == p["x"].shape and out.dtype == p["dtype"]
        assert_within(out, ref, bound, backend)
