"""GPU: the layer-op kernels (rms_norm with and without the residual add, silu_and_mul, rope, qkv_rope_cache) against the
float64 reference on fresh random inputs, outputs poisoned first; rope against reshape_and_cache's fused
RoPE; the friendly calls; CUDA-graph replay. Run on the device:
`pytest -m gpu tests/targets/cuda/test_cuda_layer_ops_gpu.py`."""
from __future__ import annotations

import numpy as np
import pytest

from uacompile import ir, reference, testing
from uacompile.ir import numpy_dtype

from cuda_helpers import to_torch

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, A, P = ir.RMSNorm, ir.SiluAndMul, ir.Rope
NORMS = [N(4096, "bf16", 1e-6), N(4096, "bf16", 1e-6, True), N(64, "fp16", 1e-5, True), N(128, "fp16", 1e-5),
         N(8, "fp32", 1e-5, True), N(27, "fp16", 1e-6, True), N(32768, "fp32", 1e-6, True), N(5120, "bf16", 1e-5, True)]
ACTS = [A(12288, "bf16"), A(96, "fp16"), A(172, "fp32"), A(5, "bf16"), A(14336, "fp16")]
ROPES = [P(32, 128, "bf16", 1e6), P(8, 128, "bf16", 1e6), P(4, 16, "fp16"), P(2, 64, "fp16", interleaved=True),
         P(6, 8, "fp32", interleaved=True), P(6, 8, "fp32"), P(3, 6, "bf16", 5e5), P(8, 256, "fp32", 1e4, True),
         P(8, 16, "bf16", 5e5, freq_factors=(1, 1, 1.5, 2.5, 8, 8, 8, 8))]
Q = ir.QKVRopeCache
PROLOGUES = [Q(32, 8, 128, 16, "bf16", "bf16", True, 1e-6, 1e6), Q(32, 8, 128, 16, "bf16", "fp8_e4m3", True, 1e-6, 1e6),
             Q(32, 8, 128, 16, "fp16", "int8", True, 1e-6, 1e6), Q(32, 8, 128, 16, "bf16", "bf16"),
             Q(4, 2, 64, 8, "fp16", "fp16", rope_interleaved=True), Q(6, 3, 6, 4, "fp32", "fp32", True),
             Q(2, 1, 96, 16, "bf16", "int8", True, freq_factors=tuple(range(1, 49)))]
TOKENS = [1, 7, 300]


@pytest.fixture(scope="module", autouse=True)
def _built():
    from uacompile.targets.cuda import api

    api.preload([*NORMS, *ACTS, *ROPES, *PROLOGUES])


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().double().numpy()


def poisoned(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(0xFF)  # NaN for floats: unwritten elements cannot pass
    return t


def arrays(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


def ulps_apart(got: np.ndarray, want: np.ndarray, dtype: str) -> np.ndarray:
    """|got - want| in units of dtype's spacing at want (both float64 arrays of dtype values)."""
    spacing = np.spacing(np.abs(want).astype(numpy_dtype(dtype))).astype(np.float64)
    return np.abs(got - want) / np.maximum(spacing, np.finfo(np.float64).tiny)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op", NORMS, ids=lambda o: f"{o.dtype}-E{o.hidden_size}{'-residual' if o.residual else ''}")
def test_rms_norm_matches_reference(op, num_tokens, rng):
    from uacompile.targets.cuda import api

    inp = testing.rms_norm_inputs(op, rng, num_tokens)
    want_res = inp["residual"].copy() if op.residual else None
    want = reference.rms_norm(op, inp["x"], inp["weight"], want_res)
    dev = {k: to_torch(v) for k, v in arrays(inp).items()}
    out = poisoned(dev["x"].shape, dev["x"].dtype)
    api.kernel(op)(**dev, out=out)
    got = to_numpy(out)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    tol = testing.layer_tolerance(op.dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max() * 1e-2)
    if op.residual:  # x + residual rounded once: the kernel's float32 sum of two dtype values rounds the same
        np.testing.assert_array_equal(to_numpy(dev["residual"]), want_res.astype(np.float64))


def test_rms_norm_in_place_on_x(rng):
    """out may be x itself: each row is read whole before it is written."""
    from uacompile.targets.cuda import api

    op = N(4096, "bf16", 1e-6, True)
    inp = testing.rms_norm_inputs(op, rng, 64)
    want = reference.rms_norm(op, inp["x"], inp["weight"], inp["residual"].copy())
    x, res = to_torch(inp["x"]), to_torch(inp["residual"])
    assert api.rms_norm(x, to_torch(inp["weight"]), op.eps, residual=res, out=x) is x
    np.testing.assert_allclose(to_numpy(x), want, rtol=testing.layer_tolerance("bf16"), atol=1e-3)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op", ACTS, ids=lambda o: f"{o.dtype}-I{o.intermediate_size}")
def test_silu_and_mul_matches_reference(op, num_tokens, rng):
    from uacompile.targets.cuda import api

    inp = testing.silu_and_mul_inputs(op, rng, num_tokens)
    want = reference.silu_and_mul(op, inp["x"])
    x = to_torch(inp["x"])
    out = poisoned((num_tokens, op.intermediate_size), x.dtype)
    api.kernel(op)(x=x, out=out)
    got = to_numpy(out)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    # silu in float32 may round the other way once before the product: at most 1 ulp of dtype after it
    tol = testing.layer_tolerance(op.dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 1e-2)
    # and against torch on the device (transformers' F.silu(gate) * up): the same roundings
    g, u = x.chunk(2, dim=-1)
    torch_out = to_numpy(torch.nn.functional.silu(g) * u)
    assert (ulps_apart(got, torch_out, op.dtype) <= 1).all()


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op", ROPES, ids=lambda o: f"{o.dtype}-H{o.num_heads}-D{o.head_dim}-{'gptj' if o.interleaved else 'neox'}"
                         f"{'-scaled' if o.freq_factors else ''}")
def test_rope_matches_reference(op, num_tokens, rng):
    """Bit for bit but for device sin/cos differing from libm in the last float64 bit, which very rarely
    flips a rounding of the stored dtype (as reshape_and_cache's fused RoPE): 1 element in 10^4 may be 1 ulp off."""
    from uacompile.targets.cuda import api

    inp = testing.rope_inputs(op, rng, num_tokens)
    want = inp["x"].copy()
    reference.rope_op(op, want, inp["positions"])
    x, pos = to_torch(inp["x"]), to_torch(inp["positions"])
    api.kernel(op)(x=x, positions=pos)
    got, ref = to_numpy(x), want.astype(np.float64)
    off = ulps_apart(got, ref, op.dtype)
    assert off.max() <= 1 and (off > 0).mean() <= 1e-4, f"{(off > 0).sum()} of {off.size} elements differ"


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_equals_reshape_and_caches_fused_rope(interleaved, rng):
    """The same K through rope then reshape_and_cache, and through reshape_and_cache with rope=True: equal caches."""
    from uacompile.targets.cuda import api

    T, H, D = 257, 8, 128
    k = to_torch(testing.random_floats(rng, (T, H, D), "bf16"))
    v = to_torch(testing.random_floats(rng, (T, H, D), "bf16"))
    pos = torch.from_numpy(rng.integers(0, 1 << 17, size=T).astype(np.int64)).cuda()
    slots = torch.arange(T, dtype=torch.int64, device="cuda")
    fused_k, fused_v = (torch.zeros((T // 16 + 1, 16, H, D), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    api.reshape_and_cache(k, v, fused_k, fused_v, slots, positions=pos, rope_theta=1e6, rope_interleaved=interleaved)
    plain_k, plain_v = torch.zeros_like(fused_k), torch.zeros_like(fused_v)
    api.reshape_and_cache(api.rope(k.clone(), pos, 1e6, interleaved), v, plain_k, plain_v, slots)
    assert torch.equal(plain_k, fused_k) and torch.equal(plain_v, fused_v)


def test_layer_ops_replay_in_a_cuda_graph(rng):
    """Captured once, replayed on new data in the same buffers: the replay computes on the new data."""
    from uacompile.targets.cuda import api

    norm, act, rot = N(256, "bf16", 1e-6, True), A(128, "bf16"), P(4, 64, "bf16", 1e6)
    x, res, gu = (torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    w = torch.ones(256, dtype=torch.bfloat16, device="cuda")
    q = torch.zeros(8, 4, 64, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(8, dtype=torch.int64, device="cuda")
    h, y = torch.empty_like(x), torch.empty(8, 128, dtype=torch.bfloat16, device="cuda")
    graph = api.capture_graph([lambda: api.rms_norm(x, w, norm.eps, residual=res, out=h),
                               lambda: api.silu_and_mul(gu, out=y), lambda: api.rope(q, pos, rot.rope_theta)])
    inp = testing.rms_norm_inputs(norm, rng, 8)
    x.copy_(to_torch(inp["x"]))
    res.copy_(to_torch(inp["residual"]))
    w.copy_(to_torch(inp["weight"]))
    gu_np = testing.silu_and_mul_inputs(act, rng, 8)["x"]
    gu.copy_(to_torch(gu_np))
    rp = testing.rope_inputs(rot, rng, 8)
    q.copy_(to_torch(rp["x"]))
    pos.copy_(to_torch(rp["positions"]))
    graph.replay()
    torch.cuda.synchronize()
    tol = testing.layer_tolerance("bf16")
    np.testing.assert_allclose(to_numpy(h), reference.rms_norm(norm, inp["x"], inp["weight"], inp["residual"].copy()),
                               rtol=tol, atol=1e-3)
    np.testing.assert_allclose(to_numpy(y), reference.silu_and_mul(act, gu_np), rtol=tol, atol=1e-3)
    want_q = rp["x"].copy()
    reference.rope_op(rot, want_q, rp["positions"])
    assert ulps_apart(to_numpy(q), want_q.astype(np.float64), "bf16").max() <= 1


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("op", PROLOGUES, ids=lambda o: f"{o.dtype}-{o.kv_dtype}-Hq{o.num_q_heads}-D{o.head_dim}"
                         f"{'-norm' if o.qk_norm else ''}{'-gptj' if o.rope_interleaved else ''}")
def test_qkv_rope_cache_matches_reference(op, num_tokens, rng):
    """q_out poisoned first; the caches full of random data, so a skipped slot (-1) or another page's rows
    would show. The float32 norm may round a head element the other way (1 ulp) before RoPE, as the rope kernel's
    sincos may: a few elements in 10^3 may be a rounding off, none unwritten."""
    from uacompile.targets.cuda import api

    inp = testing.qkv_rope_cache_inputs(op, rng, num_tokens)
    want = {k: v.copy() for k, v in arrays(inp).items()}
    want_q = reference.qkv_rope_cache(op, **want)
    dev = {k: to_torch(v) for k, v in arrays(inp).items()}
    q_out = poisoned((num_tokens, op.num_q_heads, op.head_dim), dev["qkv"].dtype)
    api.kernel(op)(**dev, q_out=q_out)
    got_q = to_numpy(q_out)
    assert np.isfinite(got_q).all(), "unwritten (NaN) q_out"
    exact = op.dtype != "fp32" or not op.qk_norm  # a float32 norm against float64 rounds half the fp32 values apart
    # within 2 ulps of the head's largest element everywhere (RoPE mixes a pair: an input rounding moves both); an
    # fp32 output carries the float32 norm's own error (rsqrtf's 2 ulps, the two products) through RoPE: 8 fp32 ulps
    head_max = np.abs(want_q).max(-1, keepdims=True).astype(numpy_dtype(op.dtype))
    bound = 2 if exact else 8
    assert (np.abs(got_q - want_q) <= bound * np.spacing(head_max).astype(np.float64)).all()
    if exact:
        off = ulps_apart(got_q, want_q, op.dtype)
        assert (off > 0).mean() <= 2e-3, f"{(off > 0).sum()} of {off.size} q elements differ"
    for name in ("k_cache", "v_cache"):
        got = dev[name].cpu()
        got = got.view(torch.uint8).numpy() if op.quantized else to_numpy(got)
        ref = want[name].view(np.uint8) if op.quantized else want[name].astype(np.float64)
        if not exact and name == "k_cache":
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            continue
        diff = got != ref
        assert diff.mean() <= 2e-3, f"{name}: {diff.sum()} of {diff.size} differ"
        if name == "v_cache" or not op.qk_norm:  # V is only copied or quantised; K without the norm only rotated
            assert diff.mean() <= 1e-4, f"{name}: {diff.sum()} of {diff.size} differ"
    if op.quantized:
        np.testing.assert_allclose(dev["k_scale"].cpu().numpy(), want["k_scale"], rtol=1e-2)
        np.testing.assert_array_equal(dev["v_scale"].cpu().numpy(), want["v_scale"])


def test_qkv_rope_cache_replays_in_a_cuda_graph(rng):
    """Captured once (a decode step's prologue), replayed on new qkv, positions and slots in the same buffers."""
    from uacompile.targets.cuda import api

    op = PROLOGUES[0]
    inp = testing.qkv_rope_cache_inputs(op, rng, 8)
    dev = {k: to_torch(v) for k, v in arrays(inp).items()}
    q_out = poisoned((8, op.num_q_heads, op.head_dim), dev["qkv"].dtype)
    graph = api.capture_graph([lambda: api.qkv_rope_cache(
        dev["qkv"], dev["positions"], dev["slot_mapping"], dev["k_cache"], dev["v_cache"], op.num_q_heads,
        op.rope_theta, q_out=q_out, q_norm=dev["q_norm"], k_norm=dev["k_norm"], eps=op.eps)])
    fresh = testing.qkv_rope_cache_inputs(op, rng, 8)
    for name in ("qkv", "positions", "slot_mapping", "k_cache", "v_cache", "q_norm", "k_norm"):
        dev[name].copy_(to_torch(fresh[name]))
    q_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = {k: v.copy() for k, v in arrays(fresh).items()}
    want_q = reference.qkv_rope_cache(op, **want)
    assert (ulps_apart(to_numpy(q_out), want_q, op.dtype) > 0).mean() <= 2e-3
    assert (to_numpy(dev["v_cache"]) == want["v_cache"].astype(np.float64)).all()
