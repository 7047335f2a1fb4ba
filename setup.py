"""Build attn's compiled modules, the Cython extensions listed in ``extensions`` below.

All metadata lives in ``pyproject.toml``; this file only declares the
extensions and probes the compiler for OpenMP.

Environment switches (read at build time):

``ATTN_DEBUG_BUILD=1``
    Cython ``boundscheck``/``wraparound``/``initializedcheck`` on, the C
    macro ``ATTN_DEBUG`` defined (every pointer the kernel dereferences is
    checked against the extent of its array), ``-O1 -g``.
``ATTN_SANITIZE=address`` (or a comma list, e.g. ``address,undefined``)
    Compile and link with ``-fsanitize=<value>`` (errors are not recoverable:
    the first one aborts), ``-O1 -g -fno-omit-frame-pointer``
    (see README, "Hardening", for how to run the tests under
    AddressSanitizer: libasan must be preloaded into Python).
``ATTN_NO_OPENMP=1``
    Build serially even when the compiler supports OpenMP.
``ATTN_DEBUG_INFO=1``
    Keep the debug information (``-g``) in an optimized build, e.g. for a
    profiler's source lines. Otherwise the optimized build has none
    (``-g0``: Python's own ``CFLAGS`` usually carry ``-g``, which made the
    extension ~3.4 MB, most of it DWARF); its symbol table stays, so
    profilers still name the functions. Debug and sanitizer builds keep ``-g``.
``ATTN_WERROR=1``
    Turn compiler warnings into errors (CI sets it: the build is warning-free
    with ``-Wall``, and a new warning fails the build). Cython's own warnings
    are errors too (``warning_errors``).
"""

import os
import sys
import tempfile
import textwrap

import numpy as np
from Cython.Build import cythonize
from Cython.Compiler import Options as CythonOptions
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("ATTN_DEBUG_BUILD", "") not in ("", "0")
SANITIZE = os.environ.get("ATTN_SANITIZE", "")
NO_OPENMP = os.environ.get("ATTN_NO_OPENMP", "") not in ("", "0")
DEBUG_INFO = os.environ.get("ATTN_DEBUG_INFO", "") not in ("", "0")
WERROR = os.environ.get("ATTN_WERROR", "") not in ("", "0")

OPENMP_PROBE = textwrap.dedent(
    """
    #include <omp.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        return n > 0 ? 0 : 1;
    }
    """
)


def _openmp_flags(compiler):
    """Return (compile_args, link_args) enabling OpenMP, or None."""
    if compiler.compiler_type == "msvc":
        return ["/openmp"], []
    return ["-fopenmp"], ["-fopenmp"]


def _compiler_supports_openmp(compiler):
    flags = _openmp_flags(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp_probe.c")
        with open(src, "w") as f:
            f.write(OPENMP_PROBE)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags[0])
            compiler.link_executable(
                objs, "omp_probe", output_dir=tmp, extra_postargs=flags[1]
            )
        except Exception:  # any compile or link failure means "no OpenMP"
            return False
    return True


class BuildExt(build_ext):
    """build_ext that enables OpenMP when the compiler has it."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # both extensions at once on 2+ cores (--parallel / -j still wins)
            self.parallel = min(2, os.cpu_count() or 1)

    def build_extensions(self):
        use_openmp = not NO_OPENMP and _compiler_supports_openmp(self.compiler)
        if not use_openmp:
            reason = "disabled by ATTN_NO_OPENMP" if NO_OPENMP else "not supported by this compiler"
            print(
                f"WARNING: attn: OpenMP {reason}; building the kernels single-threaded.",
                file=sys.stderr,
            )
        msvc = self.compiler.compiler_type == "msvc"
        for ext in self.extensions:
            if not msvc:
                ext.extra_compile_args += ["-Wall"] + (["-Werror"] if WERROR else [])
            if msvc:
                ext.extra_compile_args += ["/O2"]
            elif DEBUG or SANITIZE:
                # (a sanitizer build at -O1: the suite runs as fast under ASan+UBSan as at -O3
                # (179 vs 183 s on 2 cores) and the build takes half the time (129 vs 259-283 s))
                ext.extra_compile_args += ["-O1", "-g", "-fno-omit-frame-pointer"]
            else:
                ext.extra_compile_args += ["-O3"]
                if not (DEBUG_INFO or SANITIZE):
                    ext.extra_compile_args += ["-g0"]  # after Python's CFLAGS, so it overrides their -g
            if SANITIZE and not msvc:
                # -g: reports name file:line; -fno-sanitize-recover: the first error
                # aborts (UBSan would otherwise print and carry on)
                ext.extra_compile_args += [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all",
                                           "-g", "-fno-omit-frame-pointer"]
                ext.extra_link_args += [f"-fsanitize={SANITIZE}"]
            if use_openmp:
                cflags, lflags = _openmp_flags(self.compiler)
                ext.extra_compile_args += cflags
                ext.extra_link_args += lflags
        # Translate the .pyx files here, when extensions are being built, and not when setup.py is
        # imported: every build hook imports it (build requirements, metadata, sdist, the build
        # itself: three times for one pip install, four for sdist then wheel), and translating
        # _kernels.pyx alone costs about 10 s of CPU each time. force: the directives differ
        # between the optimized and the debug build, and a stale .c would not show it.
        translated = cythonize(self.extensions, compiler_directives=directives, force=True,
                               nthreads=self.parallel if self.parallel and self.parallel > 1 else 0)
        sources = {ext.name: ext.sources for ext in translated}
        for ext in self.extensions:  # the same objects (setuptools keeps its own state on them)
            ext.sources = sources[ext.name]
        super().build_extensions()


directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")]
if DEBUG:
    macros.append(("ATTN_DEBUG", "1"))

CythonOptions.warning_errors = WERROR

def _extension(name):
    """The compiled module attn.<name> from attn/<name>.pyx, with the kernel headers."""
    return Extension(f"attn.{name}", sources=[f"attn/{name}.pyx"], include_dirs=[np.get_include(), "attn/_src"],
                     define_macros=macros)


# The compiled layer, by role (attn/_kernels.pyx's header has the map); each cimports the
# ones before it (their .pxd), so it imports them when it loads.
extensions = [
    _extension("_problem"),           # the one problem builder: a validated call -> attn_problem
    _extension("_kernels"),           # the fused forward: algorithm, work plan, thread pool, SIMD path
    _extension("_kernels_backward"),  # the fused backward (FlashAttention-2)
    _extension("_casts"),             # bfloat16 <-> float32 of whole arrays
    _extension("_cache_write"),       # new keys and values into a paged cache (a serving engine's update)
    _extension("_fast_path"),         # the common call recognized in compiled code
    _extension("_kernels_testing"),   # the tests' hook: the SIMD path switched in-process
]

# one pool of threads for attn and NumPy's OpenBLAS (attn/_blas_pool.py): OpenBLAS's
# parallel jobs run on attn's OpenMP team; no NumPy headers
extensions.append(Extension("attn._blas_callback", sources=["attn/_blas_callback.pyx"], include_dirs=["attn/_src"]))

# the benchmark's yardsticks (FMA peak, DRAM read bandwidth): the application's, beside its suite
extensions.append(Extension("attn.apps.bench._yardsticks", sources=["attn/apps/bench/_yardsticks.pyx"],
                            include_dirs=[np.get_include(), "attn/_src", "attn/apps/bench"], define_macros=macros))

setup(
    ext_modules=extensions,  # translated by BuildExt.build_extensions
    cmdclass={"build_ext": BuildExt},
)
