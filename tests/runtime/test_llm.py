"""End to end on stories260K through the offline API: the scheduler, KV manager, executor and
TVM kernels together. Outputs must not depend on how requests were batched, cached, preempted
or chunked."""
import pytest

from uacompile.runtime import LLM, SamplingParams
from uacompile.models import STORIES260K

PROMPTS = ["Once upon a time", "Tom and his dog went to the park. They saw a big tree and a little bird.",
           [1], "Lily liked to", "The sun was hot and the sky was blue. Lily and Tom went to the beach to play"
           " in the sand. They built a big castle", "One day"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def stories():
    return str(STORIES260K)  # shipped in the package: a missing file fails, never skips


def make(stories, **kw):
    return LLM(stories, cpu_threads=1, **kw)


def count_calls(llm, method: str) -> list:
    """Record the mappings passed to one of the kernel backend's cache ops."""
    kernels, calls = llm.engine.kernels, []
    real = getattr(kernels, method)

    def spy(**kw):
        calls.append(kw["mapping"].tolist())
        return real(**kw)

    setattr(kernels, method, spy)
    return calls


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def one_at_a_time(stories):
    llm = make(stories)
    return [tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def test_batched_equals_one_at_a_time(stories, one_at_a_time):
    llm = make(stories)
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == one_at_a_time
    assert [o.prompt for o in outs] == [p if isinstance(p, str) else None for p in PROMPTS]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_concurrent_arrivals_equal_one_at_a_time(stories, one_at_a_time):
    """Requests join while others are mid-prefill or mid-decode (continuous batching)."""
    llm = make(stories, max_num_batched_tokens=16, max_prefill_chunk=8)
    eng, ids, done = llm.engine, [], {}
    for p in PROMPTS:
        ids.append(eng.add_request(p, GREEDY))
        for out in eng.step() + eng.step():
            done[out.request_id] = out
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    assert [tokens([done[i]])[0] for i in ids] == one_at_a_time


def test_abort_mid_generation_frees_its_pages(stories, one_at_a_time):
    llm = make(stories)
    eng = llm.engine
    keep, drop = eng.add_request(PROMPTS[0], GREEDY), eng.add_request(PROMPTS[1], GREEDY)
    for _ in range(5):
        eng.step()
    eng.abort(drop)
    eng.run_until_done()
    assert eng.output(keep).outputs[0].token_ids == one_at_a_time[0][0]
    dropped = eng.output(drop).outputs[0]
    assert dropped.finish_reason == "abort" and 0 < len(dropped.token_ids) < GREEDY.max_tokens
    kv = eng.scheduler.kv
    assert kv.num_free_pages == kv.num_pages and not any(kv.ref_count)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunk_sizes(stories, one_at_a_time, chunk):
    llm = make(stories, max_prefill_chunk=chunk, max_num_batched_tokens=max(chunk, 32))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == one_at_a_time


def test_prefix_caching_on_and_off(stories):
    shared = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    prompts = [shared + " One day", shared + " She had a", shared, shared + " Her mom"]
    outs = {}
    for on in (True, False):
        llm = make(stories, enable_prefix_caching=on, page_size=4)
        first = tokens(llm.generate(prompts[:1], GREEDY))   # fills the cache
        rest = tokens(llm.generate(prompts, GREEDY))       # hits it when on
        outs[on] = (first, rest, llm.engine.scheduler.stats()["prefix_hit_rate"])
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][1][0] == outs[True][0][0]
    assert outs[True][2] > 0.5 and outs[False][2] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption(stories, one_at_a_time, mode):
    # 24 pages of 4 tokens cannot hold six sequences of 25-70 tokens at once: the scheduler must preempt
    llm = make(stories, page_size=4, num_pages=24, num_cpu_pages=64, preemption=mode, max_model_len=96)
    swaps = count_calls(llm, "swap_blocks")
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == one_at_a_time
    assert llm.engine.scheduler.num_preemptions > 0
    assert bool(swaps) == (mode == "swap")


def test_seeded_sampling_is_independent_of_batching(stories):
    llm = make(stories)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=20, seed=s) for s in (1, 2, 3)]
    prompts = ["Once upon a time", "Lily liked to", "Once upon a time"]
    together = tokens(llm.generate(prompts, params))
    alone = [tokens(llm.generate([p], q))[0] for p, q in zip(prompts, params)]
    assert together == alone
    assert together[0] != together[2]  # same prompt, different seed


def test_n_samples_share_the_prompt_and_differ(stories):
    llm = make(stories, page_size=4)
    copies = count_calls(llm, "copy_blocks")
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, n=3, ignore_eos=True)
    out = llm.generate(["Tom and his dog went to the park."], params)[0]
    assert copies  # the prompt's last, partial page is shared, then copied on write
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3 and all(len(s) == 16 for s in samples)
    again = llm.generate(["Tom and his dog went to the park."], params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_top_k_one_and_temperature_zero_are_greedy(stories, one_at_a_time):
    llm = make(stories)
    p = SamplingParams(temperature=0.7, top_k=1, max_tokens=24, ignore_eos=True, seed=3)
    assert tokens(llm.generate(PROMPTS[:2], p)) == one_at_a_time[:2]


def test_stop_strings_and_stop_tokens(stories):
    llm = make(stories)
    full = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert full.text.startswith("Once upon a time, there was a little girl named Lily.")
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=40, stop=["little girl"]))[0].outputs[0]
    assert out.text == "Once upon a time, there was a " and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 40
    stop_id = full.token_ids[5]
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:6] and out.finish_reason == "stop"


def test_max_tokens_and_eos(stories):
    llm = make(stories)
    eos = llm.tokenizer.eos_token_ids[0]
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    # force an EOS: the model stops at it unless ignore_eos
    first = out.token_ids[0]
    llm.engine.model.cfg.eos_token_ids = (first,)
    try:
        stopped = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
        ignored = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    finally:
        llm.engine.model.cfg.eos_token_ids = (eos,)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert len(ignored.token_ids) == 5


def test_bad_requests_get_clear_errors(stories):
    llm = make(stories, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 5000]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(TypeError, match="prompt must be"):
        llm.generate([3.5])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="unknown engine arguments"):
        make(stories, page_sise=4)
    with pytest.raises(ValueError, match="kernel_backend"):
        make(stories, kernel_backend="magic")
    # the engine is still usable after the errors
    assert len(llm.generate([[1]], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids) == 4


def test_cuda_device_without_gpu_is_a_clear_error(stories):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM(stories, device="cuda")
