"""CPU: each kernel header of targets/cuda/include/uacompile compiles on its own (nvcc -c of a .cu that includes it
and instantiates its templates), for sm_80 and sm_90a; the package ships them."""
from __future__ import annotations

import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

# header -> an explicit instantiation of its templates (every member compiled), or "" for plain code
HEADERS = {
    "common.cuh": "",
    "page_copy.cuh": "template struct ua::PageCopy<256, 4, 32768, 16, 512, 16>;\n"
                     "template struct ua::PageCopy<256, 4, 1024, 16, 0, 1>;\n",
    "merge_state.cuh": "template struct ua::MergeState<half, 7, 16, 96, 4, 8, 256, true>;\n"
                       "template struct ua::MergeState<ua::bf16, 2, 32, 128, 4, 32, 256, false>;\n",
}


def test_every_header_is_listed():
    from uacompile.targets.cuda.build import INCLUDE_DIR

    assert sorted(p.name for p in (INCLUDE_DIR / "uacompile").glob("*.cuh")) == sorted(HEADERS)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("header", list(HEADERS))
def test_header_compiles_on_its_own(header, arch, tmp_path):
    from uacompile.targets.cuda.build import INCLUDE_DIR, nvcc_path

    cu = tmp_path / "one.cu"
    cu.write_text(f'#include "uacompile/{header}"\n{HEADERS[header]}')
    num = arch[3:]
    res = subprocess.run([nvcc_path(), "-std=c++17", f"-I{INCLUDE_DIR}", f"-gencode=arch=compute_{num},code=sm_{num}",
                          "-c", "-o", str(tmp_path / "one.o"), str(cu)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def test_headers_are_part_of_the_build_key():
    """A header's contents are in every build's key (headers_digest), its install path is not."""
    from uacompile.targets.cuda import build

    digest = build.headers_digest()
    assert len(digest) == 64 and digest == build.headers_digest()
    assert any(f.startswith("-I") for f in build.nvcc_flags("sm_80", ""))
