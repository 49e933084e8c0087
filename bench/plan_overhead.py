"""The CPU cost of one layer's attention call from Python (run on the device; bench/kernels.py calls overhead_rows).

    python3 bench/plan_overhead.py [--calls 1000]

A serving step plans once (attention.plan) and calls attention.run(plan, ...) every layer, eagerly from Python
unless a CUDA graph holds the step. This times that call: `calls` back-to-back calls with one
torch.cuda.synchronize() at the end, wall time / calls (mean us a call). The shapes are the benchmarks' head
geometry (bf16, Hq 32, Hkv 8, D 128, page 16) on short sequences, so each call's GPU work (its graph-replay time,
reported beside it) stays under its CPU cost and the wall time is the Python side: argument checks, the cffi
call, the launch. Beside it the same for paged_attention(), the one-call convenience (plan + run a call), with
a kept Workspace and with a fresh one a call. The target: run() <= 15 us a call.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from attention_bench import PagedBatch, op_of, plan_for  # noqa: E402
from timing import time_graphs  # noqa: E402

from uacompile.targets.cuda import attention  # noqa: E402

RUN_TARGET_US = 15.0
# (shape label, B, L, q_len, num_splits): a decode step at the built-in split, one with the fused merge's
# workspace tensors, and a short prefill (the Hopper item queue)
CASES = [("decode 8x256", 8, 256, 1, None), ("decode 8x256 splits=4", 8, 256, 1, 4), ("prefill 2x64", 2, 64, 64, 1)]


def eager_us(fn, calls: int, warmup: int = 20) -> float:
    """Mean wall-clock us of `calls` back-to-back calls of fn, synchronised once at the end only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def overhead_rows(ctx=None, calls: int = 1000) -> list[dict]:
    """Rows {op: "plan overhead", shape, impl, us, ms, gpu_us, note}: the mean CPU cost a call of attention.run()
    and of paged_attention(), each with its GPU time (graph replay) beside it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = op_of()
    rows = []
    for shape, B, L, q_len, splits in CASES:
        b = PagedBatch(B, L, q_len, gen)
        p = plan_for(op, b, num_splits=splits)
        ws = attention.Workspace(b.q.device)
        args = b.args()
        fns = {
            "attention.run(plan, ...)": lambda: attention.run(p, **args, out=b.out),
            "paged_attention(), kept Workspace": lambda: attention.paged_attention(op, **args, out=b.out,
                                                                                 num_splits=splits, workspace=ws),
            "paged_attention(), fresh Workspace": lambda: attention.paged_attention(op, **args, out=b.out,
                                                                                  num_splits=splits),
        }
        gpu_ms = time_graphs({"run": fns["attention.run(plan, ...)"]}, calls=20, rounds=5)["run"].ms
        for impl, fn in fns.items():
            us = eager_us(fn, calls)
            note = (f"{p.config.num_splits} split(s), decode_only={p.config.decode_only}, "
                    f"item_queue={p.config.item_queue}; GPU {gpu_ms * 1e3:.1f} us a call (graph)")
            if gpu_ms * 1e3 >= us:
                note += "; GPU-bound: the wall time is the GPU's, the CPU cost is lower"
            rows.append(dict(op="plan overhead", shape=shape, impl=impl, us=round(us, 2), ms=round(us / 1e3, 5),
                             gpu_us=round(gpu_ms * 1e3, 2), note=note))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape | call | CPU us a call | GPU us a call | note |", "|---|---|---:|---:|---|"]
    lines += [f"| {r['shape']} | {r['impl']} | {r['us']:.2f} | {r['gpu_us']:.2f} | {r['note']} |" for r in rows]
    return "\n".join(lines) + f"\n\nTarget: attention.run() <= {RUN_TARGET_US:g} us a call."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000, help="calls timed a row (default 1000)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/plan_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}\n\n{table(overhead_rows(calls=a.calls))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
