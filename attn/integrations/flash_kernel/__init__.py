"""attn.flash as a `kernels` package kernel: the directory transformers loads for ``attn_implementation="attn/flash"``.

transformers sends every implementation whose name contains "flash" down its
FlashAttention path, and loads a name shaped like a hub repository
(``org/name``) through the ``kernels`` package, which maps a repository id to
a local directory with ``LOCAL_KERNELS=repo_id=path``. This directory is such
a kernel (``metadata.json`` beside this file) inside attn's own package:
:func:`attn.integrations.transformers.register_flash` points ``LOCAL_KERNELS``
here. Nothing is downloaded.

The functions are attn.flash's, with transformers' name for attention sinks
(``s_aux``, gpt-oss) added to their signatures so that transformers passes them.

Where ``ATTN_FLASH_CALLS_FILE`` names a file in the environment, the first
``CALLS_LOGGED`` calls each append one byte to it: ``python -m attn serve`` counts
the calls that answered its warm-up request that way, also where transformers runs
the model in a process of its own (5.25's engine process).
"""

import os

from attn import flash as _flash

#: The environment variable naming the file each call appends a byte to, and how many calls do.
CALLS_FILE = "ATTN_FLASH_CALLS_FILE"
CALLS_LOGGED = 4096
_calls_left = None  # calls still to log (None: the environment not read yet)
_calls_fd = -1       # the file, opened once for appending while calls are logged


def _log_call():
    global _calls_left, _calls_fd
    if _calls_left is None:
        _calls_left = CALLS_LOGGED if os.environ.get(CALLS_FILE) else 0
        if _calls_left:
            _calls_fd = os.open(os.environ[CALLS_FILE], os.O_WRONLY | os.O_APPEND)
    if _calls_left > 0:
        _calls_left -= 1
        os.write(_calls_fd, b".")
        if _calls_left == 0:
            os.close(_calls_fd)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    """:func:`attn.flash.flash_attn_func`; ``s_aux``: attention sinks [nheads]."""
    _log_call()
    return _flash.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, sinks=s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, s_aux=None):
    """:func:`attn.flash.flash_attn_varlen_func`; ``s_aux``: attention sinks [nheads]."""
    _log_call()
    return _flash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                         softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                         return_attn_probs, block_table, sinks=s_aux)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, s_aux=None):
    """:func:`attn.flash.flash_attn_with_kvcache`; ``s_aux``: attention sinks [nheads]."""
    _log_call()
    return _flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                          cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                          window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                          return_softmax_lse, sinks=s_aux)
