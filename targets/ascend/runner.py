"""Load an emulator build of a generated AscendC kernel and call its launcher from numpy.

The launcher is the same `int ua_<op>_<hash>(void*..., int64_t..., aclrtStream)` as on the
NPU; here it runs the kernel's blocks as threads over the caller's arrays (GM), or, in the
CPU-debug build, one process per block over GmAlloc copies of them. build.load builds and
loads one. Arguments
are checked against op.params() first (uacompile.binding): a wrong dtype is a TypeError, a
wrong shape or size a ValueError, each naming the argument; sizes may be omitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from uacompile.binding import NUMPY, Binder
from uacompile.ir import OpSpec, cffi_cdef


class EmulatorError(RuntimeError):
    """The emulator rejected the kernel's behaviour (bounds, alignment, UB, queues, hazards)."""


@dataclass
class EmulatedKernel:
    op: OpSpec
    library: Path
    _lib: object = field(init=False, repr=False)
    _ffi: object = field(init=False, repr=False)
    _binder: Binder = field(init=False, repr=False)

    def __post_init__(self):
        import cffi

        self._binder = Binder(self.op, (NUMPY,))

        sym = self.op.symbol()
        self._ffi = cffi.FFI()
        decls = [cffi_cdef(self.op), f"const char* {sym}_last_error(void);"]
        if self.op.kind == "swap_blocks":
            decls.append(f"int64_t {sym}_plan(const int64_t*, int64_t, int64_t, int64_t, int64_t*);")
        self._ffi.cdef("\n".join(decls))
        self._lib = self._ffi.dlopen(str(self.library))

    def bind(self, arrays: dict) -> tuple[list, list]:
        """Check arrays against op.params() (uacompile.binding); return (tensor arrays, sizes) in launcher order."""
        return self._binder(arrays)

    def __call__(self, **arrays) -> None:
        tensors, sizes = self.bind(arrays)
        ptrs = [self._ffi.NULL if a is None else self._ffi.cast("void*", a.ctypes.data) for a in tensors]
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
