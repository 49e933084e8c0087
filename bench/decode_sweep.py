"""Decode split-KV sweep on the device: fused merge vs the two-launch path vs torch SDPA.

    python3 bench/decode_sweep.py [--extra] [--quant] [--json PATH]  # JSON also to $OUT/decode_sweep.json

Rows are bench/attention_bench.py's decode shapes (bf16, Hq 32, Hkv 8, D 128, page 16, random
page order); --extra adds shapes that probe the split rule (plan.choose_splits) off those
rows, and int8 / fp8 KV rows (fused vs two-launch around the auto split). For each row and split
count in {auto, 1, 2, 4, 8, 16, 32, 33, 48, 64} (splits of >= 64 positions) it plans the step with
that count (attention.plan(num_splits=...): the decode-only kernel's config with that split count) and
times attention.run() with the fused merge (one launch) and with fused_merge=False (partials +
merge_state; 1 split has no merge and is listed as fused), and torch SDPA on contiguous copies of
the same K/V. GB/s = K+V bytes / time. Times are medians of CUDA graph replays (captured on a
stream that was warmed up first, so the graph holds only the kernels), rotating over enough batch
copies to defeat the L2. Every configuration's output is poisoned, computed and compared with
SDPA first; the exit status is 1 when one differs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention_bench as ab  # noqa: E402  (PagedBatch, sdpa, shapes)

from uacompile import ir  # noqa: E402
from uacompile.targets.cuda import api, attention  # noqa: E402
from uacompile.targets.cuda.config import AttentionConfig  # noqa: E402
from uacompile.targets.cuda.layout import layout  # noqa: E402
from uacompile.targets.cuda.plan import MAX_SPLITS, choose_config, device_arch, device_sms  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 33, 48, 64)
EXTRA_SHAPES = [(2, 32768), (4, 16384), (16, 8192), (12, 16384), (20, 8192), (64, 2048)]
MIN_POSITIONS = 64  # a split shorter than this is not worth timing
TOLERANCE = 2e-2  # bf16 output vs SDPA


def auto_splits(op, B: int, L: int) -> int:
    """What attention.plan() picks on this device for B decode tokens at context L (the decode-only kernel)."""
    return choose_config(op, B, B, L, device_sms(0), device_arch(0)).num_splits


def unit_slots(op) -> int:
    """(token, KV head, split) items the GPU runs at once: resident decode-only blocks x their decode groups."""
    lay = layout(op, AttentionConfig(decode_only=True), device_arch(0))
    return device_sms(0) * lay.blocks_per_sm * lay.decode_groups


def replay_calls(kv_bytes: int) -> int:
    """Calls a graph replay holds: about 2 ms of K/V streaming, 2 to 20 of them."""
    return max(2, min(20, int(2e-3 / (kv_bytes / 3.5e12))))


def split_counts(B: int, L: int, auto: int) -> list[int]:
    return list(dict.fromkeys([auto, *(s for s in SPLITS if s == 1 or L // s >= MIN_POSITIONS)]))


QUANTIZED_ROWS = [(kv, B, L) for kv in ("int8", "fp8_e4m3") for B, L in [(8, 16384), (1, 32768)]]


def quantized_splits(op, B: int, L: int) -> list[int]:
    """The auto split, half and twice it, and the decode-only merge's chunk edges (16, 24, 32 splits)."""
    auto = auto_splits(op, B, L)
    near = [max(1, auto // 2), auto * 2, 16, 24, 32]
    return list(dict.fromkeys([auto, *(s for s in near if s <= MAX_SPLITS and L // s >= MIN_POSITIONS)]))


def build_all(shapes, quantized: bool) -> float:
    """Every variant the run launches, in parallel, before any timing."""
    t0 = time.perf_counter()
    cases = [(ab.op_of(), B, L, split_counts(B, L, auto_splits(ab.op_of(), B, L))) for B, L in shapes]
    if quantized:
        quant = [(ab.op_of().replace(kv_dtype=kv), B, L) for kv, B, L in QUANTIZED_ROWS]
        cases += [(op, B, L, quantized_splits(op, B, L)) for op, B, L in quant]
    ops = []
    for op, B, L, splits in cases:  # what plan() builds: the decode-only kernel at each count, fused or not
        for s in splits:
            ops += [ab.launched_kernel(op, B, B, L, num_splits=s)]
            if s > 1:
                ops += [ab.launched_kernel(op, B, B, L, num_splits=s, fused_merge=False),
                        ir.MergeState(ab.HQ, ab.D, s, "bf16")]
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, dict.fromkeys(ops)))
    return time.perf_counter() - t0


def sweep_row(B: int, L: int, gen) -> list[dict]:
    op = ab.op_of()
    slots = unit_slots(op)
    batches = ab.decode_batches(B, L, gen)
    b0 = batches[0]
    kv_bytes = b0.kv_bytes
    calls = replay_calls(kv_bytes)
    k, v = b0.contiguous_kv()
    want = ab.sdpa(b0.q_bhld(), k, v, False).transpose(1, 2).reshape(b0.q.shape).float()
    del k, v
    auto = auto_splits(op, B, L)
    rows = []
    shape = f"{B}x{L}"
    fns = {}
    for splits in split_counts(B, L, auto):
        for fused in ((True, False) if splits > 1 else (True,)):
            p = ab.plan_for(op, b0, num_splits=splits, fused_merge=fused)
            call = lambda b, p=p: attention.run(p, **b.args(), out=b.out)  # noqa: E731
            b0.out.fill_(float("nan"))
            call(b0)
            diff = (b0.out.float() - want).abs().max().item()  # NaN (an unwritten element) compares False
            units = B * ab.HKV * splits
            rows.append(dict(shape=shape, impl="fused" if fused or splits == 1 else "two-launch", splits=splits,
                             auto=splits == auto, units=units, waves=round(units / slots, 2),
                             max_diff=diff, ok=diff <= TOLERANCE))
            fns[len(rows) - 1] = [lambda b=b, call=call: call(b) for b in batches]
    kc = [b.contiguous_kv() for b in batches]
    rows.append(dict(shape=shape, impl="torch SDPA contiguous", splits=0, auto=False, units=0, waves=0.0,
                     max_diff=0.0, ok=True))
    fns[len(rows) - 1] = [lambda b=b, kv=kv: ab.sdpa(b.q_bhld(), *kv, False) for b, kv in zip(batches, kc)]
    for i, t in ab.time_graphs(fns, calls, rounds=ab.ROUNDS).items():  # every split and SDPA interleaved
        rows[i].update(us=round(t.ms * 1e3, 2), gbps=round(kv_bytes / t.ms / 1e6, 1))
    del kc, batches, b0
    torch.cuda.empty_cache()
    return rows


def quantized_rows(gen) -> list[dict]:
    """Quantised KV (int8, fp8): the fused merge against the two-launch path at the auto split and
    its neighbours (the fused variants of these templates carry more register spills). Outputs are
    compared with the fused auto split's."""
    rows = []
    for kv_dtype, B, L in QUANTIZED_ROWS:
        op = ab.op_of().replace(kv_dtype=kv_dtype)
        slots = unit_slots(op)
        b = ab.PagedBatch(B, L, 1, gen)
        caches = {}
        for name in ("k", "v"):  # per (position, head) scales, as reshape_and_cache stores them
            x = getattr(b, f"{name}_cache").float()
            scale = (x.abs().amax(-1) / ir.QMAX[kv_dtype]).clamp_min(1e-8)
            y = x / scale[..., None]
            caches[f"{name}_cache"] = (y.round().clamp(-127, 127).to(torch.int8) if kv_dtype == "int8"
                                       else y.clamp(-448, 448).to(torch.float8_e4m3fn))
            caches[f"{name}_scale"] = scale.contiguous()
            setattr(b, f"{name}_cache", None)
            del x, y
        args = {**b.args(), **caches}
        kv_bytes = 2 * B * L * ab.HKV * (ab.D + 4)  # 1-byte elements + a float scale per row
        auto = auto_splits(op, B, L)
        calls = replay_calls(kv_bytes)
        want, fns = None, {}
        for splits in quantized_splits(op, B, L):
            for fused in ((True, False) if splits > 1 else (True,)):
                p = ab.plan_for(op, args, num_splits=splits, fused_merge=fused)
                call = lambda p=p: attention.run(p, **args, out=b.out)  # noqa: E731
                b.out.fill_(float("nan"))
                call()
                got = b.out.float()
                want = got.clone() if want is None else want
                diff = (got - want).abs().max().item()
                units = B * ab.HKV * splits
                rows.append(dict(shape=f"{B}x{L} {kv_dtype}", impl="fused" if fused or splits == 1 else "two-launch",
                                 splits=splits, auto=splits == auto, units=units, waves=round(units / slots, 2),
                                 max_diff=diff, ok=diff <= TOLERANCE))
                fns[len(rows) - 1] = call
        for i, t in ab.time_graphs(fns, calls, rounds=ab.ROUNDS).items():  # the row's split counts interleaved
            rows[i].update(us=round(t.ms * 1e3, 2), gbps=round(kv_bytes / t.ms / 1e6, 1))
        del b, args, caches, want
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| shape | impl | splits | items x splits (waves) | us | GB/s | % SDPA | max diff vs SDPA (int8/fp8: vs fused auto) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    sdpa_gbps = {r["shape"]: r["gbps"] for r in rows if r["impl"].startswith("torch")}
    for r in rows:
        splits = "" if r["impl"].startswith("torch") else f"{r['splits']}{' (auto)' if r['auto'] else ''}"
        units = f"{r['units']} ({r['waves']})" if r["units"] else ""
        diff = "" if r["impl"].startswith("torch") else f"{r['max_diff']:.3g}{'' if r['ok'] else ' BAD'}"
        pct = f"{100 * r['gbps'] / sdpa_gbps[r['shape']]:.0f}%" if r["shape"] in sdpa_gbps else ""
        lines.append(f"| {r['shape']} | {r['impl']} | {splits} | {units} | {r['us']:.1f} | {r['gbps']:.0f} | {pct} | {diff} |")
    return "\n".join(lines)


def summary(rows) -> list[str]:
    """Per shape: the auto choice against the best fused split count of this run."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        fused = [r for r in rows if r["shape"] == shape and r["impl"] == "fused"]
        auto = next(r for r in fused if r["auto"])
        best = max((r for r in fused if r["ok"]), key=lambda r: r["gbps"], default=auto)
        two = {r["splits"]: r["gbps"] for r in rows if r["shape"] == shape and r["impl"] == "two-launch"}
        old = f", two-launch at auto {two[auto['splits']]:.0f}" if auto["splits"] in two else ""
        out.append(f"{shape}: auto {auto['splits']} splits {auto['gbps']:.0f} GB/s ({auto['us']:.1f} us){old}; "
                   f"best fused {best['splits']} splits {best['gbps']:.0f} GB/s; auto/best {auto['gbps'] / best['gbps']:.3f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", action="store_true",
                    help="also sweep shapes that probe the split rule, and int8 / fp8 KV (fused vs two-launch)")
    ap.add_argument("--quant", action="store_true", help="also the int8 / fp8 KV rows (without --extra's shapes)")
    ap.add_argument("--json", default=None, help="write rows here (default $OUT/decode_sweep.json when OUT is set)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = ab.DECODE_SHAPES + (EXTRA_SHAPES if args.extra else [])
    quant = args.extra or args.quant
    print(f"# built the variants in {build_all(shapes, quant):.1f} s", flush=True)
    slots = unit_slots(ab.op_of())
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, t0 = [], time.perf_counter()
    for B, L in shapes:
        rows += sweep_row(B, L, gen)
        print(f"# {B}x{L} done at {time.perf_counter() - t0:.1f} s", flush=True)
    if quant:
        rows += quantized_rows(gen)
        print(f"# quantised KV done at {time.perf_counter() - t0:.1f} s", flush=True)
    gpu = torch.cuda.get_device_name()
    lines = summary(rows)
    print(f"\n{gpu}, {device_arch(0)}: {slots} (token, KV head, split) items at once (bf16)\n\n{table(rows)}\n\n" + "\n".join(lines))
    path = args.json or (os.path.join(os.environ["OUT"], "decode_sweep.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), slots=slots, summary=lines,
                                              rows=rows), indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
