"""Kernel backends for the runtime: the four ops the executor launches, one interface.

  tvm-cpu    TVM-LLVM kernels from uacompile.lower (the shipped CPU path)
  cuda       the generated CUDA kernels (uacompile.targets.cuda), cffi launchers on torch's stream
  reference  uacompile.reference in numpy float64 (slow; an explicit choice for debugging)

Every call takes keyword tensors named as in op.params(); sizes are bound from the shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from uacompile import binding, ir, reference

BACKENDS = ("tvm-cpu", "cuda", "reference")


@dataclass(frozen=True)
class KernelOps:
    """The op variants a model needs, built in one place from its shape."""

    attention: ir.PagedAttention
    cache_write: ir.ReshapeAndCache
    copy: ir.CopyBlocks
    swap: ir.SwapBlocks

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                  sliding_window: int = 0, variant: str = "ua") -> "KernelOps":
        dt = ir.from_torch(dtype)
        if dt not in ir.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {[ir.torch_dtype(d) for d in ir.FLOAT_DTYPES]}, got {dtype}")
        return cls(ir.PagedAttention(num_heads, num_kv_heads, head_dim, page_size, q_dtype=dt, kv_dtype=dt,
                                     window=sliding_window, variant=variant),
                   ir.ReshapeAndCache(num_kv_heads, head_dim, page_size, dtype=dt, kv_dtype=dt),
                   ir.CopyBlocks(num_kv_heads, head_dim, page_size, kv_dtype=dt),
                   ir.SwapBlocks(num_kv_heads, head_dim, page_size, kv_dtype=dt))


class KernelBackend:
    name = "base"

    def __init__(self, ops: KernelOps):
        self.ops = ops

    def run(self, op: ir.OpSpec, **tensors) -> None:
        raise NotImplementedError

    def prepare(self, max_tokens: int, max_seqs: int, max_kv_len: int, progress: bool = False) -> dict:
        """Build or load, before serving, every kernel a step within these limits may launch."""
        return dict(kernels=0, cached=0, seconds=0.0)

    def plan_step(self, num_tokens: int, num_seqs: int, max_kv_len: int):
        """What a step's attention launches need, worked out once before its layers (None: nothing to plan)."""
        return None

    # the executor's four calls
    def reshape_and_cache(self, k, v, slot_mapping, k_cache, v_cache) -> None:
        self.run(self.ops.cache_write, k=k, v=v, slot_mapping=slot_mapping, k_cache=k_cache, v_cache=v_cache)

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None) -> None:
        self.run(self.ops.attention, q=q, k_cache=k_cache, v_cache=v_cache, token_seq=token_seq,
                 page_table=page_table, token_kv_len=token_kv_len, out=out)

    def copy_blocks(self, kv, mapping) -> None:
        self.run(self.ops.copy, kv=kv, mapping=mapping)

    def swap_blocks(self, src, dst, mapping) -> None:
        self.run(self.ops.swap, src=src, dst=dst, mapping=mapping)


class ReferenceBackend(KernelBackend):
    """numpy float64 reference; works on CPU tensors in place through shared memory."""

    name = "reference"

    def __init__(self, ops: KernelOps):
        super().__init__(ops)
        self.binders = {op.kind: binding.host_binder(op) for op in (ops.attention, ops.cache_write, ops.copy, ops.swap)}

    def run(self, op, **tensors):
        self.binders[op.kind](tensors)  # names, dtypes, shapes, layout, on the CPU
        arrays = {}
        for k, t in tensors.items():
            if t.dtype == torch.bfloat16:
                raise TypeError(f"reference backend: {k} must be fp32/fp16 (numpy has no bf16 view), got {t.dtype}")
            arrays[k] = t.numpy()  # a view: in-place writes land in the torch tensor
        if op.kind == "paged_attention":
            out = arrays.pop("out")
            # hand the reference only the pages in use (it converts whole caches to float64)
            table = arrays["page_table"]
            used = np.unique(table[table >= 0])
            remap = np.full(int(used.max(initial=0)) + 1, -1, dtype=np.int32)
            remap[used] = np.arange(len(used), dtype=np.int32)
            arrays["page_table"] = np.where(table >= 0, remap[np.maximum(table, 0)], -1).astype(np.int32)
            arrays["k_cache"], arrays["v_cache"] = arrays["k_cache"][used], arrays["v_cache"][used]
            o, _ = reference.paged_attention(op, **arrays)
            out[...] = o
        else:
            reference.run(op, **arrays)


class TVMCPUBackend(KernelBackend):
    """TVM-LLVM kernels (uacompile.lower.tvm_build.cpu_kernel), built once per op and cached on disk. A step's
    attention runs the tuning database's TVMConfig for the step's bucket (`uacompile tune --target cpu`; tuned:
    a tunedb.Tuned, None: the default database, False: none), else the default schedule."""

    name = "tvm-cpu"

    def __init__(self, ops: KernelOps, tuned=None):
        super().__init__(ops)
        try:
            from uacompile.lower.tvm_build import cpu_kernel
        except ImportError as e:
            raise NotImplementedError(f"tvm-cpu backend: uacompile.lower.tvm_build is not available ({e})") from None
        self.cpu_kernel = cpu_kernel
        self.fns = {op.kind: cpu_kernel(op) for op in (ops.attention, ops.cache_write, ops.copy, ops.swap)}
        if tuned is None:
            from uacompile.tunedb import default_tuned

            tuned = default_tuned("cpu")
        self.tuned = tuned or None

    def plan_step(self, num_tokens: int, num_seqs: int, max_kv_len: int):
        """The step's attention kernel: the tuned one of its bucket, or None (the default kernel)."""
        if self.tuned is None:
            return None
        from uacompile.lower.config import TVMConfig

        config = self.tuned.config(self.ops.attention, num_tokens, num_seqs, max_kv_len)
        if not isinstance(config, TVMConfig) or config.num_splits > 1:
            return None
        return self.cpu_kernel(ir.Kernel(self.ops.attention, config))  # loaded once per process

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None) -> None:
        (plan or self.fns["paged_attention"])(q=q, k_cache=k_cache, v_cache=v_cache, token_seq=token_seq,
                                              page_table=page_table, token_kv_len=token_kv_len, out=out)

    def run(self, op, **tensors):
        self.fns[op.kind](**tensors)  # checks shapes, dtypes and layout itself


class CUDABackend(KernelBackend):
    """Generated CUDA kernels (Jinja templates, nvcc, cffi) through uacompile.targets.cuda: launched on
    torch's current stream; a step's attention is planned once (split-KV by the step's shapes) and run
    every layer."""

    name = "cuda"

    def __init__(self, ops: KernelOps):
        super().__init__(ops)
        try:
            from uacompile.targets.cuda import api, attention, layout, plan
        except ImportError as e:
            raise NotImplementedError(f"cuda backend: uacompile.targets.cuda is not available ({e})") from None
        layout.check(ops.attention)  # IRError naming the field the CUDA template does not cover
        self.api, self.attention, self.planner = api, attention, plan
        self.device = torch.cuda.current_device()
        self.workspace = plan.Workspace(torch.device("cuda", self.device))

    def prepare(self, max_tokens: int, max_seqs: int, max_kv_len: int, progress: bool = False) -> dict:
        """Build or load every kernel a step within these limits may launch (planner.reachable_configs), so no
        step waits for nvcc; returns {kernels, cached libraries, seconds}."""
        import time

        t0 = time.perf_counter()
        plan = self.planner
        arch, sms = plan.device_arch(self.device), plan.device_sms(self.device)
        from uacompile.tunedb import default_tuned

        configs = plan.reachable_configs(self.ops.attention, max_tokens, max_seqs, max_kv_len, sms, arch,
                                         default_tuned("cuda", self.device))  # tuned records' kernels too
        kernels = [ir.Kernel(self.ops.attention, c) for c in configs]
        kernels += [ir.Kernel(self.ops.cache_write), ir.Kernel(self.ops.copy), ir.Kernel(self.ops.swap)]
        hits = self.api.preload(kernels, progress=progress)
        return dict(kernels=len(kernels), cached=hits, seconds=time.perf_counter() - t0)

    def plan_step(self, num_tokens: int, num_seqs: int, max_kv_len: int):
        return self.planner.plan(self.ops.attention, num_tokens, num_seqs, max_kv_len, workspace=self.workspace)

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None) -> None:
        if plan is None:
            plan = self.plan_step(q.shape[0], page_table.shape[0], page_table.shape[1] * self.ops.attention.page_size)
        self.attention.run(plan, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out=out)

    def run(self, op, **tensors):
        self.api.kernel(op)(**tensors)  # checks names, dtypes, shapes, devices itself


def make_backend(name: str, ops: KernelOps, device: str) -> KernelBackend:
    if name == "auto":
        name = "cuda" if device == "cuda" else "tvm-cpu"
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    if name == "cuda" and device != "cuda":
        raise ValueError("kernel_backend='cuda' needs device='cuda'")
    if name != "cuda" and device == "cuda":
        raise ValueError(f"kernel_backend={name!r} runs on the CPU; use device='cpu' or kernel_backend='cuda'")
    return {"reference": ReferenceBackend, "tvm-cpu": TVMCPUBackend, "cuda": CUDABackend}[name](ops)
