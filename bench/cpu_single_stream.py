"""Single-stream CPU speed of our runtime beside llama.cpp's, on SmolLM2-135M-Instruct Q4_1 and stories260K:

    python bench/cpu_single_stream.py --out bench/results/cpu-single-stream-DATE \\
        [--llama-cpp-python /work/scratch/lcp-venv/bin/python]

Ours: LLM(model, device="cpu") with the default tvm-cpu kernels and quantization="auto": the GGUF's Q4_1 / Q8_0
blocks stay packed and run TVM's quant_matmul kernels (steps over 16 tokens: decoded into a scratch buffer, then
torch's matmul; a float checkpoint's projections are torch matmuls), the layer ops (RMSNorm, SiLU-and-mul, RoPE),
cache write and attention TVM kernels, a decode step replaying the first one's recorded calls (runtime/cpu_decode.py);
one request at a time, greedy, EOS ignored, prefix caching off, in a fresh
process per thread count (cpu_threads = OMP_NUM_THREADS = TVM_NUM_THREADS = N). Decode tok/s: the tokens after the first over the time from
the first token to the last (SmolLM2: 128 tokens, stories260K: 256, after a short prompt); prompt tok/s: a 512-token
prompt over the time to its first token, with the engine's default scheduler (prefill in chunks of
max_prefill_chunk = 64) and with one 512-token chunk. The median of --repeats runs after a warm-up run.

llama.cpp: measured in the same run by tests/data/record_llama_cpp.py --speed-json (the same prompts and counts:
one llama_decode per generated token, one of the whole 512-token prompt) when this interpreter imports llama_cpp or
--llama-cpp-python names one that does; else read from tests/data/llama_cpp_reference.json and labelled
"recorded" with that file's date and load. Prints a table and writes --out.json and --out.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "data" / "llama_cpp_reference.json"
RECORDER = ROOT / "tests" / "data" / "record_llama_cpp.py"
PPL_TEXT = ROOT / "tests" / "data" / "ppl_text.txt"
# the same prompts and counts as record_llama_cpp.SPEED
SPEED = {
    "smollm2": {"decode_prompt": "The capital of France is", "decode_tokens": 128, "prompt_tokens": 512},
    "stories260K": {"decode_prompt": "Once upon a time", "decode_tokens": 256, "prompt_tokens": None},
}


def model_path(name: str) -> Path:
    from uacompile.models import STORIES260K, smollm2_path

    return smollm2_path() if name == "smollm2" else STORIES260K


def worker(name: str, threads: int, repeats: int) -> dict:
    """Ours, in this process (started with the thread variables set)."""
    from uacompile.runtime import LLM, SamplingParams

    cfg = SPEED[name]
    res = {"threads": threads}
    variants = [("default", {})]
    if cfg["prompt_tokens"]:
        variants.append(("chunk512", {"max_prefill_chunk": 512, "max_num_batched_tokens": 512}))
    for label, kw in variants:
        # no prefix caching: every run computes its whole prompt (the runs repeat the same prompt)
        llm = LLM(model=str(model_path(name)), device="cpu", cpu_threads=threads, progress=False,
                  log_stats_interval=0, enable_prefix_caching=False, **kw)
        eng, tok = llm.engine, llm.tokenizer

        def run(ids, n):
            """(seconds to the first token, seconds from it to the last)"""
            rid = eng.add_request(list(ids), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            t0 = time.perf_counter()
            first = None
            while eng.has_unfinished():
                eng.step()
                if first is None and eng.output(rid).outputs[0].token_ids:
                    first = time.perf_counter()
            end = time.perf_counter()
            assert len(eng.output(rid).outputs[0].token_ids) == n
            eng.release(rid)
            return first - t0, end - first

        short = tok.encode(cfg["decode_prompt"])
        if label == "default":
            decode, load = [], []
            for rep in range(repeats + 1):
                load.append(os.getloadavg()[0])
                _, dt = run(short, cfg["decode_tokens"])
                if rep:
                    decode.append((cfg["decode_tokens"] - 1) / dt)
            res.update(decode_prompt_tokens=len(short), decode_tokens=cfg["decode_tokens"],
                       decode_tok_s=round(statistics.median(decode), 2), decode_tok_s_runs=[round(x, 2) for x in decode],
                       load_avg_1min=[round(x, 2) for x in load])
        if cfg["prompt_tokens"]:
            ids = (tok.encode(PPL_TEXT.read_text()) * 4)[:cfg["prompt_tokens"]]
            prompt = []
            for rep in range(repeats + 1):
                pt, _ = run(ids, 1)
                if rep:
                    prompt.append(cfg["prompt_tokens"] / pt)
            res["prompt_tokens"] = cfg["prompt_tokens"]
            res[f"prompt_tok_s_{label}"] = round(statistics.median(prompt), 2)
            res[f"prompt_tok_s_{label}_runs"] = [round(x, 2) for x in prompt]
        del llm, eng
    return res


def ours(name: str, threads: int, repeats: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TVM_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, __file__, "--worker", name, "--threads", str(threads),
                        "--repeats", str(repeats)], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"worker {name} x{threads} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_cpp_python(arg: str | None) -> str | None:
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("llama_cpp") else None


def llama_cpp_speed(python: str | None, repeats: int) -> tuple[dict, str]:
    if python:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "speed.json"
            subprocess.run([python, str(RECORDER), "--speed-json", str(out), "--repeats", str(repeats)], cwd=ROOT,
                           check=True, capture_output=True)
            return json.loads(out.read_text()), "measured in this run"
    rec = json.loads(REFERENCE.read_text())["speed"]
    return rec, f"recorded ({REFERENCE.relative_to(ROOT)}, {rec['date_utc']} UTC, {rec['uptime']})"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count()}


def table(res: dict) -> str:
    rows = ["| model | threads | ours decode tok/s | llama.cpp decode tok/s | ours / llama.cpp | "
            "ours 512-token prompt tok/s (chunk 64 / 512) | llama.cpp 512-token prompt tok/s |",
            "|---|---|---|---|---|---|---|"]
    for name, runs in res["ours"].items():
        peer = {r["threads"]: r for r in res["llama_cpp"]["models"][name]}
        for r in runs:
            p = peer[r["threads"]]
            ratio = r["decode_tok_s"] / p["decode_tok_s"]
            prompt = (f"{r['prompt_tok_s_default']} / {r['prompt_tok_s_chunk512']}" if "prompt_tok_s_default" in r
                      else "-")
            rows.append(f"| {name} | {r['threads']} | {r['decode_tok_s']} | {p['decode_tok_s']} | {ratio:.3f} | "
                        f"{prompt} | {p.get('prompt_tok_s', '-')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2,stories260K")
    ap.add_argument("--llama-cpp-python", help="an interpreter that imports llama_cpp (measure llama.cpp in this run)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, int(a.threads), a.repeats)))
        return 0
    threads = [int(t) for t in a.threads.split(",")]
    names = a.models.split(",")
    start = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
             "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    res = {"command": "python bench/cpu_single_stream.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "start": start, "what": __doc__.split("\n\n", 2)[2].split("\n\nllama.cpp:")[0]}
    res["ours"] = {n: [ours(n, t, a.repeats) for t in threads] for n in names}
    peer, label = llama_cpp_speed(llama_cpp_python(a.llama_cpp_python), a.repeats)
    res["llama_cpp"] = {"source": label, **peer}
    res["end"] = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                  "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    t = table(res)
    print(t)
    print(f"llama.cpp: {label}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        md = [f"# Single-stream CPU speed: uacompile runtime vs llama.cpp ({start['date_utc'][:10]})", "",
              f"Command: `{res['command']}`", "",
              f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, shared with other jobs; "
              f"load at start: `{start['uptime']}`, at end: `{res['end']['uptime']}`.", "",
              f"llama.cpp: llama-cpp-python {peer.get('llama_cpp_python', '?')}, {label}.", "", t, "",
              res["what"].replace("\n", " "), ""]
        a.out.with_suffix(".md").write_text("\n".join(md))
        print(f"wrote {a.out.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
