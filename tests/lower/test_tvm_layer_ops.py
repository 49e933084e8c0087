"""TVM lowering of the layer ops (rms_norm, silu_and_mul, rope): the CPU kernels (LLVM) against the float64
reference on fresh random inputs, outputs poisoned first; rope bit for bit (libm's sin / cos on both sides);
and the CUDA source of each compiles with nvcc (sm_80, sm_90)."""
import re
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("tvm")

from uacompile import reference, testing  # noqa: E402
from uacompile.ir import RMSNorm, Rope, SiluAndMul, c_signature, numpy_dtype  # noqa: E402
from uacompile.lower.tvm_build import cpu_kernel  # noqa: E402

NORMS = [RMSNorm(64, "fp32", 1e-5, True), RMSNorm(96, "fp16", 1e-6), RMSNorm(80, "bf16", 1e-6, True),
         RMSNorm(8, "fp32", 1e-5)]
ACTS = [SiluAndMul(48, "fp32"), SiluAndMul(40, "fp16"), SiluAndMul(24, "bf16")]
ROPES = [Rope(4, 16, "fp32"), Rope(2, 8, "fp32", 1e6, interleaved=True), Rope(3, 32, "fp16", 5e5),
         Rope(2, 64, "bf16", 1e6, interleaved=True), Rope(2, 8, "fp32", 5e5, freq_factors=(1.0, 1.5, 8.0, 32.0))]


def arrays(d):
    return {k: v for k, v in d.items() if isinstance(v, np.ndarray)}


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("op", NORMS, ids=lambda o: f"{o.dtype}-E{o.hidden_size}{'-residual' if o.residual else ''}")
def test_rms_norm(op, num_tokens, rng):
    inp = testing.rms_norm_inputs(op, rng, num_tokens)
    want_res = inp["residual"].copy() if op.residual else None
    want = reference.rms_norm(op, inp["x"], inp["weight"], want_res)
    out = np.full(inp["x"].shape, np.nan, numpy_dtype(op.dtype))
    cpu_kernel(op)(**arrays(inp), out=out)
    got = out.astype(np.float64)
    assert np.isfinite(got).all()
    tol = testing.layer_tolerance(op.dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max() * 1e-2)
    if op.residual:
        np.testing.assert_array_equal(inp["residual"].astype(np.float64), want_res.astype(np.float64))


def test_rms_norm_out_may_be_x(rng):
    op = RMSNorm(64, "fp16", 1e-6, True)
    inp = testing.rms_norm_inputs(op, rng, 5)
    want = reference.rms_norm(op, inp["x"], inp["weight"], inp["residual"].copy())
    cpu_kernel(op)(x=inp["x"], residual=inp["residual"], weight=inp["weight"], out=inp["x"])
    np.testing.assert_allclose(inp["x"].astype(np.float64), want, rtol=testing.layer_tolerance("fp16"), atol=1e-4)


@pytest.mark.parametrize("op", ACTS, ids=lambda o: f"{o.dtype}-I{o.intermediate_size}")
def test_silu_and_mul(op, rng):
    inp = testing.silu_and_mul_inputs(op, rng, 7)
    out = np.full((7, op.intermediate_size), np.nan, numpy_dtype(op.dtype))
    cpu_kernel(op)(x=inp["x"], out=out)
    got = out.astype(np.float64)
    assert np.isfinite(got).all()
    tol = testing.layer_tolerance(op.dtype)
    np.testing.assert_allclose(got, reference.silu_and_mul(op, inp["x"]), rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("op", ROPES, ids=lambda o: f"{o.dtype}-H{o.num_heads}-D{o.head_dim}-{'gptj' if o.interleaved else 'neox'}"
                         f"{'-scaled' if o.freq_factors else ''}")
def test_rope_bit_exact(op, rng):
    inp = testing.rope_inputs(op, rng, 11)
    want = inp["x"].copy()
    reference.rope_op(op, want, inp["positions"])
    cpu_kernel(op)(x=inp["x"], positions=inp["positions"])
    np.testing.assert_array_equal(inp["x"].view(np.uint8), want.view(np.uint8))


def test_bad_arguments_are_named(rng):
    op = SiluAndMul(8, "fp32")
    with pytest.raises(ValueError, match=r"silu_and_mul.out: dim 1 must be 8"):
        cpu_kernel(op)(x=np.zeros((3, 16), np.float32), out=np.zeros((3, 9), np.float32))
    with pytest.raises(TypeError, match=r"rope.positions: expected dtype int64"):
        cpu_kernel(ROPES[0])(x=np.zeros((2, 4, 16), np.float32), positions=np.zeros(2, np.int32))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile(arch, tmp_path):
    from uacompile.lower.tvm_cuda import build_cuda_library

    for op in (NORMS[0], NORMS[1], ACTS[2], ROPES[1], ROPES[2], ROPES[4]):
        so = build_cuda_library(op, arch, tmp_path / op.symbol())
        assert f'extern "C" {c_signature(op)}' in so.with_suffix(".cu").read_text()
        syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
        assert re.search(rf"\bT {op.symbol()}$", syms, re.M), f"{op.symbol()} not exported"
