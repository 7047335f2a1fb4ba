"""The backends: one module per form of the same computation, and the choice between them.

Each module is named for its form; the ``backend=`` names users pass are the table's first column.

=========  ======================================================  ==========================
name       how it runs                                             extra memory
=========  ======================================================  ==========================
loop       :mod:`.loop`: a Python loop over query rows             O(S) per row
numpy      :mod:`.matrix`: matrix products over the whole batch    3 x the L x S scores
online     :mod:`.online`: NumPy over key blocks, running max/sum  O(L x block) per matrix
cython     :mod:`.fused`: the fused OpenMP kernel (attn._kernels)  per-thread tiles only
=========  ======================================================  ==========================

Every module has the same three functions:

``cannot_run(p)``
    None, or what the backend cannot do for problem ``p`` (e.g. dropout).
``check_memory(p)``
    MemoryError (:mod:`attn._memory`) when what the backend allocates would not fit.
``forward(p)``
    ``(out, weights or None)`` for a validated :class:`attn._validation.AttentionProblem`.

and two for gradients (:mod:`attn._gradients`, :func:`attn.scaled_dot_product_attention_vjp`):

``forward_lse(p)``
    the log-sum-exp [*batch, L] of each row's scaled, masked scores (-inf: no visible key).
``backward(p, out, lse, keep, dout, want_ds)``
    ``(dq, dk, dv, ds or None)`` over the batch, one key/value head per query
    head, P recomputed from ``lse`` (loop: per row; numpy: matrices; online:
    key blocks, FlashAttention-2 in NumPy; cython: ``attn._kernels_backward``).

and declares what it does beyond that, for the layers that call it (never probed, never
compared by identity):

``APPLIES_SINKS``
    joins the sinks to each row's sum itself (else :mod:`attn._variants` joins them afterwards).
``READS_Q8``
    reads int8 (q8_0) key/value rows in place (:func:`read_by`).
``FORWARD_WRITES_LSE``
    has ``forward_and_lse(p)``, one pass for out and lse.
``RUNS_VARLEN``
    runs a packed variable-length batch (:mod:`attn._varlen`) in one call, with
    ``varlen_forward(p)`` and ``varlen_backward(p, out, lse, dout)``; the others run each
    sequence as its own call.
``RUNS_CACHE``
    runs attention over a key/value cache (:mod:`attn._paged`: contiguous or in pages) in
    place, with ``cache_forward(p, with_lse)``; for the others the pages are gathered first.
``unavailable(gradients=False)``
    None, or the compiled extension it needs (with ``gradients``: for its backward too)
    that is not importable, and why: ``(extension, error)``, read at each call.

:func:`select` is the one place that turns ``backend=...`` into a module, for a forward or
(``gradients=True``) a forward and its backward; :func:`select_varlen`, :func:`select_cache`
and :func:`select_softmax` are the same choice for a packed batch, a key/value cache and a
masked softmax.
"""

import dataclasses

from .. import _memory, _quantized
from . import fused, loop, matrix, online

ATTENTION = {"loop": loop, "numpy": matrix, "online": online, "cython": fused}
ATTENTION_NAMES = ("auto",) + tuple(ATTENTION)
SOFTMAX_NAMES = ("auto", "numpy", "cython")
CACHE_NAMES = ("auto", "cython", "numpy")


def _check_name(backend, names):
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")


def _auto(p, gradients):
    """The backend "auto" names: the fused kernel when it is built (``gradients``: its backward
    too) and can run ``p`` (None: no problem to ask about), else numpy."""
    if fused.unavailable(gradients) is None and (p is None or fused.cannot_run(p) is None):
        return "cython"
    return "numpy"


def _require_built(name):
    """RuntimeError when backend ``name``'s compiled extension is not importable."""
    missing = ATTENTION[name].unavailable()
    if missing is not None:
        raise RuntimeError(
            f"backend={name!r} requested but the compiled extension {missing[0]} "
            f"is not importable ({missing[1]}); "
            "reinstall attn with a C compiler available"
        )


def select(p, gradients=False):
    """The backend module that runs attention problem ``p`` (``p.backend``, as the caller asked).

    "auto" is the fused kernel when it is built and can run ``p``, else numpy.
    ``gradients``: the backward will run too (:mod:`attn._gradients`): "auto" is the fused
    kernel only when its backward is built too, and an explicit backend whose backward is not
    built is a RuntimeError now. Checks that the chosen backend's memory fits; ``p`` is not changed.
    """
    name = p.backend
    _check_name(name, ATTENTION_NAMES)
    if name == "auto":
        name = _auto(p, gradients)
    _require_built(name)
    impl = ATTENTION[name]
    reason = impl.cannot_run(p)
    if reason is not None:
        raise ValueError(f"backend={name!r} cannot {reason}; use backend='numpy' or 'loop'")
    impl.check_memory(p)
    missing = impl.unavailable(gradients=True) if gradients else None
    if missing is not None:
        raise RuntimeError(
            f"backend={name!r} gradients need the compiled extension {missing[0]}, "
            f"which is not importable ({missing[1]}); use backend='numpy'"
        )
    return impl


def select_varlen(p, gradients=False):
    """How packed variable-length batch ``p`` (:class:`attn._varlen.VarlenProblem`) runs: ``(impl, name)``.

    ``impl``: the backend module that runs the whole batch in one call (one that ``RUNS_VARLEN``),
    the one ``p.backend`` names or, for "auto", the fused kernel when it is built (``gradients``:
    its backward too); else None, and each sequence runs as its own call with backend ``name``
    ("numpy" for "auto"). RuntimeError when the named backend's compiled extension is not importable.
    """
    if p.backend == "auto":
        impl = ATTENTION[_auto(None, gradients)]
        return (impl if impl.RUNS_VARLEN else None), "numpy"
    impl = ATTENTION[p.backend]
    if not impl.RUNS_VARLEN:
        return None, p.backend
    if impl.unavailable(gradients) is not None:
        _kernels_missing(p.backend)
    return impl, p.backend


def select_cache(backend):
    """The backend module that runs attention over a key/value cache (:class:`attn._paged.CacheProblem`)
    in place (one that ``RUNS_CACHE``): the one ``backend`` names or, for "auto", the fused kernel
    when it is built; else None, and the pages are gathered and each sequence runs the NumPy
    reference. RuntimeError when the named backend's compiled extension is not importable."""
    _check_name(backend, CACHE_NAMES)
    name = _auto(None, gradients=False) if backend == "auto" else backend
    impl = ATTENTION[name]
    if not impl.RUNS_CACHE:
        return None
    if impl.unavailable() is not None:
        _kernels_missing(name)
    return impl


def _kernels_missing(name):
    """The RuntimeError of a packed batch or a cache whose named backend's kernels are not importable."""
    raise RuntimeError(f"backend={name!r} requested but attn's compiled kernels are not importable; "
                       "use backend='numpy'")


def read_by(p, impl):
    """``p`` as backend ``impl`` reads it: int8 (q8_0) key and value rows in place where the
    backend ``READS_Q8`` (the fused kernel), else dequantized once (float32), whose values
    define the result."""
    if impl.READS_Q8 or not _quantized.is_q8(p.k):
        return p
    return dataclasses.replace(p, k=p.k.dequantize(), v=p.v.dequantize())


def select_softmax(p):
    """The backend module for masked-softmax problem ``p``: "numpy" or the fused "cython" (``p`` unchanged)."""
    _check_name(p.backend, SOFTMAX_NAMES)
    name = p.backend
    if name == "auto":
        name = _auto(None, gradients=False)
    _require_built(name)
    copies = 3 if name == "numpy" else 1  # numpy: logits, exponentials, result
    _memory.check_fits_in_memory(p.x.size, p.x.itemsize, copies,
                                 f"masked_softmax (backend={name!r})", hint="")
    return ATTENTION[name]


__all__ = ["ATTENTION", "fused", "loop", "matrix", "online", "read_by", "select", "select_cache",
           "select_softmax", "select_varlen"]
