"""Load built kernel libraries with cffi; the declarations come from the IR (ir.cffi_cdef).

    from uacompile.targets.cuda.loader import load
    lib = load([op1, op2])               # build (cached) + dlopen, once per process
    fn = lib.function(op1)               # cffi function: fn(void* ..., int64 ..., void* stream) -> int
    fn(*[lib.ffi.cast("void*", t.data_ptr()) for t in tensors], *sizes, lib.ffi.cast("void*", stream))

Prefer api.CudaKernel, which checks tensors and passes the stream for you.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from uacompile import ir
from .build import BuildResult, build


@dataclass
class KernelLibrary:
    path: Path
    ops: list
    ffi: object
    lib: object
    build: BuildResult | None = None
    _functions: dict = field(default_factory=dict)

    def function(self, op: ir.OpSpec):
        sym = op.symbol()
        if sym not in self._functions:
            if sym not in {o.symbol() for o in self.ops}:
                raise KeyError(f"op {sym} is not in library {self.path}")
            self._functions[sym] = getattr(self.lib, sym)
        return self._functions[sym]


_loaded: dict[tuple[str, tuple[str, ...]], KernelLibrary] = {}
_lock = threading.Lock()


def load_library(path: Path | str, ops: Iterable[ir.OpSpec], build_result: BuildResult | None = None) -> KernelLibrary:
    """dlopen a built .so and declare the launchers of ops (once per path and op set)."""
    import cffi

    ops = list({op.symbol(): op for op in ops}.values())  # a variant listed twice is declared once
    key = (str(path), tuple(sorted(op.symbol() for op in ops)))
    with _lock:
        if key not in _loaded:
            ffi = cffi.FFI()
            ffi.cdef("\n".join(ir.cffi_cdef(op) for op in ops))
            _loaded[key] = KernelLibrary(Path(path), ops, ffi, ffi.dlopen(str(path)), build_result)
        return _loaded[key]


def load(ops: ir.OpSpec | Iterable[ir.OpSpec], arch: str | None = None) -> KernelLibrary:
    """Build (through the cache) and load one library holding every op in ops."""
    ops = [ops] if isinstance(ops, ir.OpSpec) else list(ops)
    res = build(ops, arch)
    return load_library(res.path, ops, res)


# ---------------------------------------------------------------- design candidates side by side
def _build_design(env_var: str, design: str, ops: list, arch: str | None) -> str:
    """In a spawned worker: build ops with the design's knobs in env_var; the library path."""
    import os

    os.environ[env_var] = design
    return str(build(ops, arch).path)


def load_designs(env_var: str, designs: dict, ops: list, arch: str | None = None) -> dict:
    """{name: KernelLibrary, or the exception its build raised}: ops built once per design
    ("k=v,..." in env_var, which the template's context builder reads at render; "" is production),
    each in its own spawned process so that no build sees another's knobs, nvcc runs in parallel."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    out = {}
    workers = max(1, min(len(designs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_build_design, env_var, d, ops, arch) for name, d in designs.items()}
        for name, fut in futures.items():
            try:
                out[name] = load_library(fut.result(), ops)
            except Exception as e:  # noqa: BLE001 - a design that does not build is reported, not fatal
                out[name] = e
    return out


def build_failure(e: Exception) -> str:
    """A design's failed build in one line (a sweep's row)."""
    text = str(e).strip()
    return f"build: {text.splitlines()[-1][:200] if text else type(e).__name__}"
