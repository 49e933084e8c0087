"""Sweep the Hopper prefill tile table (attention.WG_TILE: K/V positions per tile, TMA stages) on
ANCHORS.md's causal prefill shapes, with torch SDPA on contiguous KV in the same run, and check
that the 8-warp decode blocks of each variant keep their speed. Run on the device:

    python bench/prefill_sweep.py [--tiles 64x6,128x3] [--decode] [--mixed] [--designs ";prefill=dynamic"]
                                  [--power] [--json PATH]

--designs compares several UACOMPILE_PA_VARIANT values (";"-separated, "" = production) in one process;
every variant a design launches is built in parallel before any timing. Each shape's designs and
torch SDPA are timed interleaved (timing.time_graphs: one graph each, replayed round by round),
so drift hits them alike; compare tiles by their ratio to the SDPA timed beside them.
--mixed adds attention_bench's mixed-ubatch rows (per design). --power adds, per prefill row, the board's
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
from attention_bench import D, DECODE_SHAPES, PREFILL_SHAPES, ROUNDS, PagedBatch, mixed_rows, op_of, sdpa, spin_up_clocks
from timing import power_per_call, time_graphs
from uacompile.targets.cuda import api, attention


def prebuild(op, designs: list[str], decode: bool) -> None:
    """Every variant paged_attention() launches under the designs (prefill, decode rows), built at once."""
    from concurrent.futures import ThreadPoolExecutor

    for d in designs:  # the render reads the other knobs once a process: bench/decode_sweep.py --candidates compares them
        if any(k != "prefill" for k, v in attention.design_of(d).items() if v != attention.DESIGN_KNOBS[k][0]):
            raise SystemExit(f"--designs: only the prefill knob changes within one process, got {d!r}")
    splits = {1} | ({attention.launch_splits(op, B, B, L) for B, L in DECODE_SHAPES} if decode else set())
    ops = {attention.launched_op(op, s, design=attention.design_of(d)) for d in designs for s in splits}
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, ops))


def under(design: str, fn):
    """fn run with UACOMPILE_PA_VARIANT=design: paged_attention() reads it per call, so a graph
    captured through this wrapper launches that design's op."""
    def call():
        os.environ[attention.DESIGN_ENV] = design
        return fn()
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", default="64x6,128x3,64x4")
    ap.add_argument("--decode", action="store_true", help="also time the decode rows")
    ap.add_argument("--mixed", action="store_true", help="also time the mixed-ubatch rows")
    ap.add_argument("--designs", default="", help='";"-separated UACOMPILE_PA_VARIANT values ("" = production)')
    ap.add_argument("--shapes", default=",".join(f"{B}x{L}" for B, L in PREFILL_SHAPES))
    ap.add_argument("--power", action="store_true", help="also read power and SM clock per prefill implementation (NVML)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tiles = []
    for t in a.tiles.split(","):
        tiles.append(tuple(int(x) for x in t.split("x")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    op = op_of()
    rows = []
    shapes = [tuple(int(x) for x in t.split("x")) for t in a.shapes.split(",")]
    batches = {(B, L): PagedBatch(B, L, L, gen) for B, L in shapes}
    for b in batches.values():
        b.kv = b.contiguous_kv()
        b.want = sdpa(b.q_bhld(), *b.kv, True)
    designs = a.designs.split(";")
    for bn, stages in tiles:
        attention.WG_TILE[D] = (bn, stages)
        api._kernels.clear()
        t0 = time.perf_counter()
        prebuild(op, designs, a.decode)
        built = time.perf_counter() - t0
        tile = f"ua wgmma {bn}x{stages}"
        impls = {d: f"{tile}{' ' + d if d else ''}" for d in designs}
        spin_up_clocks()  # the builds let the clocks drop
        for (B, L), b in batches.items():
            flops = 4 * B * L * L / 2 * 32 * D
            call = lambda: attention.paged_attention(op, **b.args(), out=b.out, num_splits=1)  # noqa: E731
            fns = {d: under(d, call) for d in designs}
            fns["sdpa"] = lambda: sdpa(b.q_bhld(), *b.kv, True)
            t = time_graphs(fns, calls=2, rounds=ROUNDS)
            power = power_per_call(fns) if a.power else {}
            if a.power and not power:
                print("# --power: NVML (nvidia-ml-py) not available, rows without power", flush=True)
            watts = {n: dict(watts=round(w.watts, 1), joules_per_call=round(w.joules_per_call, 4), sm_mhz=w.sm_mhz)
                     for n, w in power.items()}
            rows.append(dict(shape=f"{B}x{L} causal", impl=f"torch SDPA contiguous (beside {tile})", ms=t["sdpa"].ms,
                             tflops=flops / t["sdpa"].ms / 1e9, **watts.get("sdpa", {})))
            for d in designs:
                b.out.fill_(float("nan"))
                under(d, call)()
                diff = (b.out.view(B, L, 32, D).transpose(1, 2).float() - b.want.float()).abs().max().item()
                rows.append(dict(shape=f"{B}x{L} causal", impl=impls[d], ms=t[d].ms, tflops=flops / t[d].ms / 1e9,
                                 vs_sdpa=round(t["sdpa"].ms / t[d].ms, 3), spread_pct=round(t[d].spread_pct, 2),
                                 diff=diff, build_s=round(built, 2), **watts.get(d, {})))
                print(rows[-1], flush=True)
        if a.decode:
            for B, L in DECODE_SHAPES:
                d_ = PagedBatch(B, L, 1, gen)
                call = lambda: attention.paged_attention(op, **d_.args(), out=d_.out)  # noqa: E731
                t = time_graphs({d: under(d, call) for d in designs}, calls=10, rounds=ROUNDS)
                splits = attention.launch_splits(op, B, B, L)
                for d in designs:
                    rows.append(dict(shape=f"decode {B}x{L}", impl=f"{impls[d]} splits={splits}", ms=t[d].ms,
                                     gbps=d_.kv_bytes / t[d].ms / 1e6))
                    print(rows[-1], flush=True)
                del d_
        if a.mixed:
            for d in designs:
                os.environ[attention.DESIGN_ENV] = d
                for r in mixed_rows(gen):
                    rows.append(dict(shape=f"mixed {r['shape']}", impl=f"{impls[d]}: {r['impl']}", ms=r["ms"]))
                    print(rows[-1], flush=True)
        os.environ.pop(attention.DESIGN_ENV, None)
    print(f"\n{torch.cuda.get_device_name()}\n| shape | impl | ms | TFLOP/s | GB/s | x SDPA (same timing) | max abs diff vs SDPA "
          "| W alone | J a call | SM MHz |\n|---|---|---|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['impl']} | {r['ms']:.4f} | {r.get('tflops', 0):.0f} | {r.get('gbps', 0):.0f} | "
              f"{r.get('vs_sdpa', '')} | {r.get('diff', '')} | {r.get('watts', '')} | {r.get('joules_per_call', '')} | "
              f"{r.get('sm_mhz', '')} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))


if __name__ == "__main__":
    main()
