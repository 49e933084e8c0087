"""Decode split-KV sweep on the device: fused merge vs the two-launch path vs torch SDPA.

    python3 bench/decode_sweep.py [--extra] [--quant] [--json PATH]  # JSON also to $OUT/decode_sweep.json
    python3 bench/decode_sweep.py --candidates [NAME,...]      # decode launch designs side by side

Rows are bench/attention_bench.py's decode shapes (bf16, Hq 32, Hkv 8, D 128, page 16, random
page order); --extra adds shapes that probe the split rule (attention.choose_splits) off those
rows, and int8 / fp8 KV rows (fused vs two-launch around the auto split). For each row and split
count in {auto, 1, 2, 4, 8, 16, 32, 33, 48, 64} (splits of >= 64 positions) it times
paged_attention() with the fused merge (one launch) and with fused_merge=False (partials +
merge_state; 1 split has no merge and is listed as fused), and torch SDPA on contiguous copies of
the same K/V. GB/s = K+V bytes / time. Times are medians of CUDA graph replays (captured on a
stream that was warmed up first, so the graph holds only the kernels), rotating over enough batch
copies to defeat the L2. Every configuration's output is poisoned, computed and compared with
SDPA first; the exit status is 1 when one differs.

--candidates: paged_attention()'s design knobs (attention.DESIGN_KNOBS; CANDIDATES below), each
built in its own spawned process (attention.load_designs), timed on CANDIDATE_SHAPES at the auto
split with the fused merge: one table of GB/s (us) a candidate and shape, torch SDPA as the last
row, and the change in us against the production build ("default") per cell; CANDIDATE_QUANT_SHAPES
adds int8 / fp8 KV rows (GB/s of 1-byte elements + scales; checked against SDPA on the dequantised
caches, not timed against it).
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
from uacompile.targets.cuda.loader import build_failure  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 33, 48, 64)
EXTRA_SHAPES = [(2, 32768), (4, 16384), (16, 8192), (12, 16384), (20, 8192), (64, 2048)]
MIN_POSITIONS = 64  # a split shorter than this is not worth timing
TOLERANCE = 2e-2  # bf16 output vs SDPA


# name -> design ("k=v,..."; "" = production): attention.DESIGN_KNOBS, read by paged_attention()
CANDIDATES = {
    "default": "",  # production: decode=only
    "mixed": "decode=mixed",  # decode steps on the one mixed kernel
}
CANDIDATE_SHAPES = [(1, 32768), (1, 4096), (8, 16384), (32, 4096), (128, 1024)]
# (kv_dtype, B, L) rows the candidates are timed on too: GB/s counts 1-byte elements + the scales
CANDIDATE_QUANT_SHAPES = [(kv, B, L) for kv in ("int8", "fp8_e4m3") for B, L in [(8, 16384), (1, 32768)]]


def auto_splits(op, B: int, L: int) -> int:
    """What paged_attention() picks on this device for B decode tokens at context L (on the decode-only
    kernel's layout unless the design's decode knob says mixed)."""
    return attention.launch_splits(op, B, B, L, attention._num_sms(0), attention._arch(0))


def unit_slots(op) -> int:
    """(token, KV head, split) items the GPU runs at once: resident blocks x their decode groups."""
    lay = attention.layout(op.replace(decode_only=attention.decode_launch(1, 1)), attention._arch(0))
    return attention._num_sms(0) * lay.blocks_per_sm * lay.decode_groups


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
    return list(dict.fromkeys([auto, *(s for s in near if s <= attention.MAX_SPLITS and L // s >= MIN_POSITIONS)]))


def build_all(shapes, quantized: bool) -> float:
    """Every variant the run launches, in parallel, before any timing."""
    t0 = time.perf_counter()
    cases = [(ab.op_of(), split_counts(B, L, auto_splits(ab.op_of(), B, L))) for B, L in shapes]
    if quantized:
        quant = [(ab.op_of().replace(kv_dtype=kv), B, L) for kv, B, L in QUANTIZED_ROWS]
        cases += [(op, quantized_splits(op, B, L)) for op, B, L in quant]
    ops = []
    for op, splits in cases:  # the launched kind: decode-only, unless the design says mixed
        op = op.replace(decode_only=attention.decode_launch(1, 1))
        ops += [op]
        for s in splits:
            if s > 1:
                ops += [op.replace(num_splits=s, fused_merge=True), op.replace(num_splits=s),
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
            call = lambda b, s=splits, f=fused: attention.paged_attention(op, **b.args(), out=b.out, num_splits=s,  # noqa: E731
                                                                          fused_merge=f)
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
                call = lambda s=splits, f=fused: attention.paged_attention(op, **args, out=b.out, num_splits=s,  # noqa: E731
                                                                           fused_merge=f)
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


def candidate_design(name: str) -> dict:
    """The knobs a candidate's paged_attention() calls read (decode, prefill): its design's, not this process'."""
    return attention.design_of(CANDIDATES[name])


def candidate_ops(shapes, quant_shapes=(), design: dict | None = None) -> dict:
    """{(kv_dtype, B, L): (op, splits)}: the op paged_attention() launches for each shape at its auto split
    under design (default production): fused merge, decode-only or (decode=mixed) the mixed kernel with
    item_queue on Hopper. Before session 8 the candidates ran the op without item_queue: another kernel,
    whose decode path ptxas allocates differently."""
    out = {}
    design = design or attention.design_of("")
    for kv, B, L in [(ab.op_of().kv_dtype, B, L) for B, L in shapes] + list(quant_shapes):
        out[(kv, B, L)] = attention.launch_plan(ab.op_of().replace(kv_dtype=kv), B, B, L, num_sms=attention._num_sms(0),
                                                arch=attention._arch(0), design=design)
    return out


def quantize_batch(b, kv_dtype: str) -> None:
    """b's K/V caches quantised in place (per (position, head) scales, as reshape_and_cache stores
    them); b.scales holds the scales, b.dequantized the dequantised 16-bit caches (for a reference)."""
    b.scales, b.dequantized = {}, {}
    for name in ("k", "v"):
        x = getattr(b, f"{name}_cache").float()
        scale = (x.abs().amax(-1) / ir.QMAX[kv_dtype]).clamp_min(1e-8)
        y = x / scale[..., None]
        q = y.round().clamp(-127, 127).to(torch.int8) if kv_dtype == "int8" else y.clamp(-448, 448).to(torch.float8_e4m3fn)
        setattr(b, f"{name}_cache", q)
        b.scales[f"{name}_scale"] = scale.contiguous()
        b.dequantized[name] = (q.float() * scale[..., None]).to(ab.DTYPE)
    b.kv_bytes_quant = 2 * b.B * b.L * ab.HKV * (ab.D + 4)


def candidate_call(kern, op, splits: int, b, design: dict | None = None) -> None:
    """One launch of a candidate's kernel through paged_attention() (its workspaces and item queue)."""
    def kernel_of(run):
        assert run == op, f"paged_attention() launches {run}, the candidate was built for {op}"
        return kern

    attention.paged_attention(ab.op_of().replace(kv_dtype=op.kv_dtype), **b.args(), **getattr(b, "scales", {}),
                              out=b.out, num_splits=splits, kernel_of=kernel_of, design=design)


def candidates_main(names: list[str], json_path: str | None, build_only: bool = False) -> int:
    designs = {n: candidate_design(n) for n in names}
    per = {n: candidate_ops(CANDIDATE_SHAPES, CANDIDATE_QUANT_SHAPES, designs[n]) for n in names}
    ops = per[names[0]]  # the shapes (every candidate has the same keys)
    t0 = time.perf_counter()
    every = list(dict.fromkeys(op for n in names for op, _ in per[n].values()))
    libs = attention.load_designs({n: CANDIDATES[n] for n in names}, every)
    print(f"# built {len(names)} candidates in {time.perf_counter() - t0:.1f} s", flush=True)
    if build_only:  # fills the kernel cache (a device script runs this beside the GPU tests)
        bad = [f"{n}: {v}" for n, v in libs.items() if isinstance(v, Exception)]
        print("\n".join(bad))
        return 1 if bad else 0
    failed = {n: build_failure(v) for n, v in libs.items() if isinstance(v, Exception)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for (kv, B, L) in ops:
        batches = ab.decode_batches(B, L, gen)
        quant = kv != ab.op_of().kv_dtype
        for b in batches if quant else ():
            quantize_batch(b, kv)
        b0 = batches[0]
        kv_bytes = b0.kv_bytes_quant if quant else b0.kv_bytes
        calls = replay_calls(kv_bytes)
        if quant:  # the reference: SDPA on the dequantised caches
            k, v = b0.k_cache, b0.v_cache
            b0.k_cache, b0.v_cache = b0.dequantized["k"], b0.dequantized["v"]
            kd, vd = b0.contiguous_kv()
            b0.k_cache, b0.v_cache = k, v
            want = ab.sdpa(b0.q_bhld(), kd, vd, False).transpose(1, 2).reshape(b0.q.shape).float()
            del kd, vd
            for b in batches:
                del b.dequantized
        else:
            k, v = b0.contiguous_kv()
            want = ab.sdpa(b0.q_bhld(), k, v, False).transpose(1, 2).reshape(b0.q.shape).float()
            del k, v
        shape = f"{B}x{L}" + (f" {kv}" if quant else "")
        fns = {}
        for n in names:
            op, splits = per[n][(kv, B, L)]
            if n in failed:
                rows.append(dict(shape=shape, candidate=n, splits=splits, ok=False, check=failed[n]))
                continue
            kern = api.CudaKernel(op, library=libs[n])
            call = lambda b, kern=kern, op=op, splits=splits, d=designs[n]: candidate_call(kern, op, splits, b, d)  # noqa: E731
            b0.out.fill_(float("nan"))
            call(b0)
            diff = (b0.out.float() - want).abs().max().item()  # NaN (an unwritten element) compares False
            rows.append(dict(shape=shape, candidate=n, splits=splits, max_diff=diff, ok=diff <= TOLERANCE,
                             check="ok" if diff <= TOLERANCE else f"max diff {diff:.3g} vs SDPA"))
            fns[len(rows) - 1] = [lambda b=b, call=call: call(b) for b in batches]
        kc = [] if quant else [b.contiguous_kv() for b in batches]  # quantised rows: the candidates only
        if not quant:
            rows.append(dict(shape=shape, candidate="torch SDPA contiguous", splits=0, ok=True, check="ok"))
            fns[len(rows) - 1] = [lambda b=b, kv=kv: ab.sdpa(b.q_bhld(), *kv, False) for b, kv in zip(batches, kc)]
        for i, t in ab.time_graphs(fns, calls, rounds=ab.ROUNDS).items():  # candidates and SDPA interleaved
            rows[i].update(us=round(t.ms * 1e3, 2), gbps=round(kv_bytes / t.ms / 1e6, 1))
        del kc, batches, b0
        torch.cuda.empty_cache()
        print(f"# {shape} done at {time.perf_counter() - t0:.1f} s", flush=True)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    by = {(r["candidate"], r["shape"]): r for r in rows}
    splits = {r["shape"]: r["splits"] for r in rows if r["splits"] and r["candidate"] == names[0]}
    lines = [f"{torch.cuda.get_device_name()}, {attention._arch(0)}: GB/s (median us) at the auto split; "
             "[+-us vs default]",
             "", "| candidate | " + " | ".join(f"{s} ({splits.get(s, 1)} splits)" for s in shapes) + " |",
             "|---|" + "---:|" * len(shapes)]
    for n in [*names, "torch SDPA contiguous"]:
        cells = []
        for s in shapes:
            r = by.get((n, s))
            if r is None or "us" not in r:
                cells.append(r["check"] if r else "")
                continue
            base = by.get(("default", s))
            delta = f" [{r['us'] - base['us']:+.1f}]" if base and "us" in base and n != "default" else ""
            own = f" {r['splits']} splits" if r["splits"] and r["splits"] != splits.get(s) else ""  # a design's own rule
            cells.append(f"{r['gbps']:.0f} ({r['us']:.1f}){own}{delta}{'' if r['ok'] else ' BAD'}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines))
    for r in rows:
        if not r["ok"]:
            print(f"! {r['candidate']} {r['shape']}: {r['check']}")
    path = json_path or (os.path.join(os.environ["OUT"], "decode_candidates.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                              candidates={n: CANDIDATES[n] for n in names}, rows=rows), indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", action="store_true",
                    help="also sweep shapes that probe the split rule, and int8 / fp8 KV (fused vs two-launch)")
    ap.add_argument("--quant", action="store_true", help="also the int8 / fp8 KV rows (without --extra's shapes)")
    ap.add_argument("--json", default=None, help="write rows here (default $OUT/decode_sweep.json when OUT is set)")
    ap.add_argument("--candidates", nargs="?", const=",".join(CANDIDATES), default=None,
                    help="compare the decode design candidates (comma list; default all) instead of split counts")
    ap.add_argument("--build-only", action="store_true", help="with --candidates: build them and exit")
    args = ap.parse_args(argv)
    if args.candidates is not None:
        names = [n for n in args.candidates.split(",") if n]
        unknown = sorted(set(names) - set(CANDIDATES))
        if unknown:
            ap.error(f"unknown candidates {unknown}; have {list(CANDIDATES)}")
    if not torch.cuda.is_available():
        print("bench/decode_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.candidates is not None:
        return candidates_main(names, args.json, args.build_only)
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
    print(f"\n{gpu}, {attention._arch(0)}: {slots} (token, KV head, split) items at once (bf16)\n\n{table(rows)}\n\n" + "\n".join(lines))
    path = args.json or (os.path.join(os.environ["OUT"], "decode_sweep.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), slots=slots, summary=lines,
                                              rows=rows), indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
