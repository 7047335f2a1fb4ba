"""What each precision of the KV cache costs in accuracy: one decode step, measured against float64.

A Llama-3.2-1B-shaped decode step (32 query heads over 8 key/value heads, one
query row, a cache of 4096 positions, head sizes 64 and 128) with random
normal queries, keys and values. The reference is float64 attention over the
float64 keys and values; each row stores the same keys and values in one
cache dtype and runs attn's fused kernel over it (float32 queries, float32
compute). For the int8 (q8_0) cache the documented bound of what quantizing
moves each output (:func:`attn._quantized.attention_error`) is printed too.
"""

from dataclasses import dataclass

import numpy as np

from attn import _dtypes
from attn._api import scaled_dot_product_attention
from attn._build import _kernels
from attn._quantized import Q8Tensor, attention_error

SEED = 20261201
SHAPES = ((32, 8, 4096, 64), (32, 8, 4096, 128))  # query heads, key/value heads, S, E
CACHES = ("float32", "float16", "bfloat16", "int8")


@dataclass
class PrecisionRow:
    cache: str
    heads: tuple  # (query heads, key/value heads)
    n_keys: int
    head_dim: int
    bytes_per_value: float  # of the cache, scales included
    max_error: float  # max |attn - float64| over the outputs
    mean_error: float
    bound_max: float = float("nan")  # int8: the largest bound of attention_error (plus nothing for rounding)


def _cache(k, dtype):
    if dtype == "int8":
        return Q8Tensor.quantize(k)
    return k.astype(_dtypes.as_dtype(dtype))


def run():
    """One :class:`PrecisionRow` per (shape, cache dtype)."""
    rows = []
    rng = np.random.default_rng(SEED)
    for hq, hkv, s, e in SHAPES:
        q = rng.standard_normal((1, hq, 1, e)).astype(np.float32)  # [B, Hq, 1, E]
        k = rng.standard_normal((1, hkv, s, e))  # [B, Hkv, S, E]
        v = rng.standard_normal((1, hkv, s, e))
        group = hq // hkv
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
        # the exact reference on the float32-representable inputs every cache starts from
        ref = scaled_dot_product_attention(q.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                                           enable_gqa=True, backend="numpy")
        for dtype in CACHES:
            kc, vc = _cache(k32, dtype), _cache(v32, dtype)
            out = scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            err = np.abs(out.astype(np.float64) - ref)
            bound = float("nan")
            if dtype == "int8":  # GQA: each query head over its key/value head, [B, Hkv, group, E]
                qg = q.reshape(1, hkv, group, e)  # [B, Hq, 1, E] -> [B, Hkv, group, E]
                rounded = _kernels is not None and _kernels.q8_rounds_query(1, e)  # (the query rounded too)
                bound = float(attention_error(qg, k32, v32, query_rounded=rounded).max())
            rows.append(PrecisionRow(dtype, (hq, hkv), s, e, kc.nbytes / k32.size,
                                     float(err.max()), float(err.mean()), bound))
    return rows


def report(rows):
    lines = ["One decode step (1 query row, float32 queries) over a cache of each dtype, against float64 attention",
             "over the same keys and values; |v| ~ N(0, 1). int8: q8_0, and the documented bound of what it moves",
             "an output (attn._quantized.attention_error; the kernel's float32 rounding comes on top).",
             "",
             f"{'heads':>7} {'S':>5} {'E':>4}  {'cache':<9} {'bytes/value':>11} {'max |err|':>10} {'mean |err|':>10}"
             f" {'int8 bound':>10}"]
    for r in rows:
        bound = "" if np.isnan(r.bound_max) else f"{r.bound_max:10.2e}"
        lines.append(f"{r.heads[0]:>4}/{r.heads[1]:<2} {r.n_keys:>5} {r.head_dim:>4}  {r.cache:<9} "
                     f"{r.bytes_per_value:>11.3f} {r.max_error:>10.2e} {r.mean_error:>10.2e} {bound:>10}".rstrip())
    return "\n".join(lines)
