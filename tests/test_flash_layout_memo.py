"""flash_attn_varlen_func over pages: the kernel calls of a repeated layout are derived once
(attn/flash/_layout_memo.py), as every layer of a decode step repeats it.

Each call is checked against torch float64 over that call's own values, within float32's rounding
bound (tests/_bounds.py), so a call that ran another call's layout or values fails. The memo must
also never skip a check: index arrays changed in place, bad arguments and a missing extension after
a hit each take the full path.
"""

import gc
import weakref

import numpy as np
import pytest

import attn
from attn.flash import _layout_memo, flash_attn_varlen_func

from _bounds import assert_within
from test_flash import gather, paged_pool, seq_bound, seq_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

# (query dtype, cache dtype): a float32, float16, bfloat16 model over its own cache; float32 over e4m3fn
CASES = {"float32": (np.float32, np.float32), "float16": (np.float16, np.float16), "bfloat16": (BF16, BF16),
         "e4m3fn": (np.float32, E4M3)}
# (query rows, keys) of each sequence: decode rows only; vLLM's mixed steps (decode rows first,
# then prefill chunks: the calls write the output in place); prefill chunks first (cache_forward's
# path, not the calls': the memo keeps that the layout takes it)
BATCHES = {"decode": ([1, 1, 1, 1], [37, 300, 5, 129]), "mixed": ([1, 1, 9, 4], [200, 3, 40, 77]),
           "chunks first": ([6, 1, 1], [6, 90, 17])}
H, H_KV, E, PAGE = 6, 2, 64, 16


def _batch(rng, case, batch):
    q_dtype, kv_dtype = CASES[case]
    q_len, k_len = BATCHES[batch]
    k, v, table = paged_pool(rng, k_len, PAGE, H_KV, E, E, np.float32)
    k, v = (3 * k).astype(kv_dtype), (3 * v).astype(kv_dtype)
    cu_q = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), H, E)).astype(q_dtype)
    return q, k, v, cu_q, cu_k, table


def _check(out, q, k, v, cu_q, cu_k, table, what):
    """Each sequence of ``out`` within float32's rounding bound (stored in q's dtype) of torch float64."""
    assert out.dtype == q.dtype and out.shape == q.shape[:2] + (v.shape[-1],)
    for s in range(len(cu_q) - 1):
        n = int(cu_k[s + 1] - cu_k[s])
        ks, vs = (gather(x, table[s], n).astype(np.float64) for x in (k, v))
        qs = q[cu_q[s]:cu_q[s + 1]]
        ref = seq_reference(qs, ks, vs, causal=True)["out"]
        bound = seq_bound(qs, ks, vs, ref, dtype=q.dtype, causal=True)
        assert_within(out[cu_q[s]:cu_q[s + 1]], ref, bound, f"{what}, sequence {s}")


def _call(q, k, v, cu_q, cu_k, table, **kw):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(np.diff(cu_q).max()), int(np.diff(cu_k).max()),
                                  causal=True, block_table=table, **kw)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("case", list(CASES))
def test_a_repeated_layout_computes_each_calls_values(case, batch, rng, monkeypatch):
    """Three calls of one layout (the index arrays the same objects, q, k, v new values each time, as
    a step's layers): each within the bound of its own values, and the bits of the full path."""
    q, k, v, cu_q, cu_k, table = _batch(rng, case, batch)
    for call in range(3):
        q = rng.standard_normal(q.shape).astype(q.dtype)
        k, v = ((3 * rng.standard_normal(x.shape)).astype(x.dtype) for x in (k, v))
        out = _call(q, k, v, cu_q, cu_k, table)
        _check(out, q, k, v, cu_q, cu_k, table, f"{case} {batch} call {call}")
        entry = _layout_memo.calls_of(_layout_memo.key(q, k, v, cu_q, cu_k, int(np.diff(cu_q).max()),
                                                       int(np.diff(cu_k).max()), None, True, None, 0.0, table, None))
        assert (entry is False) == (batch == "chunks first"), entry
        with monkeypatch.context() as m:
            m.setattr(_layout_memo, "key", lambda *args: None)
            full = _call(q, k, v, cu_q, cu_k, table)
        np.testing.assert_array_equal(out.view(np.uint8), full.view(np.uint8))


def test_a_packed_float8_cache_repeated(rng):
    """A packed e4m3fn k, v (no block_table: read in place as one cache row) called twice with new values."""
    q_len, k_len = [1, 5, 1], [70, 12, 33]
    cu_q, cu_k = np.cumsum([0] + q_len), np.cumsum([0] + k_len)
    for call in range(2):
        q = rng.standard_normal((sum(q_len), H, E)).astype(np.float32)
        k, v = ((3 * rng.standard_normal((sum(k_len), H_KV, E))).astype(E4M3) for _ in range(2))
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 70, causal=True)
        for s in range(len(q_len)):
            ks, vs = (x[cu_k[s]:cu_k[s + 1]].astype(np.float64) for x in (k, v))
            qs = q[cu_q[s]:cu_q[s + 1]]
            ref = seq_reference(qs, ks, vs, causal=True)["out"]
            assert_within(out[cu_q[s]:cu_q[s + 1]], ref, seq_bound(qs, ks, vs, ref, dtype=np.float32, causal=True),
                          f"call {call}, sequence {s}")


def test_index_arrays_changed_in_place_are_read_again(rng):
    """The same cu_seqlens_k and block_table objects, changed in place between calls (a sequence one key
    longer into a fresh page, another moved to other pages): the new layout, not the remembered one."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    _check(_call(q, k, v, cu_q, cu_k, table), q, k, v, cu_q, cu_k, table, "before")
    spare = np.setdiff1d(np.arange(k.shape[0]), table[table >= 0])
    assert spare.size >= 1
    cu_k[1:] += 1  # sequence 0: 38 keys, in the pages it has
    table[2, 0] = spare[0]  # sequence 2 (5 keys) reads another page
    _check(_call(q, k, v, cu_q, cu_k, table), q, k, v, cu_q, cu_k, table, "after")


def test_bad_arguments_after_a_hit_still_raise(rng):
    """After the layout is remembered, a call that differs in what the checks read raises as a first call does."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    for _ in range(2):
        _call(q, k, v, cu_q, cu_k, table)
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 300, causal=1, block_table=table)
    for _ in range(2):
        _call(q, k, v, cu_q, cu_k, table, window_size=(5, 0))
    with pytest.raises(TypeError, match=r"window\[0\] \(left\) must be an int"):
        _call(q, k, v, cu_q, cu_k, table, window_size=(5.0, 0))
    with pytest.raises(ValueError, match="max_seqlen_k=299 is less than the longest sequence"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 299, causal=True, block_table=table)
    bad = table.copy()
    bad[1, 3] = k.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 3\] = .* is not a page of the cache"):
        _call(q, k, v, cu_q, cu_k, bad)
    with pytest.raises(TypeError):
        _call(q.astype(np.float64), k, v, cu_q, cu_k, table)
    with pytest.raises(ValueError):
        _call(q, k[..., :32], v[..., :32], cu_q, cu_k, table)


def test_the_memo_keeps_no_callers_array(rng):
    """Once a call returns, nothing it was given is kept alive (the memo holds copies of the index arrays)."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "mixed")
    _call(q, k, v, cu_q, cu_k, table)
    _call(q, k, v, cu_q, cu_k, table)
    refs = [weakref.ref(x) for x in (q, k, v, cu_q, cu_k, table)]
    del q, k, v, cu_q, cu_k, table
    gc.collect()
    assert [r() is None for r in refs] == [True] * 6


def test_without_the_kernels_after_a_hit_the_pages_are_gathered(rng, monkeypatch):
    """A remembered layout whose kernels then become unavailable: gathered pages and NumPy's reference."""
    from attn._backends import fused

    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    for _ in range(2):
        _call(q, k, v, cu_q, cu_k, table)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused backend ran without its extension")

    monkeypatch.setattr(attn._build, "HAVE_CYTHON", False)
    monkeypatch.setattr(fused, "run_cache_calls", refuse)
    monkeypatch.setattr(fused, "cache_forward", refuse)
    _check(_call(q, k, v, cu_q, cu_k, table), q, k, v, cu_q, cu_k, table, "gathered")


def test_thread_count_is_part_of_the_layout(rng):
    """attn.set_num_threads between two calls of one layout: the second runs with the new count and gives
    the same bits (results do not depend on the thread count)."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "bfloat16", "mixed")
    first = _call(q, k, v, cu_q, cu_k, table)
    attn.set_num_threads(1)
    try:
        one = _call(q, k, v, cu_q, cu_k, table)
        entry = _layout_memo.calls_of(_layout_memo.key(q, k, v, cu_q, cu_k, 9, 200, None, True, None, 0.0, table,
                                                       None))
        assert entry and all(c[4]["num_threads"] == 1 for c in entry[1])
    finally:
        attn.set_num_threads(None)
    np.testing.assert_array_equal(first.view(np.uint16), one.view(np.uint16))


def test_non_native_arrays_repeated(rng):
    """Big-endian q, k and v (the full path converts them to native floats before deriving its calls):
    each repeat within the bound of its own values, not the kernel reading big-endian bytes."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "mixed")
    for call in range(3):
        qb, kb, vb = (x.astype(">f4") for x in (q * (call + 1), k, v))
        out = _call(qb, kb, vb, cu_q, cu_k, table)
        _check(out.astype(np.float32), q * (call + 1), k, v, cu_q, cu_k, table, f"big-endian call {call}")


@pytest.mark.parametrize("shape", ["no heads", "headdim 0"])
def test_calls_that_run_no_kernel_repeated(shape, rng):
    """No query head, or a head size of 0 (values of 8): q holds no element, and the full path answers
    without the kernel (an empty output, or zeros); every repeat answers as the first call did."""
    E, Ev, page = (16 if shape == "no heads" else 0), 8, 4
    H = 0 if shape == "no heads" else 4
    k, v, table = paged_pool(rng, [5, 9], page, H_KV, E, Ev, np.float32)
    cu_q, cu_k = np.array([0, 1, 2], np.int32), np.array([0, 5, 14], np.int32)
    q = np.zeros((2, H, E), np.float32)
    first = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 9, causal=True, block_table=table)
    again = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 9, causal=True, block_table=table)
    assert first.shape == again.shape == (2, H, Ev)
    np.testing.assert_array_equal(again, first)


def test_alternating_layouts_are_both_kept(rng):
    """A model whose layers alternate two layouts (a sliding window, then none) derives each once."""
    q, k, v, cu_q, cu_k, table = _batch(rng, "float32", "decode")
    keys = []
    for window in ((64, 0), (-1, -1)) * 2:
        out = _call(q, k, v, cu_q, cu_k, table, window_size=window)
        keys.append(_layout_memo.key(q, k, v, cu_q, cu_k, 1, 300, None, True,
                                     None if window == (-1, -1) else window, 0.0, table, None))
    assert all(_layout_memo.calls_of(key) for key in keys)
    for s in range(len(cu_q) - 1):   # the last call's (no window) result
        n = int(cu_k[s + 1] - cu_k[s])
        ks, vs = (gather(x, table[s], n).astype(np.float64) for x in (k, v))
        ref = seq_reference(q[s:s + 1], ks, vs, causal=True)["out"]
        assert_within(out[s:s + 1], ref, seq_bound(q[s:s + 1], ks, vs, ref, dtype=np.float32, causal=True), f"{s}")
