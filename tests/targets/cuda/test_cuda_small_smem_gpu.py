"""Variants whose two-stage layout exceeds a smaller GPU's block shared memory (layout.layout: fewer cp.async
stages there): D 256 on an A100 (sm_80, 163 KB a block) and D 128 on GA10x / Ada (sm_86, 99 KB). Their builds
run on the H200 through the embedded PTX, against the float64 reference with poisoned outputs: mixed kernels on
decode and mixed ubatches, decode-only kernels on decode steps, 16-bit and quantised KV, one and three splits.
"""
from __future__ import annotations

import pytest

from uacompile import ir, testing
from uacompile.targets.cuda.layout import block_smem, layout

torch = pytest.importorskip("torch")
from cuda_helpers import config_of, pa_kernel  # noqa: E402
from test_cuda_decode_gpu import DECODE_LENS, MIXED, check_outputs, fused, run_fused  # noqa: E402

gpu = pytest.mark.gpu
PA = ir.PagedAttention
OPS = {  # name: (arch, kernel)
    "sm80-bf16-d256": ("sm_80", pa_kernel(PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True))),
    "sm80-bf16-d256-only": ("sm_80", pa_kernel(PA(8, 2, 256, 16, "bf16", "bf16", return_lse=True), decode_only=True)),
    "sm80-fp16-d256-int8": ("sm_80", pa_kernel(PA(8, 4, 256, 16, "fp16", "int8", window=900))),
    "sm86-bf16-d128": ("sm_86", pa_kernel(PA(16, 4, 128, 16, "bf16", "bf16", return_lse=True))),
    "sm86-bf16-d128-only": ("sm_86", pa_kernel(PA(16, 4, 128, 16, "bf16", "bf16"), decode_only=True)),
    "sm86-fp16-d128-fp8": ("sm_86", pa_kernel(PA(16, 4, 128, 8, "fp16", "fp8_e4m3", softcap=20.0))),
}
SPLITS = (1, 3)


@pytest.fixture(scope="module")
def kernels():
    """{arch: kernel_of(kernel)}: the kernels built for that arch, one library an arch (api.preload)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from uacompile.targets.cuda import api

    by_arch = {}
    for arch, op in OPS.values():
        by_arch.setdefault(arch, []).extend(fused(op, s) for s in SPLITS)
    for arch, ops in by_arch.items():
        api.preload(ops, arch)
    return {arch: (lambda kernel, arch=arch: api.kernel(kernel, arch)) for arch in by_arch}


@gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("name", list(OPS))
def test_fewer_stages_match_reference(kernels, rng, name, splits):
    arch, op = OPS[name]
    lay = layout(op.op, config_of(op), arch)
    assert lay.stages == 1 and lay.smem_bytes <= block_smem(arch), lay
    cases = [("decode", testing.attention_inputs(op.op, rng, DECODE_LENS))]
    if not config_of(op).decode_only:
        cases.append(("mixed", testing.attention_inputs(op.op, rng, **MIXED)))
    for case, inputs in cases:
        outs = run_fused(None, op, splits, inputs, kernel_of=kernels[arch])
        check_outputs(f"{name}/s{splits}/{case}", op, inputs, outs["out"], outs.get("lse"))
