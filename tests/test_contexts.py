"""attn.apps.models.contexts: the generate command lines it runs, the figure it reads from generate's
output, and its table (medians, the best alternative, the ratio)."""

import pytest

from attn.apps.models import contexts


def test_command_prompt_ends_the_decode_at_the_context():
    argv = contexts.command(2048, 40, ["--backend", "numpy"])
    assert argv[:4] == ["-m", "attn", "generate", contexts.PROMPT]
    assert argv[argv.index("--prompt-tokens") + 1] == "2008" and argv[argv.index("--max-new-tokens") + 1] == "40"
    assert "--ignore-eos" in argv and argv[-2:] == ["--backend", "numpy"]


def test_decode_figure_is_read_from_generates_last_line():
    line = ("prefill: 2008 tokens in 2.89 s (694.8 tokens/s); decode: 39 tokens in 1.97 s "
            "(19.8 tokens/s); attention backend auto")
    assert contexts.DECODE.search(line).groups() == ("39", "1.97", "19.8")


def test_table_takes_medians_and_the_best_alternative():
    labels = [s[0] for s in contexts.SETTINGS]
    rates = {}
    for n, base in ((256, 30.0), (8192, 10.0)):
        for i, x in enumerate(labels):
            rates[(n, x)] = [base + i, base + i + 100, base + i - 1]  # median: base + i
    text = contexts.table(rates, [256, 8192], 40, 3, ("0.10", "0.20"))
    rows = [line for line in text.splitlines() if line.startswith("| 256 |") or line.startswith("| 8192 |")]
    assert rows[0] == "| 256 | 30.0 | 31.0 | 32.0 | 33.0 | 34.0 | 0.91 (vs OPENBLAS_NUM_THREADS=1) |"
    assert rows[1] == "| 8192 | 10.0 | 11.0 | 12.0 | 13.0 | 14.0 | 0.77 (vs OPENBLAS_NUM_THREADS=1) |"
    assert "load average 0.10 at the start, 0.20 at the end" in text
    assert "ATTN_SHARE_BLAS_THREADS=0" not in contexts.ALTERNATIVES  # attn's old default, not an alternative


def test_lengths_must_leave_room_for_the_prompt():
    with pytest.raises(SystemExit):
        contexts.main(["--lengths", "40", "--new-tokens", "40"])
