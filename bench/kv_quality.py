"""What an 8-bit KV cache costs in quality: the 16-bit cache against fp8_e4m3 and int8 (kv_cache_dtype), on the CPU.

    python3 bench/kv_quality.py                                  # stories260K (shipped), float16 and float32 models
    python3 bench/kv_quality.py --model PATH.gguf --dtypes bfloat16 --name SmolLM2-135M-Instruct-Q4_1 --merge

Per model, model dtype and cache (auto: the model's dtype; int8; fp8_e4m3), on the tvm-cpu backend:
  perplexity   of a fixed text (TEXT), teacher-forced in chunks of 32 tokens through the paged cache, so every
               position attends the K/V the cache holds (quantised for 8 bits), its own chunk's included
  greedy       64 tokens from each of PROMPTS; against the auto cache's tokens: the leading tokens that agree
               (mean, min, and the prompts that agree on all 64) and the share of positions with the same token
Writes kv-quality-<date>.json and .md to --out (with --merge, adds to that day's file: one row per model, model
dtype and cache).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from uacompile.models import STORIES260K
from uacompile.runtime import LLM, SamplingParams
from uacompile.runtime.scheduler import ScheduledBatch
from uacompile.runtime.sequence import Sequence
from uacompile.runtime.step import device_step, host_step

CACHES = ("auto", "int8", "fp8_e4m3")
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, "
        "she saw a big red ball in the park. She ran to the ball and picked it up. A little boy came and said, "
        "\"That is my ball!\" Lily was sad, but she gave the ball back to the boy. The boy smiled and said, \"Thank "
        "you! Do you want to play with me?\" Lily was happy. They played with the ball all day. When the sun went "
        "down, Lily's mom called her home. Lily said goodbye to the boy and ran home. She told her mom about her new "
        "friend. Her mom hugged her and said, \"It is good to share.\" Lily went to bed with a big smile on her "
        "face. The next day, Lily went back to the park. The boy was there with his dog, Max. Max was a big, "
        "friendly dog who liked to run and jump. Lily, the boy and Max played together until it was time to go "
        "home. They were best friends.")
PROMPTS = ["Once upon a time", "Tom and his dog went to the park.", "Lily liked to", "One day", "The sun was hot and "
           "the sky was blue.", "There was a big tree in the garden.", "Sam had a red car.", "The cat saw a bird"]
CHUNK, NEW_TOKENS = 32, 64


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each predicted from the tokens before it through the
    engine's executor (every position's logits, chunks of CHUNK tokens on the cache's pages)."""
    ex = llm.engine.executor
    P = ex.page_size
    seq = Sequence(0, list(ids), len(ids), SamplingParams())
    seq.block_table = list(range(-(-len(ids) // P)))
    nll = []
    while seq.num_computed_tokens < len(ids) - 1:
        n = min(CHUNK, len(ids) - 1 - seq.num_computed_tokens)
        batch = ScheduledBatch(seqs=[seq], num_new_tokens=[n], sample=[True])
        ex.staging.flip()
        hs = host_step(batch, P)
        step = device_step(hs, ex.staging)
        plan = ex.kernels.plan_step(len(hs.input_ids), len(hs.page_table), hs.page_table.shape[1] * P)
        logp = torch.log_softmax(ex.model.logits(ex.forward(step, plan)), dim=-1)
        start = seq.num_computed_tokens
        target = torch.tensor(ids[start + 1:start + 1 + n])
        nll += (-logp[torch.arange(n), target]).tolist()
        seq.num_computed_tokens += n
    return math.exp(float(np.mean(nll)))


def leading(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(model: str, name: str, dtype: str, page_size: int) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rows, base = [], None
    for kv in CACHES:
        t0 = time.perf_counter()
        llm = LLM(model, cpu_threads=1, dtype=dtype, kv_cache_dtype=kv, page_size=page_size,
                  max_model_len=1024, progress=False)
        ids = llm.tokenizer.encode(TEXT)
        ppl = perplexity(llm, ids)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if base is None:
            base = tokens
        lead = [leading(a, b) for a, b in zip(base, tokens)]
        same = float(np.mean([x == y for a, b in zip(base, tokens) for x, y in zip(a, b)]))
        rows.append(dict(model=name, model_dtype=dtype, kv_cache_dtype=llm.engine.kv_dtype if kv == "auto" else kv,
                         kv_option=kv, text_tokens=len(ids), perplexity=round(ppl, 6),
                         greedy_prompts=len(PROMPTS), greedy_tokens=NEW_TOKENS,
                         lead_mean=round(float(np.mean(lead)), 2), lead_min=int(min(lead)),
                         prompts_all_agree=int(sum(n == NEW_TOKENS for n in lead)), same_position=round(same, 4),
                         leads=lead, page_bytes=page_bytes_of(llm, page_size),
                         seconds=round(time.perf_counter() - t0, 1)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "leads"}), flush=True)
    for r in rows:  # relative to the model-dtype cache's (the first row: auto)
        r["perplexity_change"] = round(r["perplexity"] / rows[0]["perplexity"] - 1, 6)
    return rows


def page_bytes_of(llm: LLM, page_size: int) -> int:
    from uacompile.runtime.memory import page_bytes

    cfg = llm.engine.model.cfg
    return page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, llm.engine.kv_dtype)


def report(meta: dict, out: Path) -> None:
    stem = out / f"kv-quality-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    cols = ["model", "model_dtype", "kv_cache_dtype", "perplexity", "perplexity_change", "lead_mean", "lead_min",
            "prompts_all_agree", "same_position", "page_bytes"]
    lines = [f"# KV cache quality, {meta['date']}", "",
             f"{meta['host']}, torch {meta['torch']}, tvm-cpu backend. Perplexity of a fixed {meta['text_words']}-word "
             f"story (teacher-forced in chunks of {CHUNK} through the paged cache); greedy: {len(PROMPTS)} prompts x "
             f"{NEW_TOKENS} tokens against the model-dtype cache (auto) of the same model and dtype: leading tokens "
             "that agree (mean, min), prompts agreeing on all of them, positions holding the same token. perplexity_change: "
             "relative to the auto cache's. page_bytes: "
             "one page of the pool, all layers, scales included.", "", f"Command: `{meta['command']}`", ""]
    for note in meta.get("notes", []):
        lines += [f"- {note}"]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in meta["rows"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def command_args(argv) -> list[str]:
    """The run's arguments for the report, its --note texts left out (the notes list holds them)."""
    args, out, skip = list(argv if argv is not None else sys.argv[1:]), [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(STORIES260K), help="a .gguf or HF folder (default: stories260K)")
    ap.add_argument("--name", default=None, help="the model's name in the rows (default: the file's stem)")
    ap.add_argument("--dtypes", default="float16,float32", help="model dtypes, comma list (default float16,float32)")
    ap.add_argument("--page-size", type=int, default=16, help="KV positions a page (default 16)")
    ap.add_argument("--out", default="bench/results", help="folder for kv-quality-<date>.json/.md")
    ap.add_argument("--merge", action="store_true",
                    help="add the rows to that day's file (rows of other models and model dtypes kept)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or Path(args.model).stem
    rows = [r for d in args.dtypes.split(",") if d for r in measure(args.model, name, d, args.page_size)]
    date = dt.date.today().isoformat()
    meta = dict(date=date, host=f"{platform.machine()} CPU", torch=torch.__version__, text_words=len(TEXT.split()),
                command=" ".join(["python3 bench/kv_quality.py", *command_args(argv)]),
                notes=list(args.note), rows=rows)
    path = out / f"kv-quality-{date}.json"
    if args.merge and path.exists():
        old = json.loads(path.read_text())
        new = {(r["model"], r["model_dtype"]) for r in rows}
        meta["rows"] = [r for r in old["rows"] if (r["model"], r["model_dtype"]) not in new] + rows
        meta["notes"] = old.get("notes", []) + [n for n in meta["notes"] if n not in old.get("notes", [])]
        meta["command"] = old["command"] + "; " + meta["command"]
    report(meta, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
