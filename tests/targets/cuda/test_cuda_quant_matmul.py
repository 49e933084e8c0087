"""CPU: the quant_matmul and dequantize templates (GGUF block formats kept packed) render with the IR launcher and
compile with nvcc for sm_80 and sm_90 (a small set by default, every format x dtype in the slow sweep), the
tensor-core kernels of small token tiles keep off local memory; the friendly calls reject bad tensors before any
device work."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from uacompile import ir

from cuda_helpers import assert_renders_with_launcher

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

Q, D = ir.QuantMatmul, ir.Dequantize
FORMATS = tuple(ir.WEIGHT_FORMATS)
# the default set: a 32-weight format with K not a multiple of 256 and a K-quant, each in a 16-bit and float32
SMALL = [Q(576, 1000, "q8_0", "bf16"), Q(4096, 4096, "q4_k", "fp16"), Q(576, 64, "q4_1", "fp32"),
         D(576, "q4_1", "bf16"), D(4096, "q6_k", "fp32")]
EVERY = [Q(4096, 4096, f, d) for f in FORMATS for d in ir.FLOAT_DTYPES] + [D(4096, f, d) for f in FORMATS
                                                                            for d in ir.FLOAT_DTYPES]


def test_render_has_the_ir_launcher():
    assert_renders_with_launcher(EVERY + SMALL)


def test_config_picks_the_tiles():
    from uacompile.targets.cuda.config import QuantMatmulConfig
    from uacompile.targets.cuda.render import render_op

    op = Q(4096, 4096, "q4_0", "bf16")
    kernel = ir.Kernel(op, QuantMatmulConfig(warps=4, stages=3, m_tiles=(1, 2, 2, 4)))
    src = render_op(kernel)
    assert "launch<1, 1, 4, 3>" in src and f"return {kernel.symbol()}_impl::launch<4, 8, 4, 3>" in src
    assert QuantMatmulConfig(warps=4).warps == (4, 4, 4, 4)
    with pytest.raises(ir.IRError, match="QuantMatmulConfig.stages"):
        QuantMatmulConfig(stages=1)
    with pytest.raises(ir.IRError, match="shared memory"):
        render_op(ir.Kernel(Q(4096, 4096, "q8_0", "bf16"), QuantMatmulConfig(warps=8, stages=8, m_tiles=4)))


def test_config_picks_the_gemv_kernels():
    from uacompile.targets.cuda.config import QuantMatmulConfig
    from uacompile.targets.cuda.render import quant_gemv_tiles, render_op

    op = Q(4096, 4096, "q4_k", "bf16")
    # the rule: 1-2 tokens on CUDA cores (1 for q4_0, q4_1, q6_k), 8 warps where 128 blocks of 32 rows fit one
    # wave, 4 beyond; two units a stage where they fit
    assert quant_gemv_tiles(op) == [(1, 8, 2, 2), (2, 8, 2, 2)]
    assert [nt for nt, _, _, _ in quant_gemv_tiles(Q(4096, 4096, "q6_k", "bf16"))] == [1]
    assert {w for _, w, _, _ in quant_gemv_tiles(Q(4096, 6144, "q4_k", "bf16"))} == {4}
    assert [p for _, _, _, p in quant_gemv_tiles(Q(4096, 4096, "q8_0", "bf16"))] == [1, 1]
    assert quant_gemv_tiles(Q(4096, 4096, "q4_k", "fp32")) == []
    src = render_op(op)
    assert "launch_gemv<1, 8, 2, 2>" in src and "launch_gemv<2, 8, 2, 2>" in src and "launch_gemv<4," not in src
    assert "cudaLaunchKernelEx" in src and "cudaLaunchKernelEx" not in render_op(op, "sm_80")
    src = render_op(ir.Kernel(op, QuantMatmulConfig(gemv_tokens=8, gemv_warps=4, gemv_stages=2, pdl=False)))
    assert "launch_gemv<2, 4, 2, 2>" in src and "launch_gemv<8, 4, 2, 1>" in src and "cudaLaunchKernelEx" not in src
    assert "launch_gemv" not in render_op(ir.Kernel(op, QuantMatmulConfig(gemv_tokens=0))).split("extern")[1]
    for bad in (dict(gemv_tokens=3), dict(gemv_warps=2), dict(gemv_stages=5), dict(pdl=1)):
        with pytest.raises(ir.IRError, match="QuantMatmulConfig"):
            QuantMatmulConfig(**bad)


def test_every_rule_tile_fits():
    from uacompile.targets.cuda.config import QuantMatmulConfig
    from uacompile.targets.cuda.render import (GEMV_TWO_BLOCKS, SMEM_LIMIT, quant_gemv_smem, quant_gemv_tiles,
                                               quant_matmul_fits, quant_matmul_tiles)

    for f in FORMATS:
        for K, N in ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (256, 100)):
            op = Q(K, N, f, "bf16")
            assert quant_matmul_fits(op), (op, quant_matmul_tiles(op))
            gemv = quant_gemv_tiles(op, QuantMatmulConfig(gemv_tokens=8))
            assert [nt for nt, _, _, _ in gemv] == [1, 2, 4, 8], (op, gemv)
            assert all(quant_gemv_smem(op, nt, w, st, p) <= (SMEM_LIMIT if w == 8 else GEMV_TWO_BLOCKS)
                       for nt, w, st, p in gemv), (op, gemv)


def _build(ops, arch):
    from uacompile.targets.cuda.build import build
    from uacompile.targets.cuda.loader import load_library

    res = build(ops, arch)
    assert res.path.exists() and res.arch == arch
    lib = load_library(res.path, ops, res)
    for op in ops:
        assert lib.function(op) is not None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_quant_ops_compile_and_export_launchers(arch):
    _build(SMALL, arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_format_and_dtype_compiles(arch):
    _build(EVERY, arch)


def test_small_token_tiles_do_not_spill(tmp_path):
    """ptxas -v on sm_90: the CUDA-core kernels, the 1-16 token tensor-core kernels and dequantize keep off local
    memory for every format."""
    from uacompile.targets.cuda.build import INCLUDE_DIR
    from uacompile.targets.cuda.config import QuantMatmulConfig
    from uacompile.targets.cuda.render import render_op

    src = tmp_path / "q.cu"
    ops = [ir.Kernel(Q(4096, 4096, f, "bf16"), QuantMatmulConfig(gemv_tokens=8)) for f in FORMATS]
    ops += [D(4096, f, "fp16") for f in FORMATS]
    src.write_text("\n".join(render_op(op, "sm_90") for op in ops))
    proc = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", f"-I{INCLUDE_DIR}", "-Xptxas", "-v", "-c",
                           str(src), "-o", str(tmp_path / "q.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # ptxas prints each entry's "Compiling entry function '<name>'" then its spill line
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", proc.stderr, re.S)
    assert entries
    small = [(name, int(n)) for name, n in entries if re.search(r"kernelILi\dELi[12]E", name) or "dequantize" in name
             or "gemv" in name]
    assert small and all(n == 0 for _, n in small), small
    assert sum("gemv" in name for name, _ in small) == 4 * len(FORMATS)


def test_friendly_calls_reject_bad_tensors():
    torch = pytest.importorskip("torch")
    from uacompile.targets.cuda import api

    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight_format"):
        api.quant_matmul(x, torch.zeros(8, 68, dtype=torch.uint8), "q3_k")
    with pytest.raises(ValueError, match="68 bytes"):
        api.quant_matmul(x, torch.zeros(8, 70, dtype=torch.uint8), "q8_0")
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        api.quant_matmul(x[None], torch.zeros(8, 68, dtype=torch.uint8), "q8_0")
    with pytest.raises(ValueError, match="multiple of 256"):
        api.dequantize(torch.zeros(8, 210, dtype=torch.uint8), "q6_k", 128)
    op = api.quant_matmul_op(x, torch.zeros(8, 68, dtype=torch.uint8), "q8_0")
    assert op == Q(64, 8, "q8_0", "bf16")
