"""Kernel benchmark, run on the device: prints one table and writes kernels-<date>.json / .md.

    PYTHONPATH=... python3 bench/kernels.py --out bench/results [--only attention,cache,swap,build] [--quick]
                                            [--tvm-cuda-dir DIR]

Rows are dicts {op, shape, impl, gbps | tflops | ms, note?}. Bandwidth counts the bytes a
kernel must move (each input read once, each output written once) over its median time
(CUDA events, warmed up; reshape_and_cache rows and small shapes are timed as CUDA-graph
replays of many calls, the impls of a row group interleaved round by round: bench/timing.py).
Cache ops are compared with the device copy ceiling (a 1 GiB torch copy_) and torch index
copies; swap with one pinned cudaMemcpy of the same bytes and with per-block copies (vLLM's
swap_blocks does one memcpy per block). Build rows: nvcc cold build and cached load (a
copy of the cache at a new path: key + render + dlopen) per variant. Attention rows come
from bench/attention_bench.py (`attention_rows`: ours, torch SDPA and FlashInfer timed
interleaved per shape); tvm-cuda rows from bench/tvm_cuda_bench.py (TVM's CUDA attention, default and tuned
schedule, beside the Jinja kernel); plan-overhead rows from bench/plan_overhead.py (the CPU cost of one layer's
attention.run() call from Python, and of paged_attention(), mean us over 1000 eager calls; target <= 15 us).
The report is rewritten after every section, so a run cut short keeps its rows.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from uacompile import ir

sys.path.insert(0, str(Path(__file__).parent))
import attention_bench  # noqa: E402
import plan_overhead  # noqa: E402
import tvm_cuda_bench  # noqa: E402
from timing import copy_ceiling_gbps, time_eager, time_graphs  # noqa: E402
from attention_bench import spin_up_clocks  # noqa: E402

GB = 1e9


@dataclass
class BenchContext:
    """What a rows function gets: the measured ceilings and the run's options."""

    copy_gbps: float = 0.0  # device-to-device copy ceiling, bytes read + written
    quick: bool = False
    gpu: str = ""
    tvm_cuda_dir: str | None = None  # prebuilt TVM-CUDA kernels (--tvm-cuda-dir) for a machine without TVM
    notes: list = field(default_factory=list)


def row(op, shape, impl, **metric) -> dict:
    return dict(op=op, shape=shape, impl=impl, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in metric.items()})


def copy_ceiling(ctx: BenchContext) -> list[dict]:
    ctx.copy_gbps, ms = copy_ceiling_gbps()
    return [row("copy", "1 GiB", "torch copy_ (ceiling)", gbps=ctx.copy_gbps, ms=ms)]


# ---------------------------------------------------------------- cache ops
def _kv(shape, dtype: str, gen: torch.Generator | None = None) -> torch.Tensor:
    x = torch.randn(shape, device="cuda", generator=gen)
    if dtype == "int8":
        return (x * 40).clamp(-127, 127).to(torch.int8)
    return x.to(ir.torch_dtype(dtype))


# the tracked reshape_and_cache rows: (num_tokens, dtype, kv_dtype, rope) at Hkv=8, D=128, P=16
RESHAPE_CASES = [(32768, "fp16", "fp16", False), (32768, "bf16", "int8", False), (32768, "bf16", "fp8_e4m3", False),
                 (32768, "bf16", "bf16", True), (256, "bf16", "bf16", False)]
# reshape_and_cache timing (time_graphs): calls per graph replay and interleaved rounds. A big
# row's replay is ~1.5 ms (20 calls of 60-80 us); 25 rounds put the median's noise well under
# a point of the ceiling (the spread column shows it)
RESHAPE_CALLS = {"big": 20, "small": 200}
RESHAPE_ROUNDS = 25


@dataclass
class ReshapeCase:
    op: ir.ReshapeAndCache
    args: dict  # CUDA tensors named as in op.params(): random k, v (and positions); caches full of data
    nbytes: int  # bytes read (k, v, slots) + written (cache rows, scales)
    shape: str

    @property
    def small(self) -> bool:  # launch-bound: more calls per graph replay
        return self.args["k"].shape[0] <= 4096

    @property
    def calls(self) -> int:
        return RESHAPE_CALLS["small" if self.small else "big"]


def reshape_op(T: int, dt_in: str, dt_kv: str, rope: bool, Hkv: int = 8, D: int = 128, P: int = 16) -> ir.ReshapeAndCache:
    """The op of a RESHAPE_CASES row (T is the batch: the op does not depend on it)."""
    return ir.ReshapeAndCache(Hkv, D, P, dtype=dt_in, kv_dtype=dt_kv, rope=rope)


def reshape_case(T: int, dt_in: str, dt_kv: str, rope: bool, Hkv: int = 8, D: int = 128, P: int = 16,
                 seed: int = 0) -> ReshapeCase:
    """T distinct random slots in a cache of twice the pages needed (no -1: every row is written).
    The data and the slot permutation come from `seed` alone (the same rows and scatter pattern in
    every run: a fresh permutation per run was one source of run-to-run spread)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = T // P * 2
    op = reshape_op(T, dt_in, dt_kv, rope, Hkv, D, P)
    args = dict(k=_kv((T, Hkv, D), dt_in, gen), v=_kv((T, Hkv, D), dt_in, gen),
                slot_mapping=torch.randperm(num_pages * P, device="cuda", generator=gen)[:T].contiguous(),
                k_cache=_kv((num_pages, P, Hkv, D), dt_kv, gen), v_cache=_kv((num_pages, P, Hkv, D), dt_kv, gen))
    if op.quantized:
        args.update(k_scale=torch.ones(num_pages, P, Hkv, device="cuda"), v_scale=torch.ones(num_pages, P, Hkv, device="cuda"))
    if rope:
        args["positions"] = torch.randint(0, 32768, (T,), device="cuda", generator=gen)
    out_item = torch.empty((), dtype=ir.torch_dtype(dt_kv)).element_size()
    nbytes = 2 * T * Hkv * D * (args["k"].element_size() + out_item) + T * 8 + (2 * T * Hkv * 4 if op.quantized else 0)
    shape = f"T={T} Hkv={Hkv} D={D} P={P} {dt_in}->{dt_kv}{' +rope' if rope else ''}"
    return ReshapeCase(op, args, nbytes, shape)


def reshape_rows(ctx: BenchContext) -> list[dict]:
    """Ours and torch's index copies of each case, timed interleaved (time_graphs)."""
    from uacompile.targets.cuda import api

    rows = []
    cases = RESHAPE_CASES[:1] + RESHAPE_CASES[-1:] if ctx.quick else RESHAPE_CASES
    for case_args in cases:
        case = reshape_case(*case_args)
        a, Hkv, D = case.args, case.op.num_kv_heads, case.op.head_dim
        kern = api.kernel(case.op)
        fns = {"uacompile": lambda: kern(**a)}
        if not case.op.quantized and not case.op.rope:  # torch's scatter of the same rows (no -1 handling, no fusion)
            kf, vf = a["k_cache"].view(-1, Hkv, D), a["v_cache"].view(-1, Hkv, D)
            fns["torch index_copy_ x2"] = lambda: (kf.index_copy_(0, a["slot_mapping"], a["k"]),
                                                   vf.index_copy_(0, a["slot_mapping"], a["v"]))
        for impl, t in time_graphs(fns, calls=case.calls, rounds=RESHAPE_ROUNDS).items():
            rows.append(row("reshape_and_cache", case.shape, impl, gbps=case.nbytes / t.ms / 1e6, ms=t.ms,
                            pct_ceiling=100 * case.nbytes / t.ms / 1e6 / ctx.copy_gbps, spread_pct=t.spread_pct,
                            note=f"IQR {t.spread_pct:.1f}% of {len(t.samples)} graph replays"))
        del case, a, fns
    return rows


def copy_blocks_rows(ctx: BenchContext) -> list[dict]:
    from uacompile.targets.cuda import api

    rows = []
    for L, pages, pairs, P, Hkv, D, dt_kv in [(32, 2048, 256, 16, 8, 128, "bf16"), (32, 512, 64, 256, 8, 128, "int8")]:
        kv = _kv((L, 2, pages, P, Hkv, D), dt_kv)
        quant = dt_kv in ir.QUANT_DTYPES
        scales = torch.rand(L, 2, pages, P, Hkv, device="cuda") if quant else None
        perm = torch.randperm(pages, device="cuda")
        mapping = torch.stack([perm[:pairs], perm[pairs:2 * pairs]], 1).contiguous()
        page_bytes = P * Hkv * D * kv.element_size() + (P * Hkv * 4 if quant else 0)
        nbytes = 2 * L * 2 * pairs * page_bytes  # read + write
        shape = f"L={L} pairs={pairs} P={P} Hkv={Hkv} D={D} {dt_kv}"
        ms = time_eager(lambda: api.copy_blocks(kv, mapping, scales), iters=10)
        rows.append(row("copy_blocks", shape, "uacompile (1 launch)", gbps=nbytes / ms / 1e6, ms=ms,
                        pct_ceiling=100 * nbytes / ms / 1e6 / ctx.copy_gbps))
        src, dst = mapping[:, 0], mapping[:, 1]

        def torch_copy():
            kv[:, :, dst] = kv[:, :, src]
            if quant:
                scales[:, :, dst] = scales[:, :, src]

        ms = time_eager(torch_copy, iters=10)
        rows.append(row("copy_blocks", shape, "torch kv[:,:,dst] = kv[:,:,src]", gbps=nbytes / ms / 1e6, ms=ms,
                        pct_ceiling=100 * nbytes / ms / 1e6 / ctx.copy_gbps))
        del kv, scales
    return rows


def swap_rows(ctx: BenchContext) -> list[dict]:
    from uacompile.targets.cuda import api

    rows = []
    L, pairs, P, Hkv, D = 32, 128, 16, 8, 128
    dev_pages, host_pages = 512, 256
    dev = _kv((L, 2, dev_pages, P, Hkv, D), "bf16")
    host = torch.empty((L, 2, host_pages, P, Hkv, D), dtype=torch.bfloat16).pin_memory()
    host.copy_(dev[:, :, :host_pages].flip(2))  # random data, filled by DMA (a CPU fill of 0.5 GB is slow)
    m = torch.stack([torch.randperm(dev_pages)[:pairs], torch.randperm(host_pages)[:pairs]], 1).cuda()
    m_in = m.flip(1).contiguous()
    nbytes = L * 2 * pairs * P * Hkv * D * 2  # bytes over PCIe, one way
    shape = f"L={L} pairs={pairs} P={P} Hkv={Hkv} D={D} bf16 ({nbytes / 2**20:.0f} MiB)"
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    for direction, ours, memcpy in [
        ("d2h", lambda: api.swap_blocks(dev, host, m), lambda: flat_host.copy_(flat_dev, non_blocking=True)),
        ("h2d", lambda: api.swap_blocks(host, dev, m_in), lambda: flat_dev.copy_(flat_host, non_blocking=True)),
    ]:
        ms_memcpy = time_eager(memcpy, iters=5)
        ref_gbps = nbytes / ms_memcpy / 1e6
        rows.append(row("swap_blocks", f"{direction} {shape}", "pinned cudaMemcpy, contiguous (ceiling)", gbps=ref_gbps, ms=ms_memcpy))
        ms = time_eager(ours, iters=5)
        rows.append(row("swap_blocks", f"{direction} {shape}", "uacompile (1 launch, zero-copy)",
                        gbps=nbytes / ms / 1e6, ms=ms, pct_memcpy=100 * ms_memcpy / ms))
    # vLLM's swap_blocks: one cudaMemcpyAsync per block and layer (timed with Python's launches)
    src_idx, dst_idx = m[:, 0].tolist(), m[:, 1].tolist()

    def per_block():
        for layer in range(L):
            for kv in range(2):
                for s, d in zip(src_idx, dst_idx):
                    host[layer, kv, d].copy_(dev[layer, kv, s], non_blocking=True)

    ms = time_eager(per_block, iters=1, repeats=3, warmup=1)
    rows.append(row("swap_blocks", f"d2h {shape}", "torch copy_ per block (vLLM-style)", gbps=nbytes / ms / 1e6, ms=ms))
    del dev, host, flat_dev, flat_host
    return rows


# ---------------------------------------------------------------- build times
def build_variants() -> list:
    R, C, S, M = ir.ReshapeAndCache, ir.CopyBlocks, ir.SwapBlocks, ir.MergeState
    ops = [R(8, 128, dtype="bf16", kv_dtype="bf16"), R(8, 128, dtype="bf16", kv_dtype="fp8_e4m3", rope=True),
           C(8, 128, kv_dtype="int8"), S(8, 128, kv_dtype="bf16"), M(32, 128, 8, out_dtype="bf16", return_lse=True)]
    try:
        from uacompile.targets.cuda.config import AttentionConfig
    except ImportError:
        return ops
    PA = ir.PagedAttention
    # paged attention as plan() builds it: the mixed kernel with the Hopper item queue (prefill), the decode-only
    # kernel with 4 fused splits (8x16384 decode), and fp8 KV
    ops += [ir.Kernel(PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig(item_queue=True)),
            ir.Kernel(PA(32, 8, 128, 16, "bf16", "bf16"), AttentionConfig(num_splits=4, fused_merge=True, decode_only=True)),
            ir.Kernel(PA(32, 8, 128, 16, "bf16", "fp8_e4m3"), AttentionConfig())]
    return ops


def build_rows(ctx: BenchContext) -> list[dict]:
    from uacompile import nvcc
    from uacompile.targets.cuda import build as build_mod, loader

    rows = []
    nvcc.toolchain()  # nvcc --version once per process, outside the timings
    old = os.environ.get("UACOMPILE_CACHE_DIR")
    cold_dir, warm_dir = Path(tempfile.mkdtemp(prefix="ua-cold-")), Path(tempfile.mkdtemp(prefix="ua-warm-"))
    try:
        for op in build_variants():
            os.environ["UACOMPILE_CACHE_DIR"] = str(cold_dir)
            try:
                res = build_mod.build(op)
            except Exception as e:  # noqa: BLE001 - a failed variant is a row, not the end of the run
                rows.append(row("build", op.symbol(), "nvcc cold build", ms=-1.0, note=f"FAILED: {str(e)[:120]}"))
                continue
            shutil.rmtree(warm_dir, ignore_errors=True)
            shutil.copytree(cold_dir, warm_dir)
            os.environ["UACOMPILE_CACHE_DIR"] = str(warm_dir)
            t0 = time.perf_counter()
            hit = build_mod.build(op)
            lib = loader.load_library(hit.path, [op], hit)
            lib.function(op)
            load_ms = (time.perf_counter() - t0) * 1e3
            name = f"{op.kind} {op.key()}"
            rows.append(row("build", name, "nvcc cold build", ms=res.seconds * 1e3, note=str(op)[:150]))
            rows.append(row("build", name, "cached load (key+render+dlopen)", ms=load_ms, hit=hit.hit))
            shutil.rmtree(cold_dir, ignore_errors=True)
            cold_dir.mkdir()
    finally:
        if old is None:
            os.environ.pop("UACOMPILE_CACHE_DIR", None)
        else:
            os.environ["UACOMPILE_CACHE_DIR"] = old
        shutil.rmtree(cold_dir, ignore_errors=True)
        shutil.rmtree(warm_dir, ignore_errors=True)
    return rows


def attention_rows(ctx: BenchContext) -> list[dict]:
    """Ours, torch SDPA and FlashInfer (unless quick or UA_BENCH_FLASHINFER=0) per shape, interleaved."""
    return attention_bench.attention_rows(ctx)


def tvm_cuda_rows(ctx: BenchContext) -> list[dict]:
    """TVM's CUDA attention (default and tuned schedule) beside the Jinja kernel per shape (bench/tvm_cuda_bench.py)."""
    return tvm_cuda_bench.tvm_cuda_rows(ctx)


def overhead_rows(ctx: BenchContext) -> list[dict]:
    """The CPU cost of attention.run(plan, ...) and paged_attention() a call (bench/plan_overhead.py)."""
    return plan_overhead.overhead_rows(ctx)


# attention first: after the cache section its first decode group read ~10% slow (SDPA beside it too)
SECTIONS = {"attention": attention_rows, "tvm-cuda": tvm_cuda_rows, "overhead": overhead_rows,
            "cache": lambda c: reshape_rows(c) + copy_blocks_rows(c), "swap": swap_rows, "build": build_rows}


# ---------------------------------------------------------------- report
def table(rows: list[dict]) -> str:
    head = "| op | shape | impl | GB/s | TFLOP/s | ms | vs ceiling | note |"
    lines = [head, "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        pct = r.get("pct_ceiling", r.get("pct_memcpy"))
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["op"], r["shape"], r["impl"], f"{r['gbps']:.0f}" if "gbps" in r else "",
            f"{r['tflops']:.0f}" if "tflops" in r else "", f"{r['ms']:.4g}" if "ms" in r else "",
            f"{pct:.0f}%" if pct is not None else "", r.get("note", "")))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {list(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--tvm-cuda-dir", default=None, help="folder of prebuilt TVM-CUDA kernels for the tvm-cuda "
                                                         "section (bench/prebuild_tvm_cuda.sh --tune N): no TVM here")
    ap.add_argument("--rerender", metavar="JSON", help="rewrite the report of a run's JSON into --out (no GPU)")
    args = ap.parse_args(argv)
    if args.rerender:
        print(write_meta(Path(args.out), json.loads(Path(args.rerender).read_text())))
        return 0
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    np.random.seed(0)
    torch.manual_seed(0)
    ctx = BenchContext(quick=args.quick, gpu=torch.cuda.get_device_name(), tvm_cuda_dir=args.tvm_cuda_dir)
    rows = copy_ceiling(ctx)
    names = args.only.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            spin_up_clocks()
            rows += SECTIONS[name](ctx)
        except Exception as e:  # noqa: BLE001 - keep the other sections' rows
            import traceback

            traceback.print_exc()
            ctx.notes.append(f"section {name} failed: {type(e).__name__}: {e}")
        print(f"[bench] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        # the report so far, after every section: a run cut short still leaves its rows
        text = write_report(Path(args.out), ctx, rows, pending=names[i + 1:])
    print(text)
    return 0


# the targets, checked from the rows themselves (a target is met by a benchmark, never a test)
DECODE_TARGET_GBPS = 3800.0
CACHE_TARGET_PCT = 85.0
SWAP_TARGET_PCT = 80.0
COLD_BUILD_TARGET_MS = 10_000.0
CACHED_LOAD_TARGET_MS = 50.0
RUN_TARGET_US = plan_overhead.RUN_TARGET_US  # attention.run() CPU cost a call, eager from Python
LAUNCH_BOUND_MS = 0.01  # rows faster than this measure launch cost, not bandwidth: not target rows


def target_checks(rows: list[dict]) -> list[dict]:
    """One check a target row: {target, shape, measured, goal, ratio, met, peers}. Decode and
    prefill take the production (auto) rows and name the peers' numbers of the same shape."""
    by = {(r["op"], r["shape"], r["impl"]): r for r in rows}
    checks = []

    def add(target, shape, measured, goal, higher_is_better=True, peers=""):
        ratio = measured / goal if higher_is_better else goal / measured
        checks.append(dict(target=target, shape=shape, measured=round(measured, 2), goal=goal,
                           ratio=round(ratio, 3), met=ratio >= 1.0, peers=peers))

    def peers_of(op, shape, metric, impls):
        found = [(i, by[(op, shape, i)][metric]) for i in impls if (op, shape, i) in by]
        return ", ".join(f"{i} {v:.0f}" for i, v in found)

    for r in rows:
        if r["op"] == "decode" and r["impl"].startswith("ua splits=") and r["impl"].endswith("(auto)"):
            add("decode GB/s >= 3800", r["shape"], r["gbps"], DECODE_TARGET_GBPS,
                peers=peers_of("decode", r["shape"], "gbps", ["FlashInfer tensor-core", "FlashInfer CUDA-core",
                                                               "torch SDPA contiguous"]))
        elif r["op"] == "prefill" and r["impl"] == "ua":
            sdpa = by.get(("prefill", r["shape"], "torch SDPA contiguous"))
            if sdpa:
                add("prefill TFLOP/s >= torch SDPA", r["shape"], r["tflops"], sdpa["tflops"],
                    peers=peers_of("prefill", r["shape"], "tflops", ["torch SDPA contiguous", "FlashInfer paged"]))
        elif r["op"] in ("reshape_and_cache", "copy_blocks") and r["impl"].startswith("uacompile"):
            if r["ms"] >= LAUNCH_BOUND_MS:
                add(f"{r['op']} % of copy ceiling >= 85", r["shape"], r["pct_ceiling"], CACHE_TARGET_PCT)
        elif r["op"] == "swap_blocks" and "pct_memcpy" in r:
            add("swap % of pinned memcpy >= 80", r["shape"], r["pct_memcpy"], SWAP_TARGET_PCT)
        elif r["op"] == "plan overhead" and r["impl"].startswith("attention.run"):
            add(f"attention.run() CPU us <= {RUN_TARGET_US:g}", r["shape"], r["us"], RUN_TARGET_US,
                higher_is_better=False, peers=peers_of("plan overhead", r["shape"], "us",
                                                       ["paged_attention(), kept Workspace"]))
    for impl, target, goal in (("nvcc cold build", "cold build ms <= 10000", COLD_BUILD_TARGET_MS),
                               ("cached load", "cached load ms <= 50", CACHED_LOAD_TARGET_MS)):
        times = [r["ms"] for r in rows if r["op"] == "build" and r["impl"].startswith(impl)]
        if times:  # the slowest variant decides
            add(target, f"slowest of {len(times)} variants", max(times), goal, higher_is_better=False)
    return checks


def targets_table(checks: list[dict]) -> str:
    lines = ["| target | shape | measured | goal | ratio | met | peers, same run |", "|---|---|---:|---:|---:|---|---|"]
    for c in checks:
        lines.append(f"| {c['target']} | {c['shape']} | {c['measured']:g} | {c['goal']:g} | {c['ratio']:.2f} | "
                     f"{'yes' if c['met'] else '**no**'} | {c['peers']} |")
    met = sum(c["met"] for c in checks)
    return "\n".join(lines) + f"\n\n{met} of {len(checks)} target rows met."


def write_report(out: Path, ctx: BenchContext, rows: list[dict], pending: list[str]) -> str:
    """kernels-<date>.json and .md under out; a partial report names the sections still to run."""
    notes = ctx.notes + ([f"partial: sections {', '.join(pending)} not run yet"] if pending else [])
    meta = dict(gpu=ctx.gpu, date=dt.date.today().isoformat(), torch=torch.__version__,
                copy_ceiling_gbps=round(ctx.copy_gbps, 1), notes=notes, rows=rows)
    return write_meta(out, meta)


def write_meta(out: Path, meta: dict) -> str:
    """The report of one run's meta (gpu, date, notes, rows): its JSON (with the target checks) and
    its markdown table; `--rerender` rebuilds both from a committed JSON."""
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, targets=target_checks(meta["rows"]))
    (out / f"kernels-{meta['date']}.json").write_text(json.dumps(meta, indent=1))
    chart = draw_chart(meta, out / f"kernels-{meta['date']}.png")
    text = (f"# Kernel benchmark, {meta['gpu']}, {meta['date']}\n\n"
            + (f"![ours against the peers and the targets]({chart.name})\n\n" if chart else "")
            + f"{table(meta['rows'])}\n"
            + "".join(f"\n- {n}" for n in meta["notes"]) + f"\n\n## Targets\n\n{targets_table(meta['targets'])}\n")
    (out / f"kernels-{meta['date']}.md").write_text(text)
    return text



def draw_chart(meta: dict, png: Path) -> Path | None:
    """bench/chart.py's picture of the run, where matplotlib is installed (a dev dependency; the
    device machine lacks it, so there `--rerender` draws it afterwards); None where it is not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    import chart

    return chart.draw(meta, png)

if __name__ == "__main__":
    sys.exit(main())
