"""TVM lowering of the GGUF weight ops (lower.tvm_quant): the CPU kernels (LLVM) against the float64 reference on
random packed weights (every bit pattern of the quants, signed scales), outputs poisoned with NaN first.
quant_matmul within testing.matmul_tolerance; dequantize bit for bit (as its dtype)."""
import numpy as np
import pytest

pytest.importorskip("tvm")

from uacompile import reference, testing  # noqa: E402
from uacompile.ir import WEIGHT_FORMATS, Dequantize, Kernel, QuantMatmul, numpy_dtype  # noqa: E402
from uacompile.lower.config import TVMConfig  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel  # noqa: E402

FORMATS = list(WEIGHT_FORMATS)
DTYPES = ("fp32", "bf16", "fp16")


def check_matmul(kernel, num_tokens, rng):
    op = kernel.op if isinstance(kernel, Kernel) else kernel
    inp = testing.quant_matmul_inputs(op, rng, num_tokens)
    out = np.full((num_tokens, op.out_features), np.nan, numpy_dtype(op.dtype))
    cpu_kernel(kernel)(x=inp["x"], weight=inp["weight"], out=out)
    want = reference.quant_matmul(op, inp["x"], inp["weight"])
    assert np.isfinite(out.astype(np.float64)).all()
    err = testing.matmul_error(out, want)
    assert err <= testing.matmul_tolerance(op.dtype), f"{op}: error {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_matmul_k4096(fmt, dtype, rng):
    for num_tokens in (1, 3):
        check_matmul(QuantMatmul(4096, 24, fmt, dtype), num_tokens, rng)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_matmul_k1536_tokens(fmt, rng):
    for num_tokens in (1, 17, 64):
        check_matmul(QuantMatmul(1536, 40, fmt, "fp32"), num_tokens, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_quant_matmul_k576(fmt, dtype, rng):
    """SmolLM2's hidden size (576 = 18 blocks of 32): rows not a multiple of a task's, every token count."""
    for num_tokens in (1, 3, 17, 64):
        check_matmul(QuantMatmul(576, 70, fmt, dtype), num_tokens, rng)


@pytest.mark.parametrize("cfg", [TVMConfig(rows=1, token_tile=1), TVMConfig(rows=7, token_tile=3, unroll_dot=True),
                                 TVMConfig(rows=64, token_tile=8)], ids=["rows1-tile1", "rows7-tile3-unroll", "rows64-tile8"])
@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
def test_quant_matmul_schedules(fmt, cfg, rng):
    """The schedule knobs change the loops, never the result."""
    K = 256 * 3 if fmt == "q6_k" else 576
    for num_tokens in (1, 4, 17):
        check_matmul(Kernel(QuantMatmul(K, 33, fmt, "fp32"), cfg), num_tokens, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_bit_exact(fmt, dtype, rng):
    for K, rows in ((4096, 9), (1536, 5)) + (((576, 13),) if WEIGHT_FORMATS[fmt].block == 32 else ()):
        op = Dequantize(K, fmt, dtype)
        inp = testing.dequantize_inputs(op, rng, rows)
        out = np.full((rows, K), np.nan, numpy_dtype(dtype))
        cpu_kernel(op)(weight=inp["weight"], out=out)
        want = reference.dequantize_op(op, inp["weight"]).astype(numpy_dtype(dtype))
        bits = np.uint32 if dtype == "fp32" else np.uint16
        np.testing.assert_array_equal(out.view(bits), want.view(bits), err_msg=f"{op}")


def test_quant_matmul_torch_tensors(rng):
    """torch CPU tensors (bf16 too) go in and come out as numpy arrays do."""
    torch = pytest.importorskip("torch")
    op = QuantMatmul(576, 48, "q4_1", "bf16")
    inp = testing.quant_matmul_inputs(op, rng, 2)
    x = torch.from_numpy(inp["x"].astype(np.float32)).to(torch.bfloat16)
    out = torch.full((2, 48), float("nan"), dtype=torch.bfloat16)
    cpu_kernel(op)(x=x, weight=torch.from_numpy(inp["weight"]), out=out)
    err = testing.matmul_error(out.float().numpy(), reference.quant_matmul(op, inp["x"], inp["weight"]))
    assert err <= testing.matmul_tolerance("bf16")


def test_bad_weight_shape_is_named(rng):
    op = QuantMatmul(576, 8, "q4_1", "fp32")
    with pytest.raises(ValueError, match=r"quant_matmul.weight: dim 1 must be 360"):
        cpu_kernel(op)(x=np.zeros((1, 576), np.float32), weight=np.zeros((8, 361), np.uint8),
                       out=np.zeros((1, 8), np.float32))


def test_cpu_threads(rng):
    """A kernel load fixes TVM's pool size at the usable CPUs (TVM alone would halve it on x86); set_cpu_threads
    resizes it and refuses nonsense; results do not depend on it."""
    import os

    from uacompile.lower.tvm_build import set_cpu_threads

    op = QuantMatmul(576, 96, "q4_1", "fp32")
    check_matmul(op, 2, rng)
    assert int(os.environ["TVM_NUM_THREADS"]) >= 1
    try:
        set_cpu_threads(1)
        check_matmul(op, 2, rng)
    finally:
        set_cpu_threads(int(os.environ["TVM_NUM_THREADS"]))
    with pytest.raises(ValueError, match="set_cpu_threads"):
        set_cpu_threads(0)
