"""An 8-bit KV cache for transformers' ``generate``: :class:`Q8Cache` (q8_0 rows, read in place by attn).

>>> from attn.integrations.transformers import Q8Cache, register   # doctest: +SKIP
>>> register()                                                       # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="attn")  # doctest: +SKIP
>>> model.generate(**inputs, cache=Q8Cache())               # doctest: +SKIP

Each layer quantizes the new keys and values of every step to llama.cpp's
q8_0 (8-bit values, a float32 scale per 32: :mod:`attn._quantized`) and hands
the attention function :class:`attn.Q8Tensor` views of all its positions. Only
attn's attention function reads them (``attn_implementation="attn"``): with
another implementation the first layer raises. Half the bytes of a bfloat16
cache stream through each decode step; the error this adds is bounded in
docs/kv_cache_int8.md.

Limits: every layer keeps all positions (a sliding-window layer does not drop
the keys outside its window; attention still applies the window), beam search
(``reorder_cache``) is not supported, and the model's attention must take its
keys and values from the cache unchanged (the Llama family does).
"""

import numpy as np
from transformers.cache_utils import Cache, DynamicLayer

from .. import _interop, _quantized


class Q8Layer(DynamicLayer):
    """One layer's keys and values as q8_0 rows in a buffer that doubles when full."""

    is_croppable = True

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self._k = self._v = None  # uint8 [B, H, capacity, row bytes]
        self._length = 0
        self.is_initialized = True

    def _grow(self, buffer, new_rows, dim):
        """``buffer`` with room for ``new_rows`` more positions (capacity doubled, rows copied)."""
        b, h = new_rows.shape[:2]
        need = self._length + new_rows.shape[2]
        if buffer is not None and buffer.shape[2] >= need:
            return buffer
        capacity = max(need, 2 * (0 if buffer is None else buffer.shape[2]), 64)
        grown = np.zeros((b, h, capacity, _quantized.row_bytes(dim)), np.uint8)
        if buffer is not None:
            grown[:, :, : self._length] = buffer[:, :, : self._length]
        return grown

    def update(self, key_states, value_states, *args, **kwargs):
        """Quantize the new ``[B, H_kv, T, E]`` states behind the others; return Q8Tensor views of all."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = _interop.to_numpy(key_states, "key_states", detach=True)
        v = _interop.to_numpy(value_states, "value_states", detach=True)
        self._k = self._grow(self._k, k, k.shape[-1])
        self._v = self._grow(self._v, v, v.shape[-1])
        end = self._length + k.shape[2]
        _quantized.quantize_into(k, self._k[:, :, self._length:end], "key_states")
        _quantized.quantize_into(v, self._v[:, :, self._length:end], "value_states")
        self._length = end
        self.keys = _quantized.Q8Tensor(self._k[:, :, :end], k.shape[-1])
        self.values = _quantized.Q8Tensor(self._v[:, :, :end], v.shape[-1])
        return self.keys, self.values

    def get_seq_length(self):
        return self._length if self.is_initialized else 0

    def reset(self):
        self._k = self._v = self.keys = self.values = None
        self._length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove):
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove < 0:
            self._length = max(self._length + tokens_to_remove, 0)
            self.keys = _quantized.Q8Tensor(self._k[:, :, : self._length], self.keys.dim)
            self.values = _quantized.Q8Tensor(self._v[:, :, : self._length], self.values.dim)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("Q8Cache does not reorder or select batch rows (beam search); "
                                  "use greedy or sampled generation, or a DynamicCache")

    batch_repeat_interleave = batch_select_indices = reorder_cache = _unsupported


class Q8Cache(Cache):
    """A transformers cache whose every layer stores q8_0 keys and values (:class:`Q8Layer`).

    Pass it as ``cache`` to ``model.generate`` or to the model's
    forward, with ``attn_implementation="attn"``.
    """

    def __init__(self):
        super().__init__(layer_class_to_replicate=Q8Layer)
