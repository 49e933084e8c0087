"""The 16-bit K/V tile layout (templates/cuda/paged_attention.cu.j2 `tile_off`, docs/attention-rationale.md,
"K/V tile layout"): swizzled 128-byte rows by default, padded rows with -DUA_TILE_SWIZZLE=0. Both layouts are forced
on every split count (-DUA_TILE_SWIZZLE=1 / =0, each design built in its own process) and checked against
the float64 reference with poisoned outputs: Hopper decode groups (sm_90 build) and, in an sm_80 build, the
mma.sync decode and prefill tiles, on decode-only and mixed ubatches; D 64, 128, 256, and D 80 (padded rows
whatever the switch: its rows are not whole 128-byte segments).
"""
from __future__ import annotations

import pytest

from uacompile import ir, testing
from uacompile.targets.cuda import attention

torch = pytest.importorskip("torch")
from test_cuda_decode_gpu import DECODE_LENS, MIXED, check_outputs, fused, run_fused  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention
DESIGNS = {"swizzled": "|-DUA_TILE_SWIZZLE=1", "padded": "|-DUA_TILE_SWIZZLE=0"}
OPS = {
    "bf16-d128-g4": PA(32, 8, 128, 16, "bf16", "bf16", return_lse=True),
    "fp16-d64-g1-p8": PA(8, 8, 64, 8, "fp16", "fp16", return_lse=True),
    "bf16-d256-g2": PA(8, 4, 256, 16, "bf16", "bf16"),
    "fp16-d80-g4": PA(16, 4, 80, 16, "fp16", "fp16"),
}
SPLITS = (1, 3)
ARCHS = ("sm_90", "sm_80")


@pytest.fixture(scope="module")
def swizzle_libs():
    """{(design, arch): kernel_of(op)}."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ops = list(dict.fromkeys(fused(op, s) for op in OPS.values() for s in SPLITS))
    return {(name, arch): kernel_of for arch in ARCHS
            for name, kernel_of in attention.design_kernels(DESIGNS, ops, arch).items()}


@gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("design", list(DESIGNS))
def test_tile_layout_matches_reference(swizzle_libs, rng, design, name, splits, arch):
    op = OPS[name]
    kernel_of = swizzle_libs[(design, arch)]
    for case, inputs in (("decode", testing.attention_inputs(op, rng, DECODE_LENS)),
                         ("mixed", testing.attention_inputs(op, rng, **MIXED))):
        outs = run_fused(None, op, splits, inputs, kernel_of=kernel_of)
        check_outputs(f"{design}/{arch}/{name}/s{splits}/{case}", op, inputs, outs["out"], outs.get("lse"))
