"""The benchmark summary's headline table, from made-up results (no timing involved)."""

from types import SimpleNamespace

from attn.bench import _common as ab
from attn.bench import _summary

CASE = ab.Case("grid", (1, 8), 1024, 1024, 64, 64, "f32", False, mask="bool")


def results(cython_median, torch_median, paired=(0.86, 0.80, 0.92)):
    rows = []
    for backend, median in (("torch", torch_median), ("cython", cython_median)):
        gflops = CASE.flops / median / 1e9
        rows.append({"group": CASE.group, "case_obj": CASE, "backend": backend, "median": median,
                     "min": median, "gflops": gflops, "pct_peak": 50.0, "peak": 2 * gflops,
                     "diff_torch": 0.0, "diff_ref64": 1e-7})
    ratio, q1, q3 = paired
    return SimpleNamespace(timings=rows, memory=[], loadavg={"start": [0.1], "end": [0.1]},
                           paired={CASE.group: {"ratio": ratio, "ratio_q1": q1, "ratio_q3": q3,
                                                "torch": torch_median, "cython": cython_median,
                                                "blocks": 15, "calls_per_block": 5}})


SETTINGS = SimpleNamespace(backends=ab.BACKEND_ORDER, threads=2, disabled=False)


def row(lines):
    (line,) = [x for x in lines if x.startswith(CASE.group)]
    return line


def test_a_median_ratio_outside_the_paired_middle_half_is_marked_noise():
    # the example: medians said 1.37x, the paired figure 0.86x
    table, noisy, _ = _summary.headline_table(SETTINGS, results(13.7e-3, 10e-3))
    assert noisy
    line = row(table)
    assert "0.86x  0.80-0.92" in line
    assert "1.37x noise" in line


def test_a_median_ratio_that_agrees_is_not_marked():
    table, noisy, _ = _summary.headline_table(SETTINGS, results(8.8e-3, 10e-3))
    assert not noisy
    assert "0.88x" in row(table) and "noise" not in row(table)


def test_the_slack_is_five_percent_either_side():
    paired = {"ratio": 1.0, "ratio_q1": 0.9, "ratio_q3": 1.1}
    assert not _summary.is_noise(0.9 * 0.951, paired) and _summary.is_noise(0.9 * 0.949, paired)
    assert not _summary.is_noise(1.1 * 1.049, paired) and _summary.is_noise(1.1 * 1.051, paired)


def test_without_torch_the_summary_says_why_and_how_to_get_it():
    env = {"torch": None, "torch_error": "PyTorch is not installed (ModuleNotFoundError: No module named 'torch')",
           "backends": {"cython": True, "simd": "generic"}, "attn_version": "0", "numpy_version": "2"}
    lines = _summary.torch_note(SETTINGS, env)
    assert lines[0].startswith("no torch column: PyTorch is not installed")
    assert "install PyTorch's CPU build: pip install torch --index-url" in lines[1]


def test_paired_only_groups_are_printed():
    """Groups timed only as a pair (the decode table) and the stream rate get a line each."""
    from attn.bench import _summary

    lines = _summary.paired_only_lines({
        "decode x": dict(a=2e-5, b=1e-5, torch=2e-5, cython=1e-5, ratio=0.5, ratio_q1=0.4, ratio_q3=0.6),
        "decode stream y": dict(seconds=1e-3, kv_bytes_per_s=8e9, copy_bytes_per_s=2e10, fraction_of_copy=0.4),
    })
    assert any("decode x" in ln and "cython/torch 0.50x" in ln and "0.40-0.60" in ln for ln in lines)
    assert any("decode stream y" in ln and "0.40 of copy bandwidth" in ln for ln in lines)
