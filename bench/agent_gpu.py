"""The story agent (examples/story_agent) against `uacompile serve`, UA kernels against the unified_masked baseline
in one run: 20 agent runs, 8-16 sessions at once, up to 128 tokens a step; per-step TTFT p50 / p99, tok/s, total.

    # on the H200, one `run` call (carry [".whl"], bench/fetch_device_wheels.sh):
    UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/agent_gpu.py --out $OUT' bash bench/run_device.sh
    # with a local GGUF or HF directory instead of the random Qwen3-8B-shaped model:
    UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/agent_gpu.py --out $OUT --model /path/model.gguf' bash bench/run_device.sh
    # CPU smoke test (stories260K, short prompts, 4 runs):
    python3 bench/agent_gpu.py --smoke --out /tmp/agent-smoke

The default model is Qwen3-8B's architecture with random bf16 weights (made on the GPU) and a synthetic byte-level
BPE vocabulary of its size, so nothing is read from disk or the network. For each attention variant the script
starts the server in-process on 127.0.0.1 (an OS-chosen port), runs the agent's sessions through the OpenAI client,
stops it and frees the GPU. Writes agent-<date>.json, .md and .png to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "story_agent"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_gpu import write_report  # noqa: E402

VARIANTS = ("ua", "unified_masked")
TARGETS = {"ttft_p99_vs_unified": 0.4, "total_vs_unified": 0.5}


def synthetic_bpe(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of vocab_size tokens: the 256 byte characters, random merges, 3 specials."""
    from uacompile.runtime.tokenizer import bpe_from_gguf_fields

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            chars.append(256 + extra)
            extra += 1
    byte_chars = [chr(c) for c in chars]
    tokens, merges, seen = list(byte_chars), [], set(byte_chars)
    rng = np.random.default_rng(seed)
    while len(tokens) < vocab_size - 3:
        a, b = tokens[rng.integers(0, min(len(tokens), 4096))], byte_chars[rng.integers(0, 256)]
        t = a + b
        if t in seen or len(t) > 12:
            continue
        seen.add(t)
        tokens.append(t)
        merges.append(f"{a} {b}")
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (vocab_size - 3) + [3] * 3
    return bpe_from_gguf_fields({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                 "tokenizer.ggml.merges": merges, "tokenizer.ggml.pre": "qwen2",
                                 "tokenizer.ggml.eos_token_id": vocab_size - 1,
                                 "tokenizer.ggml.bos_token_id": vocab_size - 3, "tokenizer.ggml.add_bos_token": False})


def model_source(spec: str):
    if spec != "qwen3-8b-random":
        return spec, spec
    from serving_gpu import QWEN3_8B

    from uacompile.runtime.loader import LoadedModel
    from uacompile.runtime.model import ModelConfig

    cfg = ModelConfig(**QWEN3_8B)
    return LoadedModel(cfg, None, synthetic_bpe(cfg.vocab_size)), "Qwen3-8B architecture (random bf16 weights)"


def serve_and_run(source, variant: str, args) -> dict:
    import uvicorn

    import agent
    from uacompile.runtime.async_engine import AsyncEngine
    from uacompile.runtime.engine import Engine, EngineConfig
    from uacompile.runtime.server import ServerConfig, build_app

    ec = EngineConfig(device=args.device, attention_variant=variant,
                      **({"cpu_threads": 1} if args.device == "cpu" else {"dtype": "bfloat16"}))
    engine = Engine(source, ec, max_model_len=args.max_model_len, max_num_seqs=max(args.sessions_list))
    app = build_app(AsyncEngine(engine, max_queue=256), ServerConfig("agent-bench"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    rows = []
    try:
        asyncio.run(agent.run_sessions(url, 1, 64, 4, scenes=1, quiet=True))  # warm-up
        for sessions in args.sessions_list:
            out = asyncio.run(agent.run_sessions(url, sessions, args.prompt_tokens, args.max_tokens, args.scenes,
                                                 temperature=0.8, runs=args.runs, quiet=True))
            row = {"variant": variant, "sessions": sessions, "runs": args.runs, **out["summary"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.should_exit = True
        thread.join(60)
        del engine, app
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return rows


def target_checks(rows: list[dict]) -> list[dict]:
    out = []
    for s in sorted({r["sessions"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["sessions"] == s}
        if set(VARIANTS) <= set(by):
            ua, uni = by["ua"], by["unified_masked"]
            for name, key, target in (("p99 TTFT / unified_masked <= 0.4", "ttft_p99_s", 0.4),
                                      ("total time / unified_masked <= 0.5", "total_s", 0.5)):
                v = ua[key] / uni[key]
                out.append({"target": f"{s} sessions: {name}", "value": round(v, 3), "met": v <= target})
    return out


def report(meta: dict, out: Path) -> Path:
    stem = out / f"agent-{meta['date']}{'-smoke' if meta['smoke'] else ''}"
    meta["targets"] = target_checks(meta["rows"])
    cols = ["variant", "sessions", "runs", "steps", "prompt_tokens_mean", "ttft_p50_s", "ttft_p99_s",
            "step_tok_s_mean", "output_tok_s", "total_s"]
    header = [f"# Story agent against uacompile serve, {meta['device']}, {meta['date']}", "",
              f"Model: {meta['model']}. {meta['runs']} agent runs a row ({meta['steps_per_run']} steps each: outline, "
              f"characters, scenes, revision), prompts of about {meta['prompt_tokens']} tokens, at most "
              f"{meta['max_tokens']} tokens a step, temperature 0.8.", "", f"Command: `{meta['command']}`", ""]

    def cell(r, c):
        v = r.get(c)
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    write_report(stem, meta, header, cols, cell, plot)
    return stem


def plot(meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for v in VARIANTS:
        rs = sorted((r for r in meta["rows"] if r["variant"] == v), key=lambda r: r["sessions"])
        xs = [r["sessions"] for r in rs]
        for ax, key, label in zip(axes, ("ttft_p99_s", "output_tok_s", "total_s"),
                                  ("p99 step TTFT (s)", "output tok/s", "total time (s)")):
            ax.plot(xs, [r[key] for r in rs], marker="o", label=v)
            ax.set(xlabel="concurrent sessions", ylabel=label, xticks=xs)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"story agent, {meta['device']}, {meta['date']} ({meta['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="qwen3-8b-random", help="qwen3-8b-random, or a GGUF file / HF directory")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="stories260K on the CPU, short prompts, 4 runs")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--sessions", default=None, help="comma list of concurrent sessions (default 8,16; smoke 2,4)")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--scenes", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    if args.smoke:
        from uacompile.models import STORIES260K
        args.device, args.model, args.runs = "cpu", str(STORIES260K), min(args.runs, 4)
        args.sessions = args.sessions or "2,4"
        args.prompt_tokens, args.max_tokens, args.scenes = min(args.prompt_tokens, 256), min(args.max_tokens, 8), 1
    args.sessions = args.sessions or "8,16"
    args.sessions_list = [int(s) for s in args.sessions.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants) or not args.sessions_list or min(args.sessions_list) < 1:
        ap.error(f"--variants from {VARIANTS}; --sessions a comma list of ints >= 1")
    args.max_model_len = (args.prompt_tokens * 3 // 2 + args.max_tokens + 256) if not args.smoke else 2048
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source, model_name = model_source(args.model)
    rows = []
    for v in variants:
        t0 = time.perf_counter()
        rows += serve_and_run(source, v, args)
        print(f"{v}: {time.perf_counter() - t0:.1f} s", flush=True)
    device = "cpu"
    if args.device == "cuda":
        import torch
        device = torch.cuda.get_device_name()
    meta = dict(device=device, date=dt.date.today().isoformat(), model=model_name, smoke=args.smoke, runs=args.runs,
                steps_per_run=3 + args.scenes, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                command="UA_SKIP_TESTS=1 UA_BENCH_SCRIPT='bench/agent_gpu.py --out $OUT' bash bench/run_device.sh"
                if not args.smoke else "python3 bench/agent_gpu.py --smoke", rows=rows)
    report(meta, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
