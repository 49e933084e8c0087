"""quant_matmul / dequantize benchmark on the GPU: GGUF block formats kept packed, at Qwen3-8B's layer shapes.

    PYTHONPATH=... python3 bench/quant_gemv.py --out DIR [--quick]

For each format and rows (tokens) 1-64 at each shape: GB/s of the packed weight bytes (the bytes a decode step must
read; x and out are under 1% of them), its ratio to the device copy ceiling measured in the same run
(timing.copy_ceiling_gbps), and torch's bf16 matmul (cuBLAS) of the same shape beside it (ms, GB/s of its bf16
weights). Every timing is a CUDA-graph replay over several weight copies in turn (timing.time_graphs), so that L2
(50 MB) does not hold the weights. dequantize's GB/s count packed bytes read + bf16 bytes written. The prefill
path: dequantize into a scratch buffer + torch.matmul against plain bf16 torch.matmul, TFLOP/s at T = 512 and 2048.
--variants also times, beside the default kernel (one time_graphs call), the kernels of VARIANTS (a
QuantMatmulConfig each: the tensor-core kernel at every row count) for VARIANT_FORMATS at 1-8 rows.
Writes quant_gemv.json and quant_gemv.md into --out; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import copy_ceiling_gbps, time_graphs  # noqa: E402

from uacompile import ir  # noqa: E402
from uacompile.targets.cuda import api  # noqa: E402
from uacompile.targets.cuda.config import QuantMatmulConfig  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}  # (K, N)
ROWS = (1, 2, 4, 8, 16, 32, 64)
PREFILL = (512, 2048)
FORMATS = tuple(ir.WEIGHT_FORMATS)
COPY_BYTES = 256 << 20  # weight copies a timing cycles through: at least this many bytes (5x L2)
VARIANTS = {"tensor cores": QuantMatmulConfig(gemv_tokens=0)}
VARIANT_FORMATS = ("q8_0", "q4_k", "q6_k")  # the served formats (Q8_0; Q4_K_M holds q4_k and q6_k rows)
VARIANT_ROWS = (1, 2, 4, 8)


def copies_for(nbytes: int) -> int:
    return max(2, min(16, math.ceil(COPY_BYTES / nbytes)))


def random_weights(N: int, row_bytes: int, n: int) -> list:
    return [torch.randint(0, 256, (N, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="o_proj and gate_up only, rounds 10")
    ap.add_argument("--variants", action="store_true", help="also time VARIANTS' kernels at 1-8 rows")
    ap.add_argument("--build-only", action="store_true", help="build the kernels into the cache and stop")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = {k: v for k, v in SHAPES.items() if not args.quick or k in ("o_proj", "gate_up")}
    rounds = 10 if args.quick else 12
    t0 = time.time()
    ops = [ir.QuantMatmul(K, N, f, "bf16") for (K, N) in shapes.values() for f in FORMATS]
    ops += [ir.Dequantize(K, f, "bf16") for K in sorted({K for K, _ in shapes.values()}) for f in FORMATS]
    if args.variants:
        ops += [ir.Kernel(ir.QuantMatmul(K, N, f, "bf16"), c) for (K, N) in shapes.values() for f in VARIANT_FORMATS
                for c in VARIANTS.values()]
    api.preload(ops)
    print(f"built {len(ops)} kernels in {time.time() - t0:.0f} s", flush=True)
    if args.build_only:
        return 0
    ceiling, _ = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out, deq_out, prefill_out, variant_out = [], [], [], []
    for name, (K, N) in shapes.items():
        # cuBLAS bf16 beside
        wb = 2 * N * K
        w16 = [torch.randn((N, K), device="cuda", generator=gen).to(torch.bfloat16) for _ in range(copies_for(wb))]
        xs = {T: torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16) for T in ROWS}
        outs = {T: torch.empty((T, N), dtype=torch.bfloat16, device="cuda") for T in ROWS}
        fns = {T: [(lambda w=w, T=T: torch.matmul(xs[T], w.t(), out=outs[T])) for w in w16] for T in ROWS}
        cublas = {T: t.ms for T, t in time_graphs(fns, calls=2, rounds=rounds).items()}
        del fns
        for fmt in FORMATS:
            f = ir.WEIGHT_FORMATS[fmt]
            rb = f.row_bytes(K)
            nbytes = N * rb
            ws = random_weights(N, rb, copies_for(nbytes))
            kern = api.kernel(ir.QuantMatmul(K, N, fmt, "bf16"))
            fns = {}
            for T in ROWS:
                ls = [kern.launcher({"weight": w}, {"x": xs[T], "out": outs[T]}) for w in ws]
                fns[T] = [(lambda l=l, T=T: l(xs[T], outs[T])) for l in ls]
            variants = VARIANTS if args.variants and fmt in VARIANT_FORMATS else {}
            for vname, cfg in variants.items():
                vk = api.kernel(ir.Kernel(ir.QuantMatmul(K, N, fmt, "bf16"), cfg))
                for T in VARIANT_ROWS:
                    ls = [vk.launcher({"weight": w}, {"x": xs[T], "out": outs[T]}) for w in ws]
                    fns[(vname, T)] = [(lambda l=l, T=T: l(xs[T], outs[T])) for l in ls]
            res = time_graphs(fns, calls=2, rounds=rounds)
            for vname in variants:
                for T in VARIANT_ROWS:
                    ms = res[(vname, T)].ms
                    variant_out.append(dict(shape=name, K=K, N=N, format=fmt, rows=T, variant=vname, ms=ms,
                                            gbps=nbytes / ms / 1e6, pct_ceiling=100 * nbytes / ms / 1e6 / ceiling,
                                            default_ms=res[T].ms))
            for T in ROWS:
                ms = res[T].ms
                gbps = nbytes / ms / 1e6
                rows_out.append(dict(shape=name, K=K, N=N, format=fmt, rows=T, ms=ms, gbps=gbps,
                                     pct_ceiling=100 * gbps / ceiling, spread_pct=res[T].spread_pct,
                                     cublas_bf16_ms=cublas[T], cublas_bf16_gbps=wb / cublas[T] / 1e6,
                                     speedup_vs_cublas=cublas[T] / ms))
                print(f"{name:8s} {fmt:5s} T={T:3d} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s {100 * gbps / ceiling:5.1f}%"
                      f"  cuBLAS bf16 {cublas[T] * 1e3:8.1f} us", flush=True)
            # dequantize into one bf16 scratch buffer
            scratch = torch.empty((N, K), dtype=torch.bfloat16, device="cuda")
            dk = api.kernel(ir.Dequantize(K, fmt, "bf16"))
            dls = [dk.launcher({"weight": w}, {"out": scratch}) for w in ws]
            dfn = [(lambda l=l: l(scratch)) for l in dls]
            pre = {}
            for T in PREFILL:
                xp = torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16)
                op_ = torch.empty((T, N), dtype=torch.bfloat16, device="cuda")
                pre[T] = [(lambda l=l, xp=xp, op_=op_: (l(scratch), torch.matmul(xp, scratch.t(), out=op_))) for l in dls]
            res = time_graphs({"deq": dfn, **{f"pre{T}": v for T, v in pre.items()}}, calls=1, rounds=rounds)
            ms = res["deq"].ms
            moved = nbytes + 2 * N * K
            deq_out.append(dict(shape=name, K=K, N=N, format=fmt, ms=ms, gbps=moved / ms / 1e6,
                                pct_ceiling=100 * moved / ms / 1e6 / ceiling))
            for T in PREFILL:
                prefill_out.append(dict(shape=name, K=K, N=N, format=fmt, T=T, ms=res[f"pre{T}"].ms,
                                        tflops=2 * T * N * K / res[f"pre{T}"].ms / 1e9))
            del ws, dls, dfn, pre, fns, res, scratch
            torch.cuda.empty_cache()
        # plain bf16 prefill matmul
        plain = {}
        for T in PREFILL:
            xp = torch.randn((T, K), device="cuda", generator=gen).to(torch.bfloat16)
            op_ = torch.empty((T, N), dtype=torch.bfloat16, device="cuda")
            plain[T] = [(lambda w=w, xp=xp, op_=op_: torch.matmul(xp, w.t(), out=op_)) for w in w16]
        res = time_graphs(plain, calls=1, rounds=rounds)
        for T in PREFILL:
            prefill_out.append(dict(shape=name, K=K, N=N, format="bf16", T=T, ms=res[T].ms,
                                    tflops=2 * T * N * K / res[T].ms / 1e9))
        del w16, plain, res
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_gbps=ceiling,
                rows=rows_out, dequantize=deq_out, prefill=prefill_out, variants=variant_out,
                seconds=time.time() - t0)
    (out_dir / "quant_gemv.json").write_text(json.dumps(meta, indent=1))
    md = table(meta)
    (out_dir / "quant_gemv.md").write_text(md)
    print(md)
    return 0


def table(meta: dict) -> str:
    ceiling = meta["copy_ceiling_gbps"]
    lines = [f"# quant_matmul (bf16 x, packed GGUF weights) on {meta['gpu']}, copy ceiling {ceiling:.0f} GB/s", "",
             "GB/s of packed weight bytes (% of the copy ceiling); cuBLAS bf16: us (GB/s of its bf16 weights)", ""]
    shapes = list(dict.fromkeys(r["shape"] for r in meta["rows"]))
    for s in shapes:
        rs = [r for r in meta["rows"] if r["shape"] == s]
        K, N = rs[0]["K"], rs[0]["N"]
        lines += [f"## {s} K={K} N={N}", "", "| format | " + " | ".join(f"T={T}" for T in ROWS) + " |",
                  "|---|" + "---|" * len(ROWS)]
        for fmt in FORMATS:
            cells = {r["rows"]: r for r in rs if r["format"] == fmt}
            lines.append(f"| {fmt} | " + " | ".join(
                f"{cells[T]['gbps']:.0f} ({cells[T]['pct_ceiling']:.0f}%) {cells[T]['ms'] * 1e3:.1f}us" for T in ROWS) + " |")
        cells = {r["rows"]: r for r in rs if r["format"] == FORMATS[0]}
        lines.append("| cuBLAS bf16 | " + " | ".join(
            f"{cells[T]['cublas_bf16_ms'] * 1e3:.1f}us ({cells[T]['cublas_bf16_gbps']:.0f})" for T in ROWS) + " |")
        lines.append("")
    lines += ["## dequantize -> bf16 (GB/s of bytes read + written, % of ceiling)", "",
              "| format | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    for fmt in FORMATS:
        cells = {r["shape"]: r for r in meta["dequantize"] if r["format"] == fmt}
        lines.append(f"| {fmt} | " + " | ".join(f"{cells[s]['gbps']:.0f} ({cells[s]['pct_ceiling']:.0f}%)" for s in shapes) + " |")
    if meta.get("variants"):
        lines += ["", "## variants at 1-8 rows, timed beside the default kernel: us (% of the copy ceiling)", "",
                  "| shape | format | kernel | " + " | ".join(f"T={T}" for T in VARIANT_ROWS) + " |",
                  "|---|---|---|" + "---|" * len(VARIANT_ROWS)]
        for s in shapes:
            for fmt in VARIANT_FORMATS:
                vs = [r for r in meta["variants"] if r["shape"] == s and r["format"] == fmt]
                if not vs:
                    continue
                dflt = {r["rows"]: r for r in meta["rows"] if r["shape"] == s and r["format"] == fmt}
                lines.append(f"| {s} | {fmt} | default | " + " | ".join(
                    f"{dflt[T]['ms'] * 1e3:.1f} ({dflt[T]['pct_ceiling']:.0f}%)" for T in VARIANT_ROWS) + " |")
                for vname in dict.fromkeys(r["variant"] for r in vs):
                    cells = {r["rows"]: r for r in vs if r["variant"] == vname}
                    lines.append(f"| {s} | {fmt} | {vname} | " + " | ".join(
                        f"{cells[T]['ms'] * 1e3:.1f} ({cells[T]['pct_ceiling']:.0f}%)" for T in VARIANT_ROWS) + " |")
    lines += ["", "## prefill: dequantize into scratch + torch.matmul vs bf16 torch.matmul (TFLOP/s)", "",
              "| format | " + " | ".join(f"{s} T={T}" for s in shapes for T in PREFILL) + " |",
              "|---|" + "---|" * (len(shapes) * len(PREFILL))]
    for fmt in (*FORMATS, "bf16"):
        cells = {(r["shape"], r["T"]): r for r in meta["prefill"] if r["format"] == fmt}
        lines.append(f"| {fmt} | " + " | ".join(f"{cells[(s, T)]['tflops']:.0f}" for s in shapes for T in PREFILL) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
