"""The TIR of every op: `prim_func(op, target)` -> tvm.tirx.PrimFunc.

target "cpu" emits serial/parallel loops for LLVM; "cuda" emits thread-bound loops.
The PrimFunc's parameters are exactly op.params() (buffers named as the tensors, sizes
as int64 vars), so the CPU callable, the CUDA launcher and the docs agree. The generators
(tvm_attention, tvm_cache_ops) share the helpers of tvm_tir; all import tvm lazily.
"""
from __future__ import annotations

from pathlib import Path

from ..ir import OpSpec, as_kernel
from . import tvm_attention, tvm_cache_ops, tvm_evict, tvm_layer_ops, tvm_quant

# source files whose text is part of every kernel's cache key
GENERATOR_FILES = [Path(__file__).with_name(n)
                   for n in ("tvm_kernels.py", "tvm_tir.py", "tvm_attention.py", "tvm_cache_ops.py", "tvm_layer_ops.py",
                             "tvm_quant.py", "tvm_evict.py")]

TARGETS = ("cpu", "cuda")


def generator_source() -> str:
    return "".join(p.read_text() for p in GENERATOR_FILES)


def prim_func(op, target: str = "cpu"):
    """The TIR kernel of a kernel (an op and its TVMConfig; an op alone: the default config) for target 'cpu' or
    'cuda' (global_symbol = its symbol())."""
    kernel = as_kernel(op)
    if target not in TARGETS:
        raise ValueError(f"target: must be one of {TARGETS}, got {target!r}")
    gen = {"paged_attention": tvm_attention.paged_attention, "reshape_and_cache": tvm_cache_ops.reshape_and_cache,
           "copy_blocks": tvm_cache_ops.copy_blocks, "swap_blocks": tvm_cache_ops.swap_blocks,
           "merge_state": tvm_cache_ops.merge_state, "rms_norm": tvm_layer_ops.rms_norm,
           "silu_and_mul": tvm_layer_ops.silu_and_mul, "rope": tvm_layer_ops.rope,
           "quant_matmul": tvm_quant.quant_matmul, "dequantize": tvm_quant.dequantize,
           "gather_tokens": tvm_evict.gather_tokens, "kv_score": tvm_evict.kv_score}[kernel.kind]
    arg = kernel if kernel.kind in ("paged_attention", "reshape_and_cache", "quant_matmul", "dequantize") else kernel.op
    return finalize(gen(arg, target == "cuda"), kernel)


def finalize(func, op: OpSpec):
    """Keep and order the params as op.params() (generators declare the union of all options)."""
    from tvm import tirx

    by_name = {p.name: p for p in func.params}
    names = [p.name for p in op.params()]
    missing = [n for n in names if n not in by_name]
    if missing:
        raise AssertionError(f"generator for {op.kind} lacks params {missing}")
    f = tirx.PrimFunc([by_name[n] for n in names], func.body, func.ret_type, func.attrs)
    return f.with_attr("global_symbol", op.symbol()).with_attr("tirx.noalias", True)
