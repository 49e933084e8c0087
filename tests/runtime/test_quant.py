"""runtime/quant.py and the packed-weight path through the loader and the model: torch's decoding of the six
GGUF block formats and its Q8_0 / e4m3 quantisers against the reference, GGUF projections kept packed (runs of
formats within a fused layer, llama's permuted Q/K rows, a packed tied embedding) giving the decoded model's
logits, and the engine's `quantization` option."""
import gguf
import numpy as np
import pytest
import torch

from model_helpers import EVERY_FORMAT_SHAPE, model_logits, write_every_format_gguf  # noqa: E402

from uacompile import ir, reference, testing
from uacompile.runtime import LLM
from uacompile.runtime import quant
from uacompile.runtime.engine import EngineConfig
from uacompile.runtime.loader import load
from uacompile.runtime.model import LlamaForCausalLM

Q = gguf.GGMLQuantizationType
FORMATS = list(ir.WEIGHT_FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_the_reference_bit_for_bit(fmt, rng):
    raw = testing.random_quant_weight(rng, fmt, 7, 512)
    want = reference.dequantize_blocks(raw, fmt, 512)
    got = quant.dequantize(torch.from_numpy(raw), fmt, 512)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    half = quant.dequantize(torch.from_numpy(raw), fmt, 512, torch.bfloat16)
    assert torch.equal(half, torch.from_numpy(want).to(torch.bfloat16))


def test_quantize_q8_0_is_ggml(rng):
    w = rng.standard_normal((9, 320)).astype(np.float32)
    w[2, 64:96] = 0
    w[4, :32] = 0.5  # ties: roundf rounds halves away from zero
    assert np.array_equal(quant.quantize_q8_0(torch.from_numpy(w)).numpy(), reference.quantize_blocks(w, "q8_0"))


def test_fp8_rows_scale_each_row_to_its_maximum(rng):
    w = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32))
    w[3] = 0
    q, scale = quant.fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5,) and scale[3] == 1
    back = q.float() * scale[:, None]
    assert (back - w).abs().max() <= 0.07 * w.abs().max()
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 2, 4]], torch.full((4,), 448.0))


# ---------------------------------------------------------------- a GGUF of every format
E, H, HKV, D = EVERY_FORMAT_SHAPE["E"], EVERY_FORMAT_SHAPE["H"], EVERY_FORMAT_SHAPE["HKV"], EVERY_FORMAT_SHAPE["D"]


@pytest.fixture(scope="module")
def every_format_gguf(tmp_path_factory):
    return write_every_format_gguf(tmp_path_factory.mktemp("quant") / "every-format.gguf")


def test_projections_stay_packed_and_give_the_decoded_logits(every_format_gguf):
    loaded = load(every_format_gguf)
    cfg, weights = loaded.config, loaded.weights
    assert cfg.tie_word_embeddings and weights.stored_format("model.embed_tokens.weight") == "q8_0"
    dense = LlamaForCausalLM.from_weights(cfg, weights)
    packed = LlamaForCausalLM.from_weights(cfg, weights, packed=frozenset(FORMATS))
    qkv0 = packed.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv0, quant.QuantLinear)
    assert [(p.weight_format, p.start, p.stop) for p in qkv0.parts] == [("q4_k", 0, 384), ("q6_k", 384, 512)]
    assert isinstance(packed.model.embed_tokens, quant.QuantEmbedding) and isinstance(packed.lm_head, quant.QuantLinear)
    assert packed.lm_head.weight0.data_ptr() == packed.model.embed_tokens.weight.data_ptr()  # tied: one buffer
    assert "q4_k" in packed.weight_formats() and "float32" not in packed.weight_formats()
    assert packed.weight_bytes() < dense.weight_bytes() / 5
    # the packed rows are the file's rows (llama's Q/K un-permuted as they load), decoding to the dense weights
    q_rows = qkv0.weight0[:H * D]
    assert torch.equal(quant.dequantize(q_rows, "q4_k", E), weights["model.layers.0.self_attn.q_proj.weight"])
    ids = [5, 17, 200, 3, 99, 301, 42, 7]
    want, got = model_logits(dense, ids), model_logits(packed, ids)
    assert np.isfinite(want).all() and want.std() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_only_the_named_formats_stay_packed(every_format_gguf):
    loaded = load(every_format_gguf)
    model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, packed=frozenset({"q8_0"}))
    layers = model.model.layers
    assert isinstance(layers[1].mlp.gate_up_proj, torch.nn.Linear)  # q5_k: decoded
    assert isinstance(layers[0].mlp.down_proj, quant.QuantLinear)  # q8_0: packed
    assert isinstance(model.model.embed_tokens, quant.QuantEmbedding)


def test_quantization_q8_0_of_a_float_model(every_format_gguf):
    loaded = load(every_format_gguf)
    dense = LlamaForCausalLM.from_weights(loaded.config, loaded.weights)
    q8 = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, quantization="q8_0")
    assert all(isinstance(m, quant.QuantLinear) and m.parts[0].weight_format == "q8_0" for m in q8.projections().values())
    assert isinstance(q8.model.embed_tokens, quant.QuantEmbedding)
    ids = [1, 2, 3, 250, 11, 64]
    want, got = model_logits(dense, ids), model_logits(q8, ids)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def test_engine_quantization_option(every_format_gguf):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, fp8, q8_0"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization='fp8' runs on CUDA"):
        EngineConfig(quantization="fp8")
    llm = LLM(str(every_format_gguf), device="cpu", quantization="q8_0", num_pages=16, page_size=8)
    assert "q8_0" in llm.engine.model.weight_formats()


@pytest.mark.parametrize("qt", list(gguf.GGML_QUANT_SIZES), ids=lambda t: t.name)
def test_every_gguf_type_loads_or_is_refused_with_the_supported_list(tmp_path, qt):
    """Each tensor type the gguf library knows, as one projection of a file (random bytes): a supported type loads
    and decodes to the layer's shape, any other is refused naming it and the supported types."""
    from uacompile.runtime.loader import GGUF_TENSOR_TYPES

    path = write_every_format_gguf(tmp_path / f"{qt.name}.gguf", override_type={"blk.0.ffn_down.weight": qt})
    if qt.name in GGUF_TENSOR_TYPES:
        w = load(path).weights["model.layers.0.mlp.down_proj.weight"]
        assert w.shape == (E, 512)
    else:
        with pytest.raises(ValueError, match=rf"blk.0.ffn_down.weight: type {qt.name} is not supported "
                                             rf"\(supported: .*Q6_K"):
            load(path)
