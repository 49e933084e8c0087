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
    return LLM(stories, **{"cpu_threads": 1, **kw})


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


def test_seeded_sampling_repeats_and_differs_by_seed(stories):
    """What sampling.py guarantees is checked in test_sampling_guarantees.py; here: a seed repeats its
    tokens on the same engine, and two seeds on the same prompt differ."""
    llm = make(stories)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=20, seed=s) for s in (1, 2, 3)]
    prompts = ["Once upon a time", "Lily liked to", "Once upon a time"]
    together = tokens(llm.generate(prompts, params))
    assert tokens(llm.generate(prompts, params)) == together
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


@pytest.mark.parametrize("kw,message", [
    (dict(kv_cache_bytes=1), "kv_cache_bytes=1 holds no KV page: one page of 16 tokens takes 20480 bytes"),
    (dict(kv_cache_bytes=-5), r"kv_cache_bytes must be an int >= 1 \(bytes\) or None, got -5"),
    (dict(kv_cache_bytes=2.5), "kv_cache_bytes must be an int"),
    (dict(max_model_len=10**6), r"max_model_len must be in \[1, 2048\] \(the model's max_position_embeddings\)"),
    (dict(max_model_len=0), "max_model_len must be an int >= 1, got 0"),
    (dict(num_pages=2, max_model_len=64), "max_model_len=64 does not fit the KV cache: 2 pages of 16 tokens hold 32"),
    (dict(seed=2**70), r"seed must be an int in \[0, 2\*\*64 - 1\]"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64 - 1\]"),
    (dict(device="tpu"), "device must be 'cpu' or 'cuda', got 'tpu'"),
    (dict(dtype="fp8"), "dtype must be one of"),
    (dict(cpu_threads=0), "cpu_threads must be an int >= 1 or None"),
    (dict(log_stats_interval=-1), "log_stats_interval must be a finite number of seconds >= 0"),
    (dict(num_cpu_pages=-1), "num_cpu_pages must be an int >= 0"),
    (dict(page_size=0), "page_size must be an int >= 1"),
    (dict(policy="lifo"), "policy must be one of"),
    (dict(preemption="drop"), "preemption must be one of"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int >= 1"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be a bool"),
])
def test_engine_options_are_checked_with_their_range(stories, kw, message, monkeypatch):
    from uacompile.runtime import engine

    if not any(m in message for m in ("kv_cache_bytes=1 ", "max_model_len=64", "max_position_embeddings")):  # need the model
        monkeypatch.setattr(engine, "load", lambda path: pytest.fail("the option was checked after loading the model"))
    with pytest.raises(ValueError, match=message):
        make(stories, **kw)


def test_the_default_dtype_is_the_one_the_models_kernels_exist_in(stories):
    """dtype=None: float32 on the CPU; on CUDA the checkpoint's 16-bit type where the CUDA templates cover the model,
    else float32 (TVM's CUDA kernels). Each model `uacompile build` has a preset for is built in the dtype this
    gives, so LLM(model, device="cuda", kernel_dir=<its preset's folder>) needs no dtype: stories260K (an fp32
    GGUF, head_dim 8) in fp32, a Llama-3-8B-shaped bf16 checkpoint in bf16."""
    import torch

    from uacompile import build, ir
    from uacompile.runtime.engine import default_dtype
    from uacompile.runtime.loader import load
    from uacompile.runtime.model import ModelConfig

    def shape(hq, hkv, d, checkpoint):
        return ModelConfig(arch="llama", vocab_size=32, hidden_size=hq * d, intermediate_size=64, num_layers=1,
                           num_heads=hq, num_kv_heads=hkv, head_dim=d, torch_dtype=checkpoint)

    story = load(stories).config
    assert story.head_dim == 8 and story.torch_dtype == "float32"
    assert default_dtype(story, "cuda") == torch.float32 and default_dtype(story, "cpu") == torch.float32
    checkpoints = {"stories260k": story, "llama3-8b": shape(32, 8, 128, "bfloat16")}
    assert set(checkpoints) == set(build.MODELS)
    for name, cfg in checkpoints.items():
        m = build.MODELS[name]
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (m.num_q_heads, m.num_kv_heads, m.head_dim)
        assert default_dtype(cfg, "cuda") == ir.torch_dtype(m.dtype), name
    # the checkpoint's 16-bit type where the templates cover the model: bf16 for bf16 (and Q8_0) checkpoints, else fp16
    for checkpoint, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float16)):
        assert default_dtype(shape(8, 2, 64, checkpoint), "cuda") == want
        assert default_dtype(shape(8, 2, 64, checkpoint), "cpu") == torch.float32
    # not covered (head_dim not a multiple of 16; more than 16 query heads a KV head): float32 whatever the checkpoint
    assert default_dtype(shape(8, 2, 40, "bfloat16"), "cuda") == torch.float32
    assert default_dtype(shape(32, 1, 64, "float16"), "cuda") == torch.float32


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0"),
    (dict(top_p=0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(seed=2**70), r"seed must be an int in \[0, 2\*\*64 - 1\] or None"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(n=0), "n must be an int >= 1"),
    (dict(stop=[""]), "stop must be a list of non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of ints >= 0"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
])
def test_sampling_params_are_checked_with_their_range(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_largest_seed_works_and_its_samples_wrap(stories):
    llm = make(stories)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, max_tokens=4, seed=2**64 - 1, n=2))
    assert [len(c.token_ids) for c in out[0].outputs] == [4, 4]


def test_hf_config_missing_a_field_names_it(tmp_path):
    import json

    from uacompile.runtime.loader import load

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
                                                      "intermediate_size": 32, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="config.json: num_attention_heads must be an int >= 1, is missing"):
        load(tmp_path)


def test_runtime_logs_load_kv_pool_kernels_preemptions_and_throughput(stories, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="uacompile"):
        llm = make(stories, page_size=4, num_pages=24, num_cpu_pages=64, preemption="swap", max_model_len=96,
                   log_stats_interval=1e-9)
        llm.generate(PROMPTS, GREEDY)
    text = caplog.text
    assert "model loaded in" in text and "stories260K.gguf" in text
    assert "KV cache: 24 pages of 4 tokens (96 tokens)" in text and "GB on cpu; swap pool 64 pages" in text
    assert "kernels ready in" in text and "tvm-cpu" in text
    assert "preempted sequence" in text and "by swap" in text and "swapped sequence" in text
    assert "throughput:" in text and "generated tok/s" in text
    assert all(r.name.startswith("uacompile.") for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="uacompile"):
        make(stories)
    assert not caplog.records  # INFO is the user's choice; nothing at WARNING on a plain start


def test_a_clamp_that_stays_is_logged(stories, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="uacompile"):
        llm = make(stories, num_pages=6)
    assert llm.engine.scheduler.config.max_model_len == 96
    assert "max_model_len = 96, what the KV cache's 6 pages hold (the model allows 2048" in caplog.text


def test_cuda_device_without_gpu_is_a_clear_error(stories):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM(stories, device="cuda")


def test_cached_start_takes_under_a_second_and_imports_no_tvm(stories):
    """LLM(...) with its kernels in the cache: no TVM import (the cache key and the library load need none)
    and under 1 s of CPU time (CPU time, not wall time: the test machine's cores are shared)."""
    import json
    import subprocess
    import sys

    make(stories)  # the kernels are in the cache now
    probe = ("import json, sys, time; from uacompile.runtime import LLM; "
             "w, c = time.perf_counter(), time.process_time(); "
             f"LLM({stories!r}); "
             "print(json.dumps({'wall': time.perf_counter() - w, 'cpu': time.process_time() - c, "
             "'tvm': 'tvm' in sys.modules}))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert not got["tvm"], got
    assert got["cpu"] < 1.0, got
