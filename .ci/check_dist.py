"""CI: the sdist and the wheel carry LICENSE, the bench suite and the flash kernel's metadata; the extensions carry no debug info.

Usage: python .ci/check_dist.py DIST_DIR
"""

import glob
import subprocess
import sys
import tarfile
import tempfile
import zipfile

out = sys.argv[1]
(sdist,), (wheel,) = glob.glob(f"{out}/attn-*.tar.gz"), glob.glob(f"{out}/attn-*.whl")
assert any(n.endswith("/LICENSE") for n in tarfile.open(sdist).getnames()), "LICENSE not in the sdist"
whl = zipfile.ZipFile(wheel)
names = whl.namelist()
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
assert "attn/apps/bench/plugin.py" in names and "attn/apps/bench/test_bench_sdpa.py" in names, "no bench suite in the wheel"
assert any(n.startswith("attn/apps/bench/_yardsticks") and n.endswith(".so") for n in names), "no yardsticks in the wheel"
assert "attn/integrations/flash_kernel/metadata.json" in names, "no kernels-package metadata (register_flash) in the wheel"
with tempfile.TemporaryDirectory() as tmp:
    for so in [n for n in names if n.endswith(".so")]:
        sections = subprocess.run(["readelf", "-S", whl.extract(so, tmp)],
                                  capture_output=True, text=True, check=True).stdout
        assert ".debug_" not in sections, f"{so} carries debug info"
        print(f"{so}: {whl.getinfo(so).file_size} bytes, no debug sections")
