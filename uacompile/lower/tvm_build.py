"""CPU kernels from the TVM lowering: build once (LLVM, cached as a shared library), load, call.

    k = cpu_kernel(PagedAttention(8, 2, 64))
    k(q=q, k_cache=kc, v_cache=vc, token_seq=ts, page_table=pt, token_kv_len=kl, out=out)

Arguments are keyword, named as op.params(); tensors are numpy arrays or torch CPU tensors
(outputs too: the kernel writes into them), sizes may be omitted (inferred from shapes).
bf16 numpy arrays travel as zero-copy torch views (numpy's DLPack has no bf16); fp8 travels
as its raw bytes (uint8), which is what the kernel decodes.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..cache import cached_build, content_hash, toolchain_versions
from ..ir import OpSpec, numpy_dtype
from .tvm_kernels import generator_source, prim_func

CACHE_KIND = "tvm_cpu"
LIBRARY = "kernel.so"
_loaded: dict[str, "CpuKernel"] = {}
_lock = threading.Lock()

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8",
                 "fp8_e4m3": "float8_e4m3fn", "int32": "int32", "int64": "int64"}


def cpu_target() -> dict:
    """The LLVM target: this machine's CPU (part of the cache key, so caches never cross CPUs)."""
    import tvm

    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


def cpu_cache_key(op: OpSpec) -> str:
    return content_hash(op.to_dict(), generator_source(), toolchain_versions("tvm", "g++"), cpu_target())


def build_cpu_library(op: OpSpec, out_dir: Path) -> Path:
    """Compile op's TIR for the CPU and export it as out_dir/kernel.so (+ kernel.json)."""
    import tvm

    ex = tvm.compile(prim_func(op, "cpu"), target=tvm.target.Target(cpu_target()))
    out_dir = Path(out_dir)
    ex.export_library(str(out_dir / LIBRARY))
    (out_dir / "kernel.json").write_text(json.dumps({"op": op.to_dict(), "symbol": op.symbol(), "target": cpu_target()}))
    return out_dir / LIBRARY


def cpu_kernel(op: OpSpec) -> "CpuKernel":
    """The callable CPU kernel of op, from the build cache (built on a miss; loaded once per process)."""
    if not isinstance(op, OpSpec):
        raise TypeError(f"op: must be an ir op spec, got {type(op).__name__}")
    key = cpu_cache_key(op)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        import tvm

        folder, hit = cached_build(CACHE_KIND, key, lambda d: build_cpu_library(op, d))
        fn = tvm.runtime.load_module(str(folder / LIBRARY))[op.symbol()]
        kernel = _loaded[key] = CpuKernel(op, folder / LIBRARY, hit, fn)
        return kernel


@dataclass
class CpuKernel:
    op: OpSpec
    path: Path
    cache_hit: bool  # whether the library came from the cache (False: built in this process)
    fn: object = field(repr=False)

    def __post_init__(self):
        self._binder = ArgBinder(self.op)

    def __call__(self, **args) -> None:
        self.fn(*self._binder(args))


def bind_args(op: OpSpec, args: dict) -> list:
    """Check keyword args against op.params() and return them in order, ready for the TVM function."""
    return ArgBinder(op)(args)


class ArgBinder:
    """The per-op checking plan, computed once: this runs on every call (every layer, every step)."""

    def __init__(self, op: OpSpec):
        self.op = op
        self.names = [p.name for p in op.params()]
        self.name_set = frozenset(self.names)
        self.tensors = [(p, _accepted_numpy(p.dtype), p.role != "in") for p in op.tensors()]
        self.sizes = [p.name for p in op.sizes()]
        self.torch_dtypes: dict | None = None  # filled on the first torch tensor

    def __call__(self, args: dict) -> list:
        for n in args:
            if n not in self.name_set:
                raise TypeError(f"{n}: not a parameter of {self.op.kind}; parameters: {self.names}")
        dims: dict[str, int] = {}
        src: dict[str, str] = {}
        out = []
        for p, np_ok, is_out in self.tensors:
            x = args.get(p.name)
            if x is None:
                raise TypeError(f"{p.name}: missing tensor argument ({p.dtype}{list(p.shape)}) of {self.op.kind}")
            if isinstance(x, np.ndarray):
                shape = self._check_numpy(p, x, np_ok, is_out)
                if p.dtype in ("fp8_e4m3", "bf16"):
                    x = _numpy_view(p.dtype, x)
            else:
                shape = self._check_torch(p, x)
                if p.dtype == "fp8_e4m3":
                    x = x.view(self.torch_dtypes["uint8"])
            if len(shape) != len(p.shape):
                raise ValueError(f"{p.name}: expected {len(p.shape)} dims {list(p.shape)}, got shape {tuple(shape)}")
            for i, (want, got) in enumerate(zip(p.shape, shape)):
                if want.__class__ is int:
                    if got != want:
                        raise ValueError(f"{p.name}: dim {i} must be {want} (shape {list(p.shape)}), got {tuple(shape)}")
                elif want not in dims:
                    dims[want], src[want] = got, p.name
                elif dims[want] != got:
                    raise ValueError(f"{p.name}: dim {i} ({want}) is {got} but {src[want]} has {want}={dims[want]}")
            out.append(x)
        for name in self.sizes:
            v = args.get(name)
            if v is None:
                if name not in dims:
                    raise TypeError(f"{name}: size not given and no tensor shape implies it")
                v = dims[name]
            elif isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}: must be an int, got {type(v).__name__}")
            elif name in dims and int(v) != dims[name]:
                raise ValueError(f"{name}: given {int(v)} but {src[name]} has {name}={dims[name]}")
            out.append(int(v))
        return out

    @staticmethod
    def _check_numpy(p, x, np_ok, is_out) -> tuple:
        if x.dtype not in np_ok:
            raise TypeError(f"{p.name}: expected dtype {p.dtype} ({numpy_dtype(p.dtype)}), got {x.dtype}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{p.name}: must be C-contiguous")
        if is_out and not x.flags.writeable:
            raise ValueError(f"{p.name}: is an output and must be writeable")
        return x.shape

    def _check_torch(self, p, x) -> tuple:
        if self.torch_dtypes is None:
            torch = _torch_if_tensor(x)
            if torch is None:
                raise TypeError(f"{p.name}: expected a numpy array or torch CPU tensor, got {type(x).__name__}")
            self.torch_dtypes = {**{k: getattr(torch, v) for k, v in _TORCH_DTYPES.items()}, "uint8": torch.uint8,
                                 "Tensor": torch.Tensor}
        td = self.torch_dtypes
        if not isinstance(x, td["Tensor"]):
            raise TypeError(f"{p.name}: expected a numpy array or torch CPU tensor, got {type(x).__name__}")
        if x.dtype != td[p.dtype] and not (p.dtype == "fp8_e4m3" and x.dtype == td["uint8"]):
            raise TypeError(f"{p.name}: expected dtype {p.dtype} ({td[p.dtype]}), got {x.dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"{p.name}: must be on the CPU, got device {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"{p.name}: must be contiguous")
        return x.shape


def _accepted_numpy(dtype: str) -> tuple:
    return (numpy_dtype(dtype), np.dtype(np.uint8)) if dtype == "fp8_e4m3" else (numpy_dtype(dtype),)


def _torch_if_tensor(x):
    if type(x).__module__.startswith("torch"):
        import torch

        return torch if isinstance(x, torch.Tensor) else None
    return None


def _numpy_view(dtype: str, x: np.ndarray):
    if dtype == "fp8_e4m3":
        return x.view(np.uint8)
    import torch  # numpy's DLPack has no bf16: hand over a zero-copy torch view of the same memory

    return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)


__all__ = ["cpu_kernel", "CpuKernel", "ArgBinder", "bind_args", "build_cpu_library", "cpu_cache_key", "cpu_target"]
