"""What each backend promises beyond agreeing with torch: its declared capabilities, memory, dropout draws,
the split-key merge."""

import tracemalloc

import numpy as np
import pytest

import attn
from attn import _backends
from _bounds import assert_sdpa_close, assert_within, matmul_error, sdpa_error, unit_roundoff
from conftest import make_qkv, torch_sdpa


#: What the layers above read of every backend module (attn._backends' docstring): never probed.
DECLARED_FLAGS = ("APPLIES_SINKS", "READS_Q8", "FORWARD_WRITES_LSE", "RUNS_VARLEN", "RUNS_CACHE")
FUNCTIONS = ("unavailable", "cannot_run", "check_memory", "forward", "forward_lse", "backward")


@pytest.mark.parametrize("name", list(_backends.ATTENTION))
def test_each_backend_declares_every_capability(name, monkeypatch):
    """Each module declares every flag as a bool and has every function; the functions a flag
    promises exist exactly when it is set; ``unavailable`` reads the build at each call."""
    impl = _backends.ATTENTION[name]
    for flag in DECLARED_FLAGS:
        assert type(getattr(impl, flag)) is bool, (name, flag)
    for fn in FUNCTIONS:
        assert callable(getattr(impl, fn)), (name, fn)
    assert callable(getattr(impl, "forward_and_lse", None)) == impl.FORWARD_WRITES_LSE, name
    for fn in ("varlen_forward", "varlen_backward"):
        assert callable(getattr(impl, fn, None)) == impl.RUNS_VARLEN, (name, fn)
    assert callable(getattr(impl, "cache_forward", None)) == impl.RUNS_CACHE, name
    from attn import _build

    built = {"HAVE_CYTHON": _build.HAVE_CYTHON, "HAVE_BACKWARD": _build.HAVE_BACKWARD}
    for gradients in (False, True):
        missing = impl.unavailable(gradients)
        assert missing is None or (len(missing) == 2 and missing[0].startswith("attn._kernels")), (name, missing)
    monkeypatch.setattr(_build, "HAVE_BACKWARD", False)
    monkeypatch.setattr(_build, "BACKWARD_IMPORT_ERROR", "ImportError: not built")
    if name == "cython":
        assert impl.unavailable(gradients=True) == ("attn._kernels_backward", "ImportError: not built")
        assert (impl.unavailable() is None) == built["HAVE_CYTHON"]
    else:
        assert impl.unavailable(gradients=True) is None and impl.unavailable() is None


def _peak_bytes(fn):
    """Peak traced allocation while ``fn`` runs (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_loop_extra_memory_is_per_row(is_causal, rng):
    """The loop keeps one row of scores: O(S) beyond the output, never an L x S array.

    At L = S = 2000 an L x S bool mask alone is 4 MB and float64 scores 32 MB;
    the bound allowed here is the output plus 64 rows of S float64.
    """
    n, e = 2000, 4
    q, k, v = make_qkv(rng, (), n, n, e)
    out_bytes = n * e * 8
    peak = _peak_bytes(lambda: attn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend="loop"))
    assert peak <= out_bytes + 64 * n * 8, f"peak {peak} bytes"


def test_online_extra_memory_is_blocks(rng):
    """The online form holds [L, block] scores, never L x S."""
    n, e = 2000, 4
    q, k, v = make_qkv(rng, (), n, n, e)
    peak = _peak_bytes(lambda: attn.scaled_dot_product_attention(q, k, v, is_causal=True, backend="online"))
    assert peak <= n * n * 8 / 4, f"peak {peak} bytes"  # a quarter of one L x S float64 array


@pytest.mark.parametrize("h_q, h_kv", [(4, 4), (6, 2)])
def test_loop_and_numpy_draw_the_same_dropout(h_q, h_kv, rng):
    """Per-row draws in C order over (batch, row, key) equal one draw of the whole keep mask."""
    q = rng.standard_normal((2, h_q, 5, 4))
    k, v = rng.standard_normal((2, 2, h_kv, 7, 4))[:]
    kw = dict(dropout_p=0.3, enable_gqa=h_q != h_kv, return_weights=True)
    out_l, w_l = attn.scaled_dot_product_attention(q, k, v, backend="loop", rng=np.random.default_rng(3), **kw)
    out_n, w_n = attn.scaled_dot_product_attention(q, k, v, backend="numpy", rng=np.random.default_rng(3), **kw)
    keep = np.random.default_rng(3).random((2, h_q, 5, 7)) >= 0.3
    assert np.array_equal(w_l != 0, keep) and np.array_equal(w_n != 0, keep)
    # both: the same kept weights / (1 - p) times v; each within the weights' bound and the product's
    w_err = sdpa_error(q, k, v, enable_gqa=True, return_weights=True)[1] / 0.7 + unit_roundoff(np.float64) * np.abs(w_n)
    v_rep = np.repeat(v, h_q // h_kv, axis=-3)  # [2, h_q, 7, 4]
    assert_within(out_l, out_n, 2 * matmul_error(np.abs(w_n) + w_err, v_rep, dx=w_err))


@pytest.mark.parametrize("chunk_mask", ["none", "first_chunk_masked", "last_chunk_masked", "all_masked"])
def test_online_is_the_oracle_of_the_split_key_merge(chunk_mask, rng):
    """Decode shapes (few rows, thousands of keys) take the fused kernel's split-key
    path; merging its chunk partials must equal the online form's key blocks and torch."""
    q, k, v = make_qkv(rng, (3,), 2, 3000, 16)
    allowed = np.ones((3, 2, 3000), bool)
    if chunk_mask == "first_chunk_masked":
        allowed[..., :1500] = False
    elif chunk_mask == "last_chunk_masked":
        allowed[..., 600:] = False
    elif chunk_mask == "all_masked":
        allowed[1] = False
    fused = attn.scaled_dot_product_attention(q, k, v, allowed, backend="cython")
    online = attn.scaled_dot_product_attention(q, k, v, allowed, backend="online")
    ref = torch_sdpa(q, k, v, allowed)
    ref[~allowed.any(-1)] = 0  # torch gives NaN for rows with no key; attn's contract is 0
    assert_sdpa_close(online, ref, q, k, v, attn_mask=allowed, what="online")
    assert_sdpa_close(fused, online, q, k, v, attn_mask=allowed, what="fused")


def test_online_nan_stays_in_its_row(rng):
    q, k, v = make_qkv(rng, (), 3, 200, 8)
    k[150, 2] = np.nan  # every row sees key 150
    out = attn.scaled_dot_product_attention(q, k, v, backend="online")
    assert np.isnan(out).all()
    out = attn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", backend="online")
    assert np.isnan(out).all()
    k2 = k.copy()
    k2[150] = 0
    ok = attn.scaled_dot_product_attention(q, k2, v, is_causal=True, backend="online")  # rows 0..2 see keys 0..2
    assert np.isfinite(ok).all()


@pytest.mark.parametrize("h_q, h_kv, S", [(2, 1, 2), (4, 2, 70), (6, 3, 130)])
def test_grouped_decode_weights_stop_at_the_causal_horizon(h_q, h_kv, S, rng):
    """One query row per head, heads of a group computed together (no per-row causal
    mask, only the block's horizon): with upper-left causal the row sees key 0 alone,
    and the weights of every later key, in the same key tile too, must be 0."""
    from conftest import torch_weights

    q = rng.standard_normal((1, h_q, 1, 8))
    k, v = rng.standard_normal((2, 1, h_kv, S, 8))
    out, w = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                               return_weights=True, backend="cython")
    k_rep = np.repeat(k, h_q // h_kv, axis=1)  # [1, h_q, S, 8]
    ref = torch_weights(q, k_rep, is_causal=True)
    assert np.array_equal(w[..., 1:], np.zeros_like(w[..., 1:]))
    assert np.array_equal(ref[..., 1:], np.zeros_like(ref[..., 1:]))
    assert np.all(w[..., 0] == 1.0) and np.max(np.abs(out - np.repeat(v, h_q // h_kv, axis=1)[..., :1, :])) == 0
