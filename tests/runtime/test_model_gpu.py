"""The runtime on the GPU: generated CUDA kernels (uacompile.targets.cuda) under the Llama executor, its layers
(ir.RMSNorm with the residual add, SiluAndMul, the QKVRopeCache prologue) on the CUDA backend's kernels. Tiny random HF models
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
    assert kinds == {"rms_norm", "silu_and_mul"}, kinds  # the layers ran on the CUDA kernels
    assert engine.model.prologue.kind == "qkv_rope_cache"  # and the attention prologue in one launch
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


def test_cuda_graphs_capture_whatever_the_process_did_before(checkpoints, rng):
    """An engine captures its decode graphs whatever the process did before it: another graphed engine
    mid-generation (its async step in flight), a side stream with a long matmul queued and non-blocking copies
    pending from and to pinned memory, and a thread that allocated, copied and synchronised the device. The engine
    starts, and its tokens are those of an eager engine. (A device-wide synchronize from another thread *during* the
    capture invalidates it, thread-local capture mode or not: measured on the H200; the engine does not guard that.)"""
    import threading

    _, path = checkpoints["llama"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [rng.integers(3, 512, size=int(n)).tolist() for n in (1, 17, 40, 5)]
    kw = dict(device="cuda", page_size=16, num_pages=128, max_model_len=256)
    other = LLM(str(path), **kw)
    for p in prompts:
        other.engine.add_request(p, params)
    other.engine.step()
    other.engine.step()  # a decode step's sampling is in flight (async scheduling)

    def busy():
        for _ in range(50):
            x = torch.randn(1 << 16, device="cuda") + 1
            x.cpu()
            torch.empty(1 << 20, pin_memory=True)
            torch.cuda.synchronize()

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    thread.join()
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    host = torch.randn(1 << 22).pin_memory()
    back = torch.empty(1 << 22).pin_memory()
    with torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a / 64
        dev = host.to("cuda", non_blocking=True)
        back.copy_(dev, non_blocking=True)
    graphed = LLM(str(path), **kw)
    assert graphed.engine.executor.graphs is not None and graphed.engine.executor.graphs.graphs
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    eager = LLM(str(path), cuda_graphs=False, **kw)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    other.engine.run_until_done()
    assert graphed.engine.executor.graphs.replays > 0


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


# ---- 8-bit KV caches (kv_cache_dtype int8 / fp8_e4m3: pages with float32 scales) -----------------------------
KV8 = ["int8", "fp8_e4m3"]
# of the largest |logit|, against transformers in float32; measured on the CPU backend (tvm-cpu, the same
# quantisation bit for bit) over these models and inputs at most 0.027 / 0.073 (int8, fp16 / bf16) and
# 0.109 / 0.159 (fp8); the 16-bit caches there: 0.007 / 0.063
TOL_KV8 = {("int8", "float16"): 0.06, ("int8", "bfloat16"): 0.12, ("fp8_e4m3", "float16"): 0.2,
           ("fp8_e4m3", "bfloat16"): 0.25}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv", KV8)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_cuda_8bit_kv_logits_stay_near_transformers(checkpoints, arch, kv, dtype, rng):
    """Prefill chunks and decode steps over scattered pages of an int8 / fp8 cache (CUDA quantising writes, attention
    dequantising reads, the sliding window for mistral)."""
    model, path = checkpoints[arch]
    llm = LLM(str(path), device="cuda", dtype=dtype, kv_cache_dtype=kv, page_size=16, num_pages=64)
    ex = llm.engine.executor
    assert llm.engine.kernels.name == "cuda" and llm.engine.kernels.ops.kv_dtype == kv
    assert ex.kv.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv] and ex.kv.is_cuda
    assert ex.scales.dtype == torch.float32 and ex.scales.shape == ex.kv.shape[:-1] and ex.scales.is_cuda
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (37, 20, 9)]
    chunks = [[16, 8, 1, 1, 1, 10], [1] * 20, [9]]
    got = runtime_logits(ex, prompts, chunks, rng)
    assert ex.scales.abs().sum() > 0  # the writes set scales
    assert_logits_match(model, prompts, got, TOL_KV8[kv, dtype], f"{arch} {dtype} {kv}")


@pytest.mark.parametrize("kv", KV8)
@pytest.mark.parametrize("config", ["batched", "continuous", "no-prefix-cache", "recompute", "swap"])
def test_cuda_8bit_kv_graphs_give_the_eager_tokens(checkpoints, config, kv):
    """Decode graphs captured over an 8-bit cache (every cache write and attention launch taking its layer's
    scales) give the tokens of the same engine run eagerly, through padding rows, prefix hits and preemption."""
    _, path = checkpoints["qwen3"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11, 7, 30, 2, 17))]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    kw = {"page_size": 16, "num_pages": 256, "max_model_len": 256, "kv_cache_dtype": kv, **GPU_CONFIGS[config]}
    eager = LLM(str(path), device="cuda", cuda_graphs=False, async_scheduling=False, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(path), device="cuda", **kw)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert graphed.engine.executor.graphs.replays > 0 and graphed.engine.executor.scales is not None
    assert got == want
    if config in ("recompute", "swap"):
        assert graphed.engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def one_at_a_time_cuda_kv8(checkpoints):
    _, path = checkpoints["llama"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = {}
    for kv in KV8:
        llm = LLM(str(path), device="cuda", page_size=16, num_pages=256, kv_cache_dtype=kv)
        want[kv] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    return path, prompts, params, want


@pytest.mark.parametrize("kv", KV8)
@pytest.mark.parametrize("config", ["batched", "chunk-7", "no-prefix-cache", "recompute", "swap"])
def test_cuda_8bit_kv_outputs_do_not_depend_on_batching(one_at_a_time_cuda_kv8, config, kv):
    """A token's quantised K/V depend on it alone, so batching, chunking and preemption (swap moves the scales to
    the pinned host pool and back) leave the tokens of one request at a time."""
    path, prompts, params, want = one_at_a_time_cuda_kv8
    kw = {"page_size": 16, "num_pages": 256, "kv_cache_dtype": kv, **GPU_CONFIGS[config]}
    llm = LLM(str(path), device="cuda", **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want[kv]
    if config == "swap":
        assert llm.engine.executor.cpu_scales.is_pinned() and llm.engine.executor.cpu_scales.shape[2] == 64
    if config in ("recompute", "swap"):
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kv", KV8)
def test_cuda_8bit_kv_survives_swap_prefix_cache_and_copy_on_write(checkpoints, kv, rng):
    """Shared-prefix prompts through a tight pool with swap preemption give the tokens of a roomy pool without the
    prefix cache; n = 2 greedy samples (their shared partial page copied on write, scales with it) both give the
    n = 1 tokens."""
    _, path = checkpoints["llama"]
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [shared + rng.integers(3, 512, size=n).tolist() for n in (3, 9, 17, 5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = LLM(str(path), device="cuda", page_size=16, num_pages=256, enable_prefix_caching=False, kv_cache_dtype=kv)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    tight = LLM(str(path), device="cuda", page_size=16, num_pages=12, num_cpu_pages=64, preemption="swap",
                max_model_len=96, kv_cache_dtype=kv)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.scheduler.kv.prefix_hit_tokens > 0
    assert got == want
    forked = free.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2))[0]
    assert [c.token_ids for c in forked.outputs] == [want[1], want[1]]


@pytest.mark.parametrize("kv", KV8)
def test_cuda_8bit_kv_keeps_most_16_bit_greedy_tokens(checkpoints, kv):
    """Greedy decoding over an 8-bit cache follows the fp16 cache's for most of 32 tokens (the random tiny model's
    logits are close calls, so a few prompts part early)."""
    _, path = checkpoints["qwen3"]
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 23, 1, 40, 11, 7, 30, 2))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(device="cuda", dtype="float16", page_size=16, num_pages=256)
    base = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(str(path), kv_cache_dtype=kv, **kw).generate(prompts, params)]
    lead = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 32) for x, y in zip(base, got)]
    assert all(len(t) == 32 for t in got)
    assert sum(lead) >= (0.5 if kv == "int8" else 0.25) * 32 * len(prompts), lead


def test_cuda_8bit_kv_pool_buys_more_pages_for_the_same_budget(checkpoints):
    """kv_cache_bytes (or the profiled budget) is bytes: 8-bit pages (head_dim 16 elements + a float32 scale a slot
    and KV head: 20 bytes against fp16's 32) give 1.6 times the pages, and the pool tensors stay in the budget."""
    from uacompile.runtime.memory import page_bytes

    _, path = checkpoints["llama"]
    budget, pages = 1 << 20, {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(str(path), device="cuda", dtype="float16", page_size=16, kv_cache_bytes=budget, kv_cache_dtype=kv,
                  max_model_len=512, cuda_graphs=False)
        ex, n = llm.engine.executor, llm.engine.scheduler.kv.num_pages
        per_page = page_bytes(2, 2, 16, 16, "fp16" if kv == "auto" else kv)
        assert n == budget // per_page
        assert ex.kv.nbytes + (ex.scales.nbytes if ex.scales is not None else 0) <= budget
        pages[kv] = n
    assert pages["int8"] == pages["fp8_e4m3"] and pages["int8"] / pages["auto"] == pytest.approx(1.6, rel=0.02)
    prof = LLM(str(path), device="cuda", dtype="float16", kv_cache_dtype="int8", max_model_len=512,
               gpu_memory_utilization=0.5, cuda_graphs=False).engine
    want = min(32 * 512 // 16, prof.memory.kv_budget // page_bytes(2, 2, 16, 16, "int8"))
    assert prof.scheduler.kv.num_pages == want
