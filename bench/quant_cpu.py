"""CPU speed of the TVM GGUF weight kernels (quant_matmul, dequantize) against torch, on SmolLM2-135M's shapes:

    python bench/quant_cpu.py --out bench/results            # writes quant-cpu-<date>.{json,md} there

Rows (ms a call, median of interleaved rounds; GB/s of packed weight bytes; % of the measured read bandwidth):
- bandwidth: a 1 GiB read (DRAM) and a 96 MiB read (the model's size: this machine's L3 may hold it), torch sum.
- overhead: a tiny quant_matmul through cpu_kernel's checked call, and through the raw TVM function.
- decode (num_tokens 1, 2, 4): SmolLM2's GEMVs (Q4_1 qkv / o / gate_up / down, Q8_0 lm_head), each call on the next
  of 30 weight copies (one a layer: the model's working set, not one hot copy), beside torch F.linear of fp32
  weights dequantised at load and of bf16 weights.
- step: one decode step's 121 GEMVs (30 layers x 4 + lm_head) called from Python in turn: the whole weight path of
  a token, call overhead included (attention, norms and sampling come on top).
- formats: K = N = 4096, one token, every format.
- prefill (num_tokens 64, 512): the quantised kernel vs dequantize (TVM) + torch matmul vs fp32 weights at load.
The machine's load average (before and after) goes into the output: timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's uacompile, not an installed one
from uacompile import ir, reference, testing  # noqa: E402
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel, set_cpu_threads  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
LAYER_SHAPES = {"qkv": (HIDDEN, 960), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN)}


TORCH_THREADS = [1]  # the torch thread count for torch rows (main() sets it)


def timed(fns: dict, rounds: int, calls: int) -> dict:
    """{name: median ms a call}: TVM fns (names not starting with "torch") interleaved with each other, torch fns
    with each other, apart: after a parallel torch op its OpenMP threads spin for a while and take the second core
    from TVM's pool (measured: a 2-thread TVM GEMV right after torch ran ~2x slower), so TVM rows run with torch at
    one thread and torch rows at TORCH_THREADS."""
    import torch

    tvm_fns = {n: f for n, f in fns.items() if not n.startswith("torch")}
    torch_fns = {n: f for n, f in fns.items() if n.startswith("torch")}
    out = {}
    for group, nthreads in ((tvm_fns, 1), (torch_fns, TORCH_THREADS[0])):
        if group:
            torch.set_num_threads(nthreads)
            time.sleep(0.05)
            out.update(_timed(group, rounds, calls))
    return out


def _timed(fns: dict, rounds: int, calls: int) -> dict:
    names = list(fns)
    samples = {n: [] for n in names}
    for fn in fns.values():
        fn()
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            for _ in range(calls):
                fns[n]()
            samples[n].append((time.perf_counter() - t) * 1e3 / calls)
    for n, ss in samples.items():
        MINS[id(fns[n])] = min(ss)
    return {n: statistics.median(ss) for n, ss in samples.items()}


MINS: dict = {}  # id(fn) -> the fastest round's ms a call of the latest _timed (uncontended speed on a busy machine)


def fastest(fn) -> float:
    return MINS[id(fn)]


class Rotating:
    """Call fn on the next of several argument sets each time (weights not hot in cache)."""

    def __init__(self, fn, argsets):
        self.fn, self.argsets, self.i = fn, argsets, 0

    def __call__(self):
        a = self.argsets[self.i]
        self.i = (self.i + 1) % len(self.argsets)
        self.fn(*a)


def bandwidth(torch, rounds: int) -> dict:
    out = {}
    for label, nbytes in (("dram_1GiB", 1 << 30), ("model_96MiB", 96 << 20)):
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        ms = timed({"torch_sum": lambda: x.sum()}, rounds, 1)["torch_sum"]
        out[label] = nbytes / ms / 1e6
        del x
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="folder for quant-cpu-<date>.{json,md}")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="TVM and torch threads (default: every usable CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and shapes (a smoke run)")
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    threads = a.threads or len(os.sched_getaffinity(0))
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    TORCH_THREADS[0] = threads
    rounds = 3 if a.quick else a.rounds
    copies = 4 if a.quick else LAYERS
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    t_start = time.time()
    res = {"machine": {"cpu": _cpu_name(), "cpus": threads, "python": platform.python_version(),
                       "torch": torch.__version__, "loadavg_before": load_before},
           "command": "python bench/quant_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    bw = bandwidth(torch, rounds)
    res["bandwidth_gbs"] = bw
    peak = bw["model_96MiB"]
    print(f"read bandwidth: {bw['dram_1GiB']:.1f} GB/s (1 GiB), {bw['model_96MiB']:.1f} GB/s (96 MiB)")

    # per-call overhead
    tiny = ir.QuantMatmul(32, 1, "q8_0", "fp32")
    kt = cpu_kernel(tiny)
    set_cpu_threads(threads)
    xt, wt, ot = np.ones((1, 32), np.float32), testing.random_quant_weight(rng, "q8_0", 1, 32), np.zeros((1, 1), np.float32)
    xtt, wtt, ott = torch.from_numpy(xt), torch.from_numpy(wt), torch.from_numpy(ot)
    lin_x, lin_w = torch.ones(1, 32), torch.ones(1, 32)
    ov = timed({"cpu_kernel(numpy)": lambda: kt(x=xt, weight=wt, out=ot),
                "cpu_kernel(torch tensors)": lambda: kt(x=xtt, weight=wtt, out=ott),
                "raw fn(torch tensors)": lambda: kt.fn(xtt, wtt, ott, 1),
                "torch F.linear": lambda: F.linear(lin_x, lin_w)}, rounds, 200)
    res["overhead_us"] = {k: v * 1e3 for k, v in ov.items()}
    print("per-call overhead (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ov.items()))

    # decode GEMVs
    decode_shapes = [(n, "q4_1", K, N) for n, (K, N) in LAYER_SHAPES.items()] + [("lm_head", "q8_0", HIDDEN, VOCAB)]
    rows = []
    weights = {}
    for name, fmt, K, N in decode_shapes:
        ncopy = 1 if name == "lm_head" else copies
        op = ir.QuantMatmul(K, N, fmt, "fp32")
        packed = [torch.from_numpy(testing.random_quant_weight(rng, fmt, N, K)) for _ in range(ncopy)]
        w32 = [torch.from_numpy(reference.dequantize_blocks(p.numpy(), fmt, K)) for p in packed]
        w16 = [w.to(torch.bfloat16) for w in w32]
        weights[name] = (op, packed, w32, w16)
        k = cpu_kernel(op)
        for T in ((1, 2, 4) if not a.quick else (1,)):
            x = torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32))
            xb = x.to(torch.bfloat16)
            out = torch.empty(T, N)
            fns = {"tvm_q": Rotating(lambda w: k.fn(x, w, out, T), [(p,) for p in packed]),
                   "torch_fp32": Rotating(lambda w: F.linear(x, w, out=out), [(w,) for w in w32]),
                   "torch_bf16": Rotating(lambda w: F.linear(xb, w), [(w,) for w in w16])}
            ms = timed(fns, rounds, len(packed) if ncopy > 1 else 3)
            qbytes = packed[0].numel()
            row = {"shape": name, "format": fmt, "K": K, "N": N, "num_tokens": T, "weight_bytes": qbytes,
                   "ms": ms["tvm_q"], "min_ms": fastest(fns["tvm_q"]), "torch_fp32_min_ms": fastest(fns["torch_fp32"]), "gbs": qbytes / ms["tvm_q"] / 1e6, "pct_bw": 100 * qbytes / ms["tvm_q"] / 1e6 / peak,
                   "torch_fp32_ms": ms["torch_fp32"], "torch_bf16_ms": ms["torch_bf16"]}
            rows.append(row)
            print(f"decode {name:8s} {fmt} {K}->{N} T={T}: tvm {row['ms']:.3f} ms {row['gbs']:.1f} GB/s "
                  f"({row['pct_bw']:.0f}%), torch fp32 {row['torch_fp32_ms']:.3f} ms, bf16 {row['torch_bf16_ms']:.3f} ms")
    res["decode"] = rows

    # the weight path of one decode step, called from Python
    x1 = {K: torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32)) for K in (HIDDEN, INTER)}
    outs = {n: torch.empty(1, N) for n, _, _, N in decode_shapes}
    kernels = {n: cpu_kernel(weights[n][0]) for n in weights}

    def step(kind):
        def run():
            for layer in range(LAYERS):
                for n in LAYER_SHAPES:
                    op, packed, w32, w16 = weights[n]
                    i = layer % len(packed)
                    if kind == "tvm_q":
                        kernels[n](x=x1[op.in_features], weight=packed[i], out=outs[n])
                    elif kind == "torch_fp32":
                        F.linear(x1[op.in_features], w32[i], out=outs[n])
                    else:
                        F.linear(x1[op.in_features].to(torch.bfloat16), w16[i])
            op, packed, w32, w16 = weights["lm_head"]
            if kind == "tvm_q":
                kernels["lm_head"](x=x1[HIDDEN], weight=packed[0], out=outs["lm_head"])
            elif kind == "torch_fp32":
                F.linear(x1[HIDDEN], w32[0], out=outs["lm_head"])
            else:
                F.linear(x1[HIDDEN].to(torch.bfloat16), w16[0])
        return run

    sf = {k: step(k) for k in ("tvm_q", "torch_fp32", "torch_bf16")}
    st = timed(sf, rounds, 1)
    step_bytes = sum(weights[n][1][0].numel() * (LAYERS if n != "lm_head" else 1) for n in weights)
    res["step"] = {"ms": st, "min_ms": {k: fastest(f) for k, f in sf.items()}, "weight_bytes": step_bytes,
                   "copies": copies}
    print("decode step, 121 GEMVs from Python (ms, median / fastest): "
          + ", ".join(f"{k} {v:.2f} / {res['step']['min_ms'][k]:.2f}" for k, v in st.items())
          + f" ({step_bytes / 1e6:.0f} MB of packed weights; {copies} distinct layer copies)")

    # every format at 4096 x 4096
    frows = []
    for fmt in ir.WEIGHT_FORMATS:
        if a.quick and fmt not in ("q4_1", "q4_k"):
            continue
        op = ir.QuantMatmul(4096, 4096, fmt, "fp32")
        k = cpu_kernel(op)
        packed = [torch.from_numpy(testing.random_quant_weight(rng, fmt, 4096, 4096)) for _ in range(2 if a.quick else 4)]
        x = torch.from_numpy(rng.standard_normal((1, 4096)).astype(np.float32))
        out = torch.empty(1, 4096)
        dq = cpu_kernel(ir.Dequantize(4096, fmt, "fp32"))
        w32 = torch.empty(4096, 4096)
        ms = timed({"q": Rotating(lambda w: k.fn(x, w, out, 1), [(p,) for p in packed]),
                    "deq": Rotating(lambda w: dq.fn(w, w32, 4096), [(p,) for p in packed])}, rounds, len(packed))
        qbytes = packed[0].numel()
        frows.append({"format": fmt, "K": 4096, "N": 4096, "weight_bytes": qbytes, "ms": ms["q"],
                      "gbs": qbytes / ms["q"] / 1e6, "pct_bw": 100 * qbytes / ms["q"] / 1e6 / peak,
                      "dequantize_fp32_ms": ms["deq"]})
        print(f"format {fmt}: quant_matmul {ms['q']:.3f} ms {qbytes / ms['q'] / 1e6:.1f} GB/s; "
              f"dequantize to fp32 {ms['deq']:.3f} ms")
    res["formats"] = frows

    # prefill
    prow = []
    for T in ((64,) if a.quick else (64, 512)):
        for name in LAYER_SHAPES:
            op, packed, w32, w16 = weights[name]
            K, N = op.in_features, op.out_features
            k = cpu_kernel(op)
            dq = cpu_kernel(ir.Dequantize(K, "q4_1", "fp32"))
            scratch = torch.empty(N, K)
            x = torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32))
            out = torch.empty(T, N)

            def deq_mm(p):
                dq.fn(p, scratch, N)
                torch.matmul(x, scratch.t(), out=out)

            ms = timed({"tvm_q": Rotating(lambda p: k.fn(x, p, out, T), [(p,) for p in packed[:4]]),
                        "torch_after_tvm_dequant": Rotating(deq_mm, [(p,) for p in packed[:4]]),
                        "torch_fp32_at_load": Rotating(lambda w: F.linear(x, w, out=out), [(w,) for w in w32[:4]])},
                       max(3, rounds // 3), 4)
            prow.append({"shape": name, "K": K, "N": N, "num_tokens": T, **{f"{k2}_ms": v for k2, v in ms.items()}})
            print(f"prefill {name:8s} T={T}: " + ", ".join(f"{k2} {v:.3f} ms" for k2, v in ms.items()))
    res["prefill"] = prow
    res["machine"]["loadavg_after"] = os.getloadavg()
    res["seconds"] = round(time.time() - t_start, 1)
    print(f"load average before {load_before}, after {res['machine']['loadavg_after']}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = a.out / f"quant-cpu-{a.date}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
        stem.with_suffix(".md").write_text(markdown(res))
        print(f"wrote {stem}.json and {stem}.md")
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(res: dict) -> str:
    m, bw = res["machine"], res["bandwidth_gbs"]
    lines = [f"# GGUF weight kernels on the CPU (TVM LLVM) vs torch: SmolLM2-135M shapes", "",
             f"`{res['command']}` on {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}; load average before "
             f"{', '.join(f'{v:.2f}' for v in m['loadavg_before'])}, after "
             f"{', '.join(f'{v:.2f}' for v in m['loadavg_after'])} (a shared machine: other jobs ran alongside). "
             f"Medians of interleaved rounds (fastest round beside some); GB/s counts packed weight bytes; % is of the 96 MiB read bandwidth.", "",
             f"Read bandwidth (torch sum, {m['cpus']} threads): {bw['dram_1GiB']:.1f} GB/s over 1 GiB, "
             f"{bw['model_96MiB']:.1f} GB/s over 96 MiB.", "",
             "Per-call overhead (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["overhead_us"].items()), "",
             "## Decode GEMVs (each call on the next of the layer copies)", "",
             "| shape | format | K -> N | tokens | TVM quant ms | (fastest) | GB/s | % bw | torch fp32 (dequantised at load) ms | (fastest) | torch bf16 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        lines.append(f"| {r['shape']} | {r['format']} | {r['K']} -> {r['N']} | {r['num_tokens']} | {r['ms']:.3f} | "
                     f"{r['min_ms']:.3f} | {r['gbs']:.1f} | {r['pct_bw']:.0f} | {r['torch_fp32_ms']:.3f} | "
                     f"{r['torch_fp32_min_ms']:.3f} | {r['torch_bf16_ms']:.3f} |")
    s = res["step"]
    lines += ["", f"Decode step's weight path (30 layers x 4 GEMVs + lm_head, {s['weight_bytes'] / 1e6:.0f} MB packed, "
                  f"called from Python through cpu_kernel / F.linear), median (fastest round): " +
              ", ".join(f"{k} {v:.2f} ms ({s['min_ms'][k]:.2f})" for k, v in s["ms"].items()), "",
              "## Every format, K = N = 4096, one token", "",
              "| format | quant_matmul ms | GB/s | % bw | dequantize to fp32 ms |", "|---|---|---|---|---|"]
    for r in res["formats"]:
        lines.append(f"| {r['format']} | {r['ms']:.3f} | {r['gbs']:.1f} | {r['pct_bw']:.0f} | {r['dequantize_fp32_ms']:.3f} |")
    lines += ["", "## Prefill (Q4_1 layer shapes, fp32 activations)", "",
              "| shape | K -> N | tokens | TVM quant ms | TVM dequantize + torch matmul ms | torch fp32 (at load) ms |",
              "|---|---|---|---|---|---|"]
    for r in res["prefill"]:
        lines.append(f"| {r['shape']} | {r['K']} -> {r['N']} | {r['num_tokens']} | {r['tvm_q_ms']:.3f} | "
                     f"{r['torch_after_tvm_dequant_ms']:.3f} | {r['torch_fp32_at_load_ms']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
