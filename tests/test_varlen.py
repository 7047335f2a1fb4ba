"""attn.varlen_attention: packed variable-length batches against each sequence's torch float64 reference."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

import attn
from attn._backends import fused
from conftest import BACKENDS
from _bounds import assert_within
from test_variants import close64, reference, variants_bound


def packed_batch(rng, lengths_q, lengths_k, H=4, H_kv=2, E=8, dtype=np.float64):
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lengths_q)]), np.concatenate([[0], np.cumsum(lengths_k)])
    q = rng.standard_normal((cu_q[-1], H, E)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], H_kv, E)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], H_kv, E + 2)).astype(dtype)
    return q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32)


def per_sequence_reference(q, k, v, cu_q, cu_k, grad_out=None, alibi_slopes=None, **kw):
    """Each sequence through the torch reference of test_variants ([H, L, E] layout)."""
    res = {"out": np.zeros(q.shape[:2] + (v.shape[2],)), "lse": np.zeros((q.shape[1], q.shape[0])),
           "dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape), "dsinks": 0}
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (a[c[s]:c[s + 1]].transpose(1, 0, 2) for a, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        go = None if grad_out is None else grad_out[cu_q[s]:cu_q[s + 1]].transpose(1, 0, 2)
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)[s] if np.ndim(alibi_slopes) == 2 \
            else alibi_slopes
        r = reference(qs[None], ks[None], vs[None], grad_out=None if go is None else go[None],
                      enable_gqa=q.shape[1] != k.shape[1], alibi_slopes=slopes, **kw)
        res["out"][cu_q[s]:cu_q[s + 1]] = r["out"][0].transpose(1, 0, 2)
        res["lse"][:, cu_q[s]:cu_q[s + 1]] = r["lse"][0]
        if go is not None:
            res["dq"][cu_q[s]:cu_q[s + 1]] = r["dq"][0].transpose(1, 0, 2)
            res["dk"][cu_k[s]:cu_k[s + 1]] = r["dk"][0].transpose(1, 0, 2)
            res["dv"][cu_k[s]:cu_k[s + 1]] = r["dv"][0].transpose(1, 0, 2)
            if "dsinks" in r:
                res["dsinks"] = res["dsinks"] + r["dsinks"]
    return res


CASES = [dict(), dict(is_causal=True), dict(is_causal="lower_right", window=(5, 0)), dict(window=(3, 2)),
         dict(softcap=1.5, alibi_slopes="h", is_causal=True), dict(alibi_slopes="bh", sinks=True),
         dict(sinks=True, window=(4, 1), is_causal="lower_right", softcap=2.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_varlen_forward_backward(backend, case, rng):
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    lq, lk = [7, 1, 0, 70, 12], [9, 1, 3, 70, 5]  # an empty query sequence, L > S, L < S
    q, k, v, cu_q, cu_k = packed_batch(rng, lq, lk)
    kw = {n: x for n, x in case.items() if n not in ("alibi_slopes", "sinks")}
    if case.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = rng.uniform(0.1, 0.5, 4)
    elif case.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.uniform(0.1, 0.5, (5, 4))
    if case.get("sinks"):
        kw["sinks"] = rng.standard_normal(4)
    dout = rng.standard_normal(q.shape[:2] + (v.shape[2],))
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, grad_out=dout, **kw)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    out2, backward = attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, backend=backend, **kw)
    close64(out2, ref["out"], "vjp out")
    grads = backward(dout)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        close64(g, ref[name], name)


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
def test_varlen_kernel_paths_and_threads(simd, rng):
    """Every SIMD path; float32 results bitwise the same on 1 and 2 threads."""
    q, k, v, cu_q, cu_k = packed_batch(rng, [1, 130, 3, 64], [300, 130, 3, 200], dtype=np.float32)
    kw = dict(is_causal="lower_right", window=(50, 0), softcap=3.0)
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, **kw)
    out = [attn.varlen_attention(q, k, v, cu_q, cu_k, backend="cython", num_threads=t, **kw) for t in (1, 2)]
    np.testing.assert_array_equal(out[0], out[1])
    for s in range(len(cu_q) - 1):  # each sequence within its float32 rounding bound
        rows = slice(cu_q[s], cu_q[s + 1])
        qs, ks, vs = (a[c[s]:c[s + 1]].transpose(1, 0, 2) for a, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ks, vs = np.repeat(ks, 2, axis=0), np.repeat(vs, 2, axis=0)
        ref_s = ref["out"][rows].transpose(1, 0, 2)
        err = variants_bound(qs, ks, vs, ref_s, dtype=np.float32, **kw)
        assert_within(out[0][rows].transpose(1, 0, 2), ref_s, err, f"sequence {s}")
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    close64(attn.varlen_attention(q64, k64, v64, cu_q, cu_k, backend="cython", **kw),
            per_sequence_reference(q64, k64, v64, cu_q, cu_k, **kw)["out"], "float64")


DECODE_CASES = [dict(is_causal="lower_right"), dict(), dict(is_causal=True),
                dict(is_causal="lower_right", window=(300, 0), softcap=2.0, alibi_slopes="bh", sinks=True)]


@pytest.mark.skipif(not attn.backends()["cython"], reason="kernels not built")
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_varlen_decode_batch(simd, L, case, rng):
    """A decode batch, every sequence L query rows (the decode plan's: the query heads of a key/value head
    read each key together, long contexts split across threads), contexts from fewer keys than rows to
    2,000: float64 equals each sequence's torch reference (upper-left alignment included, which that plan
    does not take), float32 stays within its rounding bound of it and is bitwise the same on 1 and 2
    threads and when the batch also holds a prefill sequence (then a single row's sequences alone)."""
    lq, lk = [L] * 4, [2, 2000, 700, 65]
    q, k, v, cu_q, cu_k = packed_batch(rng, lq, lk, H=8, H_kv=2, E=32)
    kw = {n: x for n, x in case.items() if n not in ("alibi_slopes", "sinks")}
    if case.get("alibi_slopes"):
        kw["alibi_slopes"] = rng.uniform(0.001, 0.01, (4, 8))
    if case.get("sinks"):
        kw["sinks"] = rng.standard_normal(8)
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, **kw)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, backend="cython", return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    out32 = [attn.varlen_attention(q32, k32, v32, cu_q, cu_k, backend="cython", num_threads=t, **kw) for t in (1, 2)]
    np.testing.assert_array_equal(out32[0], out32[1])
    for s in range(len(lq)):   # each sequence within its float32 rounding bound
        rows = slice(cu_q[s], cu_q[s + 1])
        qs, ks, vs = (a[c[s]:c[s + 1]].transpose(1, 0, 2) for a, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        ks, vs = np.repeat(ks, 4, axis=0), np.repeat(vs, 4, axis=0)
        ref_s = ref["out"][rows].transpose(1, 0, 2)
        vkw = dict(kw, alibi_slopes=kw["alibi_slopes"][s]) if "alibi_slopes" in kw else kw
        err = variants_bound(qs, ks, vs, ref_s, dtype=np.float32, **vkw)
        assert_within(out32[0][rows].transpose(1, 0, 2), ref_s, err, f"sequence {s}")
    if L == 1:   # the same sequences beside a prefill sequence of 40 rows: their rows bit for bit the same
        q2, k2, v2, cu_q2, cu_k2 = packed_batch(rng, lq + [40], lk + [50], H=8, H_kv=2, E=32, dtype=np.float32)
        q2[:4], k2[:cu_k[-1]], v2[:cu_k[-1]] = q32, k32, v32
        kw2 = dict(kw, alibi_slopes=np.concatenate([kw["alibi_slopes"], kw["alibi_slopes"][:1]])) \
            if "alibi_slopes" in kw else kw
        mixed = attn.varlen_attention(q2, k2, v2, cu_q2, cu_k2, backend="cython", **kw2)
        np.testing.assert_array_equal(mixed[:4], out32[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_varlen_reads_16bit_keys_as_they_are(simd, dtype, rng):
    """16-bit K and V go to the kernel as they are, as a 16-bit cache does (a widened copy cost up to a third
    of a bfloat16 prefill and took float32 products where the bfloat16 ones apply): the packed call equals,
    bit for bit, each sequence's own scaled_dot_product_attention call on the same values and the same
    keys in pages (flash_attn_varlen_func with a block table; a bfloat16 out written by the kernel on
    both routes), and so do the gradients (the backward widens them) those of each sequence's own vjp."""
    dt = attn._dtypes.bfloat16() if dtype == "bfloat16" else np.dtype(np.float16)
    q, k, v, cu_q, cu_k = packed_batch(rng, [1, 130, 3, 64], [300, 130, 3, 200], H=8, H_kv=2, E=64,
                                       dtype=np.float32)
    q, k, v = (a.astype(dt) for a in (q, k, v))
    kw = dict(is_causal="lower_right", window=(90, 0))
    out = attn.varlen_attention(q, k, v, cu_q, cu_k, backend="cython", **kw)
    assert out.dtype == dt
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (a[c[s]:c[s + 1]].transpose(1, 0, 2)[None] for a, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        one = attn.scaled_dot_product_attention(qs, ks, vs, backend="cython", enable_gqa=True, **kw)
        np.testing.assert_array_equal(out[cu_q[s]:cu_q[s + 1]].view(np.uint16),
                                      one[0].transpose(1, 0, 2).view(np.uint16), err_msg=f"sequence {s}")
    # the same keys in pages of 16 (flash_attn_varlen_func with a block table: the cache plan), bit for bit
    from attn.flash import flash_attn_varlen_func
    from test_flash import to_pages

    k_pages, v_pages, table = to_pages(16, rng, *([x[cu_k[s]:cu_k[s + 1]] for s in range(len(cu_k) - 1)]
                                                  for x in (k, v)))
    paged = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, None, None, causal=True, window_size=(90, 0),
                                   block_table=table)
    assert paged.dtype == dt
    np.testing.assert_array_equal(paged.view(np.uint16), out.view(np.uint16))
    g = rng.standard_normal(out.shape).astype(dt)
    _, backward = attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, backend="cython", **kw)
    grads = backward(g)
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (a[c[s]:c[s + 1]].transpose(1, 0, 2)[None] for a, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        _, one = attn.scaled_dot_product_attention_vjp(qs, ks, vs, backend="cython", enable_gqa=True, **kw)
        gs = one(np.ascontiguousarray(g[cu_q[s]:cu_q[s + 1]].transpose(1, 0, 2)[None]))
        for what, a, b, c in zip(("dq", "dk", "dv"), grads, gs, (cu_q, cu_k, cu_k)):
            assert a.dtype == dt, what
            np.testing.assert_array_equal(a[c[s]:c[s + 1]].view(np.uint16), b[0].transpose(1, 0, 2).view(np.uint16),
                                          err_msg=f"{what} of sequence {s}")


class _UnwrittenIsInf:
    """numpy for the fused backend, except that np.empty's float arrays hold +inf and -inf (alternating
    along the first axis: a GQA group's consecutive heads) instead of whatever the memory held, so
    a read of an element nobody wrote shows (as inf, NaN, or inf - inf's warning)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float, **kw):
        a = np.empty(shape, dtype, **kw)
        if a.dtype.kind == "f" and a.ndim:
            a[...] = np.where(np.arange(a.shape[0]) % 2 == 0, np.inf, -np.inf).reshape((-1,) + (1,) * (a.ndim - 1))
        return a


@pytest.fixture
def unwritten_is_inf(monkeypatch):
    """The np.empty arrays of the fused backend, which runs the packed batch (its varlen_forward and
    varlen_backward), hold +-inf (:class:`_UnwrittenIsInf`) for the test."""
    monkeypatch.setattr(fused, "np", _UnwrittenIsInf())


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,h_kv", [([3], [0], 2), ([3, 0, 2], [0, 4, 0], 2), ([0, 3, 5, 4], [2, 0, 7, 0], 1)],
                         ids=["no-keys", "mixed", "mixed-gqa"])
def test_varlen_backward_without_keys(unwritten_is_inf, backend, lq, lk, h_kv, rng):
    """Sequences with no keys (every one, or some, next to some with no queries): output and grad_q
    zero, grad_k and grad_v of k's and v's shapes (zero-size when no sequence has a key); no read
    of unwritten memory (:class:`_UnwrittenIsInf`)."""
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    q, k, v, cu_q, cu_k = packed_batch(rng, lq, lk, H=2, H_kv=h_kv)
    dout = rng.standard_normal(q.shape[:2] + (v.shape[2],))
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, grad_out=dout)
    out, backward = attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, backend=backend)
    close64(out, ref["out"], "out")
    grads = backward(dout)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape, (name, g.shape, x.shape)
        close64(g, ref[name], name)
    no_keys = np.repeat(np.diff(cu_k) == 0, np.diff(cu_q))  # the query rows of key-less sequences
    assert not out[no_keys].any() and not grads[0][no_keys].any()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_kv", [4, 2])
def test_varlen_backward_reads_only_written_memory(unwritten_is_inf, backend, h_kv, rng):
    """GQA (8 query heads over 4 or 2) and key lengths from 0 to 300: the fused backward's per-matrix
    buffers are as long as the longest sequence and the kernel writes each matrix's own rows only.
    With those buffers' unwritten memory made +-inf, no warning (an error here) and torch's gradients."""
    if backend == "cython" and not attn.backends()["cython"]:
        pytest.skip("kernels not built")
    q, k, v, cu_q, cu_k = packed_batch(rng, [5, 130, 1, 64, 3], [300, 7, 0, 129, 1], H=8, H_kv=h_kv)
    dout = rng.standard_normal(q.shape[:2] + (v.shape[2],))
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, grad_out=dout, is_causal="lower_right")
    out, backward = attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, backend=backend, is_causal="lower_right")
    close64(out, ref["out"], "out")
    for name, g in zip(("dq", "dk", "dv"), backward(dout)):
        close64(g, ref[name], name)


def test_varlen_without_the_compiled_kernels(monkeypatch, rng):
    """Without the backward extension the gradients of "auto" run each sequence with numpy, and
    without attn._kernels its forward too (the fused backend's packed calls never run), giving
    torch's results; an explicit backend="cython" is a RuntimeError before any kernel runs."""
    from attn import _build

    q, k, v, cu_q, cu_k = packed_batch(rng, [3, 0, 5], [4, 2, 6])
    dout = rng.standard_normal(q.shape[:2] + (v.shape[2],))
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, grad_out=dout, is_causal=True)

    def refuse(*args):
        raise AssertionError("the fused backend ran the packed batch")

    monkeypatch.setattr(_build, "HAVE_BACKWARD", False)
    monkeypatch.setattr(fused, "varlen_backward", refuse)
    out, backward = attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, is_causal=True)
    close64(out, ref["out"], "vjp out")
    for name, g in zip(("dq", "dk", "dv"), backward(dout)):
        close64(g, ref[name], name)
    with pytest.raises(RuntimeError, match="backend='cython' requested but attn's compiled kernels are not importable"):
        attn.varlen_attention_vjp(q, k, v, cu_q, cu_k, backend="cython")
    monkeypatch.setattr(_build, "HAVE_CYTHON", False)
    monkeypatch.setattr(fused, "varlen_forward", refuse)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, return_lse=True)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
    with pytest.raises(RuntimeError, match="backend='cython' requested but attn's compiled kernels are not importable"):
        attn.varlen_attention(q, k, v, cu_q, cu_k, backend="cython")


def test_varlen_validation():
    q = np.zeros((5, 2, 4))
    cu = np.array([0, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        attn.varlen_attention(q, q, q, np.array([0, 2, 4]), cu)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an array of ints"):
        attn.varlen_attention(q, q, q, cu, cu.astype(float))
    with pytest.raises(ValueError, match="as many sequences"):
        attn.varlen_attention(q, q, q, cu, np.array([0, 5]))
    with pytest.raises(ValueError, match="max_seqlen_q=2 is less than the longest sequence"):
        attn.varlen_attention(q, q, q, cu, cu, max_seqlen_q=2)
    with pytest.raises(ValueError, match="3 dims"):
        attn.varlen_attention(q[0], q, q, cu, cu)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[H\] or \[B, H\]"):
        attn.varlen_attention(q, q, q, cu, cu, alibi_slopes=np.ones(3))
    q8 = attn.Q8Tensor.quantize(np.ones((5, 2, 32), np.float32))
    with pytest.raises(TypeError, match="k is an int8 .* cache tensor, which varlen_attention does not take"):
        attn.varlen_attention(np.ones((5, 2, 32), np.float32), q8, q8, cu, cu)


@given(lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
       left=st.integers(-1, 50), causal=st.sampled_from([False, True, "lower_right"]), seed=st.integers(0, 999))
def test_varlen_property(lengths, left, causal, seed):
    """Random lengths (empty sequences included) and windows: the fused call equals the reference."""
    rng = np.random.default_rng(seed)
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    q, k, v, cu_q, cu_k = packed_batch(rng, lq, lk, H=2, H_kv=1)
    kw = dict(is_causal=causal, window=(left, -1))
    ref = per_sequence_reference(q, k, v, cu_q, cu_k, **kw)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    close64(out, ref["out"], "out")
    close64(lse, ref["lse"], "lse")
