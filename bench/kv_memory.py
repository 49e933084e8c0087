"""KV memory: how many long sequences a fixed KV budget holds by KV cache dtype, and what preemption costs under
pressure (recompute vs swap vs the CPU offload tier), on the serving runtime.

    python3 bench/kv_memory.py --out $OUT                                   # on the device (bench/run_device.sh)
    python3 bench/kv_memory.py --out $OUT --weights q8_0 --gguf q8_0=PATH --append   # the Q8_0 rows, same JSON
    python3 bench/kv_memory.py --tiny --device cpu --out DIR                # the same code on a toy model (smoke)

Model: the Qwen3-8B architecture (bench/serving_gpu.py's QWEN3_8B), bf16 random weights made on the GPU, or Q8_0
(a GGUF from --gguf q8_0=PATH, else the random weights quantised at load). One workload, "32x16K": 32 prompts of
16,384 random tokens, 128 output tokens each (greedy, ignore_eos), all arriving at t = 0, max_num_seqs 32, at a
fixed KV budget (--kv-gb, 24 GB = 24e9 bytes: EngineConfig.kv_cache_bytes), which holds about a third of the work's
bf16 KV. Rows:
  capacity and throughput by KV dtype (bf16, fp8_e4m3, int8; preemption recompute): max_seqs_no_preemption = the
    pool's pages // the pages one sequence needs (prompt + outputs), what the pool holds at once without preempting;
    peak_running = the most sequences running at once in the run;
  preemption under pressure (--preemptions: recompute, swap, offload; KV --pressure-kv, default bf16): swap's host
    pool and the offload tier take --host-gb of pinned host memory each (one engine at a time; torch's pinned
    allocator rounds a block up to a power of two: 48 GB takes 64 GiB); offload rows name their
    offload_pages_per_step (--offload-pages-per-step, a comma list: one row each).
Per row: output_tok_s = all output tokens / the workload's wall time; ttft_p99_s (and mean) from t = 0;
preemptions, recomputed_tokens (tokens computed again after a preemption: Scheduler.recomputed_tokens), the tier's
pages_offloaded / pages_restored / prefix_hits_cpu, pool_share = the pool's tokens / the work's tokens.
Writes kv-memory-<date>.json (gpu, date, model, rows with workload, weights, kv_cache_dtype, preemption, kv_gb,
max_seqs_no_preemption, output_tok_s, ttft_p99_s, preemptions, recomputed_tokens, ...), kv-memory-<date>.md (a table
and the issue's targets) and kv-memory-<date>.png to --out; --append merges this run's rows into that day's JSON
(a row replaces one of the same weights, kv_cache_dtype, preemption and offload_pages_per_step).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from uacompile.runtime.engine import Engine, EngineConfig, kv_dtype_of
from uacompile.runtime.loader import LoadedModel, load
from uacompile.runtime.memory import page_bytes
from uacompile.runtime.model import ModelConfig
from uacompile.runtime.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # PYTHONSAFEPATH runs leave the script's folder out
from serving_gpu import QWEN3_8B, TINY, write_report  # noqa: E402

KV_DTYPES = ("bf16", "fp8_e4m3", "int8")  # on the CPU (a float32 model) the first is the model's: fp32
PREEMPTIONS = ("recompute", "swap", "offload")
WEIGHTS = ("bf16", "q8_0")
PAGE = 16
# the targets (checked here, never by a test)
TARGETS = {"capacity_vs_bf16": 1.9, "throughput_vs_bf16": 1.5, "offload_recompute_cut": 0.9,
           "offload_vs_recompute": 1.2}


def model_kv(kv: str, device: str) -> str:
    """The IR name of a KV dtype here: bf16 means the model's dtype (fp32 on the CPU)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return kv_dtype_of("auto" if kv == "bf16" else kv, dtype)


def workload_name(requests: int, prompt_len: int) -> str:
    return f"{requests}x{prompt_len // 1024}K" if prompt_len % 1024 == 0 else f"{requests}x{prompt_len}"


def run_workload(engine: Engine, prompts: list, output_len: int) -> dict:
    """Every prompt at t = 0; per-request first-token times, output tok/s, the peak of running sequences, and the
    scheduler's counters over this run."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.engine_config.device == "cuda" else (lambda: None)
    sch = engine.scheduler
    before = sch.stats()
    sync()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    first, count, peak = {}, {r: 0 for r in rids}, 0
    while engine.has_unfinished():
        out = engine.run_step()
        peak = max(peak, len(sch.running))
        now = time.perf_counter() - t0
        for d in out.deltas:
            first.setdefault(d.request_id, now)
            count[d.request_id] += len(d.token_ids)
    sync()
    wall = time.perf_counter() - t0
    for r in rids:
        engine.release(r)
    after = sch.stats()
    delta = {k: after[k] - before[k] for k in ("num_preemptions", "num_swap_outs", "recomputed_tokens",
                                               "pages_offloaded", "pages_restored", "prefix_hits_cpu",
                                               "offload_pages_not_saved", "offload_pages_not_ready")}
    ttft = np.array([first[r] for r in rids])
    return dict(ttft=ttft, output_tok_s=sum(count.values()) / wall, wall_s=wall, peak_running=peak, **delta)


def make_engine(args, cfg: ModelConfig, source, weights: str, kv: str, preemption: str, pages_per_step: int,
                max_len: int) -> Engine:
    cuda = args.device == "cuda"
    kv_bytes = int(args.kv_gb * 1e9)
    host_bytes = int(args.host_gb * 1e9)
    pb = page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, PAGE, model_kv(kv, args.device))
    ec = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", kv_cache_bytes=kv_bytes,
                      kv_cache_dtype="auto" if kv == "bf16" else kv, progress=False,
                      quantization="q8_0" if weights == "q8_0" else "auto",
                      cpu_offload_bytes=host_bytes if preemption == "offload" else None)
    kw = dict(max_model_len=max_len, max_num_seqs=args.max_num_seqs, page_size=PAGE, preemption=preemption,
              num_cpu_pages=host_bytes // pb if preemption == "swap" else 0, offload_pages_per_step=pages_per_step)
    if not cuda:  # the toy model's steps: a GPU-like token budget, scaled down
        kw.update(max_num_batched_tokens=256, max_prefill_chunk=256)
    return Engine(source, ec, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results", help="folder for kv-memory-<date>.json/.md/.png")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a toy model, 64-token prompts, a KV budget of kilobytes")
    ap.add_argument("--weights", default="bf16", help=f"comma list of {WEIGHTS}")
    ap.add_argument("--gguf", action="append", default=[], metavar="q8_0=PATH", help="a Q8_0 GGUF of the model")
    ap.add_argument("--kv", default=",".join(KV_DTYPES), help=f"comma list of {KV_DTYPES} (the capacity rows)")
    ap.add_argument("--preemptions", default=",".join(PREEMPTIONS), help=f"comma list of {PREEMPTIONS}")
    ap.add_argument("--pressure-kv", default="bf16", help="the KV dtypes of the swap / offload rows (comma list)")
    ap.add_argument("--kv-gb", type=float, default=24.0, help="the KV budget, GB (1e9 bytes)")
    ap.add_argument("--host-gb", type=float, default=48.0, help="swap pool / offload tier, GB of pinned host memory")
    ap.add_argument("--offload-pages-per-step", default="1024",
                    help="comma list: one offload row each (an 8192-token prefill step computes 512 pages)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16384)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--append", action="store_true", help="merge the rows into this day's JSON in --out")
    ap.add_argument("--rerender", metavar="JSON", help="rebuild the table and plot from a run's JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        return report(json.loads(Path(args.rerender).read_text()), out)
    lists = {}
    for name, allowed in (("weights", WEIGHTS), ("kv", KV_DTYPES), ("preemptions", PREEMPTIONS),
                          ("pressure_kv", KV_DTYPES)):
        lists[name] = [v for v in getattr(args, name).split(",") if v]
        bad = [v for v in lists[name] if v not in allowed]
        if bad:
            ap.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {allowed}")
    ggufs = dict(spec.partition("=")[::2] for spec in args.gguf)
    if set(ggufs) - {"q8_0"} or not all(ggufs.values()):
        ap.error(f"--gguf: want q8_0=PATH, got {args.gguf}")
    steps = [int(v) for v in args.offload_pages_per_step.split(",") if v]
    if args.tiny:
        cfg = ModelConfig(**TINY)
        args.prompt_len, args.output_len = args.prompt_len // 256, max(4, args.output_len // 16)
        work = args.requests * (args.prompt_len + args.output_len)
        tiny_pb = page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, PAGE, "fp32")
        args.kv_gb = tiny_pb * -(-work // PAGE) / 3 / 1e9  # a third of the work, as 24 GB of the 8B's bf16
        args.host_gb = 4 * tiny_pb * -(-work // PAGE) / 1e9
        steps = [max(1, s // 16) for s in steps]
    else:
        cfg = ModelConfig(**QWEN3_8B)
    rng = np.random.default_rng(0)
    V = min(cfg.vocab_size, 150000)
    prompts = [rng.integers(3, V, size=args.prompt_len).tolist() for _ in range(args.requests)]
    max_len = args.prompt_len + args.output_len + 16
    per_seq = -(-(args.prompt_len + args.output_len) // PAGE)
    work_tokens = args.requests * (args.prompt_len + args.output_len)
    runs = [(kv, "recompute", steps[0]) for kv in lists["kv"]]
    for kv in lists["pressure_kv"]:
        for p in lists["preemptions"]:
            for s in (steps if p == "offload" else [steps[0]]):
                if (kv, p, s) not in runs and not (p == "recompute" and (kv, p, steps[0]) in runs):
                    runs.append((kv, p, s))
    rows = []
    for weights in lists["weights"]:
        source = load(ggufs["q8_0"]) if weights == "q8_0" and "q8_0" in ggufs else LoadedModel(cfg, None, None)
        for kv, preemption, per_step in runs:
            t0 = time.perf_counter()
            engine = make_engine(args, cfg, source, weights, kv, preemption, per_step, max_len)
            sc = engine.scheduler.config
            print(f"{weights} weights, KV {engine.kv_dtype}, {preemption}: {sc.num_pages} pages "
                  f"({sc.num_pages // per_seq} sequences), ready in {time.perf_counter() - t0:.1f} s", flush=True)
            run_workload(engine, [prompts[0][:256]], 4)  # warm-up
            r = run_workload(engine, prompts, args.output_len)
            rows.append(dict(
                workload=workload_name(args.requests, args.prompt_len), weights=weights, kv_cache_dtype=engine.kv_dtype,
                preemption=preemption, kv_gb=round(args.kv_gb, 6), num_pages=sc.num_pages,
                pool_share=round(sc.num_pages * PAGE / work_tokens, 3), max_seqs_no_preemption=sc.num_pages // per_seq,
                peak_running=r["peak_running"], output_tok_s=round(r["output_tok_s"], 2),
                ttft_p99_s=round(float(np.percentile(r["ttft"], 99)), 4),
                ttft_mean_s=round(float(r["ttft"].mean()), 4), preemptions=r["num_preemptions"],
                swap_outs=r["num_swap_outs"], recomputed_tokens=r["recomputed_tokens"],
                pages_offloaded=r["pages_offloaded"], pages_restored=r["pages_restored"],
                prefix_hits_cpu=r["prefix_hits_cpu"], offload_pages_not_saved=r["offload_pages_not_saved"],
                offload_pages_not_ready=r["offload_pages_not_ready"],
                host_gb=round(args.host_gb, 6) if preemption != "recompute" else 0,
                offload_pages_per_step=per_step if preemption == "offload" else None,
                requests=args.requests, prompt_len=args.prompt_len, output_len=args.output_len,
                wall_s=round(r["wall_s"], 3)))
            print(json.dumps(rows[-1]), flush=True)
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                if hasattr(torch._C, "_host_emptyCache"):  # the pinned pool / tier: give the host memory back
                    torch._C._host_emptyCache()
        del source
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    given = list(argv if argv is not None else sys.argv[1:])
    shown = [a for i, a in enumerate(given) if not a.startswith("--out") and not (i and given[i - 1] == "--out")]
    meta = dict(gpu=gpu, date=dt.date.today().isoformat(),
                model="tiny qwen3" if args.tiny else "Qwen3-8B architecture", torch=torch.__version__,
                command="UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/kv_memory.py --out $OUT"
                + "".join(" " + a for a in shown) + "' bash bench/run_device.sh", rows=rows)
    path = out / f"kv-memory-{meta['date']}.json"
    if args.append and path.exists():
        old = json.loads(path.read_text())
        key = lambda r: (r["weights"], r["kv_cache_dtype"], r["preemption"], r.get("offload_pages_per_step"))  # noqa
        mine = {key(r) for r in rows}
        meta["rows"] = [r for r in old["rows"] if key(r) not in mine] + rows
        meta["command"] = old.get("command", "") + "; " + meta["command"]
    return report(meta, out)


# ---------------------------------------------------------------- the report
def target_checks(rows: list[dict]) -> list[dict]:
    checks = []

    def check(name, value, bound, ge=True):
        if value is not None and math.isfinite(value):
            checks.append(dict(target=name, value=round(value, 3), bound=bound,
                               met=value >= bound if ge else value <= bound))

    for weights in sorted({r["weights"] for r in rows}):
        rec = {r["kv_cache_dtype"]: r for r in rows if r["weights"] == weights and r["preemption"] == "recompute"}
        base = rec.get("bf16") or rec.get("fp32")
        if base:
            for kv in ("fp8_e4m3", "int8"):
                if kv in rec:
                    check(f"{weights}: {kv} sequences held / bf16's >= 1.9",
                          rec[kv]["max_seqs_no_preemption"] / max(1, base["max_seqs_no_preemption"]), 1.9)
                    check(f"{weights}: {kv} output tok/s under pressure / bf16's >= 1.5",
                          rec[kv]["output_tok_s"] / base["output_tok_s"], 1.5)
        for kv, r in rec.items():
            for off in (o for o in rows if o["weights"] == weights and o["kv_cache_dtype"] == kv
                        and o["preemption"] == "offload"):
                tag = f"{weights} {kv} offload ({off['offload_pages_per_step']} pages/step)"
                if r["recomputed_tokens"]:
                    check(f"{tag}: recomputed tokens cut vs recompute >= 90%",
                          1 - off["recomputed_tokens"] / r["recomputed_tokens"], 0.9)
                check(f"{tag}: output tok/s / recompute's >= 1.2", off["output_tok_s"] / r["output_tok_s"], 1.2)
    return checks


COLS = ["workload", "weights", "kv_cache_dtype", "preemption", "offload_pages_per_step", "kv_gb", "pool_share",
        "max_seqs_no_preemption", "peak_running", "output_tok_s", "ttft_p99_s", "preemptions", "recomputed_tokens",
        "pages_offloaded", "pages_restored", "wall_s"]


def report(meta: dict, out: Path) -> int:
    rows = meta["rows"]
    meta["targets"] = target_checks(rows)
    header = [f"# KV memory, {meta['gpu']}, {meta['date']}", "", f"Model: {meta['model']}. Command: "
              f"`{meta['command']}`", "", "max_seqs_no_preemption: the pool's pages // the pages one sequence needs "
              "(prompt + outputs); peak_running: the most running at once in the run; pool_share: the pool's tokens / "
              "the work's.", ""]
    write_report(out / f"kv-memory-{meta['date']}", meta, header, COLS,
                 lambda r, c: "" if r.get(c) is None else str(r.get(c)), plot)
    return 0


def plot(meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = meta["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    label = lambda r: (f"{r['weights']} {r['kv_cache_dtype']}\n{r['preemption']}"  # noqa: E731
                       + (f" {r['offload_pages_per_step']}/step" if r["preemption"] == "offload" else ""))
    cap = [r for r in rows if r["preemption"] == "recompute"]
    x = np.arange(len(cap))
    axes[0].bar(x, [r["max_seqs_no_preemption"] for r in cap])
    axes[0].set_xticks(x, [f"{r['weights']}\n{r['kv_cache_dtype']}" for r in cap], fontsize=8)
    axes[0].set(ylabel="sequences", title=f"Held without preemption ({cap[0]['kv_gb'] if cap else ''} GB KV)")
    x = np.arange(len(rows))
    axes[1].bar(x, [r["output_tok_s"] for r in rows])
    axes[1].set_xticks(x, [label(r) for r in rows], fontsize=6)
    axes[1].set(ylabel="output tok/s", title=f"{rows[0]['workload'] if rows else ''}: aggregate output")
    axes[2].bar(x - 0.2, [r["recomputed_tokens"] for r in rows], 0.4, label="recomputed tokens")
    ax2 = axes[2].twinx()
    ax2.bar(x + 0.2, [r["ttft_p99_s"] for r in rows], 0.4, color="tab:orange", label="p99 TTFT (s)")
    axes[2].set_xticks(x, [label(r) for r in rows], fontsize=6)
    axes[2].set(ylabel="tokens", title="Recomputed tokens and p99 TTFT")
    ax2.set_ylabel("s")
    axes[2].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"uacompile KV memory, {meta['gpu']}, {meta['date']} ({meta['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
