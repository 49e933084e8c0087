"""uacompile.nvcc, the nvcc driver of both CUDA lowerings: flags, finding nvcc, a failed compile's error.

The compiler here is a stand-in script (UACOMPILE_NVCC), so these run without CUDA."""
import os
import stat

import pytest

from uacompile import nvcc


def fake_nvcc(tmp_path, body: str) -> str:
    script = tmp_path / "nvcc"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_flags_are_base_then_arch_then_extra(monkeypatch):
    monkeypatch.setenv("UACOMPILE_NVCC_FLAGS", "-DX=1")  # not read: a build's flags come from its caller alone
    fl = nvcc.flags("sm_90a", ("-diag-suppress=177",))
    assert fl[:len(nvcc.BASE_FLAGS)] == list(nvcc.BASE_FLAGS)
    assert fl[len(nvcc.BASE_FLAGS):] == ["-gencode=arch=compute_90a,code=sm_90a", "-diag-suppress=177"]
    assert {"-O3", "-shared"} <= set(fl)
    assert nvcc.flags("sm_80")[-1] == "-arch=sm_80"


@pytest.mark.parametrize("arch", ["sm90", "ampere", "sm_9", "sm_90b", 90, None])
def test_a_bad_arch_is_a_value_error(arch):
    with pytest.raises(ValueError, match=r"arch: expected like 'sm_90' or 'sm_90a'"):
        nvcc.flags(arch)


def test_nvcc_not_found_says_how_to_point_at_it(monkeypatch, tmp_path):
    monkeypatch.delenv("UACOMPILE_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(nvcc.NvccNotFound, match="UACOMPILE_NVCC or CUDA_HOME"):
        nvcc.nvcc_path()
    monkeypatch.setenv("UACOMPILE_NVCC", "/opt/my/nvcc")
    assert nvcc.nvcc_path() == "/opt/my/nvcc"


def test_a_failed_compile_names_the_build_and_keeps_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("UACOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("UACOMPILE_NVCC", fake_nvcc(tmp_path, 'echo "k.cu(1): error: this is not C++" >&2; exit 2'))
    src = tmp_path / "k.cu"
    src.write_text("this is not C++;\n")
    with pytest.raises(nvcc.NvccError, match=r"nvcc failed for ua_op_1 \(source kept at .*\.cu\):\n"
                                             r"k\.cu\(1\): error: this is not C\+\+\ncommand: ") as e:
        nvcc.compile_library(src, tmp_path / "k.so", nvcc.flags("sm_90"), "ua_op_1")
    kept = str(e.value).split("source kept at ")[1].split(")")[0]
    assert open(kept).read() == "this is not C++;\n" and os.path.dirname(kept).endswith("nvcc-failed")


def test_a_compile_returns_its_warnings(monkeypatch, tmp_path):
    out = 'echo "ptxas info : (C7511) Potential Performance Loss: wgmma serialized"; echo "ptxas info : Used 90 registers"'
    monkeypatch.setenv("UACOMPILE_NVCC", fake_nvcc(tmp_path, out + '; echo "k.cu(3): warning #177-D: unused" >&2'))
    (tmp_path / "k.cu").write_text("")
    warnings = nvcc.compile_library(tmp_path / "k.cu", tmp_path / "k.so", nvcc.flags("sm_90"), "ua_op_1")
    assert warnings == ["k.cu(3): warning #177-D: unused", "ptxas info : (C7511) Potential Performance Loss: wgmma serialized"]
