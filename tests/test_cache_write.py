"""attn._cache_write.write_pages: new keys and values into a paged cache, held to NumPy's indexed assignment."""

import ml_dtypes
import numpy as np
import pytest

import attn._build

cache_write = attn._build._cache_write
pytestmark = pytest.mark.skipif(cache_write is None, reason="attn._cache_write is not built")


def _vllm_cache(rng, dtype, num_blocks=7, H_kv=3, page=16, E=8):
    """vLLM's CPU_ATTN tensor [num_blocks, H_kv, page, 2E] and its K and V pages [num_blocks, page, H_kv, E]
    (permuted views: no dimension contiguous but E)."""
    cache = rng.standard_normal((num_blocks, H_kv, page, 2 * E)).astype(dtype)
    kv = cache.transpose(0, 2, 1, 3)
    return cache, kv[..., :E], kv[..., E:]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.uint8])
@pytest.mark.parametrize("strided_new", [False, True])
def test_write_pages_is_indexed_assignment(dtype, strided_new):
    """Every token's K and V row lands at (block, row) of its pages, as NumPy's pages[block, row] = new,
    in vLLM's strided cache; rows of other tokens and the other half of each cache row untouched."""
    rng = np.random.default_rng(3)
    cache, k_pages, v_pages = _vllm_cache(rng, dtype)
    T, H_kv, E = 5, k_pages.shape[2], k_pages.shape[3]
    slots = rng.choice(k_pages.shape[0] * k_pages.shape[1], T, replace=False)
    block, row = slots // k_pages.shape[1], slots % k_pages.shape[1]
    qkv = rng.standard_normal((T + 2, 5 * H_kv, E)).astype(dtype)   # key and value: views into one tensor
    k_new, v_new = (qkv[:, H_kv:2 * H_kv], qkv[:, 2 * H_kv:3 * H_kv]) if strided_new else (
        np.ascontiguousarray(qkv[:, :H_kv]), np.ascontiguousarray(qkv[:, H_kv:2 * H_kv]))
    want = cache.copy()
    want_kv = want.transpose(0, 2, 1, 3)
    want_kv[..., :E][block, row] = k_new[:T]
    want_kv[..., E:][block, row] = v_new[:T]
    cache_write.write_pages(k_new, v_new, k_pages, v_pages, block.astype(np.int64), row.astype(np.int64))
    np.testing.assert_array_equal(cache.view(np.uint8), want.view(np.uint8))


def test_write_pages_with_strided_elements():
    """Pages whose E elements are not adjacent (a transposed view) take the element-by-element copy."""
    rng = np.random.default_rng(4)
    pages = rng.standard_normal((4, 8, 2, 6)).astype(np.float32)
    k_pages = pages[..., ::2]          # [4, 8, 2, 3], element stride 2
    v_pages = np.zeros((4, 8, 2, 3), np.float32)
    k_new = rng.standard_normal((3, 2, 6)).astype(np.float32)[..., 1::2]
    v_new = rng.standard_normal((3, 2, 3)).astype(np.float32)
    block, row = np.array([3, 0, 3]), np.array([7, 0, 1])
    want_k, want_v = k_pages.copy(), v_pages.copy()
    want_k[block, row], want_v[block, row] = k_new, v_new
    cache_write.write_pages(k_new, v_new, k_pages, v_pages, block, row)
    np.testing.assert_array_equal(k_pages, want_k)
    np.testing.assert_array_equal(v_pages, want_v)


def test_write_pages_refuses_what_does_not_fit():
    """A slot outside the pool, another dtype, shapes that do not fit, read-only pages, lengths that
    differ: clear errors, nothing written."""
    rng = np.random.default_rng(5)
    _, k_pages, v_pages = _vllm_cache(rng, np.float32)
    new = rng.standard_normal((3, 3, 8)).astype(np.float32)
    ok_block, ok_row = np.array([0, 1, 2]), np.array([0, 1, 2])
    for block, row, what in [(np.array([0, 7, 1]), ok_row, "token 1: page 7, row 1 is outside the pool of 7 pages of 16"),
                             (ok_block, np.array([0, 1, 16]), "token 2: page 2, row 16 is outside"),
                             (np.array([-1, 0, 0]), ok_row, "token 0: page -1")]:
        before = k_pages.copy(), v_pages.copy()
        with pytest.raises(ValueError, match=what):
            cache_write.write_pages(new, new, k_pages, v_pages, block, row)
        np.testing.assert_array_equal(k_pages, before[0])
        np.testing.assert_array_equal(v_pages, before[1])
    with pytest.raises(TypeError, match=r"k_new \(float64\) and k_pages \(float32\)"):
        cache_write.write_pages(new.astype(np.float64), new, k_pages, v_pages, ok_block, ok_row)
    with pytest.raises(ValueError, match=r"v_new \[T, H_kv, E\] does not fit v_pages"):
        cache_write.write_pages(new, new[:, :2], k_pages, v_pages, ok_block, ok_row)
    with pytest.raises(ValueError, match="k_new has 3 rows for 4 tokens"):
        cache_write.write_pages(new, new, k_pages, v_pages, np.zeros(4, np.int64), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="one length"):
        cache_write.write_pages(new, new, k_pages, v_pages, ok_block, ok_row[:2])
    frozen = k_pages.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="k_pages is read-only"):
        cache_write.write_pages(new, new, frozen, v_pages, ok_block, ok_row)
