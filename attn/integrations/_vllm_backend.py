"""attn's attention backend classes for vLLM's CPU platform (see :mod:`attn.integrations.vllm`).

Imported by vLLM through the registry path that :func:`attn.integrations.vllm.register`
installs; this module imports vllm and torch at its top.

The classes follow vLLM's backend interface (``vllm/v1/attention/backend.py``,
and ``vllm/v1/attention/backends/cpu_attn.py`` for the CPU): the backend
class (what is served), the metadata builder (once per step: the batch's
plan, :func:`attn.integrations._vllm_plan.plan_step`), and the impl (per
layer: the cache update and the attention, one attn kernel call over the
whole mixed batch).

The cache tensor vLLM allocates per layer is CPU_ATTN's,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; this backend writes
it itself (``forward_includes_kv_cache_update = False``:
:meth:`AttnImpl.do_kv_cache_update`), split as CPU_ATTN splits it (each
block's K rows of a head, then its V rows), and reads both as
FlashAttention's pages ``[num_blocks, block_size, num_kv_heads, E]``
(strided views, no copy: :func:`attn.integrations._vllm_plan.cache_pages`).
"""

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

import attn

from . import _vllm_plan
from .. import _build
from .._interop import to_numpy

# a name under vLLM's logger, so that vLLM's logging configuration prints it
logger = logging.getLogger("vllm.attn")

_ENV = "ATTN_VLLM"
_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # CPU_ATTN's (what is tested)
# vLLM's float8 cache dtypes ("fp8" is e4m3: vllm/utils/torch_utils.py) -> torch's format of the bytes
_FLOAT8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # saturation (e4m3fn has no infinity)
_announced = False


class UnservedConfigurationError(ValueError):
    """A configuration attn's vLLM backend does not serve (raised when the engine builds the model)."""


def _refuse(what):
    raise UnservedConfigurationError(
        f"attn's vLLM attention backend ({_ENV}=1) does not serve {what}. Unset {_ENV} to run vLLM's own "
        f"CPU attention (CPU_ATTN) for this configuration."
    )


def _announce():
    """One log line per process, when the first layer is built: attn, its version and its SIMD path."""
    global _announced
    if not _announced:
        _announced = True
        logger.info("attn %s (SIMD path %s) computes vLLM's CPU attention (%s=1)", attn.__version__,
                    attn.backends()["simd"], _ENV)


class AttnBackend(AttentionBackend):
    """vLLM's ``CPU_ATTN`` backend computed by attn (its name stays ``CPU_ATTN``: vLLM maps it back to the enum)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *_FLOAT8]  # float8: read in place, every path

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(32)]  # CPU_ATTN's (attn reads any page size: this keeps vLLM's block sizes)

    @classmethod
    def get_supported_head_sizes(cls):
        return list(_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # CPU_ATTN's; attn reads any strides

    @staticmethod
    def get_name():
        return "CPU_ATTN"

    @classmethod
    def supports_non_causal(cls):
        return True

    @classmethod
    def supports_sliding_window(cls):
        return True

    @classmethod
    def supports_sink(cls):
        return True

    @classmethod
    def supports_kv_connector(cls):
        return False  # the cache's inside of a block is attn's, not CPU_ATTN's

    @classmethod
    def supports_attn_type(cls, attn_type):
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls():
        return AttnImpl

    @staticmethod
    def get_builder_cls():
        return AttnMetadataBuilder


@dataclass
class AttnMetadata:
    """One step's attention metadata, shared by the layers of a KV cache group.

    vLLM's own fields (``num_actual_tokens`` .. ``causal``, as CPU_ATTN's)
    are kept for code that reads them; attn's are the plan and each new
    token's cache address.

    Attributes
    ----------
    plan : attn.integrations._vllm_plan.StepPlan
        The batch, checked once for all layers.
    slot_block, slot_offset : ndarray of int64, shape [T]
        Page and row in the page where new token t's key and value go
        (``slot_mapping[t] = slot_block[t] * block_size + slot_offset[t]``).
    num_pages, page_size : int
        The page pool the plan was checked against.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    plan: _vllm_plan.StepPlan
    slot_block: np.ndarray
    slot_offset: np.ndarray
    num_pages: int
    page_size: int


class AttnMetadataBuilder(AttentionMetadataBuilder[AttnMetadata]):
    """Builds each step's :class:`AttnMetadata` once for all layers of a KV cache group."""

    # vLLM's model runner puts the requests of one query token (decode) at the front of the batch,
    # where the kernel writes their rows into the layer's output in place (_vllm_plan.run_layer)
    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._pool_layer = None  # a layer of this group: its bound cache gives the pool's shape

    def _pool_shape(self):
        """``(num_pages, page_size)`` of this group's caches (read from a layer's bound cache tensor)."""
        if self._pool_layer is None:
            layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
            self._pool_layer = next(iter(layers.values()))
        cache = self._pool_layer.kv_cache
        if cache.ndim != 4:
            raise RuntimeError(f"attn's vLLM backend ({_ENV}=1): layer {self._pool_layer.layer_name} has no bound "
                               f"[num_blocks, num_kv_heads, block_size, 2 * head_size] cache (shape "
                               f"{tuple(cache.shape)})")
        return int(cache.shape[0]), int(cache.shape[2])

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AttnMetadata:
        """The step's metadata: its plan (lengths, block table checked against the pool, threads) and the
        cache address of each new token, computed once for every layer of the group.

        Parameters
        ----------
        common_prefix_len : int
            Unused (vLLM passes 0).
        common_attn_metadata : vllm.v1.attention.backend.CommonAttentionMetadata
            ``query_start_loc`` [B + 1], ``seq_lens`` [B], ``block_table_tensor`` [B, max_pages],
            ``slot_mapping`` [>= T], ``causal``.
        fast_build : bool
            Unused.

        Returns
        -------
        AttnMetadata
        """
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor):
            _refuse("per-token causality (a dynamic causal mask)")
        b = cm.num_reqs
        num_pages, page_size = self._pool_shape()
        plan = _vllm_plan.plan_step(cm.query_start_loc[: b + 1], cm.seq_lens[:b], cm.block_table_tensor[:b],
                                    num_pages, page_size, cm.causal, torch.get_num_threads())
        block, offset, keep = _split_slots(to_numpy(cm.slot_mapping[: plan.num_tokens], "slot_mapping"), page_size)
        if keep.size != plan.num_tokens:   # (vLLM gives every scheduled token a slot)
            raise RuntimeError(f"the step's slot_mapping leaves {plan.num_tokens - keep.size} of its "
                               f"{plan.num_tokens} tokens without a cache slot")
        return AttnMetadata(
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len, seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping, causal=bool(cm.causal), plan=plan,
            slot_block=block, slot_offset=offset,
            num_pages=num_pages, page_size=page_size,
        )


def _check_engine(vllm_config, kv_cache_dtype, attn_type, head_size, sliding_window, extra):
    """Refuse, when a layer is built, what this backend does not serve (:class:`UnservedConfigurationError`)."""
    if attn_type != AttentionType.DECODER:
        _refuse(f"{attn_type} attention (decoder self-attention only)")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in _FLOAT8:
        _refuse(f"kv_cache_dtype={kv_cache_dtype!r} (served: 'auto', {', '.join(map(repr, _FLOAT8))})")
    if head_size not in _HEAD_SIZES:
        _refuse(f"head_size={head_size} (served: {_HEAD_SIZES})")
    if extra:
        _refuse(f"the attention arguments {sorted(extra)}")
    dtype = vllm_config.model_config.dtype if vllm_config.model_config is not None else None
    if dtype is not None and dtype not in AttnBackend.supported_dtypes:
        _refuse(f"dtype={dtype} (served: float32, bfloat16, float16)")
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV cache transfer (kv_transfer_config): its cache blocks are laid out as attn writes them, "
                "not as CPU_ATTN's kernels and connectors read them")
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        _refuse("context parallelism (decode_context_parallel_size / prefill_context_parallel_size > 1)")
    if sliding_window is not None and vllm_config.attention_config.use_non_causal:
        _refuse("a sliding window in non-causal attention")


class AttnImpl(AttentionImpl[AttnMetadata]):
    """One attention layer computed by attn: the cache update and one kernel call per step.

    Parameters
    ----------
    num_heads, head_size : int
    scale : float
    num_kv_heads : int
        num_heads is a multiple (GQA/MQA).
    alibi_slopes : list of float [num_heads] or None
    sliding_window : int or None
        vLLM's window length (a query sees its last ``sliding_window`` keys).
    kv_cache_dtype : str
        "auto" (the model's dtype), or "fp8"/"fp8_e4m3" (float8 e4m3fn) or "fp8_e5m2": the layer's keys
        and values stored divided by its ``k_scale``/``v_scale``, saturated and rounded to nearest even,
        read in place (attn.flash's float8 caches, docs/flash_api.md).
    logits_soft_cap : float or None
    attn_type : str
        Decoder attention only.
    kv_sharing_target_layer_name : str or None
        The layer whose cache this one reads (vLLM then skips this layer's cache update).
    sinks : torch.Tensor [num_heads] or None
        Attention sinks (gpt-oss), read at each call.

    Raises
    ------
    UnservedConfigurationError
        For what is not served (see :mod:`attn.integrations.vllm`), naming it and ``ATTN_VLLM``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 **extra) -> None:
        _check_engine(get_current_vllm_config(), kv_cache_dtype, attn_type, head_size, sliding_window, extra)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.float8 = getattr(torch, _FLOAT8[kv_cache_dtype]) if kv_cache_dtype in _FLOAT8 else None
        self.attn_type = attn_type
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or 0
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        dtype = _numpy_dtype(torch.get_default_dtype())
        self.spec = _vllm_plan.layer_spec(num_heads, head_size, dtype, scale, sliding_window, logits_soft_cap,
                                          alibi_slopes, sinks)
        self._pages_of = (None,) * 5  # (cache tensor, K pages, V pages, their NumPy views)
        _announce()

    def _pages(self, kv_cache):
        """K and V of ``kv_cache`` [num_blocks, H_kv, block_size, 2E] as pages [num_blocks, block_size, H_kv, E]
        (:func:`~attn.integrations._vllm_plan.cache_pages`; a float8 cache, which vLLM allocates as
        bytes: viewed as its float8 dtype), and their NumPy
        views (the kernel's operands), made once per cache tensor."""
        if self._pages_of[0] is not kv_cache:
            k, v = _vllm_plan.cache_pages(kv_cache if self.float8 is None else kv_cache.view(self.float8),
                                          self.head_size)
            self._pages_of = (kv_cache, k, v, to_numpy(k, "k_pages"), to_numpy(v, "v_pages"))
        return self._pages_of[1:]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        """The layer's attention over the step's mixed batch, written into ``output``.

        Parameters
        ----------
        layer : vllm.model_executor.layers.attention.Attention
        query : torch.Tensor [num_tokens, num_heads, head_size]
        key, value : torch.Tensor [num_tokens, num_kv_heads, head_size]
            Already in the cache (:meth:`do_kv_cache_update`); unused here.
        kv_cache : torch.Tensor [num_blocks, num_kv_heads, block_size, 2 * head_size]
        attn_metadata : AttnMetadata or None
            None during vLLM's warm-up: nothing is computed.
        output : torch.Tensor [num_tokens, num_heads, head_size]
            Rows ``[:T]`` written (T the step's tokens).

        Returns
        -------
        output
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by attn's vLLM backend")
        if attn_metadata is None:
            return output
        md = attn_metadata
        n = md.plan.num_tokens
        if n == 0:
            return output
        if kv_cache.shape[0] != md.num_pages or kv_cache.shape[2] != md.page_size:
            raise RuntimeError(f"layer {layer.layer_name}'s cache {tuple(kv_cache.shape)} is not the pool of "
                               f"{md.num_pages} pages of {md.page_size} its step was planned for")
        k_np, v_np = self._pages(kv_cache)[2:]
        descales = (layer._k_scale_float, layer._v_scale_float) if self.float8 is not None else (None, None)
        _vllm_plan.run_layer(md.plan, self.spec, query[:n], k_np, v_np, *descales, out=output[:n])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Write the step's new keys and values into their cache slots: one compiled call for both
        (attn._cache_write.write_pages).

        Parameters
        ----------
        layer : vllm.model_executor.layers.attention.Attention
        key, value : torch.Tensor [num_tokens, num_kv_heads, head_size]
        kv_cache : torch.Tensor [num_blocks, num_kv_heads, block_size, 2 * head_size]
        slot_mapping : torch.Tensor of int64 [num_tokens]
            Token t goes to page ``slot // block_size``, row ``slot % block_size``
            (-1: a padding token, not written). The step's metadata has them
            split already; this tensor is used when there is none.
        """
        if kv_cache.numel() == 0:
            return
        k_pages, v_pages, k_np, v_np = self._pages(kv_cache)
        md = _step_metadata(layer.layer_name)
        if md is not None:
            block, offset, n = md.slot_block, md.slot_offset, md.plan.num_tokens
        else:
            block, offset, keep = _split_slots(to_numpy(slot_mapping, "slot_mapping"), kv_cache.shape[2])
            n = keep.size
            key, value = key[torch.from_numpy(keep)], value[torch.from_numpy(keep)]
        key, value = key[:n], value[:n]
        if self.float8 is not None:   # the bytes vLLM's own writer stores (float8_bytes_as_cpu_attn)
            fmt = str(self.float8)[len("torch."):]
            key = float8_bytes_as_cpu_attn(key, layer._k_scale_float, fmt)
            value = float8_bytes_as_cpu_attn(value, layer._v_scale_float, fmt)
            k_pages, v_pages = k_pages.view(torch.uint8), v_pages.view(torch.uint8)   # (the bytes, as they are)
            k_np, v_np = k_np.view(np.uint8), v_np.view(np.uint8)
        if _build._cache_write is None:   # (attn's extensions not built: two indexed copies)
            k_pages[torch.from_numpy(block), torch.from_numpy(offset)] = key
            v_pages[torch.from_numpy(block), torch.from_numpy(offset)] = value
            return
        _build._cache_write.write_pages(to_numpy(key, "key"), to_numpy(value, "value"), k_np, v_np, block, offset)


def _split_slots(slots, page_size):
    """``(page, row in the page, token index)`` of the non-negative entries of ``slots`` (int64 arrays)."""
    keep = np.flatnonzero(slots >= 0)
    kept = slots[keep].astype(np.int64)
    return kept // page_size, kept % page_size, keep


def float8_bytes_as_cpu_attn(x, scale, fmt):
    """``x`` as the float8 bytes vLLM's CPU_ATTN stores for it (``cpu_attn_reshape_and_cache``'s scalar
    quantizers, csrc/cpu/cpu_attn_fp8.hpp): times ``1 / scale`` in float32, saturated to the largest
    finite value, then the mantissa cut (rounded toward zero, not to nearest), 0 for +-0, e4m3fn's NaN
    byte never written. The same bytes whichever kernel reads the cache, so that ATTN_VLLM changes how
    the cache is read, not what it holds.

    Parameters
    ----------
    x : torch.Tensor, any float dtype
    scale : float
        The layer's ``k_scale`` or ``v_scale``.
    fmt : {"float8_e4m3fn", "float8_e5m2"}

    Returns
    -------
    torch.Tensor of uint8, x's shape
    """
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)  # 1 / scale, float32
    v = x.float() * inv
    top = _FLOAT8_MAX[fmt]
    v = v.clamp(-top, top)
    if fmt == "float8_e4m3fn":
        bits = (v * 2.0 ** -120).view(torch.int32)   # e4m3's exponent bias (7) in float32's place (127)
        sign = (bits >> 24) & 0x80
        out = sign | ((bits >> 20) & 0x7F).clamp(max=0x7E)
    else:
        bits = v.view(torch.int32)
        sign = (bits >> 24) & 0x80
        exp = ((bits >> 23) & 0xFF) - 127
        normal = sign | ((exp + 15) << 2) | ((bits >> 21) & 0x03)
        shift = (-14 - exp + 21).clamp(max=31)   # e5m2 subnormals: the significand shifted down
        sub = sign | (((bits & 0x7FFFFF) | 0x800000) >> shift).clamp(max=3)
        out = torch.where(exp < -14, torch.where(-14 - exp + 21 >= 32, sign, sub), normal)
    return torch.where(v == 0, 0, out).to(torch.uint8)


def _step_metadata(layer_name):
    """This step's :class:`AttnMetadata` of layer ``layer_name`` from vLLM's forward context, or None."""
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        md = md[0] if md else None
    if isinstance(md, dict):
        md = md.get(layer_name)
    return md if isinstance(md, AttnMetadata) else None


def _numpy_dtype(dtype):
    """The NumPy dtype attn reads a torch dtype as (bfloat16: ml_dtypes')."""
    from .._interop import to_numpy

    return to_numpy(torch.empty(0, dtype=dtype), "dtype").dtype
