"""Kernel backends for the runtime: the four ops the executor launches, and the model's fused layer ops, one
interface.

  tvm-cpu    TVM-LLVM kernels from uacompile.lower (the shipped CPU path)
  cuda       the generated CUDA kernels (uacompile.targets.cuda), cffi launchers on torch's stream
  tvm-cuda   TVM's CUDA kernels (uacompile.lower.tvm_cuda) for the models the CUDA templates do not cover
             (cuda falls back to it), prebuilt by `uacompile build` (kernel_dir) or built here with TVM
  reference  uacompile.reference in numpy float64 (slow; an explicit choice for debugging)

Every call takes keyword tensors named as in op.params(); sizes are bound from the shapes. The KV cache is in the
model's dtype or 8-bit (KernelOps.kv_dtype int8 / fp8_e4m3): then the four KV calls also take its float32 scales,
one per (page, slot, KV head), which every backend hands its quantised kernels. The layer ops
(rms_norm with the residual add, silu_and_mul, rope) are TorchLayerOps' torch code (the unfused model's
arithmetic, exactly) unless a backend has kernels for them: cuda and tvm-cpu launch ir.RMSNorm / SiluAndMul / Rope.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from uacompile import binding, ir, reference
from uacompile.errors import IRError

from .quant import FP8_MAX, Fp8Linear, QuantEmbedding, QuantLinear, dequantize

log = logging.getLogger("uacompile.runtime")
BACKENDS = ("tvm-cpu", "cuda", "tvm-cuda", "reference")


@dataclass(frozen=True)
class KernelOps:
    """The op variants a model needs, built in one place from its shape and KV dtype."""

    attention: ir.PagedAttention
    cache_write: ir.ReshapeAndCache
    copy: ir.CopyBlocks
    swap: ir.SwapBlocks
    gather: ir.GatherTokens
    score: ir.KVScore | None  # KV eviction's scores (None: a quantised cache, which kv_score does not read)

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                  sliding_window: int = 0, variant: str = "ua", kv_dtype: str | None = None,
                  score_method: str = "andpro") -> "KernelOps":
        """kv_dtype: the cache's IR dtype (None: the model's; int8 / fp8_e4m3 store per (page, slot, KV head)
        float32 scales beside the pages). score_method: KV eviction's kv_score method."""
        dt = ir.from_torch(dtype)
        if dt not in ir.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {[ir.torch_dtype(d) for d in ir.FLOAT_DTYPES]}, got {dtype}")
        kv = dt if kv_dtype is None else kv_dtype
        return cls(ir.PagedAttention(num_heads, num_kv_heads, head_dim, page_size, q_dtype=dt, kv_dtype=kv,
                                     window=sliding_window, variant=variant),
                   ir.ReshapeAndCache(num_kv_heads, head_dim, page_size, dtype=dt, kv_dtype=kv),
                   ir.CopyBlocks(num_kv_heads, head_dim, page_size, kv_dtype=kv),
                   ir.SwapBlocks(num_kv_heads, head_dim, page_size, kv_dtype=kv),
                   ir.GatherTokens(num_kv_heads, head_dim, page_size, kv_dtype=kv),
                   None if kv in ir.QUANT_DTYPES else ir.KVScore(num_heads, num_kv_heads, head_dim, page_size, dt, kv,
                                                                 method=score_method))

    @property
    def kv_dtype(self) -> str:
        return self.attention.kv_dtype

    @property
    def quantized(self) -> bool:
        """The cache holds int8 / fp8 with float32 scales (every KV call takes them)."""
        return self.attention.quantized


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

    packed_formats: frozenset = frozenset()  # the block formats the backend runs packed (QuantLinear); others decode at load
    fuses_prologue: bool = False  # runs ir.QKVRopeCache (qkv_rope_cache): the model hands it the packed qkv

    def linear(self, module, x):
        """x @ W^T (+ bias) of a projection: dense (nn.Linear), packed blocks (QuantLinear: the outputs of its runs of
        rows, packed_runs, side by side) or e4m3 (Fp8Linear)."""
        if isinstance(module, QuantLinear):
            outs = self.packed_runs(module, x)
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            return y if module.bias is None else y + module.bias
        if isinstance(module, Fp8Linear):
            return self.fp8_linear(module, x)
        return F.linear(x, module.weight, module.bias)

    def fp8_linear(self, module: Fp8Linear, x):
        """x @ (weight * scale)^T (+ bias): on CUDA torch._scaled_mm (cuBLASLt's e4m3 matmul, row-wise scales) over
        x's rows quantised to e4m3 (quantize_rows); elsewhere the weights decoded to x's dtype."""
        if x.is_cuda:
            xq, sx = self.quantize_rows(x)
            y = torch._scaled_mm(xq, module.weight.t(), scale_a=sx[:, None], scale_b=module.scale[None, :],
                                 out_dtype=x.dtype)
        else:
            y = F.linear(x, (module.weight.float() * module.scale[:, None]).to(x.dtype))
        return y if module.bias is None else y + module.bias

    def quantize_rows(self, x):
        """x [T, K]'s rows in e4m3 with their float32 scales [T] (ir.QuantizeRows: scale = amax / 448, 1 for a zero
        or NaN row), in torch."""
        amax = x.abs().amax(dim=1).float()
        sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (x.float() / sx[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx

    def packed_runs(self, module: QuantLinear, x) -> list:
        """x @ W^T of each run of a packed projection's rows (no bias): here decoded every call; a backend with
        kernels runs them packed."""
        return [F.linear(x, dequantize(w, p.weight_format, module.in_features, x.dtype)) for p, w in module.packed()]

    def embed(self, module, ids):
        """The embedding rows of ids: a lookup, or for a QuantEmbedding its packed rows decoded."""
        if isinstance(module, QuantEmbedding):
            return dequantize(module.weight[ids], module.weight_format, module.embedding_dim, module.dtype)
        return F.embedding(ids, module.weight)

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

    def rope(self, x, positions, rope_theta: float, freq_factors: tuple, tables):
        """NeoX RoPE of x [T, H, D] at positions, of frequencies 1 / rope_theta^(2i / D) / freq_factors[i]
        (ir.Rope), which the model's cos / sin tables [T, 1, D/2] (tables.get(), made at the first call) hold too.
        Returns the rotated x (may be x itself, rotated in place)."""
        return apply_rope(x, *tables.get())


DECODE_ROWS = 64  # cuda: rows up to which a packed projection runs ir.QuantMatmul (decode batches)
CPU_PACKED_ROWS = 16  # tvm-cpu: the same (SmolLM2 prefill, 1 thread: 64-token chunks run 1.8x faster decoded + torch)
# tvm-cpu: tokens a step up to which a layer op runs its TVM kernel, beyond which torch's vector ops win (1 thread:
# rms_norm 1.4 vs 15 us at one token, 55 vs 31 at 64; silu_and_mul 3.8 vs 5.3 at one, 14 vs 8 at 4; rope 8.8 vs 11 at
# one, 35 vs 12 at 4: its kernel works each angle's cos / sin out in float64 where torch takes the step's table)
CPU_LAYER_KERNEL_ROWS = {"rms_norm": 16, "silu_and_mul": 2, "rope": 1}


class PackedLinearOps(TorchLayerOps):
    """Packed projections (QuantLinear) and embeddings (QuantEmbedding) on a backend's ir.QuantMatmul / ir.Dequantize
    kernels: a step of up to `packed_rows` rows runs the packed matmul; a longer one decodes each run of rows into
    one scratch buffer (the largest layer's, reused by every layer) and multiplies densely (torch). A subclass gives
    quant_kernel(key, make_op): the kernel of make_op()'s op, found by the plain-value key."""

    packed_formats = frozenset(ir.WEIGHT_FORMATS)
    packed_rows = DECODE_ROWS

    def quant_kernel(self, key: tuple, make_op):
        raise NotImplementedError

    def scratch(self, elements: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of at least `elements` (the decoded weights of one run of rows), kept for the next layers."""
        buf = self.__dict__.get("_scratch")
        if buf is None or buf.numel() < elements or buf.dtype != dtype or buf.device != device:
            buf = self.__dict__["_scratch"] = torch.empty(elements, dtype=dtype, device=device)
        return buf[:elements]

    def packed_runs(self, module: QuantLinear, x) -> list:
        T, K, dt = x.shape[0], module.in_features, x.dtype
        outs = []
        for part, w in module.packed():
            fmt, rows = part.weight_format, part.rows
            if T <= self.packed_rows:
                out = torch.empty((T, rows), dtype=dt, device=x.device)
                self.quant_kernel(("quant_matmul", K, rows, fmt, dt),
                                  lambda: ir.QuantMatmul(K, rows, fmt, ir.from_torch(dt)))(x=x, weight=w, out=out)
            else:
                dense = self.scratch(rows * K, dt, x.device).view(rows, K)
                self.quant_kernel(("dequantize", K, fmt, dt),
                                  lambda: ir.Dequantize(K, fmt, ir.from_torch(dt)))(weight=w, out=dense)
                out = F.linear(x, dense)
            outs.append(out)
        return outs

    def embed(self, module, ids):
        if not isinstance(module, QuantEmbedding):
            return super().embed(module, ids)
        E, fmt, dt = module.embedding_dim, module.weight_format, module.dtype
        out = torch.empty((ids.shape[0], E), dtype=dt, device=ids.device)
        self.quant_kernel(("dequantize", E, fmt, dt), lambda: ir.Dequantize(E, fmt, ir.from_torch(dt)))(
            weight=module.weight[ids], out=out)
        return out


class KernelLayerOps(PackedLinearOps):
    """The layer ops on kernels (ir.RMSNorm, SiluAndMul, Rope, and the packed QuantMatmul / Dequantize): a subclass
    gives build_layer_kernel(op), a callable over op.params() keywords. The residual stream is updated in place
    (rms_norm writes h into residual and the norm into x), rope rotates a contiguous x in place."""

    def build_layer_kernel(self, op: ir.OpSpec):
        raise NotImplementedError

    def quant_kernel(self, key: tuple, make_op):
        return self.layer_kernel(key, make_op)

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

    def quantize_rows(self, x):
        T, K = x.shape
        out = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(T, dtype=torch.float32, device=x.device)
        self.layer_kernel(("quantize_rows", K, x.dtype), lambda: ir.QuantizeRows(K, ir.from_torch(x.dtype)))(
            x=x, out=out, scale=scale)
        return out, scale

    def silu_and_mul(self, x):
        inter = x.shape[1] // 2
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
        self.layer_kernel(("silu_and_mul", inter, x.dtype), lambda: ir.SiluAndMul(inter, ir.from_torch(x.dtype)))(
            x=x, out=out)
        return out

    def rope(self, x, positions, rope_theta: float, freq_factors: tuple, tables):
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

    def set_threads(self, n: int) -> None:
        """Run the backend's CPU kernels on n threads (EngineConfig.cpu_threads); nothing to do off the CPU."""

    # the executor's four calls; the scales (float32, per page, slot and KV head) go with a quantised cache only
    def reshape_and_cache(self, k, v, slot_mapping, k_cache, v_cache, k_scale=None, v_scale=None) -> None:
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.ops.quantized else {}
        self.run(self.ops.cache_write, k=k, v=v, slot_mapping=slot_mapping, k_cache=k_cache, v_cache=v_cache, **scales)

    def qkv_rope_cache(self, op: ir.QKVRopeCache, qkv, positions, slot_mapping, q_out, k_cache, v_cache, q_norm=None,
                       k_norm=None, k_scale=None, v_scale=None) -> None:
        """The attention prologue (fuses_prologue backends): q_out and the K/V write from the packed qkv."""
        extra = dict(k_scale=k_scale, v_scale=v_scale) if op.quantized else {}
        if op.qk_norm:
            extra.update(q_norm=q_norm, k_norm=k_norm)
        self.run(op, qkv=qkv, positions=positions, slot_mapping=slot_mapping, q_out=q_out, k_cache=k_cache,
                 v_cache=v_cache, **extra)

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None,
                        k_scale=None, v_scale=None) -> None:
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.ops.quantized else {}
        self.run(self.ops.attention, q=q, k_cache=k_cache, v_cache=v_cache, token_seq=token_seq,
                 page_table=page_table, token_kv_len=token_kv_len, out=out, **scales)

    def copy_blocks(self, kv, mapping, scales=None) -> None:
        extra = dict(scales=scales) if self.ops.quantized else {}
        self.run(self.ops.copy, kv=kv, mapping=mapping, **extra)

    def swap_blocks(self, src, dst, mapping, src_scales=None, dst_scales=None) -> None:
        extra = dict(src_scales=src_scales, dst_scales=dst_scales) if self.ops.quantized else {}
        self.run(self.ops.swap, src=src, dst=dst, mapping=mapping, **extra)

    # KV eviction
    def gather_tokens(self, kv, src_slots, dst_slots, scales=None) -> None:
        extra = dict(scales=scales) if self.ops.quantized else {}
        self.run(self.ops.gather, kv=kv, src_slots=src_slots, dst_slots=dst_slots, **extra)

    def kv_score(self, q, k_cache, v_cache, query_seq, query_kv_len, page_table, kv_len, scores) -> None:
        if self.ops.score is None:
            raise ValueError(f"KV eviction scores a float KV cache; this one is {self.ops.kv_dtype}")
        self.run(self.ops.score, q=q, k_cache=k_cache, v_cache=v_cache, query_seq=query_seq,
                 query_kv_len=query_kv_len, page_table=page_table, kv_len=kv_len, scores=scores)


class ReferenceBackend(KernelBackend):
    """numpy float64 reference; works on CPU tensors in place through shared memory."""

    name = "reference"

    def __init__(self, ops: KernelOps):
        super().__init__(ops)
        self.binders = {op.kind: binding.host_binder(op)
                        for op in (ops.attention, ops.cache_write, ops.copy, ops.swap, ops.gather, ops.score) if op}

    def run(self, op, **tensors):
        self.binders[op.kind](tensors)  # names, dtypes, shapes, layout, on the CPU
        arrays = {}
        for k, t in tensors.items():
            if t.dtype == torch.bfloat16:
                raise TypeError(f"reference backend: {k} must be fp32/fp16 (numpy has no bf16 view), got {t.dtype}")
            if t.dtype == torch.float8_e4m3fn:  # numpy sees fp8 through ml_dtypes, over the same bytes
                arrays[k] = t.view(torch.uint8).numpy().view(ir.numpy_dtype("fp8_e4m3"))
            else:
                arrays[k] = t.numpy()  # a view: in-place writes land in the torch tensor
        if op.kind == "paged_attention":
            out = arrays.pop("out")
            # hand the reference only the pages in use (it converts whole caches to float64)
            table = arrays["page_table"]
            used = np.unique(table[table >= 0])
            remap = np.full(int(used.max(initial=0)) + 1, -1, dtype=np.int32)
            remap[used] = np.arange(len(used), dtype=np.int32)
            arrays["page_table"] = np.where(table >= 0, remap[np.maximum(table, 0)], -1).astype(np.int32)
            for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
                if name in arrays:
                    arrays[name] = arrays[name][used]
            o, _ = reference.paged_attention(op, **arrays)
            out[...] = o
        elif op.kind == "kv_score":
            scores = arrays.pop("scores")
            scores[...] = reference.kv_score(op, **arrays, max_kv_len=scores.shape[2])
        else:
            reference.run(op, **arrays)


class NotRecordable(Exception):
    """A call the tvm-cpu backend cannot put on a tape (a torch fallback, or a copy it would have to make)."""


class TVMCPUBackend(PackedLinearOps, KernelBackend):
    """TVM-LLVM kernels (uacompile.lower.tvm_build.cpu_kernel), built once per op and cached on disk. A step's
    attention runs the tuning database's TVMConfig for the step's bucket (`uacompile tune --target cpu`; tuned:
    a tunedb.Tuned, None: the default database, False: none), else the default schedule; a one-token step's
    in one parallel task a thread (grain: its q heads over the threads; the same arithmetic).

    The layer ops (rms_norm with the residual add in place, silu_and_mul, rope in place) run TVM kernels in steps
    of up to CPU_LAYER_KERNEL_ROWS tokens (torch's beyond), the packed matmuls in steps of up to packed_rows. The
    hot path calls each kernel's TVM function positionally (raw_call): its first call goes through the checked
    call (uacompile.binding: names, dtypes, shapes, layout), later ones straight to the function with the sizes
    read off the tensors, which the model, the executor and this backend make themselves in the shapes that first
    call checked.

    recording() opens a tape: every call made while it is open is also appended to it as (function, arguments), the
    dense and packed projections as torch matmuls into their output tensors, so calling each function on its
    arguments again repeats the step over the same tensors (cpu_decode). A call that would leave the tape incomplete
    (a torch fallback, a copy made to get a contiguous tensor) raises NotRecordable there."""

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
        self.raw_fns: dict[int, object] = {}  # id(CpuKernel) -> its positional caller (raw_call)
        self.linear_plans: dict[int, tuple] = {}  # id(QuantLinear) -> (module, [(caller, weight, rows)])
        self.quant_kernels: dict[tuple, object] = {}
        self.layer_fns: dict[tuple, object] = {}  # layer-op key -> its CpuKernel
        self.tape: list | None = None  # (function, arguments) of each call while recording() is open
        self.threads = len(os.sched_getaffinity(0))  # TVM's pool by default (set_threads changes it)
        self._token_attention = None  # the one-token steps' attention kernel (one_token_attention)

    def raw_call(self, kern):
        """kern's function called positionally: its tensors in op.params() order, then its sizes. The first call
        goes through kern's checked call (sizes inferred); later ones call the TVM function itself (an 8-bit float
        tensor needs the checked call's view, so such kernels stay checked)."""
        fn = self.raw_fns.get(id(kern))
        if fn is None:
            names = [p.name for p in kern.binder.tensor_specs]
            raw = not kern.viewed

            def fn(*args):
                kern(**dict(zip(names, args)))
                if raw:
                    self.raw_fns[id(kern)] = kern.fn

            self.raw_fns[id(kern)] = fn
        return fn

    def launch(self, kern, *args) -> None:
        """kern called positionally (raw_call), and recorded on the open tape."""
        self.raw_call(kern)(*args)
        if self.tape is not None:
            self.tape.append((self.raw_call(kern), args))

    def _torch_call(self, fn, *args) -> None:
        """A torch op writing its out= tensor, recorded on the open tape."""
        fn(*args)
        if self.tape is not None:
            self.tape.append((fn, args))

    @contextmanager
    def recording(self):
        """A tape of the calls made inside the block (see the class docstring)."""
        self.tape = tape = []
        try:
            yield tape
        finally:
            self.tape = None

    def _recordable(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x contiguous: itself, or (no tape open) a contiguous copy."""
        if x.is_contiguous():
            return x
        if self.tape is not None:
            raise NotRecordable(f"{what}: a non-contiguous input would be copied")
        return x.contiguous()

    def _fallback(self, what: str) -> None:
        if self.tape is not None:
            raise NotRecordable(f"{what} runs in torch at this size")

    def plan_step(self, num_tokens: int, num_seqs: int, max_kv_len: int):
        """The step's attention kernel: the tuned one of its bucket; else a one-token step's one_token_attention,
        any other step's None (the default kernel)."""
        from uacompile.lower.config import TVMConfig

        if self.tuned is not None:
            config = self.tuned.config(self.ops.attention, num_tokens, num_seqs, max_kv_len)
            if isinstance(config, TVMConfig) and config.num_splits == 1:
                return self.cpu_kernel(ir.Kernel(self.ops.attention, config))  # loaded once per process
        return self.one_token_attention() if num_tokens == 1 else None

    def one_token_attention(self):
        """The default attention schedule with a token's q heads split over the pool's threads, a task each (the
        default's task a head costs more than one head's work at decode lengths)."""
        from uacompile.lower.config import TVMConfig

        if self._token_attention is None:
            grain = -(-self.ops.attention.num_q_heads // self.threads)
            self._token_attention = self.cpu_kernel(ir.Kernel(self.ops.attention, TVMConfig(grain=grain)))
        return self._token_attention

    def prepare(self, max_tokens: int, max_seqs: int, max_kv_len: int, progress: bool = False) -> dict:
        """Build (or load) the one-token steps' attention kernel, so no decode step waits for TVM."""
        t0 = time.perf_counter()
        kern = self.one_token_attention()
        return dict(kernels=1, cached=int(kern.cache_hit), seconds=time.perf_counter() - t0)

    def set_threads(self, n: int) -> None:
        """TVM's pool runs the kernels' parallel loops on n threads (at most TVM_NUM_THREADS: by default every CPU
        this process may use)."""
        from uacompile.lower.tvm_build import set_cpu_threads

        set_cpu_threads(n)
        self.threads, self._token_attention = n, None

    def threads_setter(self):
        """A callable n -> None resizing TVM's pool to n threads at once (set_threads' call, unchecked), for a
        caller that runs some calls on fewer threads than the backend's and then restores them."""
        from uacompile.lower.tvm_build import cpu_threads_setter

        return cpu_threads_setter()

    def reshape_and_cache(self, k, v, slot_mapping, k_cache, v_cache, k_scale=None, v_scale=None) -> None:
        kern = self.fns["reshape_and_cache"]
        if self.ops.quantized:
            self.launch(kern, k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, k.shape[0], k_cache.shape[0])
        else:
            self.launch(kern, k, v, slot_mapping, k_cache, v_cache, k.shape[0], k_cache.shape[0])

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None,
                        k_scale=None, v_scale=None) -> None:
        scales = (k_scale, v_scale) if self.ops.quantized else ()  # op.params(): the scales come before out
        self.launch(plan or self.fns["paged_attention"], q, k_cache, v_cache, token_seq, page_table, token_kv_len,
                    *scales, out, q.shape[0], page_table.shape[0], page_table.shape[1], k_cache.shape[0])

    packed_rows = CPU_PACKED_ROWS

    def prepare_layers(self, ops: list) -> None:
        """Build (or load from the disk cache) the kernels of the layer ops the model launches."""
        for op in ops:
            if op.kind == "quant_matmul":
                self.quant_kernel(("quant_matmul", op.in_features, op.out_features, op.weight_format,
                                   ir.torch_dtype(op.dtype)), lambda op=op: op)
            elif op.kind == "dequantize":
                self.quant_kernel(("dequantize", op.in_features, op.weight_format, ir.torch_dtype(op.dtype)),
                                  lambda op=op: op)
            else:
                self.cpu_kernel(op)

    def quant_kernel(self, key: tuple, make_op):
        """TVM-LLVM's quant_matmul / dequantize kernel (cpu_kernel: built once per op, cached on disk)."""
        kern = self.quant_kernels.get(key)
        if kern is None:
            kern = self.quant_kernels[key] = self.cpu_kernel(make_op())
        return kern

    def layer_fn(self, key: tuple, make_op):
        """make_op()'s kernel (launch calls it), found by the plain-value key."""
        kern = self.layer_fns.get(key)
        if kern is None:
            kern = self.layer_fns[key] = self.cpu_kernel(make_op())
        return kern

    def linear_plan(self, module: QuantLinear, dtype: torch.dtype) -> list:
        """[(caller, packed weight, rows)] of a packed projection's runs of rows, made at its first decode step."""
        entry = self.linear_plans.get(id(module))
        if entry is None or entry[0] is not module or entry[1] != dtype:
            K = module.in_features
            runs = []
            for part, w in module.packed():
                fmt, rows = part.weight_format, part.rows
                kern = self.quant_kernel(("quant_matmul", K, rows, fmt, dtype),
                                         lambda: ir.QuantMatmul(K, rows, fmt, ir.from_torch(dtype)))
                runs.append((kern, w, rows))
            entry = self.linear_plans[id(module)] = (module, dtype, runs)
        return entry[2]

    def linear(self, module, x):
        """TorchLayerOps.linear; with a tape open, a dense projection is torch.mm / addmm into its output (the
        matmul F.linear runs) and a packed one's runs are joined by torch.cat into it, both recorded."""
        if self.tape is None:
            return super().linear(module, x)
        x = self._recordable(x, "linear")
        if isinstance(module, nn.Linear):
            out = torch.empty((x.shape[0], module.out_features), dtype=x.dtype)
            if module.bias is None:
                self._torch_call(partial(torch.mm, out=out), x, module.weight.t())
            else:
                self._torch_call(partial(torch.addmm, out=out), module.bias, x, module.weight.t())
            return out
        if not isinstance(module, QuantLinear):
            raise NotRecordable(f"linear: {type(module).__name__} is not recorded")
        outs = self.packed_runs(module, x)
        y = outs[0]
        if len(outs) > 1:
            y = torch.empty((x.shape[0], module.out_features), dtype=x.dtype)
            self._torch_call(partial(torch.cat, dim=-1, out=y), outs)
        if module.bias is not None:
            self._torch_call(partial(torch.add, out=y), y, module.bias)
        return y

    def embed(self, module, ids):
        """TorchLayerOps.embed; with a tape open, the rows are gathered by a recorded torch.index_select."""
        if self.tape is None:
            return super().embed(module, ids)
        if isinstance(module, QuantEmbedding):
            E, fmt, dt = module.embedding_dim, module.weight_format, module.dtype
            rows = torch.empty((ids.shape[0], module.weight.shape[1]), dtype=module.weight.dtype)
            self._torch_call(partial(torch.index_select, out=rows), module.weight, 0, ids)
            out = torch.empty((ids.shape[0], E), dtype=dt)
            self.launch(self.quant_kernel(("dequantize", E, fmt, dt), lambda: ir.Dequantize(E, fmt, ir.from_torch(dt))),
                        rows, out, ids.shape[0])
            return out
        out = torch.empty((ids.shape[0], module.weight.shape[1]), dtype=module.weight.dtype)
        self._torch_call(partial(torch.index_select, out=out), module.weight, 0, ids)
        return out

    def packed_runs(self, module: QuantLinear, x) -> list:
        if x.shape[0] > self.packed_rows:
            self._fallback("a packed projection")
            return super().packed_runs(module, x)
        x = self._recordable(x, "packed projection")
        T, dt = x.shape[0], x.dtype
        outs = []
        for kern, w, rows in self.linear_plan(module, dt):
            out = torch.empty((T, rows), dtype=dt)
            self.launch(kern, x, w, out, T)
            outs.append(out)
        return outs

    def rms_norm(self, x, weight, eps: float, residual=None):
        """The kernel's rms_norm: with residual, residual += x and x = norm(residual), in place."""
        if not 0 < x.shape[0] <= CPU_LAYER_KERNEL_ROWS["rms_norm"]:
            self._fallback("rms_norm")
            return super().rms_norm(x, weight, eps, residual)
        x = self._recordable(x, "rms_norm")
        res = residual is not None
        kern = self.layer_fn(("rms_norm", x.shape[-1], x.dtype, eps, res),
                             lambda: ir.RMSNorm(x.shape[-1], ir.from_torch(x.dtype), float(eps), res))
        if not res:
            out = torch.empty_like(x)
            self.launch(kern, x, weight, out, x.shape[0])
            return out
        self.launch(kern, x, residual, weight, x, x.shape[0])
        return x, residual

    def silu_and_mul(self, x):
        if not 0 < x.shape[0] <= CPU_LAYER_KERNEL_ROWS["silu_and_mul"]:
            self._fallback("silu_and_mul")
            return super().silu_and_mul(x)
        x = self._recordable(x, "silu_and_mul")
        inter = x.shape[1] // 2
        out = torch.empty((x.shape[0], inter), dtype=x.dtype)
        kern = self.layer_fn(("silu_and_mul", inter, x.dtype), lambda: ir.SiluAndMul(inter, ir.from_torch(x.dtype)))
        self.launch(kern, x, out, x.shape[0])
        return out

    def rope(self, x, positions, rope_theta: float, freq_factors: tuple, tables):
        if not 0 < x.shape[0] <= CPU_LAYER_KERNEL_ROWS["rope"]:
            self._fallback("rope")
            return super().rope(x, positions, rope_theta, freq_factors, tables)
        x = self._recordable(x, "rope")
        H, D = x.shape[1], x.shape[2]
        kern = self.layer_fn(("rope", H, D, x.dtype, rope_theta, freq_factors),
                             lambda: ir.Rope(H, D, ir.from_torch(x.dtype), float(rope_theta),
                                             freq_factors=freq_factors))
        self.launch(kern, x, positions, x.shape[0])
        return x

    def run(self, op, **tensors):
        fn = self.fns.get(op.kind)
        if fn is None:  # the KV-eviction ops, built on first use
            fn = self.fns[op.kind] = self.cpu_kernel(op)
        fn(**tensors)  # checks shapes, dtypes and layout itself


class CUDABackend(KernelLayerOps, KernelBackend):
    """Generated CUDA kernels (Jinja templates, nvcc, cffi) through uacompile.targets.cuda: launched on
    torch's current stream; a step's attention is planned once (split-KV by the step's shapes) and run
    every layer."""

    name = "cuda"
    fuses_prologue = True

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

        P = self.ops.attention.page_size  # a step's page tables span whole pages
        configs = plan.reachable_configs(self.ops.attention, max_tokens, max_seqs, -(-max_kv_len // P) * P, sms, arch,
                                         default_tuned("cuda", self.device))  # tuned records' kernels too
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

    def paged_attention(self, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out, plan=None,
                        k_scale=None, v_scale=None) -> None:
        if plan is None:
            plan = self.plan_step(q.shape[0], page_table.shape[0], page_table.shape[1] * self.ops.attention.page_size)
        self.attention.run(plan, q, k_cache, v_cache, token_seq, page_table, token_kv_len, out=out, k_scale=k_scale,
                           v_scale=v_scale)  # attention.run passes the scales to a quantised cache's kernel only

    def run(self, op, **tensors):
        self.api.kernel(op)(**tensors)  # checks names, dtypes, shapes, devices itself


def cuda_template_gap(ops: KernelOps) -> str | None:
    """Why the CUDA templates cannot run the model's ops (the first template check that refuses one), or None."""
    from uacompile.targets.cuda import layout

    try:
        layout.check(ops.attention)
    except IRError as e:
        return str(e)
    return None


def tvm_cuda_kernels(ops: KernelOps) -> list[ir.Kernel]:
    """The TVM-CUDA kernels a model launches: attention in one split (TVMConfig(): no partials, nothing to plan),
    the cache ops as they are; the symbols `uacompile build --target cuda` writes for the model's shape."""
    from uacompile.lower.config import TVMConfig

    return [ir.Kernel(ops.attention, TVMConfig()), ir.Kernel(ops.cache_write), ir.Kernel(ops.copy),
            ir.Kernel(ops.swap)]


def _runs_on(built: str, device: str) -> bool:
    """Whether code nvcc built for arch `built` (-arch=sm_XY: SASS + PTX; sm_XYa: SASS only) runs on `device`."""
    num = lambda a: int(a[3:].rstrip("a"))  # noqa: E731
    return built == device if built.endswith("a") else num(built) <= num(device)


DTYPE_FIELDS = ("q_dtype", "kv_dtype", "dtype")


def _build_hint(kernel: ir.Kernel, out_dir, entries: dict | None = None) -> str:
    """How to get a TVM-CUDA kernel into a `uacompile build` folder (or which dtype the folder has it in)."""
    from uacompile.build import build_command

    cmd = build_command(kernel, "cuda", "tvm", out_dir)
    if cmd is not None:
        return f"build it where TVM is installed: `{cmd}`"
    params = kernel.op.to_dict()
    want = {k: v for k, v in params.items() if k not in DTYPE_FIELDS}
    same_shape = [e["params"] for e in (entries or {}).values()
                  if {k: v for k, v in e["params"].items() if k not in DTYPE_FIELDS} == want]
    model = params.get("q_dtype", params.get("dtype"))
    kv_caches = sorted({str(p.get("kv_dtype")) for p in same_shape if "kv_dtype" in params and "kv_dtype" in p and
                        p.get("q_dtype", p.get("dtype")) == model and p.get("kv_dtype") != params["kv_dtype"]})
    if kv_caches:  # the model's dtype is there, with another KV cache
        names = " or ".join(repr("auto" if kv == model else kv) for kv in kv_caches)
        return f"the folder holds this shape with a {'/'.join(kv_caches)} KV cache (run with kv_cache_dtype={names})"
    other = sorted({str(p.get("q_dtype", p.get("dtype"))) for p in same_shape})
    if other:
        names = " or ".join(repr(ir.DTYPES[d].torch) for d in other)
        return f"the folder holds this shape in {'/'.join(other)} (run the model with dtype={names})"
    return "no `uacompile build` preset holds this shape (add it to uacompile.build.MODELS and build that preset)"


def _describe(kernel: ir.Kernel) -> str:
    """A kernel in a message: its symbol, op and the fields that tell it apart (heads, head_dim, page, dtypes)."""
    d = kernel.op.to_dict()
    keep = ("num_q_heads", "num_kv_heads", "head_dim", "page_size", "q_dtype", "kv_dtype", "dtype", "variant",
            "window")
    fields = ", ".join(f"{k}={d[k]}" for k in keep if d.get(k) not in (None, 0))
    return f"TVM-CUDA kernel {kernel.symbol()} ({kernel.kind}: {fields})"


def prebuilt_libraries(kernels: list[ir.Kernel], kernel_dir: str | Path, arch: str) -> dict[str, Path]:
    """Each kernel's library in a `uacompile build` folder, by symbol among its cuda/tvm entries (manifest.json):
    {symbol: .so path}. Imports neither TVM nor the CUDA runtime. ValueError, one line, for a kernel the folder
    lacks or holds built for another arch, naming the `uacompile build` command that makes it."""
    from uacompile.build import load_manifest

    entries = load_manifest(kernel_dir, "cuda", "tvm")
    out = {}
    for k in kernels:
        entry = entries.get(k.symbol())
        if entry is None:
            raise ValueError(f"{_describe(k)} is not in {Path(kernel_dir) / 'manifest.json'}; "
                             f"{_build_hint(k, kernel_dir, entries)}")
        lib = entry.get("library")
        if lib is None or not Path(lib).exists():
            why = (entry.get("reason") or "not built").splitlines()[0] if lib is None else f"{lib} is missing"
            raise ValueError(f"{_describe(k)} was not built in {kernel_dir} ({why}); {_build_hint(k, kernel_dir)}")
        built = entry.get("arch") or "sm_90"
        if not _runs_on(built, arch):
            raise ValueError(f"{_describe(k)} in {kernel_dir} is built for {built}, which does not run on {arch}; "
                             "build the kernels on this machine instead (no kernel_dir; needs TVM and nvcc)")
        out[k.symbol()] = Path(lib)
    return out


class TVMCUDABackend(KernelBackend):
    """TVM's CUDA kernels (uacompile.lower.tvm_cuda: generated source + an extern "C" launcher, nvcc-built), for
    the models the CUDA templates do not cover (fp32, head_dim not a multiple of 16, ...).

    With kernel_dir, a `uacompile build --target cuda` folder, each kernel's library is looked up there by symbol
    (manifest.json), so a GPU machine needs neither TVM nor nvcc; without it they are generated and built here
    through the kernel cache (TVM + nvcc). Loading is cffi with ir.cffi_cdef (targets.cuda.loader.load_library);
    calls go through targets.cuda.api.CudaKernel (the one binder, torch's current stream). Attention runs in one
    split, so plan_step has nothing to plan (None) and no workspace exists: a call binds and launches, allocating
    nothing, and the decode graphs capture it."""

    name = "tvm-cuda"

    def __init__(self, ops: KernelOps, kernel_dir: str | Path | None = None, arch: str | None = None):
        super().__init__(ops)
        from uacompile import nvcc

        self.arch = nvcc.check_arch(arch) if arch else nvcc.default_arch()
        self.kernels = tvm_cuda_kernels(ops)
        self.kernel_dir = kernel_dir
        if kernel_dir is not None:
            self.paths = prebuilt_libraries(self.kernels, kernel_dir, self.arch)
        else:
            self.paths = None
            if importlib.util.find_spec("tvm") is None:
                raise NotImplementedError(
                    "tvm-cuda backend: TVM is not installed here, so the model's CUDA kernels cannot be generated; "
                    f"pass kernel_dir=DIR, a folder of prebuilt kernels ({_build_hint(self.kernels[0], 'DIR')})")
        self.calls: dict[str, object] = {}  # op kind -> api.CudaKernel

    def prepare(self, max_tokens: int = 0, max_seqs: int = 0, max_kv_len: int = 0, progress: bool = False) -> dict:
        """Load every kernel the model launches (from kernel_dir, or built here), so no step waits; returns
        {kernels, cached: libraries taken from kernel_dir, seconds}."""
        from tqdm import tqdm

        from uacompile.targets.cuda import api, loader

        t0 = time.perf_counter()
        todo = [k for k in self.kernels if k.kind not in self.calls]
        for k in tqdm(todo, desc="tvm-cuda kernels", unit="kernel", disable=not progress, dynamic_ncols=True):
            if self.paths is not None:
                path = self.paths[k.symbol()]
            else:
                from uacompile.lower.tvm_cuda import build_cuda_library

                path = build_cuda_library(k, self.arch)
            self.calls[k.kind] = api.CudaKernel(k, library=loader.load_library(path, [k]))
        return dict(kernels=len(self.kernels), cached=len(self.kernels) if self.paths is not None else 0,
                    seconds=time.perf_counter() - t0)

    def run(self, op, **tensors):
        call = self.calls.get(op.kind)
        if call is None:
            self.prepare()
            call = self.calls[op.kind]
        call(**tensors)  # checks names, dtypes, shapes, devices; launches on torch's current stream


def make_backend(name: str, ops: KernelOps, device: str, kernel_dir: str | Path | None = None) -> KernelBackend:
    """The backend `name` runs the model's ops with. cuda falls back to tvm-cuda where the CUDA templates do not
    cover the model (cuda_template_gap); kernel_dir (prebuilt TVM-CUDA kernels) is read by tvm-cuda only."""
    if name == "auto":
        name = "cuda" if device == "cuda" else "tvm-cpu"
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    if name in ("cuda", "tvm-cuda") and device != "cuda":
        raise ValueError(f"kernel_backend={name!r} needs device='cuda'")
    if name not in ("cuda", "tvm-cuda") and device == "cuda":
        raise ValueError(f"kernel_backend={name!r} runs on the CPU; use device='cpu' or kernel_backend='cuda'")
    if name == "cuda":
        gap = cuda_template_gap(ops)
        if gap is not None:
            log.info("cuda: the CUDA templates do not cover this model (%s); running TVM's CUDA kernels", gap)
            name = "tvm-cuda"
    if name == "tvm-cuda":
        return TVMCUDABackend(ops, kernel_dir)
    if kernel_dir is not None:
        log.info("kernel_dir %s is not used: the %s backend builds its own kernels", kernel_dir, name)
    return {"reference": ReferenceBackend, "tvm-cpu": TVMCPUBackend, "cuda": CUDABackend}[name](ops)
