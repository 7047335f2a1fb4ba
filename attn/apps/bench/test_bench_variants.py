"""The variants' cost, as paired ratios (_paired.py): each against the call it replaces.

* window: w = 512 at L = S = 8192, causal, E = 64, H = 8: attn's windowed call
  against its own full causal call (the work it skips), and against torch
  SDPA given the equivalent L x S bool mask (what a model without native
  windows runs);
* softcap, ALiBi, sinks at T = 1024 (H = 8, E = 64, causal) against the plain call;
* varlen: 8 sequences of 64 ... 1024 tokens packed, against the padded batch
  [8, H, 1024, E] with a key padding mask (FlashAttention's varlen vs padding).

Each ratio is time(variant) / time(reference): below 1, the variant is faster.
Results go to the summary's paired table (``bench_results.paired``). Run:

    python -m pytest -p attn.apps.bench.plugin attn/apps/bench/test_bench_variants.py
    ATTN_BENCH_VARIANTS_SMALL=1 python -m pytest -p attn.apps.bench.plugin \
        attn/apps/bench/test_bench_variants.py --benchmark-disable    # small sizes, one block: a smoke test
"""

from __future__ import annotations

import functools
import gc
import os

import numpy as np
import pytest

from attn.apps.bench._paired import paired_ratio

SMALL = os.environ.get("ATTN_BENCH_VARIANTS_SMALL", "") not in ("", "0")
H, E = 8, 64
T_WINDOW, W = (1024, 64) if SMALL else (8192, 512)
T = 256 if SMALL else 1024
LENGTHS = np.linspace(64, 1024, 8).astype(int) // (8 if SMALL else 1)


def _attn():
    import attn

    if not attn.backends()["cython"]:
        pytest.skip("attn's Cython extension is not built")
    return attn


def _record(bench_results, group, r):
    bench_results.paired[group] = dict(r, reference=r["a"], variant=r["b"])
    print(f"\n{group}: {r['ratio']:.3f}x (middle half {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})")


def _qkv(L, S, heads=H, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, heads, L, E), dtype), rng.standard_normal((1, heads, S, E), dtype),
            rng.standard_normal((1, heads, S, E), dtype))


def _run(fa, fb, bench_settings):
    gc.collect()
    return paired_ratio(fa, fb, blocks=1 if bench_settings.disabled else None, budget=bench_settings.paired_budget)


@pytest.mark.parametrize("against", ["full causal", "torch bool mask"])
def test_window(against, bench_settings, bench_results):
    attn = _attn()
    q, k, v = _qkv(T_WINDOW, T_WINDOW)
    sdpa = functools.partial(attn.scaled_dot_product_attention, q, k, v, backend="cython")
    windowed = functools.partial(sdpa, is_causal=True, window=(W - 1, 0))
    if against == "full causal":
        reference = functools.partial(sdpa, is_causal=True)
    else:
        torch = pytest.importorskip("torch")
        i, j = np.arange(T_WINDOW)[:, None], np.arange(T_WINDOW)[None, :]
        mask = torch.from_numpy((j <= i) & (j > i - W))
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        reference = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
        with torch.inference_mode():  # the same answer (float32 rounding)
            np.testing.assert_allclose(windowed(), reference().numpy(), atol=1e-4)
    r = _run(reference, windowed, bench_settings)
    _record(bench_results, f"window w={W} T={T_WINDOW} H={H} E={E} causal / {against}", r)


@pytest.mark.parametrize("variant", ["softcap", "alibi", "sinks"])
def test_score_variants(variant, bench_settings, bench_results):
    attn = _attn()
    q, k, v = _qkv(T, T)
    plain = functools.partial(attn.scaled_dot_product_attention, q, k, v, is_causal=True, backend="cython")
    kw = {"softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=2.0 ** -np.arange(1, H + 1)),
          "sinks": dict(sinks=np.zeros(H))}[variant]
    r = _run(plain, functools.partial(plain, **kw), bench_settings)
    _record(bench_results, f"{variant} T={T} H={H} E={E} causal / plain", r)


def test_varlen(bench_settings, bench_results):
    attn = _attn()
    rng = np.random.default_rng(1)
    total, n_max = int(LENGTHS.sum()), int(LENGTHS.max())
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    q, k, v = (rng.standard_normal((total, H, E), np.float32) for _ in range(3))
    packed = functools.partial(attn.varlen_attention, q, k, v, cu, cu, is_causal=True, backend="cython")
    # the padded batch: [8, H, n_max, E], keys past each sequence masked (right padding, so the
    # causal diagonal is each sequence's own)
    pad = np.zeros((len(LENGTHS), H, n_max, E), np.float32)
    qp, kp, vp = pad.copy(), pad.copy(), pad.copy()
    for s, (a, n) in enumerate(zip(cu[:-1], LENGTHS)):
        for dst, src in ((qp, q), (kp, k), (vp, v)):
            dst[s, :, :n] = src[a:a + n].transpose(1, 0, 2)
    key_mask = (np.arange(n_max)[None, :] < LENGTHS[:, None])[:, None, None, :]  # [8, 1, 1, n_max]
    causal = np.tril(np.ones((n_max, n_max), bool))
    padded = functools.partial(attn.scaled_dot_product_attention, qp, kp, vp, attn_mask=key_mask & causal,
                               backend="cython")
    out = packed()
    ref = padded()
    for s, (a, n) in enumerate(zip(cu[:-1], LENGTHS)):  # the same answer on the real rows
        np.testing.assert_allclose(out[a:a + n], ref[s, :, :n].transpose(1, 0, 2), atol=1e-5)
    r = _run(padded, packed, bench_settings)
    _record(bench_results, f"varlen 8 seqs {LENGTHS.min()}..{LENGTHS.max()} H={H} E={E} causal / padded", r)
