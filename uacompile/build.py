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
from .ir import CopyBlocks, Kernel, MergeState, OpSpec, PagedAttention, ReshapeAndCache, SwapBlocks, as_kernel


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
        """The model's ops (the math)."""
        Hq, Hkv, D, P, dt = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype
        return [
            PagedAttention(Hq, Hkv, D, P, dt, dt),
            MergeState(Hq, D, self.decode_splits, dt),
            ReshapeAndCache(Hkv, D, P, dt, dt),
            CopyBlocks(Hkv, D, P, dt),
            SwapBlocks(Hkv, D, P, dt),
        ]

    def kernels(self, target: str, lowering: str) -> list[Kernel]:
        """The kernels a lowering builds for the model: each op, attention in the configs that target runs."""
        return [k for op in self.ops() for k in kernels_for(op, target, lowering, self.decode_splits)]


MODELS = {
    # each in the dtype the runtime runs it in on CUDA by default (runtime.engine.default_dtype: the checkpoint's
    # 16-bit type where the CUDA templates cover the model, else fp32), so `LLM(model, device="cuda",
    # kernel_dir=<this preset's build>)` finds its kernels without a dtype. Llama-3-8B and Qwen3-8B share the
    # attention shape
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


def kernels_for(op: OpSpec, target: str, lowering: str, decode_splits: int = 8) -> list[Kernel]:
    """op's kernels for a lowering: paged attention in its default config and a split-KV config (the CUDA
    templates: the configs its planner launches, prefill and decode steps); other ops as they are."""
    if op.kind != "paged_attention":
        return [Kernel(op)]
    if (target, lowering) == ("cuda", "jinja"):
        from .targets.cuda.config import AttentionConfig
        from .targets.cuda.layout import uses_wgmma

        prefill = AttentionConfig()
        configs = [prefill.replace(item_queue=uses_wgmma(op, prefill)), AttentionConfig(decode_only=True),
                   AttentionConfig(num_splits=decode_splits, fused_merge=True, decode_only=True)]
    elif target == "ascend":
        from .targets.ascend.config import AscendConfig

        configs = [AscendConfig(), AscendConfig(num_splits=decode_splits)]
    else:
        from .lower.config import TVMConfig

        configs = [TVMConfig(), TVMConfig(num_splits=decode_splits)]
    return [Kernel(op, c) for c in configs]


def preset_ops(preset: str) -> list[OpSpec]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    ops: list[OpSpec] = []
    for model in PRESETS[preset]:
        ops += [op for op in MODELS[model].ops() if op not in ops]
    return ops


# (target, lowering) -> the tuning database's target name of its records
TUNED_TARGETS = {("cpu", "tvm"): "cpu", ("cuda", "jinja"): "cuda", ("cuda", "tvm"): "tvm-cuda"}


def tuned_kernels(op: OpSpec, target: str, lowering: str, db) -> list[Kernel]:
    """The kernels of op's records in a tuning database (tunedb.TuningDB) for a lowering: on the CPU, this
    machine's records; for CUDA, this GPU's where there is one, else every GPU's (a build machine without one
    builds what each tuned device runs)."""
    from .tunedb import config_from_dict, cpu_environment

    name = TUNED_TARGETS.get((target, lowering))
    if db is None or name is None:
        return []
    records = [r for r in db.records.values() if r.target == name and r.op_key == op.key()]
    if target == "cpu":
        env = cpu_environment()
        records = [r for r in records if (r.device, r.toolchain) == (env["device"], env["toolchain"])]
    else:
        try:
            import torch

            if torch.cuda.is_available():
                device = torch.cuda.get_device_name(0)
                records = [r for r in records if r.device == device]
        except ImportError:
            pass
    out = []
    for r in records:
        k = Kernel(op, config_from_dict(r.config))
        if k not in out:
            out.append(k)
    return out


def preset_kernels(preset: str, target: str, lowering: str, tuning=None) -> list[Kernel]:
    """A preset's kernels for one lowering (each model's ops in the configs that lowering runs, and those of
    the tuning database's records for them)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    kernels: list[Kernel] = []
    for model in PRESETS[preset]:
        m = MODELS[model]
        for op in m.ops():
            kernels += [k for k in kernels_for(op, target, lowering, m.decode_splits) + tuned_kernels(
                op, target, lowering, tuning) if k not in kernels]
    return kernels


def preset_of(kernel: OpSpec | Kernel, target: str, lowering: str) -> str | None:
    """The smallest preset whose `uacompile build` makes this kernel for (target, lowering), or None."""
    kernel = as_kernel(kernel)
    for preset in sorted(PRESETS, key=lambda p: (len(PRESETS[p]), p)):
        if kernel in preset_kernels(preset, target, lowering):
            return preset
    return None


def build_command(kernel: OpSpec | Kernel, target: str, lowering: str, out_dir: str | Path) -> str | None:
    """The `uacompile build` command line that writes this kernel into out_dir, or None when no preset holds it."""
    preset = preset_of(kernel, target, lowering)
    return None if preset is None else f"uacompile build --preset {preset} --target {target} --out {out_dir}"


MANIFEST = "manifest.json"


def load_manifest(out_dir: str | Path, target: str, lowering: str) -> dict[str, dict]:
    """The kernels one lowering of a `uacompile build` folder holds, by symbol: {symbol: manifest entry}.

    A symbol names the same kernel in every lowering of a target (the cache ops' templates and TVM's), so the
    lookup is per (target, lowering). Each entry's `library` and `source` are resolved inside out_dir, as absolute
    paths (out_dir/target/lowering/<file>), so a folder built on one machine and carried to another still resolves;
    a kernel that was not built keeps library None and its `reason`. Reads JSON only (no TVM, no torch).
    ValueError (one line) where out_dir holds no readable manifest."""
    folder = Path(out_dir)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["kernels"]
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: make the folder with `uacompile build --target {target} "
                         f"--out {folder}`") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a uacompile build manifest ({type(e).__name__}: {e})") from None
    out: dict[str, dict] = {}
    for entry in entries:
        if entry.get("target") != target or entry.get("lowering") != lowering:
            continue
        entry = dict(entry)
        for k in ("source", "library"):
            if isinstance(entry.get(k), str):
                entry[k] = str(folder.absolute() / target / lowering / _inside(Path(entry[k]), target, lowering))
        out[entry["symbol"]] = entry
    return out


def _inside(path: Path, target: str, lowering: str) -> Path:
    """A recorded artefact path relative to its lowering's folder (what follows the last <target>/<lowering>)."""
    parts = path.parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i:i + 2] == (target, lowering):
            return Path(*parts[i + 2:])
    return Path(path.name)


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


def build_one(op: OpSpec | Kernel, target: str, lowering: str, out_dir: Path) -> dict:
    """Build one kernel (an op alone: its default config); never raises for a missing toolchain: the entry says
    why instead."""
    op = as_kernel(op)
    cfg = op.to_dict()["config"]
    entry = {"op": op.kind, "target": target, "lowering": lowering, "params": op.op.to_dict(), "config": cfg,
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


def build_set(preset: str, targets, out_dir: Path, progress: bool = True, tuning=None) -> dict:
    """Build a preset's kernels for every target and lowering (with the tuned configs of `tuning`, a
    tunedb.TuningDB); write and return out_dir/manifest.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(k, t, low) for t in targets for low in lowerings_for(t) for k in preset_kernels(preset, t, low, tuning)]
    from tqdm import tqdm

    entries = []
    bar = tqdm(jobs, unit="kernel", disable=not progress, dynamic_ncols=True)
    for op, t, low in bar:
        bar.set_description(f"{t}/{low} {op.kind}")
        entries.append(build_one(op, t, low, out_dir / t / low))
    manifest = {"uacompile": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "targets": list(targets), "kernels": entries}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
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
    from .lower.tvm_cuda import build_cuda_library, cuda_source
    from .nvcc import NvccNotFound

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

    from .nvcc import NvccNotFound, nvcc_path
    from .targets.cuda.build import build
    from .targets.cuda.render import render_op

    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{op.symbol()}_{arch}.cu"
    src.write_text(render_op(op, arch))  # IRError for a variant the templates do not cover
    try:
        nvcc_path()
    except NvccNotFound as e:
        return {"source": src, "library": None, "reason": str(e), "arch": arch}
    res = build(op, arch)
    lib = out_dir / f"{op.symbol()}_{arch}.so"
    shutil.copyfile(res.path, lib)
    return {"source": src, "library": lib, "arch": arch, "cached": res.hit}


def _version() -> str:
    from . import __version__

    return __version__
