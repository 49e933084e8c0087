"""A story-writing agent on `uacompile serve`: a graph of steps (outline, characters, scenes, revision), each a
prompt synthesised from local tools over the shipped story index and streamed through the OpenAI client.

    uacompile serve --model models/stories260K.gguf --port 8000 --cpu-threads 1 &
    python examples/story_agent/agent.py --url http://127.0.0.1:8000 --sessions 4 --prompt-tokens 256 --max-tokens 32

--prompt-tokens sets how long each step's prompt is made (4096-16384 on a GPU model; a few hundred on the CPU);
--sessions N runs N stories at once and prints each step's TTFT and tok/s, then a summary line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import StoryIndex  # noqa: E402

CHARS_PER_TOKEN = 4  # a first guess; run_sessions measures the served model's ratio through /tokenize


@dataclass
class StepResult:
    session: int
    step: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tok_s: float | None
    total_s: float
    text: str = field(repr=False, default="")


def story_graph(num_scenes: int = 2) -> nx.DiGraph:
    """The steps as a DAG: outline -> characters -> scene_1 -> ... -> scene_n -> revision. Each node names the
    tools whose results its prompt carries."""
    g = nx.DiGraph()
    g.add_node("outline", tools=("summarise", "search"), ask="Write a short outline of the next chapter.")
    g.add_node("characters", tools=("lookup", "search"), ask="Describe what each character wants in this chapter.")
    g.add_edge("outline", "characters")
    prev = "characters"
    for i in range(1, num_scenes + 1):
        g.add_node(f"scene_{i}", tools=("search", "summarise"), ask=f"Write scene {i} of the chapter.")
        g.add_edge(prev, f"scene_{i}")
        prev = f"scene_{i}"
    g.add_node("revision", tools=("continuity_check", "summarise"), ask="Revise the scenes so they keep the facts.")
    g.add_edge(prev, "revision")
    return g


def synthesise(index: StoryIndex, step: str, tools: tuple, done: dict[str, str], ask: str, prompt_tokens: int,
               chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """A prompt of about prompt_tokens tokens: tool results, the earlier steps' outputs, then the request; the
    index's chapters are repeated as reference material until the budget is filled."""
    parts = [f"You are writing a children's story. Step: {step}."]
    for tool in tools:
        if tool == "summarise":
            parts.append("Earlier chapters:\n" + index.summarise())
        elif tool == "search":
            parts.append("Search results for the lighthouse key:\n" + "\n".join(index.search("lighthouse brass key")))
        elif tool == "lookup":
            parts.append("Characters:\n" + "\n".join(index.lookup(c["name"]) for c in index.characters))
        elif tool == "continuity_check":
            draft = "\n".join(done.values())
            problems = index.continuity_check(draft)
            parts.append("Continuity problems found: " + ("; ".join(problems) if problems else "none"))
    for name, text in done.items():
        parts.append(f"Output of step {name}:\n{text}")
    tail = f"\n{ask}\n"
    budget = int(prompt_tokens * chars_per_token) - len(tail)
    body = "\n\n".join(parts)
    reference = [f"Reference, chapter {c['number']} ({c['title']}): {c['text']}" for c in index.chapters]
    i = 0
    while len(body) < budget:
        body += "\n\n" + reference[i % len(reference)]
        i += 1
    return body[:max(budget, 0)] + tail


async def run_step(client, model: str, session: int, step: str, prompt: str, max_tokens: int,
                   temperature: float) -> StepResult:
    t0 = time.perf_counter()
    first = last = None
    pieces, usage = [], None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=temperature,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                pieces.append(ch.delta.content)
    end = time.perf_counter()
    n_out = usage.completion_tokens if usage else len(pieces)
    tok_s = (n_out - 1) / (last - first) if first is not None and last > first and n_out > 1 else None
    return StepResult(session, step, usage.prompt_tokens if usage else 0, n_out,
                      (first if first is not None else end) - t0, tok_s, end - t0, "".join(pieces))


async def run_session(client, model: str, session: int, index: StoryIndex, graph: nx.DiGraph, prompt_tokens: int,
                      max_tokens: int, temperature: float, chars_per_token: float = CHARS_PER_TOKEN,
                      on_step=None) -> list[StepResult]:
    done: dict[str, str] = {}
    results = []
    for step in nx.topological_sort(graph):
        node = graph.nodes[step]
        prompt = synthesise(index, step, node["tools"], done, node["ask"], prompt_tokens, chars_per_token)
        r = await run_step(client, model, session, step, prompt, max_tokens, temperature)
        done[step] = r.text
        results.append(r)
        if on_step:
            on_step(r)
    return results


def print_step(r: StepResult) -> None:
    tok_s = f"{r.tok_s:8.1f}" if r.tok_s is not None else "       -"
    print(f"session {r.session:3d}  {r.step:<11s} prompt {r.prompt_tokens:6d}  out {r.output_tokens:4d}  "
          f"TTFT {r.ttft_s * 1e3:9.1f} ms  {tok_s} tok/s", flush=True)


async def run_sessions(url: str, sessions: int, prompt_tokens: int, max_tokens: int, scenes: int = 2,
                       temperature: float = 0.8, api_key: str = "unused", model: str | None = None,
                       runs: int | None = None, quiet: bool = False) -> dict:
    """`runs` stories (default: `sessions`), at most `sessions` at once; the per-step results and a summary."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=600)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        index, graph = StoryIndex.load(), story_graph(scenes)
        ratio = await chars_per_token(url, api_key, index)
        gate = asyncio.Semaphore(sessions)

        async def one(s):
            async with gate:
                return await run_session(client, model, s, index, graph, prompt_tokens, max_tokens, temperature,
                                         ratio, None if quiet else print_step)

        t0 = time.perf_counter()
        per = await asyncio.gather(*(one(s) for s in range(runs or sessions)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    steps = [r for rs in per for r in rs]
    return {"steps": [{k: v for k, v in asdict(r).items() if k != "text"} for r in steps],
            "summary": summary(steps, wall), "stories": [rs[-1].text for rs in per]}


async def chars_per_token(url: str, api_key: str, index: StoryIndex) -> float:
    """Characters per token of the served model's tokenizer on the index's chapters (the server's /tokenize)."""
    import httpx

    sample = "\n\n".join(c["text"] for c in index.chapters)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(url.rstrip("/") + "/tokenize", json={"prompt": sample},
                            headers={"Authorization": f"Bearer {api_key}"})
        r.raise_for_status()
    return len(sample) / max(1, r.json()["count"])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summary(steps: list[StepResult], wall: float) -> dict:
    ttfts = [r.ttft_s for r in steps]
    rates = [r.tok_s for r in steps if r.tok_s is not None]
    return {"steps": len(steps), "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "step_tok_s_mean": statistics.fmean(rates) if rates else None,
            "output_tok_s": sum(r.output_tokens for r in steps) / wall, "total_s": wall,
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the uacompile serve base URL")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--sessions", type=int, default=1, help="stories written at once")
    ap.add_argument("--runs", type=int, default=None, help="stories in all (default: --sessions)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="each step's prompt length, about (4096-16384)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens a step writes at most")
    ap.add_argument("--scenes", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--json", metavar="FILE", help="write the per-step results and the summary here")
    args = ap.parse_args(argv)
    for name in ("sessions", "prompt_tokens", "max_tokens", "scenes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        out = asyncio.run(run_sessions(args.url, args.sessions, args.prompt_tokens, args.max_tokens, args.scenes,
                                       args.temperature, args.api_key, runs=args.runs))
    except Exception as e:  # noqa: BLE001  (a server that is down or refuses: one line)
        print(f"agent.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    s = out["summary"]
    print(f"{s['steps']} steps, TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms p99 {s['ttft_p99_s'] * 1e3:.1f} ms, "
          f"{s['output_tok_s']:.1f} output tok/s, {s['total_s']:.2f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
