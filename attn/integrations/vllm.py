"""attn as vLLM's attention backend on the CPU (opt-in: ``ATTN_VLLM=1``).

>>> # pip install attn into vLLM's environment, then, in the shell that starts vLLM:
>>> # ATTN_VLLM=1 python my_offline_script.py        (vLLM's Python API: LLM(...).generate(...))

attn declares a vLLM general plugin in its package metadata
(``[project.entry-points."vllm.general_plugins"]``: ``attn =
"attn.integrations.vllm:register"``). vLLM calls :func:`register` in each
of its processes (the front end, the engine core, the workers) before it
builds the model. With ``ATTN_VLLM=1`` in the environment, on vLLM's CPU
platform, at a tested vLLM version (0.32.x), :func:`register` points vLLM's
``CPU_ATTN`` backend at attn's (``register_backend(AttentionBackendEnum.
CPU_ATTN, "attn.integrations._vllm_backend.AttnBackend")``, vLLM's own
registry API; no vLLM module is patched). Otherwise it does nothing and
vLLM runs its own kernel: ``ATTN_VLLM`` unset (or ``0``), another platform,
another vLLM version (a warning says so). ``VLLM_PLUGINS`` (vLLM's
allow-list of plugin names) can also leave ``attn`` out.

The backend (:mod:`attn.integrations._vllm_backend`) keeps the name
``CPU_ATTN`` and its cache tensor, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` per layer, which it writes itself (each block's keys of a head, then its
values, as CPU_ATTN splits it) and reads in place as FlashAttention's
pages. One attn kernel call per layer and step covers the
whole batch, prefill chunks and decode rows together
(:func:`attn.flash.flash_attn_varlen_func`'s computation with a block
table); what depends on the step alone (lengths, block table, cache
addresses, thread count) is computed once per step by the metadata builder
(:mod:`attn.integrations._vllm_plan`). The kernel runs on the worker's
``torch.get_num_threads()`` threads.

Served: decoder self-attention in float32, bfloat16 and float16; GQA/MQA;
head sizes 32 to 512 (CPU_ATTN's list, 80 and 112 included); per-layer
sliding windows (vLLM's ``sliding_window`` w is FlashAttention's
``window_size=(w - 1, 0)``), softcap, ALiBi, attention sinks; chunked
prefill, prefix caching, mixed prefill/decode batches; vLLM's compiled mode
and ``enforce_eager``. Refused when the engine builds the model (an
:class:`~attn.integrations._vllm_backend.UnservedConfigurationError` naming
the configuration and ``ATTN_VLLM``): ``kv_cache_dtype`` other than
``"auto"`` (attn has no fp8 cache reader), encoder and encoder-decoder
attention, other head sizes, KV cache transfer connectors (the inside of a
cache block is attn's layout, not CPU_ATTN's), context parallelism, a dynamic
causal mask. See docs/vllm.md.

``import attn.integrations.vllm`` imports neither vllm nor torch; the
backend classes are imported by vLLM when it builds the model.
"""

import logging
import os

import attn

ENV = "ATTN_VLLM"
#: vLLM versions this backend is tested with (major.minor prefixes)
TESTED_VLLM = ("0.32",)
#: the class path vLLM's registry is given for CPU_ATTN
BACKEND_PATH = "attn.integrations._vllm_backend.AttnBackend"

_ON, _OFF = ("1",), ("", "0")
logger = logging.getLogger("vllm.attn")  # a name under vLLM's logger: vLLM's logging configuration prints it


def enabled(environ=None):
    """Whether ``ATTN_VLLM`` asks for attn's backend: ``1`` yes; unset, empty or ``0`` no.

    Parameters
    ----------
    environ : mapping, optional
        Default ``os.environ``.

    Returns
    -------
    bool

    Raises
    ------
    ValueError
        Any other value (a typo should not silently leave vLLM's kernel in place).
    """
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV}={value!r}: set {ENV}=1 to run vLLM's CPU attention with attn, or unset it (or 0)")


def tested_version(version):
    """Whether vLLM ``version`` (e.g. ``"0.32.0"``) is in the tested range :data:`TESTED_VLLM`."""
    return any(version == t or version.startswith(t + ".") for t in TESTED_VLLM)


def register():
    """vLLM's general-plugin entry point: install attn as ``CPU_ATTN`` when ``ATTN_VLLM=1`` (see the module).

    Called by vLLM in each of its processes (several times is harmless).

    Returns
    -------
    bool
        Whether attn's backend is registered in this process.
    """
    if not enabled():
        return False
    import vllm
    from vllm.platforms import current_platform

    if not tested_version(vllm.__version__):
        logger.warning("%s=1, but attn %s's vLLM backend is tested with vLLM %s, not %s: vLLM's own CPU attention "
                       "runs", ENV, attn.__version__, " / ".join(t + ".x" for t in TESTED_VLLM), vllm.__version__)
        return False
    if not current_platform.is_cpu():
        logger.warning("%s=1, but attn serves vLLM's CPU platform only, not %s: vLLM's own attention runs", ENV,
                       type(current_platform).__name__)
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    logger.debug("attn %s registered as vLLM's CPU_ATTN (%s)", attn.__version__, BACKEND_PATH)
    return True


def __getattr__(name):
    """The backend classes (``AttnBackend``, ``AttnImpl``, ``AttnMetadataBuilder``, ``AttnMetadata``,
    ``UnservedConfigurationError``), imported on first use (they import vllm and torch)."""
    if name in ("AttnBackend", "AttnImpl", "AttnMetadataBuilder", "AttnMetadata", "UnservedConfigurationError"):
        from . import _vllm_backend

        return getattr(_vllm_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
