"""reshape_and_cache design sweep, run on the device: one table of GB/s and % of the copy ceiling.

    PYTHONPATH=... python3 bench/reshape_sweep.py [--only rows4,oneshot] [--list]   # JSON to $OUT if set

A candidate is the template built with another ReshapeConfig (targets/cuda/config.py; the rule for the fields
it leaves unset is `_reshape_and_cache` in targets/cuda/render.py). Each candidate is one library holding
the kernels of bench/kernels.py RESHAPE_CASES. For every case and candidate: a correctness run
on poisoned caches with every 5th slot -1, against the numpy reference (bit for bit; K with
fused RoPE as tests/targets/cuda/test_cuda_api_gpu.py allows, <= 1e-4 of the written rows, and bit for bit with
the first candidate); for quantised caches a second run with rows outside the fast quantisation
range (zeros, NaN, Inf, tiny and huge scales, the range's edges), bit for bit with the first
candidate (the reference leaves NaN rows to numpy's casts). Then all candidates that passed
are timed together with every slot written (kernels.time_graphs: one CUDA graph of many calls
each, replayed round-robin, the order rotated per round; median and interquartile spread), on
inputs from a fixed seed. The copy ceiling (a 1 GiB torch copy_) is measured in the same run,
after the GPU clocks are spun up (it idles through the builds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

# name -> design knobs ("" = the production choice); the knobs are documented in _reshape_and_cache.
# A candidate's knobs apply to every column: read the table per column (the quantised columns get
# quant=lean,amax=packed under every candidate; RoPE's run through the cp.async ring, where oneshot
# changes nothing). Registers are sm_90 ptxas counts of the big-task kernel (the min_blocks caps
# also cap RoPE's float64 math, which then spills: read those in the other columns).
# Dropped after the 2026-11-30 sweeps (in git history), where they lost to the production choice: stages2/3/4 and
# stages4-t128 without a persistent grid, rows1/4, stages3-rows1, waves1/2 (register pipeline),
# threads128/512, minblocks4, mb5, mb8, stages2-minblocks4, steps1, slowquant, neox-reload,
# group 4/8, prefetch 1024/2048/4096; lean and lean-packed are production.
CANDIDATES = {
    "default": "",
    # waves=0 gives each warp one round: known at compile time, the register pipeline's next-task
    # loads and loop-carried copies go (int8/fp8 63 -> 40 registers, fp16 53 -> 28: 4 -> 6 / 8
    # resident blocks of 256 an SM, so more rows in flight per SM)
    "oneshot": "oneshot=1",
    # ... capped at 32 registers: 8 blocks an SM, full occupancy (spill-free for the bench's D=128
    # int8 / fp8 / fp16; spills 4-44 bytes at quantised D 64/80/96 and 140-650 with RoPE)
    "oneshot-mb8": "oneshot=1,min_blocks=8",
    # ... four heads a step: 8 vectors a lane in flight before the first reduction (64 / 42 registers)
    "oneshot-rows4": "oneshot=1,rows=4",
    # ... 128-thread blocks capped at 32 registers (a block's slot frees when its 4 warps end; spills as mb8)
    "oneshot-t128-mb16": "oneshot=1,threads=128,min_blocks=16",
    # cp.async ring on a persistent grid (2 waves): the next 1 / 2 / 3 steps in flight through shared
    # memory instead of registers (int8/fp8 50, fp16 32 registers; with RoPE the ring runs on
    # across tokens instead of refilling per token). The ring without a persistent grid lost (above).
    "stages2-waves2": "stages=2,waves=2",
    "stages3-waves2": "stages=3,waves=2",
    "stages4-waves2": "stages=4,waves=2",
    "stages3-waves1": "stages=3,waves=1",
}


def candidate_kernel(name: str, op):
    """The candidate's kernel of op: op with the candidate's ReshapeConfig."""
    from uacompile import ir
    from uacompile.targets.cuda.config import ReshapeConfig

    return ir.Kernel(op, ReshapeConfig.parse(CANDIDATES[name]))


def build_failure(e: Exception) -> str:
    """A candidate's failed build in one line (a sweep's row)."""
    text = str(e).strip()
    return f"build: {text.splitlines()[-1][:200] if text else type(e).__name__}"


def build_all(names: list[str], ops: list, arch: str) -> tuple[dict, dict]:
    """One library a candidate (its kernels: ops with its ReshapeConfig), nvcc runs side by side on threads:
    {name: library}, {name: its build's error in one line}."""
    from concurrent.futures import ThreadPoolExecutor

    from uacompile.targets.cuda.loader import load

    def one(n):
        try:
            return n, load([candidate_kernel(n, op) for op in ops], arch), None
        except Exception as e:  # noqa: BLE001 - a candidate that does not build is a row, not the end
            return n, None, build_failure(e)

    libs, failed = {}, {}
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        for n, lib, err in pool.map(one, names):
            if lib is not None:
                libs[n] = lib
            else:
                failed[n] = err
    return libs, failed


# ---------------------------------------------------------------- correctness
def to_numpy(t, dtype: str):
    import torch

    from uacompile.ir import numpy_dtype

    return t.detach().cpu().contiguous().view(torch.uint8).numpy().view(numpy_dtype(dtype)).reshape(tuple(t.shape))


def expected_outputs(case, check_slots) -> dict:
    """The reference's caches and scales (written rows on a poison background), as bytes on the GPU."""
    import numpy as np
    import torch

    from uacompile import reference
    from uacompile.ir import numpy_dtype

    op, a = case.op, case.args
    specs = {p.name: p for p in op.tensors()}
    arrays = dict(k=to_numpy(a["k"], op.dtype), v=to_numpy(a["v"], op.dtype), slot_mapping=check_slots.cpu().numpy())
    if op.rope:
        arrays["positions"] = a["positions"].cpu().numpy()
    outs = [n for n in ("k_cache", "v_cache", "k_scale", "v_scale") if n in a]
    for n in outs:
        raw = np.full(a[n].numel() * a[n].element_size(), 0xFF, np.uint8)
        arrays[n] = raw.view(numpy_dtype(specs[n].dtype)).reshape(tuple(a[n].shape))
    reference.reshape_and_cache(op, **arrays)
    return {n: torch.from_numpy(arrays[n].reshape(-1).view(np.uint8)).cuda() for n in outs}


def special_rows(case) -> dict:
    """k and v with one head's row of each kind the fast quantisation path hands to the general
    one (and rows at the edges of its range), on tokens 1..; K and V rows of a token differ."""
    import torch

    D = case.op.head_dim
    base = torch.randn(D, device="cuda")
    unit = base / base.abs().max()
    kinds = [torch.zeros(D, device="cuda"), base.clone().index_fill_(0, torch.tensor([3], device="cuda"), float("nan")),
             base.clone().index_fill_(0, torch.tensor([5], device="cuda"), float("inf")),
             base.clone().index_fill_(0, torch.tensor([7], device="cuda"), float("-inf")),
             base * 1e-33, base * 1e33, unit * (127 * 2.0 ** -100), unit * (127 * 2.0 ** 100), unit * (448 * 2.0 ** -100),
             unit * (448 * 2.0 ** 100), unit * 1e-6]
    token = lambda j: 5 * (j // 4) + j % 4 + 1  # noqa: E731 - the j-th token that is not padding (check_slots[::5] = -1)
    out = {}
    for name, shift in (("k", 0), ("v", 1)):
        x = case.args[name].clone()
        for i, row in enumerate(kinds):
            t = token(i + shift)
            x[t, t % case.op.num_kv_heads] = row.to(x.dtype)
        out[name] = x
    return out


def check_special(kern, case, check_slots, special: dict, first: dict) -> list[str]:
    """The special rows' outputs, bit for bit with the first candidate's (which fills `first`)."""
    import torch

    run_args = dict(case.args, slot_mapping=check_slots, **special)
    for n in ("k_cache", "v_cache", "k_scale", "v_scale"):
        run_args[n].view(torch.uint8).fill_(0xFF)
    kern(**run_args)
    torch.cuda.synchronize()
    bad = []
    for n in ("k_cache", "v_cache", "k_scale", "v_scale"):
        got = run_args[n].view(torch.uint8).reshape(-1)
        key = "special " + n
        if key in first and not torch.equal(got, first[key]):
            bad.append(f"{key}: {int((got != first[key]).sum())} bytes differ from the first candidate")
        first.setdefault(key, got.clone())
    return bad


def check(kern, case, check_slots, expected: dict, first: dict, special: dict | None = None) -> str:
    """'ok', or what differs. first: the first candidate's outputs (filled by its call)."""
    import torch

    op = case.op
    run_args = dict(case.args, slot_mapping=check_slots)
    for n in expected:
        run_args[n].view(torch.uint8).fill_(0xFF)  # poison: NaN / -1 where nothing is written
    kern(**run_args)
    torch.cuda.synchronize()
    bad = []
    for n, want in expected.items():
        got = run_args[n].view(torch.uint8).reshape(-1)
        if op.rope and n in ("k_cache", "k_scale"):  # device sincos vs libm: compare rows, then designs bit for bit
            if n == "k_cache":
                row_bytes = op.head_dim * run_args[n].element_size()
                rows_bad = int((got.view(-1, row_bytes) != want.view(-1, row_bytes)).any(1).sum())
                written = int((check_slots >= 0).sum()) * op.num_kv_heads
                if rows_bad > 1e-4 * written:
                    bad.append(f"{n}: {rows_bad} of {written} rows differ from the reference")
            if n in first and not torch.equal(got, first[n]):
                bad.append(f"{n}: {int((got != first[n]).sum())} bytes differ from the first candidate")
            first.setdefault(n, got.clone())
        elif not torch.equal(got, want):
            bad.append(f"{n}: {int((got != want).sum())} of {got.numel()} bytes differ")
    if special:
        bad += check_special(kern, case, check_slots, special, first)
    return "; ".join(bad) or "ok"


# ---------------------------------------------------------------- report
def short(shape: str) -> str:
    """'T=32768 Hkv=8 D=128 P=16 bf16->int8' -> 'bf16->int8' (T kept when not the big batch)."""
    parts = shape.split()
    return " ".join(([parts[0]] if parts[0] != "T=32768" else []) + parts[4:])


def table(rows: list[dict], names: list[str], shapes: list[str]) -> str:
    width, cell = max(len(n) for n in ["candidate", *names]), 27
    head = f"{'candidate':<{width}} | " + " | ".join(f"{short(s):>{cell}}" for s in shapes) + " | min % (T=32768)"
    lines = [head, "-" * len(head)]
    by = {(r["candidate"], r["shape"]): r for r in rows}
    for n in names:
        cells, big = [], []
        for s in shapes:
            r = by.get((n, s))
            if r is None or "gbps" not in r:
                cells.append(f"{'-':>{cell}}")
                continue
            flag = "" if r["check"] == "ok" else " !"
            cells.append(f"{r['gbps']:5.0f} {r['pct_ceiling']:5.1f}% {r['us']:6.1f}us ±{r['spread_pct'] / 2:3.1f}{flag:>2}")
            if s.startswith("T=32768"):
                big.append(r["pct_ceiling"])
        lines.append(f"{n:<{width}} | " + " | ".join(cells) + (f" | {min(big):.1f}" if big else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of candidates (the first is the K reference for RoPE)")
    ap.add_argument("--list", action="store_true", help="print the candidates and exit")
    ap.add_argument("--rounds", type=int, default=0,
                    help="interleaved timing rounds per case (median, IQR; 0: kernels.RESHAPE_ROUNDS)")
    args = ap.parse_args(argv)
    if args.list:
        for n, d in CANDIDATES.items():
            print(f"{n:16} {d or '(production)'}")
        return 0
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidates {unknown}; --list shows them")

    import torch

    if not torch.cuda.is_available():
        print("bench/reshape_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(BENCH_DIR))
    import kernels as kb
    from timing import time_graphs

    args.rounds = args.rounds or kb.RESHAPE_ROUNDS

    from uacompile.targets.cuda import api
    from uacompile.nvcc import default_arch

    t_start = time.perf_counter()
    torch.manual_seed(0)
    ops = [kb.reshape_op(*c) for c in kb.RESHAPE_CASES]
    libs, failed = build_all(names, ops, default_arch())
    build_s = time.perf_counter() - t_start
    print(f"[sweep] built {len(libs)} of {len(names)} candidates in {build_s:.1f} s", flush=True)

    ctx = kb.BenchContext(gpu=torch.cuda.get_device_name())
    kb.spin_up_clocks()  # the GPU idled through the builds
    kb.copy_ceiling(ctx)
    rows, shapes = [], []
    for case_args in kb.RESHAPE_CASES:
        t0 = time.perf_counter()
        case = kb.reshape_case(*case_args)
        shapes.append(case.shape)
        check_slots = case.args["slot_mapping"].clone()
        check_slots[::5] = -1
        expected = expected_outputs(case, check_slots)
        special = special_rows(case) if case.op.quantized else None
        first: dict = {}
        kerns = {}
        for n in names:  # correctness first, every candidate; only those that launch are timed
            if n not in libs:
                rows.append(dict(shape=case.shape, candidate=n, design=CANDIDATES[n], check=failed[n]))
                continue
            kern = api.CudaKernel(candidate_kernel(n, case.op), library=libs[n])
            try:
                status = check(kern, case, check_slots, expected, first, special)
            except RuntimeError as e:  # a candidate that cannot launch must not lose the others' rows
                print(f"[sweep] {case.shape} {n}: {e}", flush=True)
                rows.append(dict(shape=case.shape, candidate=n, design=CANDIDATES[n], check=f"launch failed: {e}"))
                continue
            kerns[n] = (kern, status)
        # all candidates of the case in one interleaved timing (drift hits them alike)
        timings = time_graphs({n: (lambda kern=kern: kern(**case.args)) for n, (kern, _) in kerns.items()},
                                 calls=case.calls, rounds=args.rounds)
        for n, (kern, status) in kerns.items():
            t = timings[n]
            gbps = case.nbytes / t.ms / 1e6
            rows.append(dict(shape=case.shape, candidate=n, design=CANDIDATES[n], gbps=round(gbps, 1),
                             pct_ceiling=round(100 * gbps / ctx.copy_gbps, 2), us=round(t.ms * 1e3, 2),
                             spread_pct=round(t.spread_pct, 2), samples_us=[round(x * 1e3, 3) for x in t.samples],
                             check=status))
        print(f"[sweep] {case.shape}: {time.perf_counter() - t0:.1f} s", flush=True)
        del case, expected, first, special, kerns, timings
        torch.cuda.empty_cache()

    print(f"\n# reshape_and_cache sweep, {ctx.gpu}, copy ceiling {ctx.copy_gbps:.0f} GB/s (GB/s = bytes read + "
          f"written; % of the ceiling; median us of {args.rounds} interleaved graph replays; ± half the IQR in %)\n")
    print(table(rows, names, shapes))
    for r in rows:
        if r["check"] != "ok":
            print(f"! {r['candidate']} {short(r['shape'])}: {r['check']}")
    ranked = [n for n in names if n in libs and all(r["check"] == "ok" for r in rows if r["candidate"] == n)]
    big = {n: min(r["pct_ceiling"] for r in rows if r["candidate"] == n and r["shape"].startswith("T=32768")) for n in ranked}
    for s in shapes:  # the column's best against the production choice
        col = {r["candidate"]: r["pct_ceiling"] for r in rows if r["shape"] == s and r.get("check") == "ok"}
        if col:
            best = max(col, key=col.get)
            print(f"best for {short(s)}: {best} {col[best]:.1f}% (default {col.get('default', float('nan')):.1f}%)")
    if big:
        best = max(big, key=big.get)
        print(f"\nbest by the smallest % over the T=32768 rows: {best} ({CANDIDATES[best] or 'production'}): {big[best]:.1f}%")
    print(f"[sweep] total {time.perf_counter() - t_start:.1f} s")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "reshape_sweep.json").write_text(json.dumps(dict(
            gpu=ctx.gpu, torch=torch.__version__, copy_ceiling_gbps=round(ctx.copy_gbps, 1), build_seconds=round(build_s, 1),
            candidates={n: CANDIDATES[n] for n in names}, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
