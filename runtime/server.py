"""OpenAI-compatible HTTP server over AsyncEngine (FastAPI + uvicorn).

Routes: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models, /health,
/metrics (Prometheus, vLLM's metric names), llama-server's /completion, /props, /slots and /apply-template
(runtime/server_llama.py), and /tokenize, /detokenize in vLLM's
shapes (which take llama-server's `content` / `add_special` / `with_pieces` too and answer with both servers'
keys). Prompts are scored with echo + logprobs (max_tokens 0: the prompt alone) or vLLM's prompt_logprobs. A
body field the server does not implement is a 400 that names it (`user` alone is accepted and ignored). Bad
input gets a 4xx with an OpenAI-style error body; a full queue gets 503 with Retry-After; with an API key, /v1/* and
/completion want `Authorization: Bearer KEY`. A client that disconnects has its request aborted,
which frees its pages before the engine's next step. Each response carries the request's timing
(TTFT, TPOT, inter-token latency, end to end) in a `timings` field (a stream: in its last content
chunk), also logged at INFO.

No request can stall the event loop or crash a handler: bodies are application/json only and at most
`max_request_bytes` (413); JSON parsing, tokenising and chat-template rendering run in a worker
thread, after caps checked first (JSON depth, prompt characters, stop strings: 400); every error,
the framework's 404 / 405 / 422 included, has OpenAI's `{"error": {...}}` shape.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import chat, server_llama, structured, tools as toolcalls, webui
from .async_engine import AsyncEngine, EngineDead, Overloaded, RequestStream, StreamEvent
from .sequence import SamplingParams
from .server_openapi import add_request_schemas

log = logging.getLogger("uacompile.runtime.server")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


# ---- errors -------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errs = e.errors()
    err = next((x for x in errs if x.get("type") == "extra_forbidden"), errs[0])
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return f"unsupported field {loc!r}: this server does not implement it", loc
    return (f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))), (loc or None)


# ---- request bodies -----------------------------------------------------------------------------
class _Body(BaseModel):
    """A request body: a field not declared here is a 400 that names it (nothing is silently ignored)."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    min_tokens: int = 0                       # vLLM's: no EOS / stop token / stop string before this many
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string stays in the text
    user: str | None = None                   # accepted and ignored, as vLLM does
    # structured output (runtime/structured.py): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None         # llama.cpp's GBNF or a Lark grammar
    # KV eviction (SamplingParams.kv_budget): cached tokens kept (an int) or a share of the prompt (a float in (0, 1])
    kv_budget: int | float | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False            # with logprobs: the prompt's tokens' too (max_tokens 0 scores the prompt alone)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the k most likely, per choice


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: str
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str
    function: NamedFunction


class ChatBody(_Sampling):
    messages: list[Message]
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class LlamaCppBody(_Body):
    prompt: str | list[int]
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = []
    stream: bool = False
    ignore_eos: bool = False
    n_probs: int = 0
    grammar: str | None = None                # GBNF
    json_schema: dict[str, Any] | None = None


class TokenizeBody(_Body):
    """vLLM's /tokenize (prompt or messages, add_special_tokens) and llama-server's (content, add_special)."""
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: token_strs, each token's text
    with_pieces: bool = False        # llama-server's: tokens as [{"id", "piece"}]


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


# ---- metrics ------------------------------------------------------------------------------------
class ServerMetrics:
    """vLLM's metric names in a registry of the server's own."""

    def __init__(self, aengine: AsyncEngine, model_name: str):
        self.aengine, self.model_name = aengine, model_name
        self.registry = CollectorRegistry(auto_describe=True)

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s)")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between successive output tokens (s)")
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Mean time per output token of a request (s)")
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds", "Mean time per output token of a request (s)")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (s)")
        token_buckets = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens of a request", token_buckets)
        self.gen_len = hist("vllm:request_generation_tokens", "Generated tokens of a request", token_buckets)
        self.registry.register(self)

    def observe(self, stream: RequestStream) -> None:
        t = stream.timing
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        for itl in t.itls:
            self.itl.observe(itl)
        if t.tpot is not None:
            self.tpot.observe(t.tpot)
            self.tpot_legacy.observe(t.tpot)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
        self.prompt_len.observe(t.num_prompt_tokens)
        self.gen_len.observe(t.num_output_tokens)
        log.info("request %s: %s", stream.request_id, t.as_dict())

    def describe(self):
        return []

    def collect(self):
        s, c, m = self.aengine.stats, self.aengine.counters, [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            k = CounterMetricFamily(name, doc, labels=["model_name"])
            k.add_metric(m, value)
            return k

        yield gauge("vllm:num_requests_running", "Requests running on the engine", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run", s["num_waiting"])
        yield gauge("vllm:num_requests_swapped", "Requests swapped to the CPU pool", s["num_swapped"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full); cached free pages count as free",
                    s["kv_usage"])
        yield gauge("uacompile:kv_pages_in_use", "KV pages held by requests", s["pages_in_use"])
        yield gauge("uacompile:kv_pages_cached", "Free KV pages kept for the prefix cache", s["pages_cached"])
        yield gauge("uacompile:kv_pages_total", "KV pages on the device", s["num_pages"])
        yield gauge("uacompile:requests_tracked", "Requests the engine keeps state for", s["requests_tracked"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s["prefix_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s["prefix_hits"])
        yield counter("vllm:num_preemptions", "Preemptions", s["num_preemptions"])
        by_tier = CounterMetricFamily("uacompile:prefix_cache_hits_by_tier",
                                      "Prompt tokens found in the prefix cache, by tier (gpu, cpu: the offload tier)",
                                      labels=["model_name", "tier"])
        by_tier.add_metric([self.model_name, "gpu"], s["prefix_hits_gpu"])
        by_tier.add_metric([self.model_name, "cpu"], s["prefix_hits_cpu"])
        yield by_tier
        yield counter("uacompile:kv_pages_offloaded", "KV pages copied to the CPU offload tier", s["pages_offloaded"])
        yield counter("uacompile:kv_pages_restored", "KV pages restored from the CPU offload tier", s["pages_restored"])
        yield counter("uacompile:recomputed_tokens", "Tokens computed again after a preemption", s["recomputed_tokens"])
        yield counter("uacompile:offload_pages_evicted", "Offload tier entries evicted to make room",
                      s["offload_pages_evicted"])
        yield counter("uacompile:offload_pages_not_saved", "Pages the offload tier had no room for (recomputed)",
                      s["offload_pages_not_saved"])
        yield counter("uacompile:offload_pages_not_ready", "Tier lookups stopped at a copy not finished (recomputed)",
                      s["offload_pages_not_ready"])
        yield gauge("uacompile:offload_pages_used", "CPU offload tier pages holding KV", s["offload_pages_used"])
        yield counter("uacompile:kv_evictions", "KV evictions to a sequence's kv_budget", s["num_evictions"])
        yield counter("uacompile:kv_evicted_tokens", "Cached tokens dropped by KV eviction", s["evicted_tokens"])
        yield counter("uacompile:kv_compactions", "KV-cache compactions", s["num_compactions"])
        yield gauge("uacompile:kv_fragmentation", "1 - live pages / (highest live page + 1)", s["fragmentation"])
        yield counter("vllm:prompt_tokens", "Prompt tokens admitted", c["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated", c["generation_tokens"])
        done = CounterMetricFamily("vllm:request_success", "Finished samples by reason",
                                   labels=["model_name", "finished_reason"])
        for reason, count in sorted(self.aengine.finish_reasons.items()):
            done.add_metric([self.model_name, reason], count)
        yield done
        yield counter("uacompile:requests_aborted", "Requests aborted (client gone)", c["requests_aborted"])


# ---- helpers ------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_n: int = 16
    max_request_bytes: int = 4 * 2 ** 20   # a longer body gets 413 before it is read on
    max_json_depth: int = 64                # nesting of arrays / objects in a body
    max_stop_strings: int = 32
    max_stop_chars: int = 256               # of one stop string
    max_prompt_chars: int | None = None     # default: max_model_len x the longest token's text x 2
    model_path: str | None = None           # what /props reports

    def __post_init__(self):
        for name in ("max_n", "max_request_bytes", "max_json_depth", "max_stop_strings", "max_stop_chars"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _now() -> int:
    return int(time.time())


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _sse_response(served, streams, rid: str, obj: str, model: str, body, head: list, choices_of):
    """The SSE stream of an OpenAI response, as OpenAI sends it: a chunk a head choice, then each step's
    choices_of(i, events) (nothing when empty), [DONE]. The last chunk that finishes a choice also carries the
    requests' `timings`. With stream_options.include_usage every chunk has `usage: null` and a last chunk with
    empty choices has the usage; with continuous_usage_stats too (vLLM's option) every chunk has the usage so
    far. The requests are aborted when the stream ends or the client goes."""
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)
    prompt_tokens = sum(s.timing.num_prompt_tokens for s in streams)

    def chunk(choices, completion_tokens: int) -> dict:
        c = {"id": rid, "object": obj, "created": _now(), "model": model, "choices": choices}
        if continuous:
            c["usage"] = _usage(prompt_tokens, completion_tokens)
        elif include_usage:
            c["usage"] = None
        return c

    async def events():
        generated = 0
        held = None  # a chunk that finishes a choice waits for the next one: the last gets the timings
        try:
            for choice in head:
                yield _sse(chunk([choice], 0))
            async for i, evs in served.merged(streams):
                generated += sum(len(e.token_ids) for e in evs)
                choices = choices_of(i, evs)
                if not choices:
                    continue
                if held is not None:
                    yield _sse(held)
                    held = None
                c = chunk(choices, generated)
                if any(ch.get("finish_reason") for ch in choices):
                    held = c
                else:
                    yield _sse(c)
            if held is not None:
                held["timings"] = served.timings(streams)
                yield _sse(held)
                held = None
            if include_usage:
                yield _sse({**chunk([], generated), "usage": served.usage(streams)})
            yield b"data: [DONE]\n\n"
        except APIError as e:
            if held is not None:
                yield _sse(held)
            yield _sse({"error": {"message": e.message, "type": e.type}})
            yield b"data: [DONE]\n\n"
        finally:
            served.abort(streams)

    return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(served.abort, streams))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _collect(served, streams, index_of) -> dict:
    """{choice index: its events} of a whole (non-streaming) response; index_of(stream, event) -> choice index."""
    got: dict[int, list] = {}
    try:
        async for i, evs in served.merged(streams):
            for e in evs:
                got.setdefault(index_of(i, e), []).append(e)
    finally:
        served.abort(streams)
    return got


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be longer than `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}",
                       code="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is longer than the limit of {limit} bytes",
                           code="request_too_large")
        parts.append(part)
    return b"".join(parts)


def _json_depth_over(data, limit: int) -> bool:
    """Whether arrays / objects nest deeper than `limit` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _parse_body(raw: bytes, model: type[BaseModel], max_depth: int):
    """The validated body (run in a worker thread: parsing a few MB takes a while)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if _json_depth_over(data, max_depth):
        raise APIError(400, f"the request body nests deeper than {max_depth} levels")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param) from None


def _longest_token_chars(tokenizer, vocab_size: int) -> int:
    longest = 1
    for t in range(vocab_size):
        try:
            longest = max(longest, len(tokenizer.token_text(t)))
        except Exception:  # noqa: BLE001  (a token without text bounds nothing)
            continue
    return longest


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out = {}
    for k, v in raw.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
    return out


def _params(**kw) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None


class _Served:
    """Shared handler logic: prompt encoding, admission, collection of events."""

    def __init__(self, aengine: AsyncEngine, cfg: ServerConfig):
        self.aengine, self.cfg = aengine, cfg
        self.engine = aengine.engine
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.scheduler.config.max_model_len
        self.max_prompt_chars = cfg.max_prompt_chars
        if self.max_prompt_chars is None:
            # more characters need more tokens than the context holds (the 2 leaves room for normalisation)
            longest = _longest_token_chars(self.tokenizer, self.engine.model.cfg.vocab_size) if self.tokenizer else 1
            self.max_prompt_chars = self.max_model_len * longest * 2

    async def body(self, request: Request, model: type[BaseModel]):
        """The request's body as `model`: application/json only, size-capped, parsed off the event loop."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"the request body must be application/json, got {ctype or 'no content-type'!r}",
                           code="unsupported_media_type")
        raw = await _read_body(request, self.cfg.max_request_bytes)
        return await asyncio.to_thread(_parse_body, raw, model, self.cfg.max_json_depth)

    def check_chars(self, n: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {n} characters; at most {self.max_prompt_chars} can fit this "
                                f"model's context of {self.max_model_len} tokens", param=param)

    def check_stop(self, stop) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.cfg.max_stop_strings:
            raise APIError(400, f"stop has {len(stops)} strings; at most {self.cfg.max_stop_strings} are allowed",
                           param="stop")
        long = next((s for s in stops if len(s) > self.cfg.max_stop_chars), None)
        if long is not None:
            raise APIError(400, f"a stop string has {len(long)} characters; at most {self.cfg.max_stop_chars} "
                                f"are allowed", param="stop")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.cfg.model_name!r}",
                           param="model", code="model_not_found")

    def _encode(self, prompt) -> list[int]:
        try:
            return self.engine.encode_prompt(prompt)[1]
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="prompt") from None

    async def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text or ids), tokenised in a worker thread after the length cap."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
        elif isinstance(prompt, list) and len(prompt) > self.max_model_len:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                f"{self.max_model_len} tokens", param="prompt")
        return await asyncio.to_thread(self._encode, prompt)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """The tokenizer's ids of a text (no vocabulary or emptiness checks), in a worker thread after the cap."""
        self.check_chars(len(text), "prompt")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str:
        V = self.engine.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {V})", param="tokens")
        if len(ids) > self.max_model_len:
            raise APIError(400, f"{len(ids)} tokens; at most this model's context of {self.max_model_len}",
                           param="tokens")
        return await asyncio.to_thread(self.tokenizer.decode, ids)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                          tools: toolcalls.ToolConfig | None = None) -> list[int]:
        """Token ids of a chat (with its tools, and earlier tool calls and results, as runtime/tools.py readies them):
        the template rendered and tokenised in a worker thread after the length cap."""
        chars = 0
        for m in messages:
            c = m.get("content")
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):
                chars += sum(len(p["text"]) for p in c if isinstance(p.get("text"), str))
        self.check_chars(chars, "messages")

        def work():
            try:
                names = chat.template_names(self.tokenizer)
                ready = toolcalls.prompt_messages(messages, tools, names)
                text = chat.render(self.tokenizer, ready, add_generation_prompt,
                                   tools.tools if tools is not None and "tools" in names else None)
                ids = chat.encode(self.tokenizer, text)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param="messages") from None
            self._encode(ids)  # vocabulary and emptiness checks
            return ids

        return await asyncio.to_thread(work)

    async def compile_guide(self, guide: structured.Guide | None, param: str | None) -> None:
        """Compile a structured-output guide in a worker thread (cached; the engine then finds it compiled)."""
        if guide is None:
            return
        try:
            await asyncio.to_thread(self.engine.compile_guide, guide)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                f"{self.max_model_len} tokens", param="prompt")
        if requested is None:
            return min(default, room) if default is not None else room
        if requested > room:
            raise APIError(400, f"max_tokens={requested} with a {prompt_len}-token prompt exceeds the "
                                f"context of {self.max_model_len} tokens (at most {room})", param="max_tokens")
        return requested

    def check_n(self, n: int) -> None:
        if n > self.cfg.max_n:
            raise APIError(400, f"n must be at most {self.cfg.max_n}, got {n}", param="n")

    async def start(self, prompts: list[list[int]], params: SamplingParams, priority: int) -> list[RequestStream]:
        streams = []
        try:
            for ids in prompts:
                streams.append(await self.aengine.generate(ids, params, priority))
        except Overloaded as e:
            self.abort(streams)
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": str(e.retry_after)}) from None
        except EngineDead as e:
            self.abort(streams)
            raise APIError(503, str(e), "server_unavailable") from None
        except (ValueError, TypeError) as e:
            self.abort(streams)
            raise APIError(400, str(e)) from None
        return streams

    async def inspect(self, fn):
        """fn(engine) on the engine thread (a consistent read of its state)."""
        try:
            return await self.aengine.inspect(fn)
        except EngineDead as e:
            raise APIError(503, str(e), "server_unavailable") from None

    def abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.aengine.abort(s)

    async def merged(self, streams: list[RequestStream]):
        """(prompt index, events) as they come, from all streams."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for evs in s:
                    await q.put((i, evs))
            except BaseException as e:  # noqa: BLE001  (forwarded to the consumer)
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        left = len(streams)
        try:
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise APIError(500 if not isinstance(item, EngineDead) else 503, f"generation failed: {item}",
                                   "server_error")
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def usage(self, streams: list[RequestStream]) -> dict:
        return _usage(sum(s.timing.num_prompt_tokens for s in streams),
                      sum(s.timing.num_output_tokens for s in streams))

    @staticmethod
    def timings(streams: list[RequestStream]):
        t = [s.timing.as_dict() for s in streams]
        return t[0] if len(t) == 1 else t

    def completion_logprobs(self, events: list[StreamEvent], offset0: int = 0) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        off = offset0
        for e in events:
            for lp in e.logprobs:
                text = self.tokenizer.token_text(lp.token_id) if self.tokenizer else str(lp.token_id)
                tokens.append(text)
                lps.append(lp.logprob)
                tops.append({(self.tokenizer.token_text(t) if self.tokenizer else str(t)): v for t, v in lp.top})
                offsets.append(off)
                off += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _text(self, tid: int) -> str:
        return self.tokenizer.token_text(tid) if self.tokenizer else str(tid)

    def echo_logprobs(self, prompt_ids: list[int], prompt_lps: list, k: int, generated: dict, echoed: str) -> dict:
        """OpenAI's legacy logprobs of an echoed prompt (the first token's null) followed by the generated ones;
        the offsets are into the echoed text (which lacks the leading space a first word's token text has)."""
        tokens, lps, tops, offsets, off = [], [], [], [], 0
        texts = [self._text(t) for t in prompt_ids]
        dropped = max(0, sum(map(len, texts)) - len(echoed))
        for text, e in zip(texts, prompt_lps):
            tokens.append(text)
            lps.append(None if e is None else e.logprob)
            tops.append(None if e is None else {self._text(t): v for t, v in e.top[:k]})
            offsets.append(max(0, off - dropped))
            off += len(text)
        return {"tokens": tokens + generated["tokens"], "token_logprobs": lps + generated["token_logprobs"],
                "top_logprobs": tops + generated["top_logprobs"], "text_offset": offsets + generated["text_offset"]}

    def vllm_prompt_logprobs(self, prompt_lps: list, k: int) -> list:
        """vLLM's prompt_logprobs: per prompt position null (the first) or {token id: {logprob, rank,
        decoded_token}} holding the prompt's token and the k most likely."""
        out = []
        for e in prompt_lps:
            if e is None:
                out.append(None)
                continue
            d = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self._text(t)} for r, (t, v) in
                 enumerate(e.top[:k])}
            d[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": self._text(e.token_id)}
            out.append(d)
        return out

    def chat_logprobs(self, events: list[StreamEvent]) -> dict:
        def entry(tid, v):
            text = self.tokenizer.token_text(tid) if self.tokenizer else str(tid)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}

        content = []
        for e in events:
            for lp in e.logprobs:
                content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]})
        return {"content": content}


async def _until_disconnect(request: Request, coro):
    """Run coro; if the client goes away first, cancel it (its finally blocks abort the requests)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


# ---- the app ------------------------------------------------------------------------------------
def build_app(aengine: AsyncEngine, cfg: ServerConfig, tracer=None, trace_path=None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it (writing the trace)."""
    served = _Served(aengine, cfg)
    metrics = ServerMetrics(aengine, cfg.model_name)
    aengine.on_finish = metrics.observe

    @asynccontextmanager
    async def lifespan(app):
        if not aengine.is_alive:
            aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()
            if tracer is not None and trace_path:
                tracer.write(trace_path)
                log.info("trace written to %s", trace_path)

    app = FastAPI(title="uacompile", lifespan=lifespan)
    app.state.metrics, app.state.aengine = metrics, aengine

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        message, code = {404: (f"Invalid URL ({where})", "not_found"),
                         405: (f"method not allowed ({where})", "method_not_allowed")}.get(
            e.status_code, (str(e.detail), None))
        return APIError(e.status_code, message, code=code, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        return APIError(422, f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None).response()

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    def auth(request: Request) -> None:
        if cfg.api_key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
                raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                               "authentication_error", code="invalid_api_key")

    protected = [Depends(auth)]
    webui.mount(app)  # the chat page at /

    @app.get("/health")
    async def health():
        if not aengine.is_alive:
            dead = aengine.dead
            raise APIError(503, f"the engine stopped after an unrecoverable device error: {dead}" if dead else
                           "the engine is not running", "server_unavailable")
        s = aengine.stats
        return {"status": "ok", "requests_in_flight": aengine.num_active, "requests_tracked": s["requests_tracked"],
                "kv_pages_in_use": s["pages_in_use"]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": _now(), "owned_by": "uacompile",
                "max_model_len": served.max_model_len}

    @app.get("/v1/models", dependencies=protected)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)
    async def model(model_id: str):
        if model_id != cfg.model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    # -- vLLM's /tokenize and /detokenize (llama-server's field names accepted too)
    @app.post("/tokenize", dependencies=protected)
    async def tokenize(request: Request):
        body: TokenizeBody = await served.body(request, TokenizeBody)
        served.check_model(body.model)
        if served.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if body.prompt is not None and body.content is not None:
            raise APIError(400, "give prompt or content, not both", param="content")
        if body.add_special_tokens is not None and body.add_special is not None:
            raise APIError(400, "give add_special_tokens or add_special, not both", param="add_special")
        text = body.prompt if body.prompt is not None else body.content
        special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
        if (text is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt (or content) and messages", param="prompt")
        if body.messages is not None:
            if special:
                raise APIError(400, "add_special_tokens with messages is not supported: the chat template "
                                    "places the special tokens", param="add_special_tokens")
            ids = await served.encode_chat([m.model_dump() for m in body.messages], body.add_generation_prompt)
        else:
            ids = await served.tokenize(text, True if special is None else special)
        strs = [served.tokenizer.token_text(t) for t in ids] if body.return_token_strs or body.with_pieces else None
        tokens = [{"id": t, "piece": p} for t, p in zip(ids, strs)] if body.with_pieces else ids
        return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": tokens,
                "token_strs": strs if body.return_token_strs else None}

    @app.get("/tokenizer_info", dependencies=protected)
    async def tokenizer_info():
        """vLLM's tokenizer description: what lm-evaluation-harness's remote tokenizer reads (the special tokens'
        text and the chat template) before it tokenises through /tokenize."""
        tok = served.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token or None,
                "eos_token": tok.eos_token or None, "pad_token": None, "add_bos_token": bool(tok.add_bos),
                "chat_template": tok.chat_template or chat.FALLBACK_TEMPLATE, "model_max_length": served.max_model_len,
                "vocab_size": tok.vocab_size}

    @app.post("/detokenize", dependencies=protected)
    async def detokenize(request: Request):
        body: DetokenizeBody = await served.body(request, DetokenizeBody)
        served.check_model(body.model)
        if served.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        text = await served.detokenize(body.tokens)
        return {"prompt": text, "content": text}

    # -- /v1/completions
    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request):
        body: CompletionBody = await served.body(request, CompletionBody)
        served.check_model(body.model)
        served.check_n(body.n)
        prompt = body.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        _check_stream_options(body)
        served.check_stop(body.stop)
        score_only = body.max_tokens == 0  # the engine samples one token the response leaves out
        if score_only and not body.echo:
            raise APIError(400, "max_tokens: 0 needs echo: true (it scores the prompt)", param="max_tokens")
        want_prompt_lp = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
        if body.stream and (score_only or want_prompt_lp):
            raise APIError(400, "prompt log-probabilities (echo with logprobs, prompt_logprobs) and max_tokens: 0 "
                                "are not supported with stream: true", param="stream")
        guide, guide_field = _guide(body)
        ids = [await served.encode(p) for p in prompts]
        max_tokens = min(served.max_tokens(1 if score_only else body.max_tokens, len(i), 16) for i in ids)
        prompt_k = max(body.prompt_logprobs or 0, (body.logprobs or 0) if body.echo else 0) if want_prompt_lp else None
        params = _sampling_params(body, max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_k, guided=guide)
        await served.compile_guide(guide, guide_field)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await served.start(ids, params, body.priority)
        n = params.n
        echo = [served.tokenizer.decode(i) if body.echo and served.tokenizer else "" for i in ids]

        def chunk(i, e: StreamEvent):
            return {"index": i * n + e.index, "text": e.text, "finish_reason": e.finish_reason,
                    "logprobs": served.completion_logprobs([e]) if params.logprobs is not None else None}

        if body.stream:
            head = [{"index": i * n + j, "text": echo[i], "finish_reason": None, "logprobs": None}
                    for i in range(len(prompts)) for j in range(n)] if body.echo else []
            return _sse_response(served, streams, rid, "text_completion", cfg.model_name, body, head,
                                 lambda i, evs: [chunk(i, e) for e in evs if e.text or e.finish_reason or e.logprobs])

        got = await _until_disconnect(request, _collect(served, streams, lambda i, e: i * n + e.index))
        prompt_lps = [next((e.prompt_logprobs for e in got.get(i * n, []) if e.prompt_logprobs is not None), None)
                      for i in range(len(prompts))]
        choices = []
        for idx in range(len(prompts) * n):
            evs = got.get(idx, [])
            reason = next((e.finish_reason for e in evs if e.finish_reason), None)
            if score_only:
                evs, reason = [], "length"
            text = echo[idx // n] + "".join(e.text for e in evs)
            lp = None
            if params.logprobs is not None:
                lp = served.completion_logprobs(evs, len(echo[idx // n]))
                if body.echo:
                    lp = served.echo_logprobs(ids[idx // n], prompt_lps[idx // n], body.logprobs, lp, echo[idx // n])
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = served.vllm_prompt_logprobs(prompt_lps[idx // n], body.prompt_logprobs)
            choices.append(choice)
        usage = served.usage(streams)
        if score_only:
            usage = _usage(usage["prompt_tokens"], 0)
        return {"id": rid, "object": "text_completion", "created": _now(), "model": cfg.model_name,
                "choices": choices, "usage": usage, "timings": served.timings(streams)}

    # -- /v1/chat/completions
    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        body: ChatBody = await served.body(request, ChatBody)
        served.check_model(body.model)
        served.check_n(body.n)
        if served.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; use /v1/completions with token ids")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        _check_stream_options(body)
        served.check_stop(body.stop)
        tools = _tool_config(body)
        (guide, guide_field), tool_guide = _guide(body), tools.guide() if tools is not None else None
        if guide is not None and tool_guide is not None:
            raise APIError(400, "response_format / guided_* cannot be combined with tool_choice 'required' or a "
                                "named function (both constrain the output)", param="tool_choice")
        ids = await served.encode_chat([m.model_dump() for m in body.messages], body.add_generation_prompt, tools)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling_params(body, served.max_tokens(requested, len(ids), None),
                                  logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                  guided=guide or tool_guide)
        await served.compile_guide(guide or tool_guide, guide_field or "tools")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await served.start([ids], params, body.priority)
        parses = tools is not None and tools.parses

        if body.stream:
            head = [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for j in range(params.n)]
            parsers = {j: toolcalls.ToolCallParser() for j in range(params.n)} if parses else {}

            def delta_of(e: StreamEvent):
                p = parsers.get(e.index)
                if p is None:
                    return ({"content": e.text} if e.text else {}), e.finish_reason
                content, calls = p.feed(e.text)
                if e.finish_reason:
                    rest, more = p.finish()
                    content, calls = content + rest, calls + more
                delta = {"content": content} if content else {}
                if calls:
                    first = len(p.calls) - len(calls)
                    delta["tool_calls"] = [{"index": first + k, **c} for k, c in enumerate(calls)]
                reason = "tool_calls" if e.finish_reason == "stop" and p.calls else e.finish_reason
                return delta, reason

            def choices_of(_, evs):
                out = []
                for e in evs:
                    delta, reason = delta_of(e)
                    if delta or reason or e.logprobs:
                        out.append({"index": e.index, "delta": delta,
                                    "logprobs": served.chat_logprobs([e]) if params.logprobs is not None else None,
                                    "finish_reason": reason})
                return out

            return _sse_response(served, streams, rid, "chat.completion.chunk", cfg.model_name, body, head, choices_of)

        got = await _until_disconnect(request, _collect(served, streams, lambda _, e: e.index))
        choices = []
        for j in range(params.n):
            evs = got.get(j, [])
            text = "".join(e.text for e in evs)
            reason = next((e.finish_reason for e in evs if e.finish_reason), None)
            message = {"role": "assistant", "content": text}
            if parses:
                content, calls = toolcalls.parse(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": j, "message": message,
                            "logprobs": served.chat_logprobs(evs) if params.logprobs is not None else None,
                            "finish_reason": reason})
        return {"id": rid, "object": "chat.completion", "created": _now(), "model": cfg.model_name,
                "choices": choices, "usage": served.usage(streams), "timings": served.timings(streams)}

    # -- llama.cpp's /completion
    @app.post("/completion", dependencies=protected)
    async def llama_completion(request: Request):
        body: LlamaCppBody = await served.body(request, LlamaCppBody)
        served.check_stop(body.stop)
        ids = await served.encode(body.prompt)
        if body.n_probs < 0:
            raise APIError(400, f"n_probs must be >= 0, got {body.n_probs}", param="n_probs")
        if body.n_predict < -1:
            raise APIError(400, f"n_predict must be -1 (until the context is full), 0 (the prompt only) or "
                                f"more, got {body.n_predict}", param="n_predict")
        no_output = body.n_predict == 0  # the prompt is evaluated (and cached); the one token sampled is dropped
        if body.grammar and body.json_schema is not None:
            raise APIError(400, "give grammar or json_schema, not both", param="grammar")
        try:
            guide = (structured.Guide.grammar(body.grammar) if body.grammar else
                     structured.Guide.json_schema(body.json_schema) if body.json_schema is not None else None)
        except ValueError as e:
            raise APIError(400, str(e), param="grammar" if body.grammar else "json_schema") from None
        await served.compile_guide(guide, "grammar" if body.grammar else "json_schema")
        params = _params(max_tokens=served.max_tokens(None if body.n_predict < 0 else max(body.n_predict, 1),
                                                      len(ids), None),
                         temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                         min_p=body.min_p, repetition_penalty=body.repeat_penalty,
                         presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                         seed=None if body.seed == -1 else body.seed, stop=body.stop or None,
                         ignore_eos=body.ignore_eos, logprobs=body.n_probs or None, guided=guide)
        streams = await served.start([ids], params, 0)
        stream = streams[0]
        out_ids: list[int] = []
        text_of = served._text

        def probs(evs: list) -> dict:
            return {"completion_probabilities": server_llama.completion_probabilities(
                [lp for e in evs for lp in e.logprobs], served._text)} if body.n_probs and not no_output else {}

        def final(content: str, shown: str, evs: list) -> dict:
            """The last response: content (the whole text, or "" ending a stream), shown: all the text sent."""
            t = stream.timing
            reason = "length" if no_output else stream.finish_reasons.get(0)
            d = t.as_dict()
            n_out = 0 if no_output else t.num_output_tokens
            kind = server_llama.stop_type(reason, out_ids[-1] if out_ids else None,
                                          served.engine.model.cfg.eos_token_ids, body.ignore_eos)
            word = ""
            if kind == "word" and served.tokenizer is not None:
                word = server_llama.stopping_word(served.tokenizer.decode_continuation(ids, out_ids), shown,
                                                  body.stop)
            return {"content": "" if no_output else content, "stop": True, "model": cfg.model_name,
                    "tokens_predicted": n_out, "tokens_evaluated": t.num_prompt_tokens, "stop_type": kind,
                    "stopping_word": word, **probs(evs),
                    "timings": {"prompt_n": t.num_prompt_tokens, "prompt_ms": d["ttft_ms"], "predicted_n": n_out,
                                "predicted_per_token_ms": d["tpot_ms"], "predicted_ms": d["e2e_ms"],
                                "predicted_per_second": (1e3 / d["tpot_ms"]) if d["tpot_ms"] else None}}

        if body.stream:
            async def events():
                shown = []
                try:
                    async for _, evs in served.merged(streams):
                        for e in evs:
                            out_ids.extend(e.token_ids)
                            if e.text and not no_output:
                                shown.append(e.text)
                                yield _sse({"content": e.text, "tokens": e.token_ids, "stop": False, **probs([e])})
                    yield _sse(final("", "".join(shown), []))
                except APIError as e:
                    yield _sse({"error": {"message": e.message, "type": e.type}})
                finally:
                    served.abort(streams)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     background=BackgroundTask(served.abort, streams))

        async def collect():
            got = []
            try:
                async for _, evs in served.merged(streams):
                    got.extend(evs)
                    for e in evs:
                        out_ids.extend(e.token_ids)
            finally:
                served.abort(streams)
            return got

        got = await _until_disconnect(request, collect())
        text = "".join(e.text for e in got)
        return final(text, text, got)

    server_llama.add_routes(app, served, cfg, protected, APIError)
    add_request_schemas(app, {"/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody,
                              "/completion": LlamaCppBody, "/tokenize": TokenizeBody, "/detokenize": DetokenizeBody,
                              "/apply-template": server_llama.ApplyTemplateBody})
    return app


def _guide(body: _Sampling) -> tuple[structured.Guide | None, str | None]:
    """The structured-output guide of a request's response_format / guided_* fields and the field that gave it
    (400 where malformed)."""
    rf = body.response_format.model_dump(by_alias=True) if body.response_format is not None else None
    try:
        return structured.from_request(rf, body.guided_json, body.guided_regex, body.guided_choice,
                                       body.guided_grammar)
    except ValueError as e:
        raise APIError(400, str(e), param="response_format" if rf else None) from None


def _tool_config(body: ChatBody) -> toolcalls.ToolConfig | None:
    try:
        return toolcalls.ToolConfig.of([t.model_dump() for t in body.tools] if body.tools is not None else None,
                                       body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
                                       else body.tool_choice, body.parallel_tool_calls)
    except ValueError as e:
        raise APIError(400, str(e), param="tools" if "tool_choice" not in str(e) else "tool_choice") from None


def _check_stream_options(body: _Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


def _sampling_params(body: _Sampling, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None = None, guided: structured.Guide | None = None) -> SamplingParams:
    return _params(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                   min_p=body.min_p, presence_penalty=body.presence_penalty,
                   frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                   seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, n=body.n,
                   ignore_eos=body.ignore_eos, logprobs=logprobs, logit_bias=_logit_bias(body.logit_bias),
                   min_tokens=body.min_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
                   prompt_logprobs=prompt_logprobs, guided=guided, kv_budget=body.kv_budget)


# ---- entry point --------------------------------------------------------------------------------
def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (before the model loads) so a bad or busy port is found at once."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    try:
        # getaddrinfo's proto (IPPROTO_TCP) is what lets asyncio set TCP_NODELAY on the accepted connections
        family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_output_path(path: str, what: str) -> None:
    """A file the server writes later (at shutdown): its folder must exist and both must be writable."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory")
    folder = p.parent
    if not folder.is_dir():
        raise ValueError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{what} {path} is not writable")


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, trace: str | None = None, max_queue: int = 256,
          log_level: str = "info", max_request_bytes: int = ServerConfig.max_request_bytes,
          shutdown_timeout: float = 30.0, **engine_kwargs) -> None:
    """Load the model and serve until interrupted (the `uacompile serve` command). The port and the trace path
    are checked before the model loads; the socket bound then is the one served on."""
    if trace:
        check_output_path(trace, "--trace")
    check_shutdown_timeout(shutdown_timeout)
    sock = listen_socket(host, port)

    from .engine import Engine, EngineConfig
    from .llm import ENGINE_OPTIONS

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ec = EngineConfig(**{k: engine_kwargs.pop(k) for k in list(engine_kwargs) if k in ENGINE_OPTIONS})
    engine = Engine(model, ec, **engine_kwargs)
    serve_engine(engine, sock, served_model_name or Path(model).stem, api_key=api_key, trace=trace,
                 max_queue=max_queue, log_level=log_level, max_request_bytes=max_request_bytes,
                 shutdown_timeout=shutdown_timeout, model_path=model)


def check_shutdown_timeout(seconds) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {seconds!r}")


class EngineFailed(RuntimeError):
    """The engine stopped after an unrecoverable device error; the server shut down (exit non-zero)."""


def serve_engine(engine, sock: socket.socket, name: str, api_key: str | None = None, trace: str | None = None,
                 max_queue: int = 256, log_level: str = "info",
                 max_request_bytes: int = ServerConfig.max_request_bytes, shutdown_timeout: float = 30.0,
                 model_path: str | None = None) -> None:
    """Serve a loaded engine on a bound socket until SIGINT / SIGTERM. On the signal the server stops accepting,
    lets the requests in flight run for shutdown_timeout seconds, then ends them (a stream with an error event
    and [DONE], a whole response with a 503) and returns. An unrecoverable device error ends every request with
    its error, shuts the server down and raises EngineFailed."""
    from .trace import Tracer

    check_shutdown_timeout(shutdown_timeout)
    tracer = None
    if trace:
        tracer = Tracer()
        engine.set_tracer(tracer)
    aengine = AsyncEngine(engine, max_queue=max_queue)
    app = build_app(aengine, ServerConfig(name, api_key, max_request_bytes=max_request_bytes, model_path=model_path),
                    tracer, trace)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (max_model_len %d)", name, host, port, engine.scheduler.config.max_model_len)
    config = uvicorn.Config(app, log_level=log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 5)  # a backstop behind the drain below
    server = _DrainingServer(config, aengine, shutdown_timeout)
    aengine.on_dead = server.engine_died
    # uvicorn raises the signal again once it has shut down: SIGINT as KeyboardInterrupt, SIGTERM into this
    # handler (so a drained server exits cleanly)
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if main:
            signal.signal(signal.SIGTERM, before)
    if aengine.dead is not None:
        raise EngineFailed(f"the engine stopped after an unrecoverable device error: {aengine.dead}")
    if not server.started:
        raise RuntimeError("the server did not start (see the log above)")


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, whose exit signal starts a drain: after `timeout` seconds the requests still in flight
    are ended with an error. It also shuts down when the engine dies."""

    def __init__(self, config, aengine: AsyncEngine, timeout: float):
        super().__init__(config)
        self.aengine, self.timeout, self.loop = aengine, timeout, None

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit and self.loop is not None:
            log.info("shutting down: %d requests in flight get %.3g s to finish", self.aengine.num_active,
                     self.timeout)
            self.loop.call_soon_threadsafe(self.loop.call_later, self.timeout, self.drain_expired)
        super().handle_exit(sig, frame)

    def drain_expired(self) -> None:
        if self.aengine.num_active:
            log.warning("shutdown timeout: ending %d requests in flight", self.aengine.num_active)
        self.aengine.fail_all(EngineDead("the server is shutting down (the drain timeout passed)"))

    def engine_died(self, error) -> None:  # from the engine thread, once its requests have their error
        self.should_exit = True

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)
