"""Memory policy: refuse up front what cannot fit, stating the size.

With overcommit an oversized ``np.empty`` succeeds and the process is killed
later, while the array is being filled; so every entry point asks here first.
Each backend says what it needs in its own ``check_memory(p)`` (attn/_backends/loop.py,
numpy.py, online.py, fused.py), which calls :func:`check_fits_in_memory`.
"""

import os

CHECK_MEMORY_ABOVE = 2**28  # bytes; smaller requests are never refused
NO_SCORES_HINT = "; use the cython backend without return_weights (it never builds the L x S scores)"


def _physical_memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return None


def available_memory_bytes():
    """Memory a new allocation can still get: Linux's MemAvailable + free swap.

    Falls back to the physical memory size where /proc/meminfo is missing.
    """
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        kib = int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])
        return kib * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return _physical_memory_bytes()


def check_fits_in_memory(n_elements, itemsize, copies, what, extra_bytes=0, hint=NO_SCORES_HINT):
    """MemoryError stating the size when ``copies`` arrays of ``n_elements`` would not fit.

    Parameters
    ----------
    n_elements, itemsize, copies : int
        The request: ``copies`` arrays of ``n_elements`` items of ``itemsize`` bytes.
    what : str
        What needs it, for the message.
    extra_bytes : int
        Bytes needed besides (the output).
    hint : str
        Appended to the message: how to avoid the allocation.
    """
    need = n_elements * itemsize * copies + extra_bytes
    if need < CHECK_MEMORY_ABOVE:
        return  # small: not worth reading /proc/meminfo on every call
    total = available_memory_bytes()
    if total is not None and need > total:
        raise MemoryError(
            f"{what} needs about {need / 2**30:.1f} GiB "
            f"({n_elements} elements x {itemsize} bytes x {copies}"
            + (f" + {extra_bytes} bytes of output" if extra_bytes else "")
            + f"), more than the {total / 2**30:.1f} GiB of memory available{hint}"
        )


def check_output_and_weights(p):
    """What a backend that keeps O(S) per row needs: the output, and the weights if returned.

    ``p`` is an :class:`attn._validation.AttentionProblem`.
    """
    n_batch = 1
    for d in p.batch:
        n_batch *= d
    out_bytes = n_batch * p.n_q * p.d_v * p.q.itemsize
    if p.return_weights:
        check_fits_in_memory(n_batch * p.n_q * p.n_k, p.q.itemsize, 1, "return_weights=True", out_bytes)
    else:
        check_fits_in_memory(0, p.q.itemsize, 1, "the output", out_bytes, hint="")
