"""Packed weights on the GPU (runtime/quant.py through the cuda backend): the every-format GGUF's projections run
ir.QuantMatmul (decode rows) and ir.Dequantize + a dense matmul (longer steps), its embedding ir.Dequantize of the
gathered rows, against the decoded model in float32 on the CPU; decode graphs give the eager tokens; the float
weights quantised at load (q8_0 blocks, fp8 rows through torch._scaled_mm) stay near the bf16 model."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from model_helpers import model_logits, write_every_format_gguf  # noqa: E402

from uacompile.runtime import LLM, SamplingParams, quant  # noqa: E402
from uacompile.runtime.engine import Engine, EngineConfig  # noqa: E402
from uacompile.runtime.kernels import DECODE_ROWS, KernelOps, make_backend  # noqa: E402
from uacompile.runtime.loader import LoadedModel, load  # noqa: E402
from uacompile.runtime.model import LlamaForCausalLM, ModelConfig  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def every_format_gguf(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return write_every_format_gguf(tmp_path_factory.mktemp("quant-gpu") / "every-format.gguf")


@pytest.mark.parametrize("tokens", [1, 7, DECODE_ROWS, DECODE_ROWS + 37])
def test_packed_model_on_cuda_matches_the_decoded_model(every_format_gguf, tokens, rng):
    loaded = load(every_format_gguf)
    cfg = loaded.config
    want_model = LlamaForCausalLM.from_weights(cfg, loaded.weights)  # decoded, float32, CPU
    backend = make_backend("cuda", KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16,
                                                       torch.bfloat16), "cuda")
    model = LlamaForCausalLM.from_weights(cfg, loaded.weights, "cuda", torch.bfloat16, packed=backend.packed_formats)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, quant.QuantLinear)
    model.use_kernels(backend)
    ids = rng.integers(0, cfg.vocab_size, size=tokens).tolist()
    got, want = model_logits(model, ids, "cuda"), model_logits(want_model, ids, "cpu")
    kinds = {op.kind for op in backend.layer_kernels}
    assert ("quant_matmul" if tokens <= DECODE_ROWS else "dequantize") in kinds and "dequantize" in kinds
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 3e-2, f"{tokens} tokens: relative error {err:.3g}"


def test_packed_engine_graphs_give_the_eager_tokens(every_format_gguf, rng):
    prompts = [rng.integers(0, 320, size=n).tolist() for n in (5, 80, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        llm = LLM(str(every_format_gguf), device="cuda", cuda_graphs=graphs, page_size=16, num_pages=64)
        assert isinstance(llm.engine.model.model.layers[1].mlp.down_proj, quant.QuantLinear)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
    assert runs[0] == runs[1]


SMALL = dict(arch="qwen3", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
             num_kv_heads=4, head_dim=64, max_position_embeddings=512, qk_norm=True, torch_dtype="bfloat16")


# the relative logit error of quantising this random model's projections, measured on the H200: q8_0 up to 0.026,
# fp8 (e4m3 weights and activations) up to 0.090; a broken quantiser is off by O(1)
@pytest.mark.parametrize("quantization, tol", [("q8_0", 4e-2), ("fp8", 1.5e-1)])
def test_quantization_at_load_stays_near_bf16(quantization, tol, rng):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg = ModelConfig(**SMALL)

    def engine(quantization):  # random weights of the same seed, quantised at load or not
        return Engine(LoadedModel(cfg, None, None), EngineConfig(device="cuda", dtype="bfloat16",
                                                                 quantization=quantization), page_size=16, num_pages=64)

    ref, q = engine("none"), engine(quantization)
    kind = {"q8_0": quant.QuantLinear, "fp8": quant.Fp8Linear}[quantization]
    assert all(isinstance(m, kind) for p, m in q.model.projections().items() if p != "lm_head")
    assert q.model.decode_read_bytes() < 0.6 * ref.model.decode_read_bytes()
    for tokens in (3, 150):
        ids = rng.integers(0, cfg.vocab_size, size=tokens).tolist()
        want, got = model_logits(ref.model, ids, "cuda"), model_logits(q.model, ids, "cuda")
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < tol, f"{quantization}, {tokens} tokens: relative error {err:.3g}"
    rid = q.add_request(rng.integers(0, 1024, size=20).tolist(), SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True))
    n = 0
    while q.has_unfinished():
        n += sum(len(d.token_ids) for d in q.run_step().deltas if d.request_id == rid)
    assert n == 8
