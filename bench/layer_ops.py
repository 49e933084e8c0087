"""Decode-step layer kernels against the copy of the same bytes, run on the device:

    PYTHONPATH=... python3 bench/layer_ops.py [--out DIR] [--rows 1,2,4,...] [--quick]

At Qwen3-8B's sizes (hidden 4096, intermediate 12288, 32 q / 8 KV heads of 128), bf16 and fp16, for 1 to 256 token
rows: rms_norm (with and without the residual add), silu_and_mul and qkv_rope_cache (qk-norm, RoPE and the cache
write; 16-bit and fp8 caches) as CUDA-graph replays (bench/timing.py: interleaved rounds), beside torch's unfused
ops and an elementwise torch copy kernel (x * 1) moving the same bytes (read + written). A row: the kernel's time,
the same-bytes copy's, the copy's time over the kernel's in % (>= 80: at the copy's bandwidth), and the floor of
the bytes at the 1 GiB copy ceiling. Buffers stay in L2 at these sizes, as a decode step's activations do.
Writes layer_ops-<date>.json beside the printed table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from uacompile import ir

sys.path.insert(0, str(Path(__file__).parent))
from timing import copy_ceiling_gbps, time_graphs  # noqa: E402

E, I, HQ, HKV, D, P = 4096, 12288, 32, 8, 128, 16
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def same_bytes_copy(nbytes: int, dtype: torch.dtype):
    """An elementwise torch kernel reading and writing nbytes / 2 each (a captured copy_ would be a memcpy node)."""
    n = max(8, nbytes // 2 // 2)
    src = torch.randn(n, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    return lambda: torch.mul(src, 1, out=dst)


def norm_case(T, dt, residual):
    from uacompile.targets.cuda import api
    from uacompile.runtime.kernels import torch_rms_norm

    x, r = (torch.randn(T, E, device="cuda").to(dt) for _ in range(2))
    w = torch.randn(E, device="cuda").to(dt)
    out = torch.empty_like(x)
    s = x.element_size()
    if residual:
        ours = lambda: api.rms_norm(x, w, 1e-6, residual=r, out=out)  # noqa: E731
        theirs = lambda: torch_rms_norm(x + r, w, 1e-6)  # noqa: E731
        nbytes = (4 * T * E + E) * s
    else:
        ours = lambda: api.rms_norm(x, w, 1e-6, out=out)  # noqa: E731
        theirs = lambda: torch_rms_norm(x, w, 1e-6)  # noqa: E731
        nbytes = (2 * T * E + E) * s
    return ours, theirs, nbytes


def silu_case(T, dt):
    from uacompile.targets.cuda import api

    x = torch.randn(T, 2 * I, device="cuda").to(dt)
    out = torch.empty(T, I, device="cuda", dtype=dt)

    def theirs():
        g, u = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    return lambda: api.silu_and_mul(x, out=out), theirs, 3 * T * I * x.element_size()


def prologue_case(T, dt, kv):
    """Qwen3-8B's attention prologue: ours in one launch; torch's the unfused model's q/k norms (torch_rms_norm of the
    head rows), rotate-half RoPE by cos / sin tables and an index_copy of K and V into the cache (16-bit caches)."""
    from uacompile.targets.cuda import api
    from uacompile.runtime.kernels import apply_rope, torch_rms_norm

    qkv = torch.randn(T, HQ + 2 * HKV, D, device="cuda").to(dt)
    qn, kn = (torch.randn(D, device="cuda").to(dt) for _ in range(2))
    pages = T // P + 2
    cache_dt = dt if kv == "auto" else ir.torch_dtype(kv)
    kc, vc = (torch.zeros(pages, P, HKV, D, device="cuda", dtype=dt).to(cache_dt) for _ in range(2))
    scales = dict(k_scale=torch.ones(pages, P, HKV, device="cuda"), v_scale=torch.ones(pages, P, HKV, device="cuda")) \
        if kv != "auto" else {}
    pos = torch.arange(T, device="cuda", dtype=torch.int64) + 1000
    slots = torch.randperm(pages * P, device="cuda")[:T].to(torch.int64)
    q_out = torch.empty(T, HQ, D, device="cuda", dtype=dt)
    ours = lambda: api.qkv_rope_cache(qkv, pos, slots, kc, vc, HQ, 1e6, q_out=q_out, q_norm=qn, k_norm=kn,  # noqa: E731
                                      **scales)
    inv = 1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D)

    def theirs():
        ang = pos.double()[:, None] * inv
        cos, sin = ang.cos().to(dt)[:, None], ang.sin().to(dt)[:, None]
        q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
        q = apply_rope(torch_rms_norm(q.reshape(T * HQ, D), qn, 1e-6).view(T, HQ, D), cos, sin)
        k = apply_rope(torch_rms_norm(k.reshape(T * HKV, D), kn, 1e-6).view(T, HKV, D), cos, sin)
        if kv == "auto":
            kc.view(-1, HKV, D).index_copy_(0, slots, k)
            vc.view(-1, HKV, D).index_copy_(0, slots, v.contiguous())
        return q

    s, cs = qkv.element_size(), kc.element_size()
    nbytes = (T * (HQ + 2 * HKV) * D + 2 * D) * s + 16 * T + T * HQ * D * s + 2 * T * HKV * D * cs
    nbytes += 2 * T * HKV * 4 if kv != "auto" else 0
    return ours, theirs if kv == "auto" else None, nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/layer_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from uacompile.targets.cuda import api

    rows = [int(r) for r in a.rows.split(",")]
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    api.preload([op for name in dts for op in (
        ir.RMSNorm(E, name, 1e-6), ir.RMSNorm(E, name, 1e-6, True), ir.SiluAndMul(I, name),
        ir.QKVRopeCache(HQ, HKV, D, P, name, name, True, 1e-6, 1e6),
        ir.QKVRopeCache(HQ, HKV, D, P, name, "fp8_e4m3", True, 1e-6, 1e6))])
    ceiling, _ = copy_ceiling_gbps()
    print(f"copy ceiling (1 GiB torch copy_): {ceiling:.0f} GB/s", flush=True)
    results = dict(gpu=torch.cuda.get_device_name(), copy_ceiling_gbps=ceiling, rows=[])
    print(f"{'op':<28} {'dtype':<5} {'T':>4} {'bytes':>9} {'ours us':>8} {'copy us':>8} {'% copy':>7} "
          f"{'floor us':>8} {'torch us':>8}")
    for name, dt_ in dts.items():
        cases = {"rms_norm": lambda T: norm_case(T, dt_, False), "rms_norm+residual": lambda T: norm_case(T, dt_, True),
                 "silu_and_mul": lambda T: silu_case(T, dt_),
                 "qkv_rope_cache": lambda T: prologue_case(T, dt_, "auto"),
                 "qkv_rope_cache fp8 cache": lambda T: prologue_case(T, dt_, "fp8_e4m3")}
        for op_name, make in cases.items():
            for T in rows:
                ours, theirs, nbytes = make(T)
                fns = {"ours": ours, "copy": same_bytes_copy(nbytes, dt_)}
                if theirs is not None:
                    fns["torch"] = theirs
                t = time_graphs(fns, calls=20, rounds=7 if a.quick else 15)
                us = {k: v.ms * 1e3 for k, v in t.items()}
                r = dict(op=op_name, dtype=name, rows=T, bytes=nbytes, ours_us=us["ours"], copy_us=us["copy"],
                         pct_of_copy=100 * us["copy"] / us["ours"], floor_us=nbytes / (ceiling * 1e9) * 1e6,
                         torch_us=us.get("torch"), spread_pct=t["ours"].spread_pct)
                results["rows"].append(r)
                print(f"{op_name:<28} {name:<5} {T:>4} {nbytes:>9} {r['ours_us']:>8.2f} {r['copy_us']:>8.2f} "
                      f"{r['pct_of_copy']:>6.0f}% {r['floor_us']:>8.2f} "
                      f"{'' if r['torch_us'] is None else format(r['torch_us'], '8.2f'):>8}", flush=True)
    if a.out:
        path = Path(a.out) / f"layer_ops-{dt.date.today().isoformat()}.json"
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
