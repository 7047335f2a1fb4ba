"""Shared helpers of the attn benchmark suite: the CPU's description, the GEMM
yardstick, cases, flop counts, inputs, references, the loop-cost estimate,
formatting.

Imported by the plugin, the test modules and plot.py; it imports neither
pytest nor torch at module level.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field

import numpy as np

from attn import _dtypes as attn_dtypes
from attn._interop import to_numpy, to_torch

#: Order in which the contenders of one group run.  torch and cython first,
#: numpy (whose BLAS threads keep spinning after each call) and the loop last,
#: so a measurement never follows numpy directly within a group; a pause
#: before every benchmark covers the step from one group to the next.
BACKEND_ORDER = ("torch", "cython", "numpy", "loop")
ATTN_BACKENDS = ("loop", "numpy", "cython")

DTYPES = {"f32": np.float32, "f64": np.float64, "bf16": attn_dtypes.bfloat16()}  # bf16: ml_dtypes'
U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff


# --------------------------------------------------------------------------
# machine
# --------------------------------------------------------------------------


def n_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _cpuinfo() -> dict:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" in line:
                    k, v = (s.strip() for s in line.split(":", 1))
                    info.setdefault(k, v)
    except OSError:
        pass
    return info


def cpu_description(simd: str | None = None, cores: int | None = None) -> str:
    """The CPU in one phrase: model name, family/model, the SIMD path attn took, cores.

    e.g. ``"AMD EPYC (family 25 model 17), avx512 SIMD path, 2 cores"``. On Linux from
    /proc/cpuinfo; elsewhere ``platform.processor()``. ``simd``: ``attn.backends()["simd"]``
    (left out when None); ``cores``: default the cores this process may run on.
    """
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    parts = [name] + ([f"{simd} SIMD path"] if simd else []) + [f"{n_cores() if cores is None else cores} cores"]
    return ", ".join(parts)


# --------------------------------------------------------------------------
# the machine's own yardstick: a GEMM measured in the same run
# --------------------------------------------------------------------------

GEMM_MIN_N, GEMM_MAX_N = 256, 2048
GEMM_REPEATS = 5


def gemm_size(flops: float) -> int:
    """Side ``n`` of a square GEMM doing about ``flops`` (2 n^3), a multiple of 64 in [256, 2048]."""
    n = round((max(flops, 0) / 2) ** (1 / 3) / 64) * 64
    return int(min(GEMM_MAX_N, max(GEMM_MIN_N, n)))


def _best_seconds(fn, repeats):
    fn()  # warm: first-call costs (allocation, thread pool start) are not the rate
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def backward_flops(heads: int, T: int, E: int, causal: bool) -> float:
    """Useful flops of one backward over ``heads`` T x T matrices of head size E: five
    matrix products, 2 E flops each per visible query-key pair (10 E per pair; a
    forward's useful flops are 4 E per pair)."""
    pairs = T * (T + 1) // 2 if causal else T * T
    return 10.0 * E * pairs * heads


def gemm_rate(dtype: str, n: int, torch=None, threads: int | None = None, repeats: int = GEMM_REPEATS) -> dict:
    """Best GFLOP/s of ``repeats`` n x n @ n x n matrix products in ``dtype`` ("f32", "f64" or "bf16").

    The products are BLAS's: ``torch.matmul`` (on torch's current thread count, which the
    suite sets to its own) when ``torch`` is given, and ``numpy.matmul`` when NumPy's BLAS
    runs on the same threads as the rest (``threads`` is None or all cores: NumPy's thread
    count cannot be set from here); the faster of them is the yardstick. bfloat16: torch's
    GEMM only (without torch, NumPy's float32 one, and ``by`` says so).

    Returns
    -------
    dict: ``gflops`` (the best), ``n``, ``dtype``, ``by`` (which library gave it) and
    ``rates`` ({library: GFLOP/s}).
    """
    dt = DTYPES[dtype]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dt) for _ in range(2))
    out = np.empty((n, n), dt)
    flops = 2.0 * n ** 3
    rates = {}
    if torch is not None:
        ta, tb, tout = as_torch(a), as_torch(b), as_torch(out)
        rates["torch.matmul"] = flops / _best_seconds(lambda: torch.matmul(ta, tb, out=tout), repeats) / 1e9
    if dtype == "bf16" and torch is None:  # NumPy has no bfloat16 GEMM (ml_dtypes' is a scalar loop)
        a, b, out = (x.astype(np.float32) for x in (a, b, out))
        rates["numpy.matmul (float32)"] = flops / _best_seconds(lambda: np.matmul(a, b, out=out), repeats) / 1e9
    elif torch is None or threads is None or threads >= n_cores():
        rates["numpy.matmul"] = flops / _best_seconds(lambda: np.matmul(a, b, out=out), repeats) / 1e9
    by = max(rates, key=rates.get)
    return {"gflops": rates[by], "n": n, "dtype": dtype, "by": by, "rates": rates}


PEAK_SECONDS = 0.2   # each FMA-peak run: long enough that thread start-up is a small part of the span
PEAK_REPEATS = 3
READ_BYTES = 1 << 30  # the read yardstick's buffer: 1 GiB, far past any last-level cache
READ_REPEATS = 5


def _yardsticks():
    """The compiled yardsticks (attn/apps/bench/_yardsticks.pyx), or None where they are not built."""
    try:
        from attn.apps.bench import _yardsticks
    except ImportError:
        return None
    return _yardsticks


def _best_rate(run, probe: int, threads: int, repeats: int) -> float:
    """The best of ``repeats`` rates ``run(iters, threads)`` of a compiled yardstick loop, iters sized
    from a ``probe``-round run on one thread so that each run takes about PEAK_SECONDS."""
    iters = max(probe, int(probe * PEAK_SECONDS / _best_seconds(lambda: run(probe, 1), 1)))
    return max(run(iters, threads) for _ in range(repeats))


def fma_peak_rate(attn, dtype: str, threads: int, repeats: int = PEAK_REPEATS) -> dict | None:
    """The CPU's measured multiply-add peak on attn's current SIMD path (attn/apps/bench/_yardsticks.h):
    the best GFLOP/s of ``repeats`` runs of independent FMA chains on ``threads`` threads from one
    barrier, each run about PEAK_SECONDS long, flops over the span from the first thread's start to
    the last one's end.

    ``dtype`` "f32", "f64", or "bf16": bfloat16 products, on AMX tiles (tdpbf16ps) on the avx512-amx
    path, vdpbf16ps on avx512-bf16, elsewhere the float32 peak (attn then computes bfloat16 in
    float32); ``of`` says which ("amx", "bf16", "f32"). On the amx path the tiles are the path's
    fastest products (attn runs a prefill's blocks on them, a decode's rows on float32 FMAs): its
    bfloat16 peak is theirs.

    Returns
    -------
    dict: ``gflops``, ``dtype``, ``of`` (the loop's dtype), ``path``, ``threads``; None without the
    compiled yardsticks.
    """
    y = _yardsticks()
    if y is None:
        return None
    of = dtype
    if dtype == "bf16" and y.fma_peak("amx", 1, 1):
        of = "amx"
    elif dtype == "bf16" and not y.fma_peak("bf16", 1, 1):
        of = "f32"
    best = _best_rate(lambda iters, t: y.fma_peak(of, iters, t), 1_000_000, threads, repeats)
    return {"gflops": best, "dtype": dtype, "of": of, "path": attn.backends()["simd"], "threads": threads}


def read_bandwidth_rate(threads: int, nbytes: int = READ_BYTES, repeats: int = READ_REPEATS,
                        backing: str = "numpy") -> dict | None:
    """The DRAM read bandwidth on ``threads`` threads: the best of ``repeats`` reads of a ``nbytes``
    buffer (filled first, so its pages exist), each thread reading its own slice from one barrier,
    bytes over the span from the first start to the last end (attn/apps/bench/_yardsticks.pyx).

    ``backing``: how the buffer is allocated, which sets its page size (attn/apps/bench/_pages.py):
    "numpy" (a NumPy array, as the suite's inputs are: NumPy advises 2 MiB pages for large arrays),
    "2m" or "4k" (a mapping advised for 2 MiB pages or against them). This loop has no software prefetch: on 4 KiB pages,
    where the hardware prefetchers stop at every page, it reads less than a kernel that prefetches
    across pages (so only a read of 2 MiB pages is the machine's limit).

    Returns
    -------
    dict: ``bytes_per_s``, ``nbytes``, ``threads``, ``backing``, ``huge_share`` (the buffer's share
    on 2 MiB pages; None where /proc/self/smaps is unreadable); None without the compiled yardsticks.
    """
    from attn.apps.bench import _pages

    y = _yardsticks()
    if y is None:
        return None
    if backing == "numpy":
        buf = np.ones(nbytes // 4, np.float32)
    elif backing in ("2m", "4k"):
        buf = _pages.zeros(nbytes, huge=backing == "2m")
    else:
        raise ValueError(f"backing must be 'numpy', '2m' or '4k', got {backing!r}")
    best = max(y.read_bandwidth(buf, threads)[0] for _ in range(repeats))
    return {"bytes_per_s": best, "nbytes": nbytes, "threads": threads, "backing": backing,
            "huge_share": _pages.huge_share(buf)}


def softmax_rate(attn, threads: int, repeats: int = PEAK_REPEATS) -> dict | None:
    """Scores per second of the kernel's own float32 tile softmax on attn's current SIMD path
    (its table's online_softmax, attn_tile_softmax_rounds in attn/_src/attn_simd.h: exp, max, sums
    and rescale over a key-major tile kept in L1, as a prefill runs it between its products): the best of ``repeats`` runs on
    ``threads`` threads from one barrier, each about PEAK_SECONDS long. On bfloat16 product paths
    (vdpbf16ps, AMX tiles) this, not the products, can bound a prefill. (Until 2026-12-07 it was
    ``attn.masked_softmax`` over a 64 MiB array: its memory's rate, 5-8x lower.)

    Returns
    -------
    dict: ``scores_per_s``, ``path``, ``threads``; None without the compiled yardsticks.
    """
    y = _yardsticks()
    if y is None:
        return None
    best = _best_rate(y.softmax_rate, 5_000, threads, repeats)
    return {"scores_per_s": best, "path": attn.backends()["simd"], "threads": threads}


def cython_available(backends: dict):
    """Interpret attn.backends()'s description of the Cython extension."""
    c = backends.get("cython")
    if isinstance(c, dict):
        return bool(c.get("built", c.get("available", True)))
    if c is None:
        return bool(backends.get("cython_built", backends.get("compiled", False)))
    return bool(c)


# --------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmark group: a shape, a dtype, causal or not, a mask or not."""

    kind: str  # "seed" | "grid" | "decode"
    lead: tuple  # leading (batch, head) dims; () for the seed's single head
    L: int
    S: int
    E: int
    Ev: int
    dtype: str  # "f32" | "f64" | "bf16"
    causal: bool
    mask: str = "none"  # "none" | "bool" (random [L, S], half the keys) | "padding" ([B, 1, 1, S])
    #                     | "float" (the "bool" pattern as an additive 0 / -inf bias in the case's dtype)
    tags: tuple = field(default=(), compare=False)

    # identifiers ---------------------------------------------------------
    @property
    def id(self) -> str:
        """pytest id fragment; non-causal is 'dense' so `-k causal` is exact."""
        mode = "causal" if self.causal else "dense"
        if self.kind == "seed":
            return f"headline-seed-T{self.L}-E{self.E}-{self.dtype}"
        if self.kind == "decode":
            return f"decode-H{self.lead[-1]}-L{self.L}-S{self.S}-E{self.E}-{self.dtype}-{mode}"
        B, H = self.lead
        masked = "" if self.mask == "none" else f"-{self.mask}mask"
        return f"B{B}H{H}-T{self.L}-E{self.E}-{self.dtype}-{mode}{masked}"

    @property
    def group(self) -> str:
        """pytest-benchmark group name (one group per shape/dtype/causal)."""
        mode = "causal" if self.causal else "dense"
        if self.kind == "seed":
            return f"seed headline: one head ({self.L},{self.E}) {self.dtype} {mode}"
        if self.kind == "decode":
            return (f"decode B={self.lead[0]} H={self.lead[1]} L={self.L} S={self.S} "
                    f"E={self.E} {self.dtype} {mode}")
        B, H = self.lead
        masked = "" if self.mask == "none" else f" {self.mask} mask"
        return f"B={B} H={H} T={self.L} E={self.E} {self.dtype} {mode}{masked}"

    # sizes -----------------------------------------------------------------
    @property
    def q_shape(self):
        return tuple(self.lead) + (self.L, self.E)

    @property
    def k_shape(self):
        return tuple(self.lead) + (self.S, self.E)

    @property
    def v_shape(self):
        return tuple(self.lead) + (self.S, self.Ev)

    @property
    def heads(self) -> int:
        return math.prod(self.lead) if self.lead else 1

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPES[self.dtype]).itemsize

    @property
    def pairs(self) -> int:
        """Allowed (query, key) pairs per head.

        Causal masks are top-left aligned (torch semantics): row i sees keys
        0..i, i.e. min(i + 1, S) of them. A bool or padding mask counts every
        pair: torch and the kernel both compute the masked scores.
        """
        if not self.causal:
            return self.L * self.S
        L, S = self.L, self.S
        m = min(L, S)  # rows 0..m-1 see i+1 keys, the rest see all S
        return m * (m + 1) // 2 + (L - m) * S

    @property
    def flops(self) -> int:
        """Exact useful flops: allowed pairs x (2E for q.k + 2Ev for p.v)."""
        return self.heads * self.pairs * (2 * self.E + 2 * self.Ev)

    @property
    def kv_bytes(self) -> int:
        return self.heads * self.S * (self.E + self.Ev) * self.itemsize

    @property
    def rows(self) -> int:
        """Query rows the loop backend walks in Python."""
        return self.heads * self.L

    def describe(self) -> dict:
        return {
            "group": self.group,
            "case": self.id,
            "q_shape": list(self.q_shape),
            "k_shape": list(self.k_shape),
            "v_shape": list(self.v_shape),
            "dtype": np.dtype(DTYPES[self.dtype]).name,
            "causal": self.causal,
            "mask": self.mask,
            "flops": self.flops,
        }


def _grid(T, E, dtype, causal, B=1, H=8):
    return Case("grid", (B, H), T, T, E, E, dtype, causal)


def _masked_cases() -> list:
    """T=1024 float32 with a random bool mask and with a key padding mask."""
    return [Case("grid", (1, 8), 1024, 1024, 64, 64, "f32", False, mask=m) for m in ("bool", "padding")]


def _gemm_rate_cases() -> list:
    """The groups whose rate is held to the GEMM's (T = 1024 and 2048, E = 64 and 128, float32 and
    float64, dense, bool-masked and float-masked; the T=1024 E=64 float32 dense, bool and padding
    cases are already in the grid)."""
    cases = []
    for dtype in ("f32", "f64"):
        for E in (64, 128):
            for T in (1024, 2048):
                for m in ("bool", "float"):
                    if not (dtype == "f32" and E == 64 and T == 1024 and m == "bool"):
                        cases.append(Case("grid", (1, 8), T, T, E, E, dtype, False, mask=m))
    return cases


def default_cases() -> list:
    cases = [Case("seed", (), 128, 128, 64, 64, "f64", False)]
    for dtype in ("f32", "f64", "bf16"):  # bf16: attn against torch's bfloat16 SDPA and GEMM
        for causal in (False, True):
            cases.append(_grid(1024, 64, dtype, causal))
    return cases + _masked_cases()


def full_cases() -> list:
    """The performance grid: T x E x dtype x causal, and the rest (a superset of the default cases)."""
    cases = [Case("seed", (), 128, 128, 64, 64, "f64", False)]
    for dtype in ("f32", "f64"):
        for E in (64, 128):
            for T in (128, 512, 1024, 2048, 4096):
                for causal in (False, True):
                    cases.append(_grid(T, E, dtype, causal))
    for dtype in ("f32", "f64"):
        cases.append(_grid(512, 64, dtype, True, B=4, H=8))
    cases.append(Case("decode", (1, 32), 1, 4096, 128, 128, "f32", False))
    return cases + _masked_cases() + _gemm_rate_cases()


def quick_cases() -> list:
    """The seed's headline and T=1024 float32, dense and causal (``python -m attn bench --quick``)."""
    return [Case("seed", (), 128, 128, 64, 64, "f64", False)] + [
        _grid(1024, 64, "f32", causal) for causal in (False, True)]


def cases_for(grid: str) -> list:
    if grid == "quick":
        return quick_cases()
    if grid == "default":
        return default_cases()
    if grid == "full":
        return full_cases()
    raise ValueError(f"unknown bench grid {grid!r} (expected 'quick', 'default' or 'full')")


@dataclass(frozen=True)
class MemCase:
    """One memory measurement shape (always 4-D: (B, H, L, E))."""

    B: int
    H: int
    L: int
    S: int
    E: int
    dtype: str
    causal: bool = False

    @property
    def id(self) -> str:
        mode = "causal" if self.causal else "dense"
        return f"mem-B{self.B}H{self.H}-T{self.L}-E{self.E}-{self.dtype}-{mode}"

    @property
    def label(self) -> str:
        return f"B={self.B} H={self.H} L=S={self.L} E={self.E} {self.dtype}"


MEM_SMALL = MemCase(1, 8, 1024, 1024, 64, "f32")
MEM_LARGE = MemCase(1, 1, 16384, 16384, 64, "f32")


# --------------------------------------------------------------------------
# inputs and references
# --------------------------------------------------------------------------


def make_inputs(case: Case, seed: int = 20261012):
    """Unit-scale normal q, k, v (drawn in float64, then cast), C-contiguous."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[case.dtype]
    q = rng.standard_normal(case.q_shape).astype(dt)
    k = rng.standard_normal(case.k_shape).astype(dt)
    v = rng.standard_normal(case.v_shape).astype(dt)
    return q, k, v


def make_mask(case: Case, seed: int = 20261013):
    """The case's bool attn_mask (True = takes part, SDPA's convention), or None.

    "bool": [L, S], each key kept with probability 1/2 (key 0 always), shared
    by the batch and heads; "padding": [B, 1, 1, S], the last quarter of the
    keys masked, as for padded sequences; "float": the "bool" pattern as an
    additive bias, 0 where a key takes part and -inf elsewhere, in the case's
    dtype (the float-mask path of every implementation, the same answer).
    """
    if case.mask == "none":
        return None
    if case.mask in ("bool", "float"):
        m = np.random.default_rng(seed).random((case.L, case.S)) < 0.5
        m[:, 0] = True
        return m if case.mask == "bool" else np.where(m, 0.0, -np.inf).astype(DTYPES[case.dtype])
    if case.mask == "padding":
        m = np.ones((case.lead[0], 1, 1, case.S), bool)
        m[..., case.S - case.S // 4:] = False
        return m
    raise ValueError(f"unknown mask kind {case.mask!r}")


def as_torch(a):
    """torch view of a NumPy array (ml_dtypes' bfloat16 as torch.bfloat16: the same bits)."""
    import torch  # noqa: F401  (imported: attn._interop.to_torch takes it from sys.modules)

    return to_torch(a)


def as_numpy(t):
    """A torch result as NumPy (bfloat16 widened to float32, exactly)."""
    a = to_numpy(t, "torch's result", detach=True)
    return a.astype(np.float32) if attn_dtypes.is_bfloat16(a.dtype) else a


def as_torch4d(a):
    """torch view of a NumPy array, with leading dims padded to 4-D.

    torch's fused CPU (flash) SDPA kernel only takes 4-D inputs; a 2-D call
    falls back to its slower math path, so the seed's single head is handed
    to torch as a (1, 1, L, E) view of the same memory (no copy).
    """
    t = as_torch(a)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def torch_sdpa_fn(q, k, v, causal: bool, mask=None):
    """Zero-argument callable running torch SDPA on views of q, k, v (and the bool mask)."""
    import torch.nn.functional as F

    tq, tk, tv = as_torch4d(q), as_torch4d(k), as_torch4d(v)
    tm = None if mask is None else as_torch4d(mask)
    sdpa = F.scaled_dot_product_attention

    def run():
        return sdpa(tq, tk, tv, attn_mask=tm, is_causal=causal)

    return run


def torch_reference(q, k, v, causal: bool, upcast: bool = False, mask=None) -> np.ndarray:
    """torch SDPA output as a NumPy array with q's leading shape."""
    import torch

    if upcast:
        q, k, v = (a.astype(np.float64) for a in (q, k, v))
        if mask is not None and mask.dtype != bool:
            mask = mask.astype(np.float64)  # torch takes a float mask in q's dtype
    with torch.inference_mode():
        out = torch_sdpa_fn(q, k, v, causal, mask)()
    return as_numpy(out).reshape(q.shape[:-1] + (v.shape[-1],))


def numpy_reference64(q, k, v, causal: bool, mask=None) -> np.ndarray:
    """softmax(q k^T / sqrt(E) + mask) v in float64, written out (the reference without torch).

    ``mask``: bool, True = the key takes part, or a float bias added to the
    scaled scores, broadcastable to [..., L, S];
    causal: top-left aligned (row i sees keys 0..i). A row without any key gives 0.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scores = np.einsum("...le,...se->...ls", q, k) / math.sqrt(q.shape[-1])  # [..., L, S]
    allowed = np.ones(scores.shape[-2:], bool)
    if causal:
        allowed = np.tril(allowed)  # [L, S]
    if mask is not None and mask.dtype == bool:
        allowed = allowed & mask  # broadcast to [..., L, S]
    elif mask is not None:
        scores = scores + mask.astype(np.float64)  # broadcast to [..., L, S]
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)  # [..., L, 1]
    e = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    denom = np.sum(e, axis=-1, keepdims=True)
    weights = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    return weights @ v  # [..., L, Ev]


def max_abs_diff(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    d = np.abs(a - b)
    return float(np.nanmax(d)) if not np.isnan(d).all() else float("nan")


def rounding_bound(q, k, v, dtype) -> float:
    """Largest ``|computed - exact|`` rounding allows SDPA in ``dtype`` (any implementation, order).

    The global, O(size) form of the test suite's bound (tests/_bounds.py has the
    reasoning): with ``A = scale * max_i |q_i|_1 * max |k|`` every score is off by
    at most ``d = gamma(E + 2) A + 4 u A + 6 u`` (dot product and scale, the row-max
    subtraction and exp), which moves the weights by ``sum |dp| <= 2 W / (1 - W)``,
    ``W = e^d - 1``; the weighted sum over S keys adds ``2 gamma(2 S) + 2 u``, all
    times ``max |v|``. A mask only removes keys, so it keeps the bound.
    Two implementations differ by at most the sum of their bounds.
    """
    u = float(np.finfo(dtype).eps) / 2  # (float32 or float64: the precision computed in)
    gamma = lambda n: n * u / (1 - n * u)
    E, S = q.shape[-1], k.shape[-2]
    a = (np.abs(q).sum(axis=-1).max() * np.abs(k).max() / math.sqrt(E)) if q.size and k.size else 0.0
    d = gamma(E + 2) * a + 4 * u * a + 6 * u
    w = math.expm1(d)
    assert w < 0.5, "scores too large for a meaningful rounding bound"
    dp = 2 * w / (1 - w)
    vmax = float(np.abs(v).max()) if v.size else 0.0
    return ((dp + 2 * gamma(2 * max(S, 1)) + 2 * u) * (1 + dp) + 2 * S * float(np.finfo(dtype).tiny)) * vmax


def backward_rounding_bound(q, k, v, dout, causal: bool, dtype, visible=None):
    """Elementwise bounds on ``|computed - exact|`` of SDPA's gradients (dq, dk, dv) in ``dtype``.

    The backward's counterpart of :func:`rounding_bound`, to first order in
    u and for any summation order, per (batch, head), from the exact float64
    values of the same inputs (q, k, v, dout exact; scale 1/sqrt(E); causal:
    top-left). With ``s`` the scores, P the weights, O = P V, dP = dO V^T,
    D = rowsum(dO o O) and dS = P o (dP - D):

    * each weight's error ``eP``: the larger of a softmax normalized by its
      sum (score errors ``d = gamma(E + 2) |s| + 2 u |s - max| + 6 u``, then
      ``(P (e^d - 1) + P W) / (1 - W)``, ``W = sum_j P_j (e^d_j - 1)``, and the
      sum and division ``(gamma(2 S) + 2 u) P``) and of P recomputed from a
      log-sum-exp with its own error (the flash backward's way);
    * ``eO = eP |V| + gamma(S) P |V| + u |O|``; ``e_dP = gamma(Ev) |dO| |V|^T``;
      ``eD`` the larger of rowsum(dO o O)'s and rowsum(P o dP)'s bounds;
    * ``e_dS = eP |dP - D| + P (e_dP + eD) + 2 u |dS|``;
    * ``dQ = s dS K``: ``s (e_dS |K| + gamma(S + 1) |dS| |K|)``; dK likewise over
      the L rows; ``dV = P^T dO``: ``eP^T |dO| + gamma(L) P^T |dO|``; each
      plus one rounding of the result.

    ``visible``: an optional bool [L, S] mask (True = takes part, broadcast over
    the batch dims), for a bool mask or a float mask of 0 and -inf.

    Worst-case bounds: typically 10 to 1000 times the errors seen, while a
    wrong gradient is off by its own size. Costs a few L x S float64
    products per head (one head's arrays at a time).

    Returns
    -------
    (bq, bk, bv) : ndarray, float64, the shapes of q, k, v
    """
    u = float(np.finfo(dtype).eps) / 2
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    tiny = float(np.finfo(dtype).tiny)
    bounds = tuple(np.zeros(np.shape(a)) for a in (q, k, v))
    for idx in np.ndindex(*np.shape(q)[:-2]):
        qh, kh, vh, gh = (np.asarray(a[idx], dtype=np.float64) for a in (q, k, v, dout))
        (L, E), S, Ev = qh.shape, kh.shape[0], vh.shape[1]
        sc = 1 / math.sqrt(E)
        aq, ak, av, ag = np.abs(qh), np.abs(kh), np.abs(vh), np.abs(gh)
        vis = np.tril(np.ones((L, S), bool)) if causal else np.ones((L, S), bool)
        if visible is not None:
            vis = vis & np.asarray(visible, bool)
        t = np.where(vis, sc * (qh @ kh.T), -np.inf)  # [L, S]
        top = np.max(t, axis=1, keepdims=True)
        lse = top + np.log(np.sum(np.exp(t - top), axis=1, keepdims=True))
        p = np.exp(t - lse)  # exact weights, 0 where masked
        fin = np.where(vis, t, 0.0)
        d = np.where(vis, gamma(E + 2) * sc * (aq @ ak.T) + 2 * u * np.abs(fin - top) + 6 * u, 0.0)
        grown = p * np.expm1(d)
        w = np.sum(grown, axis=1, keepdims=True)
        assert np.all(w < 0.5), "scores too large for a meaningful rounding bound"
        e_norm = (grown + p * w) / (1 - w) + (gamma(2 * S) + 2 * u) * p
        d_lse = np.max(d, axis=1, keepdims=True) + gamma(S) + 2 * u * np.abs(lse) + 6 * u
        e_lse = p * np.expm1(d + d_lse + 2 * u * np.abs(fin - lse))
        ep = np.maximum(e_norm, e_lse) + np.where(vis, 2 * tiny, 0.0)
        o = p @ vh
        dp = gh @ vh.T
        dd = np.sum(gh * o, axis=1, keepdims=True)
        ds = p * (dp - dd)
        e_o = ep @ av + gamma(S) * (p @ av) + u * np.abs(o)
        e_dp = gamma(Ev) * (ag @ av.T)
        rowsum = lambda a: np.sum(a, axis=1, keepdims=True)  # noqa: E731
        e_dd = np.maximum(rowsum(ag * e_o) + gamma(Ev) * rowsum(np.abs(gh * o)),  # rowsum(dO o O)
                          rowsum(ep * np.abs(dp) + p * e_dp) + gamma(S) * rowsum(p * np.abs(dp)))  # rowsum(P o dP)
        e_ds = ep * np.abs(dp - dd) + p * (e_dp + e_dd) + 2 * u * np.abs(ds)
        dq, dk, dv = sc * (ds @ kh), sc * (ds.T @ qh), p.T @ gh
        bounds[0][idx] = sc * (e_ds @ ak + gamma(S + 1) * (np.abs(ds) @ ak)) + u * np.abs(dq)
        bounds[1][idx] = sc * (e_ds.T @ aq + gamma(L + 1) * (np.abs(ds).T @ aq)) + u * np.abs(dk)
        bounds[2][idx] = ep.T @ ag + gamma(L) * (p.T @ ag) + u * np.abs(dv)
    return bounds


def estimate_loop_seconds(attn_mod, case: Case, q, k, v, sample_rows: int = 16) -> float:
    """Seconds one loop-backend call would take, from timing a few rows.

    Times the loop backend (best of 3) on `sample_rows` query rows of one
    head against all S keys (non-causal: an upper bound for causal rows) and
    scales to every query row of the case.
    """
    n = min(sample_rows, case.L)
    q1 = q.reshape((-1, case.L, case.E))[0, :n]
    k1 = k.reshape((-1, case.S, case.E))[0]
    v1 = v.reshape((-1, case.S, case.Ev))[0]
    attn_mod.scaled_dot_product_attention(q1[:1], k1, v1, backend="loop")  # warm
    best = float("inf")
    for _ in range(3):  # best of 3: robust to a busy machine
        t0 = time.perf_counter()
        attn_mod.scaled_dot_product_attention(q1, k1, v1, backend="loop")
        best = min(best, time.perf_counter() - t0)
    return best / n * case.rows


# --------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------


def fmt_time(s) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_ratio(a, b) -> str:
    if not a or not b:
        return "-"
    r = a / b
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def fmt_diff(d) -> str:
    if d is None:
        return "-"
    if d == 0:
        return "0"
    return f"{d:.1e}"


def parse_list(text: str | None, allowed) -> tuple:
    if not text:
        return tuple(allowed)
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad:
        raise ValueError(f"unknown backend(s) {bad}; choose from {list(allowed)}")
    return tuple(x for x in allowed if x in items)
