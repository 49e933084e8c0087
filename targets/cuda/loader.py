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

    def function(self, op: ir.OpSpec | ir.Kernel):
        sym = op.symbol()
        if sym not in self._functions:
            if sym not in {o.symbol() for o in self.ops}:
                raise KeyError(f"op {sym} is not in library {self.path}")
            self._functions[sym] = getattr(self.lib, sym)
        return self._functions[sym]


_loaded: dict[tuple[str, tuple[str, ...]], KernelLibrary] = {}
_lock = threading.Lock()


def load_library(path: Path | str, ops: Iterable[ir.OpSpec | ir.Kernel],
                 build_result: BuildResult | None = None) -> KernelLibrary:
    """dlopen a built .so and declare the launchers of its kernels (once per path and kernel set)."""
    import cffi

    ops = list({op.symbol(): ir.as_kernel(op) for op in ops}.values())  # a variant listed twice is declared once
    key = (str(path), tuple(sorted(op.symbol() for op in ops)))
    with _lock:
        if key not in _loaded:
            ffi = cffi.FFI()
            ffi.cdef("\n".join(ir.cffi_cdef(op) for op in ops))
            _loaded[key] = KernelLibrary(Path(path), ops, ffi, ffi.dlopen(str(path)), build_result)
        return _loaded[key]


def load(ops: ir.OpSpec | ir.Kernel | Iterable[ir.OpSpec | ir.Kernel], arch: str | None = None) -> KernelLibrary:
    """Build (through the cache) and load one library holding every kernel in ops."""
    ops = [ir.as_kernel(op) for op in ([ops] if isinstance(ops, (ir.OpSpec, ir.Kernel)) else ops)]
    res = build(ops, arch)
    return load_library(res.path, ops, res)
