"""Load an emulator build of a generated AscendC kernel and call its launcher from numpy.

The launcher is the same `int ua_<op>_<hash>(void*..., int64_t..., aclrtStream)` as on the
NPU; here it runs the kernel's blocks as threads over the caller's arrays (GM). Arguments
are checked against op.params() first: a wrong dtype is a TypeError, a wrong shape or
size a ValueError, each naming the argument.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from uacompile.ir import OpSpec, cffi_cdef, numpy_dtype


class EmulatorError(RuntimeError):
    """The emulator rejected the kernel's behaviour (bounds, alignment, UB, queues, hazards)."""


@dataclass
class EmulatedKernel:
    op: OpSpec
    library: Path
    _lib: object = field(init=False, repr=False)
    _ffi: object = field(init=False, repr=False)

    def __post_init__(self):
        import cffi

        sym = self.op.symbol()
        self._ffi = cffi.FFI()
        decls = [cffi_cdef(self.op), f"const char* {sym}_last_error(void);"]
        if self.op.kind == "swap_blocks":
            decls.append(f"int64_t {sym}_plan(const int64_t*, int64_t, int64_t, int64_t, int64_t*);")
        self._ffi.cdef("\n".join(decls))
        self._lib = self._ffi.dlopen(str(self.library))

    def bind(self, arrays: dict) -> tuple[list, list]:
        """Check arrays against op.params(); return (tensor arrays, sizes) in launcher order."""
        names = {p.name for p in self.op.params()}
        extra = sorted(set(arrays) - names)
        if extra:
            raise TypeError(f"{self.op.kind}: unexpected argument(s) {extra}")
        sizes = {}
        for p in self.op.sizes():
            v = arrays.get(p.name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{p.name}: must be an int, got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"{p.name}: must be >= 0, got {v}")
            sizes[p.name] = int(v)
        tensors = []
        for p in self.op.tensors():
            a = arrays.get(p.name)
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{p.name}: must be a numpy array, got {type(a).__name__}")
            want = numpy_dtype(p.dtype)
            if a.dtype != want:
                raise TypeError(f"{p.name}: dtype must be {want} ({p.dtype}), got {a.dtype}")
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in p.shape)
            if a.shape != shape:
                raise ValueError(f"{p.name}: shape must be {shape}, got {a.shape}")
            if not a.flags.c_contiguous:
                raise ValueError(f"{p.name}: must be C-contiguous")
            if p.role != "in" and not a.flags.writeable:
                raise ValueError(f"{p.name}: must be writeable ({p.role})")
            tensors.append(a)
        return tensors, [sizes[p.name] for p in self.op.sizes()]

    def __call__(self, **arrays) -> None:
        tensors, sizes = self.bind(arrays)
        ptrs = [self._ffi.cast("void*", a.ctypes.data) for a in tensors]
        sym = self.op.symbol()
        rc = getattr(self._lib, sym)(*ptrs, *sizes, self._ffi.NULL)
        if rc != 0:
            msg = self._ffi.string(getattr(self._lib, f"{sym}_last_error")()).decode() if rc == 1 else ""
            raise EmulatorError(f"{sym} returned {rc}: {msg or 'bad sizes or mapping'}")

    def swap_plan(self, mapping: np.ndarray, num_src_pages: int, num_dst_pages: int) -> np.ndarray:
        """swap_blocks only: the (src, dst, len) runs the launcher copies, one memcpy per run and plane."""
        m = np.ascontiguousarray(mapping, dtype=np.int64).reshape(-1, 2)
        out = np.zeros((len(m), 3), np.int64)
        n = getattr(self._lib, f"{self.op.symbol()}_plan")(
            self._ffi.cast("int64_t*", m.ctypes.data), len(m), num_src_pages, num_dst_pages,
            self._ffi.cast("int64_t*", out.ctypes.data))
        if n < 0:
            raise ValueError(f"mapping: {'a page index is out of range' if n == -1 else 'a destination repeats'}")
        return out[:n]


@functools.lru_cache(maxsize=None)
def load(op: OpSpec, soc: str | None = None) -> EmulatedKernel:
    """Build (cached) and load the emulator library of op."""
    from .build import emulator_library
    from .generate import DEFAULT_SOC

    return EmulatedKernel(op, emulator_library(op, soc or DEFAULT_SOC))
