"""GPU: the quantize_rows kernel (ir.QuantizeRows) against the reference bit for bit (bytes and scales) on random
rows of very different scales, a zero row and a row holding a NaN, outputs poisoned first; the same under CUDA-graph
replay. (torch's own CUDA ops are not the reference: a division by a CUDA scalar multiplies by its reciprocal, so
their scales can differ from amax / 448 in the last bit; measured on the H200.) Run on the device:
`pytest -m gpu tests/targets/cuda/test_cuda_quantize_rows_gpu.py`."""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, reference

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Q = ir.QuantizeRows
VARIANTS = [Q(4096, "bf16"), Q(12288, "bf16"), Q(4096, "fp16", "int8"), Q(8, "fp32"), Q(27, "fp16"),
            Q(576, "bf16", "int8"), Q(12288, "fp16")]
TOKENS = [1, 7, 300]


@pytest.fixture(scope="module", autouse=True)
def _built():
    from uacompile.targets.cuda import api

    api.preload(VARIANTS)


def rows(op: ir.QuantizeRows, rng, num_tokens: int) -> torch.Tensor:
    x = rng.standard_normal((num_tokens, op.hidden_size)).astype(np.float32)
    x *= np.exp(rng.uniform(-12, 9, size=(num_tokens, 1))).astype(np.float32)  # 6e-6 to 8e3
    if num_tokens > 2:
        x[1] = 0
        x[2, op.hidden_size // 2] = np.nan
    return torch.from_numpy(x).to(ir.torch_dtype(op.dtype)).cuda()


def check(op, x, out, scale):
    with np.errstate(invalid="ignore"):
        want_q, want_s = reference.run(op, x=x.float().cpu().numpy())
    assert np.array_equal(scale.cpu().numpy(), want_s)
    got, want = out.view(torch.uint8).cpu().numpy(), np.asarray(want_q).view(np.uint8)
    if op.out_dtype == "fp8_e4m3":
        nan = np.isnan(np.asarray(want_q).astype(np.float32))
        assert (np.isnan(out.float().cpu().numpy()) == nan).all()
        assert np.array_equal(got[~nan], want[~nan])
    else:
        finite = np.isfinite(x.float().cpu().numpy())  # int8 has no NaN: where x has one, the value is unspecified
        assert np.array_equal(got[finite], want[finite])


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op", VARIANTS, ids=lambda o: f"{o.dtype}-E{o.hidden_size}-{o.out_dtype}")
def test_quantize_rows_is_the_reference(op, num_tokens, rng):
    from uacompile.targets.cuda import api

    x = rows(op, rng, num_tokens)
    out = torch.empty(x.shape, dtype=ir.torch_dtype(op.out_dtype), device="cuda")
    out.view(torch.uint8).fill_(0x7F)  # e4m3 NaN / int8 127: unwritten elements cannot pass
    scale = torch.full((num_tokens,), float("nan"), device="cuda")
    api.quantize_rows(x, op.out_dtype, out=out, scale=scale)
    check(op, x, out, scale)


def test_quantize_rows_replays_in_a_graph(rng):
    from uacompile.targets.cuda import api

    op = VARIANTS[0]
    x = rows(op, rng, 64)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(64, device="cuda")
    graph = api.capture_graph([lambda: api.quantize_rows(x, out=out, scale=scale)])
    x.copy_(rows(op, rng, 64))
    out.view(torch.uint8).fill_(0x7F)
    graph.replay()
    torch.cuda.synchronize()
    check(op, x, out, scale)
