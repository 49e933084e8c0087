"""The OpenAI-compatible server, through real HTTP on loopback: a uvicorn server on 127.0.0.1 and a
free port, httpx clients. Outputs must equal offline greedy generation, bad input must get a 4xx and
leave the server serving, and aborted or finished requests must leave no pages behind."""
import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import make_engine, metric, running_server, sse_events, stories_path
from uacompile.runtime import LLM, SamplingParams

PROMPTS = ["Once upon a time", "Tom and his dog went to the park.", "Lily liked to", "One day",
           "The sun was hot and the sky was blue.", "Ben had a red ball"]
MAX_TOKENS = 12
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with running_server(max_num_seqs=32, page_size=8) as (url, app):
        yield url


@pytest.fixture(scope="module")
def offline():
    """Greedy texts and token counts of the offline API, one prompt at a time."""
    llm = LLM(stories_path(), cpu_threads=1)
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {prompt: llm.generate([prompt], p)[0].outputs[0].text for prompt in PROMPTS}


def completion(url, **body):
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def greedy(prompt, **kw):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- endpoints ----------------------------------------------------------------------------------
def test_health_models_and_metrics(server):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "stories260K"
    completion(server, **greedy("One day"))
    names = {f.name for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in names, name
    assert metric(server, "vllm:generation_tokens_total") >= MAX_TOKENS
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1


def test_offload_tier_metrics(offline):
    """The offload tier's counters under their names: pages saved, prefix hits by tier, recomputed tokens."""
    with running_server(page_size=4, num_offload_pages=64, offload_watermark=0) as (url, _):
        for prompt in PROMPTS[:2]:
            assert completion(url, **greedy(prompt)).json()["choices"][0]["text"] == offline[prompt]
        assert metric(url, "uacompile:kv_pages_offloaded_total") > 0
        assert metric(url, "uacompile:prefix_cache_hits_by_tier_total", tier="gpu") >= 0
        assert metric(url, "uacompile:prefix_cache_hits_by_tier_total", tier="cpu") >= 0
        for name in ("uacompile:kv_pages_restored_total", "uacompile:recomputed_tokens_total",
                     "uacompile:offload_pages_not_saved_total", "uacompile:offload_pages_not_ready_total",
                     "uacompile:offload_pages_evicted_total", "uacompile:offload_pages_used",
                     "uacompile:kv_compactions_total", "uacompile:kv_fragmentation"):
            assert metric(url, name) >= 0, name


def test_completion_equals_offline_greedy(server, offline):
    for prompt in PROMPTS[:3]:
        r = completion(server, **greedy(prompt))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == offline[prompt]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        t = body["timings"]
        assert t["ttft_ms"] > 0 and t["tpot_ms"] > 0 and t["e2e_ms"] >= t["ttft_ms"]


def test_streaming_is_parsed_and_equals_the_whole(server, offline):
    prompt = PROMPTS[1]
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json=greedy(prompt, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) > 3 and all(e["object"] == "text_completion" for e in chunks)
    assert "".join(c["text"] for e in chunks for c in e["choices"]) == offline[prompt]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["ttft_ms"] > 0
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    assert all(e["usage"] is None for e in chunks) and "timings" not in events[-2]


def test_chat_completion_stream_and_whole_agree(server):
    body = {"messages": [{"role": "system", "content": "A story."}, {"role": "user", "content": "Tell me one."}],
            "max_tokens": 10, "temperature": 0}
    whole = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    assert whole["object"] == "chat.completion" and msg["role"] == "assistant" and msg["content"]
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"])
    assert text == msg["content"]


def test_llama_cpp_completion(server, offline):
    prompt = PROMPTS[2]
    r = httpx.post(server + "/completion", json={"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0,
                                                 "ignore_eos": True}, timeout=60).json()
    assert r["content"] == offline[prompt] and r["stop"] is True and r["tokens_predicted"] == MAX_TOKENS
    assert r["stop_type"] == "limit" and r["timings"]["predicted_n"] == MAX_TOKENS
    with httpx.stream("POST", server + "/completion", timeout=60,
                      json={"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert "".join(e["content"] for e in events) == offline[prompt] and events[-1]["stop"] is True


def test_sampling_fields(server, offline):
    prompt = PROMPTS[0]
    a = completion(server, prompt=prompt, max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, min_p=0.05,
                   seed=11, n=2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2).json()
    b = completion(server, prompt=prompt, max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, min_p=0.05,
                   seed=11, n=2, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # seeded: reproducible
    assert [c["index"] for c in a["choices"]] == [0, 1]
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 20,
                            "min_p": 0.05, "seed": 11, "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                            "repetition_penalty": 1.2, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    streamed = ["", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in a["choices"]]
    # logit_bias can force a token; logprobs list the chosen token and the top ones
    forced = completion(server, prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True,
                        logit_bias={"300": 100}, logprobs=3).json()["choices"][0]
    lp = forced["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(t) == 3 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    token = httpx.post(server + "/v1/completions", json={"prompt": [1, 300, 300, 300, 300], "max_tokens": 1},
                       timeout=60)
    assert token.status_code == 200
    # stop strings cut the text where they begin
    full = offline[PROMPTS[0]]
    stop = full[4:9]
    cut = completion(server, **greedy(prompt, stop=[stop])).json()["choices"][0]
    assert cut["text"] == full[:full.index(stop)] and cut["finish_reason"] == "stop"
    with httpx.stream("POST", server + "/v1/completions", json=greedy(prompt, stop=[stop], stream=True),
                      timeout=60) as r:
        events = sse_events(r.iter_lines())
    streamed = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert streamed == cut["text"]  # text that might begin a stop string is held back, never sent
    # several prompts in one request
    many = completion(server, **greedy(PROMPTS[:2])).json()
    assert [c["text"] for c in many["choices"]] == [offline[p] for p in PROMPTS[:2]]


def test_concurrent_clients_equal_offline_greedy(server, offline):
    """32+ clients at once, half streaming, all get exactly the offline greedy text."""
    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            r = await client.post(server + "/v1/completions", json=greedy(prompt))
            return prompt, r.json()["choices"][0]["text"]
        async with client.stream("POST", server + "/v1/completions", json=greedy(prompt, stream=True)) as r:
            lines = [line async for line in r.aiter_lines()]
        return prompt, "".join(c["text"] for e in sse_events(lines)[:-1] for c in e["choices"])

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(36)))

    results = asyncio.run(main())
    assert len(results) == 36
    for prompt, text in results:
        assert text == offline[prompt]


# ---- aborts and errors --------------------------------------------------------------------------
def test_disconnect_frees_pages(server):
    in_use = lambda: metric(server, "uacompile:kv_pages_in_use")  # noqa: E731
    assert wait_for(lambda: in_use() == 0)
    aborted = metric(server, "uacompile:requests_aborted_total")
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data:") for line in got)
            assert in_use() > 0
        # leaving the block closes the connection mid-stream
    assert wait_for(lambda: in_use() == 0, 10), "the disconnected request still holds pages"
    assert metric(server, "uacompile:requests_aborted_total") == aborted + 1
    # a non-streaming client that gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    assert wait_for(lambda: metric(server, "uacompile:requests_aborted_total") == aborted + 2, 10)
    assert wait_for(lambda: in_use() == 0, 10)


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens must be an int >= 1"),
    ({"prompt": "a", "max_tokens": "7"}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10 ** 6}, 400, "exceeds the context"),
    ({"prompt": "a " * 3000, "max_tokens": 4}, 400, "context"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "a", "n": 1000}, 400, "n must be at most"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p must be a number in (0, 1]"),
    ({"prompt": "a", "min_p": 2}, 400, "min_p must be a number in [0, 1]"),
    ({"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty must be a number in [-2, 2]"),
    ({"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty must be a number in (0, 100]"),
    ({"prompt": "a", "logprobs": 50}, 400, "logprobs must be an int in [0, 20]"),
    ({"prompt": "a", "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias keys"),
    ({"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "a", "seed": 2 ** 70}, 400, "seed"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
def test_bad_requests_get_openai_errors(server, body, status, needle):
    if isinstance(body, bytes):
        r = httpx.post(server + "/v1/completions", content=body, headers=JSON)
    else:
        r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"], err


def test_bad_chat_requests(server):
    for body, needle in (({"messages": []}, "non-empty"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
                         ({"messages": "hi"}, "messages")):
        r = httpx.post(server + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                       | st.text(max_size=12), lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)
FIELDS = {"prompt": st.text(max_size=40) | st.lists(st.integers(-5, 600), max_size=8) | JSONISH,
          "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                                      "content": st.text(max_size=20) | JSONISH}), max_size=3)
          | JSONISH,
          "max_tokens": st.integers(-3, 6) | st.sampled_from([10 ** 9, None]) | JSONISH,
          "n_predict": st.integers(-2, 6) | JSONISH,
          "temperature": st.floats(-1, 3) | JSONISH, "top_p": st.floats(-0.5, 1.5) | JSONISH,
          "top_k": st.integers(-3, 600) | JSONISH, "min_p": st.floats(-1, 2) | JSONISH,
          "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
          "repetition_penalty": st.floats(-1, 3), "seed": st.integers(-2 ** 65, 2 ** 65) | JSONISH,
          "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | JSONISH,
          "n": st.integers(-1, 4) | JSONISH, "logprobs": st.integers(-2, 25) | st.booleans() | JSONISH,
          "top_logprobs": st.integers(-2, 25) | JSONISH,
          "logit_bias": st.dictionaries(st.text(max_size=4) | st.integers(0, 600).map(str), st.floats(-200, 200),
                                        max_size=3) | JSONISH,
          "stream": st.booleans() | JSONISH, "model": st.sampled_from(["stories260K", "other"]) | JSONISH,
          "ignore_eos": st.booleans(), "echo": st.booleans() | JSONISH, "stream_options": JSONISH}
BODIES = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.just(None), max_size=8).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/completion"]), body=BODIES)
def test_fuzzed_bodies_never_get_a_5xx(server, path, body):
    if body.get("max_tokens") is None and body.get("n_predict") is None:
        body["max_tokens"] = body["n_predict"] = 4  # bounded generation: no default to the full context
    with httpx.Client(timeout=60) as client:
        r = client.post(server + path, content=json.dumps(body), headers=JSON)
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            for line in r.iter_lines():
                assert '"type": "server_error"' not in line, line
        assert r.status_code < 500, (r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert "message" in r.json()["error"]
        assert client.get(server + "/health").status_code == 200


def test_raw_garbage_bodies(server):
    for raw in (b"", b"\xff\xfe", b"null", b'"x"', b"1e999", b'{"prompt": NaN}', b"{" * 5000):
        for path in ("/v1/completions", "/v1/chat/completions", "/completion"):
            r = httpx.post(server + path, content=raw, headers=JSON)
            assert 400 <= r.status_code < 500, (path, raw[:20], r.status_code, r.text[:200])
    assert httpx.get(server + "/health").status_code == 200


def test_overload_gets_503_with_retry_after():
    with running_server(max_num_seqs=1, max_queue=1) as (url, _):
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(6)))

        rs = asyncio.run(main())
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 503 in codes, codes
        busy = next(r for r in rs if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_overloaded"


def test_api_key():
    with running_server(api_key="sekret") as (url, _):
        body = {"prompt": "One day", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200


def test_openai_client(server, offline):
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="stories260K", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == offline[PROMPTS[0]]
    chunks = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stream=True)
    assert sum(1 for c in chunks for _ in c.choices) >= 2


# ---- soak ---------------------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_soak_leaks_no_pages_and_no_memory():
    """A few thousand tiny requests (mixed endpoints, streaming and not, some aborted by the client):
    afterwards no page is held, the engine tracks no request, and memory is flat after a warm-up."""
    engine = make_engine(max_num_seqs=16, page_size=4)
    with running_server(engine) as (url, _):
        async def burst(n, client):
            sem = asyncio.Semaphore(16)

            async def one(i):
                async with sem:
                    prompt = PROMPTS[i % len(PROMPTS)] + " " + str(i)
                    if i % 7 == 0:
                        async with client.stream("POST", url + "/v1/completions",
                                                 json={"prompt": prompt, "max_tokens": 2, "stream": True}) as r:
                            async for _ in r.aiter_lines():
                                pass
                    elif i % 11 == 0:
                        await client.post(url + "/v1/chat/completions",
                                          json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
                    else:
                        r = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                        assert r.status_code == 200, r.text

            await asyncio.gather(*(one(i) for i in range(n)))

        async def main():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=16)) as client:
                await burst(300, client)  # warm-up: caches, allocator pools
                before = _rss_mb()
                start = time.monotonic()
                await burst(2000, client)
                return before, _rss_mb(), time.monotonic() - start

        before, after, seconds = asyncio.run(main())
        print(f"soak: 2000 requests in {seconds:.1f} s, RSS {before:.0f} -> {after:.0f} MB")
        assert wait_for(lambda: metric(url, "uacompile:kv_pages_in_use") == 0)
        assert not engine.requests and not engine.has_unfinished()
        engine.scheduler.kv.check_invariants()
        assert metric(url, "uacompile:requests_tracked") == 0
        assert after - before < 20, f"RSS grew {after - before:.1f} MB over 2000 requests"
        assert seconds < 60, seconds


# ---- the command and the trace ------------------------------------------------------------------
def check_trace(path):
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e.get("cat"), e["name"]) for e in events}
    for want in (("scheduler", "step"), ("scheduler", "execute"), ("kernel", "paged_attention"),
                 ("kernel", "reshape_and_cache"), ("counter", "kv_pages"), ("request", "add_request"),
                 ("request", "finish")):
        assert want in names, want
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_trace_is_written_at_shutdown(tmp_path):
    from uacompile.runtime.trace import Tracer

    engine, tracer, path = make_engine(), Tracer(), tmp_path / "trace.json"
    engine.set_tracer(tracer)
    with running_server(engine, tracer=tracer, trace_path=path) as (url, _):
        assert completion(url, prompt="One day", max_tokens=4).status_code == 200
    check_trace(path)


@pytest.mark.slow
def test_serve_command_writes_a_chrome_trace(tmp_path):
    """`uacompile serve` in its own process: loopback, then SIGINT writes the trace."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace = tmp_path / "trace.json"
    proc = subprocess.Popen([sys.executable, "-m", "uacompile.cli", "serve", "--model", stories_path(),
                             "--port", str(port), "--cpu-threads", "1", "--trace", str(trace),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is None and False

        assert wait_for(up, 90), proc.stdout.read() if proc.poll() is not None else "server did not come up"
        assert completion(url, prompt="One day", max_tokens=4).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    check_trace(trace)


@pytest.mark.parametrize("args,needle", [(["--model", "/nonexistent.gguf"], "does not exist"),
                                         (["--model", "MODEL", "--policy", "lifo"], "policy must be one of"),
                                         (["--model", "MODEL", "--page-size", "0"], "page_size must be"),
                                         # checked before the model loads: the model's error never comes
                                         (["--model", "/nonexistent.gguf", "--port", "99999"],
                                          "port must be an int in [0, 65535], got 99999"),
                                         (["--model", "/nonexistent.gguf", "--trace", "/nonexistent/t.json"],
                                          "--trace /nonexistent/t.json: the folder /nonexistent does not exist"),
                                         (["--model", "/nonexistent.gguf", "--trace", "/"], "is a directory")])
def test_serve_command_errors_are_one_line(capsys, args, needle):
    from uacompile.cli import main

    port = [] if "--port" in args else ["--port", "0"]
    assert main(["serve", *port, *[stories_path() if a == "MODEL" else a for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("uacompile: error:"), err


def test_serve_command_port_in_use_is_one_line_before_the_model_loads(capsys):
    import socket

    from uacompile.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent.gguf", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err


# ---- as the openai SDK sees it ------------------------------------------------------------------
@pytest.fixture(scope="module")
def sdk(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_openai_sdk_stream_without_usage_has_a_choice_in_every_chunk(sdk):
    """The SDK's usual loop, ch.choices[0].delta.content, runs to the end; the timings ride on the last
    content chunk; the text equals the whole response's."""
    kw = dict(model="stories260K", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10,
              temperature=0)
    whole = sdk.chat.completions.create(**kw)
    chunks = list(sdk.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks)
    timings = [ch.model_extra.get("timings") for ch in chunks]
    assert timings[-1]["ttft_ms"] > 0 and timings[-1]["completion_tokens"] == whole.usage.completion_tokens
    assert all(t is None for t in timings[:-1])


def test_openai_sdk_stream_with_include_usage(sdk, offline):
    prompt = PROMPTS[3]
    stream = sdk.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.total_tokens == last.usage.prompt_tokens + MAX_TOKENS and last.usage.prompt_tokens > 0
    assert all(ch.choices and ch.usage is None for ch in content)
    assert "".join(ch.choices[0].text for ch in content) == offline[prompt]
    assert content[-1].choices[0].finish_reason == "length" and content[-1].model_extra["timings"]["e2e_ms"] > 0
    whole = sdk.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == offline[prompt] and whole.usage == last.usage


def test_openai_sdk_continuous_usage_stats(sdk):
    """vLLM's continuous_usage_stats: every chunk carries the usage so far; the last one the total."""
    stream = sdk.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=8, temperature=0, stream=True, n=2,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(ch.usage is not None for ch in chunks)
    used = [ch.usage.completion_tokens for ch in chunks]
    assert used == sorted(used) and used[0] == 0 and used[-1] == 16
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
    assert chunks[-1].choices == [] and all(ch.choices for ch in chunks[:-1])
    finishing = [ch for ch in chunks if any(c.finish_reason for c in ch.choices)]
    assert {c.index for ch in finishing for c in ch.choices if c.finish_reason} == {0, 1}
    assert [("timings" in ch.model_extra) for ch in chunks[:-1]].count(True) == 1
    assert "timings" in finishing[-1].model_extra
    # without include_usage, continuous_usage_stats adds nothing (as in vLLM)
    plain = list(sdk.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=3, stream=True,
                                             stream_options={"continuous_usage_stats": True}))
    assert all(ch.choices and ch.usage is None for ch in plain)


def test_openai_sdk_models_and_errors(sdk):
    import openai

    assert sdk.models.retrieve("stories260K").id == "stories260K"
    assert [m.id for m in sdk.models.list()] == ["stories260K"]
    with pytest.raises(openai.NotFoundError) as e:
        sdk.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="stories260K", prompt="x", max_tokens=2, stream_options={"include_usage": True})
    assert "stream_options" in e.value.message
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="stories260K", prompt="x", max_tokens=2, stop=["a"] * 33)


# ---- what a client cannot do to the server ------------------------------------------------------
def test_framework_errors_have_the_openai_shape(server):
    for method, path, status in (("GET", "/nowhere", 404), ("POST", "/v1/nowhere", 404),
                                 ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, server + path)
        assert r.status_code == status, (method, path, r.status_code)
        err = r.json()["error"]
        assert path in err["message"] and err["type"] == "invalid_request_error" and set(err) >= {"param", "code"}
    assert "GET" in httpx.delete(server + "/v1/models").headers["allow"]


def test_only_json_bodies(server):
    body = json.dumps(greedy("One day")).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        for path in ("/v1/completions", "/v1/chat/completions", "/completion"):
            r = httpx.post(server + path, content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (path, ctype)
    r = httpx.post(server + "/v1/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_request_size_limit():
    with running_server(server_kw={"max_request_bytes": 4096}) as (url, _):
        ok = {"prompt": "One day", "max_tokens": 2, "user": "x" * 3000}
        assert httpx.post(url + "/v1/completions", json=ok).status_code == 200
        big = {**ok, "user": "x" * 5000}
        r = httpx.post(url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

        def chunked():  # no content-length: counted as it comes
            yield json.dumps(big).encode()

        r = httpx.post(url + "/v1/completions", content=chunked(), headers=JSON)
        assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health").status_code == 200


def test_default_request_size_limit(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "a", "junk": "x" * (5 * 2 ** 20)}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_json_depth_and_stop_caps(server):
    deep = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = {"prompt": "a", "max_tokens": 2, "x": json.loads("[" * 65 + "]" * 65)}
    for path in ("/v1/completions", "/v1/chat/completions", "/completion"):
        r = httpx.post(server + path, content=deep, headers=JSON)
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"], r.text
        r = httpx.post(server + path, json=nested)
        assert r.status_code == 400 and "nests deeper than 64" in r.json()["error"]["message"], r.text
    msg = {"role": "user", "content": "a", "x": json.loads("[" * 60 + "]" * 60)}  # depth 64 in all
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [msg], "max_tokens": 2})
    assert r.status_code == 200, r.text
    many, long = ["a"] * 33, ["a" * 257]
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
                       ("/completion", {"prompt": "a", "n_predict": 2})):
        for stop, needle in ((many, "at most 32"), (long, "at most 256 are allowed")):
            r = httpx.post(server + path, json={**body, "stop": stop})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert httpx.post(server + path, json={**body, "stop": ["a" * 256] * 32}).status_code == 200
    assert httpx.get(server + "/health").status_code == 200


def test_tokenising_runs_off_the_event_loop():
    """While a prompt is being tokenised (here: held inside the tokenizer) /health still answers, for
    /v1/completions, /v1/chat/completions and /completion alike; a prompt over the character cap is refused
    without being tokenised at all."""
    import threading

    engine = make_engine()
    tok = engine.tokenizer
    encode, entered, release, calls = tok.encode, threading.Event(), threading.Event(), []

    def held_encode(*a, **kw):
        calls.append(1)
        entered.set()
        release.wait(30)
        return encode(*a, **kw)

    tok.encode = held_encode
    with running_server(engine, server_kw={"max_prompt_chars": 1000}) as (url, _):
        for path, body in (("/v1/completions", {"prompt": "One day", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 2}),
                           ("/completion", {"prompt": "One day", "n_predict": 2})):
            entered.clear()
            release.clear()
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(url + path, json=body, timeout=60)))
            t.start()
            assert entered.wait(30), path
            assert httpx.get(url + "/health", timeout=5).status_code == 200, path
            release.set()
            t.join(60)
            assert out["r"].status_code == 200, (path, out["r"].text)
        release.set()
        n = len(calls)
        for path, body in (("/v1/completions", {"prompt": "a" * 1001}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600},
                                                                  {"role": "user", "content": "a" * 401}]}),
                           ("/completion", {"prompt": "a" * 1001})):
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400 and "1001 characters; at most 1000" in r.json()["error"]["message"], r.text
        assert len(calls) == n


def test_listen_socket_is_tcp_for_nodelay():
    """serve binds its socket itself; asyncio sets TCP_NODELAY on accepted connections only when the listening
    socket's proto is IPPROTO_TCP (without it a keep-alive /health waits out a delayed ACK)."""
    import socket

    from uacompile.runtime.server import listen_socket

    for host in ("127.0.0.1", "localhost"):
        with listen_socket(host, 0) as sock:
            assert sock.proto == socket.IPPROTO_TCP and sock.type == socket.SOCK_STREAM
    with pytest.raises(OSError, match="cannot listen on no-such-host.invalid:80"):
        listen_socket("no-such-host.invalid", 80)


# ---- tokenize / detokenize ----------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server):
    """vLLM's shapes; llama-server's field names give the same ids; the ids are the ones generation uses."""
    text = "Once upon a time"
    r = httpx.post(server + "/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    got = r.json()
    ids = LLM(stories_path(), cpu_threads=1).engine.encode_prompt(text)[1]
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] >= len(ids)
    bare = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == ids[1:]  # stories260K's tokenizer adds BOS
    assert httpx.post(server + "/tokenize", json={"content": text, "add_special": False}).json()["tokens"] == bare
    strs = httpx.post(server + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(ids) and "".join(strs).strip() == text
    pieces = httpx.post(server + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": t, "piece": p} for t, p in zip(ids, strs)]
    back = httpx.post(server + "/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == text and back["content"] == text
    used = completion(server, prompt=text, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert used == got["count"]


def test_tokenize_messages_equals_the_chat_prompt(server):
    msgs = [{"role": "user", "content": "Hi there"}]
    got = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    r = httpx.post(server + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert got["count"] == r.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {}, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "content": "a"}, "not both"),
    ("/tokenize", {"prompt": "a", "with_piece": True}, "'with_piece'"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist"),
    ("/detokenize", {"tokens": [1, 999999]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_bad_requests(server, path, body, needle):
    r = httpx.post(server + path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_tokenize_needs_the_api_key():
    with running_server(api_key="sekret") as (url, _):
        assert httpx.post(url + "/tokenize", json={"prompt": "a"}).status_code == 401
        assert httpx.post(url + "/detokenize", json={"tokens": [1]}).status_code == 401
        ok = httpx.post(url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200


# ---- min_tokens, include_stop_str_in_output -----------------------------------------------------
LONG = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}


def _chat(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Once"}],
                                                          "max_tokens": 40, "temperature": 0, **body}, timeout=60)


def _streamed_text(url, path, body) -> str:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        evs = sse_events(r.iter_lines())
    key = "text" if path == "/v1/completions" else "delta"
    return "".join((c[key] if key == "text" else c[key].get("content", "")) or ""
                   for e in evs if e != "[DONE]" for c in e["choices"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_stop_str_in_output(server, path):
    post = (lambda **b: completion(server, **LONG, **b)) if path == "/v1/completions" else \
        (lambda **b: _chat(server, **b))
    full = post().json()["choices"][0]
    text = full["text"] if "text" in full else full["message"]["content"]
    stop = next(ch for ch in ".,!" if ch in text[1:])
    cut = text.index(stop)
    for include, want in ((False, text[:cut]), (True, text[:cut + 1])):
        body = {"stop": [stop], "include_stop_str_in_output": include}
        c = post(**body).json()["choices"][0]
        assert (c["text"] if "text" in c else c["message"]["content"]) == want
        assert c["finish_reason"] == "stop"
        base = LONG if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Once"}],
                                                       "max_tokens": 40, "temperature": 0}
        assert _streamed_text(server, path, {**base, **body}) == want


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_tokens_passes_early_stop_strings(server, path):
    """A stop string inside the first min_tokens tokens does not end the output; the next one does."""
    post = (lambda **b: completion(server, **LONG, **b)) if path == "/v1/completions" else \
        (lambda **b: _chat(server, **b))
    whole = post().json()
    c = whole["choices"][0]
    text = c["text"] if "text" in c else c["message"]["content"]
    stop = next(ch for ch in ".," if text.count(ch) >= 2)
    first = text.index(stop)
    early = post(stop=[stop]).json()
    assert early["usage"]["completion_tokens"] < 40
    m = early["usage"]["completion_tokens"] + 1
    late = post(stop=[stop], min_tokens=m).json()
    lc = late["choices"][0]
    got = lc["text"] if "text" in lc else lc["message"]["content"]
    assert got == text[:text.index(stop, first + 1)] and lc["finish_reason"] == "stop"
    assert late["usage"]["completion_tokens"] >= m
    base = LONG if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Once"}],
                                                   "max_tokens": 40, "temperature": 0}
    assert _streamed_text(server, path, {**base, "stop": [stop], "min_tokens": m}) == got


def test_min_tokens_masks_eos_and_stop_tokens(server):
    """The stop token greedy decoding picks early is masked until min_tokens: the output is at least that long,
    the token is nowhere before it, and the server's text equals the offline API's."""
    llm = LLM(stories_path(), cpu_threads=1)
    prompt = "Once upon a time"
    ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].token_ids
    stop_tok = ids[3]
    first = ids.index(stop_tok)
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop_token_ids": [stop_tok]}
    assert completion(server, **body).json()["usage"]["completion_tokens"] == first + 1
    m = first + 6
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok],
                                                min_tokens=m))[0].outputs[0]
    assert len(out.token_ids) >= m and stop_tok not in out.token_ids[:m - 1]
    r = completion(server, **body, min_tokens=m).json()
    assert r["usage"]["completion_tokens"] == len(out.token_ids) and r["choices"][0]["text"] == out.text
    # EOS: with ignore_eos off, a min_tokens output never holds an EOS before min_tokens
    eos = set(llm.engine.model.cfg.eos_token_ids)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=60, min_tokens=50))[0].outputs[0]
    assert len(out.token_ids) >= 50 and not eos & set(out.token_ids[:49])


@pytest.mark.parametrize("body,needle", [
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens must be an int in [0, max_tokens=5]"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
])
def test_min_tokens_bad_values(server, body, needle):
    r = completion(server, prompt="a", **body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


# ---- KV eviction per request --------------------------------------------------------------------
def test_kv_budget_per_request_evicts_and_frees_its_pages(server):
    """A request's kv_budget (SamplingParams.kv_budget) evicts its cache to the budget after the prompt: the output
    comes back whole and the pages are freed; a budget over the prompt leaves it the offline greedy text."""
    prompt = " ".join(PROMPTS * 4)
    full = completion(server, **greedy(prompt)).json()["choices"][0]["text"]
    assert completion(server, **greedy(prompt, kv_budget=10_000)).json()["choices"][0]["text"] == full
    evictions, dropped = metric(server, "uacompile:kv_evictions_total"), metric(server, "uacompile:kv_evicted_tokens_total")
    r = completion(server, **greedy(prompt, kv_budget=0.25))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    n = r.json()["usage"]["prompt_tokens"]
    assert metric(server, "uacompile:kv_evictions_total") >= evictions + 1
    assert metric(server, "uacompile:kv_evicted_tokens_total") - dropped >= n - n // 4 - MAX_TOKENS
    assert wait_for(lambda: httpx.get(server + "/health").json()["kv_pages_in_use"] == 0)


@pytest.mark.parametrize("budget", [0, -3, 1.5, "0.5", True])
def test_a_bad_kv_budget_is_a_400_naming_it(server, budget):
    r = completion(server, **greedy("Once upon a time", kv_budget=budget))
    assert r.status_code == 400 and "kv_budget" in r.json()["error"]["message"], r.text


# ---- fields the server does not implement -------------------------------------------------------
UNSUPPORTED = [("/v1/completions", f) for f in ("best_of", "suffix", "no_such_field")] + \
    [("/v1/chat/completions", f) for f in ("functions", "function_call", "no_such_field")] + \
    [("/completion", f) for f in ("no_such_field",)]


@pytest.mark.parametrize("path,field", UNSUPPORTED)
def test_unsupported_fields_are_a_400_that_names_them(server, path, field):
    body = {"prompt": "a"} if path != "/v1/chat/completions" else {"messages": [{"role": "user", "content": "a"}]}
    limit = {"n_predict": 2} if path == "/completion" else {"max_tokens": 2}
    r = httpx.post(server + path, json={**body, **limit, field: {"type": "json_object"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"unsupported field {field!r}" in err["message"], err


def test_unsupported_nested_field_is_named(server):
    r = completion(server, prompt="a", stream=True, stream_options={"include_usage": True, "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.bogus", r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_user_is_accepted_and_ignored(server, path):
    body = {"prompt": "Once"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Once"}]}
    body = {**body, "max_tokens": 4, "temperature": 0}
    a = httpx.post(server + path, json=body).json()["choices"][0]
    b = httpx.post(server + path, json={**body, "user": "someone"}).json()["choices"][0]
    assert a.get("text", a.get("message")) == b.get("text", b.get("message"))


# ---- prompt logprobs ----------------------------------------------------------------------------
SCORED = "Once upon a time, there was a little girl named Lily. She loved to play outside."


@pytest.fixture(scope="module")
def reference_prompt_logprobs():
    """log p(token i | tokens before it) from the runtime's forward, one sequence outside the engine."""
    from model_helpers import prompt_logprobs
    llm = LLM(stories_path(), cpu_threads=1)
    ids = llm.engine.encode_prompt(SCORED)[1]
    return ids, prompt_logprobs(llm.engine.executor, ids)


def test_echo_with_max_tokens_0_scores_the_prompt(reference_prompt_logprobs):
    """OpenAI's legacy shape: the prompt's tokens, the first logprob null, nothing generated; equal to the
    reference over prefill chunks and again when the prompt's pages are in the prefix cache."""
    ids, ref = reference_prompt_logprobs
    with running_server(page_size=4, max_prefill_chunk=8) as (url, _):
        for _ in range(2):
            r = completion(url, prompt=SCORED, max_tokens=0, echo=True, logprobs=3, temperature=0)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["text"] == SCORED and c["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 0
            lp = c["logprobs"]
            assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            np.testing.assert_allclose(lp["token_logprobs"][1:], ref, atol=1e-4)
            offs = lp["text_offset"]
            assert offs == sorted(offs) and all(SCORED[o:].startswith(t) for o, t in zip(offs[2:], lp["tokens"][2:]))
            for top, chosen in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
                assert len(top) <= 3 and max(top.values()) >= chosen - 1e-6
        # echo + logprobs with generation: the prompt's entries, then the generated tokens'
        r = completion(url, prompt=SCORED, max_tokens=3, echo=True, logprobs=0, temperature=0, ignore_eos=True).json()
        lp = r["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], ref, atol=1e-4)


def test_vllm_prompt_logprobs(server, reference_prompt_logprobs):
    ids, ref = reference_prompt_logprobs
    r = completion(server, prompt=[ids, ids[:5]], max_tokens=2, prompt_logprobs=2, temperature=0, n=2)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c, want in zip(choices, (ids, ids, ids[:5], ids[:5])):
        plp = c["prompt_logprobs"]
        assert len(plp) == len(want) and plp[0] is None
        for pos, entry in enumerate(plp[1:], 1):
            own = entry[str(want[pos])]
            assert abs(own["logprob"] - ref[pos - 1]) < 1e-4
            others = [v for k, v in entry.items() if k != str(want[pos])]
            assert len(entry) in (2, 3) and {v["rank"] for v in others} <= {1, 2}
            higher = sum(v["logprob"] > own["logprob"] for v in others)
            assert own["rank"] == higher + 1 if own["rank"] <= 2 else higher == len(others) == 2
        assert c["logprobs"] is None


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 0}, "max_tokens: 0 needs echo"),
    ({"max_tokens": 0, "echo": True, "stream": True}, "not supported with stream"),
    ({"echo": True, "logprobs": 1, "stream": True}, "not supported with stream"),
    ({"prompt_logprobs": 1, "stream": True}, "not supported with stream"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an int in [0, 20]"),
])
def test_prompt_logprobs_bad_requests(server, body, needle):
    r = completion(server, prompt="Once upon", **body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_chat_prompt_logprobs_is_unsupported(server):
    r = _chat(server, prompt_logprobs=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_openai_sdk_scores_a_prompt_and_names_unsupported_fields(sdk, reference_prompt_logprobs):
    """What lm-evaluation-harness's local-completions does for a loglikelihood: echo, max_tokens 0, logprobs."""
    import openai
    ids, ref = reference_prompt_logprobs
    out = sdk.completions.create(model="stories260K", prompt=SCORED, max_tokens=0, echo=True, logprobs=1,
                                 temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == SCORED and lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref, atol=1e-4)
    assert out.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="unsupported field 'functions'"):
        sdk.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                    functions=[{"name": "f"}])
    with pytest.raises(openai.BadRequestError, match="unsupported field 'best_of'"):
        sdk.completions.create(model="stories260K", prompt="Hi", max_tokens=2, best_of=2)
    ok = sdk.completions.create(model="stories260K", prompt="Hi", max_tokens=2, user="someone")
    assert len(ok.choices) == 1 and ok.usage.prompt_tokens > 0
