"""Where a single-stream CPU decode step's time goes (tvm-cpu backend, greedy, one request):

    python bench/cpu_step_profile.py [--model stories260K|smollm2] [--threads 1] [--tokens 256] [--repeats 3]

Decodes --tokens tokens after a short prompt (bench/cpu_single_stream.py's) --repeats times after a warm-up, with
perf_counter timers wrapped around the step's parts: the scheduler's schedule() and update(), the executor's
execute() (inside it: host_step / device_step / the model's forward / the lm_head on the ordinary path, the decode
program's replay where there is one), sampling (Sampler.launch) and the engine's commit (ids into the sequences,
stop checks). The timers cost ~0.3 us each. Then, where the decode program recorded a tape, each of its calls is
timed alone (2000 runs, at the last step's length) and summed by kernel: the model's cost with the Python between
calls taken out. Prints per-step microseconds (the median run); the wrappers' own time is in "the rest".
Runs on any checkout of the runtime (one without cpu_decode has no tape part).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time


def wrap(obj, name: str, label: str, acc: dict) -> None:
    fn = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t

    setattr(obj, name, timed)


def tape_costs(eng) -> dict:
    """Seconds of each kind of call on the decode program's tape, each call timed alone."""
    import torch

    prog = getattr(eng.executor, "decode_program", None)
    if prog is None or not prog.tapes:
        return {}
    B = eng.kernels
    kinds = {}
    for k in [*B.fns.values(), *B.layer_fns.values(), *B.quant_kernels.values()]:
        kinds[id(k.fn)] = k.op.kind + (" (+residual)" if getattr(k.op, "residual", False) else "")
    kinds[id(B.one_token_attention().fn)] = "paged_attention"
    costs = collections.Counter()
    calls = collections.Counter()
    tape = max(prog.tapes.values(), key=lambda t: len(t.calls))
    with torch.inference_mode():
        for fn, args in tape.calls:
            name = kinds.get(id(fn)) or "torch." + getattr(getattr(fn, "func", fn), "__name__", "?")
            for _ in range(50):
                fn(*args)
            t = time.perf_counter()
            for _ in range(2000):
                fn(*args)
            costs[name] += (time.perf_counter() - t) / 2000
            calls[name] += 1
    return {k: (v, calls[k]) for k, v in costs.most_common()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stories260K", choices=["stories260K", "smollm2"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from uacompile.models import STORIES260K, smollm2_path
    from uacompile.runtime import LLM, SamplingParams
    import uacompile.runtime.executor as X

    path = STORIES260K if a.model == "stories260K" else smollm2_path()
    n = a.tokens or (256 if a.model == "stories260K" else 128)
    prompt = "Once upon a time" if a.model == "stories260K" else "The capital of France is"
    llm = LLM(model=str(path), device="cpu", cpu_threads=a.threads, progress=False, log_stats_interval=0,
              enable_prefix_caching=False)
    eng = llm.engine
    acc = collections.defaultdict(float)
    wrap(eng.scheduler, "schedule", "schedule", acc)
    wrap(eng.scheduler, "update", "scheduler.update", acc)
    wrap(eng, "_commit", "commit (ids in, stop checks)", acc)
    wrap(eng.sampler, "launch", "sampling", acc)
    wrap(eng.executor, "execute", "execute", acc)
    for name in ("host_step", "device_step"):
        wrap(X, name, "  " + name, acc)
    wrap(eng.executor, "forward", "  forward (ordinary path)", acc)
    for name in ("linear", "paged_attention", "rms_norm", "rope", "silu_and_mul", "reshape_and_cache", "embed"):
        wrap(eng.kernels, name, f"    forward: {name}", acc)  # the ordinary path's backend calls
    wrap(eng.model, "logits", "  lm_head (ordinary path)", acc)
    prog = getattr(eng.executor, "decode_program", None)
    if prog is not None:
        wrap(prog, "run", "  decode program (replay)", acc)
    ids = llm.tokenizer.encode(prompt)
    runs = []
    for rep in range(a.repeats + 1):
        rid = eng.add_request(list(ids), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        eng.step()  # the prompt
        acc.clear()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        dt = time.perf_counter() - t0
        eng.release(rid)
        if rep:
            runs.append((dt, dict(acc)))
    dt, parts = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    steps = n - 1
    us = lambda s: s / steps * 1e6  # noqa: E731
    print(f"{a.model}, {a.threads} thread(s), {steps} decode steps: {us(dt):.1f} us a step ({steps / dt:.0f} tok/s; "
          f"runs {[round((n - 1) / r[0]) for r in runs]} tok/s), load {os.getloadavg()[0]:.2f}")
    print("| part of a decode step | us a step |\n|---|---|")
    print(f"| whole step (engine.step) | {us(dt):.1f} |")
    top = [k for k in parts if not k.startswith("  ")]
    for k in sorted(parts, key=lambda k: (k.startswith("  "), -parts[k])):
        if parts[k]:
            where = "" if not k.startswith("  ") else "in execute: " if not k.startswith("    ") else "in the forward: "
            print(f"| {where}{k.strip().removeprefix('forward: ')} | {us(parts[k]):.1f} |")
    print(f"| the rest (engine glue, timers) | {us(dt - sum(parts[k] for k in top)):.1f} |")
    costs = tape_costs(eng)
    if costs:
        total = sum(v for v, _ in costs.values())
        print(f"\nthe decode program's tape, each call timed alone: {total * 1e6:.1f} us")
        print("| calls on the tape | count | us a step |\n|---|---|---|")
        for k, (v, c) in costs.items():
            print(f"| {k} | {c} | {v * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
