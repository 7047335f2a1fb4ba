"""One vLLM step's paged attention, planned once and run by every layer (:mod:`attn.integrations.vllm`).

A step of vLLM's engine is one packed batch of sequences: sequence s has
``L_s`` new query tokens (a prefill chunk, or one decode row) which are the
last of its ``S_s`` keys, the keys in pages listed by its row of the block
table. Everything about that batch except the layer's own tensors is the
same for every layer: the query and key lengths, the block table checked
against the page pool, the thread count. :class:`StepPlan` holds them,
checked once (:func:`plan_step`, called by the metadata builder's
``build()``), and :func:`run_layer` runs one layer's attention from it: the
computation of :func:`attn.flash.flash_attn_varlen_func` with a
``block_table`` (the same :class:`attn._paged.CacheProblem`, bit for bit:
tests/test_vllm.py checks it), without re-checking the step's arrays layer
after layer.

Nothing here imports vLLM; torch tensors are read in place through
:mod:`attn._interop`.
"""

from dataclasses import dataclass, field

import numpy as np

from .. import _backends, _dtypes, _paged, _threads
from .._interop import to_numpy
from .._validation import check_scale
from ..flash._kvcache import _paged_variants_check


@dataclass(frozen=True)
class StepPlan:
    """The parts of one step's attention call that every layer shares.

    Attributes
    ----------
    num_tokens : int
        Query tokens of the step (vLLM's ``num_actual_tokens``), T.
    q_start, q_len, k_len : ndarray of int64, shape [B]
        Sequence s owns query tokens ``q_start[s] : q_start[s] + q_len[s]``
        and attends its first ``k_len[s]`` keys.
    block_table : ndarray of int32, shape [B, max_pages], C-contiguous
        The pages of each sequence's keys (checked against the pool).
    max_q, max_k : int
        The longest query chunk and key sequence.
    causal : bool
    num_threads : int
        Threads of each layer's kernel call (vLLM's worker: ``torch.get_num_threads()``).
    zeros : ndarray of int64, shape [B]
        The batch rows and key starts of the packed problem (all 0).
    calls : dict
        The step's kernel calls as :func:`run_layer` derives them from the first layer of each
        layout (:func:`attn._backends.fused.cache_calls_into`), for the layers after it.
    """

    num_tokens: int
    q_start: np.ndarray
    q_len: np.ndarray
    k_len: np.ndarray
    block_table: np.ndarray
    max_q: int
    max_k: int
    causal: bool
    num_threads: int
    zeros: np.ndarray
    calls: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer adds to a step (fixed for the engine's lifetime).

    Attributes
    ----------
    scale : float
    window : tuple of (int, int) or None
        FlashAttention's ``window_size`` (None: no window).
    softcap : float or None
    alibi_slopes : ndarray of float32, shape [H], or None
    sinks : ndarray, shape [H], or None
        Read when the layer runs (vLLM loads its weights after building the layer).
    """

    scale: float
    window: tuple | None = None
    softcap: float | None = None
    alibi_slopes: np.ndarray | None = None
    sinks: object = None


def cache_pages(kv_cache, head_size):
    """K and V of one layer's cache tensor as FlashAttention's pages, views of it (no copy).

    vLLM's CPU_ATTN allocates ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer and
    reads it as ``[num_blocks, num_kv_heads, 2, block_size, head_size]``: in each block, each K/V
    head's keys (``block_size`` rows of ``head_size``), then its values. attn keeps that split, so
    that the rows a decode reads for one head lie side by side, one run of ``block_size * head_size``
    elements a page (rows of K and V interleaved, 2 * head_size apart, took 1.13x vLLM's time against
    0.83x so in a cold-cache decode: SmolLM2's heads, 16 x 2k keys, bfloat16, Zen 4).

    Parameters
    ----------
    kv_cache : torch.Tensor or ndarray, shape [num_blocks, num_kv_heads, block_size, 2 * head_size]
        C-contiguous in its last two dimensions.
    head_size : int

    Returns
    -------
    k_pages, v_pages : views, shape [num_blocks, block_size, num_kv_heads, head_size]
    """
    n_blocks, n_kv_heads, block_size, two_e = kv_cache.shape
    if two_e != 2 * head_size:
        raise ValueError(f"a cache of rows of 2 * head_size = {2 * head_size} elements; got {tuple(kv_cache.shape)}")
    if isinstance(kv_cache, np.ndarray):
        kv = kv_cache.reshape(n_blocks, n_kv_heads, 2, block_size, head_size)
        return kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    kv = kv_cache.view(n_blocks, n_kv_heads, 2, block_size, head_size)  # [blocks, H_kv, K|V, page, E]
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)     # each [blocks, page, H_kv, E]


def plan_step(query_start_loc, seq_lens, block_table, num_pages, page_size, causal, num_threads):
    """Check one step's batch once: the :class:`StepPlan` every layer runs from.

    Parameters
    ----------
    query_start_loc : array_like of int, shape [B + 1]
        Cumulative query tokens (vLLM's ``query_start_loc``): starts at 0, never decreases.
    seq_lens : array_like of int, shape [B]
        Keys of each sequence, its new tokens included (vLLM's ``seq_lens``).
    block_table : array_like of int, shape [B, max_pages]
        Page indices (vLLM's ``block_table_tensor``); read in place when int32 and C-contiguous.
    num_pages, page_size : int
        The page pool's size and keys per page.
    causal : bool
    num_threads : int

    Returns
    -------
    StepPlan

    Raises
    ------
    ValueError
        Lengths that do not fit together (a sequence with more queries than
        keys, more keys than its pages hold, a page outside the pool).
    """
    cu_q = np.asarray(query_start_loc).astype(np.int64)
    k_len = np.asarray(seq_lens).astype(np.int64)
    q_len = np.diff(cu_q)
    if cu_q.ndim != 1 or q_len.shape != k_len.shape or cu_q[0] != 0 or (q_len < 0).any():
        raise ValueError(f"query_start_loc {cu_q.tolist()} and seq_lens {k_len.tolist()} do not describe one batch")
    if (q_len > k_len).any():
        s = int(np.flatnonzero(q_len > k_len)[0])
        raise ValueError(f"sequence {s} has {int(q_len[s])} new tokens but only {int(k_len[s])} keys")
    table = _paged.check_block_table(block_table, len(k_len), num_pages, page_size, k_len)
    return StepPlan(
        num_tokens=int(cu_q[-1]), q_start=cu_q[:-1], q_len=q_len, k_len=k_len, block_table=table,
        max_q=int(q_len.max(initial=0)), max_k=int(k_len.max(initial=0)), causal=bool(causal),
        num_threads=_threads.check_num_threads(int(num_threads)), zeros=np.zeros(len(k_len), np.int64),
    )


def layer_spec(num_heads, head_size, dtype, scale, sliding_window, softcap, alibi_slopes, sinks):
    """One layer's :class:`LayerSpec`, its variants checked as attn's kernel takes them.

    Parameters
    ----------
    num_heads, head_size : int
    dtype : numpy dtype
        The model's dtype (its query's).
    scale : float
    sliding_window : int or None
        vLLM's window length: a query sees its last ``sliding_window`` keys,
        itself included (FlashAttention's ``window_size=(sliding_window - 1, 0)``).
    softcap : float or None (0: none)
    alibi_slopes : sequence of float [num_heads] or None
    sinks : torch.Tensor [num_heads] or None
        The layer's parameter (its values are read at each call).

    Returns
    -------
    LayerSpec
    """
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    if window is not None and window[0] < 0:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    softcap = float(softcap) if softcap else None
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float32)
    _paged_variants_check(window, softcap, slopes, None, 1, num_heads, dtype)
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape [{num_heads}] (one per query head); got {tuple(sinks.shape)}")
    return LayerSpec(scale=check_scale(scale, head_size), window=window, softcap=softcap, alibi_slopes=slopes,
                     sinks=sinks)


def run_layer(plan, spec, query, k_pages, v_pages, k_descale=None, v_descale=None, out=None):
    """One layer's attention over the step's pages.

    Parameters
    ----------
    plan : StepPlan
    spec : LayerSpec
    query : torch.Tensor or ndarray, shape [T, H, E], T = ``plan.num_tokens``
    k_pages, v_pages : torch.Tensor or ndarray, shape [num_pages, page_size, H_kv, E]
        Any strides (read in place), the model's dtype or float8 (e4m3fn, e5m2).
    k_descale, v_descale : float, optional
        A float8 cache's scales (vLLM's ``k_scale``, ``v_scale``): the real values are the stored ones
        times them (1.0: none to apply).
    out : torch.Tensor or ndarray, shape [T, H, E], the query's dtype, optional
        Where the result goes. The kernel writes it there itself (a 16-bit model's rows rounded
        once from float32, as attn.flash's output) when the step's layout allows
        (:func:`attn._backends.fused.cache_calls_into`: vLLM's order of decode rows, then prefill
        chunks), C-contiguous and without float8 scales (other than 1), sinks or ALiBi; the calls are derived
        once per step and layout and shared by the layers after the first. Otherwise the result
        is copied in.

    Returns
    -------
    ndarray, shape [T, H, E]
        ``out`` (its NumPy view) when given; else in the compute dtype: float32 for a
        float16/bfloat16 model, else the model's dtype.
    """
    q, k, v = _numpy(query, "query"), _numpy(k_pages, "k_pages"), _numpy(v_pages, "v_pages")
    # a scale of 1 (vLLM's k_scale and v_scale unless a checkpoint gives others) multiplies by 1: none
    k_descale, v_descale = (None if type(d) is float and d == 1.0 else d for d in (k_descale, v_descale))
    if out is None:
        return _run(plan, spec, q, k, v, k_descale, v_descale)
    o = _numpy(out, "out")
    if o.shape != q.shape or o.dtype != q.dtype:
        raise ValueError(f"out must have the query's shape {tuple(q.shape)} and dtype {q.dtype}; "
                         f"got {tuple(o.shape)} {o.dtype}")
    if k_descale is None and v_descale is None and _into(plan, spec, q, k, v, o):
        return o
    o[...] = _dtypes.cast(_run(plan, spec, q, k, v, k_descale, v_descale), o.dtype)
    return o


def _numpy(x, name):
    """An ndarray as it is, a torch tensor's NumPy view (:func:`attn._interop.to_numpy`)."""
    return x if isinstance(x, np.ndarray) else to_numpy(x, name)


def _into(plan, spec, q, k, v, o):
    """Run the layer with the kernel writing ``o`` itself, from the step's calls for this layout
    (derived at the first layer that has it); False (nothing run) where the layout does not allow it."""
    if spec.sinks is not None or spec.alibi_slopes is not None or not o.flags.c_contiguous:
        return False
    if not (q.flags.aligned and k.flags.aligned and v.flags.aligned and o.flags.aligned):
        return False
    key = (spec.scale, spec.window, spec.softcap, q.shape, q.strides, q.dtype.str, k.shape, k.strides,
           k.dtype.str, v.shape, v.strides, v.dtype.str)
    calls = plan.calls.get(key)
    if calls is None:
        calls = _derive_calls(plan, spec, q, k, v) or False
        plan.calls[key] = calls
    if calls is False:
        return False
    impl, calls = calls
    impl.run_cache_calls(calls, _paged.kernel_query(q, k, v)[None], k, v, o[None])
    return True


def _derive_calls(plan, spec, q, k, v):
    """``(backend, its calls)`` of this layout (:func:`attn._backends.fused.cache_calls_into`), or None
    where the fused kernel does not run the cache (not built, another backend chosen) or the output
    dtype is not one the kernel writes."""
    impl = _backends.select_cache("auto")
    cdtype = _dtypes.compute_dtype(q.dtype)
    if impl is None or not hasattr(impl, "cache_calls_into"):
        return None
    if not (q.dtype == cdtype or (_dtypes.is_16bit(q.dtype) and cdtype == np.float32)):
        return None
    calls = impl.cache_calls_into(_problem(plan, spec, q, k, v, None, None), q.dtype)
    return None if calls is None else (impl, calls)


def _run(plan, spec, q, k, v, k_descale, v_descale):
    """The layer's result in the compute dtype, by :func:`attn._paged.forward` on the step's problem."""
    out, _ = _paged.forward(_problem(plan, spec, q, k, v, k_descale, v_descale), with_lse=False)
    return out[0]


def _problem(plan, spec, q, k, v, k_descale, v_descale):
    """The layer's :class:`attn._paged.CacheProblem` (checked: shapes, dtypes, scales)."""
    sinks = spec.sinks
    if sinks is not None and not isinstance(sinks, np.ndarray):
        sinks = to_numpy(sinks, "sinks", detach=True)
        if _dtypes.is_bfloat16(sinks.dtype):  # (a bfloat16 model's parameter: attn takes float sinks)
            sinks = sinks.astype(np.float32)
    if q.ndim != 3 or q.shape[0] != plan.num_tokens or k.ndim != 4 or q.shape[1] % k.shape[2]:
        raise ValueError(f"query [{plan.num_tokens}, H, E] and pages [num_pages, page_size, H_kv, E] (H a multiple "
                         f"of H_kv) do not match: query {tuple(q.shape)}, pages {tuple(k.shape)}")
    _paged.check_cache_dtypes(q, k, v, "the pages")
    zeros = plan.zeros
    p = _paged.CacheProblem(
        q=_paged.kernel_query(q, k, v)[None], q_batch=zeros, q_start=plan.q_start,
        q_len=plan.q_len, k=k, v=v, k_batch=zeros, k_start=zeros, k_len=plan.k_len, block_table=plan.block_table,
        causal=plan.causal, scale=spec.scale, window=spec.window, softcap=spec.softcap,
        alibi_slopes=spec.alibi_slopes, sinks=sinks, out_dtype=q.dtype, q_bf16=_dtypes.is_bfloat16(q.dtype),
        num_threads=plan.num_threads, plan_token=plan,
    )
    if k_descale is not None or v_descale is not None:
        B, H_kv = plan.k_len.shape[0], k.shape[2]
        p = _paged.apply_descale(p, _paged.check_descale(k_descale, "k_scale", B, H_kv, k),
                                 _paged.check_descale(v_descale, "v_scale", B, H_kv, v))
    return p
