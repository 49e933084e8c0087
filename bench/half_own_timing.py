"""Production (-DUA_PREFILL_HALF_OWN=1: the half-wide last tile's scores in registers of their own) against the scores
aliasing the first half of S (=0, main's SASS before v37), on the launches whose split counts ptxas serialised (C7511)
in main's build: prefill chunks at long context (8, 11, 16 splits), plus the benchmarks' rows (1 split: 8x4096 prefill;
decode 8x16384, 4 splits), which were clean in both (docs/attention-rationale.md, "ptxas' wgmma serialisation"). One
library a design (each built in its own process), paged_attention() with kernel_of, both timed in one interleaved timing
(timing.time_graphs); each row says which code shape build() kept and whether ptxas serialised that kernel (build.json),
and checks the two outputs bit for bit (random data; no NaN). Run on the device (~1-2 min, builds included):

    python3 bench/half_own_timing.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from attention_bench import PagedBatch, op_of, spin_up_clocks  # noqa: E402
from timing import time_graphs  # noqa: E402
from uacompile.targets.cuda import attention  # noqa: E402

DESIGNS = {"own": "|-DUA_PREFILL_HALF_OWN=1", "aliased": "|-DUA_PREFILL_HALF_OWN=0"}
# (sequences, query tokens each, context): choose_splits gives 8, 11, 16, 4 and 1 splits for the chunks
SHAPES = [(1, 64, 16384), (1, 96, 16384), (1, 32, 16384), (2, 96, 8192), (1, 128, 16384), (8, 4096, 4096),
          (8, 1, 16384)]


def kept(kern) -> str:
    """The code shape build() kept for a CudaKernel's op and whether ptxas serialised it (its library's build.json)."""
    op = kern.op
    rec = json.loads((Path(kern.library.path).parent / "build.json").read_text())
    shape = rec["code_shapes"][op.symbol()]
    bad = any(a["shapes"][op.symbol()] == shape and op.symbol() in a["serialised"] for a in rec["attempts"]
              if op.symbol() in a["shapes"])
    return f"shape {shape}{' C7511' if bad else ''}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    op = op_of()
    gen = torch.Generator(device="cuda").manual_seed(0)
    splits = {shape: attention.choose_splits(op, shape[0] * shape[1], shape[0], shape[2]) for shape in SHAPES}
    ops = list(dict.fromkeys(attention.launched_op(op, s, design=attention.design_of("")) for s in splits.values()))
    t0 = time.perf_counter()
    kernels = attention.design_kernels(DESIGNS, ops, "sm_90")
    print(f"# built {len(ops)} ops x {len(kernels)} designs in {time.perf_counter() - t0:.0f} s", flush=True)
    spin_up_clocks()
    rows = []
    for (B, q_len, L), s in splits.items():
        b = PagedBatch(B, L, q_len, gen)
        outs = {name: torch.full_like(b.q, float("nan")) for name in DESIGNS}

        def call(name, b=b, s=s, outs=outs):
            return lambda: attention.paged_attention(op, **b.args(), out=outs[name], num_splits=s,
                                                     kernel_of=kernels[name])

        for name in DESIGNS:
            call(name)()
        torch.cuda.synchronize()
        assert not any(o.isnan().any().item() for o in outs.values()), "unwritten output (NaN poison)"
        same = torch.equal(outs["own"], outs["aliased"])
        t = time_graphs({name: call(name) for name in DESIGNS}, calls=10, rounds=11)
        run = attention.launched_op(op, s, design=attention.design_of(""))
        row = dict(shape=f"{B}x{q_len} at {L}", splits=s, own_ms=t["own"].ms, aliased_ms=t["aliased"].ms,
                   aliased_over_own=round(t["aliased"].ms / t["own"].ms, 3), bit_equal=same,
                   own_kernel=kept(kernels["own"](run)), aliased_kernel=kept(kernels["aliased"](run)))
        rows.append(row)
        print(row, flush=True)
        del b, outs
    print(f"\n{torch.cuda.get_device_name()}\n| shape | splits | own ms | aliased ms | aliased / own | bit equal "
          "| own kernel | aliased kernel |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['splits']} | {r['own_ms']:.4f} | {r['aliased_ms']:.4f} | {r['aliased_over_own']} "
              f"| {r['bit_equal']} | {r['own_kernel']} | {r['aliased_kernel']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                                rows=rows), indent=1))
    return 0 if all(r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
