"""GPU: quant_matmul over every GGUF block format x dtype x token count against the float64 reference
(testing.matmul_error <= testing.matmul_tolerance; outputs poisoned with NaN first), dequantize bit-exact to
reference.dequantize_blocks rounded to the dtype, the friendly calls, a Launcher and CUDA-graph capture / replay.
Run on the device: `pytest -m gpu tests/targets/cuda/test_cuda_quant_matmul_gpu.py`."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from uacompile import ir, reference, testing

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMATS = tuple(ir.WEIGHT_FORMATS)
DTYPES = ("bf16", "fp16", "fp32")
TOKENS = (1, 2, 3, 8, 16, 17, 64, 100)  # every token tile size: 1-8, 9-16, 17-32, 33+ (100: two tiles of 64)
# (K, N): K = 576 (not a multiple of 256: a masked last unit) for the 32-weight formats q8_0 and q4_1; Qwen3-8B's
# K = 4096 and 12288 for all, N not a multiple of a block's rows
SHAPES = {f: ([(576, 200)] if f in ("q8_0", "q4_1") else []) + [(4096, 136), (12288, 72)] for f in FORMATS}
OPS = [ir.QuantMatmul(K, N, f, d) for f in FORMATS for (K, N) in SHAPES[f] for d in DTYPES]
# more than 8192 rows: the wide-layer tiles of render.quant_matmul_tiles (4 warps a block)
OPS += [ir.QuantMatmul(4096, 8200, "q4_k", "bf16"), ir.QuantMatmul(576, 8200, "q8_0", "fp16")]
# K = 608: rows of 646 (q8_0) and 342 (q4_0) bytes, every other one at byte 2 of a word
OPS += [ir.QuantMatmul(608, 72, "q8_0", "bf16"), ir.QuantMatmul(608, 72, "q4_0", "fp16")]
# K = 256 and 768: an odd number of 256-weight units, so a two-unit CUDA-core stage has its second unit past K
OPS += [ir.QuantMatmul(K, 40, f, "bf16") for f in FORMATS for K in (256, 768)]
DEQUANT = [ir.Dequantize(K, f, d) for f in FORMATS for K in sorted({K for K, _ in SHAPES[f]}) for d in DTYPES]


def _variants():
    from uacompile.targets.cuda.config import QuantMatmulConfig

    # the tensor-core kernels at 1-2 tokens too (the CUDA-core ones take those by default), the CUDA-core kernels
    # up to 8 tokens, and with other warps and stages, without programmatic dependent launch
    out = [ir.Kernel(ir.QuantMatmul(K, N, f, d), QuantMatmulConfig(gemv_tokens=0))
           for f in FORMATS for (K, N) in SHAPES[f][:1] for d in ("bf16", "fp16")]
    out += [ir.Kernel(ir.QuantMatmul(K, N, f, d), QuantMatmulConfig(gemv_tokens=8))
            for f in FORMATS for (K, N) in SHAPES[f][-1:] for d in ("bf16", "fp16")]
    out += [ir.Kernel(ir.QuantMatmul(4096, 136, f, "bf16"),
                      QuantMatmulConfig(gemv_tokens=8, pdl=False, gemv_warps=4, gemv_stages=2)) for f in FORMATS]
    return out


VARIANTS = _variants()


@pytest.fixture(scope="module", autouse=True)
def _built():
    from uacompile.targets.cuda import api

    api.preload([*OPS, *VARIANTS, *DEQUANT])


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype == ir.numpy_dtype("bf16") else torch.from_numpy(a)
    return t.to("cuda")


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(0xFF)  # NaN for floats: unwritten elements cannot pass
    return t


@pytest.mark.parametrize("op", OPS, ids=lambda o: f"{o.weight_format}-{o.in_features}x{o.out_features}-{o.dtype}")
def test_quant_matmul_matches_reference(op):
    check_against_reference(op)


@pytest.mark.parametrize("kernel", VARIANTS, ids=lambda k: f"{k.op.weight_format}-{k.op.in_features}x"
                                                           f"{k.op.out_features}-{k.op.dtype}-{k.config}")
def test_quant_matmul_configs_match_reference(kernel):
    check_against_reference(kernel)


def check_against_reference(kernel):
    from uacompile.targets.cuda import api

    op = ir.as_kernel(kernel).op
    rng = np.random.default_rng(zlib.crc32(repr(kernel).encode()))
    kern = api.kernel(kernel)
    weight = testing.random_quant_weight(rng, op.weight_format, op.out_features, op.in_features)
    w_dev = to_torch(weight)
    deq = reference.dequantize_blocks(weight, op.weight_format, op.in_features).astype(np.float64)
    x_all = testing.random_floats(rng, (max(TOKENS), op.in_features), op.dtype)
    tol = testing.matmul_tolerance(op.dtype)
    for T in TOKENS:
        x = x_all[:T]
        out = poisoned((T, op.out_features), ir.torch_dtype(op.dtype))
        kern(x=to_torch(x), weight=w_dev, out=out)
        got = out.float().cpu().double().numpy()
        want = x.astype(np.float64) @ deq.T
        assert np.isfinite(got).all(), (op, T)
        err = testing.matmul_error(got, want)
        assert err <= tol, (op, T, err)


@pytest.mark.parametrize("op", DEQUANT, ids=lambda o: f"{o.weight_format}-{o.in_features}-{o.dtype}")
def test_dequantize_is_bit_exact(op):
    from uacompile.targets.cuda import api

    rng = np.random.default_rng(7)
    for rows in (1, 37, 256):
        inputs = testing.dequantize_inputs(op, rng, rows)
        out = poisoned((rows, op.in_features), ir.torch_dtype(op.dtype))
        api.kernel(op)(weight=to_torch(inputs["weight"]), out=out)
        want = reference.dequantize_op(op, inputs["weight"]).astype(np.float32)
        got = out.float().cpu().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (op, rows)


def test_friendly_calls_and_graph_replay():
    from uacompile.targets.cuda import api

    rng = np.random.default_rng(3)
    K, N, fmt = 4096, 256, "q4_k"
    weight = to_torch(testing.random_quant_weight(rng, fmt, N, K))
    x = to_torch(testing.random_floats(rng, (5, K), "bf16"))
    out = api.quant_matmul(x, weight, fmt)
    w16 = api.dequantize(weight, fmt, K, torch.bfloat16)
    want = (x.double() @ w16.double().T)
    assert testing.matmul_error(out.double().cpu(), want.cpu()) <= 2 * testing.matmul_tolerance("bf16")
    # a Launcher (weight bound once), captured into a graph: replays follow x's new contents
    op = api.quant_matmul_op(x, weight, fmt)
    launch = api.kernel(op).launcher({"weight": weight}, {"x": x, "out": out})
    out2 = poisoned(tuple(out.shape), torch.bfloat16)
    graph = api.capture_graph([lambda: launch(x, out2), lambda: api.dequantize(weight, fmt, K, out=w16)])
    x.copy_(to_torch(testing.random_floats(rng, (5, K), "bf16")))
    out2.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = (x.double() @ w16.double().T)
    assert torch.isfinite(out2).all()
    assert testing.matmul_error(out2.double().cpu(), want.cpu()) <= 2 * testing.matmul_tolerance("bf16")
