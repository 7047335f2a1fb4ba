"""Per-token decode latency at S = 4096: attn's fused kernel vs torch SDPA, same KV cache.

One decoding step of one layer: the newest token's query (L = 1) attends to
the 4096 positions held by an :class:`attn.KVCache` (preallocated with room
to spare, so the valid prefix is a strided view). torch reads the very same
memory (``torch.from_numpy`` of the cache's views, no copy). Timed: the
attention call only (appending one position is a copy of n_kv_head * d_k
numbers, negligible here).

One pytest-benchmark group per shape; ``extra_info`` holds the max abs
difference from torch on the same float32 inputs and from torch in float64,
and the K+V bandwidth (decoding reads every cached key and value once).

Run (plain ``python -m pytest`` only collects tests/):

    python -m pytest bench -k decode                       # timings
    python -m pytest bench -k decode --benchmark-disable   # one call each, checks only
"""

import gc
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")
import attn  # noqa: E402
from attn.apps.bench._common import rounding_bound  # noqa: E402

S = 4096
SPARE = 256  # cache capacity beyond S: the prefix views are not contiguous
SHAPES = {  # group id: (batch, n_head, n_kv_head, d_k)
    "decode S=4096 H=32 E=128 f32": (1, 32, 32, 128),
    "decode S=4096 H=32 KV=8 E=128 f32 (GQA)": (1, 32, 8, 128),
}
CONTENDERS = ("torch", "cython")
PAUSE_S = float(os.environ.get("ATTN_BENCH_PAUSE", "0.3"))  # let the other side's thread pool idle


def _threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class DecodeState:
    """A filled cache, one query, and the references, for one shape."""

    def __init__(self, shape_id):
        n_batch, n_head, n_kv_head, d_k = SHAPES[shape_id]
        rng = np.random.default_rng(20261012)
        self.gqa = n_head != n_kv_head
        self.cache = attn.KVCache(n_batch, n_kv_head, max_len=S + SPARE, head_dim=d_k, dtype=np.float32)
        for start in range(0, S, 1024):  # prefill in chunks (keeps the temporaries small)
            new = (n_batch, n_kv_head, 1024, d_k)
            self.cache.append(rng.standard_normal(new, np.float32), rng.standard_normal(new, np.float32))
        self.q = rng.standard_normal((n_batch, n_head, 1, d_k), np.float32)  # the newest token's query
        self.kv_bytes = self.cache.k.nbytes + self.cache.v.nbytes
        self.tq, self.tk, self.tv = (torch.from_numpy(a) for a in (self.q, self.cache.k, self.cache.v))
        assert np.shares_memory(self.tk.numpy(), self.cache.k_buffer)  # the same cache memory
        with torch.inference_mode():
            self.ref = self.torch_step().numpy()
            self.ref64 = torch.nn.functional.scaled_dot_product_attention(
                self.tq.double(), self.tk.double(), self.tv.double(), enable_gqa=self.gqa).numpy()

    def torch_step(self):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(self.tq, self.tk, self.tv, enable_gqa=self.gqa)

    def attn_step(self):
        return attn.scaled_dot_product_attention(
            self.q, self.cache.k, self.cache.v, is_causal="lower_right", enable_gqa=self.gqa,
            backend="cython")


@pytest.fixture(scope="module")
def decode_states():
    torch.set_num_threads(_threads())
    return {}


@pytest.mark.parametrize("contender", CONTENDERS)
@pytest.mark.parametrize("shape_id", SHAPES)
def test_decode_step(benchmark, shape_id, contender, decode_states):
    if contender == "cython" and not attn.backends()["cython"]:
        pytest.skip("attn's Cython extension is not built")
    if shape_id not in decode_states:
        decode_states.clear()  # one shape's cache alive at a time
        decode_states[shape_id] = DecodeState(shape_id)
    st = decode_states[shape_id]
    step = st.torch_step if contender == "torch" else st.attn_step
    with torch.inference_mode():
        out = step()
        out = out.numpy() if contender == "torch" else out
        diff, diff64 = float(np.max(np.abs(out - st.ref))), float(np.max(np.abs(out - st.ref64)))
        benchmark.group = shape_id
        benchmark.extra_info.update(
            contender=contender, S=S, shape=SHAPES[shape_id], dtype="float32", threads=_threads(),
            max_abs_diff_vs_torch=diff, max_abs_diff_vs_torch_f64=diff64,
        )
        gc.collect()
        time.sleep(PAUSE_S)
        benchmark(step)
    if benchmark.stats is not None:
        benchmark.extra_info["kv_gbps"] = st.kv_bytes / benchmark.stats.stats.median / 1e9
    tol = 2 * rounding_bound(st.q, st.cache.k, st.cache.v, np.float32)  # both sides in float32
    assert diff <= tol, f"{contender} differs from torch by {diff:.3g} (> {tol:.3g}) on {shape_id}"
