"""The runtime on the GPU: generated CUDA kernels (uacompile.targets.cuda) under the Llama executor, its layers
(ir.RMSNorm with the residual add, SiluAndMul, Rope) on the CUDA backend's kernels. Tiny random HF models
(head_dim 16: the CUDA attention template needs a multiple of 16) in fp16 / bf16 against transformers in
float32 on the CPU."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_helpers import assert_logits_match, runtime_logits, saved_hf_model  # noqa: E402

from uacompile.runtime import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {"float16": 2e-2, "bfloat16": 6e-2}  # of the largest |logit|


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return {arch: saved_hf_model(tmp_path_factory, arch, arch, 11, **kw)
            for arch, kw in (("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 6}))}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_cuda_logits_match_transformers(checkpoints, arch, dtype, rng):
    model, path = checkpoints[arch]
    llm = LLM(str(path), device="cuda", dtype=dtype, page_size=16, num_pages=64)
    engine = llm.engine
    assert engine.model.layer_backend is engine.kernels and engine.kernels.name == "cuda"
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (37, 20, 9)]
    chunks = [[16, 8, 1, 1, 1, 10], [1] * 20, [9]]
    got = runtime_logits(engine.executor, prompts, chunks, rng)
    kinds = {op.kind for op in engine.kernels.layer_kernels}
    assert kinds == {"rms_norm", "silu_and_mul", "rope"}, kinds  # the layers ran on the CUDA kernels
    assert_logits_match(model, prompts, got, TOL[dtype], f"{arch} {dtype}")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_generation_survives_swap_and_prefix_cache(checkpoints, arch, rng):
    """Swap preemption through the pinned CPU pool, and prefix-cache hits, give the greedy tokens
    of a run with room to spare (the layer kernels' in-place residual stream carries no state between steps)."""
    _, path = checkpoints[arch]
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [shared + rng.integers(3, 512, size=n).tolist() for n in (3, 9, 17, 5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = LLM(str(path), device="cuda", page_size=16, num_pages=256, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    tight = LLM(str(path), device="cuda", page_size=16, num_pages=12, num_cpu_pages=64, preemption="swap",
                max_model_len=96)
    assert tight.engine.model.layer_backend is tight.engine.kernels
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


GPU_CONFIGS = {
    "batched": {},
    "continuous": {"max_num_batched_tokens": 16, "max_prefill_chunk": 8},
    "chunk-1": {"max_prefill_chunk": 1},
    "chunk-7": {"max_prefill_chunk": 7},
    "chunk-64": {"max_prefill_chunk": 64},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "recompute": {"num_pages": 12, "preemption": "recompute", "max_model_len": 96},
    "swap": {"num_pages": 12, "num_cpu_pages": 64, "preemption": "swap", "max_model_len": 96},
}


@pytest.fixture(scope="module")
def one_at_a_time_cuda(checkpoints):
    _, path = checkpoints["qwen3"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11))]
    llm = LLM(str(path), device="cuda", page_size=16, num_pages=256)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return path, prompts, params, [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_cuda_outputs_do_not_depend_on_batching(one_at_a_time_cuda, config):
    """The CPU equality suite (test_llm.py) on the CUDA kernels: batching, continuous arrivals,
    prefill chunk sizes 1/7/64, prefix caching off, preemption by recompute and by swap."""
    path, prompts, params, want = one_at_a_time_cuda
    kw = {"page_size": 16, "num_pages": 256, **GPU_CONFIGS[config]}
    llm = LLM(str(path), device="cuda", **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    if config in ("recompute", "swap"):
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("config", ["batched", "continuous", "no-prefix-cache", "recompute", "swap"])
def test_cuda_graphs_give_the_eager_tokens(checkpoints, config):
    """Decode steps replayed from CUDA graphs give the greedy tokens of the same engine run eagerly: batch sizes
    1 to 9 (buckets 1, 2, 4, 8, 16 with padding rows), prefix-cache hits, preemption by recompute and by swap."""
    _, path = checkpoints["qwen3"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11, 7, 30, 2, 17))]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    kw = {"page_size": 16, "num_pages": 256, "max_model_len": 256, **GPU_CONFIGS[config]}
    eager = LLM(str(path), device="cuda", cuda_graphs=False, async_scheduling=False, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(path), device="cuda", **kw)  # graphs and async scheduling (the defaults)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert graphed.engine.executor.graphs.replays > 0 and eager.engine.executor.graphs is None
    assert graphed.engine.async_scheduling and got == want


@pytest.mark.parametrize("config", ["continuous", "recompute", "swap"])
def test_cuda_async_scheduling_gives_the_sync_outputs(checkpoints, config):
    """Steps launched before the previous step's ids come back (read on the GPU from its samples) give what
    the synchronous engine gives: greedy, seeded sampling with n = 2 and log-probs, stop tokens, EOS, a penalty
    request (whose steps wait), preemption."""
    _, path = checkpoints["qwen3"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11, 7))]
    base = LLM(str(path), device="cuda", page_size=16, num_pages=256, max_model_len=256, async_scheduling=False)
    greedy = [o.outputs[0].token_ids for o in base.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                                                    ignore_eos=True))]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[greedy[1][6]], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20),  # EOS: made greedy[2][4] below
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=14, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=1)]
    kw = {"page_size": 16, "num_pages": 256, "max_model_len": 256, **GPU_CONFIGS[config]}
    if config in ("recompute", "swap"):
        kw["num_pages"] = 6  # 96 tokens for prompts of 87 and their outputs: preemptions even where EOS comes early
    outs = {}
    for on in (False, True):
        llm = LLM(str(path), device="cuda", async_scheduling=on, **kw)
        llm.engine.model.cfg.eos_token_ids = (greedy[2][4],)
        res = llm.generate(prompts, params)
        outs[on] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in res]
        kv = llm.engine.scheduler.kv
        assert kv.num_free_pages == kv.num_pages
        if config in ("recompute", "swap"):
            assert llm.engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]
    (stopped, r1), (eos, r2) = outs[True][1][0], outs[True][2][0]
    assert r1 == r2 == "stop" and stopped[-1] == greedy[1][6] and eos[-1] == greedy[2][4] and len(eos) < 20


def test_cuda_graph_inputs_follow_each_step(checkpoints, rng):
    """The graphs read their inputs from static buffers: a second batch (other prompts, other pages, other
    lengths) through the same engine gives what a fresh eager engine gives, so no replay sees stale page tables."""
    _, path = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphed = LLM(str(path), device="cuda", page_size=16, num_pages=128, max_model_len=256)
    for n in (3, 6):
        prompts = [rng.integers(3, 512, size=int(rng.integers(1, 60))).tolist() for _ in range(n)]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        eager = LLM(str(path), device="cuda", page_size=16, num_pages=128, max_model_len=256, cuda_graphs=False)
        assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_cuda_engine_prepares_every_kernel_before_serving(checkpoints, monkeypatch):
    """Start-up builds or loads every kernel a step within the engine's limits may launch: serving afterwards
    never builds (a build would go through loader.load)."""
    from uacompile.targets.cuda import loader

    _, path = checkpoints["llama"]
    llm = LLM(str(path), device="cuda", page_size=16, num_pages=64, max_model_len=512, max_num_seqs=8)

    def no_build(*a, **k):
        raise AssertionError("a kernel was built while serving")

    monkeypatch.setattr(loader, "load", no_build)
    monkeypatch.setattr("uacompile.targets.cuda.api.load", no_build)
    prompts = [list(range(3, 3 + n)) for n in (500, 1, 77, 260, 9, 33, 128, 64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_cuda_second_start_loads_every_kernel_from_the_cache_in_under_a_second(checkpoints, caplog, monkeypatch):
    """The first engine builds (or loads) every kernel its limits reach; a second one on the same model runs no
    nvcc and has them all ready in under a second."""
    import logging
    import re

    from uacompile import nvcc

    _, path = checkpoints["qwen3"]
    kw = dict(device="cuda", page_size=16, num_pages=64, max_model_len=512, max_num_seqs=8, cuda_graphs=False)
    LLM(str(path), **kw)

    def no_nvcc(*a, **k):
        raise AssertionError("nvcc ran on a second start")

    monkeypatch.setattr(nvcc, "compile_library", no_nvcc)
    with caplog.at_level(logging.INFO, logger="uacompile.runtime"):
        LLM(str(path), **kw)
    m = re.search(r"kernels ready in ([\d.]+) s \(cuda backend; (\d+) prepared", caplog.text)
    assert m, caplog.text
    assert float(m.group(1)) < 1.0 and int(m.group(2)) > 0, m.group(0)


def test_cuda_default_kv_pool_is_sized_from_the_profile(checkpoints):
    """Without num_pages the pool takes gpu_memory_utilization of the device less the weights and the largest
    step's activations (runtime/memory.py); an impossible fraction is a clear error."""
    _, path = checkpoints["llama"]
    llm = LLM(str(path), device="cuda", max_model_len=512, gpu_memory_utilization=0.5)
    prof = llm.engine.memory
    assert prof.kv_budget > 0 and prof.weights > 0 and prof.activation > 0
    assert llm.engine.scheduler.config.max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(path), device="cuda", max_model_len=512, gpu_memory_utilization=1.5)
