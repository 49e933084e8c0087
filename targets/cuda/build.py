"""nvcc build of rendered ops into one shared library, through the content-hash kernel cache.

    from uacompile.targets.cuda.build import build
    res = build([op1, op2], arch="sm_90")     # BuildResult(path=<.so>, hit=bool, seconds, key, arch)

Several ops go into one translation unit (each template wraps its code in its own
namespace; the common header is include-guarded), so a kernel set costs one nvcc run.
Cache key = content_hash(op dicts, rendered source, nvcc version, flags); the artefact
folder keeps kernels.cu and build.json beside lib.so. nvcc runs through uacompile.nvcc (flags,
env, errors: a failed build raises nvcc.NvccError with nvcc's message and the kept source).
arch: "sm_80", "sm_90", "sm_90a", or None = the current GPU (sm_90 without one). A template
marked UA_REQUIRES_SM90A is built for sm_90a when arch is sm_90. An op with several code shapes
(render.code_shapes: the same computation rendered differently, because ptxas serialises the wgmma
(C7511) of some kernels in one shape and not another) is built in shape 0 and, where ptxas
serialised it, rebuilt in its next shape.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from uacompile import ir, nvcc
from uacompile.cache import cached_build, content_hash
from .render import code_shapes, needs_sm90a, render_op

# What build.json records, as part of the key: 2 since ptxas' "Performance Loss" lines are kept (builds cached
# before that recorded no C75xx line, so a guard reading them passed whatever ptxas said)
BUILD_RECORD = 3  # 3: a kernel ptxas serialised is built again with its next code shape
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
    return nvcc.flags(build_arch(arch, source))


def serialised_kernels(warnings: list[str]) -> set[str]:
    """Op symbols whose kernel ptxas built with serialised wgmma (C7511 / C7520; kernels are named
    <symbol>_impl::...)."""
    return {m.group(1) for w in warnings if "wgmma" in w and (m := SERIALISED.search(w))}


def build(ops: ir.OpSpec | ir.Kernel | Iterable[ir.OpSpec | ir.Kernel], arch: str | None = None) -> BuildResult:
    """Build (or find in the cache) one .so holding the launchers of every kernel in ops (ir.Kernel: an op and
    its config; an op alone is its default config). Where a kernel has
    several code shapes (render.code_shapes), the unit is built with every op in shape 0; an op whose wgmma
    ptxas serialised is rebuilt in its next shape until it has a clean one (shape 0 if none is), a unit of
    mixed shapes if need be. build.json keeps each attempt."""
    t0 = time.perf_counter()
    ops = [ir.as_kernel(op) for op in ([ops] if isinstance(ops, (ir.OpSpec, ir.Kernel)) else ops)]
    if not ops:
        raise ValueError("ops: need at least one op to build")
    ops = list({op.symbol(): op for op in ops}.values())  # one launcher per distinct kernel
    arch = arch or nvcc.default_arch()
    source = "\n".join(render_op(op, arch) for op in ops)
    flags = nvcc_flags(arch, source)
    key = content_hash([op.to_dict() for op in ops], source, nvcc.toolchain(), flags, BUILD_RECORD)
    n_shapes = {op.symbol(): code_shapes(op, arch) for op in ops}

    def compile_into(folder: Path) -> None:
        started, built = time.perf_counter(), {}  # shape vector -> (its folder, serialised symbols, warnings)

        def compile_shapes(shapes: tuple[int, ...]) -> None:
            sub = folder / ("shapes-" + "".join(map(str, shapes)))
            sub.mkdir()
            src = source if not any(shapes) else "\n".join(render_op(op, arch, s) for op, s in zip(ops, shapes))
            (sub / "kernels.cu").write_text(src)
            warnings = nvcc.compile_library(sub / "kernels.cu", sub / "lib.so", flags, str([op.symbol() for op in ops]))
            built[shapes] = (sub, serialised_kernels(warnings), warnings)

        # each op's shape: the first one (in order) that ptxas did not serialise. Since v37 (the half-wide
        # tile's scores of their own) shape 0 is clean in every op the census built, so one compile is the rule
        # and the retry a guard against the next ptxas or template change.
        def pick() -> tuple[int, ...]:
            """Per op: its first clean shape built so far, else its next unbuilt one, else 0 (serialised in
            every shape: shape 0 has the fastest decode)."""
            chosen = []
            for i, op in enumerate(ops):
                tried = sorted({v[i] for v in built})
                clean = [s for s in tried if not any(v[i] == s and op.symbol() in bad for v, (_, bad, _) in built.items())]
                untried = [s for s in range(n_shapes[op.symbol()]) if s not in tried]
                chosen.append(clean[0] if clean else untried[0] if untried else 0)
            return tuple(chosen)

        chosen = (0,) * len(ops)
        while chosen not in built:
            compile_shapes(chosen)
            chosen = pick()
        sub, _, warnings = built[chosen]
        for name in ("kernels.cu", "lib.so"):
            os.replace(sub / name, folder / name)
        for v in built:
            shutil.rmtree(built[v][0], ignore_errors=True)
        attempts = [dict(shapes=dict(zip([o.symbol() for o in ops], v)), serialised=sorted(bad)) for v, (_, bad, _) in built.items()]
        (folder / "build.json").write_text(json.dumps(
            dict(ops=[op.to_dict() for op in ops], arch=arch, flags=flags, nvcc=nvcc.toolchain(),
                 seconds=round(time.perf_counter() - started, 3), warnings=warnings,
                 code_shapes=dict(zip([o.symbol() for o in ops], chosen)), attempts=attempts), indent=1, default=str))

    folder, hit = cached_build("cuda", key, compile_into)
    return BuildResult(folder / "lib.so", hit, time.perf_counter() - t0, key, arch)
