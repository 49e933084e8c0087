"""The Hopper prefill path (wgmma + TMA, templates/cuda/attention_wgmma.cuh.j2) against the
float64 reference on the GPU, over the shapes that stress it: long prompts (many tiles, the TMA
stages wrap around), chunks that start mid-sequence, many short sequences sharing one 64-row
tile (the stage barriers' phases carry across runs), and mixed ubatches. CPU tests below check
which variants take the path and that both archs render what they should.
"""
from __future__ import annotations


import pytest
from cuda_helpers import cuda_api_with

from uacompile import ir, testing
from uacompile.targets.cuda import attention
from uacompile.targets.cuda.render import SM90A_MARKER, render_op

from test_cuda_attention_gpu import MIXED, check_close, reference_of, run_kernel, tol_of

torch = pytest.importorskip("torch")

PA = ir.PagedAttention
WG_CASES = {
    "bf16-d128-g4-p16": PA(32, 8, 128, 16, "bf16", "bf16"),
    "fp16-d64-g4-p16": PA(16, 4, 64, 16, "fp16", "fp16"),
    "bf16-d128-g1-p8": PA(4, 4, 128, 8, "bf16", "bf16"),
    "fp16-d128-g3-p32-lse": PA(12, 4, 128, 32, "fp16", "fp16", return_lse=True),
    "bf16-d128-g16-p256": PA(16, 1, 128, 256, "bf16", "bf16"),
    "bf16-d64-g8-p128-window-softcap": PA(16, 2, 64, 128, "bf16", "bf16", window=300, softcap=15.0),
    "fp16-d128-alibi-split3": PA(8, 2, 128, 16, "fp16", "fp16", alibi=True, num_splits=3),
}
SHAPES = {
    "long": dict(kv_lens=[700, 1100], q_lens=[700, 1100]),
    "chunks": dict(kv_lens=[700, 1300, 90], q_lens=[200, 77, 90]),
    "many-short": dict(kv_lens=[3, 5, 2, 7, 11, 40, 1, 9, 33], q_lens=[3, 5, 2, 7, 11, 40, 1, 9, 33]),
    "mixed": MIXED,
}


@pytest.fixture(scope="module")
def api():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path is for sm_90")
    return cuda_api_with(WG_CASES.values())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(WG_CASES))
def test_wgmma_prefill_matches_reference(api, rng, name, shape):
    op = WG_CASES[name]
    assert attention.uses_wgmma(op)
    inputs, outs = run_kernel(api, op, rng, **SHAPES[shape])
    ref_out, ref_lse = reference_of(op, inputs)
    tol = tol_of(op)
    if op.num_splits > 1:
        check_close(f"{name}.o_partial", outs["o_partial"], ref_out, tol)
        check_close(f"{name}.lse_partial", outs["lse_partial"], ref_lse, 2 * tol)
        return
    check_close(f"{name}.out", outs["out"], ref_out, tol)
    if op.return_lse:
        check_close(f"{name}.lse", outs["lse"], ref_lse, 2 * tol)


# ---------------------------------------------------------------- CPU
@pytest.mark.parametrize("op, hopper", [
    (PA(32, 8, 128, 16, "bf16", "bf16"), True),
    (PA(8, 2, 64, 8, "fp16", "fp16", window=9, softcap=5.0, alibi=True, num_splits=2), True),
    (PA(8, 2, 128, 4, "bf16", "bf16"), False),  # a page is less than one 1024-byte swizzle atom
    (PA(8, 2, 96, 16, "bf16", "bf16"), False),  # rows are not whole 128-byte halves
    (PA(8, 2, 256, 16, "bf16", "bf16"), False),
    (PA(8, 2, 128, 16, "bf16", "fp8_e4m3"), False),  # quantised KV is dequantised through smem
    (PA(8, 2, 128, 16, "bf16", "bf16", variant="unified_masked"), False),
])
def test_which_variants_take_the_hopper_path(op, hopper):
    assert attention.uses_wgmma(op, "sm_90") is hopper
    assert attention.uses_wgmma(op, "sm_80") is False
    assert (SM90A_MARKER in render_op(op, "sm_90")) is hopper
    assert SM90A_MARKER not in render_op(op, "sm_80")
    lay = attention.layout(op, "sm_90")
    assert lay.warps == (8 if hopper else 4)
    assert lay.prefill_rows == 16 * lay.warps * (1 if hopper else lay.mt_prefill)
    if hopper:  # one 8-warp block a SM: 227 KB a block at most, with the static smem well under 1 KB
        assert lay.smem_bytes + 1024 <= 227 * 1024 and lay.blocks_per_sm == 1


def test_split_choice_counts_hopper_blocks():
    """Hopper variants run one 8-warp block a SM, so the split choice sees half the block slots."""
    op = PA(32, 8, 128, 16, "bf16", "bf16")
    hopper, ampere = attention.layout(op, "sm_90"), attention.layout(op, "sm_80")
    assert (hopper.blocks_per_sm, ampere.blocks_per_sm) == (1, 2)
    for T, L in [(1, 32768), (8, 16384), (64, 8192)]:
        s90 = attention.choose_splits(op, T, T, L, arch="sm_90")
        s80 = attention.choose_splits(op, T, T, L, arch="sm_80")
        assert 1 <= s90 <= s80, (T, L, s90, s80)
        assert s90 == 1 or T * op.num_kv_heads * s90 <= 2 * attention.H200_SMS * hopper.decode_groups  # 2 waves
