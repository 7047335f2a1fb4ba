"""attn.KVCache, and decoding through it against one full causal call in torch (float64)."""

import numpy as np
import pytest
import torch

import attn
from _bounds import assert_sdpa_close, assert_within, mha_error, unit_roundoff
from conftest import BACKENDS, torch_sdpa

CHUNKINGS = {
    "tokens": [1] * 12,  # token by token
    "prefill+tokens": [5, 1, 1, 1, 1, 1, 1, 1],  # chunked prefill, then one token at a time
    "chunks": [3, 4, 1, 2, 2],
}


def _chunks(sizes):
    start = 0
    for n in sizes:
        yield slice(start, start + n)
        start += n


# ---------------------------------------------------------------- the cache itself


def test_append_writes_in_place_and_exposes_views(rng):
    cache = attn.KVCache(2, 3, max_len=10, head_dim=4, value_dim=5, dtype=np.float64)
    assert len(cache) == 0 and cache.free == 10
    assert cache.k_buffer.shape == (2, 3, 10, 4) and cache.v_buffer.shape == (2, 3, 10, 5)
    k1, v1 = rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 6, 5))
    k2, v2 = rng.standard_normal((2, 3, 1, 4)), rng.standard_normal((2, 3, 1, 5))
    cache.append(k1, v1)
    k, v = cache.append(k2, v2)
    assert len(cache) == 7 and cache.free == 3
    assert k.shape == (2, 3, 7, 4) and v.shape == (2, 3, 7, 5)
    assert np.shares_memory(k, cache.k_buffer) and np.shares_memory(v, cache.v_buffer)
    assert k.base is not None and v.base is not None  # views, not copies
    assert np.array_equal(k, np.concatenate([k1, k2], axis=-2))
    assert np.array_equal(v, np.concatenate([v1, v2], axis=-2))
    assert np.array_equal(cache.k, k) and np.array_equal(cache.v, v)


def test_unbatched_and_multi_dim_batch(rng):
    cache = attn.KVCache((), 2, max_len=4, head_dim=3)
    k, _ = cache.append(*(rng.standard_normal((2, 2, 3)).astype(np.float32) for _ in range(2)))
    assert k.shape == (2, 2, 3) and cache.dtype == np.float32
    cache = attn.KVCache((2, 3), 1, max_len=4, head_dim=3, dtype=np.float64)
    assert cache.append(np.zeros((2, 3, 1, 4, 3)), np.zeros((2, 3, 1, 4, 3)))[0].shape == (2, 3, 1, 4, 3)


def test_reset_and_empty_append(rng):
    cache = attn.KVCache(1, 1, max_len=4, head_dim=2, dtype=np.float64)
    cache.append(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2)))
    cache.reset(1)
    assert len(cache) == 1
    k, _ = cache.append(np.full((1, 1, 2, 2), 7.0), np.full((1, 1, 2, 2), 7.0))
    assert np.array_equal(k[0, 0, :, 0], [1, 7, 7])
    assert cache.append(np.zeros((1, 1, 0, 2)), np.zeros((1, 1, 0, 2)))[0].shape == (1, 1, 3, 2)
    cache.reset()
    assert len(cache) == 0 and cache.k.shape == (1, 1, 0, 2)
    with pytest.raises(ValueError, match="length must be <= len"):
        cache.reset(1)


def test_full_cache_raises_and_writes_nothing():
    cache = attn.KVCache(1, 2, max_len=3, head_dim=2, dtype=np.float64)
    cache.append(np.ones((1, 2, 2, 2)), np.ones((1, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"KVCache is full: cannot append 2 positions to 2 of max_len=3"):
        cache.append(np.full((1, 2, 2, 2), 5.0), np.full((1, 2, 2, 2), 5.0))
    assert len(cache) == 2 and not (cache.k_buffer == 5).any()
    cache.append(np.ones((1, 2, 1, 2)), np.ones((1, 2, 1, 2)))  # exactly full is fine
    with pytest.raises(ValueError, match="full"):
        cache.append(np.ones((1, 2, 1, 2)), np.ones((1, 2, 1, 2)))


@pytest.mark.parametrize(
    "k_shape,v_shape,match",
    [
        ((2, 2, 1, 4), (1, 2, 1, 4), r"k must have shape \(1, 2, T, 4\)"),  # batch
        ((1, 3, 1, 4), (1, 3, 1, 4), r"k must have shape \(1, 2, T, 4\)"),  # heads
        ((1, 2, 1, 5), (1, 2, 1, 4), r"k must have shape"),  # head_dim
        ((1, 2, 1, 4), (1, 2, 1, 3), r"v must have shape \(1, 2, T, 4\)"),  # value_dim
        ((2, 1, 4), (2, 1, 4), r"k must have shape"),  # ndim
        ((1, 2, 2, 4), (1, 2, 1, 4), r"same number of positions"),
    ],
)
def test_wrong_shapes(k_shape, v_shape, match):
    cache = attn.KVCache(1, 2, max_len=8, head_dim=4, dtype=np.float64)
    with pytest.raises(ValueError, match=match):
        cache.append(np.zeros(k_shape), np.zeros(v_shape))
    assert len(cache) == 0


def test_wrong_dtypes():
    cache = attn.KVCache(1, 2, max_len=8, head_dim=4, dtype=np.float64)
    with pytest.raises(TypeError, match="k must have the cache's dtype float64; got shape .* float32"):
        cache.append(np.zeros((1, 2, 1, 4), np.float32), np.zeros((1, 2, 1, 4)))
    with pytest.raises(TypeError, match="v must have dtype float16, bfloat16, float32 or float64"):
        cache.append(np.zeros((1, 2, 1, 4)), np.zeros((1, 2, 1, 4), np.int64))
    assert len(cache) == 0


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((1, 0, 4, 4), {}, ValueError, "num_kv_heads must be >= 1"),
        ((1, 2, 0, 4), {}, ValueError, "max_len must be >= 1"),
        ((1, 2, 4, 4.0), {}, TypeError, "head_dim must be an int"),
        (("1", 2, 4, 4), {}, TypeError, "batch must be an int or a tuple"),
        ((1, 2, 4, 4), {"dtype": np.int32}, TypeError, "dtype must be float16, bfloat16, float32, float64 or int8"),
    ],
)
def test_constructor_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attn.KVCache(*args, **kwargs)


# ---------------------------------------------------------------- decoding = one causal call


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_decoding_matches_full_causal_call(backend, chunking, h_q, h_kv, rng):
    T, E = sum(CHUNKINGS[chunking]), 8
    q = rng.standard_normal((2, h_q, T, E))
    k, v = rng.standard_normal((2, h_kv, T, E)), rng.standard_normal((2, h_kv, T, E))
    ref = torch_sdpa(q, k, v, is_causal=True, enable_gqa=h_q != h_kv)  # one call, [2, h_q, T, E]
    cache = attn.KVCache(2, h_kv, max_len=T + 3, head_dim=E, dtype=np.float64)
    outs = []
    for s in _chunks(CHUNKINGS[chunking]):
        k_all, v_all = cache.append(k[..., s, :], v[..., s, :])
        outs.append(attn.scaled_dot_product_attention(
            q[..., s, :], k_all, v_all, is_causal="lower_right", enable_gqa=h_q != h_kv, backend=backend))
    assert_sdpa_close(np.concatenate(outs, axis=-2), ref, q, k, v, is_causal=True)


def _torch_causal_mha(x, w_q, w_k, w_v, w_o, b, h, h_kv):
    """One full causal self-attention call, in torch (float64), weights as x @ W."""
    x, w_q, w_k, w_v, w_o = (torch.from_numpy(a) for a in (x, w_q, w_k, w_v, w_o))
    b_q, b_k, b_v, b_o = (torch.from_numpy(a) for a in b)
    n, t = x.shape[0], x.shape[1]
    heads = lambda y, n_head: y.view(n, t, n_head, -1).transpose(1, 2)  # -> [N, n_head, T, d]
    with torch.no_grad():
        o = torch.nn.functional.scaled_dot_product_attention(
            heads(x @ w_q + b_q, h), heads(x @ w_k + b_k, h_kv), heads(x @ w_v + b_v, h_kv),
            is_causal=True, enable_gqa=h != h_kv)
        return (o.transpose(1, 2).reshape(n, t, -1) @ w_o + b_o).numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_multi_head_decoding_matches_full_causal_call(backend, chunking, h_q, h_kv, rng):
    T, d_model, d = sum(CHUNKINGS[chunking]), 16, 4
    x = rng.standard_normal((2, T, d_model))
    w_q = rng.standard_normal((d_model, h_q * d)) / 4
    w_k, w_v = (rng.standard_normal((d_model, h_kv * d)) / 4 for _ in range(2))
    w_o = rng.standard_normal((h_q * d, d_model)) / 4
    b = [rng.standard_normal(n) for n in (h_q * d, h_kv * d, h_kv * d, d_model)]
    ref = _torch_causal_mha(x, w_q, w_k, w_v, w_o, b, h_q, h_kv)
    cache = attn.KVCache(2, h_kv, max_len=T, head_dim=d, dtype=np.float64)
    outs = []
    for s in _chunks(CHUNKINGS[chunking]):
        outs.append(attn.multi_head_attention(
            x[:, s], x[:, s], x[:, s], w_q, w_k, w_v, w_o, h_q, h_kv, b_q=b[0], b_k=b[1], b_v=b[2], b_o=b[3],
            is_causal="lower_right", kv_cache=cache, backend=backend))
    assert len(cache) == T
    bound = mha_error(x, x, x, w_q, w_k, w_v, w_o, h_q, h_kv, b_q=b[0], b_k=b[1], b_v=b[2], b_o=b[3],
                      is_causal=True)
    assert_within(np.concatenate(outs, axis=1), ref, 2 * bound)


def test_decoding_float32_close_to_float64(rng):
    T, h, d = 20, 4, 8
    q, k, v = (rng.standard_normal((1, h, T, d)) for _ in range(3))
    ref = torch_sdpa(q, k, v, is_causal=True)
    cache = attn.KVCache(1, h, max_len=T, head_dim=d)  # float32 by default
    outs = []
    for t in range(T):
        step = slice(t, t + 1)
        k_all, v_all = cache.append(k[..., step, :].astype(np.float32), v[..., step, :].astype(np.float32))
        outs.append(attn.scaled_dot_product_attention(q[..., step, :].astype(np.float32), k_all, v_all,
                                                      is_causal="lower_right"))
    out = np.concatenate(outs, axis=-2)
    assert out.dtype == np.float32
    # float32 on the rounded inputs vs float64 on the originals: the casts are input errors
    dq, dk, dv = (unit_roundoff(np.float32) * np.abs(a) for a in (q, k, v))
    assert_sdpa_close(out, ref, q, k, v, is_causal=True, dq=dq, dk=dk, dv=dv)


# ---------------------------------------------------------------- the cache in multi_head_attention


def _weights(rng, d_model=8, h=2, h_kv=2, d=4):
    return (rng.standard_normal((d_model, h * d)), rng.standard_normal((d_model, h_kv * d)),
            rng.standard_normal((d_model, h_kv * d)), rng.standard_normal((h * d, d_model)))


def test_cache_must_fit_the_call(rng):
    x = rng.standard_normal((1, 3, 8))
    w = _weights(rng)
    for cache, match in [
        (attn.KVCache(1, 2, 8, 4), r"\(batch, num_kv_heads, head_dim, value_dim, dtype\)"),  # float32
        (attn.KVCache(2, 2, 8, 4, dtype=np.float64), "kv_cache does not fit"),
        (attn.KVCache(1, 1, 8, 4, dtype=np.float64), "kv_cache does not fit"),
        (attn.KVCache(1, 2, 2, 4, dtype=np.float64), "KVCache is full"),
    ]:
        with pytest.raises(ValueError, match=match):
            attn.multi_head_attention(x, x, x, *w, 2, kv_cache=cache)
        assert len(cache) == 0
    with pytest.raises(TypeError, match="kv_cache must be an attn.KVCache"):
        attn.multi_head_attention(x, x, x, *w, 2, kv_cache={})


def test_cache_needs_lower_right_after_prefill(rng):
    x = rng.standard_normal((1, 3, 8))
    w = _weights(rng)
    cache = attn.KVCache(1, 2, 8, 4, dtype=np.float64)
    attn.multi_head_attention(x, x, x, *w, 2, is_causal=True, kv_cache=cache)  # empty cache: same alignment
    with pytest.raises(ValueError, match="use is_causal='lower_right'"):
        attn.multi_head_attention(x[:, :1], x[:, :1], x[:, :1], *w, 2, is_causal=True, kv_cache=cache)
    assert len(cache) == 3


def test_cache_unchanged_when_attention_fails(rng):
    x = rng.standard_normal((1, 3, 8))
    w = _weights(rng)
    cache = attn.KVCache(1, 2, 8, 4, dtype=np.float64)
    with pytest.raises(ValueError, match="attn_mask with shape"):
        attn.multi_head_attention(x, x, x, *w, 2, attn_mask=np.ones((3, 5), bool), kv_cache=cache)
    assert len(cache) == 0
