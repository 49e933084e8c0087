"""Sweep the Hopper prefill tile (AttentionConfig.wg_tile: K/V positions per tile, TMA stages) on
ANCHORS.md's causal prefill shapes, with torch SDPA on contiguous KV in the same run, and check
that the 8-warp decode blocks of each variant keep their speed. Run on the device:

    python bench/prefill_sweep.py [--tiles 64x6,128x3] [--static] [--decode] [--mixed] [--power] [--json PATH]

Each tile is a field of the kernels' configs (plan once, run many: no global tile table is touched); a tile's
kernels are built all at once before its timings. Prefill runs as attention.plan()'s built-in rule configures it
(one split, the Hopper item queue) with the tile; --static adds the same step on an explicit
AttentionConfig(wg_tile=...) without the item queue (one prefill item a block). Each shape's
configs and torch SDPA are timed interleaved (timing.time_graphs: one graph each, replayed round by round),
so drift hits them alike; compare tiles by their ratio to the SDPA timed beside them.
--mixed adds attention_bench's mixed-ubatch rows (production config). --power adds, per prefill row, the board's
watts, joules per call and SM clock with each implementation running alone (timing.power_per_call, NVML): under
the 700 W cap a variant can lose by drawing more power as well as by doing more work.
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
from attention_bench import (D, DECODE_SHAPES, PREFILL_SHAPES, ROUNDS, PagedBatch, launched_kernel, mixed_rows,  # noqa: E402
                             op_of, plan_for, sdpa, spin_up_clocks)
from timing import power_per_call, time_graphs  # noqa: E402
from uacompile import ir  # noqa: E402
from uacompile.targets.cuda import api, attention  # noqa: E402
from uacompile.errors import IRError  # noqa: E402
from uacompile.targets.cuda.config import AttentionConfig  # noqa: E402

CONFIGS = {"": None, "static": AttentionConfig()}  # name -> explicit config (None: the built-in rule's)


def tile_configs(configs: dict, tile: tuple[int, int]) -> dict:
    """configs ({name: explicit config | None}) on the wgmma tile (positions, stages); None stays None (plan_for puts
    the tile on the built-in rule's config)."""
    return {name: c if c is None else c.replace(wg_tile=tile) for name, c in configs.items()}


def prebuild(op, shapes, configs: dict, tile: tuple[int, int], decode: bool) -> None:
    """Every kernel the rows plan (prefill at each config on the tile, decode rows at their auto split), built at
    once."""
    from concurrent.futures import ThreadPoolExecutor

    kernels = [ir.Kernel(op, c) if c is not None else launched_kernel(op, B * L, B, L, num_splits=1, wg_tile=tile)
               for B, L in shapes for c in configs.values()]
    if decode:
        kernels += [launched_kernel(op, B, B, L) for B, L in DECODE_SHAPES]
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, dict.fromkeys(kernels)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", default="64x6,128x3,64x4", help="wgmma tiles of the benchmarks' head dim (AttentionConfig.wg_tile) to sweep: positions x stages, comma list")
    ap.add_argument("--static", action="store_true", help="also time prefill without the item queue (one item a block)")
    ap.add_argument("--decode", action="store_true", help="also time the decode rows")
    ap.add_argument("--mixed", action="store_true", help="also time the mixed-ubatch rows")
    ap.add_argument("--shapes", default=",".join(f"{B}x{L}" for B, L in PREFILL_SHAPES))
    ap.add_argument("--power", action="store_true", help="also read power and SM clock per prefill implementation (NVML)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",")]
    for tile in tiles:  # a tile the config refuses stops the run here, before any GPU work
        try:
            AttentionConfig(wg_tile=tile)
        except IRError as e:
            ap.error(f"--tiles: {e}")
    if not torch.cuda.is_available():
        print("bench/prefill_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = op_of()
    rows = []
    shapes = [tuple(int(x) for x in t.split("x")) for t in a.shapes.split(",")]
    batches = {(B, L): PagedBatch(B, L, L, gen) for B, L in shapes}
    for b in batches.values():
        b.kv = b.contiguous_kv()
        b.want = sdpa(b.q_bhld(), *b.kv, True)
    for bn, stages in tiles:
        tile = (bn, stages)
        configs = tile_configs({n: c for n, c in CONFIGS.items() if n == "" or a.static}, tile)
        t0 = time.perf_counter()
        prebuild(op, list(batches), configs, tile, a.decode)
        built = time.perf_counter() - t0
        name = f"ua wgmma {bn}x{stages}"
        impls = {d: f"{name}{' ' + d if d else ''}" for d in configs}
        spin_up_clocks()  # the builds let the clocks drop
        for (B, L), b in batches.items():
            flops = 4 * B * L * L / 2 * 32 * D
            plans = {d: plan_for(op, b, tile, num_splits=1, config=c) for d, c in configs.items()}
            fns = {d: (lambda p=p: attention.run(p, **b.args(), out=b.out)) for d, p in plans.items()}
            fns["sdpa"] = lambda: sdpa(b.q_bhld(), *b.kv, True)
            t = time_graphs(fns, calls=2, rounds=ROUNDS)
            power = power_per_call(fns) if a.power else {}
            if a.power and not power:
                print("# --power: NVML (nvidia-ml-py) not available, rows without power", flush=True)
            watts = {n: dict(watts=round(w.watts, 1), joules_per_call=round(w.joules_per_call, 4), sm_mhz=w.sm_mhz)
                     for n, w in power.items()}
            rows.append(dict(shape=f"{B}x{L} causal", impl=f"torch SDPA contiguous (beside {name})", ms=t["sdpa"].ms,
                             tflops=flops / t["sdpa"].ms / 1e9, **watts.get("sdpa", {})))
            for d in configs:
                b.out.fill_(float("nan"))
                fns[d]()
                diff = (b.out.view(B, L, 32, D).transpose(1, 2).float() - b.want.float()).abs().max().item()
                rows.append(dict(shape=f"{B}x{L} causal", impl=impls[d], ms=t[d].ms, tflops=flops / t[d].ms / 1e9,
                                 vs_sdpa=round(t["sdpa"].ms / t[d].ms, 3), spread_pct=round(t[d].spread_pct, 2),
                                 diff=diff, build_s=round(built, 2), config=str(plans[d].config), **watts.get(d, {})))
                print(rows[-1], flush=True)
        if a.decode:
            for B, L in DECODE_SHAPES:
                d_ = PagedBatch(B, L, 1, gen)
                p = plan_for(op, d_, tile)
                t = time_graphs({"ua": lambda: attention.run(p, **d_.args(), out=d_.out)}, calls=10, rounds=ROUNDS)
                rows.append(dict(shape=f"decode {B}x{L}", impl=f"{name} splits={p.num_splits}", ms=t["ua"].ms,
                                 gbps=d_.kv_bytes / t["ua"].ms / 1e6))
                print(rows[-1], flush=True)
                del d_, p
        if a.mixed:
            for r in mixed_rows(gen, wg_tile=tile):
                rows.append(dict(shape=f"mixed {r['shape']}", impl=f"{name}: {r['impl']}", ms=r["ms"]))
                print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}\n| shape | impl | ms | TFLOP/s | GB/s | x SDPA (same timing) | max abs diff vs SDPA "
          "| W alone | J a call | SM MHz |\n|---|---|---|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.4f} | {r.get('tflops', 0):.0f} | {r.get('gbps', 0):.0f} | "
              f"{r.get('vs_sdpa', '')} | {r.get('diff', '')} | {r.get('watts', '')} | {r.get('joules_per_call', '')} | "
              f"{r.get('sm_mhz', '')} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
