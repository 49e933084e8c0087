"""AsyncEngine without HTTP: streamed pieces add up to the offline text, aborts free pages before the
next step, the queue bound holds, and a failing step fails only the requests in flight."""
import asyncio

import pytest

from server_helpers import make_engine
from uacompile.runtime.async_engine import AsyncEngine, Overloaded
from uacompile.runtime.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def aengine():
    a = AsyncEngine(make_engine(max_num_seqs=4), max_queue=2)
    a.start()
    yield a
    a.shutdown()
    assert not a.is_alive


async def collect(stream):
    texts, tokens = {}, {}
    async for events in stream:
        for e in events:
            texts[e.index] = texts.get(e.index, "") + e.text
            tokens.setdefault(e.index, []).extend(e.token_ids)
    return texts, tokens


def test_streams_add_up_to_the_offline_output(aengine):
    eng = aengine.engine

    async def main():
        streams = [await aengine.generate(p, GREEDY) for p in ("Once upon a time", "Lily liked to")]
        return await asyncio.gather(*(collect(s) for s in streams)), streams

    results, streams = asyncio.run(main())
    for (texts, tokens), s in zip(results, streams):
        assert len(tokens[0]) == 16 and s.finish_reasons == {0: "length"}
        assert texts[0] == eng.tokenizer.decode_continuation(s.prompt_token_ids, tokens[0])
        t = s.timing
        assert t.num_output_tokens == 16 and len(t.itls) == 15 and 0 < t.ttft <= t.e2e
    assert aengine.counters["requests_finished"] == 2 and aengine.counters["generation_tokens"] == 32


def test_abort_frees_pages_and_the_queue_bound_holds(aengine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        streams = [await aengine.generate("Once upon a time", long) for _ in range(6)]  # 4 running + 2 queued
        with pytest.raises(Overloaded):
            await aengine.generate("One day", long)
        await streams[0].__anext__()
        for s in streams:
            aengine.abort(s)
        for s in streams:
            async for _ in s:
                pass

    asyncio.run(main())
    for _ in range(100):
        if aengine.stats["pages_in_use"] == 0 and aengine.stats["requests_tracked"] == 0:
            break  # the stats are a snapshot the engine thread publishes after each step
        asyncio.run(asyncio.sleep(0.02))
    assert aengine.stats["pages_in_use"] == 0 and aengine.stats["requests_tracked"] == 0
    assert aengine.counters["requests_aborted"] == 6 and aengine.num_active == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(aengine):
    executor = aengine.engine.executor
    real, calls = executor.execute, []

    def flaky(batch, *rest):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return real(batch, *rest)

    executor.execute = flaky

    async def main():
        bad = await aengine.generate("One day", GREEDY)
        with pytest.raises(RuntimeError, match="kernel exploded"):
            await collect(bad)
        return await collect(await aengine.generate("One day", GREEDY))

    texts, tokens = asyncio.run(main())
    assert len(tokens[0]) == 16 and aengine.num_active == 0
