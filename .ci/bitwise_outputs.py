"""A representative set of attn's outputs, saved or compared byte for byte: the check that a
refactoring leaves results bitwise unchanged (issue 34's "before/after" comparison).

Usage (from a build of each revision, e.g. two worktrees on PYTHONPATH):
    python .ci/bitwise_outputs.py save before.npz     # at the old revision
    python .ci/bitwise_outputs.py check before.npz    # at the new one: prints which outputs differ
Set ATTN_SIMD to compare another SIMD path.
"""
import sys, numpy as np, ml_dtypes
import attn
from attn import flash

rng = np.random.default_rng(0)
def r(*s, dt=np.float32): return rng.standard_normal(s).astype(dt)
res = {}
q, k, v = r(2, 3, 37, 64), r(2, 3, 53, 64), r(2, 3, 53, 48)
res["dense"] = attn.scaled_dot_product_attention(q, k, v)
m = rng.random((37, 53)) < 0.8
res["boolmask"] = attn.scaled_dot_product_attention(q, k, v, attn_mask=m)
fm = np.where(m, rng.standard_normal((37, 53)), -np.inf).astype(np.float32)
res["floatmask"] = attn.scaled_dot_product_attention(q, k, v, attn_mask=fm)
res["padmask"] = attn.scaled_dot_product_attention(q, k, v, attn_mask=(rng.random((2, 1, 1, 53)) < .7))
res["causal"] = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
qd, kd = r(1, 9, 1, 64), r(1, 3, 64, 64)
res["gqa_decode"] = attn.scaled_dot_product_attention(qd, kd, kd, enable_gqa=True)
res["gqa_decode_long"] = attn.scaled_dot_product_attention(r(1, 8, 1, 64), r(1, 2, 3000, 64), r(1, 2, 3000, 64), enable_gqa=True)
out = attn.scaled_dot_product_attention(q, k, v, window=(5, 3), softcap=30.0, alibi_slopes=np.array([.5, .25, .125]), sinks=np.array([0.1, -1, 2.0]))
res["variants"] = out
q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
res["f64"] = attn.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
res["f16kv"] = attn.scaled_dot_product_attention(q, k.astype(np.float16), v.astype(np.float16))
bq, bk, bv = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
res["bf16"] = attn.scaled_dot_product_attention(bq, bk, bv).astype(np.float32)
k8, v8 = attn.Q8Tensor.quantize(k), attn.Q8Tensor.quantize(v)
res["int8"] = attn.scaled_dot_product_attention(q, k8, v8)
res["int8_decode"] = attn.scaled_dot_product_attention(q[:, :, :1], k8, v8)
o, w = attn.scaled_dot_product_attention(q, k, v, return_weights=True, attn_mask=m)
res["weights_o"], res["weights_w"] = o, w
cq = np.array([0, 5, 5, 17], np.int32); ck = np.array([0, 9, 20, 31], np.int32)
vq, vk, vv = r(17, 4, 32), r(31, 2, 32), r(31, 2, 32)
res["varlen"] = attn.varlen_attention(vq, vk, vv, cq, ck, is_causal=True)
out, bw = attn.scaled_dot_product_attention_vjp(q, k, v, attn_mask=fm, window=(4, 2))
g = bw(r(*out.shape))
for i, x in enumerate(g):
    if x is not None: res[f"vjp{i}"] = x
out, bw = attn.varlen_attention_vjp(vq, vk, vv, cq, ck, is_causal=True)
for i, x in enumerate(bw(r(*out.shape))):
    if x is not None: res[f"vvjp{i}"] = x
res["softmax"] = attn.masked_softmax(r(7, 33), mask=rng.random((7, 33)) < .6)
# flash API, paged
kc = r(6, 16, 2, 32); vc = r(6, 16, 2, 32); bt = np.array([[0, 3, 5], [1, 2, 4]], np.int32)
fq = r(2, 1, 4, 32)
res["flash_paged"] = flash.flash_attn_with_kvcache(fq, kc, vc, cache_seqlens=np.array([40, 21], np.int32), block_table=bt, causal=True)
res["flash_func"] = flash.flash_attn_func(r(2, 20, 4, 32), r(2, 20, 2, 32), r(2, 20, 2, 32), causal=True)
mode, path = sys.argv[1], sys.argv[2]
res = {k: np.asarray(v) for k, v in res.items()}
if mode == "save":
    np.savez(path, **res); print(len(res), "saved")
else:
    ref = np.load(path); bad = [k for k in res if not np.array_equal(ref[k], res[k], equal_nan=True) or ref[k].dtype != res[k].dtype]
    print(len(res), "compared; differ:", bad or "none")
