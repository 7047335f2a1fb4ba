"""A Llama forward pass in NumPy, its attention computed by :func:`attn.scaled_dot_product_attention`.

picoGPT-style: the whole model is the functions below. Names follow the papers:
RMSNorm (Zhang & Sennrich 2019), rotary position embedding RoPE (Su et al. 2021),
SwiGLU feed-forward (Shazeer 2020), grouped-query attention GQA (Ainslie et al.
2023) with ``n_kv_head`` key/value heads shared by ``n_head // n_kv_head`` query
heads each. Keys and values live in one :class:`attn.KVCache` per layer; the
queries of a step are the newest positions of the cache, so the causal mask is
aligned lower-right.

Shapes: B batch, T new positions, S cached positions (including the new ones),
d = d_model, h = n_head, h_kv = n_kv_head, d_h = d_head.

Precision: the activations, the KV cache and the attention have the dtype of
``weights["dtype"]`` (float32, float64, or bfloat16/float16 as torch runs a
16-bit checkpoint). A 16-bit model computes each operation in float32 and
rounds its result once to 16 bits; its weights are 16-bit values held in
float32 (NumPy has no 16-bit matrix product), so ``x @ w.T`` is exactly a
16-bit GEMM with float32 accumulation, rounded on output.
"""

import numpy as np

import attn
from attn import _dtypes


def compute(x):
    """``x`` in the dtype operations are computed in (float32 for a 16-bit model)."""
    return x.astype(_dtypes.compute_dtype(x.dtype), copy=False)


def linear(x, w):
    """``x @ w.T`` computed in float32 for a 16-bit ``x`` and rounded to x's dtype; [..., d_in] -> [..., d_out]."""
    return (compute(x) @ w.T).astype(x.dtype, copy=False)


def rms_norm(x, g, eps):
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * g`` over the last dim; [..., d] -> [..., d]."""
    xc = compute(x)
    return (xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps) * g).astype(x.dtype, copy=False)


def silu(x):
    """SiLU (swish): ``x * sigmoid(x)`` (of x's compute dtype)."""
    return x / (1 + np.exp(-x))


def rope_angles(positions, d_head, theta, dtype):
    """cos and sin of RoPE's angles ``p * theta^(-2i/d_h)``; [B, T] -> two [B, 1, T, d_h].

    The angles are computed in float64, then rounded once to ``dtype``.
    """
    inv_freq = theta ** (-np.arange(0, d_head, 2) / d_head)  # [d_h/2]
    angles = positions[..., None].astype(np.float64) * inv_freq  # [B, T, d_h/2]
    angles = np.concatenate([angles, angles], axis=-1)[:, None]  # [B, 1, T, d_h]: one per half
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rope(x, cos, sin):
    """Rotate the pairs (i, i + d_h/2) of every head by the position's angle; [B, h, T, d_h] -> same."""
    xc, half = compute(x), x.shape[-1] // 2
    rotated = np.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)  # rotate_half
    return (xc * compute(cos) + rotated * compute(sin)).astype(x.dtype, copy=False)


def split_heads(x, n_head):
    """[B, T, n_head * d_h] -> [B, n_head, T, d_h] (a view)."""
    b, t, _ = x.shape
    return x.reshape(b, t, n_head, -1).transpose(0, 2, 1, 3)  # [B, T, h, d_h] -> [B, h, T, d_h]


def attention(x, layer, cache, cos, sin, mask, config, backend):
    """GQA self-attention of the new positions over the cache; [B, T, d] -> [B, T, d]."""
    q = rope(split_heads(linear(x, layer["w_q"]), config.n_head), cos, sin)  # [B, h, T, d_h]
    k = rope(split_heads(linear(x, layer["w_k"]), config.n_kv_head), cos, sin)  # [B, h_kv, T, d_h]
    v = split_heads(linear(x, layer["w_v"]), config.n_kv_head)  # [B, h_kv, T, d_h]
    if not cache.quantized and cache.dtype != k.dtype:  # a 16-bit cache under float32 activations
        k, v = k.astype(cache.dtype), v.astype(cache.dtype)
    k, v = cache.append(k, v)  # [B, h_kv, S, d_h] views of the cache (int8: quantized, attn.Q8Tensor)
    causal = "lower_right" if mask is None else False
    out = attn.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, backend=backend)  # [B, h, T, d_h]
    out = out.transpose(0, 2, 1, 3).reshape(x.shape)  # [B, h, T, d_h] -> [B, T, h * d_h]
    return linear(out, layer["w_o"])


def swiglu(x, layer):
    """SwiGLU feed-forward: ``(SiLU(x W_gate^T) * (x W_up^T)) W_down^T``; [B, T, d] -> [B, T, d]."""
    gate, up = compute(linear(x, layer["w_gate"])), compute(linear(x, layer["w_up"]))  # [B, T, d_ff]
    return linear((silu(gate) * up).astype(x.dtype, copy=False), layer["w_down"])


def block(x, layer, cache, cos, sin, mask, config, backend):
    """One pre-norm transformer block; [B, T, d] -> [B, T, d]."""
    x = add(x, attention(rms_norm(x, layer["g_attn"], config.norm_eps), layer, cache, cos, sin, mask, config,
                         backend))
    return add(x, swiglu(rms_norm(x, layer["g_ffn"], config.norm_eps), layer))


def add(x, y):
    """The residual ``x + y``, rounded once to x's dtype."""
    return (compute(x) + compute(y)).astype(x.dtype, copy=False)


def activation_dtype(weights):
    """The dtype of the activations and the KV cache: ``weights["dtype"]`` (else the weights')."""
    return weights.get("dtype", weights["wte"].dtype)


def new_caches(config, batch, max_len, dtype=np.float32):
    """One empty :class:`attn.KVCache` per layer, each [batch, n_kv_head, max_len, d_head]."""
    return [attn.KVCache(batch, config.n_kv_head, max_len, config.d_head, dtype=dtype)
            for _ in range(config.n_layer)]


def forward(tokens, weights, config, caches, *, positions=None, key_valid=None, last_only=False,
            backend="auto"):
    """Logits of the next token at each new position, appending the new keys/values to ``caches``.

    Parameters
    ----------
    tokens : int array, shape [B, T]
        The new tokens (the whole prompt at prefill, one token per step when decoding).
    weights : dict from :func:`attn.apps.models.gguf.read_weights`
    config : LlamaConfig
    caches : list of KVCache, one per layer, holding the S - T earlier positions (of the activations' dtype)
    positions : int array [B, T], optional
        RoPE positions; default ``len(cache) + arange(T)`` for every row.
    key_valid : bool array [B, S], optional
        False at padding positions of a left-padded batch (all S positions,
        new ones included); None: every position is real and the causal mask
        is the kernel's own lower-right one.
    last_only : bool
        Compute the logits of the last position only (what generation needs).
    backend : attn backend for the attention ("auto", "cython", "numpy", "loop")

    Returns
    -------
    logits : ndarray [B, T, n_vocab] (or [B, 1, n_vocab] with ``last_only``), of the activations' dtype
    """
    n_b, n_t = tokens.shape
    n_past = len(caches[0])
    if positions is None:
        positions = np.broadcast_to(n_past + np.arange(n_t), (n_b, n_t))
    dtype = activation_dtype(weights)
    x = weights["wte"][tokens].astype(dtype, copy=False)  # [B, T, d]
    cos, sin = rope_angles(positions, config.d_head, config.rope_theta, dtype)
    mask = None
    if key_valid is not None:  # causal (lower-right) and not padding: [B, 1, T, S]
        mask = attn.causal_allowed(n_t, n_past + n_t, n_past) & key_valid[:, None, None, :]
    for layer, cache in zip(weights["layers"], caches):
        x = block(x, layer, cache, cos, sin, mask, config, backend)
    if last_only:
        x = x[:, -1:]  # [B, 1, d]
    return linear(rms_norm(x, weights["g_final"], config.norm_eps), weights["lm_head"])  # [B, T', n_vocab]
