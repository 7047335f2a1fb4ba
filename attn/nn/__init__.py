"""Multi-head attention built on :func:`attn.scaled_dot_product_attention`.

* :mod:`.multi_head` -- :func:`multi_head_attention`, the paper's algorithm on arrays
  (project, split heads, attend, merge, project), GQA and KV-cache decoding;
* :mod:`.module` -- :class:`MultiheadAttention`, a drop-in for ``torch.nn.MultiheadAttention``
  (torch's mask conventions, weights and ``state_dict``);
* :mod:`.kv_cache` -- :class:`KVCache`, the keys and values of past positions.
"""

from .kv_cache import KVCache
from .module import MultiheadAttention
from .multi_head import multi_head_attention

__all__ = ["KVCache", "MultiheadAttention", "multi_head_attention"]
