"""GPU: the KV-eviction kernels against the float64 reference on fresh random inputs, outputs poisoned first:
kv_score for every method (GQA, interleaved window queries of several sequences, one without any, scores past
kv_len, a row longer than a block's threads), gather_tokens bit for bit (float and 8-bit caches with scales).
Run on the device: `pytest -m gpu tests/targets/cuda/test_cuda_evict_gpu.py`."""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, reference, testing
from uacompile.ir import numpy_dtype

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCORES = [ir.KVScore(32, 8, 128, 16, "bf16", "bf16", method=m) for m in ir.SCORE_METHODS] + [
    ir.KVScore(9, 3, 64, 16, "fp32", "fp32"), ir.KVScore(6, 6, 80, 8, "fp16", "fp16", 0.25, "attention")]
GATHERS = [ir.GatherTokens(8, 128, 16, "bf16"), ir.GatherTokens(8, 128, 16, "int8"),
           ir.GatherTokens(2, 64, 4, "fp8_e4m3"), ir.GatherTokens(3, 8, 16, "fp32")]


@pytest.fixture(scope="module", autouse=True)
def _built():
    from uacompile.targets.cuda import api

    api.preload([*SCORES, *GATHERS])


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == numpy_dtype("bf16"):
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to("cuda")
    if a.dtype == numpy_dtype("fp8_e4m3"):
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn).to("cuda")
    return torch.from_numpy(a).to("cuda")


def arrays(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


@pytest.mark.parametrize("op", SCORES, ids=lambda o: f"{o.method}-{o.q_dtype}-Hq{o.num_q_heads}-Hkv{o.num_kv_heads}")
def test_kv_score_matches_reference(op, rng):
    from uacompile.targets.cuda import api

    inp = testing.kv_score_inputs(op, rng, [300, 5, 40, 129], [8, 2, 0, 16], max_kv_len=310)
    want = reference.kv_score(op, **arrays(inp), max_kv_len=310)
    dev = {k: to_torch(v) for k, v in arrays(inp).items()}
    out = torch.full(want.shape, float("nan"), dtype=torch.float32, device="cuda")
    api.kernel(op)(**dev, scores=out)
    got = out.cpu().double().numpy()
    assert (np.isneginf(got) == np.isneginf(want)).all()
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), "unwritten (NaN) scores"
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-3, atol=1e-4 * np.abs(want[fin]).max())
    assert (got[2][fin[2]] == 0).all()


@pytest.mark.parametrize("op", GATHERS, ids=lambda o: f"{o.kv_dtype}-H{o.num_kv_heads}-D{o.head_dim}")
def test_gather_tokens_bit_exact(op, rng):
    from uacompile.targets.cuda import api

    inp = testing.gather_tokens_inputs(op, rng, num_layers=3, num_src_pages=max(9, -(-37 // op.page_size) + 2),
                                        num_tokens=37)  # more source slots than tokens at every page size
    want = {k: v.copy() for k, v in arrays(inp).items()}
    reference.gather_tokens(op, want["kv"], want["src_slots"], want["dst_slots"], want.get("scales"))
    dev = {k: to_torch(v) for k, v in arrays(inp).items()}
    api.kernel(op)(**dev)
    np.testing.assert_array_equal(dev["kv"].view(torch.uint8).cpu().numpy(), want["kv"].view(np.uint8))
    if op.quantized:
        np.testing.assert_array_equal(dev["scales"].cpu().numpy(), want["scales"])
