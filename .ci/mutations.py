"""Tests of the tests: deliberate bugs in the operand offsets, the mask kinds and the causal offsets.

Each mutation is applied to the source, the extension rebuilt when needed, the
kernel-facing test files run, and the source restored; every mutation must
make the suite fail. Not part of CI (it rebuilds six times, ~6 minutes):
    python .ci/mutations.py        (from a clone with an editable install)
"""
import os
import subprocess
import sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTATIONS = [
  ("offset: fill_offsets (both paths) one matrix off on a lead dim", "attn/_problem.pyx",
   "            new = (idx[d] // div[d]) * step[d]",
   "            new = (((idx[d] + 1) % batch[d]) // div[d]) * step[d]"),
  ("offset: fill_offsets maps query head h to kv head (h + 1) // group (GQA)", "attn/_problem.pyx",
   "            new = (idx[d] // div[d]) * step[d]",
   "            new = ((min(idx[d] + 1, batch[d] - 1) if div[d] > 1 else idx[d]) // div[d]) * step[d]"),
  ("mask kind: mask_kind (both paths) swaps bool and additive", "attn/_problem.pyx",
   "    return ATTN_MASK_BOOL if cnp.PyArray_TYPE(<cnp.ndarray>mask) == cnp.NPY_BOOL else ATTN_MASK_ADD",
   "    return ATTN_MASK_ADD if cnp.PyArray_TYPE(<cnp.ndarray>mask) == cnp.NPY_BOOL else ATTN_MASK_BOOL"),
  ("mask kind: fast path takes a float padding mask as bool", "attn/_fast_path.pyx",
   "    cdef int t = cnp.PyArray_TYPE(m), md = m.ndim, lead, d, mk = mask_kind(m)",
   "    cdef int t = cnp.PyArray_TYPE(m), md = m.ndim, lead, d, mk = ATTN_MASK_BOOL"),
  ("causal: the builder (both paths) hands the kernel offset + 1", "attn/_problem.pyx",
   "    a.causal_offset = causal_offset if a.causal else 0",
   "    a.causal_offset = causal_offset + 1 if a.causal else 0"),
  ("causal: the one decision (both paths) lower-right offset - 1", "attn/_validation.py",
   "    return 0 if alignment == \"upper_left\" else n_k - n_q",
   "    return 0 if alignment == \"upper_left\" else n_k - n_q - 1"),
]
TESTS = ["tests/test_fast_path_layouts.py", "tests/test_decode_kernel.py", "tests/test_sdpa_vs_torch.py",
         "tests/test_layouts.py", "tests/test_kernel_paths.py", "tests/test_edges.py", "tests/test_backward.py"]
def build():
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."],
                          cwd=ROOT, capture_output=True, text=True).returncode
for name, path, old, new in MUTATIONS:
    p = os.path.join(ROOT, path); src = open(p).read()
    if src.count(old) != 1:
        print(f"{name}: SKIPPED (pattern found {src.count(old)} times)", flush=True); continue
    open(p, "w").write(src.replace(old, new))
    try:
        if path.endswith(".pyx") and build() != 0:
            print(f"{name}: build failed", flush=True); continue
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-m", "not model"] + TESTS,
                           cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(ROOT, ".mutations-inductor")))
        failed = sorted({l.split("::")[0] + "::" + l.split("::")[1].split("[")[0] for l in r.stdout.splitlines() if l.startswith("FAILED")})
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        print(f"{name}: {summary}\n   caught by: {', '.join(failed[:8])}{' ...' if len(failed) > 8 else ''}", flush=True)
    finally:
        open(p, "w").write(src)
build()
print("restored", flush=True)
