"""attn against PyTorch in float64: single head vs SDPA, multi-head vs nn.MultiheadAttention.

Multi-head attention is built from :func:`attn.scaled_dot_product_attention`
the paper's way (project, split d_model into h heads, attend, concatenate,
project) and compared with ``torch.nn.MultiheadAttention`` holding the same
weights: ``in_proj_weight = [WQ^T; WK^T; WV^T]``, ``out_proj.weight = WO^T``
(torch multiplies by the transposed weight).
"""

from dataclasses import dataclass

import numpy as np

from attn._api import scaled_dot_product_attention
from ._common import SEED, five_tokens, max_abs_diff

BACKENDS = ("loop", "numpy", "online", "cython")
D_MODEL = 16
N_HEADS = 4


@dataclass
class ParityResult:
    """Max abs differences to torch, per attn backend (keys: "loop", "numpy", "online", "cython")."""

    single_head: dict  # vs F.scaled_dot_product_attention, no mask
    single_head_causal: dict  # is_causal=True on both sides
    multi_head: dict  # vs nn.MultiheadAttention, no mask
    multi_head_causal: dict  # attn is_causal=True vs MHA attn_mask = triu(k=1) (True = masked)
    torch_version: str


def multi_head_attention(x, wq, wk, wv, wo, h, causal=False, backend="auto"):
    """The paper's multi-head self-attention with attn's SDPA per head.

    Parameters
    ----------
    x : ndarray, shape [T, d_model]
    wq, wk, wv, wo : ndarray, shape [d_model, d_model]
        ``q = x @ wq`` etc.; ``out = concat(heads) @ wo``.
    h : int
        Heads; head i uses columns ``i * d_k .. (i + 1) * d_k - 1``, ``d_k = d_model // h``.

    Returns
    -------
    ndarray, shape [T, d_model]
    """
    t, d_model = x.shape
    d_k = d_model // h

    def split(a):
        return a.reshape(t, h, d_k).transpose(1, 0, 2)  # [T, d_model] -> [h, T, d_k]

    heads = scaled_dot_product_attention(
        split(x @ wq), split(x @ wk), split(x @ wv), is_causal=causal, backend=backend
    )  # [h, T, d_k]
    return heads.transpose(1, 0, 2).reshape(t, d_model) @ wo  # [h, T, d_k] -> [T, d_model]


def mha_weights(seed=SEED, t=5, d_model=D_MODEL):
    """x [T, d_model] and WQ, WK, WV, WO [d_model, d_model] ~ N(0, 1/d_model), float64."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, d_model))
    w = rng.normal(size=(4, d_model, d_model)) / np.sqrt(d_model)  # WQ, WK, WV, WO
    return x, w[0], w[1], w[2], w[3]


def torch_mha(torch, x, wq, wk, wv, wo, h, causal=False):
    """``nn.MultiheadAttention(bias=False)`` with the given weights copied in; [T, d_model]."""
    d_model = x.shape[1]
    mha = torch.nn.MultiheadAttention(d_model, h, bias=False, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(np.concatenate([wq.T, wk.T, wv.T])))  # [3 d_model, d_model]
        mha.out_proj.weight.copy_(torch.from_numpy(wo.T))
        mask = torch.triu(torch.ones(len(x), len(x), dtype=torch.bool), 1) if causal else None
        tx = torch.from_numpy(x)  # unbatched [T, d_model]
        out, _ = mha(tx, tx, tx, attn_mask=mask, need_weights=False)  # MHA: True = masked
    return out.numpy()


def _torch_sdpa(torch, q, k, v, causal):
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), is_causal=causal).numpy()


def run(backends=BACKENDS):
    """All four comparisons for every backend. Raises ImportError without torch."""
    import torch

    q, k, v = five_tokens()
    x, wq, wk, wv, wo = mha_weights()
    result = ParityResult({}, {}, {}, {}, torch.__version__)
    for causal, single, multi in ((False, result.single_head, result.multi_head),
                                  (True, result.single_head_causal, result.multi_head_causal)):
        ref_single = _torch_sdpa(torch, q, k, v, causal)
        ref_multi = torch_mha(torch, x, wq, wk, wv, wo, N_HEADS, causal)
        for b in backends:
            single[b] = max_abs_diff(scaled_dot_product_attention(q, k, v, is_causal=causal, backend=b), ref_single)
            multi[b] = max_abs_diff(multi_head_attention(x, wq, wk, wv, wo, N_HEADS, causal, b), ref_multi)
    return result


def report(result):
    """The differences as a table, full precision."""
    rows = [
        ("single head (5 x 4) vs F.scaled_dot_product_attention", result.single_head),
        ("single head, causal", result.single_head_causal),
        (f"multi-head (T=5, d_model={D_MODEL}, h={N_HEADS}) vs nn.MultiheadAttention", result.multi_head),
        ("multi-head, causal (MHA attn_mask = triu, True = masked)", result.multi_head_causal),
    ]
    lines = [f"float64, torch {result.torch_version}; max |attn - torch| per attn backend"]
    for label, diffs in rows:
        lines.append(label)
        lines += [f"  {b:<6} {d!r}" for b, d in diffs.items()]
    return "\n".join(lines)
