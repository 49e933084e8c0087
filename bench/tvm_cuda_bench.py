"""The TVM lowering's CUDA attention beside the Jinja kernels, on the production shapes (run on the device).

    rows = tvm_cuda_rows(ctx)          # bench/kernels.py's "tvm-cuda" section (--tvm-cuda-dir: ctx.tvm_cuda_dir)

Per shape, one interleaved timing (timing.time_graphs) of: the Jinja kernel the planner launches ("ua jinja
(auto)"), TVM's CUDA kernel in its default schedule ("tvm-cuda default"), and TVM's kernel in the tuning
database's config for this GPU where `uacompile tune --target tvm-cuda` recorded one ("tvm-cuda tuned"). Each
TVM row notes its max abs difference from the Jinja output and its time as a multiple of the Jinja kernel's.
TVM's kernels walk K/V once per (token, head): prefill reads K/V per token, so its prefill rows are few and short.
On a GPU machine without TVM the kernels come from a folder of prebuilt libraries (kernel_dir: bench/kernels.py
--tvm-cuda-dir, made by bench/prebuild_tvm_cuda.sh --tune N), found there by symbol.
"""
from __future__ import annotations

import torch

from uacompile import ir
from uacompile.lower.config import TVMConfig
from uacompile.tune_space import tvm_cuda_plan
from uacompile.tunedb import default_tuned

import attention_bench
from attention_bench import PagedBatch, op_of, plan_for
from timing import time_graphs

DECODE_SHAPES = attention_bench.DECODE_SHAPES
PREFILL_SHAPES = [(1, 4096)]


def tuned_tvm_config(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int):
    tuned = default_tuned("tvm-cuda", torch.cuda.current_device())
    cfg = tuned.config(op, num_tokens, num_seqs, max_kv_len) if tuned else None
    return cfg if isinstance(cfg, TVMConfig) else None


def _rows_of(kind: str, B: int, L: int, gen, kernel_dir=None) -> list[dict]:
    from uacompile.targets.cuda import attention

    q_len = 1 if kind == "decode" else L
    batches = attention_bench.decode_batches(B, L, gen) if kind == "decode" else [PagedBatch(B, L, q_len, gen)]
    b0 = batches[0]
    op = op_of()
    T = b0.q.shape[0]
    jinja = plan_for(op, b0)
    configs = {"tvm-cuda default": TVMConfig()}
    tuned = tuned_tvm_config(op, T, B, L)
    if tuned is not None:
        configs["tvm-cuda tuned"] = tuned
    tvm = {name: tvm_cuda_plan(ir.Kernel(op, cfg), T, b0.q.device, kernel_dir) for name, cfg in configs.items()}
    fns = {"ua jinja (auto)": [lambda b=b: attention.run(jinja, **b.args(), out=b.out) for b in batches]}
    for name, (fn, ws) in tvm.items():
        fns[name] = [lambda b=b, fn=fn, ws=ws: fn(**b.args(), out=b.out, **ws) for b in batches]
    calls, rounds = (10, 11) if kind == "decode" else (1, 3)
    timings = time_graphs(fns, calls=calls, rounds=rounds)
    attention.run(jinja, **b0.args(), out=b0.out)
    want = b0.out.float().clone()
    shape = f"{B}x{L}"
    flops = 4 * op.num_q_heads * op.head_dim * B * (L * (L + 1) // 2 if kind == "prefill" else L)
    rows = []
    base = timings["ua jinja (auto)"].ms
    for name in fns:
        ms = timings[name].ms
        r = attention_bench.row(kind, shape, name, ms=ms, **(
            {"gbps": b0.kv_bytes / ms / 1e6} if kind == "decode" else {"tflops": flops / ms / 1e9}))
        if name != "ua jinja (auto)":
            fn, ws = tvm[name]
            b0.out.fill_(float("nan"))
            fn(**b0.args(), out=b0.out, **ws)
            diff = (b0.out.float() - want).abs().max().item()
            cfg = configs[name]
            r["note"] = (f"{ms / base:.2f}x the Jinja kernel's time; max abs diff vs Jinja {diff:.3g}; "
                         f"lanes={cfg.row_lanes(op.head_dim)} threads={cfg.threads} splits={cfg.num_splits} "
                         f"vec={cfg.vec} heads={cfg.heads}")
        rows.append(r)
    del batches, b0
    torch.cuda.empty_cache()
    return rows


def tvm_cuda_rows(ctx=None, quick: bool = False, kernel_dir=None) -> list[dict]:
    """The rows of every shape; kernel_dir (else ctx.tvm_cuda_dir): a folder of prebuilt TVM-CUDA libraries."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    quick = quick or bool(getattr(ctx, "quick", False))
    kernel_dir = kernel_dir or getattr(ctx, "tvm_cuda_dir", None)
    rows = []
    for B, L in DECODE_SHAPES[:2] if quick else DECODE_SHAPES:
        rows += _rows_of("decode", B, L, gen, kernel_dir)
    for B, L in [] if quick else PREFILL_SHAPES:
        rows += _rows_of("prefill", B, L, gen, kernel_dir)
    return rows


def build_kernels() -> list[ir.Kernel]:
    """The TVM kernels the rows time (for a build ahead of the run)."""
    return [ir.Kernel(op_of(), TVMConfig())]
