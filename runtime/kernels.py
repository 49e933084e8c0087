"""Kernel backends for the runtime: the four ops the executor launches, and the model's fused layer ops, one
interface.

  tvm-cpu    TVM-LLVM kernels from uacompile.lower (the shipped CPU path)
  cuda       the generated CUDA kernels (uacompile.targets.cuda), cffi launchers on torch's stream
  reference  uacompile.reference in numpy float64 (slow; an explicit choice for debugging)

Every call takes keyword tensors named as in op.params(); sizes are bound from the shapes. The layer ops
(rms_norm with the residual add, silu_and_mul, rope) are TorchLayerOps' torch code (the unfused model's
arithmetic, exactly) unless a backend has kernels for them: cuda launches ir.RMSNorm / SiluAndMul / Rope.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

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


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, then back, as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half on x [T, H, D]; cos/sin [T, 1, D/2]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class TorchLayerOps:
    """The model's layer ops in torch: the fallback of every backend without kernels for them."""

    def prepare_layers(self, ops: list) -> None:
        """Build (or load) the layer-op kernels a model will launch (ir.RMSNorm, SiluAndMul, Rope) before its
        first step; nothing to do in torch."""

    def rms_norm(self, x, weight, eps: float, residual=None):
        """RMSNorm of x's rows [N, E] times weight; with residual, of h = x + residual, returning (out, h): the
        next residual. A backend may write h into residual and out into x (in place)."""
        if residual is None:
            return torch_rms_norm(x, weight, eps)
        h = residual + x
        return torch_rms_norm(h, weight, eps), h

    def silu_and_mul(self, x):
        """silu(gate) * up of a merged gate/up projection x [T, 2I] -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x, positions, rope_theta: float, freq_factors: tuple, cos, sin):
        """NeoX RoPE of x [T, H, D] at positions, of frequencies 1 / rope_theta^(2i / D) / freq_factors[i]
        (ir.Rope), which the model's cos / sin tables [T, 1, D/2] hold too. Returns the rotated x (may be x itself,
        rotated in place)."""
        return apply_rope(x, cos, sin)


class KernelLayerOps(TorchLayerOps):
    """The layer ops on kernels (ir.RMSNorm, SiluAndMul, Rope): a subclass gives build_layer_kernel(op), a
    callable over op.params() keywords. The residual stream is updated in place (rms_norm writes h into
    residual and the norm into x), rope rotates a contiguous x in place."""

    def build_layer_kernel(self, op: ir.OpSpec):
        raise NotImplementedError

    @property
    def layer_kernels(self) -> dict:
        """op -> its kernel, for the layer ops launched so far (built at first use)."""
        return self.__dict__.setdefault("_layer_kernels", {})

    def layer_kernel(self, key: tuple, make_op):
        """The kernel of make_op()'s op, found by key (plain values: a hit builds no op, every layer every step)."""
        by_key = self.__dict__.setdefault("_layer_kernels_by_key", {})
        kern = by_key.get(key)
        if kern is None:
            op = make_op()
            kern = by_key[key] = self.layer_kernels[op] = self.build_layer_kernel(op)
        return kern

    def rms_norm(self, x, weight, eps: float, residual=None):
        res = residual is not None
        kern = self.layer_kernel(("rms_norm", x.shape[-1], x.dtype, eps, res),
                                 lambda: ir.RMSNorm(x.shape[-1], ir.from_torch(x.dtype), float(eps), res))
        if not res:
            out = torch.empty_like(x)
            kern(x=x, weight=weight, out=out)
            return out
        kern(x=x, residual=residual, weight=weight, out=x)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, x):
        inter = x.shape[1] // 2
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
        self.layer_kernel(("silu_and_mul", inter, x.dtype), lambda: ir.SiluAndMul(inter, ir.from_torch(x.dtype)))(
            x=x, out=out)
        return out

    def rope(self, x, positions, rope_theta: float, freq_factors: tuple, cos, sin):
        x = x.contiguous()
        H, D = x.shape[1], x.shape[2]
        kern = self.layer_kernel(("rope", H, D, x.dtype, rope_theta, freq_factors),
                                 lambda: ir.Rope(H, D, ir.from_torch(x.dtype), float(rope_theta), freq_factors=freq_factors))
        kern(x=x, positions=positions)
        return x


class KernelBackend(TorchLayerOps):
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
    """TVM-LLVM kernels (uacompile.lower.tvm_build.cpu_kernel), built once per op and cached on disk."""

    name = "tvm-cpu"

    def __init__(self, ops: KernelOps):
        super().__init__(ops)
        try:
            from uacompile.lower.tvm_build import cpu_kernel
        except ImportError as e:
            raise NotImplementedError(f"tvm-cpu backend: uacompile.lower.tvm_build is not available ({e})") from None
        self.fns = {op.kind: cpu_kernel(op) for op in (ops.attention, ops.cache_write, ops.copy, ops.swap)}

    def run(self, op, **tensors):
        self.fns[op.kind](**tensors)  # checks shapes, dtypes and layout itself


class CUDABackend(KernelLayerOps, KernelBackend):
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
        P = self.ops.attention.page_size  # a step's page tables span whole pages
        configs = plan.reachable_configs(self.ops.attention, max_tokens, max_seqs, -(-max_kv_len // P) * P, sms, arch)
        kernels = [ir.Kernel(self.ops.attention, c) for c in configs]
        kernels += [ir.Kernel(self.ops.cache_write), ir.Kernel(self.ops.copy), ir.Kernel(self.ops.swap)]
        hits = self.api.preload(kernels, progress=progress)
        return dict(kernels=len(kernels), cached=hits, seconds=time.perf_counter() - t0)

    def prepare_layers(self, ops: list) -> None:
        self.api.preload(ops)  # one nvcc run for all of them, cached on disk

    def build_layer_kernel(self, op: ir.OpSpec):
        return self.api.kernel(op)

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
