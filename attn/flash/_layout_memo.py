"""The kernel calls of the last few paged (or float8) varlen layouts, reused while a layout repeats.

Every layer of a decode step calls :func:`attn.flash.flash_attn_varlen_func` with the same
``cu_seqlens``, ``block_table`` and operand layouts; only the values of q, k and v differ. Checking
the arguments and deriving the kernel's operands from them (each matrix's offsets, the pages' rows,
the key counts) is Python over small arrays, the larger part of a small decode call's fixed cost.
So the first call of a layout derives :func:`attn._backends.fused.cache_calls_into`'s calls (the
kernel calls :func:`attn._paged.forward` makes, writing into the output), and the calls after it
with the same layout run them.

The key holds everything the checks and the derivation read: q's, k's and v's shapes, strides,
dtypes and alignment, the index arrays' dtypes, shapes and bytes, and the other arguments with
their types. A hit is therefore a call that would pass the same checks and derive the same calls
(the same bits: they are the calls), and anything else misses and takes the full path, whose
checks raise where they should. The memo holds no caller's array: the kernel operands' arrays
are dropped (the call's own are put in) and the index arrays the calls read are private copies.
A few layouts (SIZE), the latest first, in one tuple read and replaced whole, so that threads see
one layout's calls or another's. The checks and the derivation read private copies of the index
arrays, whose bytes are the key's (:func:`snapshot`), so that a thread changing the caller's arrays
meanwhile cannot pair one layout's calls with another's key.
"""

import numpy as np

from .. import _backends, _build, _dtypes, _operands, _paged, _threads

#: The layouts kept: a model whose layers alternate (sliding-window and global layers) repeats two or more.
SIZE = 4
_memo = ()  # ((key, (impl, calls, packed) or False: the layout takes the full path), ...), the latest first


def _index_part(x):
    """An index array's part of the key, or None when it is not an ndarray (not memoized)."""
    if type(x) is not np.ndarray:
        return None
    return x.dtype, x.shape, x.tobytes()


def _typed(x):
    """A scalar argument's part of the key: its type with its value (True and 1, 1 and 1.0 differ: the
    checks may take one and refuse the other), a tuple's items so; None for anything else."""
    if x is None:
        return (type(None),)
    if isinstance(x, tuple):
        items = tuple(_typed(i) for i in x)
        return None if None in items else (tuple, items)
    if isinstance(x, (int, float, np.integer, np.floating)):   # (bool is an int)
        return type(x), x
    return None


def snapshot(cu_seqlens_q, cu_seqlens_k, block_table):
    """Private copies of the index arrays that are ndarrays (the others as they are: not memoized)."""
    return tuple(x.copy() if type(x) is np.ndarray else x for x in (cu_seqlens_q, cu_seqlens_k, block_table))


def key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap,
        block_table, num_threads):
    """The layout's key, or None where the call is not memoized (arguments other than plain ndarrays
    and Python scalars: the full path checks and converts them)."""
    arrays = (q, k, v)
    if any(type(a) is not np.ndarray or not a.flags.aligned or not a.dtype.isnative
           or _operands.element_strides(a) is None for a in arrays):
        return None   # (the full path converts or copies these; the calls are derived from its arrays)
    index = tuple(_index_part(x) for x in (cu_seqlens_q, cu_seqlens_k))
    table = None if block_table is None else _index_part(block_table)
    if None in index or (block_table is not None and table is None):
        return None
    scalars = tuple(_typed(s) for s in (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap))
    if None in scalars:
        return None
    impl = _backends.select_cache("auto")  # (None: attn's kernels not built, the pages are gathered)
    if impl is None or not hasattr(impl, "cache_calls_into"):
        return None
    return (impl, tuple((a.dtype, a.shape, a.strides) for a in arrays), index, table,
            scalars, _threads.check_num_threads(num_threads))


def calls_of(memo_key):
    """The memoized ``(impl, calls, packed)`` of this key; None on a miss, False when the layout takes
    the full path."""
    if memo_key is None:
        return None
    for k, entry in _memo:   # (one tuple, read once: another thread replaces it whole)
        if k == memo_key:
            return entry
    return None


def remember(memo_key, p):
    """Derive and keep the calls of checked problem ``p`` (a varlen call's: Bq = 1) under ``memo_key``."""
    global _memo
    if memo_key is None:
        return
    impl = memo_key[0]
    calls = None
    # (no row sees a key: attn._paged.forward answers without the kernel, and so does every repeat)
    runs_kernel = p.q.size > 0 and p.n_seq > 0 and p.k_len.any()
    if runs_kernel and p.v_descale is None and p.sinks is None and p.alibi_slopes is None:
        calls = impl.cache_calls_into(p, _kernel_out_dtype(p.out_dtype))
    packed = p.block_table is None  # (a packed float8 k, v: p's are [1, total_k, H_kv, E])
    entry = False if calls is None else (impl, tuple(_detached(c) for c in calls), packed)
    _memo = ((memo_key, entry),) + tuple(e for e in _memo if e[0] != memo_key)[:SIZE - 1]


def _kernel_out_dtype(dtype):
    """What the kernel writes for a query of ``dtype``: a 16-bit query's rows (bfloat16, float16) in
    its dtype (rounded once, as the full path rounds them), else the compute dtype."""
    return dtype if _dtypes.is_16bit(dtype) else _dtypes.compute_dtype(dtype)


def _detached(call):
    """A call of :func:`attn._backends.fused.cache_calls_into` without the problem's arrays (the
    operands' arrays are the caller's at each run) and with private copies of the index arrays."""
    n_rows, q_op, k_op, v_op, kwargs = call
    kwargs = dict(kwargs)
    if kwargs.get("paged") is not None:
        table, *rest = kwargs["paged"]
        kwargs["paged"] = (table.copy(), *rest)
    return n_rows, (None,) + q_op[1:], (None,) + k_op[1:], (None,) + v_op[1:], kwargs


def run(entry, q, k, v, into=None):
    """out [total_q, H, Ev] in q's dtype: the memoized calls over this call's q, k and v, written into
    ``into`` (a checked out: q's dtype and shape) when the kernel writes that dtype and ``into`` is
    C-contiguous and aligned (then ``into`` is returned), else into a new array."""
    impl, calls, packed = entry
    qk = _paged.kernel_query(q, k, v)[None]  # [total_q, H, E] -> [1, total_q, H, E]
    if packed:
        k, v = k[None], v[None]  # [total_k, H_kv, E] -> [1, total_k, H_kv, E]
    dtype = _kernel_out_dtype(q.dtype)
    if into is not None and into.dtype == dtype and into.flags.c_contiguous and into.flags.aligned:
        impl.run_cache_calls(calls, qk, k, v, into[None])  # [total_q, H, Ev] -> [1, total_q, H, Ev]
        return into
    out = _build._problem.empty_out((1, q.shape[0], q.shape[1], v.shape[-1]), dtype)  # [1, total_q, H, Ev]
    impl.run_cache_calls(calls, qk, k, v, out)
    return _dtypes.cast(out[0], q.dtype)
