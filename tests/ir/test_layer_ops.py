"""The layer ops (rms_norm, silu_and_mul, rope): IR checks and parameter lists, and their reference
semantics against independent formulations (torch, transformers' order of roundings)."""
import numpy as np
import pytest
import torch

from uacompile import IRError, ir, program, testing
from uacompile import reference as R
from uacompile.ir import RMSNorm, Rope, SiluAndMul, numpy_dtype

TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def as_torch(a, dtype):
    return torch.from_numpy(a.astype(np.float32)).to(TORCH_DTYPE[dtype])


@pytest.mark.parametrize("kwargs, field", [
    (dict(hidden_size=0), "rms_norm.hidden_size"), (dict(hidden_size=64, dtype="int8"), "rms_norm.dtype"),
    (dict(hidden_size=64, eps=0.0), "rms_norm.eps"), (dict(hidden_size=64, eps=float("nan")), "rms_norm.eps"),
    (dict(hidden_size=64, residual=1), "rms_norm.residual"),
])
def test_rms_norm_rejects_bad_fields(kwargs, field):
    with pytest.raises(IRError, match=field):
        RMSNorm(**kwargs)


@pytest.mark.parametrize("cls, kwargs, field", [
    (SiluAndMul, dict(intermediate_size=-1), "silu_and_mul.intermediate_size"),
    (SiluAndMul, dict(intermediate_size=8, dtype="fp8_e4m3"), "silu_and_mul.dtype"),
    (Rope, dict(num_heads=4, head_dim=7), "rope.head_dim"), (Rope, dict(num_heads=0, head_dim=8), "rope.num_heads"),
    (Rope, dict(num_heads=4, head_dim=8, rope_theta=0.0), "rope.rope_theta"),
    (Rope, dict(num_heads=4, head_dim=8, interleaved="yes"), "rope.interleaved"),
    (Rope, dict(num_heads=4, head_dim=8, freq_factors=(1.0, 2.0)), "rope.freq_factors"),
    (Rope, dict(num_heads=4, head_dim=4, freq_factors=(1.0, 0.0)), "rope.freq_factors"),
    (Rope, dict(num_heads=4, head_dim=4, freq_factors=(1.0, "x")), "rope.freq_factors"),
])
def test_layer_ops_reject_bad_fields(cls, kwargs, field):
    with pytest.raises(IRError, match=field):
        cls(**kwargs)


def test_layer_op_params_and_round_trip():
    assert [p.name for p in RMSNorm(64).params()] == ["x", "weight", "out", "num_tokens"]
    res = RMSNorm(64, residual=True).params()
    assert [(p.name, p.role) for p in res] == [("x", "in"), ("residual", "inout"), ("weight", "in"), ("out", "out"),
                                               ("num_tokens", "in")]
    assert SiluAndMul(48, "bf16").params()[0].shape == ("num_tokens", 96)
    assert [(p.name, p.role) for p in Rope(4, 16).params()] == [("x", "inout"), ("positions", "in"), ("num_tokens", "in")]
    for op in (RMSNorm(64, "bf16", 1e-5, True), SiluAndMul(48), Rope(4, 16, "fp32", 1e6, True)):
        assert ir.op_from_dict(op.to_dict()) == op
        assert op.symbol().startswith(f"ua_{op.kind}_")
    assert RMSNorm(64, eps=1e-5).key() != RMSNorm(64, eps=1e-6).key()
    assert len({Rope(4, 16).key(), Rope(4, 16, interleaved=True).key(), Rope(4, 16, rope_theta=1e6).key()}) == 3
    scaled = Rope(2, 4, freq_factors=[1, 8])  # a list (JSON) becomes a tuple of floats: hashable, equal after a round trip
    assert scaled.freq_factors == (1.0, 8.0) and hash(scaled) == hash(ir.op_from_dict(scaled.to_dict()))
    assert scaled.key() != Rope(2, 4).key()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_transformers_order(dtype, residual, rng):
    """transformers: h = x + residual in dtype; weight * (h.float() * rsqrt(mean(h^2) + eps)).to(dtype)."""
    op = RMSNorm(96, dtype, 1e-5, residual)
    inp = testing.rms_norm_inputs(op, rng, 7)
    x, w = as_torch(inp["x"], dtype), as_torch(inp["weight"], dtype)
    h = x + as_torch(inp["residual"], dtype) if residual else x
    h32 = h.float()
    want = (w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + op.eps)).to(h.dtype)).double().numpy()
    got = R.run(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    tol = testing.layer_tolerance(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    if residual:  # the new residual stream, rounded to dtype, in place
        np.testing.assert_array_equal(inp["residual"].astype(np.float64), h.double().numpy())


def test_rms_norm_scale_invariant_and_unit_rms(rng):
    op = RMSNorm(128, "fp32", 1e-12)
    inp = testing.rms_norm_inputs(op, rng, 4)
    ones = np.ones(128, np.float32)
    out = R.run(op, x=inp["x"], weight=ones)
    np.testing.assert_allclose(np.sqrt((out ** 2).mean(-1)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(R.run(op, x=inp["x"] * np.float32(8), weight=ones), out, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_silu_and_mul_matches_torch(dtype, rng):
    op = SiluAndMul(40, dtype)
    inp = testing.silu_and_mul_inputs(op, rng, 6)
    g, u = as_torch(inp["x"], dtype).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(g) * u).double().numpy()
    got = R.run(op, x=inp["x"])
    tol = testing.layer_tolerance(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 1e-2)
    assert got.shape == (6, 40)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_rope_op_is_reshape_and_caches_rope(interleaved, dtype, rng):
    """rope on x equals the K that reshape_and_cache with rope=True stores (bit for bit)."""
    op = Rope(2, 32, dtype, 5e5, interleaved)
    inp = testing.rope_inputs(op, rng, 9)
    rc = ir.ReshapeAndCache(2, 32, 16, dtype, dtype, rope=True, rope_theta=5e5, rope_interleaved=interleaved)
    k_cache = np.zeros((1, 16, 2, 32), numpy_dtype(dtype))
    v_cache = np.zeros_like(k_cache)
    R.reshape_and_cache(rc, inp["x"], inp["x"], np.arange(9, dtype=np.int64), k_cache, v_cache,
                        positions=inp["positions"])
    x = inp["x"].copy()
    assert R.run(op, x=x, positions=inp["positions"]) is x
    np.testing.assert_array_equal(x.view(np.uint8), k_cache[0, :9].view(np.uint8))
    assert x.dtype == numpy_dtype(dtype)


def test_rope_freq_factors_divide_the_frequencies(rng):
    """Linear scaling by 4 (every factor 4) is RoPE at a quarter of each position; factors of 1 change nothing."""
    x = testing.random_floats(rng, (6, 2, 8), "fp32").astype(np.float64)
    pos = np.arange(6, dtype=np.int64) * 4
    np.testing.assert_allclose(R.rope(x, pos, 1e4, freq_factors=[4.0] * 4), R.rope(x, pos // 4, 1e4), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(R.rope(x, pos, 1e4, freq_factors=[1.0] * 4), R.rope(x, pos, 1e4))


def test_rope_preserves_pair_norms_and_relative_angles(rng):
    """A rotation: pair norms unchanged; <rope(q, m), rope(k, n)> depends on m - n only."""
    op = Rope(1, 16, "fp32", 100.0)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    dots = []
    for m, n in ((5, 2), (103, 100), (3, 0)):
        dots.append(float((R.rope(q, np.array([m]), 100.0) * R.rope(k, np.array([n]), 100.0)).sum()))
    np.testing.assert_allclose(dots, dots[0], rtol=1e-12)
    x = testing.rope_inputs(op, rng, 5)["x"]
    before = x.astype(np.float64)
    R.run(op, x=x, positions=np.arange(5, dtype=np.int64) * 1000)
    norm = lambda a: a[..., :8] ** 2 + a[..., 8:] ** 2  # noqa: E731
    np.testing.assert_allclose(norm(x.astype(np.float64)), norm(before), rtol=1e-5)


def test_program_runs_a_layer_chain(rng):
    """add+norm -> silu_and_mul through Program's reference run: outs are bound by name."""
    norm, act = RMSNorm(16, "fp32", 1e-6, residual=True), SiluAndMul(8, "fp32")
    prog = program.Program()
    for name in ("x", "res"):
        prog.add_tensor(name, "fp32", (3, 16))
    prog.add_tensor("w", "fp32", (16,))
    prog.add_tensor("h", "fp32", (3, 16))
    prog.add_op(norm, x="x", residual="res", weight="w", out="h")
    prog.add_tensor("y", "fp32", (3, 8))
    prog.add_op(act, x="h", out="y")
    program.validate(prog)
    inp = testing.rms_norm_inputs(norm, rng, 3)
    env = program.run_reference(prog, dict(x=inp["x"], res=inp["residual"].copy(), w=inp["weight"]))
    h = R.rms_norm(norm, inp["x"], inp["weight"], inp["residual"].copy())
    np.testing.assert_allclose(env["y"], R.silu_and_mul(act, h), rtol=1e-12)
