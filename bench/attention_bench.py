"""Attention rows of the kernel benchmark (run on the device; bench/kernels.py calls attention_rows).

    python bench/attention_bench.py [--quick] [--no-flashinfer] [--json PATH]

Shapes are ANCHORS.md's: bf16, Hq 32, Hkv 8, D 128, page 16, pages in random order.
Decode: effective GB/s = bytes of K and V read / kernel time. Prefill: causal TFLOP/s =
4 * B * L^2 / 2 * Hq * D / time. Each timing is the median of several replays of a CUDA
graph holding many calls; inputs rotate over several copies when one copy would fit in L2.
Every "ours" row is also checked against torch SDPA on the same data (max abs diff). Ours is what a
serving step runs: attention.plan() once for the shapes (the split count given or the built-in rule), then
attention.run() every call (the timed graphs hold run() only).
FlashInfer 0.2.14 is a peer when its sdist is in .peers/ (set up by JIT: slow first call). Every
implementation of a shape is timed in one interleaved timing (bench/timing.py), peers included.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from uacompile import ir
from uacompile.targets.cuda import api, attention
from uacompile.targets.cuda import layout as cuda_layout
from uacompile.targets.cuda.plan import choose_config, device_arch, device_sms

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from timing import copy_ceiling_gbps, time_graphs, time_ms  # noqa: E402

HQ, HKV, D, P = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(8, 16384), (32, 4096), (128, 1024), (1, 32768)]
PREFILL_SHAPES = [(8, 4096), (2, 16384)]
L2_BYTES = 60 * 2**20
ROUNDS = 11  # interleaved rounds per row group (timing.time_graphs)
ROOT = Path(__file__).resolve().parents[1]


def op_of(**kw) -> ir.PagedAttention:
    return ir.PagedAttention(HQ, HKV, D, P, "bf16", "bf16", **kw)


def launched_kernel(op: ir.PagedAttention, num_tokens: int, num_seqs: int, max_kv_len: int,
                    num_splits: int | None = None, fused_merge: bool = True,
                    wg_tile: tuple[int, int] | None = None) -> ir.Kernel:
    """The kernel attention.plan() launches for these shapes on device 0 by the built-in rule (to build ahead of the
    timings); wg_tile: (K/V positions, TMA stages) of its Hopper prefill path instead of the built-in one
    (AttentionConfig.wg_tile; a config without that path is left as it is)."""
    arch = device_arch(0)
    config = choose_config(op, num_tokens, num_seqs, max_kv_len, device_sms(0), arch, num_splits, fused_merge)
    if wg_tile is not None and cuda_layout.uses_wgmma(op, config, arch):
        config = config.replace(wg_tile=wg_tile)
    return ir.Kernel(op, config)


def plan_for(op: ir.PagedAttention, b, wg_tile: tuple[int, int] | None = None, **kw) -> attention.Plan:
    """attention.plan() for a batch's shapes (b: a PagedBatch, or args of one with q and page_table); kw: plan()'s
    num_splits, fused_merge, config, workspace, kernel_of. wg_tile: the Hopper prefill tile (AttentionConfig.wg_tile)
    on kw's config, or else on the config launched_kernel picks (the built-in rule, no tuning database)."""
    args = b if isinstance(b, dict) else b.args()
    shapes = args["q"].shape[0], args["page_table"].shape[0], args["page_table"].shape[1] * op.page_size
    if wg_tile is not None:
        config = kw.pop("config", None)
        if config is None:
            config = launched_kernel(op, *shapes, kw.pop("num_splits", None), kw.pop("fused_merge", True), wg_tile).config
        elif cuda_layout.uses_wgmma(op, config, device_arch(0)):
            config = config.replace(wg_tile=wg_tile)
        kw["config"] = config
    return attention.plan(op, *shapes, **kw)


class PagedBatch:
    """One batch of sequences in a paged cache (random page order) plus what peers need. The head
    geometry (Hq, Hkv, D, page size) and dtype default to ANCHORS.md's (bench/variant_sweep.py varies them)."""

    def __init__(self, B: int, L: int, q_len: int, gen: torch.Generator, geometry=(HQ, HKV, D, P), dtype=DTYPE):
        self.hq, self.hkv, self.d, self.p = geometry
        pages_per_seq = L // self.p
        self.B, self.L, self.q_len = B, L, q_len
        num_pages = B * pages_per_seq
        kv_shape = (num_pages, self.p, self.hkv, self.d)
        self.k_cache = torch.randn(kv_shape, generator=gen, device="cuda", dtype=dtype)
        self.v_cache = torch.randn(kv_shape, generator=gen, device="cuda", dtype=dtype)
        perm = torch.randperm(num_pages, generator=gen, device="cuda").to(torch.int32)
        self.page_table = perm.view(B, pages_per_seq).contiguous()
        T = B * q_len
        self.q = torch.randn((T, self.hq, self.d), generator=gen, device="cuda", dtype=dtype)
        self.token_seq = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(q_len)
        pos = torch.arange(L - q_len + 1, L + 1, device="cuda", dtype=torch.int32)
        self.token_kv_len = pos.repeat(B).contiguous()
        self.out = torch.empty_like(self.q)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.B * self.L * self.hkv * self.d * self.k_cache.element_size()

    def args(self):
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, token_seq=self.token_seq,
                    page_table=self.page_table, token_kv_len=self.token_kv_len)

    def contiguous_kv(self):
        """[B, Hkv, L, D] K and V gathered from the pages (the peers' contiguous layout)."""
        idx = self.page_table.long()
        k = self.k_cache[idx].view(self.B, self.L, self.hkv, self.d).transpose(1, 2).contiguous()
        v = self.v_cache[idx].view(self.B, self.L, self.hkv, self.d).transpose(1, 2).contiguous()
        return k, v

    def q_bhld(self):
        return self.q.view(self.B, self.q_len, self.hq, self.d).transpose(1, 2)


def decode_batches(B: int, L: int, gen: torch.Generator) -> list[PagedBatch]:
    """Copies of a B x L decode batch, as many (at most 4) as their K/V need to fill L2 four times
    over, so that calls rotating through them read K/V from DRAM."""
    copies = max(1, min(4, -(-4 * L2_BYTES // (2 * B * L * HKV * D * 2))))
    return [PagedBatch(B, L, 1, gen) for _ in range(copies)]


def spin_up_clocks(seconds: float = 0.5) -> None:
    """Busy the GPU a moment before timing: it idles at 345 MHz while builds and JIT run on the CPU.
    Matmuls and a 1 GiB copy in turn (SM and memory clocks): after kernels.py's cache section the
    first decode group (SDPA too) read ~10% slow after a 0.3 s matmul-only spin."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
            dst.copy_(src)
        torch.cuda.synchronize()


def sdpa(q, k, v, causal: bool):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


COPY_GBPS = [0.0]  # the run's copy ceiling (bench/kernels.py measures it; else attention_rows does)


def row(op, shape, impl, diff=None, **vals):
    r = dict(op=op, shape=shape, impl=impl, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in vals.items()})
    if "gbps" in r and op == "decode" and COPY_GBPS[0]:
        r["pct_ceiling"] = round(100 * r["gbps"] / COPY_GBPS[0], 1)
    if diff is not None:
        r["note"] = f"max abs diff vs torch SDPA {diff:.3g}"
    return r


def decode_rows(gen, splits_sweep=(), unified=False, peers=None) -> list[dict]:
    """Ours at each split count, SDPA on contiguous KV and the peers' decode ({name: batch -> call})
    in one interleaved timing a shape; then gather + SDPA and unified_masked on their own."""
    rows = []
    op = op_of()
    for B, L in DECODE_SHAPES:
        batches = decode_batches(B, L, gen)
        b0 = batches[0]
        shape = f"{B}x{L}"
        k, v = b0.contiguous_kv()
        want = sdpa(b0.q_bhld(), k, v, False).transpose(1, 2).reshape(b0.q.shape)
        auto = plan_for(op, b0).num_splits
        kc = [b.contiguous_kv() for b in batches]
        # ours at each split count and SDPA in one interleaved timing: the ratio is drift-free
        plans = {s: plan_for(op, b0, num_splits=s) for s in dict.fromkeys([auto, *splits_sweep]) if s == 1 or L // s >= 64}
        fns = {s: [lambda b=b, p=p: attention.run(p, **b.args(), out=b.out) for b in batches] for s, p in plans.items()}
        fns["sdpa"] = [lambda b=b, kv=kv: sdpa(b.q_bhld(), *kv, False) for b, kv in zip(batches, kc)]
        fns.update({name: make(b0) for name, make in (peers or {}).get("decode", {}).items()})
        timings = time_graphs(fns, calls=10, rounds=ROUNDS)
        for splits in [s for s in fns if isinstance(s, int)]:
            b0.out.fill_(float("nan"))
            attention.run(plans[splits], **b0.args(), out=b0.out)
            diff = (b0.out.float() - want.float()).abs().max().item()
            impl = f"ua splits={splits}" + (" (auto)" if splits == auto else "")
            ms = timings[splits].ms
            rows.append(row("decode", shape, impl, ms=ms, gbps=b0.kv_bytes / ms / 1e6, diff=diff))
        ms = timings["sdpa"].ms
        rows.append(row("decode", shape, "torch SDPA contiguous", ms=ms, gbps=b0.kv_bytes / ms / 1e6))
        for name in (peers or {}).get("decode", {}):
            rows.append(row("decode", shape, name, ms=timings[name].ms, gbps=b0.kv_bytes / timings[name].ms / 1e6))
        del kc, k, v

        def gather_sdpa(b):
            kk, vv = b.contiguous_kv()
            return sdpa(b.q_bhld(), kk, vv, False)

        ms = time_ms([lambda b=b: gather_sdpa(b) for b in batches], calls_per_fn=3)
        rows.append(row("decode", shape, "gather + SDPA", ms=ms, gbps=b0.kv_bytes / ms / 1e6))
        if unified and (B, L) == (8, 16384):
        # llama.cpp-style unified buffer: every query scans all 8 sequences' cells
            up = plan_for(op_of(variant="unified_masked"), b0)
            ms = time_ms([lambda: attention.run(up, **b0.args(), out=b0.out)], calls_per_fn=2)
            diff = (b0.out.float() - want.float()).abs().max().item()
            rows.append(row("decode", shape, "unified_masked", ms=ms, gbps=b0.kv_bytes / ms / 1e6, diff=diff))
        del batches, b0
        torch.cuda.empty_cache()
    return rows


def prefill_rows(gen, shapes=PREFILL_SHAPES, peers=None) -> list[dict]:
    """Ours, SDPA on contiguous KV and the peers' prefill in one interleaved timing a shape."""
    rows = []
    op = op_of()
    for B, L in shapes:
        b = PagedBatch(B, L, L, gen)
        flops = 4 * B * L * L / 2 * HQ * D
        shape = f"{B}x{L} causal"
        k, v = b.contiguous_kv()
        want = sdpa(b.q_bhld(), k, v, True)
        p = plan_for(op, b, num_splits=1)
        fns = {"ua": lambda: attention.run(p, **b.args(), out=b.out),
               "sdpa": lambda: sdpa(b.q_bhld(), k, v, True)}
        fns.update({name: make(b) for name, make in (peers or {}).get("prefill", {}).items()})
        t = time_graphs(fns, calls=2, rounds=ROUNDS)
        b.out.fill_(float("nan"))
        attention.run(p, **b.args(), out=b.out)
        diff = (b.out.view(B, L, HQ, D).transpose(1, 2).float() - want.float()).abs().max().item()
        rows.append(row("prefill", shape, "ua", ms=t["ua"].ms, tflops=flops / t["ua"].ms / 1e9, diff=diff))
        rows.append(row("prefill", shape, "torch SDPA contiguous", ms=t["sdpa"].ms, tflops=flops / t["sdpa"].ms / 1e9))
        for name in (peers or {}).get("prefill", {}):
            rows.append(row("prefill", shape, name, ms=t[name].ms, tflops=flops / t[name].ms / 1e9))
        del b, k, v, want
        torch.cuda.empty_cache()
    return rows


def mixed_rows(gen, wg_tile: tuple[int, int] | None = None) -> list[dict]:
    """One ubatch: 2 prefill chunks of 2048 tokens at 8K context + 64 decodes at 4K (wg_tile: plan_for's Hopper
    prefill tile, default the built-in one)."""
    op = op_of()
    chunk = PagedBatch(2, 8192, 2048, gen)
    dec = PagedBatch(64, 4096, 1, gen)
    off = chunk.k_cache.shape[0]
    k_cache = torch.cat([chunk.k_cache, dec.k_cache])
    v_cache = torch.cat([chunk.v_cache, dec.v_cache])
    table = torch.full((66, 512), -1, dtype=torch.int32, device="cuda")
    table[:2] = chunk.page_table
    table[2:, :256] = dec.page_table + off
    args = dict(q=torch.cat([chunk.q, dec.q]), k_cache=k_cache, v_cache=v_cache,
                token_seq=torch.cat([chunk.token_seq, dec.token_seq + 2]), page_table=table,
                token_kv_len=torch.cat([chunk.token_kv_len, dec.token_kv_len]))
    out = torch.empty_like(args["q"])
    one, alone_p, alone_d = (plan_for(op, x, wg_tile=wg_tile) for x in (args, chunk, dec))
    t = time_graphs({"ua one launch": lambda: attention.run(one, **args, out=out),
                     "ua prefill part alone": lambda: attention.run(alone_p, **chunk.args(), out=chunk.out),
                     "ua decode part alone": lambda: attention.run(alone_d, **dec.args(), out=dec.out)},
                    calls=5, rounds=ROUNDS)
    return [row("mixed", "2x2048@8K + 64x1@4K", impl, ms=timing.ms) for impl, timing in t.items()]


# ---------------------------------------------------------------- FlashInfer peer (JIT from its sdist)
def import_flashinfer():
    sdist = ROOT / ".peers" / "flashinfer_python-0.2.14.post1.tar.gz"
    if not sdist.exists():
        return None
    root = Path("/tmp/flashinfer-src")
    src = root / "flashinfer_python-0.2.14.post1"
    if not src.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tf:
            tf.extractall(root)
        data = src / "flashinfer" / "data"
        data.mkdir(exist_ok=True)
        for name, target in [("include", "../../include"), ("csrc", "../../csrc"),
                             ("cutlass", "../../3rdparty/cutlass"), ("spdlog", "../../3rdparty/spdlog")]:
            if not (data / name).exists():
                (data / name).symlink_to(target)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "16")
    sys.path.insert(0, str(src))
    import flashinfer

    return flashinfer


def fi_decode(fi, ws, b: PagedBatch, tensor_cores: bool):
    """FlashInfer's paged decode planned for batch b (one query token a sequence): its run call."""
    indptr = torch.arange(b.B + 1, device="cuda", dtype=torch.int32) * (b.L // P)
    last = torch.full((b.B,), P, device="cuda", dtype=torch.int32)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, b.page_table.flatten(), last, HQ, HKV, D, P, q_data_type=DTYPE, kv_data_type=DTYPE)
    return lambda: w.run(b.q, (b.k_cache, b.v_cache))


def fi_prefill(fi, ws, b: PagedBatch):
    """FlashInfer's causal paged prefill planned for batch b: its run call."""
    qo = torch.arange(b.B + 1, device="cuda", dtype=torch.int32) * b.q_len
    indptr = torch.arange(b.B + 1, device="cuda", dtype=torch.int32) * (b.L // P)
    last = torch.full((b.B,), P, device="cuda", dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(qo, indptr, b.page_table.flatten(), last, HQ, HKV, D, P, causal=True, q_data_type=DTYPE,
           kv_data_type=DTYPE)
    return lambda: w.run(b.q, (b.k_cache, b.v_cache))


def flashinfer_calls(fi) -> dict:
    """{"decode" | "prefill": {row name: batch -> planned run call}}: FlashInfer's rows, timed inside
    our rows' interleaved timings. Each wrapper has its own workspace (a plan lives in it)."""
    ws = lambda: torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")  # noqa: E731
    return {"decode": {"FlashInfer CUDA-core": lambda b: fi_decode(fi, ws(), b, False),
                       "FlashInfer tensor-core": lambda b: fi_decode(fi, ws(), b, True)},
            "prefill": {"FlashInfer paged": lambda b: fi_prefill(fi, ws(), b)}}


def warm_flashinfer(fi, log=print) -> None:
    """Build (JIT) the FlashInfer modules of flashinfer_calls and run each call once on a tiny batch:
    the builds in parallel threads (each a ninja subprocess), one after another if that fails."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator(device="cuda").manual_seed(0)
    tiny = {"decode": PagedBatch(1, 4 * P, 1, gen), "prefill": PagedBatch(1, 4 * P, 4 * P, gen)}
    jobs = [lambda make=make, kind=kind: make(tiny[kind])()
            for kind, makers in flashinfer_calls(fi).items() for make in makers.values()]
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: job(), jobs))
    except Exception as e:  # noqa: BLE001 - a JIT race: build them one by one
        log(f"# parallel FlashInfer build failed ({type(e).__name__}: {e}); building one by one")
        for job in jobs:
            job()
    torch.cuda.synchronize()
    log(f"# FlashInfer modules built in {time.perf_counter() - t0:.1f} s")


def flashinfer_wanted(quick: bool) -> bool:
    """FlashInfer rows run unless the run is quick or UA_BENCH_FLASHINFER=0."""
    return not quick and os.environ.get("UA_BENCH_FLASHINFER", "1") != "0"


def attention_rows(ctx=None, quick: bool = False, flashinfer: bool | None = None, log=print) -> list[dict]:
    """Every attention row of the benchmark table. bench/kernels.py passes its BenchContext
    (quick, copy_gbps, notes); FlashInfer rows run when its sdist is in .peers/ and not quick."""
    if ctx is not None:
        quick = ctx.quick
    if flashinfer is None:
        flashinfer = flashinfer_wanted(quick)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    # build every variant the rows use, in parallel, before any timing
    from concurrent.futures import ThreadPoolExecutor

    sweep = () if quick else (1, 2, 4, 8, 16, 32, 48)
    # what plan() launches for each decode row: at its auto split (None), one split and the swept ones
    ops = list(dict.fromkeys([launched_kernel(op_of(variant="unified_masked"), 8, 8, 16384), *(
        launched_kernel(op_of(), B, B, L, num_splits=s) for B, L in DECODE_SHAPES for s in (None, 1, *sweep))]))
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, ops))
    log(f"# built {len(ops)} attention variants in {time.perf_counter() - t0:.1f} s")
    peers = flashinfer_peers(ctx, log) if flashinfer else None
    spin_up_clocks()
    rows = []
    COPY_GBPS[0] = getattr(ctx, "copy_gbps", 0.0) or 0.0
    if not COPY_GBPS[0]:
        COPY_GBPS[0] = copy_ceiling_gbps()[0]
        rows.append(row("copy", "1 GiB", "torch copy_ (ceiling)", gbps=COPY_GBPS[0]))
    rows += decode_rows(gen, sweep, unified=True, peers=peers)
    log(f"# decode done at {time.perf_counter() - t0:.1f} s")
    rows += prefill_rows(gen, peers=peers)
    rows += mixed_rows(gen)
    log(f"# prefill + mixed done at {time.perf_counter() - t0:.1f} s")
    return rows


def flashinfer_peers(ctx=None, log=print) -> dict | None:
    """FlashInfer's calls for the rows (JIT-built from its sdist in .peers/), each tried once on a
    tiny batch by warm_flashinfer: None, with a note, when the sdist is missing or a call fails (a
    peer failing must not lose our rows)."""
    try:
        fi = import_flashinfer()
        if fi is None:
            log("# FlashInfer sdist not in .peers/: no FlashInfer rows")
            return None
        warm_flashinfer(fi, log)
        return flashinfer_calls(fi)
    except Exception as e:  # noqa: BLE001
        msg = f"FlashInfer rows skipped: {type(e).__name__}: {str(e)[:200]}"
        log("# " + msg)
        if ctx is not None:
            ctx.notes.append(msg)
        return None


def table(rows) -> str:
    lines = ["| op | shape | impl | ms | GB/s | TFLOP/s | vs ceiling | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k, fmt: (fmt % r[k]) if k in r else ""  # noqa: E731
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {f('ms', '%.4f')} | {f('gbps', '%.0f')} | "
                     f"{f('tflops', '%.0f')} | {f('pct_ceiling', '%.0f%%')} | {r.get('note', '')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--warm-flashinfer", action="store_true", help="only build FlashInfer's JIT modules, then exit")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.warm_flashinfer:
        fi = import_flashinfer()
        if fi is None:
            sys.exit("FlashInfer sdist not in .peers/")
        warm_flashinfer(fi)
        return
    rows = attention_rows(quick=a.quick, flashinfer=False if a.no_flashinfer else None)
    gpu = torch.cuda.get_device_name()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))
    print(f"\n{gpu}\n" + table(rows))


if __name__ == "__main__":
    main()
