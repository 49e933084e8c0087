"""QuantMatmulConfig sweep on the GPU: quant_matmul (bf16) GB/s of packed weights per config, format, shape and rows.

    PYTHONPATH=... python3 bench/quant_matmul_sweep.py --out DIR [--configs "warps=4,stages=4,m_tiles=1:1:2:2;..."]

Timed as quant_gemv.py times (CUDA-graph replays over weight copies, bench/timing.py). Writes
quant_matmul_sweep.json and prints, per (shape, rows), each config's GB/s and the best.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_gemv import SHAPES, copies_for, random_weights  # noqa: E402
from timing import copy_ceiling_gbps, time_graphs  # noqa: E402

from uacompile import ir  # noqa: E402
from uacompile.targets.cuda import api  # noqa: E402
from uacompile.targets.cuda.config import QuantMatmulConfig  # noqa: E402
from uacompile.targets.cuda.render import quant_matmul_fits  # noqa: E402

DEFAULT_CONFIGS = ("warps=4,stages=4,m_tiles=1:1:2:2;warps=8,stages=4,m_tiles=1:1:2:2;warps=4,stages=2,m_tiles=1:1:2:2;"
                   "warps=4,stages=2,m_tiles=4:4:4:2;warps=2,stages=4,m_tiles=2:2:4:2;warps=8,stages=2,m_tiles=2:2:2:2;"
                   "warps=4,stages=3,m_tiles=2:2:2:2;warps=2,stages=3,m_tiles=4:4:4:2")


def parse(text: str) -> QuantMatmulConfig:
    """A config of the tensor-core kernel at every row count (gemv_tokens=0 unless the text sets it)."""
    kw = {"gemv_tokens": 0}
    for item in text.split(","):
        k, _, v = item.partition("=")
        kw[k] = tuple(int(m) for m in v.split(":")) if ":" in v else int(v)
    return QuantMatmulConfig(**kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--formats", default="q8_0,q4_0,q4_k,q6_k")
    ap.add_argument("--shapes", default="o_proj,gate_up,down")
    ap.add_argument("--rows", default="1,8,16,32,64")
    args = ap.parse_args()
    cfgs = {c: (parse(c) if c != "rule" else None) for c in args.configs.split(";")}
    formats, shapes, rows = args.formats.split(","), args.shapes.split(","), [int(r) for r in args.rows.split(",")]
    t0 = time.time()
    kernels = [(ir.Kernel(ir.QuantMatmul(*SHAPES[s], f, "bf16"), c) if c else ir.QuantMatmul(*SHAPES[s], f, "bf16")) for s in shapes for f in formats for c in cfgs.values()
               if quant_matmul_fits(ir.QuantMatmul(*SHAPES[s], f, "bf16"), c)]
    api.preload(kernels)
    print(f"built {len(kernels)} kernels in {time.time() - t0:.0f} s", flush=True)
    ceiling, _ = copy_ceiling_gbps()
    results = []
    for s in shapes:
        K, N = SHAPES[s]
        xs = {T: torch.randn((T, K), device="cuda").to(torch.bfloat16) for T in rows}
        outs = {T: torch.empty((T, N), dtype=torch.bfloat16, device="cuda") for T in rows}
        for f in formats:
            nbytes = N * ir.WEIGHT_FORMATS[f].row_bytes(K)
            ws = random_weights(N, ir.WEIGHT_FORMATS[f].row_bytes(K), copies_for(nbytes))
            fns = {}
            for name, c in cfgs.items():
                if not quant_matmul_fits(ir.QuantMatmul(K, N, f, "bf16"), c):
                    continue
                kern = api.kernel(ir.Kernel(ir.QuantMatmul(K, N, f, "bf16"), c) if c else ir.QuantMatmul(K, N, f, "bf16"))
                for T in rows:
                    ls = [kern.launcher({"weight": w}, {"x": xs[T], "out": outs[T]}) for w in ws]
                    fns[(name, T)] = [(lambda l=l, T=T: l(xs[T], outs[T])) for l in ls]
            res = time_graphs(fns, calls=2, rounds=12)
            for (name, T), tm in res.items():
                results.append(dict(shape=s, format=f, config=name, rows=T, ms=tm.ms, gbps=nbytes / tm.ms / 1e6,
                                    pct=100 * nbytes / tm.ms / 1e6 / ceiling))
            for T in rows:
                rs = sorted((r for r in results if r["shape"] == s and r["format"] == f and r["rows"] == T),
                            key=lambda r: -r["gbps"])
                print(f"{s:8s} {f:5s} T={T:3d} " + "  ".join(f"{list(cfgs).index(r['config'])}:{r['pct']:3.0f}%" for r in
                      sorted(rs, key=lambda r: list(cfgs).index(r["config"]))) + f"   best {rs[0]['config']}", flush=True)
            del ws, fns, res
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant_matmul_sweep.json").write_text(json.dumps(dict(ceiling=ceiling, configs=list(cfgs),
                                                                           results=results), indent=1))
    print("configs: " + " | ".join(f"{i}: {c}" for i, c in enumerate(cfgs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
