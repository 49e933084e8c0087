"""Kernel sets: presets of op variants, the lowering registry, and the build manifest.

A lowering is a function `(op, out_dir) -> dict` that writes the kernel's source (and
library, where the toolchain is present) and returns at least `source`, `library` (a
path or None) and, when library is None, `reason`. Each is imported lazily, so TVM,
nvcc or g++ are only needed for the targets asked for.
"""
from __future__ import annotations

import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import IRError
from .ir import CopyBlocks, MergeState, OpSpec, PagedAttention, ReshapeAndCache, SwapBlocks


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    decode_splits: int = 8  # split-KV partial variant + its merge_state

    def ops(self) -> list[OpSpec]:
        Hq, Hkv, D, P, dt = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype
        return [
            PagedAttention(Hq, Hkv, D, P, dt, dt),
            PagedAttention(Hq, Hkv, D, P, dt, dt, num_splits=self.decode_splits),
            MergeState(Hq, D, self.decode_splits, dt),
            ReshapeAndCache(Hkv, D, P, dt, dt),
            CopyBlocks(Hkv, D, P, dt),
            SwapBlocks(Hkv, D, P, dt),
        ]


MODELS = {
    # Llama-3-8B and Qwen3-8B share the attention shape
    "llama3-8b": ModelShape("llama3-8b", 32, 8, 128, 16, "bf16"),
    "stories260k": ModelShape("stories260k", 8, 4, 8, 16, "fp32", decode_splits=2),
}
PRESETS = {
    "default": ["llama3-8b", "stories260k"],
    "llama3-8b": ["llama3-8b"],
    "tiny": ["stories260k"],
}
TARGETS = ("cpu", "cuda", "ascend")
DEFAULT_TARGETS = ("cpu", "cuda")  # `--target all` adds ascend

# (target, lowering) -> "module:function"
LOWERINGS = {
    ("cpu", "tvm"): "uacompile.build:tvm_cpu_artifact",
    ("cuda", "tvm"): "uacompile.build:tvm_cuda_artifact",
    ("cuda", "jinja"): "uacompile.build:jinja_cuda_artifact",
    ("ascend", "jinja"): "uacompile.targets.ascend.build:build_and_verify",
}


# (target, lowering) -> "module:function" returning {file name: text}: sources only, no compiler run
SOURCES = {
    ("cpu", "tvm"): "uacompile.build:tvm_cpu_sources",
    ("cuda", "tvm"): "uacompile.build:tvm_cuda_sources",
    ("cuda", "jinja"): "uacompile.build:jinja_cuda_sources",
    ("ascend", "jinja"): "uacompile.build:ascend_sources",
}


def lowerings_for(target: str) -> list[str]:
    return [low for (t, low) in LOWERINGS if t == target]


def preset_ops(preset: str) -> list[OpSpec]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    ops: list[OpSpec] = []
    for model in PRESETS[preset]:
        ops += [op for op in MODELS[model].ops() if op not in ops]
    return ops


def _lowering(target: str, lowering: str):
    mod, fn = LOWERINGS[(target, lowering)].split(":")
    return getattr(importlib.import_module(mod), fn)


def generate_sources(op: OpSpec, target: str, lowering: str) -> dict[str, str]:
    """The source files of op for (target, lowering), {file name: text}, without running a compiler.
    IRError or NotImplementedError when the lowering has no kernel for the variant."""
    if (target, lowering) not in SOURCES:
        raise ValueError(f"no lowering {lowering!r} for target {target!r}; have {lowerings_for(target)}")
    mod, fn = SOURCES[(target, lowering)].split(":")
    return getattr(importlib.import_module(mod), fn)(op)


def tvm_cpu_sources(op: OpSpec) -> dict[str, str]:
    from .lower.tvm_kernels import prim_func

    return {f"{op.symbol()}.tir.py": prim_func(op, "cpu").script()}


def tvm_cuda_sources(op: OpSpec, arch: str = "sm_90") -> dict[str, str]:
    from .lower.tvm_cuda import cuda_source

    return {f"{op.symbol()}_{arch}.cu": cuda_source(op, arch)}


def jinja_cuda_sources(op: OpSpec, arch: str = "sm_90") -> dict[str, str]:
    from .targets.cuda.render import render_op

    return {f"{op.symbol()}_{arch}.cu": render_op(op, arch)}


def ascend_sources(op: OpSpec) -> dict[str, str]:
    from .targets.ascend.generate import generate

    return dict(generate(op).files)


def build_one(op: OpSpec, target: str, lowering: str, out_dir: Path) -> dict:
    """Build one kernel; never raises for a missing toolchain: the entry says why instead."""
    entry = {"op": op.kind, "target": target, "lowering": lowering, "params": op.to_dict(),
             "symbol": op.symbol(), "hash": op.key()}
    t0 = time.perf_counter()
    try:
        res = _lowering(target, lowering)(op, out_dir)
    except ImportError as e:  # the toolchain's Python package is not installed
        res = {"source": None, "library": None, "reason": f"{type(e).__name__}: {e}"}
    except (NotImplementedError, IRError) as e:  # this lowering has no kernel for the variant
        res = {"source": None, "library": None, "reason": f"not supported: {e}"}
    entry.update({k: v for k, v in res.items() if k not in ("op", "target")})
    if entry.get("library") is None:
        entry["reason"] = entry.get("reason") or entry.get("verified") or "not built"
    entry.setdefault("reason", None)
    entry["build_s"] = round(time.perf_counter() - t0, 3)
    for k in ("source", "library"):
        v = entry.get(k)
        if isinstance(v, (list, tuple)):
            entry[k] = [str(p) for p in v]
        elif v is not None:
            entry[k] = str(v)
    return entry


def build_set(ops: list[OpSpec], targets, out_dir: Path, progress: bool = True) -> dict:
    """Build every op for every target and lowering; write and return out_dir/manifest.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(op, t, low) for t in targets for low in lowerings_for(t) for op in ops]
    from tqdm import tqdm

    entries = []
    bar = tqdm(jobs, unit="kernel", disable=not progress, dynamic_ncols=True)
    for op, t, low in bar:
        bar.set_description(f"{t}/{low} {op.kind}")
        entries.append(build_one(op, t, low, out_dir / t / low))
    manifest = {"uacompile": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "targets": list(targets), "kernels": entries}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def tvm_cpu_artifact(op: OpSpec, out_dir: Path) -> dict:
    """TVM -> LLVM shared library (from the kernel cache) plus the TIR it was built from."""
    import shutil

    from .lower.tvm_build import CACHE_KIND, LIBRARY, build_cpu_library, cpu_cache_key
    from .lower.tvm_kernels import prim_func
    from .cache import cached_build

    out_dir.mkdir(parents=True, exist_ok=True)
    folder, hit = cached_build(CACHE_KIND, cpu_cache_key(op), lambda d: build_cpu_library(op, d))
    lib, src = out_dir / f"{op.symbol()}.so", out_dir / f"{op.symbol()}.tir.py"
    shutil.copyfile(folder / LIBRARY, lib)
    src.write_text(prim_func(op, "cpu").script())
    return {"source": src, "library": lib, "cached": hit}


def tvm_cuda_artifact(op: OpSpec, out_dir: Path, arch: str = "sm_90") -> dict:
    """TVM -> CUDA source + extern "C" launcher, compiled by nvcc when nvcc is on PATH."""
    from .lower.tvm_cuda import NvccNotFound, build_cuda_library, cuda_source

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lib = build_cuda_library(op, arch, out_dir)
        return {"source": lib.with_suffix(".cu"), "library": lib, "arch": arch}
    except NvccNotFound as e:
        src = out_dir / f"{op.symbol()}_{arch}.cu"
        src.write_text(cuda_source(op, arch))
        return {"source": src, "library": None, "reason": str(e), "arch": arch}


def jinja_cuda_artifact(op: OpSpec, out_dir: Path, arch: str = "sm_90") -> dict:
    """Jinja template -> CUDA source + launcher, nvcc-built (through the cache) when nvcc exists."""
    import shutil

    from .targets.cuda.build import BuildError, build, nvcc_path
    from .targets.cuda.render import render_op

    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{op.symbol()}_{arch}.cu"
    src.write_text(render_op(op))  # IRError for a variant the templates do not cover
    try:
        nvcc_path()
    except BuildError as e:
        return {"source": src, "library": None, "reason": str(e), "arch": arch}
    res = build(op, arch)
    lib = out_dir / f"{op.symbol()}_{arch}.so"
    shutil.copyfile(res.path, lib)
    return {"source": src, "library": lib, "arch": arch, "cached": res.hit}


def _version() -> str:
    from . import __version__

    return __version__
