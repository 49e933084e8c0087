"""CPU: the layer-op templates (rms_norm, silu_and_mul, rope, qkv_rope_cache) render with the IR launcher and compile with
nvcc for sm_80 and sm_90, with no register spills; the friendly calls reject bad tensors before any device
work."""
from __future__ import annotations

import re
import shutil

import pytest

from uacompile import ir

from cuda_helpers import assert_renders_with_launcher, spill_stores

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

N, A, P, Q = ir.RMSNorm, ir.SiluAndMul, ir.Rope, ir.QKVRopeCache
# model shapes (Llama / Qwen3-8B bf16, stories260K fp32) and edge cases: one vector a row, odd sizes
# (1-element vectors), a row wider than 4 vectors a thread at 1024 threads
LAYER_OP_VARIANTS = [
    N(4096, "bf16", 1e-6), N(4096, "bf16", 1e-6, residual=True), N(64, "fp16", 1e-5, True), N(128, "fp16", 1e-5),
    N(8, "fp32", 1e-5, True), N(27, "fp16", 1e-6, True), N(32768, "fp32", 1e-6, True),
    A(12288, "bf16"), A(96, "fp16"), A(172, "fp32"), A(5, "bf16"),
    P(32, 128, "bf16", 1e6), P(8, 128, "bf16", 1e6), P(4, 16, "fp16"), P(2, 64, "fp16", interleaved=True),
    P(6, 8, "fp32", interleaved=True), P(6, 8, "fp32"), P(3, 6, "bf16", 5e5), P(8, 256, "fp32", 1e4, True),
    P(8, 16, "bf16", 5e5, freq_factors=(1, 1, 1.5, 2.5, 8, 8, 8, 8)),  # llama3-style scaled frequencies
    # Qwen3-8B's prologue on each cache dtype; Llama's (no norm); odd shapes (a row short of its lane group,
    # 1-element vectors, a block holding q, k and v rows)
    Q(32, 8, 128, 16, "bf16", "bf16", True, 1e-6, 1e6), Q(32, 8, 128, 16, "bf16", "fp8_e4m3", True, 1e-6, 1e6),
    Q(32, 8, 128, 16, "fp16", "int8", True, 1e-6, 1e6), Q(32, 8, 128, 16, "bf16", "bf16"),
    Q(4, 2, 64, 8, "fp16", "fp16", rope_interleaved=True), Q(6, 3, 6, 4, "fp32", "fp32", True),
    Q(2, 1, 96, 16, "bf16", "int8", True, freq_factors=tuple(range(1, 49))),
]


def test_render_has_the_ir_launcher():
    assert_renders_with_launcher(LAYER_OP_VARIANTS)


def test_rope_template_holds_the_reference_frequencies():
    import numpy as np

    from uacompile.targets.cuda.render import render_op

    op = P(4, 16, "fp16", 12345.0)
    src = render_op(op)
    table = re.search(r"INV_FREQ\[D / 2\] = \{ (.*) \};", src).group(1)
    got = np.array([float(v) for v in table.split(", ")])
    want = 1.0 / 12345.0 ** (np.arange(0, 16, 2, dtype=np.float64) / 16)
    assert (got == want).all()  # exact: the same float64 expression as reference.rope
    scaled = render_op(P(4, 16, "fp16", 12345.0, freq_factors=(1, 2, 3, 4, 5, 6, 7, 8)))
    table = re.search(r"INV_FREQ\[D / 2\] = \{ (.*) \};", scaled).group(1)
    assert [float(v) for v in table.split(", ")] == list(want / np.arange(1, 9))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layer_ops_compile_and_export_launchers(arch):
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    res = build(LAYER_OP_VARIANTS, arch)
    assert res.path.exists() and res.arch == arch
    lib = load_library(res.path, LAYER_OP_VARIANTS, res)
    for op in LAYER_OP_VARIANTS:
        assert lib.function(op) is not None
    assert build(LAYER_OP_VARIANTS, arch).hit


def test_layer_ops_do_not_spill(tmp_path):
    """ptxas -v on sm_90: no kernel of the set spills registers (RoPE's float64 angles are the tightest)."""
    assert max(spill_stores(LAYER_OP_VARIANTS, tmp_path)) == 0


def test_friendly_calls_reject_bad_tensors():
    torch = pytest.importorskip("torch")
    from uacompile.targets.cuda import api

    with pytest.raises(ValueError, match=r"x: expected 2 dims"):
        api.rms_norm(torch.zeros(4, 2, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="must be even"):
        api.silu_and_mul(torch.zeros(4, 7))
    with pytest.raises(TypeError, match="unsupported dtype"):
        api.rope(torch.zeros(4, 2, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), 1e4)
    with pytest.raises(ir.IRError, match="rope.head_dim"):
        api.rope(torch.zeros(4, 2, 7), torch.zeros(4, dtype=torch.int64), 1e4)


def test_qkv_rope_cache_refuses_a_head_past_one_lane_group():
    from uacompile.targets.cuda.render import render_op

    with pytest.raises(ir.IRError, match="qkv_rope_cache.head_dim"):
        render_op(Q(2, 1, 512, 16, "fp32", "fp32"))


def test_layer_ops_launch_with_pdl_on_hopper_only():
    from uacompile.targets.cuda.render import render_op

    for op in (N(4096, "bf16", 1e-6, True), A(12288, "bf16"), Q(32, 8, 128, 16, "bf16", "bf16", True)):
        assert "PDL = true" in render_op(op, "sm_90") or "launch_pdl(true" in render_op(op, "sm_90"), op
        assert "PDL = true" not in render_op(op, "sm_80") and "launch_pdl(true" not in render_op(op, "sm_80"), op
