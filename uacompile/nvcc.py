"""The nvcc driver of both CUDA lowerings (targets/cuda from Jinja templates, lower/tvm_cuda from TVM).

    fl = nvcc.flags("sm_90a")                                      # base + arch
    key = content_hash(<what the source depends on>, nvcc.toolchain(), fl)   # -> cache.cached_build
    warnings = nvcc.compile_library(folder / "k.cu", folder / "k.so", fl, what="ua_copy_blocks_1a2b")

One run compiles one .cu into a shared library. A failed run raises NvccError with nvcc's last lines,
the command, and a copy of the source kept in the cache folder (the build folder is thrown away).
arch: "sm_80", "sm_90", "sm_90a" (...): an arch ending in "a" is compiled for exactly that GPU
(-gencode=arch=compute_90a,code=sm_90a), others with -arch. Env: UACOMPILE_NVCC (default: nvcc on
PATH, then $CUDA_HOME/bin/nvcc).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from .cache import cache_dir, content_hash, toolchain_versions

# -fno-gnu-unique: static locals of inline/template code (a launcher's "attribute set once" flag)
# would otherwise be one object across every library of the process, so a second library of the
# same op (a sweep's candidates) would skip its own cudaFuncSetAttribute and fail to launch.
BASE_FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fno-gnu-unique", "-std=c++17", "-lineinfo")
_ARCH = re.compile(r"^sm_\d{2,3}a?$")


class NvccError(RuntimeError):
    """nvcc failed (the message has its last lines, the command and where the source is kept)."""


class NvccNotFound(NvccError):
    """No nvcc here: CUDA libraries cannot be built (sources can still be generated)."""


def nvcc_path() -> str:
    env = os.environ.get("UACOMPILE_NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = Path(home) / "bin" / "nvcc"
    if cand.exists():
        return str(cand)
    raise NvccNotFound("nvcc not found: put it on PATH, or set UACOMPILE_NVCC or CUDA_HOME")


def check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not _ARCH.match(arch):
        raise ValueError(f"arch: expected like 'sm_90' or 'sm_90a', got {arch!r}")
    return arch


def default_arch() -> str:
    """The current GPU's arch (torch), else sm_90 (the H200 the project targets)."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except ImportError:
        pass
    return "sm_90"


def arch_flags(arch: str) -> list[str]:
    check_arch(arch)
    if arch.endswith("a"):
        num = arch[3:]
        return [f"-gencode=arch=compute_{num},code=sm_{num}"]
    return [f"-arch={arch}"]


def flags(arch: str, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The whole flag list of a build for arch: base, arch, then the caller's extra."""
    return [*BASE_FLAGS, *arch_flags(arch), *extra]


def toolchain() -> dict:
    """nvcc's (and Python's) version: the toolchain part of a cache key."""
    return toolchain_versions(nvcc_path())


def compiler_warnings(output: str) -> list[str]:
    """nvcc/ptxas lines kept with a build: warnings and ptxas' performance notes (C7511/C7520: wgmma
    serialised), which nvcc 13 prints as "ptxas info : (C7511) Potential Performance Loss: ...", no "warning"."""
    return [line.strip() for line in output.splitlines()
            if "warning" in line.lower() or "performance loss" in line.lower()]


def compile_library(source: Path, library: Path, flag_list: list[str], what: str) -> list[str]:
    """nvcc source (a .cu) into the shared library `library` with flag_list (from flags()); returns the
    compiler's warning lines. what names the build in the error (e.g. the ops' symbols)."""
    cmd = [nvcc_path(), *flag_list, "-o", str(library), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        text = Path(source).read_text()
        kept = cache_dir() / "nvcc-failed" / f"{content_hash(text, flag_list)[:16]}.cu"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(text)
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise NvccError(f"nvcc failed for {what} (source kept at {kept}):\n" + "\n".join(msg[-40:])
                        + f"\ncommand: {shlex.join(cmd)}")
    return compiler_warnings(proc.stderr + proc.stdout)


__all__ = ["BASE_FLAGS", "NvccError", "NvccNotFound", "nvcc_path", "check_arch", "default_arch", "arch_flags", "flags",
           "toolchain", "compiler_warnings", "compile_library"]
