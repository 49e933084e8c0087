"""Attention across the variant axes on the device: ours against torch SDPA on contiguous KV.

    python3 bench/variant_sweep.py [--only NAME,...] [--json PATH]   # JSON also to $OUT/variant_sweep.json
    python3 bench/variant_sweep.py --only d64 --wg-tile 64=192x4    # another Hopper prefill tile (AttentionConfig.wg_tile)
    python3 bench/variant_sweep.py --rerender JSON [--out DIR] [--before JSON]  # a run's table and chart (no GPU)

bench/kernels.py checks the targets on one geometry (ANCHORS.md's: bf16, Hq 32, Hkv 8, D 128, page
16). A user's model has its own: MHA, GQA 7 (Qwen2.5-7B), GQA 8 and 16, head dims 64 / 80 / 96 / 256,
pages of 1 to 256, fp16. For each geometry (VARIANTS) this times, interleaved with torch SDPA on
contiguous copies of the same K/V (timing.time_graphs):
- decode: DECODE_B sequences whose K + V take about DECODE_BYTES, one query token each, at the split
  count attention.plan() picks; effective GB/s = K + V bytes / time;
- causal prefill: PREFILL_B x PREFILL_L, TFLOP/s = 4 * B * L^2 / 2 * Hq * D / time.
Every launch is first checked against SDPA on poisoned outputs (max abs diff; exit status 1 when one
exceeds TOLERANCE). The ratio is SDPA's time over ours (> 1: ours is faster). Ours is planned once a row
(attention.plan) and the timed graphs hold attention.run() only.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention_bench as ab  # noqa: E402  (PagedBatch, sdpa, spin_up_clocks)
from timing import copy_ceiling_gbps, time_graphs  # noqa: E402

from uacompile import ir  # noqa: E402
from uacompile.errors import IRError  # noqa: E402
from uacompile.targets.cuda import api, attention  # noqa: E402
from uacompile.targets.cuda import layout as cuda_layout  # noqa: E402
from uacompile.targets.cuda.config import AttentionConfig  # noqa: E402
from uacompile.targets.cuda.plan import choose_config, device_arch, device_sms  # noqa: E402

DECODE_B, DECODE_BYTES = 16, 512 * 2**20
PREFILL_B, PREFILL_L = 4, 4096
TOLERANCE = 2e-2  # 16-bit output against SDPA
ROUNDS = 11


@dataclass(frozen=True)
class Variant:
    name: str
    model: str  # a model with this attention geometry
    hq: int
    hkv: int
    d: int
    p: int = 16
    dtype: str = "bf16"

    def op(self) -> ir.PagedAttention:
        return ir.PagedAttention(self.hq, self.hkv, self.d, self.p, self.dtype, self.dtype)

    def decode_len(self) -> int:
        """Positions a sequence so that the decode batch's K + V take about DECODE_BYTES (whole pages, >= 1024)."""
        per_pos = 2 * DECODE_B * self.hkv * self.d * 2
        step = max(self.p, 256)
        return max(1024, DECODE_BYTES // per_pos // step * step)


VARIANTS = [
    Variant("base", "Llama-3-8B (ANCHORS.md)", 32, 8, 128),
    Variant("mha", "Llama-2-7B", 32, 32, 128),
    Variant("gqa7", "Qwen2.5-7B", 28, 4, 128),
    Variant("gqa8", "Llama-3-70B", 64, 8, 128),
    Variant("gqa16", "GQA 16", 64, 4, 128),
    Variant("d64", "TinyLlama-1.1B", 32, 4, 64),
    Variant("d80", "D 80", 32, 8, 80),
    Variant("d96", "Phi-3-mini", 32, 32, 96),
    Variant("d256", "Gemma-2-9B", 16, 8, 256),
    Variant("page1", "page 1", 32, 8, 128, p=1),
    Variant("page4", "page 4", 32, 8, 128, p=4),
    Variant("d64page1", "TinyLlama-1.1B, page 1", 32, 4, 64, p=1),
    Variant("page64", "page 64", 32, 8, 128, p=64),
    Variant("page256", "page 256", 32, 8, 128, p=256),
    Variant("fp16", "fp16", 32, 8, 128, dtype="fp16"),
]


def parse_wg_tiles(specs: list[str]) -> dict[int, tuple[int, int]]:
    """--wg-tile W=BNxSTAGES (repeatable): the wgmma prefill tile (AttentionConfig.wg_tile) of the geometries of
    padded row width W (layout.wgmma_width: 64, 128 or 256)."""
    tiles = {}
    for spec in specs:
        try:
            width, tile = spec.split("=")
            bn, stages = (int(x) for x in tile.split("x"))
            width = int(width)
        except ValueError:
            raise SystemExit(f"--wg-tile: expected like 64=192x4, got {spec!r}") from None
        if width not in cuda_layout.WG_TILE:
            raise SystemExit(f"--wg-tile {spec}: width one of {sorted(cuda_layout.WG_TILE)}")
        try:
            AttentionConfig(wg_tile=(bn, stages))
        except IRError as e:
            raise SystemExit(f"--wg-tile {spec}: {e}") from None
        tiles[width] = (bn, stages)
    return tiles


def launched_ops(v: Variant, num_sms: int = cuda_layout.H200_SMS, arch: str = "sm_90",
                 wg_tiles: dict[int, tuple[int, int]] | None = None) -> tuple[ir.Kernel, int, ir.Kernel]:
    """(the decode launch's kernel, its split count, the prefill launch's kernel), as attention.plan()'s built-in
    rule picks them on a GPU of num_sms SMs of arch (default: the H200's); the prefill kernel on wg_tiles' tile of
    the geometry's row width where it has one and runs the Hopper path."""
    op = v.op()
    decode = choose_config(op, DECODE_B, DECODE_B, v.decode_len(), num_sms, arch)
    prefill = choose_config(op, PREFILL_B * PREFILL_L, PREFILL_B, PREFILL_L, num_sms, arch, num_splits=1)
    tile = wg_tile_of(v, wg_tiles)
    if tile is not None and cuda_layout.uses_wgmma(op, prefill, arch):
        prefill = prefill.replace(wg_tile=tile)
    return ir.Kernel(op, decode), decode.num_splits, ir.Kernel(op, prefill)


def wg_tile_of(v: Variant, wg_tiles: dict[int, tuple[int, int]] | None) -> tuple[int, int] | None:
    """The --wg-tile tile of v's padded row width, or None (the built-in one)."""
    return (wg_tiles or {}).get(cuda_layout.wgmma_width(v.d))


def build_all(variants, wg_tiles=None, log=print) -> None:
    """Every launched kernel built at once (one nvcc a kernel, in parallel), so timing never waits on a build."""
    here = device_sms(0), device_arch(0)
    ops = list(dict.fromkeys(op for v in variants for op in launched_ops(v, *here, wg_tiles)[::2]))  # (decode, prefill)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(16, os.cpu_count() or 2)) as pool:
        list(pool.map(api.kernel, ops))
    log(f"# built {len(ops)} kernels in {time.perf_counter() - t0:.1f} s")


def _diff(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


def decode_row(v: Variant, gen) -> dict:
    op, L = v.op(), v.decode_len()
    b = ab.PagedBatch(DECODE_B, L, 1, gen, (v.hq, v.hkv, v.d, v.p), ir.torch_dtype(v.dtype))
    p = ab.plan_for(op, b)
    splits = p.num_splits
    k, kv = b.contiguous_kv()
    want = ab.sdpa(b.q_bhld(), k, kv, False).transpose(1, 2).reshape(b.q.shape)
    b.out.fill_(float("nan"))
    attention.run(p, **b.args(), out=b.out)
    diff = _diff(b.out, want)
    t = time_graphs({"ua": lambda: attention.run(p, **b.args(), out=b.out),
                     "sdpa": lambda: ab.sdpa(b.q_bhld(), k, kv, False)}, calls=10, rounds=ROUNDS)
    ours, peer = t["ua"].ms, t["sdpa"].ms
    return dict(op="decode", shape=f"{DECODE_B}x{L}", splits=splits, ms=ours, sdpa_ms=peer,
                gbps=b.kv_bytes / ours / 1e6, sdpa_gbps=b.kv_bytes / peer / 1e6, ratio=peer / ours, diff=diff)


def prefill_row(v: Variant, gen, wg_tiles=None) -> dict:
    op = v.op()
    b = ab.PagedBatch(PREFILL_B, PREFILL_L, PREFILL_L, gen, (v.hq, v.hkv, v.d, v.p), ir.torch_dtype(v.dtype))
    k, kv = b.contiguous_kv()
    want = ab.sdpa(b.q_bhld(), k, kv, True)
    p = ab.plan_for(op, b, wg_tile_of(v, wg_tiles), num_splits=1)
    b.out.fill_(float("nan"))
    attention.run(p, **b.args(), out=b.out)
    diff = _diff(b.out.view(PREFILL_B, PREFILL_L, v.hq, v.d).transpose(1, 2), want)
    t = time_graphs({"ua": lambda: attention.run(p, **b.args(), out=b.out),
                     "sdpa": lambda: ab.sdpa(b.q_bhld(), k, kv, True)}, calls=2, rounds=ROUNDS)
    flops = 4 * PREFILL_B * PREFILL_L**2 / 2 * v.hq * v.d
    ours, peer = t["ua"].ms, t["sdpa"].ms
    return dict(op="prefill", shape=f"{PREFILL_B}x{PREFILL_L} causal", ms=ours, sdpa_ms=peer,
                tflops=flops / ours / 1e9, sdpa_tflops=flops / peer / 1e9, ratio=peer / ours, diff=diff)


def table(rows) -> str:
    out = ["| variant | model | Hq/Hkv | D | page | dtype | op | shape | ours | SDPA | ours / SDPA | max abs diff |",
           "|---|---|---|---:|---:|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        unit, key = ("GB/s", "gbps") if r["op"] == "decode" else ("TFLOP/s", "tflops")
        op = r["op"] + (f" ({r['splits']} splits)" if r.get("splits", 1) > 1 else "")
        out.append(f"| {r['variant']} | {r['model']} | {r['hq']}/{r['hkv']} | {r['d']} | {r['p']} | {r['dtype']} | "
                   f"{op} | {r['shape']} | {r[key]:.0f} {unit} | {r['sdpa_' + key]:.0f} | {r['ratio']:.3f} | "
                   f"{r['diff']:.3g} |")
    return "\n".join(out)


def chart(rows, path: Path, title: str, before=None) -> bool:
    """Ours / SDPA per variant, decode and prefill side by side (1.0: SDPA's speed), with an earlier run's rows
    (before) as dotted lines across the bars; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 3.6))
    for k, (op, color) in enumerate((("decode", "#d62728"), ("prefill", "#1f77b4"))):
        by = {r["variant"]: r["ratio"] for r in rows if r["op"] == op}
        xs = [i - 0.2 + 0.4 * k for i, n in enumerate(names) if n in by]
        bars = ax.bar(xs, [by[n] for n in names if n in by], 0.4, label=op, color=color)
        was = {r["variant"]: r["ratio"] for r in before or () if r["op"] == op}
        pairs = [(x, was[n]) for x, n in zip(xs, [n for n in names if n in by]) if n in was]
        if pairs:  # the earlier run: a dotted line across each bar at its ratio then
            ax.hlines([w for _, w in pairs], [x - 0.2 for x, _ in pairs], [x + 0.2 for x, _ in pairs], colors="k",
                      linestyles=":", lw=1.2, zorder=3, label="before" if k == 0 else None)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    ax.set_ylabel("SDPA time / ours (> 1: ours faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def report(meta: dict, out_dir: Path, stem: str, before: dict | None = None) -> str:
    """Write <stem>.json, .md and .png (when matplotlib is there; before: an earlier run drawn behind it) under
    out_dir; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    md = f"# Paged attention across variants, {meta['gpu']}, {meta['date']}\n\n"
    title = f"Ours / torch SDPA (contiguous KV), {meta['gpu']}, {meta['date']}"
    if chart(meta["rows"], out_dir / f"{stem}.png", title, before and before["rows"]):
        md += f"![ours / SDPA per variant]({stem}.png)\n\n"
    if before:
        md += f"Dotted lines: the ratio in {before.get('label', 'an earlier run')}.\n\n"
    if meta.get("wg_tile"):
        md += "Hopper prefill tiles changed for this run (row width: positions x stages): " + \
            ", ".join(f"{w}: {t}" for w, t in meta["wg_tile"].items()) + ".\n\n"
    md += (f"Copy ceiling {meta['copy_gbps']:.0f} GB/s. Ours at the split count attention.plan() picks; SDPA on "
           f"contiguous copies of the same K/V, timed interleaved.\n\n{table(meta['rows'])}\n")
    (out_dir / f"{stem}.md").write_text(md)
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help=f"comma list of {[v.name for v in VARIANTS]}")
    ap.add_argument("--json", default=None, help="write the run here (default $OUT/variant_sweep.json when OUT is set)")
    ap.add_argument("--rerender", metavar="JSON", help="rewrite a run's table and chart into --out (no GPU)")
    ap.add_argument("--out", default=None, help="with --rerender: the folder (default: the JSON's)")
    ap.add_argument("--before", metavar="JSON", help="with --rerender: an earlier run, drawn as dotted lines")
    ap.add_argument("--wg-tile", action="append", default=[], metavar="W=BNxST",
                    help="a Hopper prefill tile instead of the built-in one (row width W: 64, 128, 256)")
    args = ap.parse_args()
    if args.rerender:
        src = Path(args.rerender)
        before = json.loads(Path(args.before).read_text()) if args.before else None
        if before is not None:
            before.setdefault("label", f"{Path(args.before).name} ({before['date']})")
        print(report(json.loads(src.read_text()), Path(args.out) if args.out else src.parent, src.stem, before))
        return 0
    wanted = [n for n in args.only.split(",") if n]
    unknown = set(wanted) - {v.name for v in VARIANTS}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    variants = [v for v in VARIANTS if not wanted or v.name in wanted]
    wg_tiles = parse_wg_tiles(args.wg_tile)
    build_all(variants, wg_tiles)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_gbps=copy_ceiling_gbps()[0],
                rows=[], **({"wg_tile": {str(w): f"{bn}x{st}" for w, (bn, st) in wg_tiles.items()}} if wg_tiles else {}))
    ab.spin_up_clocks()
    bad = 0
    for v in variants:
        for measure in (decode_row, functools.partial(prefill_row, wg_tiles=wg_tiles)):
            row = dict(variant=v.name, **{k: x for k, x in asdict(v).items() if k != "name"}, **measure(v, gen))
            row = {k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}
            meta["rows"].append(row)
            bad += not row["diff"] <= TOLERANCE
            print(table([row]).splitlines()[-1], flush=True)
            torch.cuda.empty_cache()
    print(table(meta["rows"]))
    path = args.json or (os.path.join(os.environ["OUT"], "variant_sweep.json") if os.environ.get("OUT") else None)
    if path:
        report(meta, Path(path).parent, Path(path).stem)
    if bad:
        print(f"# {bad} launches differ from SDPA by more than {TOLERANCE}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
