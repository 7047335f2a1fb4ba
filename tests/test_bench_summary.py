"""The benchmark summary's headline table, from made-up results (no timing involved)."""

from types import SimpleNamespace

from attn.apps.bench import _common as ab
from attn.apps.bench import _summary

CASE = ab.Case("grid", (1, 8), 1024, 1024, 64, 64, "f32", False, mask="bool")


def results(cython_median, torch_median, paired=(0.86, 0.80, 0.92), gemm_gflops=None, skipped=()):
    rows = []
    gemm_gflops = gemm_gflops or 2 * CASE.flops / cython_median / 1e9  # default: cython at half the GEMM
    gemm = {"gflops": gemm_gflops, "n": 1024, "dtype": "f32", "by": "torch.matmul",
            "rates": {"torch.matmul": gemm_gflops}}
    for backend, median in (("torch", torch_median), ("cython", cython_median)):
        gflops = CASE.flops / median / 1e9
        rows.append({"group": CASE.group, "case_obj": CASE, "backend": backend, "median": median,
                     "min": median, "gflops": gflops, "pct_gemm": 100 * gflops / gemm_gflops, "gemm": gemm,
                     "diff_torch": 0.0, "diff_ref64": 1e-7})
    ratio, q1, q3 = paired
    return SimpleNamespace(timings=rows, memory=[], loadavg={"start": [0.1], "end": [0.1]},
                           gemm={"f32 n=1024": gemm}, skipped=list(skipped),
                           paired={CASE.group: {"ratio": ratio, "ratio_q1": q1, "ratio_q3": q3,
                                                "torch": torch_median, "cython": cython_median,
                                                "blocks": 15, "calls_per_block": 5}})


SETTINGS = SimpleNamespace(backends=ab.BACKEND_ORDER, threads=2, disabled=False)


def row(lines):
    (line,) = [x for x in lines if x.startswith(CASE.group)]
    return line


def test_a_row_prints_the_paired_ratio_only():
    # the example: medians said 1.37x, the paired figure 0.86x; the row stands behind one
    table, _ = _summary.headline_table(SETTINGS, results(13.7e-3, 10e-3))
    line = row(table)
    assert "0.86x  0.80-0.92" in line
    assert "1.37" not in line and "noise" not in line


def test_the_rate_is_a_percentage_of_the_gemm_of_the_run():
    # 2 * 1024 * 1024 * 256 flops (dense, E = Ev = 64, 8 heads) in 5 ms: 429.5 GFLOP/s; GEMM 500
    assert CASE.flops == 8 * 1024 * 1024 * 4 * 64
    table, above = _summary.headline_table(SETTINGS, results(5e-3, 10e-3, gemm_gflops=500.0))
    assert "429.5 (86%)" in row(table) and not above and ">GEMM" not in row(table)


def test_a_kernel_faster_than_the_gemm_is_said_plainly():
    res = results(5e-3, 10e-3, gemm_gflops=300.0)
    table, above = _summary.headline_table(SETTINGS, res)
    assert above and "429.5 (143%) >GEMM" in row(table)
    legend = "\n".join(_summary.legend_lines(res, above))
    assert "ran faster than that matrix product" in legend
    assert "\n    f32 n=1024: 300 GFLOP/s (torch.matmul)\n" in legend
    assert "differ between CPUs" in legend


def test_the_summary_names_the_cpu_and_says_why_anything_was_skipped(monkeypatch):
    monkeypatch.setattr(ab, "_cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "25", "model": "17"})
    monkeypatch.setattr(ab, "n_cores", lambda: 2)
    env = {"torch": object(), "torch_version": "2", "backends": {"cython": True, "simd": "avx512"},
           "attn_version": "0", "numpy_version": "2"}
    settings = SimpleNamespace(**vars(SETTINGS), details=False)
    skipped = [("test_sdpa[B1H8-T4096-E64-f32-dense-loop]", "per-row Python loop not timed at this size")]
    lines = _summary.summary_lines(settings, results(5e-3, 10e-3, skipped=skipped), env, details=False)
    assert any(ln.startswith("CPU: AMD EPYC (family 25 model 17), avx512 SIMD path, 2 cores;") for ln in lines)
    at = lines.index("skipped (1):")
    assert lines[at + 1] == "  test_sdpa[B1H8-T4096-E64-f32-dense-loop]: per-row Python loop not timed at this size"


def test_cpu_description_without_family():
    assert ab.cpu_description("generic", cores=4).endswith(", generic SIMD path, 4 cores")


def test_gemm_size_matches_the_flops():
    assert ab.gemm_size(2 * 1024 ** 3) == 1024  # 2 n^3 flops
    assert ab.gemm_size(CASE.flops) == 1024  # 2.1 GFLOP: 2 * 1024^3 is 2.1e9
    assert ab.gemm_size(10) == 256 and ab.gemm_size(1e15) == 2048  # clamped


def test_gemm_rate_reports_the_faster_library():
    np = __import__("numpy")
    torch = __import__("pytest").importorskip("torch")
    g = ab.gemm_rate("f64", 256, torch, threads=None, repeats=2)
    assert set(g["rates"]) == {"torch.matmul", "numpy.matmul"}
    assert g["gflops"] == max(g["rates"].values()) == g["rates"][g["by"]] > 0
    assert g["n"] == 256 and g["dtype"] == "f64"
    g1 = ab.gemm_rate("f32", 256, torch, threads=1, repeats=1)
    if ab.n_cores() > 1:  # NumPy's BLAS would run on all cores: not a yardstick for one thread
        assert set(g1["rates"]) == {"torch.matmul"}
    assert np.isfinite(g1["gflops"])


def test_without_torch_the_summary_says_why_and_how_to_get_it():
    env = {"torch": None, "torch_error": "PyTorch is not installed (ModuleNotFoundError: No module named 'torch')",
           "backends": {"cython": True, "simd": "generic"}, "attn_version": "0", "numpy_version": "2"}
    lines = _summary.torch_note(SETTINGS, env)
    assert lines[0].startswith("no torch column: PyTorch is not installed")
    assert "install PyTorch's CPU build: pip install torch --index-url" in lines[1]


def test_paired_only_groups_are_printed():
    """Groups timed only as a pair (the decode table) and the stream rate get a line each."""
    from attn.apps.bench import _summary

    lines = _summary.paired_only_lines({
        "decode x": dict(a=2e-5, b=1e-5, torch=2e-5, cython=1e-5, ratio=0.5, ratio_q1=0.4, ratio_q3=0.6),
        "decode stream y": dict(seconds=1e-3, kv_bytes_per_s=8e9, copy_bytes_per_s=2e10, fraction_of_copy=0.4),
    })
    assert any("decode x" in ln and "cython/torch 0.50x" in ln and "0.40-0.60" in ln for ln in lines)
    assert any("decode stream y" in ln and "0.40 of copy bandwidth" in ln for ln in lines)


def test_float8_and_unlabelled_paired_rows_are_printed():
    """A float8-vs-16-bit cache row says which over which (the 16-bit time over the float8 one); a
    pair with neither side named (the interleaved rows) prints a plain ratio."""
    from attn.apps.bench import _summary

    lines = _summary.paired_only_lines({
        "decode bf16 cache / e4m3fn cache z": dict(a=1e-3, b=1.2e-3, e4m3fn=1e-3, bf16=1.2e-3, ratio=1.2,
                                                   ratio_q1=1.1, ratio_q3=1.3),
        "interleaved w": dict(a=1e-3, b=1e-3, ratio=0.95, ratio_q1=0.9, ratio_q3=1.0),
    })
    (f8,) = [ln for ln in lines if "e4m3fn cache z" in ln]
    assert "e4m3fn 1.000 ms" in f8 and "bf16 1.200 ms" in f8 and "bf16/e4m3fn cache 1.20x" in f8, f8
    (plain,) = [ln for ln in lines if "interleaved w" in ln]
    assert "ratio 0.95x" in plain, plain


def test_a_run_of_paired_groups_alone_prints_them(monkeypatch):
    """`python -m attn bench -k variants` times only paired groups: the summary still
    prints each, with both times (the reference's and the variant's)."""
    r = results(1e-3, 1e-3)
    r.timings = []
    r.paired = {"softcap T=1024 / plain": dict(a=2e-3, b=2.5e-3, reference=2e-3, variant=2.5e-3,
                                               ratio=1.25, ratio_q1=1.2, ratio_q3=1.3)}
    monkeypatch.setattr(_summary, "machine_lines", lambda *a: ["machine"])
    lines = _summary.summary_lines(SETTINGS, r, {"torch": None, "torch_error": "x"})
    (line,) = [x for x in lines if "softcap T=1024" in x]
    assert "reference 2.000 ms" in line and "variant 2.500 ms" in line and "variant/reference 1.25x" in line, line


def test_backward_groups_print_their_share_of_the_gemm():
    """A backward group's line: the paired ratio, then cython's GFLOP/s (10 E flops per
    visible pair) as a share of the GEMM of the run; the GEMMs are listed without a table."""
    assert ab.backward_flops(8, 1024, 64, False) == 10 * 64 * 1024 * 1024 * 8
    assert ab.backward_flops(8, 4, 64, True) == 10 * 64 * 10 * 8  # 4 + 3 + 2 + 1 visible pairs per head
    group = "backward B=1 H=8 T=1024 E=64 f32"
    bench = SimpleNamespace(group=group, name="test_backward", extra_info={"contender": "cython"},
                            stats=SimpleNamespace(median=0.01))
    gemm = {"gflops": 200.0, "n": 1024, "dtype": "f32", "by": "numpy.matmul", "rates": {}}
    paired = {group: dict(ratio=0.5, ratio_q1=0.4, ratio_q3=0.6, gflops=250.0, pct_gemm=125.0, gemm=gemm)}
    (line,) = [x for x in _summary.other_lines([bench], paired) if group in x]
    assert "cython/torch 0.50x paired" in line and "cython 250.0 GFLOP/s (125% of GEMM)" in line, line
