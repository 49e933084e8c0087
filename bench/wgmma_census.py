"""Which paged_attention kernels ptxas serialises (wgmma C7511) in each code shape: a CPU compile census.

    python3 bench/wgmma_census.py                      # every config, every variant: a table on stdout
    python3 bench/wgmma_census.py --configs bf16-32-8-128 --variants dynamic --out census.md

For each op in the census and each code shape (attention.CODE_SHAPES) the op is rendered in that shape and
compiled by nvcc to a cubin (device code only, the build's flags: ptxas sees what build() gives it; many ops
a unit, one nvcc a core). ptxas' C7511/C7520 note names the kernel (build.serialised_kernels). The table
says, per op, which shapes serialise and which shape build() keeps (its first unserialised one, 0 if none).
Ops: what paged_attention() launches (attention.launched_op) on the Hopper path, for the split counts
choose_splits can return, with the item queue (production's "dynamic" design) and without ("static"),
the split-KV merge fused or a second launch; plus the GPU tests' masked / lse / ALiBi variants.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from uacompile import ir
from uacompile.targets.cuda import attention
from uacompile.nvcc import compiler_warnings, nvcc_path
from uacompile.targets.cuda.build import nvcc_flags, serialised_kernels
from uacompile.targets.cuda.render import code_shapes, render_op

PA = ir.PagedAttention
# head configs people serve (Llama-3 8B / 70B GQA, MHA, a D 64 GQA) and the GPU tests' Hopper variants
CONFIGS = {
    "bf16-32-8-128-p16": PA(32, 8, 128, 16, "bf16", "bf16"),
    "fp16-32-8-128-p16": PA(32, 8, 128, 16, "fp16", "fp16"),
    "bf16-64-8-128-p16": PA(64, 8, 128, 16, "bf16", "bf16"),
    "bf16-32-32-128-p16": PA(32, 32, 128, 16, "bf16", "bf16"),
    "bf16-16-2-64-p16": PA(16, 2, 64, 16, "bf16", "bf16"),
    "fp16-16-4-64-p16": PA(16, 4, 64, 16, "fp16", "fp16"),
    "bf16-32-8-128-p8": PA(32, 8, 128, 8, "bf16", "bf16"),
    "bf16-32-8-128-p32": PA(32, 8, 128, 32, "bf16", "bf16"),
    # the GPU tests' (tests/targets/cuda/test_cuda_wgmma_gpu.py) lse, masked softmax and ALiBi variants
    "bf16-32-8-128-p16-lse": PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True),
    "bf16-16-2-64-p128-window-softcap": PA(16, 2, 64, 128, "bf16", "bf16", window=300, softcap=15.0),
    "fp16-8-2-128-p16-alibi": PA(8, 2, 128, 16, "fp16", "fp16", alibi=True),
}
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64)
VARIANTS = {  # name: (design's prefill knob, fused_merge)
    "dynamic": ("dynamic", True),  # what paged_attention() launches by default
    "dynamic-unfused": ("dynamic", False),
    "static": ("static", True),
    "static-unfused": ("static", False),
}
ARCH = "sm_90"


def census_ops(configs, variants, splits):
    """[(config, variant, splits, op)], one row per distinct op."""
    rows, seen = [], set()
    for cname in configs:
        for vname in variants:
            prefill, fused = VARIANTS[vname]
            for s in splits:
                op = attention.launched_op(CONFIGS[cname], s, fused, ARCH, attention.design_of(f"prefill={prefill}"))
                if op.symbol() in seen or not attention.uses_wgmma(op, ARCH):
                    continue
                seen.add(op.symbol())
                rows.append((cname, vname, s, op))
    return rows


def device_flags(source: str) -> list[str]:
    """build()'s nvcc flags for a cubin: the host-side ones (-shared, -Xcompiler ...) dropped."""
    flags, out = nvcc_flags(ARCH, source), []
    it = iter(flags)
    for f in it:
        if f == "-Xcompiler":
            next(it)
        elif f != "-shared":
            out.append(f)
    return [*out, "-cubin"]


def compile_unit(ops, shape, cache: Path) -> set[str]:
    """Symbols of ops (rendered in code shape `shape`, one unit) whose wgmma ptxas serialised; cached by source."""
    source = "\n".join(render_op(op, ARCH, shape) for op in ops)
    flags = device_flags(source)
    key = hashlib.sha256("\0".join([source, *flags, nvcc_path()]).encode()).hexdigest()[:24]
    hit = cache / f"{key}.json"
    if hit.exists():
        return set(json.loads(hit.read_text()))
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / "kernels.cu"
        src.write_text(source)
        proc = subprocess.run([nvcc_path(), *flags, "-o", str(Path(tmp) / "k.cubin"), str(src)],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"nvcc failed (shape {shape}, {[o.symbol() for o in ops]}):\n{proc.stderr[-3000:]}")
    bad = serialised_kernels(compiler_warnings(proc.stderr + proc.stdout))
    hit.write_text(json.dumps(sorted(bad)))
    return bad


def census(rows, per_unit: int, cache: Path, jobs: int, shapes=None) -> dict[str, list]:
    """{symbol: [serialised in shape 0, 1, ... (None: not built)]}; shapes: which to build (default all)."""
    n = code_shapes(rows[0][3], ARCH)
    shapes = range(n) if shapes is None else shapes
    ops = [r[3] for r in rows]
    units = [(ops[i:i + per_unit], s) for s in shapes for i in range(0, len(ops), per_unit)]
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(lambda u: (u[1], compile_unit(u[0], u[1], cache)), units))
    bad = {s: set() for s in shapes}
    for s, b in results:
        bad[s] |= b
    return {op.symbol(): [op.symbol() in bad[s] if s in bad else None for s in range(n)] for op in ops}


def picked(serialised: list) -> int | None:
    """build()'s choice: the first unserialised shape, 0 if none (None: a shape before it was not built)."""
    for s, bad in enumerate(serialised):
        if bad is None:
            return None
        if not bad:
            return s
    return 0


def table(rows, result) -> list[str]:
    n = len(next(iter(result.values())))
    head = ["config", "variant", "splits", "symbol", *[f"shape {s}" for s in range(n)], "build() keeps",
            "kept serialised"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cname, vname, s, op in rows:
        ser = result[op.symbol()]
        keep = picked(ser)
        marks = ["-" if b is None else "**C7511**" if b else "ok" for b in ser]
        kept = "?" if keep is None else "**yes**" if ser[keep] else "no"
        lines.append("| " + " | ".join([cname, vname, str(s), op.symbol(), *marks, "?" if keep is None else str(keep),
                                        kept]) + " |")
    return lines


def summary(rows, result) -> list[str]:
    n = len(next(iter(result.values())))
    built = [s for s in range(n) if result[rows[0][3].symbol()][s] is not None]
    out = [f"ops: {len(rows)}; serialised per shape: "
           + ", ".join(f"{s}: {sum(result[r[3].symbol()][s] for r in rows)}" for s in built)
           + f"; serialised in every shape built: {sum(all(result[r[3].symbol()][s] for s in built) for r in rows)}"]
    for s in built:
        out.append(f"- shape {s} ({attention.CODE_SHAPES[s]}) serialises: " + "; ".join(
            f"{c}/{v} splits {sorted(sp for cc, vv, sp, op in rows if cc == c and vv == v and result[op.symbol()][s])}"
            for c, v in dict.fromkeys((r[0], r[1]) for r in rows)
            if any(cc == c and vv == v and result[op.symbol()][s] for cc, vv, _, op in rows)) or "-")
    worst = [f"{c}/{v}/{sp}" for c, v, sp, op in rows if all(result[op.symbol()][s] for s in built)]
    out.append(f"- serialised in every shape built ({built}): " + (", ".join(worst) or "none"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--shapes", help="comma list of the code shapes to build (default: all)")
    ap.add_argument("--per-unit", type=int, default=6, help="ops a translation unit")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="nvcc processes at once")
    ap.add_argument("--cache", default="/tmp/uacompile-wgmma-census", help="per-unit results, keyed by source")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    rows = census_ops(args.configs.split(","), args.variants.split(","), [int(s) for s in args.splits.split(",")])
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shapes = [int(s) for s in args.shapes.split(",")] if args.shapes else None
    result = census(rows, args.per_unit, cache, args.jobs, shapes)
    seconds = time.perf_counter() - t0
    nvcc = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    extra = os.environ.get("UACOMPILE_NVCC_FLAGS", "")
    text = [f"CPU compile census (no GPU): nvcc {nvcc}, {ARCH} (sm_90a cubins, build()'s device flags"
            f"{', UACOMPILE_NVCC_FLAGS=' + extra if extra else ''}), {len(rows)} ops, code shapes "
            f"{shapes or list(range(len(next(iter(result.values())))))}, {seconds:.0f} s.", "",
            *summary(rows, result), "", *table(rows, result)]
    print("\n".join(text))
    if args.out:
        Path(args.out).write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
