"""Sweep the Hopper prefill tile table (attention.WG_TILE: K/V positions per tile, TMA stages) on
ANCHORS.md's causal prefill shapes, with torch SDPA on contiguous KV in the same run, and check
that the 8-warp decode blocks of each variant keep their speed. Run on the device:

    python bench/prefill_sweep.py [--tiles 64x6,128x3:-DFLAG] [--decode] [--json PATH]

A tile may carry extra nvcc flags after a colon (the template's experiment switches). Each
prefill row is timed interleaved with torch SDPA on the same data (timing.time_graphs), and its
ratio to that SDPA timing is the number to compare across tiles: drift between tiles cancels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from attention_bench import D, DECODE_SHAPES, PREFILL_SHAPES, ROUNDS, PagedBatch, op_of, sdpa, time_ms
from timing import time_graphs
from uacompile.targets.cuda import api, attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", default="64x6,128x3,64x4")
    ap.add_argument("--decode", action="store_true", help="also time the decode rows")
    ap.add_argument("--shapes", default=",".join(f"{B}x{L}" for B, L in PREFILL_SHAPES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tiles = []
    for t in a.tiles.split(","):
        shape, _, flags = t.partition(":")
        tiles.append((*(int(x) for x in shape.split("x")), flags))
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = op_of()
    rows = []
    shapes = [tuple(int(x) for x in t.split("x")) for t in a.shapes.split(",")]
    batches = {(B, L): PagedBatch(B, L, L, gen) for B, L in shapes}
    for (B, L), b in batches.items():
        b.kv = b.contiguous_kv()
        b.want = sdpa(b.q_bhld(), *b.kv, True)
    for bn, stages, flags in tiles:
        attention.WG_TILE[D] = (bn, stages)
        os.environ["UACOMPILE_NVCC_FLAGS"] = flags
        api._kernels.clear()
        t0 = time.perf_counter()
        api.kernel(op)
        built = time.perf_counter() - t0
        impl = f"ua wgmma {bn}x{stages}{' ' + flags if flags else ''}"
        for (B, L), b in batches.items():
            flops = 4 * B * L * L / 2 * 32 * D
            t = time_graphs({"ua": lambda: attention.paged_attention(op, **b.args(), out=b.out, num_splits=1),
                             "sdpa": lambda: sdpa(b.q_bhld(), *b.kv, True)}, calls=2, rounds=ROUNDS)
            b.out.fill_(float("nan"))
            attention.paged_attention(op, **b.args(), out=b.out, num_splits=1)
            diff = (b.out.view(B, L, 32, D).transpose(1, 2).float() - b.want.float()).abs().max().item()
            rows.append(dict(shape=f"{B}x{L} causal", impl=f"torch SDPA contiguous (beside {impl})", ms=t["sdpa"].ms,
                             tflops=flops / t["sdpa"].ms / 1e9))
            rows.append(dict(shape=f"{B}x{L} causal", impl=impl, ms=t["ua"].ms, tflops=flops / t["ua"].ms / 1e9,
                             vs_sdpa=round(t["sdpa"].ms / t["ua"].ms, 3), diff=diff, build_s=round(built, 2)))
            print(rows[-1], flush=True)
        if a.decode:
            for B, L in DECODE_SHAPES:
                d = PagedBatch(B, L, 1, gen)
                ms = time_ms([lambda: attention.paged_attention(op, **d.args(), out=d.out)], calls_per_fn=10)
                splits = attention.choose_splits(op, B, B, L)
                rows.append(dict(shape=f"decode {B}x{L}", impl=f"ua wgmma {bn}x{stages}{' ' + flags if flags else ''} splits={splits}", ms=ms,
                                 gbps=d.kv_bytes / ms / 1e6))
                print(rows[-1], flush=True)
                del d
    print(f"\n{torch.cuda.get_device_name()}\n| shape | impl | ms | TFLOP/s | GB/s | x SDPA (same timing) | max abs diff vs SDPA |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.4f} | {r.get('tflops', 0):.0f} | {r.get('gbps', 0):.0f} | "
              f"{r.get('vs_sdpa', '')} | {r.get('diff', '')} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))


if __name__ == "__main__":
    main()
