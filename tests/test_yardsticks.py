"""The benchmark's yardsticks (attn/apps/bench/_yardsticks.pyx): the FMA-peak loop and the tile
softmax's loop on every SIMD path, and the read-bandwidth loop.

Their speed is the benchmark's business (python -m attn bench prints them); here: each path runs
float32 and float64 chains and does flops, bfloat16 products only where the path has vdpbf16ps
(AMX tile products only on the avx512-amx path),
the read covers every byte of its buffer exactly once on any thread count, and bad arguments raise.
"""

import numpy as np
import pytest

import attn

yardsticks = pytest.importorskip("attn.apps.bench._yardsticks", reason="needs the compiled yardsticks")


def test_every_path_runs_its_loops(simd):
    for dtype in ("f32", "f64"):
        assert yardsticks.fma_peak(dtype, 1000, 1) > 0, (simd, dtype)
        assert yardsticks.fma_peak(dtype, 1000, 2) > 0, (simd, dtype)
    for threads in (1, 2):
        assert yardsticks.softmax_rate(100, threads) > 0, (simd, threads)
    has_bf16_dot = simd in ("avx512-bf16", "avx512-amx")
    assert (yardsticks.fma_peak("bf16", 1000, 1) > 0) == has_bf16_dot, simd
    assert (yardsticks.fma_peak("amx", 1000, 2) > 0) == (simd == "avx512-amx"), simd


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("words", [8 * 7, 8 * 1000 + 5, 1 << 16])
def test_the_read_covers_every_whole_64_bytes_once(threads, words):
    """Words of 1: the threads' sums add up to the number of 8-byte words in whole 64-byte blocks."""
    if words * 8 < 64 * threads:
        with pytest.raises(ValueError, match="at least 64 bytes a thread"):
            yardsticks.read_bandwidth(np.ones(words, np.uint64), threads)
        return
    rate, total = yardsticks.read_bandwidth(np.ones(words, np.uint64), threads)
    assert rate > 0
    assert total == (words * 8 // 64 * 64) // 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be"):
        yardsticks.fma_peak("f16", 10, 1)
    with pytest.raises(ValueError, match=r"threads must be in \[1, 1024\]"):
        yardsticks.fma_peak("f32", 10, 0)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        yardsticks.fma_peak("f32", 0, 1)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        yardsticks.softmax_rate(0, 1)
    with pytest.raises(ValueError, match=r"threads must be in \[1, 1024\]"):
        yardsticks.softmax_rate(10, 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        yardsticks.read_bandwidth(np.ones((64, 64))[:, ::2], 1)
    with pytest.raises(ValueError, match=r"threads must be in \[1, 1024\]"):
        yardsticks.read_bandwidth(np.ones(1024), 2000)


def test_the_bench_layer_measures_all_three():
    from attn.apps.bench import _common

    peak = _common.fma_peak_rate(attn, "f32", 1, repeats=1)
    assert peak["gflops"] > 0 and peak["of"] == "f32"
    bf16 = _common.fma_peak_rate(attn, "bf16", 1, repeats=1)   # the path's fastest bfloat16 products
    assert bf16["gflops"] > 0
    assert bf16["of"] == {"avx512-amx": "amx", "avx512-bf16": "bf16"}.get(attn.backends()["simd"], "f32")
    read = _common.read_bandwidth_rate(1, nbytes=1 << 22, repeats=1)
    assert read["bytes_per_s"] > 0
    soft = _common.softmax_rate(attn, 1, repeats=1)
    assert soft["scores_per_s"] > 0 and soft["path"] == attn.backends()["simd"]


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_page_backed_zeros():
    from attn.apps.bench import _pages

    for huge in (False, True):
        buf = _pages.zeros(3 << 20, huge)
        assert buf.dtype == np.uint8 and buf.shape == (3 << 20,)
        assert not buf.any()
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        _pages.zeros(0, True)


@pytest.mark.skipif(_thp_mode() is None, reason="no transparent huge pages here (/sys/kernel/mm)")
def test_huge_share_is_the_kernels_accounting_of_the_advice():
    """A mapping advised against huge pages has none in /proc/self/smaps; one advised for them (16
    MiB, 8 huge pages) has some where the kernel gives any (THP not 'never'); a NumPy array and a
    torch tensor report a share in [0, 1]."""
    from attn.apps.bench import _pages

    small, huge = _pages.zeros(16 << 20, False), _pages.zeros(16 << 20, True)
    assert _pages.huge_share(small) == 0.0
    if _thp_mode() != "never":
        assert _pages.huge_share(huge) > 0
    assert 0.0 <= _pages.huge_share(np.ones(1 << 22)) <= 1.0
    torch = pytest.importorskip("torch")
    assert 0.0 <= _pages.huge_share(torch.ones(1 << 22)) <= 1.0


def test_the_read_yardstick_says_its_pages():
    from attn.apps.bench import _common

    for backing in ("numpy", "2m", "4k"):
        read = _common.read_bandwidth_rate(1, nbytes=1 << 22, repeats=1, backing=backing)
        assert read["bytes_per_s"] > 0 and read["backing"] == backing
        assert read["huge_share"] is None or 0.0 <= read["huge_share"] <= 1.0
    assert _common.read_bandwidth_rate(1, nbytes=1 << 22, repeats=1, backing="4k")["huge_share"] in (0.0, None)
    with pytest.raises(ValueError, match="backing must be"):
        _common.read_bandwidth_rate(1, nbytes=1 << 22, repeats=1, backing="1g")

