"""The kernel's optional log-sum-exp output, lse[b, i] = m_i + log(l_i), held to float64 NumPy.

The backward pass recomputes the weights as exp(score - lse), so lse must be
the log of the softmax denominator of the visible scaled scores (-inf for a
row that sees no key, NaN where the output row is NaN), on the row-block
path, the dot-product path and the split-key decode path (merged partials),
on every SIMD path, and bitwise independent of the thread count.
"""

import math

import numpy as np
import pytest

from attn._build import HAVE_CYTHON, _kernels

from conftest import make_qkv, random_bool_mask

pytestmark = pytest.mark.skipif(not HAVE_CYTHON, reason="compiled kernels not built")



def kernel_lse(q, k, v, mask=None, causal_offset=None, num_threads=1):
    """(out, lse) of the kernel for C-contiguous [N, L, E] q, [N, S, E] k, v and a [L, S] mask."""
    n, L, E = q.shape
    Ev = v.shape[2]
    out = np.empty((n, L, Ev), q.dtype)
    lse = np.full((n, L), 12345.0, q.dtype)  # every entry must be overwritten
    offsets = lambda a: np.arange(n, dtype=np.int64) * a.shape[1] * a.shape[2]
    m_off, m_strides = np.zeros(0, np.int64), (0, 0)
    if mask is not None:
        m_off, m_strides = np.zeros(n, np.int64), (mask.shape[1], 1)
    _kernels.attention(
        q, k, v, mask, out, None, offsets(q), offsets(k), offsets(v), m_off,
        (E, 1), (E, 1), (Ev, 1), m_strides,
        causal_offset, 1 / math.sqrt(E), num_threads, lse=lse,
    )
    return out, lse


def reference_lse(q, k, mask=None, causal_offset=None):
    """float64 log-sum-exp of each row's visible scaled scores, and the bound on its float error."""
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    E, S = q.shape[-1], k.shape[1]
    s = q64 @ np.swapaxes(k64, -1, -2) / math.sqrt(E)  # [N, L, S]
    # score rounding: |fl(q.k) - q.k| <= E * u * sum |q_e k_e| (scaled)
    err = E * np.finfo(q.dtype).eps * (np.abs(q64) @ np.swapaxes(np.abs(k64), -1, -2)) / math.sqrt(E)
    visible = np.ones(s.shape, bool)
    if mask is not None and mask.dtype == bool:
        visible &= mask
    elif mask is not None:
        s = s + mask
    if causal_offset is not None:
        visible &= np.arange(S)[None, :] <= np.arange(q.shape[1])[:, None] + causal_offset
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        lse = (m_safe + np.log(np.exp(s - m_safe).sum(axis=-1, keepdims=True)))[..., 0]
    # exp, sum of S terms and log: S * u relative on l -> S * u absolute on log(l)
    bound = np.max(np.where(visible, err, 0), axis=-1) + (S + 8) * np.finfo(q.dtype).eps * (1 + np.abs(lse))
    return lse, bound


def check(lse, ref, bound):
    assert lse.dtype == lse.dtype
    inf = np.isneginf(ref)
    assert np.array_equal(np.isneginf(lse), inf)
    assert np.all(np.abs(lse[~inf] - ref[~inf]) <= bound[~inf])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "L,S,E",
    # dot-product rows (L <= 4), row blocks, split-key decode (L <= 16, S >= 1024)
    [(1, 7, 8), (3, 200, 64), (70, 300, 32), (130, 257, 80), (1, 1024, 64), (5, 3000, 16), (16, 1500, 40)],
)
def test_lse_matches_float64(simd, rng, dtype, L, S, E):
    q, k, v = make_qkv(rng, (3,), L, S, E, dtype=dtype)
    out, lse = kernel_lse(q, k, v)
    check(lse, *reference_lse(q, k))
    for n in (2, 3):
        out_n, lse_n = kernel_lse(q, k, v, num_threads=n)
        assert np.array_equal(lse_n, lse) and np.array_equal(out_n, out)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L,S", [(3, 50), (70, 300), (2, 3000), (9, 2100)])
def test_lse_masks_causal_and_empty_rows(simd, rng, dtype, L, S):
    q, k, v = make_qkv(rng, (2,), L, S, 16, dtype=dtype)
    allowed = random_bool_mask(rng, (L, S))
    allowed[0, :] = False                       # nothing visible: lse -inf, out 0
    allowed[L - 1, :] = False
    allowed[L - 1, S - 3] = True                # one visible key, in the last chunk
    out, lse = kernel_lse(q, k, v, mask=allowed)
    check(lse, *reference_lse(q, k, mask=allowed))
    assert np.all(np.isneginf(lse[:, 0])) and np.all(out[:, 0] == 0)
    bias = np.where(allowed, rng.standard_normal((L, S)), -np.inf).astype(dtype)
    _, lse = kernel_lse(q, k, v, mask=bias)
    check(lse, *reference_lse(q, k, mask=bias))
    for offset in (0, S - L, -1):               # upper-left, lower-right, row 0 sees nothing
        _, lse = kernel_lse(q, k, v, causal_offset=offset)
        check(lse, *reference_lse(q, k, causal_offset=offset))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("L,S", [(2, 50), (70, 300), (2, 3000)])
def test_lse_nan_like_out(simd, rng, dtype, L, S):
    q, k, v = make_qkv(rng, (1,), L, S, 16, dtype=dtype)
    q[0, L - 1, 3] = np.nan
    out, lse = kernel_lse(q, k, v)
    assert np.isnan(lse[0, L - 1]) and np.all(np.isnan(out[0, L - 1]))
    assert np.all(np.isfinite(lse[0, : L - 1]))
