"""Chrome-trace (Perfetto-viewable) recording of the engine: scheduler steps and their phases,
kernel launches (host-side time of each backend call), KV events and request lifetimes.

Tracer collects events in memory (up to max_events; later ones are counted, not kept) and write()
saves {"traceEvents": [...]} JSON. NullTracer is the same interface doing nothing, so the engine
calls it unconditionally.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

KERNEL_METHODS = ("plan_step", "reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks", "gather_tokens",
                  "kv_score")


class NullTracer:
    enabled = False

    def span(self, name: str, cat: str, **args):
        return nullcontext()

    def instant(self, name: str, cat: str, **args) -> None:
        pass

    def counter(self, name: str, **values) -> None:
        pass


class Tracer(NullTracer):
    enabled = True

    def __init__(self, max_events: int = 500_000):
        self.events: list[dict] = []
        self.max_events, self.dropped = max_events, 0
        self._t0 = time.perf_counter()
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _add(self, event: dict) -> None:
        event.setdefault("pid", self._pid)
        event.setdefault("tid", threading.get_ident() % (1 << 31))
        with self._lock:
            if len(self.events) < self.max_events:
                self.events.append(event)
            else:
                self.dropped += 1

    @contextmanager
    def span(self, name: str, cat: str, **args):
        start = self._now_us()
        try:
            yield
        finally:
            self._add({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": self._now_us() - start,
                       "args": args})

    def instant(self, name: str, cat: str, **args) -> None:
        self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self._now_us(), "args": args})

    def counter(self, name: str, **values) -> None:
        self._add({"name": name, "cat": "counter", "ph": "C", "ts": self._now_us(), "args": values})

    def to_json(self) -> dict:
        with self._lock:
            events = list(self.events)
        meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": "uacompile engine"}}]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"dropped_events": self.dropped}}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


class TracedKernels:
    """A kernel backend whose cache and attention calls are recorded as "kernel" spans."""

    def __init__(self, backend, tracer: NullTracer):
        self._backend, self._tracer = backend, tracer

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in KERNEL_METHODS:
            return attr

        def traced(*args, **kwargs):
            with self._tracer.span(name, "kernel"):
                return attr(*args, **kwargs)

        return traced
