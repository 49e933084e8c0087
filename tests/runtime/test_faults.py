"""Faults inside the engine (runtime/faults.py), injected through Engine.on_execute: a step that raises, with
async scheduling's step in flight, fails only the requests it held, frees their pages and leaves later outputs
identical; an unrecoverable device error (a sticky CUDA error) stops the engine: /health answers 503, the
requests in flight get the error and `serve` exits non-zero."""
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import running_server, sse_events, stories_path
from uacompile.runtime.async_engine import AsyncEngine, EngineDead
from uacompile.runtime.engine import Engine, EngineConfig
from uacompile.runtime.faults import StepFailed, is_unrecoverable
from uacompile.runtime.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Once upon a time", "Lily liked to", "One day"]
STICKY = "CUDA error: an illegal memory access was encountered"
SERVE_SCRIPT = Path(__file__).with_name("serve_with_fault.py")


def test_unrecoverable_errors_are_told_apart():
    assert is_unrecoverable(RuntimeError(STICKY))
    assert is_unrecoverable(StepFailed(RuntimeError("CUDA error: unspecified launch failure"), [1]))
    assert not is_unrecoverable(RuntimeError("kernel exploded"))
    assert not is_unrecoverable(ValueError("an illegal memory access"))  # not a device error
    assert not is_unrecoverable(RuntimeError("CUDA out of memory"))


async def _collect(stream) -> list[int]:
    tokens = []
    async for events in stream:
        for e in events:
            tokens.extend(e.token_ids)
    return tokens


class FailOnce:
    """on_execute hook: raises `error` on the `at`-th batch and records each batch's sequences."""

    def __init__(self, at: int, error: BaseException):
        self.at, self.error, self.calls, self.failed_batch = at, error, 0, None

    def __call__(self, batch):
        self.calls += 1
        if self.calls == self.at:
            self.failed_batch = [s.seq_id for s in batch.seqs]
            raise self.error


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_failing_step_with_a_step_in_flight_fails_only_its_requests(device, tmp_path_factory):
    """stories260K on the CPU; on CUDA a tiny random Llama the CUDA templates cover (stories260K's head_dim 8 needs
    TVM's CUDA kernels), its prompts token ids."""
    if device == "cpu":
        path, prompts, kw = stories_path(), PROMPTS, {"cpu_threads": 1}
    else:
        from model_helpers import saved_hf_model

        path, prompts, kw = saved_hf_model(tmp_path_factory, "faults", "llama", 11)[1], [[5, 9, 3], [7, 1], [4]], {}
    engine = Engine(str(path), EngineConfig(device=device, async_scheduling=True, **kw),
                    max_num_seqs=2, page_size=16)
    assert engine.async_scheduling
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        async def run_all():
            streams = [await aengine.generate(p, GREEDY) for p in prompts]
            return await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True)

        reference = asyncio.run(run_all())
        assert all(len(t) == 24 for t in reference)
        hook = FailOnce(6, RuntimeError("kernel exploded"))
        engine.on_execute = hook
        got = asyncio.run(run_all())  # the first two run (max_num_seqs=2), the third waits
        assert hook.failed_batch is not None and 1 <= len(hook.failed_batch) <= 2
        failed = [i for i, r in enumerate(got) if isinstance(r, StepFailed)]
        assert 1 <= len(failed) <= 2, got  # the failed step's requests (which ones: the arrival order)
        for i, r in enumerate(got):
            if i in failed:
                assert "kernel exploded" in str(r)
            else:
                assert r == reference[i]  # it was in no failed step: its output is the same
        engine.on_execute = None
        assert asyncio.run(run_all()) == reference  # later outputs are identical
        for _ in range(100):
            if aengine.stats["pages_in_use"] == 0 and aengine.stats["requests_tracked"] == 0:
                break  # the stats are a snapshot the engine thread publishes after each step
            time.sleep(0.02)
        assert aengine.stats["pages_in_use"] == 0 and aengine.stats["requests_tracked"] == 0
        assert aengine.num_active == 0 and aengine.is_alive
    finally:
        aengine.shutdown()


def test_a_sticky_device_error_stops_the_engine():
    engine = Engine(stories_path(), EngineConfig(cpu_threads=1, async_scheduling=True), max_num_seqs=4)
    aengine = AsyncEngine(engine)
    died = []
    aengine.on_dead = died.append
    engine.on_execute = FailOnce(4, RuntimeError(STICKY))
    aengine.start()

    async def main():
        streams = [await aengine.generate(p, GREEDY) for p in PROMPTS]
        results = await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True)
        with pytest.raises(EngineDead):
            await aengine.generate("Once", GREEDY)
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDead) and "illegal memory access" in str(r) for r in results)
    aengine.shutdown()
    assert not aengine.is_alive and len(died) == 1 and str(aengine.dead) == STICKY
    assert aengine.num_active == 0


def test_a_sticky_error_gives_503s_and_error_events():
    engine = Engine(stories_path(), EngineConfig(cpu_threads=1), max_num_seqs=4)
    with running_server(engine) as (url, app):
        assert httpx.get(url + "/health").status_code == 200
        engine.on_execute = FailOnce(3, RuntimeError(STICKY))
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "One day", "max_tokens": 50, "stream": True, "ignore_eos": True}) as s:
            events = sse_events(s.iter_lines())
        assert "illegal memory access" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and "illegal memory access" in h.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "One day", "max_tokens": 5})
        assert r.status_code == 503


def _serve(*args, port_file):
    return subprocess.Popen([sys.executable, str(SERVE_SCRIPT), stories_path(), str(port_file), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _port(proc, port_file, timeout=60) -> str:
    """The server's URL once /health answers."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the server did not start"
        if port_file.exists() and port_file.read_text():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
        time.sleep(0.05)


def test_serve_exits_non_zero_after_a_sticky_error(tmp_path):
    port_file = tmp_path / "port"
    proc = _serve("--sticky-at", "3", port_file=port_file)
    try:
        url = _port(proc, port_file)
        r = httpx.post(url + "/v1/completions", json={"prompt": "One day", "max_tokens": 50}, timeout=60)
        assert r.status_code == 503 and "illegal memory access" in r.json()["error"]["message"]
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "EngineFailed" in proc.stdout.read()


def test_sigterm_drains_then_ends_streams_with_an_error_and_exits_cleanly(tmp_path):
    """Each step takes 20 ms: a 400-token stream outlasts the 1 s drain; a 3-token one finishes within it."""
    import signal

    port_file = tmp_path / "port"
    proc = _serve("--step-sleep", "0.02", "--shutdown-timeout", "1", port_file=port_file)
    try:
        url = _port(proc, port_file)
        results = {}

        import threading

        started = {"long": threading.Event(), "short": threading.Event()}

        def stream(name, max_tokens):
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "One day", "max_tokens": max_tokens, "stream": True,
                                    "ignore_eos": True}) as s:
                def lines():  # the first line says the server admitted the request
                    for line in s.iter_lines():
                        started[name].set()
                        yield line
                results[name] = sse_events(lines())
            started[name].set()

        def whole():
            results["whole"] = httpx.post(url + "/v1/completions", timeout=60,
                                          json={"prompt": "One day", "max_tokens": 400, "ignore_eos": True})

        threads = [threading.Thread(target=stream, args=("long", 400)), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert started["long"].wait(30)
        time.sleep(0.2)  # the whole request is in too
        threads.append(threading.Thread(target=stream, args=("short", 3)))
        threads[-1].start()
        assert started["short"].wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 0.9 <= took < 10
    long = results["long"]
    assert "shutting down" in long[-2]["error"]["message"] and long[-1] == "[DONE]"
    assert results["whole"].status_code == 503 and "shutting down" in results["whole"].json()["error"]["message"]
    short = results["short"]
    assert short[-1] == "[DONE]" and not any("error" in e for e in short[:-1])
    assert short[-2]["choices"][0]["finish_reason"] == "length"
