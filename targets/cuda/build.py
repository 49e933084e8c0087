"""nvcc build of rendered ops into one shared library, through the content-hash kernel cache.

    from uacompile.targets.cuda.build import build
    res = build([op1, op2], arch="sm_90")     # BuildResult(path=<.so>, hit=bool, seconds, key, arch)

Several ops go into one translation unit (each template wraps its code in its own
namespace; the common header is include-guarded), so a kernel set costs one nvcc run.
Cache key = content_hash(op dicts, rendered source, nvcc version, flags); the artefact
folder keeps kernels.cu and build.json beside lib.so. A failed build raises BuildError
with nvcc's message and the path of the kept source. arch: "sm_80", "sm_90", "sm_90a",
or None = the current GPU (sm_90 without one). A template marked UA_REQUIRES_SM90A is
built for sm_90a when arch is sm_90. Env: UACOMPILE_NVCC (default: nvcc on PATH, then
$CUDA_HOME/bin/nvcc). Templates include the kernel headers of include/uacompile (nvcc -I INCLUDE_DIR; their
contents are part of the key). build.json keeps nvcc's warnings and ptxas' performance notes; a kernel whose wgmma
ptxas serialised (C7511 / C7520: serialised_kernels) is logged as a warning.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from uacompile import ir
from uacompile.cache import cache_dir, cached_build, content_hash, toolchain_versions
from .render import needs_sm90a, render_op

log = logging.getLogger(__name__)
INCLUDE_DIR = Path(__file__).parent / "include"  # the kernel headers (uacompile/*.cuh) the templates instantiate

# -fno-gnu-unique: static locals of inline/template code (a launcher's "attribute set once" flag)
# would otherwise be one object across every library of the process, so a second library of the
# same op (a sweep's candidates) would skip its own cudaFuncSetAttribute and fail to launch. -warn-spills: ptxas' spill
# warnings land in build.json (compiler_warnings) with the rest.
BASE_FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fno-gnu-unique", "-std=c++17", "-lineinfo",
              "-Xptxas", "-warn-spills")
# What build.json records, as part of the key: 2 since ptxas' "Performance Loss" lines are kept (builds cached
# before that recorded no C75xx line, so a guard reading them passed whatever ptxas said)
BUILD_RECORD = 4  # 4: one code shape a template (no rebuild of a serialised kernel)
# ptxas' note names the kernel: "... in the function '_ZN<len><symbol>_impl..."
SERIALISED = re.compile(r"function '_ZN\d+(\w+?)_impl")


def compiler_warnings(output: str) -> list[str]:
    """nvcc/ptxas lines kept with a build: warnings and ptxas' performance notes (C7511/C7520: wgmma
    serialised), which nvcc 13 prints as "ptxas info : (C7511) Potential Performance Loss: ...", no "warning"."""
    return [line.strip() for line in output.splitlines()
            if "warning" in line.lower() or "performance loss" in line.lower()]


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuildResult:
    path: Path  # the shared library
    hit: bool  # loaded from the cache (no nvcc run)
    seconds: float  # wall time of this call
    key: str
    arch: str


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
    raise BuildError("nvcc not found: put it on PATH, or set UACOMPILE_NVCC or CUDA_HOME")


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


def arch_flags(arch: str, source: str) -> list[str]:
    if not (arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"arch: expected like 'sm_90' or 'sm_90a', got {arch!r}")
    if arch == "sm_90" and needs_sm90a(source):
        arch = "sm_90a"
    if arch.endswith("a"):
        num = arch[3:]
        return [f"-gencode=arch=compute_{num},code=sm_{num}"]
    return [f"-arch={arch}"]


def nvcc_flags(arch: str, source: str) -> list[str]:
    return [*BASE_FLAGS, *arch_flags(arch, source), f"-I{INCLUDE_DIR}"]


@functools.cache
def headers_digest() -> str:
    """A content hash of the kernel headers (INCLUDE_DIR): part of every build's key, as the rendered source is
    (the include path is not: it moves with the install)."""
    return content_hash(sorted((str(p.relative_to(INCLUDE_DIR)), p.read_text()) for p in INCLUDE_DIR.rglob("*.cuh")))


def serialised_kernels(warnings: list[str]) -> set[str]:
    """Op symbols whose kernel ptxas built with serialised wgmma (C7511 / C7520; kernels are named
    <symbol>_impl::...)."""
    return {m.group(1) for w in warnings if "wgmma" in w and (m := SERIALISED.search(w))}


def build(ops: ir.OpSpec | Iterable[ir.OpSpec], arch: str | None = None) -> BuildResult:
    """Build (or find in the cache) one .so holding the launchers of every op in ops."""
    t0 = time.perf_counter()
    ops = [ops] if isinstance(ops, ir.OpSpec) else list(ops)
    if not ops:
        raise ValueError("ops: need at least one op to build")
    ops = list({op.symbol(): op for op in ops}.values())  # one launcher per distinct variant
    arch = arch or default_arch()
    source = "\n".join(render_op(op, arch) for op in ops)
    flags = nvcc_flags(arch, source)
    nvcc = nvcc_path()
    key = content_hash([op.to_dict() for op in ops], source, headers_digest(), toolchain_versions(nvcc),
                       [f for f in flags if not f.startswith("-I")], BUILD_RECORD)

    def compile_into(folder: Path) -> None:
        started = time.perf_counter()
        (folder / "kernels.cu").write_text(source)
        cmd = [nvcc, *flags, "-o", str(folder / "lib.so"), str(folder / "kernels.cu")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            kept = cache_dir() / "cuda-failed" / f"{key[:16]}.cu"
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(source)
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise BuildError(f"nvcc failed for {[op.symbol() for op in ops]} (source kept at {kept}):\n"
                             + "\n".join(msg[-40:]) + f"\ncommand: {shlex.join(cmd)}")
        warnings = compiler_warnings(proc.stderr + proc.stdout)
        serialised = sorted(serialised_kernels(warnings))
        if serialised:
            log.warning("ptxas serialised the wgmma of %s (%s): expect slow prefill", serialised, arch)
        (folder / "build.json").write_text(json.dumps(
            dict(ops=[op.to_dict() for op in ops], arch=arch, flags=flags, nvcc=toolchain_versions(nvcc),
                 seconds=round(time.perf_counter() - started, 3), warnings=warnings, serialised=serialised),
            indent=1, default=str))

    folder, hit = cached_build("cuda", key, compile_into)
    return BuildResult(folder / "lib.so", hit, time.perf_counter() - t0, key, arch)
