"""`uacompile bench serve`: load-test an OpenAI-compatible server the way `vllm bench serve` does.

For each concurrency level, num_prompts streaming requests go out (at most `concurrency` in flight,
optionally paced by a Poisson process of `request_rate` requests/s); each response's chunks give
time to first token (TTFT), inter-token latencies (ITL) and time per output token
(TPOT = (e2e - TTFT) / (output tokens - 1)). Reported per level: p50 / p99 / mean of each, request
and output-token throughput, and goodput (requests/s meeting every SLO of --goodput). Writes JSON
and a matplotlib plot.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = ("the a little big dog cat girl boy park tree sun day happy sad ran saw went played with friend "
         "mom dad house ball red blue green bird fish sky water box toy car book said looked wanted "
         "one time once upon there was named lily tom ben sue jump run walk fast slow").split()


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def add_arguments(p) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    p.add_argument("--dataset", default="random", help="random | shared-prefix | FILE (.jsonl with 'prompt', "
                   "a JSON list of strings, or text with one prompt a line)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (random datasets)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf = all at once")
    p.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"], metavar="METRIC:MS",
                   help="SLOs for goodput: ttft, tpot, itl, e2e in ms (default ttft:1000 tpot:100)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore_eos)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default="bench-serve.json", help="JSON results")
    p.add_argument("--plot", default="bench-serve.png", help="plot file ('' for none)")


# ---- inputs -------------------------------------------------------------------------------------
def make_prompts(dataset: str, num: int, input_len: int, seed: int = 0) -> list[str]:
    if num < 1 or input_len < 1:
        raise ValueError(f"--num-prompts and --input-len must be >= 1, got {num} and {input_len}")
    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    if dataset == "random":
        return [words(input_len) for _ in range(num)]
    if dataset == "shared-prefix":
        prefix = words(max(1, input_len * 3 // 4))
        return [f"{prefix} {words(max(1, input_len - input_len * 3 // 4))}" for _ in range(num)]
    path = Path(dataset)
    if not path.is_file():
        raise ValueError(f"--dataset must be random, shared-prefix or a file; {dataset!r} is none of them")
    text = path.read_text()
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        prompts = json.loads(text)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{path}: no prompts (want strings)")
    return [prompts[i % len(prompts)] for i in range(num)]


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, sep, val = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "itl", "e2e"):
            raise ValueError(f"--goodput expects ttft|tpot|itl|e2e:MS, got {item!r}")
        try:
            slos[key] = float(val) / 1e3
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {val!r} is not a number of ms") from None
    return slos


# ---- one request --------------------------------------------------------------------------------
def _payload(endpoint: str, model: str, prompt: str, output_len: int, ignore_eos: bool) -> dict:
    common = {"model": model, "max_tokens": output_len, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt}


def _chunk_text(obj: dict, endpoint: str) -> str:
    out = ""
    for c in obj.get("choices") or []:
        out += (c.get("delta") or {}).get("content") or "" if endpoint == "chat" else c.get("text") or ""
    return out


async def send(client, url: str, payload: dict, endpoint: str, headers: dict) -> Result:
    start = time.perf_counter()
    res, last, chunks = Result(ok=False), None, 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                now = time.perf_counter()
                if _chunk_text(obj, endpoint):
                    chunks += 1
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
    except Exception as e:  # noqa: BLE001  (a failed request is a result, not a crash)
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


# ---- one level ----------------------------------------------------------------------------------
async def run_level(url: str, endpoint: str, model: str, prompts: list[str], concurrency: int, args,
                    headers: dict) -> tuple[list[Result], float]:
    import httpx

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        async def one(prompt):
            async with sem:
                return await send(client, url.rstrip("/") + path,
                                  _payload(endpoint, model, prompt, args.output_len, not args.no_ignore_eos),
                                  endpoint, headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def summarize(results: list[Result], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok),
           "request_throughput": len(ok) / duration if duration else 0.0,
           "output_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0.0}
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration \
        if duration else 0.0
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itls], "e2e": [r.e2e for r in ok if r.e2e is not None]}
    for name, vals in series.items():
        out[f"mean_{name}_ms"] = ms(sum(vals) / len(vals)) if vals else None
        out[f"p50_{name}_ms"] = ms(_pct(vals, 50))
        out[f"p99_{name}_ms"] = ms(_pct(vals, 99))

    def meets(r):
        checks = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "itl": max(r.itls) if r.itls else None}
        return all(checks[k] is None or checks[k] <= v for k, v in slos.items())

    good = sum(1 for r in ok if meets(r))
    out["goodput"] = good / duration if duration else 0.0
    out["slo_ms"] = {k: v * 1e3 for k, v in slos.items()}
    out["errors"] = sorted({r.error for r in results if r.error})[:5]
    return out


def plot(levels: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    axes[0][0].plot(xs, [lv["output_throughput"] for lv in levels], "o-", label="output tok/s")
    axes[0][0].set_title("throughput (tok/s) and goodput (req/s)")
    good = axes[0][0].twinx()
    good.plot(xs, [lv["goodput"] for lv in levels], "s--", color="tab:orange", label="goodput (req/s)")
    good.set_ylim(bottom=0)
    good.legend(loc="lower right")
    for ax, name in ((axes[0][1], "ttft"), (axes[1][0], "tpot"), (axes[1][1], "itl")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [lv[f"{q}_{name}_ms"] or float("nan") for lv in levels], style, label=q)
        ax.set_title(f"{name.upper()} (ms)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_name(url: str, headers: dict, timeout: float) -> str:
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"{url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def main(args) -> int:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency expects comma-separated ints, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {args.concurrency!r}")
    if args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    slos = parse_slos(args.goodput)
    prompts = make_prompts(args.dataset, args.num_prompts, args.input_len, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _model_name(args.url, headers, min(args.timeout, 30))
    report = {"url": args.url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate, "levels": []}
    print(f"{'conc':>5} {'ok':>5} {'fail':>5} {'out tok/s':>10} {'goodput':>8} {'TTFT p50/p99 ms':>18} "
          f"{'TPOT p50/p99 ms':>18} {'ITL p50/p99 ms':>18}")
    for c in levels:
        results, duration = asyncio.run(run_level(args.url, args.endpoint, model, prompts, c, args, headers))
        lv = {"concurrency": c, **summarize(results, duration, slos)}
        report["levels"].append(lv)

        def pair(name):
            a, b = lv[f"p50_{name}_ms"], lv[f"p99_{name}_ms"]
            return "-" if a is None else f"{a:.1f}/{b:.1f}"

        print(f"{c:>5} {lv['completed']:>5} {lv['failed']:>5} {lv['output_throughput']:>10.1f} "
              f"{lv['goodput']:>8.2f} {pair('ttft'):>18} {pair('tpot'):>18} {pair('itl'):>18}")
        for err in lv["errors"]:
            print(f"      error: {err}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    if args.plot:
        plot(report["levels"], args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(lv["completed"] for lv in report["levels"]) else 1


__all__ = ["add_arguments", "main", "make_prompts", "summarize", "Result"]
