"""The pages a benchmark's memory sits on: 4 KiB pages or 2 MiB (transparent huge) pages.

A streaming read pays a page walk, and the hardware prefetchers stop, at every page boundary, so
the page size moves the read bandwidth a core sees: on the Zen 4 VM of docs/performance.md one
thread read 24 GB/s of 4 KiB pages against 31 GB/s of 2 MiB pages (2 threads: 32 against 35).
With the kernel's transparent huge pages in ``madvise`` mode (that VM's, and a common default) a
mapping gets 2 MiB pages only when advised: NumPy advises its large arrays, torch's allocator
does not (unless ``THP_MEM_ALLOC_ENABLE=1``), so a KV cache torch allocates (vLLM's) sits on
4 KiB pages. That read has no software prefetch; a kernel that prefetches across pages reads 4 KiB
pages faster, so the machine's limit is the read of 2 MiB pages. :func:`zeros` makes either kind
(the vLLM kernel benchmark's ``--hugepages`` caches, its read yardstick), :func:`huge_share` says
which one a buffer got.

Linux only (``/proc/self/smaps``, ``madvise``); elsewhere ``huge_share`` is None and ``zeros``
gives whatever the system's pages are.
"""

from __future__ import annotations

import mmap
import re

import numpy as np

HUGE = 2 << 20   # a transparent huge page on x86-64


def zeros(nbytes: int, huge: bool) -> np.ndarray:
    """``nbytes`` zero bytes in an anonymous mapping of their own, advised for 2 MiB pages
    (``huge``: ``MADV_HUGEPAGE``) or against them (``MADV_NOHUGEPAGE``), every page touched (so
    that it exists, of the advised size where the kernel could give it).

    Parameters
    ----------
    nbytes : int
        Bytes, > 0.
    huge : bool
        2 MiB pages (True) or 4 KiB pages (False).

    Returns
    -------
    numpy.ndarray of uint8, shape (nbytes,): a view of the mapping (it lives as long as the array).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    span = nbytes + HUGE   # room to start on a 2 MiB boundary (a huge page must be aligned)
    m = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        m.madvise(advice)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE
    buf = whole[start:start + nbytes]
    buf[::mmap.PAGESIZE] = 0   # one write a 4 KiB page: the fault maps the advised page size
    return buf


def huge_share(buffer) -> float | None:
    """The share of ``buffer``'s resident bytes on huge pages (AnonHugePages over Rss of the
    mappings it overlaps, from ``/proc/self/smaps``); None where that file cannot be read or
    nothing of the buffer is resident. A mapping wider than the buffer counts whole.

    ``buffer``: a NumPy array or anything with ``data_ptr()`` and ``nbytes`` (a torch tensor).
    """
    if hasattr(buffer, "data_ptr"):
        lo, n = buffer.data_ptr(), buffer.untyped_storage().nbytes()
    else:
        lo, n = buffer.ctypes.data, buffer.nbytes
    hi = lo + n
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    rss = huge = 0
    overlaps = False
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = int(head.group(1), 16), int(head.group(2), 16)
            overlaps = start < hi and lo < end
            continue
        if overlaps:
            field = re.match(r"^(Rss|AnonHugePages):\s+(\d+) kB", line)
            if field:
                kib = int(field.group(2))
                if field.group(1) == "Rss":
                    rss += kib
                else:
                    huge += kib
    return huge / rss if rss else None
