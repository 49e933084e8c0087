"""Build generated AscendC sources against the clean-room emulator with g++, and verify.

Builds are cached by content (uacompile.cache): op, rendered sources, emulator headers,
compiler version and flags. One shared library per kernel variant (a single translation
unit: kernel + launcher), loaded once and run on many shapes.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

from uacompile.cache import cached_build, content_hash, toolchain_versions
from uacompile.errors import IRError
from uacompile.ir import OpSpec

from .estimate import estimate
from .generate import DEFAULT_SOC, EMULATOR_DIR, STATUS, KernelSources, generate
from .runner import EmulatedKernel
from .verify import verify

CXX = os.environ.get("CXX", "g++")
STD = ["-std=c++17"]
EMU_BUILD_FLAGS = ["-O1", "-fPIC", "-shared", "-pthread", "-DUA_EMULATOR"]
# the launcher's CANN CPU-debug branch (ICPU_RUN_KF over GmAlloc copies), run on the emulator
MODES = {"npu": [], "cpu": ["-DASCENDC_CPU_DEBUG"]}
CHECK_FLAGS = ["-fsyntax-only", "-Wall", "-Werror"]


class BuildError(RuntimeError):
    """g++ rejected generated code (the message carries its diagnostics)."""


def emulator_text() -> str:
    return "".join(p.read_text() for p in sorted(EMULATOR_DIR.rglob("*.h")))


def run_compiler(cmd: list[str], cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{(r.stderr or r.stdout)[-4000:]}")


def _includes(src_dir: Path) -> list[str]:
    return [f"-I{EMULATOR_DIR}", f"-I{src_dir}"]


def syntax_check(src_dir: Path, files: list[str]) -> list[str]:
    """g++ -fsyntax-only -Wall -Werror on every generated source, in each build it has:
    the emulator build and, for launchers with a kernel, the CANN CPU-debug branch
    (ASCENDC_CPU_DEBUG; served by the emulator's tikicpulib.h). Returns the commands run."""
    src_dir = Path(src_dir)
    cmds = [[CXX, *STD, *CHECK_FLAGS, "-DUA_EMULATOR", *_includes(src_dir), *files]]
    hosts = [f for f in files if f.endswith("_host.cpp") and (src_dir / f.replace("_host.cpp", "_kernel.cpp")).exists()]
    if hosts:
        cmds.append([CXX, *STD, *CHECK_FLAGS, "-DASCENDC_CPU_DEBUG", *_includes(src_dir), *hosts])
    for cmd in cmds:
        run_compiler(cmd, cwd=src_dir)
    return [" ".join(c) for c in cmds]


def emulator_library(op: OpSpec, soc: str = DEFAULT_SOC, mode: str = "npu") -> Path:
    """The emulator build of op's kernel + launcher (cached); path of the .so. mode "npu"
    builds the launcher's NPU branch (blocks as threads, tiling through device slots),
    "cpu" its CANN CPU-debug branch (ICPU_RUN_KF: a process per block over GmAlloc copies)."""
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {sorted(MODES)}, got {mode!r}")
    src = generate(op, soc)
    key = content_hash("ascend-emu", op.to_dict(), soc, sorted(src.files.items()), emulator_text(),
                       toolchain_versions(CXX), STD + EMU_BUILD_FLAGS + MODES[mode])
    folder, _ = cached_build("ascend-emu", key, lambda tmp: build_emulator(src, tmp, mode))
    return folder / f"lib{src.symbol}.so"


def build_emulator(src: KernelSources, folder, mode: str = "npu") -> Path:
    """Write src into folder and g++-build its kernel + launcher against the emulator (one
    translation unit, uncached); path of the .so. emulator_library is the cached form."""
    folder = Path(folder)
    src.write(folder)
    units = ([f"{src.symbol}_kernel.cpp"] if src.kernel else []) + [f"{src.symbol}_host.cpp"]
    (folder / "unity.cpp").write_text("".join(f'#include "{u}"\n' for u in units))
    lib = f"lib{src.symbol}.so"
    run_compiler([CXX, *STD, *EMU_BUILD_FLAGS, *MODES[mode], *_includes(folder), "unity.cpp", "-o", lib], cwd=folder)
    return folder / lib


@functools.lru_cache(maxsize=None)
def load(op: OpSpec, soc: str | None = None, mode: str = "npu") -> EmulatedKernel:
    """Build (cached) and load the emulator library of op (mode as in emulator_library)."""
    return EmulatedKernel(op, emulator_library(op, soc or DEFAULT_SOC, mode))


def build_and_verify(op: OpSpec, out_dir, soc: str = DEFAULT_SOC, seed: int = 0) -> dict:
    """Emit op's AscendC project into out_dir, syntax-check it with -Wall -Werror, build it
    against the emulator (cached), run it against the numpy reference, and return the
    manifest entry:

      {"target": "ascend", "op": {...}, "symbol": str, "kernel": str | None,
       "source": [paths], "library": path of the emulator .so | None, "cmake": path,
       "verified": "emulator" | "no: <reason>" | "unsupported: <reason>",
       "status": str, "checks": [{"case": str, "max_abs_err" | "exact": ...}], "plan": {...}}

    "emulator" means: generated and run on the clean-room CPU emulator against the
    reference; never run on NPU hardware.
    """
    out = Path(out_dir)
    entry = {"target": "ascend", "op": op.to_dict(), "symbol": op.symbol(), "kernel": None, "source": [],
             "library": None, "cmake": None, "status": STATUS, "checks": [], "plan": None}
    try:
        src = generate(op, soc)
    except IRError as e:
        entry["verified"] = f"unsupported: {e}"
        return entry
    paths = src.write(out)
    if op.kind == "paged_attention":  # labelled estimates per shape (estimate.py), never measurements
        entry["estimate"] = estimate(op, soc)
    entry.update(kernel=src.kernel, plan=src.plan.to_dict(), cmake=str(out / "CMakeLists.txt"),
                 source=[str(p) for p in paths if p.suffix in (".cpp", ".h")])
    try:
        syntax_check(out, [p.name for p in paths if p.suffix == ".cpp"])
        lib = emulator_library(op, soc)
        entry["library"] = str(lib)
        entry["checks"] = verify(EmulatedKernel(op, lib), seed=seed)
        failed = [c for c in entry["checks"] if not c["ok"]]
        entry["verified"] = "emulator" if not failed else f"no: {len(failed)} case(s) differ from the reference"
    except (BuildError, RuntimeError, ValueError) as e:
        entry["verified"] = f"no: {str(e).splitlines()[0][:300]}"
    meta = dict(src.meta, verified=entry["verified"], checks=entry["checks"])
    (out / f"{src.symbol}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    emu = out / "emulator"
    if not emu.exists():  # the headers the emulator build used, beside the sources
        shutil.copytree(EMULATOR_DIR, emu, ignore=shutil.ignore_patterns("*.cpp", "__pycache__"))
    return entry
