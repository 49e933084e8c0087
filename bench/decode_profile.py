"""One decode launch of ours and one of FlashInfer's tensor-core decode on the same paged batch, for
ncu to profile side by side (run on the device):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \\
        -k regex:"paged_attention|Batch|Merge" python3 bench/decode_profile.py --shape 32x4096

Ours is planned once (attention.plan: the built-in split rule) and run twice (the first call loads the kernel);
FlashInfer's runs twice too (its first call plans); both outputs are checked
against torch SDPA on contiguous KV first, so a profile is of a correct launch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from attention_bench import PagedBatch, fi_decode, import_flashinfer, op_of, plan_for, sdpa  # noqa: E402
from uacompile.targets.cuda import attention  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32x4096", help="BxL: B sequences of L positions, one query token each")
    ap.add_argument("--no-flashinfer", action="store_true")
    a = ap.parse_args(argv)
    B, L = (int(x) for x in a.shape.split("x"))
    if not torch.cuda.is_available():
        print("bench/decode_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    b = PagedBatch(B, L, 1, torch.Generator(device="cuda").manual_seed(0))
    k, v = b.contiguous_kv()
    want = sdpa(b.q_bhld(), k, v, False).transpose(1, 2).reshape(b.q.shape).float()
    del k, v
    op = op_of()
    p = plan_for(op, b)
    calls = {"ua": lambda: attention.run(p, **b.args(), out=b.out)}
    fi = None if a.no_flashinfer else import_flashinfer()
    if fi is not None:
        ws = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        calls["FlashInfer tensor-core"] = fi_decode(fi, ws, b, True)
    for name, call in calls.items():
        b.out.fill_(float("nan"))
        for _ in range(2):
            got = call()
        got = b.out if got is None else got
        torch.cuda.synchronize()
        diff = (got.float().view_as(want) - want).abs().max().item()
        print(f"{a.shape} {name}: max abs diff vs SDPA {diff:.3g}, {p.config}"
              if name == "ua" else f"{a.shape} {name}: max abs diff vs SDPA {diff:.3g}", flush=True)
        if not diff <= 0.02:
            print(f"{name} is wrong: its profile would mean nothing", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
