"""quant_matmul / dequantize: IR checks and parameter lists, and the reference's GGUF block decoding and
quantisers against the gguf library's numpy implementation (ggml's layouts), bit for bit."""
import gguf
import numpy as np
import pytest
from gguf import quants

from uacompile import IRError, ir, testing
from uacompile import reference as R


@pytest.mark.parametrize("kwargs, field", [
    (dict(in_features=0, out_features=8), "quant_matmul.in_features"),
    (dict(in_features=64, out_features=8, weight_format="q3_k"), "quant_matmul.weight_format"),
    (dict(in_features=96, out_features=8, weight_format="q4_k"), "quant_matmul.in_features"),
    (dict(in_features=40, out_features=8, weight_format="q8_0"), "quant_matmul.in_features"),
    (dict(in_features=64, out_features=8, dtype="int8"), "quant_matmul.dtype"),
])
def test_quant_matmul_rejects_bad_fields(kwargs, field):
    with pytest.raises(IRError, match=field):
        ir.QuantMatmul(**kwargs)


def test_dequantize_rejects_bad_fields():
    with pytest.raises(IRError, match="dequantize.in_features"):
        ir.Dequantize(100, "q6_k")
    with pytest.raises(IRError, match="dequantize.weight_format"):
        ir.Dequantize(256, "Q4_K")


@pytest.mark.parametrize("fmt", list(ir.WEIGHT_FORMATS))
def test_weight_formats_match_gguf(fmt):
    f = ir.WEIGHT_FORMATS[fmt]
    t = getattr(gguf.GGMLQuantizationType, f.gguf)
    assert gguf.GGML_QUANT_SIZES[t] == (f.block, f.nbytes)
    op = ir.QuantMatmul(2 * f.block * 4, 48, fmt, "bf16")
    w = op.params()[1]
    assert w.dtype == "uint8" and w.shape == (48, 8 * f.nbytes)
    assert ir.Dequantize(512, fmt).params()[0].shape == ("num_rows", f.row_bytes(512))


@pytest.mark.parametrize("fmt", list(ir.WEIGHT_FORMATS))
def test_dequantize_blocks_is_ggml_bit_for_bit(fmt):
    rng = np.random.default_rng(7)
    cols = 1024
    raw = testing.random_quant_weight(rng, fmt, 9, cols)
    ours = R.dequantize_blocks(raw, fmt, cols)
    theirs = quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, ir.WEIGHT_FORMATS[fmt].gguf))
    assert ours.dtype == np.float32 and ours.shape == (9, cols)
    assert np.array_equal(ours.view(np.uint32), np.asarray(theirs, np.float32).view(np.uint32))
    assert np.isfinite(ours).all() and 0.005 < ours.std() < 0.1  # the test weights are of the intended size


def test_dequantize_blocks_fully_random_bytes():
    """Every bit pattern of the quants and scale fields (NaN / inf fp16 scales included) decodes as ggml does."""
    rng = np.random.default_rng(3)
    for fmt, f in ir.WEIGHT_FORMATS.items():
        raw = rng.integers(0, 256, size=(3, 4 * f.nbytes), dtype=np.uint8)
        ours = R.dequantize_blocks(raw, fmt, 4 * f.block)
        with np.errstate(all="ignore"):
            theirs = np.asarray(quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, f.gguf)), np.float32)
        same = (ours == theirs) | (np.isnan(ours) & np.isnan(theirs))
        assert same.all(), fmt


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantize_blocks_is_ggml_bit_for_bit(fmt):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((6, 512)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, 32:64] = 5.0  # a constant block
    ours = R.quantize_blocks(w, fmt)
    theirs = quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    assert ours.shape == (6, ir.WEIGHT_FORMATS[fmt].row_bytes(512))
    assert np.array_equal(ours, theirs)
    back = R.dequantize_blocks(ours, fmt, 512)
    step = {"q8_0": 1 / 127, "q4_0": 1 / 8, "q4_1": 1 / 15}[fmt]
    assert np.abs(back - w).max() <= np.abs(w).max() * step * 1.01


def test_quantize_blocks_refuses_k_quants():
    with pytest.raises(ValueError, match="q4_k"):
        R.quantize_blocks(np.zeros((1, 256), np.float32), "q4_k")


@pytest.mark.parametrize("fmt", list(ir.WEIGHT_FORMATS))
def test_quant_matmul_reference_is_dense_matmul_of_the_decoded_weights(fmt):
    rng = np.random.default_rng(5)
    op = ir.QuantMatmul(512, 24, fmt, "fp32")
    inp = testing.quant_matmul_inputs(op, rng, 3)
    want = inp["x"].astype(np.float64) @ R.dequantize_blocks(inp["weight"], fmt, 512).astype(np.float64).T
    got = R.run(op, x=inp["x"], weight=inp["weight"])
    assert got.shape == (3, 24) and np.array_equal(got, want)
    deq = R.run(ir.Dequantize(512, fmt, "bf16"), weight=inp["weight"])
    assert np.array_equal(deq, R.dequantize_blocks(inp["weight"], fmt, 512).astype(ir.numpy_dtype("bf16")).astype(np.float64))
