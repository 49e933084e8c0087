"""AsyncEngine: the Engine stepped by a background thread, requests streamed to asyncio callers.

generate() queues a request and returns a RequestStream; iterating it yields lists of StreamEvent
(each sample's new token ids, the text they add and any log-probs) as the engine produces them.
The thread owns the Engine: adds and aborts are commands it runs between steps, so abort() frees a
request's pages before the next step. Text is decoded incrementally (never splitting a UTF-8
character) and held back where it could be the start of a stop string. Each request records its
timing (time to first token, inter-token latencies, end to end), and the engine's counters and a
snapshot of the scheduler's state are published after every step for /metrics.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .engine import Engine
from .faults import StepFailed, is_unrecoverable
from .sampling import TokenLogprob
from .sequence import SamplingParams
from .tokenizer import IncrementalDecoder

log = logging.getLogger("uacompile.runtime.async_engine")


class Overloaded(Exception):
    """The request queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down, or the device failed for good)."""


@dataclass
class StreamEvent:
    index: int                       # sample index (0 .. n-1)
    token_ids: list[int]
    text: str                        # text these tokens add (may be "" while a character is incomplete)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sample 0's first event, when asked for


@dataclass
class RequestTiming:
    """Seconds on time.monotonic(); token_times are the steps that delivered tokens."""

    arrival: float
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.finished - self.arrival if self.finished is not None else None

    def as_dict(self) -> dict:
        itls = self.itls
        ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
        return {"ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "e2e_ms": ms(self.e2e),
                "itl_ms_mean": ms(sum(itls) / len(itls)) if itls else None,
                "itl_ms_max": ms(max(itls)) if itls else None,
                "prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens}


class RequestStream:
    """One request's events. Iterate with `async for events in stream`; finished when it stops."""

    def __init__(self, loop: asyncio.AbstractEventLoop, params: SamplingParams):
        self.loop, self.params = loop, params
        self.request_id: int | None = None
        self.prompt_token_ids: list[int] = []
        self.timing = RequestTiming(time.monotonic())
        self.finish_reasons: dict[int, str] = {}
        self.error: BaseException | None = None
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def _push(self, item) -> None:  # from the engine thread
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[StreamEvent]:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item


@dataclass
class _Sample:
    decoder: IncrementalDecoder | None
    sent: str = ""
    num_tokens: int = 0   # output tokens so far
    floor: int = 0        # characters no stop string may end within (min_tokens)


class _Live:
    """Engine-thread state of a request."""

    def __init__(self, stream: RequestStream, tokenizer, prompt_ids: list[int]):
        self.stream = stream
        p = stream.params
        self.samples = [_Sample(IncrementalDecoder(tokenizer, prompt_ids) if tokenizer else None)
                        for _ in range(p.n)]
        self.hold = max((len(s) for s in p.stop or []), default=1) - 1


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 256, on_finish=None):
        """max_queue: requests accepted beyond max_num_seqs before generate() raises Overloaded.
        on_finish(stream): called from the engine thread when a request completes (not on abort)."""
        self.engine = engine
        self.max_active = engine.scheduler.config.max_num_seqs + max_queue
        self.on_finish = on_finish
        self.num_active = 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0,
                         "requests_aborted": 0}
        self.finish_reasons: dict[str, int] = {}
        self.stats: dict = {}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._live: dict[int, _Live] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.dead: BaseException | None = None  # the unrecoverable error that stopped the engine
        self.on_dead = None  # on_dead(error): called from the engine thread once its requests have their error
        self._thread = threading.Thread(target=self._run, name="uacompile-engine", daemon=True)
        self._publish_stats()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the asyncio side -----------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request. Raises Overloaded when the queue is full, ValueError / TypeError for a
        request the engine refuses (prompt too long, token ids outside the vocabulary, ...)."""
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        with self._lock:
            if self.num_active >= self.max_active:
                raise Overloaded(f"server busy: {self.num_active} requests in flight (limit {self.max_active})")
            self.num_active += 1
        stream = RequestStream(asyncio.get_running_loop(), params)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("add", prompt, params, priority, stream, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller went away; the engine thread may add it anyway
            fut.add_done_callback(self._undo_add)
            raise
        except BaseException:
            self._release_slot()
            raise
        return stream

    def _undo_add(self, fut: concurrent.futures.Future) -> None:
        if fut.cancelled():
            return  # never added; the engine thread released the slot
        if fut.exception() is None:
            self._command(("abort", fut.result()))
        else:
            self._release_slot()

    def abort(self, stream: RequestStream) -> None:
        """Stop a request and free its pages (before the engine's next step)."""
        if stream.request_id is not None and not stream.done:
            self._command(("abort", stream.request_id))

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (a drain that timed out), freeing their pages."""
        self._command(("fail_all", error))

    async def inspect(self, fn):
        """fn(engine)'s result, run on the engine thread between steps (a consistent read of its state)."""
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._command(("inspect", fn, fut))
        return await asyncio.wrap_future(fut)

    def _command(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _release_slot(self) -> None:
        with self._lock:
            self.num_active -= 1

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._wake.clear()
            self._drain()
            if not eng.has_unfinished():
                self._publish_stats()
                self._wake.wait(0.5)
                continue
            try:
                out = eng.run_step()
            except Exception as e:
                if is_unrecoverable(e):
                    self._die(e)
                    return
                # a bug, not a bad request: fail the requests the step held and keep serving
                rids = e.request_ids if isinstance(e, StepFailed) else list(self._live)
                log.exception("engine step failed; failing %d requests", len(rids))
                for rid in rids:
                    if rid in self._live:
                        self._close(rid, error=e)
                self._publish_stats()
                continue
            self._dispatch(out)
            self._publish_stats()
        for rid in list(self._live):
            self._close(rid, error=EngineDead("the server is shutting down"))
        self._drain()

    def _die(self, e: BaseException) -> None:
        """The device cannot be used again: every request gets the error, later calls EngineDead."""
        e = e.cause if isinstance(e, StepFailed) else e
        log.critical("unrecoverable device error; the engine stops: %s", e)
        self.dead = e
        self._stop = True
        err = EngineDead(f"the engine stopped after an unrecoverable device error: {e}")
        for rid in list(self._live):
            self._close(rid, error=err)
        self._drain()
        if self.on_dead is not None:
            try:
                self.on_dead(e)
            except Exception:
                log.exception("on_dead callback failed")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, prompt, params, priority, stream, fut = cmd
                if not fut.set_running_or_notify_cancel():  # the caller was cancelled first
                    self._release_slot()
                    continue
                if self._stop:
                    fut.set_exception(EngineDead("the server is shutting down"))
                    continue
                try:
                    rid = self.engine.add_request(prompt, params, priority)
                except Exception as e:
                    fut.set_exception(e)
                    continue
                req = self.engine.requests[rid]
                stream.request_id, stream.prompt_token_ids = rid, list(req.prompt_token_ids)
                stream.timing.num_prompt_tokens = len(req.prompt_token_ids)
                self.counters["prompt_tokens"] += len(req.prompt_token_ids)
                self._live[rid] = _Live(stream, self.engine.tokenizer, req.prompt_token_ids)
                fut.set_result(rid)
            elif cmd[0] == "fail_all":
                for rid in list(self._live):
                    self.engine.abort(rid)
                    self._close(rid, error=cmd[1])
            elif cmd[0] == "inspect":
                _, fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except Exception as e:  # noqa: BLE001  (the caller's to handle)
                        fut.set_exception(e)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._live:
                    self.engine.abort(rid)
                    self.counters["requests_aborted"] += 1
                    self._close(rid)

    def _close(self, rid: int, error: BaseException | None = None) -> None:
        live = self._live.pop(rid)
        if rid in self.engine.requests:
            self.engine.abort(rid)
            self.engine.release(rid)
        live.stream.timing.finished = time.monotonic()
        self._release_slot()
        live.stream._push(error)  # None ends the stream

    def _dispatch(self, out) -> None:
        now = time.monotonic()
        events: dict[int, list[StreamEvent]] = {}
        for d in out.deltas:
            live = self._live.get(d.request_id)
            if live is None:
                continue
            self.counters["generation_tokens"] += len(d.token_ids)
            events.setdefault(d.request_id, []).append(self._event(live, d))
        for rid, evs in events.items():
            live = self._live[rid]
            timing = live.stream.timing
            timing.token_times.append(now)
            timing.num_output_tokens += sum(len(e.token_ids) for e in evs)
            for e in evs:
                if e.finish_reason is not None:
                    live.stream.finish_reasons[e.index] = e.finish_reason
                    self.finish_reasons[e.finish_reason] = self.finish_reasons.get(e.finish_reason, 0) + 1
            live.stream._push(evs)
        for req_out in out.finished:
            rid = req_out.request_id
            if rid in self._live:
                self.counters["requests_finished"] += 1
                stream = self._live[rid].stream
                self._close(rid)
                if self.on_finish is not None:
                    try:
                        self.on_finish(stream)
                    except Exception:
                        log.exception("on_finish callback failed")

    def _event(self, live: _Live, d) -> StreamEvent:
        sample = live.samples[d.index]
        if sample.decoder is None:
            return StreamEvent(d.index, d.token_ids, "", d.logprobs, d.finish_reason, d.prompt_logprobs)
        sample.decoder.add(d.token_ids)
        if d.finish_reason is not None:
            visible = self.engine.output(d.request_id).outputs[d.index].text  # cut at a stop string
        else:
            visible = sample.decoder.text
            p = live.stream.params
            sample.num_tokens += len(d.token_ids)
            if sample.num_tokens < p.min_tokens:
                sample.floor = len(visible)  # the text of the first min_tokens - 1 tokens, when they are in
            cut = p.stop_cut(visible, sample.floor) if sample.num_tokens >= p.min_tokens else None
            visible = visible[:cut] if cut is not None else visible[:len(visible) - live.hold]
        text = visible[len(sample.sent):] if visible.startswith(sample.sent) else ""
        sample.sent += text
        return StreamEvent(d.index, d.token_ids, text, d.logprobs, d.finish_reason, d.prompt_logprobs)

    def _publish_stats(self) -> None:
        sch = self.engine.scheduler
        kv = sch.kv
        self.stats = {
            "num_running": len(sch.running), "num_waiting": len(sch.waiting) + sum(map(len, sch.parked.values())),
            "num_swapped": len(sch.swapped), "kv_usage": kv.usage, "num_pages": kv.num_pages,
            "pages_in_use": kv.num_pages - kv.num_free_pages - len(kv.deferred), "pages_cached": len(kv.lru),
            "num_preemptions": sch.num_preemptions, "prefix_queries": kv.prefix_query_tokens,
            "prefix_hits": kv.prefix_hit_tokens, "requests_tracked": len(self.engine.requests),
            "num_active": self.num_active}
        self.stats.update({k: v for k, v in sch.stats().items() if k not in self.stats})
