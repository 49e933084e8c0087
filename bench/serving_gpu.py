"""The serving runtime end to end on the GPU, side by side with its baselines and the floors, in one run.

    python3 bench/serving_gpu.py --out DIR            # on the device (bench/run_device.sh, UA_BENCH_SCRIPT)
    python3 bench/serving_gpu.py --tiny --device cpu  # the same code on a toy model (a smoke test)
    python3 bench/serving_gpu.py --kv-cache-dtype fp8_e4m3 --impls uacompile-ua   # the runtime on an 8-bit KV cache

Workloads (a Qwen3-8B-architecture model, bf16, random weights made on the GPU; greedy, ignore_eos):
  seed           8 prompts x 16,384 tokens, 256 output tokens each
  conc-N         N = 1, 2, 4, 8, 16, 32 prompts x 4,096 tokens, 128 output tokens
  shared-prefix  16 prompts of a 3,072-token shared prefix + 1,024 own tokens, 128 output tokens
Implementations: this runtime on the UA kernels (uacompile-ua), the same runtime on the unified_masked kernel
(llama.cpp's unified KV buffer: every token scans every sequence's pages; uacompile-unified), Hugging Face
transformers' generate with static batching on SDPA (hf-sdpa: all prompts prefilled together, then decoded together),
and llama.cpp built with CUDA (llama.cpp: `llama-batched-bench -no-kvu`, a KV buffer a sequence, -fa on; all prompts
prefilled, then decoded together; --llama-cpp BIN_DIR) on the same GGUF files.
Weights (--weights, every row has a `weights` field): bf16 (random weights), q8_0 (a Q8_0 GGUF from --gguf, else the
random weights quantised at load), q4_k (a Q4_K_M GGUF from --gguf: Q4_K with Q6_K rows), fp8 (random weights in e4m3
rows, quantization="fp8"). A format's floors count its own bytes (the packed blocks a step reads) and, for fp8, the
e4m3 matmul rate for the projections (attention's FLOPs stay at the bf16 rate: its matmuls are bf16 in every format).
Every request arrives at t = 0. Per request: TTFT = its first token's time; TPOT = (last token - first token) /
(outputs - 1), which counts the prefill steps of later requests that run between its tokens; decode_step_ms = the
median step while every request decodes (after the last first token, before the first finishes; for HF, TPOT);
aggregate output tok/s = all output tokens / the wall time of the workload.
Floors, measured in the same run: prefill FLOPs (2 x params x tokens + causal attention) at the measured bf16 matmul
rate; a decode step's bytes (weights + every running sequence's KV) at the measured copy bandwidth. ttft_floor_s:
prompts prefilled one after another at full rate, the mean of their finish times (the seed: 1.76 s on the H200);
tpot_floor_ms: the mean step floor over the decode. --kv-cache-dtype (auto | bf16 | fp16 | fp8_e4m3 | int8) sets
the runtime's KV cache (EngineConfig.kv_cache_dtype; HF keeps its model-dtype cache, llama.cpp its f16 one) and the
KV bytes of its rows' decode floor (8-bit: the elements and their float32 scales); each row names its cache in
kv_cache_dtype.
Writes serving-<date>.json (gpu, date, model, floors, kv_cache_dtype, rows), serving-<date>.md and serving-<date>.png
to --out (serving-<date>-kv-<dtype>.* with --kv-cache-dtype other than auto).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from uacompile.runtime.engine import KV_CACHE_DTYPES, Engine, EngineConfig, kv_dtype_of
from uacompile.runtime.loader import LoadedModel, load
from uacompile.runtime.memory import page_bytes
from uacompile.runtime.model import ModelConfig
from uacompile.runtime.sequence import SamplingParams

QWEN3_8B = dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=40960, qk_norm=True, torch_dtype="bfloat16")
TINY = dict(arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=4096, qk_norm=True, torch_dtype="float32")
IMPLS = ("uacompile-ua", "uacompile-unified", "hf-sdpa", "llama.cpp")
WEIGHTS = ("bf16", "q8_0", "q4_k", "fp8")
# the targets on the seed workload (checked here, never by a test)
TARGETS = {"tpot_vs_floor": 1.25, "prefill_vs_floor": 1.3, "ttft_vs_floor": 1.3, "vs_hf_output": 3.0,
           "ua_vs_unified_output": 2.5, "ua_vs_unified_ttft": 0.4}


@dataclass
class Workload:
    name: str
    prompts: list  # token-id lists
    output_len: int


def workloads(tiny: bool, rng, only: set | None) -> list[Workload]:
    V = 500 if tiny else 150000
    scale = 64 if tiny else 1

    def prompt(n):
        return rng.integers(3, V, size=n).tolist()

    out = [Workload("seed", [prompt(16384 // scale) for _ in range(8)], 256 // (8 if tiny else 1))]
    for c in (1, 2, 4, 8, 16, 32):
        out.append(Workload(f"conc-{c}", [prompt(4096 // scale) for _ in range(c)], 128 // (8 if tiny else 1)))
    shared = prompt(3072 // scale)
    out.append(Workload("shared-prefix", [shared + prompt(1024 // scale) for _ in range(16)], 128 // (8 if tiny else 1)))
    return [w for w in out if not only or w.name in only]


# ---------------------------------------------------------------- floors
def matmul_tflops(device) -> float:
    if device == "cpu":
        return 0.1
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t0) / 1e12


def fp8_matmul_tflops(device) -> float:
    """torch._scaled_mm's e4m3 rate (row-wise scales, bf16 out) on 8192^3: the fp8 prefill floor's rate."""
    if device == "cpu":
        return 0.1
    a = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(8192, 1, device=device), torch.ones(1, 8192, device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        mm()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t0) / 1e12


def copy_gbps(device) -> float:
    if device == "cpu":
        return 10.0
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * n / (time.perf_counter() - t0) / 1e9


def model_numbers(cfg: ModelConfig, kv_dtype: str = "bf16") -> tuple[float, float, float]:
    """(parameters, weight bytes a decode step reads in bf16, KV bytes a token in kv_dtype, scales included)."""
    E, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = E * (H + 2 * Hkv) * D + H * D * E + 3 * E * F
    params = L * per_layer + 2 * V * E
    weight_bytes = 2 * (L * per_layer + V * E)  # the embedding is gathered, the lm_head read whole
    return params, weight_bytes, page_bytes(L, Hkv, D, 1, kv_dtype)


def floors(w: Workload, cfg: ModelConfig, tflops: float, gbps: float, weight_bytes: float | None = None,
           kv_dtype: str = "bf16", attn_tflops: float | None = None) -> tuple[float, float, float]:
    """(ttft floor: prompts one after another, the mean finish; all prompts prefilled; tpot floor in ms). tflops: the
    weights' matmul rate (bf16, or e4m3 for fp8 weights); attn_tflops: attention's (its bf16 matmuls; default
    tflops). weight_bytes: what a decode step reads of the weights in their format (default: bf16); kv_dtype: the KV
    cache's (IR name)."""
    params, bf16_bytes, kv_token = model_numbers(cfg, kv_dtype)
    weight_bytes = bf16_bytes if weight_bytes is None else weight_bytes
    attn = lambda n: 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n / 2  # noqa: E731 (causal)
    attn_tflops = tflops if attn_tflops is None else attn_tflops
    times = [2 * params * len(p) / (tflops * 1e12) + attn(len(p)) / (attn_tflops * 1e12) for p in w.prompts]
    finish = np.cumsum(times)
    steps = [(weight_bytes + kv_token * sum(len(p) + i for p in w.prompts)) / (gbps * 1e9) for i in range(w.output_len)]
    return float(finish.mean()), float(finish[-1]), 1e3 * float(np.mean(steps))


# ---------------------------------------------------------------- the runs
def run_engine(engine: Engine, w: Workload) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.engine_config.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in w.prompts]
    first, last, count, steps = {}, {}, {r: 0 for r in rids}, []
    while engine.has_unfinished():
        before = time.perf_counter() - t0
        out = engine.run_step()
        now = time.perf_counter() - t0
        steps.append((before, now))
        for d in out.deltas:
            first.setdefault(d.request_id, now)
            last[d.request_id] = now
            count[d.request_id] += len(d.token_ids)
    wall = time.perf_counter() - t0
    for r in rids:
        engine.release(r)
    ttft = np.array([first[r] for r in rids])
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in rids if count[r] > 1]
    # decode steps with every request running: after the last first token, while none has finished
    done = min(last.values())
    decode = [b - a for a, b in steps if a >= ttft.max() and b < done]
    return dict(ttft=ttft, tpot_ms=1e3 * float(np.mean(tpot)) if tpot else float("nan"),
                decode_step_ms=1e3 * float(np.median(decode)) if decode else float("nan"),
                output_tok_s=sum(count.values()) / wall, prefilled_s=float(ttft.max()), wall_s=wall)


class TokenTimes:
    """A transformers streamer that stamps each put: the prompt, then every generated token (generate hands it
    the tokens on the host, so each stamp follows the GPU's work)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model, w: Workload, device) -> dict:
    """Static batching: the prompts (equal lengths here) prefilled together, then decoded together, in one
    generate: TTFT is its first token's time, TPOT the time from the first token to the last a token (after an
    untimed short generate that takes the first call's one-off costs)."""
    ids = torch.tensor(w.prompts, dtype=torch.int64, device=device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    stamps = TokenTimes()
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, min_new_tokens=2, **kw)
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=w.output_len, min_new_tokens=w.output_len,
                             streamer=stamps, **kw)
        sync()
        wall = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    first, last = stamps.times[1], stamps.times[-1]  # times[0]: the prompt
    ttft = first - t0
    tpot = 1e3 * (last - first) / max(1, w.output_len - 1)
    return dict(ttft=np.full(len(w.prompts), ttft), tpot_ms=tpot, decode_step_ms=tpot, output_tok_s=n / wall,
                prefilled_s=ttft, wall_s=wall)


def llama_cpp_runs(bin_dir: Path, gguf: Path, wls: list[Workload], log_dir: Path) -> dict[str, dict]:
    """llama-batched-bench -no-kvu -fa on over the GGUF: the seed workload in one call, the conc-N sweep (4K prompts,
    128 outputs) in another; {workload name: run dict}. TTFT = all prompts prefilled (T_PP), the decode step =
    T_TG / TG (a step decodes every sequence), output tok/s = B * TG / T."""
    import re
    import subprocess

    out = {}
    calls = []
    seed = [w for w in wls if w.name == "seed"]
    conc = [w for w in wls if w.name.startswith("conc-")]
    for group in (seed, conc):
        if not group:
            continue
        pp, tg = len(group[0].prompts[0]), group[0].output_len
        npl = [len(w.prompts) for w in group]
        calls.append((group, [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(max(npl) * (pp + tg + 8)),
                              "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg),
                              "-npl", ",".join(map(str, npl)), "-ngl", "99", "-fa", "on", "-no-kvu"]))
    for group, cmd in calls:
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (log_dir / f"llama-cpp-{gguf.stem}-{group[0].name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            print(f"llama.cpp failed ({proc.returncode}): {proc.stderr[-2000:]}", flush=True)
            continue
        for line in proc.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 10 or not re.fullmatch(r"\d+", cells[0]):
                continue
            pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
            t_pp, t_tg, t = float(cells[4]), float(cells[6]), float(cells[8])
            w = next((w for w in group if len(w.prompts) == b), None)
            if w is None:
                continue
            step = 1e3 * t_tg / tg
            out[w.name] = dict(ttft=np.full(b, t_pp), tpot_ms=step, decode_step_ms=step, output_tok_s=b * tg / t,
                               prefilled_s=t_pp, wall_s=t)
    return out


def hf_model(cfg: ModelConfig, device: str, dtype):
    import transformers as tf

    hcfg = tf.Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                          max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False)
    hcfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in the serving dtype, on the device (transformers' init)
    try:
        with torch.device(device):
            model = tf.Qwen3ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def row(w: Workload, impl: str, weights: str, r: dict, fl: tuple, kv_cache_dtype: str) -> dict:
    ttft_floor, prefill_floor, tpot_floor = fl
    return dict(workload=w.name, impl=impl, weights=weights, kv_cache_dtype=kv_cache_dtype, requests=len(w.prompts),
                prompt_len=len(w.prompts[0]),
                output_len=w.output_len, ttft_mean_s=round(float(r["ttft"].mean()), 4),
                ttft_p99_s=round(float(np.percentile(r["ttft"], 99)), 4), tpot_ms=round(r["tpot_ms"], 3),
                decode_step_ms=round(r["decode_step_ms"], 3),
                output_tok_s=round(r["output_tok_s"], 2), prefilled_s=round(r["prefilled_s"], 4),
                wall_s=round(r["wall_s"], 3), ttft_floor_s=round(ttft_floor, 4), prefill_floor_s=round(prefill_floor, 4),
                tpot_floor_ms=round(tpot_floor, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results", help="folder for serving-<date>.json/.md/.png")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a toy model and short prompts (smoke test)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    ap.add_argument("--workloads", default="", help="comma list (default: all: seed, conc-N, shared-prefix)")
    ap.add_argument("--weights", default="bf16", help=f"comma list of {WEIGHTS}")
    ap.add_argument("--gguf", action="append", default=[], metavar="FMT=PATH",
                    help="a GGUF of the model in FMT (q8_0, q4_k: this runtime loads it; any FMT: llama.cpp's row)")
    ap.add_argument("--llama-cpp", metavar="BIN_DIR", help="llama.cpp's build/bin (llama-batched-bench) for its rows")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the runtime's KV cache (default auto: the model's, bf16 on cuda); HF and llama.cpp keep theirs")
    ap.add_argument("--rerender", metavar="JSON", help="rebuild the table and plot from a run's JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        meta = json.loads(Path(args.rerender).read_text())
        return report(meta, out)
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {IMPLS}")
    formats = [f for f in args.weights.split(",") if f]
    bad = [f for f in formats if f not in WEIGHTS]
    if bad:
        ap.error(f"--weights: unknown {bad}; choose from {WEIGHTS}")
    ggufs = {}
    for spec in args.gguf:
        fmt, _, path = spec.partition("=")
        if fmt not in WEIGHTS or not path:
            ap.error(f"--gguf: want FMT=PATH with FMT in {WEIGHTS}, got {spec!r}")
        ggufs[fmt] = path
    if "q4_k" in formats and "q4_k" not in ggufs:
        ap.error("--weights q4_k needs --gguf q4_k=PATH (a Q4_K_M GGUF: llama-quantize makes one)")
    cfg = ModelConfig(**(TINY if args.tiny else QWEN3_8B))
    rng = np.random.default_rng(0)
    wls = workloads(args.tiny, rng, set(filter(None, args.workloads.split(","))))
    tflops, gbps = matmul_tflops(args.device), copy_gbps(args.device)
    fp8_tflops = fp8_matmul_tflops(args.device) if "fp8" in formats else None
    print(f"floors: bf16 matmul {tflops:.0f} TFLOP/s, copy {gbps:.0f} GB/s"
          + (f", fp8 matmul {fp8_tflops:.0f} TFLOP/s" if fp8_tflops else ""), flush=True)
    max_len = max(len(p) for w in wls for p in w.prompts) + max(w.output_len for w in wls) + 16
    model_kv = kv_dtype_of("auto", torch.bfloat16 if args.device == "cuda" else torch.float32)
    kv_dtype = kv_dtype_of(args.kv_cache_dtype, torch.bfloat16 if args.device == "cuda" else torch.float32)
    rows, read_bytes = [], {}
    for fmt in formats:
        for impl in impls:
            if impl == "llama.cpp" or (fmt != "bf16" and impl != "uacompile-ua"):
                continue
            t0 = time.perf_counter()
            if impl.startswith("uacompile"):
                ec = EngineConfig(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                                  attention_variant="unified_masked" if impl.endswith("unified") else "ua",
                                  quantization={"fp8": "fp8", "q8_0": "q8_0"}.get(fmt, "auto"),
                                  kv_cache_dtype=args.kv_cache_dtype)
                source = load(ggufs[fmt]) if fmt in ggufs and fmt != "bf16" else LoadedModel(cfg, None, None)
                runner = Engine(source, ec, max_model_len=max_len, max_num_seqs=32,
                                **({} if args.device == "cuda" else dict(num_pages=4096)))
                del source
                read_bytes[fmt] = runner.model.decode_read_bytes()
                print(f"{impl} {fmt}: weights {runner.model.weight_formats()}, a decode step reads "
                      f"{read_bytes[fmt] / 1e9:.2f} GB of them", flush=True)
                run = lambda w, e=runner: run_engine(e, w)  # noqa: E731
            else:
                runner = hf_model(cfg, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
                run = lambda w, m=runner: run_hf(m, w, args.device)  # noqa: E731
            print(f"{impl} {fmt}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
            run(Workload("warm-up", [w.prompts[0][:256] for w in wls[:1]], 4))
            for w in wls:
                rate = fp8_tflops if fmt == "fp8" else tflops
                kv = kv_dtype if impl.startswith("uacompile") else model_kv
                r = row(w, impl, fmt, run(w), floors(w, cfg, rate, gbps, read_bytes.get(fmt), kv, tflops), kv)
                rows.append(r)
                print(json.dumps(r), flush=True)
            del runner, run  # the next implementation profiles the GPU's free memory: give this one's back first
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if "llama.cpp" in impls and args.llama_cpp:
        for fmt in formats:
            if fmt not in ggufs:
                print(f"llama.cpp {fmt}: no --gguf {fmt}=PATH, no row", flush=True)
                continue
            for name, r in llama_cpp_runs(Path(args.llama_cpp), Path(ggufs[fmt]), wls, out).items():
                w = next(w for w in wls if w.name == name)
                rows.append(row(w, "llama.cpp", fmt, r, floors(w, cfg, tflops, gbps, read_bytes.get(fmt), "fp16"),
                                "fp16"))  # llama-batched-bench's default f16 cache
                print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = dict(gpu=gpu, date=dt.date.today().isoformat(), model="Qwen3-8B architecture"
                if not args.tiny else "tiny qwen3", weights=formats, torch=torch.__version__,
                floors=dict(matmul_tflops=round(tflops, 1), copy_gbps=round(gbps, 1),
                            fp8_matmul_tflops=round(fp8_tflops, 1) if fp8_tflops else None,
                            decode_weight_gb={f: round(b / 1e9, 3) for f, b in read_bytes.items()}),
                command="UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/serving_gpu.py --out $OUT"
                + ("" if args.kv_cache_dtype == "auto" else f" --kv-cache-dtype {args.kv_cache_dtype}")
                + "' bash bench/run_device.sh",
                kv_cache_dtype=args.kv_cache_dtype, rows=rows)
    return report(meta, out)


# ---------------------------------------------------------------- the report
def target_checks(rows: list[dict]) -> list[dict]:
    by = {(r["workload"], r["impl"], r.get("weights", "bf16")): r for r in rows}
    ua, uni, hf = (by.get(("seed", i, "bf16")) for i in IMPLS[:3])
    checks = []

    def check(name, value, target, le=True):
        if value is not None and math.isfinite(value):
            checks.append(dict(target=name, value=round(value, 3), bound=target, met=value <= target if le else value >= target))

    if ua:
        check("decode step (all 8 running) / bandwidth floor <= 1.25", ua["decode_step_ms"] / ua["tpot_floor_ms"], 1.25)
        check("TPOT (first to last token, prefill steps included) / bandwidth floor", ua["tpot_ms"] / ua["tpot_floor_ms"],
              1.25)
        check("all 8 prompts prefilled / compute floor <= 1.3", ua["prefilled_s"] / ua["prefill_floor_s"], 1.3)
        check("mean TTFT / sequential floor <= 1.3", ua["ttft_mean_s"] / ua["ttft_floor_s"], 1.3)
    if ua and hf:
        check("aggregate output / HF transformers >= 3", ua["output_tok_s"] / hf["output_tok_s"], 3.0, le=False)
    if ua and uni:
        check("aggregate output / unified_masked >= 2.5", ua["output_tok_s"] / uni["output_tok_s"], 2.5, le=False)
        check("mean TTFT / unified_masked <= 0.4", ua["ttft_mean_s"] / uni["ttft_mean_s"], 0.4)
    q8, q8_lcpp = by.get(("seed", "uacompile-ua", "q8_0")), by.get(("seed", "llama.cpp", "q8_0"))
    if q8:
        check("Q8_0 seed: decode step / Q8_0 floor <= 1.2", q8["decode_step_ms"] / q8["tpot_floor_ms"], 1.2)
    if q8 and q8_lcpp:
        check("Q8_0 seed: aggregate output / llama.cpp Q8_0 >= 3", q8["output_tok_s"] / q8_lcpp["output_tok_s"], 3.0,
              le=False)
    fp8 = by.get(("seed", "uacompile-ua", "fp8"))
    if fp8:
        check("FP8 seed: all 8 prompts prefilled / FP8 matmul floor <= 1.2", fp8["prefilled_s"] / fp8["prefill_floor_s"],
              1.2)
    for (name, impl, fmt), r in sorted(by.items()):
        if impl != "uacompile-ua" or not name.startswith("conc-"):
            continue
        n = r["requests"]
        bound = 1.15 if n == 1 else 1.2
        check(f"{name} {fmt}: decode step / floor <= {bound}", r["decode_step_ms"] / r["tpot_floor_ms"], bound)
        peer = by.get((name, "llama.cpp", fmt))
        if peer:
            check(f"{name} {fmt}: decode speed / llama.cpp's >= 1.3", peer["decode_step_ms"] / r["decode_step_ms"], 1.3,
                  le=False)
    return checks


def report(meta: dict, out: Path) -> int:
    rows = meta["rows"]
    meta["targets"] = target_checks(rows)
    kv = meta.get("kv_cache_dtype", "auto")  # an 8-bit run is written beside the model-dtype one
    cols = ["workload", "impl", "weights", "kv_cache_dtype", "ttft_mean_s", "ttft_p99_s", "tpot_ms", "decode_step_ms", "output_tok_s", "ttft_floor_s",
            "tpot_floor_ms"]
    header = [f"# Serving, {meta['gpu']}, {meta['date']}", "", f"Model: {meta['model']}. Floors measured in the run: "
              f"bf16 matmul {meta['floors']['matmul_tflops']} TFLOP/s, copy {meta['floors']['copy_gbps']} GB/s.", "",
              f"Command: `{meta['command']}`", "", *([meta["note"], ""] if meta.get("note") else [])]
    write_report(out / f"serving-{meta['date']}{'' if kv == 'auto' else '-kv-' + kv}", meta, header, cols,
                 lambda r, c: str(r.get(c, "bf16" if c == "weights" else "")), plot)
    return 0


def write_report(stem: Path, meta: dict, header: list[str], cols: list[str], cell, plot_fn) -> None:
    """A benchmark's files: stem.json (meta), stem.md (header, a table of meta's rows in cols with cell(row, col),
    then meta's targets; also printed) and stem.png (plot_fn(meta, path), skipped without matplotlib)."""
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    lines = [*header, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in meta["rows"]]
    lines += ["", "## Targets", "", "| target | value | met |", "|---|---:|---|"]
    lines += [f"| {c['target']} | {c['value']} | {'yes' if c['met'] else 'no'} |" for c in meta["targets"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot_fn(meta, stem.with_suffix(".png"))
    except ImportError:
        print("(matplotlib not installed: no plot)")


def plot(meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = meta["rows"]
    series = sorted({(r["impl"], r.get("weights", "bf16")) for r in rows},
                    key=lambda s: (IMPLS.index(s[0]) if s[0] in IMPLS else 99, s[1]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    conc = sorted({r["requests"] for r in rows if r["workload"].startswith("conc-")})
    for impl, fmt in series:
        rs = {r["requests"]: r for r in rows if r["impl"] == impl and r.get("weights", "bf16") == fmt
              and r["workload"].startswith("conc-")}
        xs = [c for c in conc if c in rs]
        ls = "--" if impl == "llama.cpp" else "-"
        axes[0].plot(xs, [rs[c]["output_tok_s"] for c in xs], marker="o", ls=ls, label=f"{impl} {fmt}")
        axes[1].plot(xs, [rs[c]["ttft_mean_s"] for c in xs], marker="o", ls=ls, label=f"{impl} {fmt}")
    axes[0].set(xscale="log", yscale="log", xlabel="concurrent requests (4K prompts)", ylabel="output tok/s",
                title="Throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent requests (4K prompts)", ylabel="mean TTFT (s)",
                title="Time to first token")
    seed = [r for r in rows if r["workload"] == "seed"]
    if seed:
        x = np.arange(len(seed))
        axes[2].bar(x - 0.27, [r["decode_step_ms"] for r in seed], 0.27, label="decode step (ms)")
        axes[2].bar(x, [r["tpot_ms"] for r in seed], 0.27, label="TPOT (ms)")
        axes[2].bar(x + 0.27, [r["ttft_mean_s"] * 1e3 for r in seed], 0.27, label="mean TTFT (ms)")
        axes[2].scatter(x - 0.27, [r["tpot_floor_ms"] for r in seed], color="k", marker="_", s=200, zorder=3,
                        label="decode floor (its format)")
        axes[2].axhline(seed[0]["ttft_floor_s"] * 1e3, color="grey", ls=":", lw=1, label="TTFT floor")
        axes[2].set_xticks(x, [f"{r['impl']}\n{r.get('weights', 'bf16')}" for r in seed], fontsize=7)
        axes[2].set(yscale="log", ylabel="ms", title="Seed: 8 x 16K prompts, 256 outputs")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"uacompile serving, {meta['gpu']}, {meta['date']} ({meta['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
