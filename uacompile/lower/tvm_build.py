"""CPU kernels from the TVM lowering: build once (LLVM, cached as a shared library), load, call.

    k = cpu_kernel(PagedAttention(8, 2, 64))
    k(q=q, k_cache=kc, v_cache=vc, token_seq=ts, page_table=pt, token_kv_len=kl, out=out)

Arguments are keyword, named as op.params() and checked by uacompile.binding; tensors are
numpy arrays or torch CPU tensors (outputs too: the kernel writes into them), sizes may be
omitted (inferred from shapes).
bf16 numpy arrays travel as zero-copy torch views (numpy's DLPack has no bf16); fp8 travels
as its raw bytes (uint8), which is what the kernel decodes.

A cached kernel loads without importing tvm: its cache key needs no TVM (the host CPU is read
from the OS), and the library loads through tvm_ffi with TVM's small runtime library (which
serves the kernel's parallel loops). Only a build (a cache miss) imports tvm.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..binding import host_binder
from ..cache import cached_build, content_hash, toolchain_versions
from ..ir import Kernel, OpSpec, as_kernel
from .tvm_kernels import generator_source, prim_func

CACHE_KIND = "tvm_cpu"
LIBRARY = "kernel.so"
_loaded: dict[str, "CpuKernel"] = {}
_lock = threading.Lock()
log = logging.getLogger(__name__)


def cpu_target() -> dict:
    """The LLVM target: this machine's CPU (part of the cache key, so caches never cross CPUs)."""
    import tvm

    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


@functools.cache
def host_cpu() -> dict:
    """This machine's CPU as the OS describes it (architecture, model, feature flags), read without
    TVM: part of the cache key, so a library built for one CPU is never loaded on another."""
    info = {"machine": platform.machine()}
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {**info, "processor": platform.processor()}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU implementer", "CPU part", "vendor_id") and key not in info:
            info[key] = value.strip()
    return info


def cpu_cache_key(op: OpSpec) -> str:
    return content_hash(op.to_dict(), generator_source(), toolchain_versions("tvm", "g++"), host_cpu())


def _load_library(path: Path, symbol: str):
    """The kernel function of a TVM-built library, through tvm_ffi and libtvm_runtime (no tvm import)."""
    import tvm_ffi

    _tvm_runtime()
    return tvm_ffi.load_module(str(path))[symbol]


@functools.cache
def _tvm_runtime() -> None:
    """Load TVM's runtime library once, globally: a library's parallel loops call into it.

    TVM's thread pool takes its size from TVM_NUM_THREADS when it starts, and without it uses half the cores on
    x86 (it assumes two hyperthreads a core: one thread on a 2-core VM). So TVM_NUM_THREADS defaults here to the
    CPUs this process may run on; set_cpu_threads lowers the count later."""
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tvm package (apache-tvm) is not installed")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtvm_runtime.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def set_cpu_threads(n: int) -> None:
    """Run the CPU kernels' parallel loops on n threads (process-wide; at most TVM_NUM_THREADS, which the first
    kernel load fixes: by default every CPU this process may use)."""
    import tvm_ffi

    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"set_cpu_threads: n must be an int >= 1, got {n!r}")
    _tvm_runtime()
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, n)  # 1: TVM's kBig affinity mode (its default)


def cpu_threads_setter():
    """set_cpu_threads without its checks or look-ups, for a caller that resizes the pool every step: a callable
    n -> None (n: an int >= 1)."""
    import tvm_ffi

    _tvm_runtime()
    config = tvm_ffi.get_global_func("runtime.config_threadpool")
    return lambda n: config(1, n)


def build_cpu_library(op: OpSpec, out_dir: Path) -> Path:
    """Compile op's TIR for the CPU and export it as out_dir/kernel.so (+ kernel.json)."""
    import tvm

    ex = tvm.compile(prim_func(op, "cpu"), target=tvm.target.Target(cpu_target()))
    out_dir = Path(out_dir)
    ex.export_library(str(out_dir / LIBRARY))
    (out_dir / "kernel.json").write_text(json.dumps({"op": op.to_dict(), "symbol": op.symbol(), "target": cpu_target()}))
    return out_dir / LIBRARY


def cpu_kernel(op) -> "CpuKernel":
    """The callable CPU kernel of an op or ir.Kernel (op + TVMConfig), from the build cache (built on a miss;
    loaded once per process)."""
    if not isinstance(op, (OpSpec, Kernel)):
        raise TypeError(f"op: must be an ir op spec or ir.Kernel, got {type(op).__name__}")
    op = as_kernel(op)
    key = cpu_cache_key(op)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        t0 = time.perf_counter()
        folder, hit = cached_build(CACHE_KIND, key, lambda d: build_cpu_library(op, d))
        fn = _load_library(folder / LIBRARY, op.symbol())
        kernel = _loaded[key] = CpuKernel(op, folder / LIBRARY, hit, fn)
        log.log(logging.DEBUG if hit else logging.INFO, "kernel %s (%s) %s in %.2f s: %s", op.symbol(), op.kind,
                "loaded from the cache" if hit else "built", time.perf_counter() - t0, folder)
        return kernel


@dataclass
class CpuKernel:
    """Binds through uacompile.binding's host binder, then hands the TVM function the views it
    takes: fp8 as its raw bytes (uint8), bf16 numpy arrays as zero-copy torch views (numpy's
    DLPack has no bf16)."""

    op: OpSpec
    path: Path
    cache_hit: bool  # whether the library came from the cache (False: built in this process)
    fn: object = field(repr=False)

    def __post_init__(self):
        self.binder = host_binder(self.op)
        self.viewed = [(i, p.dtype) for i, p in enumerate(self.binder.tensor_specs) if p.dtype in ("fp8_e4m3", "bf16")]

    def __call__(self, **args) -> None:
        tensors, sizes = self.binder(args)
        for i, dtype in self.viewed:
            if tensors[i] is not None:
                tensors[i] = _tvm_view(dtype, tensors[i])
        self.fn(*tensors, *sizes)


def _tvm_view(dtype: str, x):
    if isinstance(x, np.ndarray):
        if dtype == "fp8_e4m3":
            return x.view(np.uint8)
        import torch  # numpy's DLPack has no bf16: hand over a zero-copy torch view of the same memory

        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    if dtype == "fp8_e4m3":
        import torch

        return x.view(torch.uint8)
    return x


__all__ = ["cpu_kernel", "CpuKernel", "set_cpu_threads", "cpu_threads_setter", "build_cpu_library", "cpu_cache_key",
           "cpu_target", "host_cpu"]
