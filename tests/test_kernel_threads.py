"""What the kernels' parallel regions run after the work items waits for every item.

attn/_kernels_testing.delay_items holds the items of the region's other threads (or its
first thread's) for milliseconds while the rest run at once, so the thread that finishes
first reaches what follows the items while another thread still holds one:

* the split-key decode's merge, which reads every key chunk's partial state;
* a mixed batch's decode rows and prefill chunks run overlapped
  (attn._kernels.attention_overlapped), and the decode's merge after both;
* the backward's key and query blocks, which read what its packing wrote.

Each reads state another thread writes, so it must wait for every item (attn_omp_barrier;
GCC's OpenMP also puts a barrier at the start of each of Cython's loops there). The state
is kept from call to call (attn_kept), so a call over other values of the same shape runs
first: a read too early would find that call's state, and the results would differ from
the one-thread call's bits and from torch's float64.
"""

import contextlib

import numpy as np
import pytest

import attn
import attn.flash
from attn._build import HAVE_CYTHON

from _bounds import assert_sdpa_close
from conftest import torch_sdpa64

pytestmark = pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")


@contextlib.contextmanager
def delayed_items(first_us, others_us):
    from attn import _kernels, _kernels_testing

    if not _kernels.build_info()["openmp"]:
        pytest.skip("a serial build has no parallel region")
    _kernels_testing.delay_items(first_us, others_us)
    try:
        yield
    finally:
        _kernels_testing.delay_items(0, 0)


def test_delay_items_refuses_negative_delays():
    from attn import _kernels_testing

    with pytest.raises(ValueError, match="delays must be >= 0"):
        _kernels_testing.delay_items(-1, 0)


def test_split_key_merge_waits_for_every_chunk(rng):
    """One decode row over 16k keys: one unit in 64 key chunks, merged by the first thread,
    which runs its items at once while the other holds each of its own 5 ms."""
    q = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)  # [B, H, L, E]
    k = rng.standard_normal((1, 1, 16384, 64)).astype(np.float32)
    v = rng.standard_normal((1, 1, 16384, 64)).astype(np.float32)
    one = attn.scaled_dot_product_attention(q, k, v, backend="cython", num_threads=1)
    attn.scaled_dot_product_attention(-q, v, k, backend="cython", num_threads=2)  # (other kept states)
    with delayed_items(0, 5000):
        two = attn.scaled_dot_product_attention(q, k, v, backend="cython", num_threads=2)
    assert_sdpa_close(two, torch_sdpa64(q, k, v), q, k, v)
    assert np.array_equal(two, one)


def _mixed_batch(rng, page=64, context=16384, chunk=32, E=64):
    """One decode row over ``context`` keys, then one prefill chunk of ``chunk`` causal rows,
    in pages of ``page`` keys (FlashAttention's [num_blocks, page, H_kv, E]), shuffled."""
    n_pages = [context // page, -(-chunk // page)]
    pool = rng.permutation(sum(n_pages))
    table = np.zeros((2, max(n_pages)), np.int32)
    table[0, :n_pages[0]], table[1, :n_pages[1]] = pool[:n_pages[0]], pool[n_pages[0]:]
    k_pages = rng.standard_normal((len(pool), page, 1, E)).astype(np.float32)
    v_pages = rng.standard_normal((len(pool), page, 1, E)).astype(np.float32)
    q = rng.standard_normal((1 + chunk, 1, E)).astype(np.float32)  # [total_q, H, E]
    return q, k_pages, v_pages, table, [(1, context), (chunk, chunk)]


def _keys_of(pages, table_row, n):
    """The n keys a sequence reads: [1, 1, n, E]."""
    return pages[table_row].reshape(-1, pages.shape[-1])[:n][None, None]


def test_overlapped_mixed_batch_waits_for_both_calls(rng):
    """The decode row's chunks (64 of them, merged by the first thread) and the prefill chunk
    in one region: the other thread takes the prefill item, then decode chunks, each held 5 ms.
    The same bits as each sequence alone, on the first call and on the second (the remembered
    layout's calls)."""
    q, k_pages, v_pages, table, seqs = _mixed_batch(rng)
    cu_q = np.array([0, 1, 1 + seqs[1][0]], np.int32)
    cu_k = np.array([0, seqs[0][1], seqs[0][1] + seqs[1][1]], np.int32)

    def call(q, cu_q, cu_k, table, threads):
        return attn.flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, int(np.diff(cu_q).max()),
                                                 int(np.diff(cu_k).max()), causal=True, block_table=table,
                                                 num_threads=threads)

    alone = [call(q[:1], cu_q[:2], cu_k[:2], table[:1], 1),
             call(q[1:], np.array([0, seqs[1][0]], np.int32), np.array([0, seqs[1][1]], np.int32), table[1:], 1)]
    together = []
    for _ in range(2):
        call(-q, cu_q, cu_k, table, 2)   # (other kept states)
        with delayed_items(0, 5000):
            together.append(call(q, cu_q, cu_k, table, 2))
    for out in together:
        assert np.array_equal(out[:1], alone[0])
        assert np.array_equal(out[1:], alone[1])
    for s, ((L, S), rows) in enumerate(zip(seqs, (slice(0, 1), slice(1, None)))):
        qs = q[rows].transpose(1, 0, 2)[None]  # [L, H, E] -> [1, H, L, E]
        ks, vs = _keys_of(k_pages, table[s], S), _keys_of(v_pages, table[s], S)
        ref = torch_sdpa64(qs, ks, vs, attn_mask=np.tril(np.ones((L, S), bool), S - L))
        assert_sdpa_close(together[0][rows].transpose(1, 0, 2)[None], ref, qs, ks, vs)


def test_backward_blocks_wait_for_the_packing(rng):
    """One matrix on two threads: the first thread packs it after 5 ms while the other starts
    on its key blocks at once."""
    from test_backward import assert_close64, torch_grads

    q, k, v = (rng.standard_normal((1, 300, 64)) for _ in range(3))
    g = rng.standard_normal((1, 300, 64))
    one = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True, backend="cython", num_threads=1)[1](g)
    attn.scaled_dot_product_attention_vjp(v, k, q, backend="cython", num_threads=2)[1](-g)  # (other kept work)
    with delayed_items(5000, 0):
        two = attn.scaled_dot_product_attention_vjp(q, k, v, is_causal=True, backend="cython",
                                                    num_threads=2)[1](g)
    ref = torch_grads(q, k, v, g, None, True)[1:]
    floor = np.max(np.abs(g)) * np.max(np.abs(v)) * max(np.max(np.abs(q)), np.max(np.abs(k)))
    for name, a, b, r in zip(("dq", "dk", "dv"), two, one, ref):
        assert np.array_equal(a, b), name
        assert_close64(a, r, name, floor)
