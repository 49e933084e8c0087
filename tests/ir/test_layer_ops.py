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


# ---------------------------------------------------------------- qkv_rope_cache
Q = ir.QKVRopeCache


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_q_heads=6, num_kv_heads=4, head_dim=8), "qkv_rope_cache.num_q_heads"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=7), "qkv_rope_cache.head_dim"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="fp16", kv_dtype="bf16"), "qkv_rope_cache.kv_dtype"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, qk_norm=1), "qkv_rope_cache.qk_norm"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, eps=-1.0), "qkv_rope_cache.eps"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, rope_theta=0.0), "qkv_rope_cache.rope_theta"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, freq_factors=(1.0,)), "qkv_rope_cache.freq_factors"),
    (dict(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=3), "qkv_rope_cache.page_size"),
])
def test_qkv_rope_cache_rejects_bad_fields(kwargs, field):
    with pytest.raises(IRError, match=field):
        Q(**kwargs)


def test_qkv_rope_cache_params():
    names = [(p.name, p.role) for p in Q(4, 2, 8, 16, "bf16", "int8", qk_norm=True).params()]
    assert names == [("qkv", "in"), ("q_norm", "in"), ("k_norm", "in"), ("positions", "in"), ("slot_mapping", "in"),
                     ("q_out", "out"), ("k_cache", "inout"), ("v_cache", "inout"), ("k_scale", "inout"),
                     ("v_scale", "inout"), ("num_tokens", "in"), ("num_pages", "in")]
    plain = Q(4, 2, 8).params()
    assert plain[0].shape == ("num_tokens", 8, 8) and "q_norm" not in [p.name for p in plain]
    op = Q(4, 2, 8, 16, "bf16", "fp8_e4m3", True, 1e-5, 1e6, True, (1, 2, 3, 4))
    assert ir.op_from_dict(op.to_dict()) == op and op.symbol().startswith("ua_qkv_rope_cache_")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_cache_is_the_unfused_ops(kv_dtype, qk_norm, rng):
    """The op equals its parts run one by one (rms_norm of each head, rope of q and of k, reshape_and_cache of the
    rotated K and V), bit for bit: caches, scales and q_out."""
    op = Q(4, 2, 16, 4, "bf16", kv_dtype, qk_norm, 1e-6, 1e6)
    inp = testing.qkv_rope_cache_inputs(op, rng, 9)
    arrays = {k: v for k, v in inp.items() if isinstance(v, np.ndarray)}
    mine = {k: v.copy() for k, v in arrays.items()}
    q_out = R.run(op, **mine)
    T, (Hq, Hkv, D) = 9, (4, 2, 16)
    q, k, v = inp["qkv"][:, :Hq], inp["qkv"][:, Hq:Hq + Hkv], inp["qkv"][:, Hq + Hkv:]
    if qk_norm:
        norm = RMSNorm(D, "bf16", 1e-6)
        q = R.rms_norm(norm, q.reshape(-1, D), inp["q_norm"]).astype(q.dtype).reshape(T, Hq, D)
        k = R.rms_norm(norm, k.reshape(-1, D), inp["k_norm"]).astype(k.dtype).reshape(T, Hkv, D)
    q, k = q.copy(), k.copy()
    R.rope_op(Rope(Hq, D, "bf16", 1e6), q, inp["positions"])
    theirs = {k_: v_.copy() for k_, v_ in arrays.items() if k_ in ("k_cache", "v_cache", "k_scale", "v_scale")}
    rc = ir.ReshapeAndCache(Hkv, D, 4, "bf16", kv_dtype, rope=True, rope_theta=1e6)
    R.run(rc, k=k, v=np.ascontiguousarray(v), slot_mapping=inp["slot_mapping"], positions=inp["positions"], **theirs)
    np.testing.assert_array_equal(q_out, q.astype(np.float64))
    for name, want in theirs.items():
        np.testing.assert_array_equal(mine[name].view(np.uint8), want.view(np.uint8), err_msg=name)
    skipped = inp["slot_mapping"] < 0
    assert skipped.any() and np.isfinite(q_out[skipped]).all()  # q_out of a padding token is still written


def test_qkv_rope_cache_norm_matches_torch(rng):
    """Qwen3's attention prologue in torch (transformers: q_norm / k_norm RMSNorm, then rotate-half RoPE with
    float64 tables) lands within a rounding of the op's q_out."""
    op = Q(4, 2, 32, 4, "fp32", "fp32", True, 1e-6, 1e6)
    inp = testing.qkv_rope_cache_inputs(op, rng, 5)
    q_out = R.run(op, **{k: v.copy() for k, v in inp.items() if isinstance(v, np.ndarray)})
    q = torch.from_numpy(inp["qkv"][:, :4].astype(np.float64))
    w = torch.from_numpy(inp["q_norm"].astype(np.float64))
    q = w * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    inv = 1.0 / 1e6 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    ang = torch.from_numpy(inp["positions"]).double()[:, None, None] * inv
    a, b = q[..., :16], q[..., 16:]
    want = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).numpy()
    np.testing.assert_allclose(q_out, want, rtol=1e-5, atol=1e-5)
