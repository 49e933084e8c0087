"""Helpers for the server tests: the stories260K model, an in-process server on a free loopback port."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx

from uacompile.runtime.async_engine import AsyncEngine
from uacompile.runtime.engine import Engine, EngineConfig
from uacompile.runtime.loader import models_dir
from uacompile.runtime.server import ServerConfig, build_app

ROOT = Path(__file__).resolve().parents[2]


def stories_path() -> str:
    """The repository's copy (models/), else the shared models folder; a missing model fails the test."""
    for path in (ROOT / "models" / "stories260K.gguf", models_dir() / "stories260K.gguf"):
        if path.exists():
            return str(path)
    raise FileNotFoundError("stories260K.gguf is in neither models/ nor the shared models folder "
                            "(set UACOMPILE_MODELS_DIR)")


def make_engine(**scheduler_kw) -> Engine:
    return Engine(stories_path(), EngineConfig(cpu_threads=1), **scheduler_kw)


@contextlib.contextmanager
def running_server(engine: Engine | None = None, api_key: str | None = None, max_queue: int = 256,
                   tracer=None, trace_path=None, server_kw: dict | None = None, **scheduler_kw):
    """Yields the base URL of a uvicorn server on 127.0.0.1 (an OS-chosen free port), in a thread;
    server_kw are ServerConfig fields."""
    import uvicorn

    engine = engine or make_engine(**scheduler_kw)
    aengine = AsyncEngine(engine, max_queue=max_queue)
    app = build_app(aengine, ServerConfig("stories260K", api_key, **(server_kw or {})), tracer, trace_path)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(15)


def metric(url: str, name: str, **labels) -> float:
    """One sample's value from /metrics, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} not in /metrics")


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream's data lines, up to [DONE] (included as the string)."""
    import json

    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
