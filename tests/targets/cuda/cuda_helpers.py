"""Shared by the CUDA GPU test modules."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from uacompile import ir
from uacompile.targets.cuda.config import AttentionConfig, config_of


def cuda_api_with(ops):
    """The CUDA call API with every kernel of ops (ops or ir.Kernels) built (all nvcc runs at once); skips without
    a GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from uacompile.targets.cuda import api

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(api.kernel, ops))
    return api


def pa_kernel(op, **config) -> ir.Kernel:
    """The paged-attention kernel of op (an op, or a kernel whose config is kept) with these AttentionConfig
    fields changed: pa_kernel(op, num_splits=3), pa_kernel(kernel, item_queue=True)."""
    kernel = ir.as_kernel(op)
    return ir.Kernel(kernel.op, config_of(kernel).replace(**config))


def base_op(op) -> ir.PagedAttention:
    """The op (the math) of an op or kernel."""
    return ir.as_kernel(op).op


__all__ = ["AttentionConfig", "base_op", "config_of", "cuda_api_with", "pa_kernel"]


def spill_stores(ops, tmp_path) -> list[int]:
    """ptxas -v on sm_90 over the ops' rendered sources in one translation unit: the spill-store bytes of each kernel
    (the compile must succeed)."""
    import re
    import subprocess

    from uacompile.targets.cuda.build import INCLUDE_DIR
    from uacompile.targets.cuda.render import render_op

    src = tmp_path / "ops.cu"
    src.write_text("\n".join(render_op(op, "sm_90") for op in ops))
    proc = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", f"-I{INCLUDE_DIR}", "-Xptxas", "-v", "-c",
                           str(src), "-o", str(tmp_path / "ops.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", proc.stderr)]
    assert spills, proc.stderr
    return spills


def to_torch(a, device="cuda", pinned=False):
    """A numpy array of any IR dtype (bf16 and fp8 from ml_dtypes included) as a torch tensor on device; on the CPU
    a copy, pinned if asked."""
    import numpy as np
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ir.numpy_dtype("bf16"):
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    elif a.dtype == ir.numpy_dtype("fp8_e4m3"):
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a)
    if device == "cpu":
        return t.pin_memory() if pinned else t.clone()
    return t.to(device)


def assert_renders_with_launcher(ops) -> None:
    """Each op's rendered source exports the IR's C launcher, keeps its kernels in the op's namespace and leaves no
    Jinja behind."""
    import re

    from uacompile.targets.cuda.render import render_op

    for op in ops:
        src = render_op(op)
        assert f'extern "C" {ir.c_signature(op)}' in src, op
        assert re.search(r"namespace\s+" + op.symbol() + "_impl", src), f"{op}: kernels must live in the op's namespace"
        assert "{{" not in src and "{%" not in src, op
