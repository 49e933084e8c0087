"""The server under hostile and heavy clients, on the CPU over loopback: `uacompile serve` on stories260K in a
child process, probed from this one.

    python3 bench/server_probe.py --out bench/results            # writes server-probe-<date>.json and prints rows

Rows:
  health_idle: /health latency (p50 / p99 / max, ms) with nothing else running;
  health_during_10mb_413: /health polled while 10 MB prompts are posted against the default --max-request-bytes
    (each answered 413; its latency too);
  health_during_10mb_400: the same with --max-request-bytes 16 MiB, so each 10 MB body is read, parsed off the
    event loop and refused by the prompt-length cap (400);
  streams_64: 64 concurrent streamed /v1/completions (64 tokens each, greedy, ignore_eos): end-to-end and
    time-to-first-token p50 / p99 (ms), and the KV pages still in use once they are done;
  fuzz: schemathesis cases over /openapi.json (--fuzz-cases) and the 5xx count.
The target for /health while a 10 MB prompt is refused is <= 50 ms.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "stories260K.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str], model: Path = MODEL, threads: int = 1, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`uacompile serve` on model in a child process (warnings only), once /health answers: (process, base URL)."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uacompile.cli", "serve", "--model", str(model), "--port", str(port),
                             "--cpu-threads", str(threads), "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(pct(ms, 0.99), 2),
            "max_ms": round(max(ms), 2)}


def poll_health(url: str, until: threading.Event, out: list[float]) -> None:
    import httpx

    with httpx.Client(timeout=30) as c:
        while not until.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health")
            out.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)


def health_during_big_prompts(url: str, posts: int) -> dict:
    import httpx

    body = json.dumps({"prompt": "x" * 10_000_000, "max_tokens": 1}).encode()
    lat, done = [], threading.Event()
    t = threading.Thread(target=poll_health, args=(url, done, lat))
    t.start()
    statuses, took = [], []
    with httpx.Client(timeout=120) as c:
        for _ in range(posts):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
            took.append((time.perf_counter() - t0) * 1e3)
            statuses.append(r.status_code)
    done.set()
    t.join()
    return {"health": summary(lat), "statuses": sorted(set(statuses)), "refusal": summary(took)}


def streams(url: str, n: int, tokens: int) -> dict:
    import httpx

    e2e, ttft, errors = [], [], []

    def one():
        body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        t0 = time.perf_counter()
        first = None
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as s:
                for line in s.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter()
            e2e.append((time.perf_counter() - t0) * 1e3)
            ttft.append((first - t0) * 1e3)
        except Exception as e:  # noqa: BLE001  (counted)
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.5)
    pages = httpx.get(url + "/health").json()["kv_pages_in_use"]
    return {"streams": n, "tokens": tokens, "wall_s": round(wall, 2), "e2e": summary(e2e), "ttft": summary(ttft),
            "errors": len(errors), "kv_pages_in_use_after": pages}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for server-probe-<date>.json (default: print only)")
    p.add_argument("--posts", type=int, default=5, help="10 MB prompts posted a row")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--fuzz-cases", type=int, default=2000)
    a = p.parse_args(argv)
    rows = {}
    proc, url = start(["--max-num-seqs", "64"])
    try:
        lat, done = [], threading.Event()
        t = threading.Thread(target=poll_health, args=(url, done, lat))
        t.start()
        time.sleep(2)
        done.set()
        t.join()
        rows["health_idle"] = summary(lat)
        rows["health_during_10mb_413"] = health_during_big_prompts(url, a.posts)
        rows["streams_64"] = streams(url, a.streams, a.stream_tokens)
        if a.fuzz_cases:
            from uacompile.runtime.server_openapi import fuzz

            got = fuzz(url, a.fuzz_cases)
            rows["fuzz"] = {"cases": got["cases"], "server_errors": len(got["server_errors"]),
                            "first_errors": got["server_errors"][:5]}
    finally:
        stop(proc)
    proc, url = start(["--max-request-bytes", str(16 * 2 ** 20)])
    try:
        rows["health_during_10mb_400"] = health_during_big_prompts(url, a.posts)
    finally:
        stop(proc)
    result = {"date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}", "machine": "CPU, loopback", "rows": rows}
    print(json.dumps(result, indent=1))
    if a.out:
        path = Path(a.out) / f"server-probe-{result['date']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
