"""attn: scaled dot-product attention for the CPU, four ways, held to PyTorch.

>>> import numpy as np, attn
>>> q = k = v = np.random.default_rng(0).normal(size=(2, 8, 128, 64))
>>> out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)   # fused kernel
>>> ref = attn.scaled_dot_product_attention(q, k, v, is_causal=True, backend="numpy")

Layers, each importing only the ones below it: :mod:`attn._api` (the public
functions) validates every argument (:mod:`attn._validation`, on
:mod:`attn._arrays` and :mod:`attn._integers`), picks a backend
(:mod:`attn._backends`: loop, numpy, online, cython) and runs it; the cython
backend (:mod:`attn._backends.fused`) describes each operand
(:mod:`attn._operands`) and is the one Python caller of the compiled layer
(loaded by :mod:`attn._build`), where one builder (``attn/_problem.pyx``)
turns every call into the kernels' problem (``attn/_kernels.pyx``,
``attn/_kernels_backward.pyx``). Packed variable-length batches
(:mod:`attn._varlen`) and attention over a paged or contiguous KV cache
(:mod:`attn._paged`, under FlashAttention's API :mod:`attn.flash`) call it
through the same backend. docs/kernel.md maps the call path.

Multi-head attention (:func:`multi_head_attention`, the torch drop-in
:class:`MultiheadAttention`) and :class:`KVCache` for decoding build on it
(an 8-bit cache holds :class:`Q8Tensor` rows, read in place by the kernel);
:mod:`attn.distributed` (ring attention over torch.distributed) spreads one
sequence over several processes or machines; :mod:`attn.integrations` plugs
attn into torch and transformers.

The applications built on the library (the benchmark suite, the article's
demos, SmolLM2 in NumPy, a server: :mod:`attn.apps`, run by ``python -m attn``)
stand apart from it: ``import attn`` imports none of them.
"""

from ._api import (
    masked_softmax, scaled_dot_product_attention, scaled_dot_product_attention_vjp, softmax,
)
from ._effective_keys import effective_keys
from ._quantized import Q8Tensor
from ._threads import backends, get_num_threads, set_num_threads
from ._varlen import varlen_attention, varlen_attention_vjp
from ._backends.matrix import causal_allowed
from .nn import KVCache, MultiheadAttention, multi_head_attention

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "MultiheadAttention",
    "Q8Tensor",
    "backends",
    "causal_allowed",
    "effective_keys",
    "get_num_threads",
    "masked_softmax",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "set_num_threads",
    "softmax",
    "varlen_attention",
    "varlen_attention_vjp",
]
