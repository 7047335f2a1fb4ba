"""The memory-safety nets are live: they catch a deliberately bad offset.

The compiled kernel trusts the per-matrix offsets and strides that
attn/_operands.py computes (and that the compiled fast path, ``sdpa_fast``,
computes for the common call). These tests corrupt the offsets of
attn/_operands.py on purpose (by wrapping ``attn._operands.matrix_offsets``;
``return_lse=True`` keeps the call off the fast path, which does not use
them) and check that

* the debug build (``ATTN_DEBUG_BUILD=1``) raises IndexError instead of
  reading out of bounds, and
* an AddressSanitizer build (``ATTN_SANITIZE=address``, run with libasan
  preloaded; see README, "Hardening") reports a heap-buffer-overflow, also
  when it has the debug checks too (.ci/run's checked build): there an array
  whose shape claims more than its buffer holds (``as_strided``) gets past the
  debug checks, which trust the array's extent, and ASan catches the read.

In a normal optimized build they are skipped: there the out-of-bounds read
would be real undefined behaviour. The other tests of the suite are what
must run clean under both builds.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attn
from attn import _operands

HAVE_CYTHON = attn.backends()["cython"]
DEBUG_BUILD = HAVE_CYTHON and attn.backends()["debug"]


def asan_loaded():
    """True when the AddressSanitizer runtime is mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def _shift_first_offsets(monkeypatch, shift):
    """Make the first matrix_offsets call of each kernel call point ``shift`` elements further."""
    real = _operands.matrix_offsets
    state = {"n": 0}

    def shifted(a, batch, *args, **kwargs):
        off = real(a, batch, *args, **kwargs)
        state["n"] += 1
        return off + shift(a) if state["n"] == 1 else off

    monkeypatch.setattr(_operands, "matrix_offsets", shifted)
    return state


@pytest.mark.skipif(not DEBUG_BUILD, reason="needs the debug build (ATTN_DEBUG_BUILD=1)")
@pytest.mark.parametrize("where", ["past_end", "before_start"])
def test_debug_build_catches_out_of_bounds_attention(monkeypatch, where):
    q = np.ones((2, 64, 16))
    shift = (lambda a: a.size) if where == "past_end" else (lambda a: -3 * a.shape[-1])
    state = _shift_first_offsets(monkeypatch, shift)
    with pytest.raises(IndexError, match="out-of-bounds"):
        attn.scaled_dot_product_attention(q, q, q, backend="cython", return_lse=True)
    assert state["n"] >= 1


@pytest.mark.skipif(not DEBUG_BUILD, reason="needs the debug build (ATTN_DEBUG_BUILD=1)")
def test_debug_build_catches_out_of_bounds_softmax(monkeypatch):
    x = np.ones((8, 300))
    _shift_first_offsets(monkeypatch, lambda a: a.size)
    with pytest.raises(IndexError, match="out-of-bounds"):
        attn.masked_softmax(x, backend="cython")


CANARY = textwrap.dedent(
    """
    import numpy as np
    import attn
    from attn import _operands

    real = _operands.matrix_offsets
    calls = []

    def shifted(a, batch, *args, **kwargs):
        calls.append(1)
        off = real(a, batch, *args, **kwargs)
        return off + a.size if len(calls) == 1 else off  # query matrix 0 starts at its end

    _operands.matrix_offsets = shifted
    q = np.ones((1, 64, 16))  # 8 KiB: a plain malloc, followed by an ASan redzone
    try:
        attn.scaled_dot_product_attention(q, q, q, backend="cython", num_threads=1, return_lse=True)
    except IndexError:
        print("DEBUG-BUILD-CAUGHT")
    else:
        print("NOT-CAUGHT")
    """
)


#: An array whose shape claims more than its buffer holds (``as_strided`` checks nothing): its byte
#: extent agrees with its shape, so a debug build's checks pass, and the kernel reads key and value
#: rows past the buffer's end, which only AddressSanitizer can see.
CANARY_PAST_BUFFER = textwrap.dedent(
    """
    import numpy as np
    import attn

    buf = np.ones(600)  # 4800 bytes: a plain malloc, followed by an ASan redzone
    q = np.lib.stride_tricks.as_strided(buf, shape=(1, 64, 16), strides=(8192, 128, 8))  # 1024 elements
    attn.scaled_dot_product_attention(q, q, q, backend="cython", num_threads=1)
    print("NOT-CAUGHT")
    """
)


@pytest.mark.skipif(not (HAVE_CYTHON and asan_loaded()), reason="needs an ATTN_SANITIZE=address build run with libasan")
def test_asan_catches_out_of_bounds_read():
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    proc = subprocess.run([sys.executable, "-c", CANARY], env=env, capture_output=True, text=True,
                          timeout=120)
    if DEBUG_BUILD:
        assert "DEBUG-BUILD-CAUGHT" in proc.stdout, proc.stderr[-2000:]
    else:
        assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, (proc.stdout, proc.stderr[-2000:])
        assert proc.returncode != 0


@pytest.mark.skipif(not (HAVE_CYTHON and asan_loaded()), reason="needs an ATTN_SANITIZE=address build run with libasan")
def test_asan_catches_a_read_past_the_buffer_in_any_asan_build():
    """AddressSanitizer is live in the kernel also in a build that has the debug checks too
    (.ci/run's checked build), where they catch the bad offset above first."""
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    proc = subprocess.run([sys.executable, "-c", CANARY_PAST_BUFFER], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, (proc.stdout, proc.stderr[-2000:])
    frame0 = next(line for line in proc.stderr.splitlines() if line.strip().startswith("#0 "))
    assert "attn" in frame0, proc.stderr[-2000:]  # in the kernel (attn/_src/..., attn/_kernels...)
    assert "NOT-CAUGHT" not in proc.stdout
    assert proc.returncode != 0
