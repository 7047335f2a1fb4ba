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

and declares what it does beyond that, for the layers that call it (never probed):
``APPLIES_SINKS`` (joins the sinks to each row's sum itself), ``READS_Q8`` (reads
int8 key/value rows in place: :func:`read_by`), ``FORWARD_WRITES_LSE`` (has
``forward_and_lse(p)``, one pass for out and lse).

:func:`select` is the one place that turns ``backend=...`` into a module.
"""

import dataclasses

from .. import _build, _memory, _quantized
from . import fused, loop, matrix, online

ATTENTION = {"loop": loop, "numpy": matrix, "online": online, "cython": fused}
ATTENTION_NAMES = ("auto",) + tuple(ATTENTION)
SOFTMAX_NAMES = ("auto", "numpy", "cython")


def _check_name(backend, names):
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")


def _require_kernels():
    if not _build.HAVE_CYTHON:
        raise RuntimeError(
            "backend='cython' requested but the compiled extension attn._kernels "
            f"is not importable ({_build.CYTHON_IMPORT_ERROR}); "
            "reinstall attn with a C compiler available"
        )


def select(p, name=None):
    """The backend module that runs attention problem ``p``.

    ``name``: the backend to run (default ``p.backend``, as the caller asked).
    "auto" is the fused kernel when it is built and can run ``p``, else numpy.
    Checks that the chosen backend's memory fits; ``p`` is not changed.
    """
    name = p.backend if name is None else name
    _check_name(name, ATTENTION_NAMES)
    if name == "auto":
        name = "cython" if _build.HAVE_CYTHON and fused.cannot_run(p) is None else "numpy"
    if name == "cython":
        _require_kernels()
    impl = ATTENTION[name]
    reason = impl.cannot_run(p)
    if reason is not None:
        raise ValueError(f"backend={name!r} cannot {reason}; use backend='numpy' or 'loop'")
    impl.check_memory(p)
    return impl


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
        name = "cython" if _build.HAVE_CYTHON else "numpy"
    if name == "cython":
        _require_kernels()
    copies = 3 if name == "numpy" else 1  # numpy: logits, exponentials, result
    _memory.check_fits_in_memory(p.x.size, p.x.itemsize, copies,
                                 f"masked_softmax (backend={name!r})", hint="")
    return ATTENTION[name]


__all__ = ["ATTENTION", "fused", "loop", "matrix", "online", "read_by", "select", "select_softmax"]
