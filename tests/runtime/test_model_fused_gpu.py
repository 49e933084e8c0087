"""The runtime on the GPU with its fused layers: merged projections and the CUDA layer kernels (ir.RMSNorm with
the residual add, SiluAndMul, Rope) through model.use_kernels(the cuda backend), against transformers in
float32 on the CPU; greedy generation under swap preemption and prefix-cache hits."""
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
    return {arch: saved_hf_model(tmp_path_factory, arch, arch, 13, **kw)
            for arch, kw in (("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 6}))}


def fused_llm(path, **kw) -> LLM:
    llm = LLM(str(path), device="cuda", page_size=16, **kw)
    engine = llm.engine
    assert engine.model.layer_backend is engine.kernels and engine.kernels.name == "cuda"
    return llm


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_cuda_logits_match_transformers(checkpoints, arch, dtype, rng):
    model, path = checkpoints[arch]
    llm = fused_llm(path, dtype=dtype, num_pages=64)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (37, 20, 9)]
    chunks = [[16, 8, 1, 1, 1, 10], [1] * 20, [9]]
    got = runtime_logits(llm.engine.executor, prompts, chunks, rng)
    kinds = {op.kind for op in llm.engine.kernels.layer_kernels}
    assert kinds == {"rms_norm", "silu_and_mul", "rope"}, kinds  # the layers ran on the CUDA kernels
    assert_logits_match(model, prompts, got, TOL[dtype], f"{arch} {dtype}")


def test_fused_cuda_generation_survives_swap_and_prefix_cache(checkpoints, rng):
    """Swap preemption and prefix-cache hits with the layer kernels give the greedy tokens of a run with room
    to spare (the in-place residual stream carries no state between steps)."""
    _, path = checkpoints["qwen3"]
    shared = rng.integers(3, 512, size=40).tolist()
    prompts = [shared + rng.integers(3, 512, size=n).tolist() for n in (3, 9, 17, 5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = fused_llm(path, num_pages=256, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    tight = fused_llm(path, num_pages=12, num_cpu_pages=64, preemption="swap", max_model_len=96)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
