"""nvcc build of rendered ops into one shared library, through the content-hash kernel cache.

    from uacompile.targets.cuda.build import build
    res = build([op1, op2], arch="sm_90")     # BuildResult(path=<.so>, hit=bool, seconds, key, arch)

Several kernels go into one translation unit (each template wraps its code in its own
namespace; the headers are include-guarded), so a kernel set costs one nvcc run.
Cache key = content_hash(kernel dicts, rendered source, the kernel headers' contents, nvcc version, flags); the
artefact folder keeps kernels.cu and build.json beside lib.so. nvcc runs through uacompile.nvcc (flags, errors: a
failed build raises nvcc.NvccError with nvcc's message and the kept source). arch: "sm_80", "sm_90", "sm_90a", or
None = the current GPU (sm_90 without one). A template marked UA_REQUIRES_SM90A is built for sm_90a when arch is
sm_90. Templates include the kernel headers of include/uacompile (nvcc -I INCLUDE_DIR). build.json keeps nvcc's
warnings and ptxas' performance notes; a kernel whose wgmma ptxas serialised (C7511 / C7520: serialised_kernels)
is logged as a warning.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from uacompile import ir, nvcc
from uacompile.cache import cached_build, content_hash
from .render import needs_sm90a, render_op

log = logging.getLogger(__name__)
INCLUDE_DIR = Path(__file__).parent / "include"  # the kernel headers (uacompile/*.cuh) the templates instantiate
# -warn-spills: ptxas' spill warnings land in build.json with the rest
EXTRA_FLAGS = ("-Xptxas", "-warn-spills")
# What build.json records, as part of the key: ptxas' "Performance Loss" lines are kept (a guard reading them
# must not pass on a record made without them)
BUILD_RECORD = 4
# ptxas' note names the kernel: "... in the function '_ZN<len><symbol>_impl..."
SERIALISED = re.compile(r"function '_ZN\d+(\w+?)_impl")


@dataclass(frozen=True)
class BuildResult:
    path: Path  # the shared library
    hit: bool  # loaded from the cache (no nvcc run)
    seconds: float  # wall time of this call
    key: str
    arch: str


def build_arch(arch: str, source: str) -> str:
    """The arch a source is compiled for: sm_90 becomes sm_90a where a template needs wgmma."""
    nvcc.check_arch(arch)
    return "sm_90a" if arch == "sm_90" and needs_sm90a(source) else arch


def nvcc_flags(arch: str, source: str) -> list[str]:
    return nvcc.flags(build_arch(arch, source), (*EXTRA_FLAGS, f"-I{INCLUDE_DIR}"))


@functools.cache
def headers_digest() -> str:
    """A content hash of the kernel headers (INCLUDE_DIR): part of every build's key, as the rendered source is
    (the include path is not: it moves with the install)."""
    return content_hash(sorted((str(p.relative_to(INCLUDE_DIR)), p.read_text()) for p in INCLUDE_DIR.rglob("*.cuh")))


def serialised_kernels(warnings: list[str]) -> set[str]:
    """Op symbols whose kernel ptxas built with serialised wgmma (C7511 / C7520; kernels are named
    <symbol>_impl::...)."""
    return {m.group(1) for w in warnings if "wgmma" in w and (m := SERIALISED.search(w))}


def build(ops: ir.OpSpec | ir.Kernel | Iterable[ir.OpSpec | ir.Kernel], arch: str | None = None) -> BuildResult:
    """Build (or find in the cache) one .so holding the launchers of every kernel in ops (ir.Kernel: an op and
    its config; an op alone is its default config)."""
    t0 = time.perf_counter()
    ops = [ir.as_kernel(op) for op in ([ops] if isinstance(ops, (ir.OpSpec, ir.Kernel)) else ops)]
    if not ops:
        raise ValueError("ops: need at least one op to build")
    ops = list({op.symbol(): op for op in ops}.values())  # one launcher per distinct kernel
    arch = arch or nvcc.default_arch()
    source = "\n".join(render_op(op, arch) for op in ops)
    flags = nvcc_flags(arch, source)
    key = content_hash([op.to_dict() for op in ops], source, headers_digest(), nvcc.toolchain(),
                       [f for f in flags if not f.startswith("-I")], BUILD_RECORD)

    def compile_into(folder: Path) -> None:
        started = time.perf_counter()
        (folder / "kernels.cu").write_text(source)
        warnings = nvcc.compile_library(folder / "kernels.cu", folder / "lib.so", flags, str([op.symbol() for op in ops]))
        serialised = sorted(serialised_kernels(warnings))
        if serialised:
            log.warning("ptxas serialised the wgmma of %s (%s): expect slow prefill", serialised, arch)
        (folder / "build.json").write_text(json.dumps(
            dict(ops=[op.to_dict() for op in ops], arch=arch, flags=flags, nvcc=nvcc.toolchain(),
                 seconds=round(time.perf_counter() - started, 3), warnings=warnings, serialised=serialised),
            indent=1, default=str))

    folder, hit = cached_build("cuda", key, compile_into)
    return BuildResult(folder / "lib.so", hit, time.perf_counter() - t0, key, arch)
