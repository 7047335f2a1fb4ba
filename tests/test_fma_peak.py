"""The benchmark's FMA-peak yardstick (attn/_src/attn_fma_peak.h): a loop on every SIMD path.

Its speed is the benchmark's business (python -m attn bench prints it); here: each path runs
float32 and float64 chains and does flops, bfloat16 products only where the path has vdpbf16ps,
and bad arguments raise.
"""

import pytest

import attn

pytestmark = pytest.mark.skipif(not attn.backends()["cython"], reason="needs attn's compiled kernels")


def test_every_path_runs_its_loops(simd):
    for dtype in ("f32", "f64"):
        assert attn._kernels.fma_peak(dtype, 1000, 1) > 0, (simd, dtype)
        assert attn._kernels.fma_peak(dtype, 1000, 2) > 0, (simd, dtype)
    has_bf16_dot = simd in ("avx512-bf16", "avx512-amx")
    assert (attn._kernels.fma_peak("bf16", 1000, 1) > 0) == has_bf16_dot, simd


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be"):
        attn._kernels.fma_peak("f16", 10, 1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        attn._kernels.fma_peak("f32", 10, 0)
