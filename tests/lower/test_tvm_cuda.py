"""TVM lowering to CUDA: every op's source + launcher compiles with nvcc (sm_80, sm_90), and,
on a GPU (marked gpu), runs and matches the numpy reference.

The GPU machine may lack TVM: set UA_TVM_CUDA_PREBUILT to a folder of libraries made with
build_cuda_library(op, "sm_90", folder) elsewhere, and the gpu tests load them from there.
"""
import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from uacompile import reference, testing
from uacompile.ir import (CopyBlocks, Kernel, MergeState, PagedAttention, ReshapeAndCache, SwapBlocks, c_signature,
                          numpy_dtype)
from uacompile.lower.config import TVMConfig

HAVE_NVCC = shutil.which("nvcc") is not None
PREBUILT = os.environ.get("UA_TVM_CUDA_PREBUILT")

VARIANTS = {
    "attn-bf16-d128-gqa4-p16": PagedAttention(32, 8, 128, page_size=16, q_dtype="bf16", kv_dtype="bf16"),
    "attn-fp16-all-options": PagedAttention(8, 2, 64, kv_dtype="int8", window=32, softcap=30.0, alibi=True,
                                            return_lse=True),
    "attn-fp8-splits": Kernel(PagedAttention(8, 1, 256, page_size=8, q_dtype="bf16", kv_dtype="fp8_e4m3"),
                              TVMConfig(num_splits=4)),
    "attn-fused-merge-lse": Kernel(PagedAttention(8, 2, 64, kv_dtype="int8", window=40, return_lse=True),
                                   TVMConfig(num_splits=3, fused_merge=True)),
    "attn-unified-d8": PagedAttention(4, 4, 8, page_size=4, q_dtype="fp32", kv_dtype="fp32",
                                      variant="unified_masked", return_lse=True),
    # the vector-load (vec) and shared-memory GQA (heads) knobs, over the features they touch
    "attn-bf16-gqa4-vec8": Kernel(PagedAttention(32, 8, 128, page_size=16, q_dtype="bf16", kv_dtype="bf16"),
                                  TVMConfig(lanes=16, vec=8)),
    "attn-bf16-gqa4-heads4-vec4": Kernel(PagedAttention(32, 8, 128, page_size=16, q_dtype="bf16", kv_dtype="bf16"),
                                         TVMConfig(heads=4, vec=4, threads=256)),
    "attn-fp16-heads2-scalar": Kernel(PagedAttention(8, 4, 128, q_dtype="fp16", kv_dtype="fp16", window=50),
                                      TVMConfig(heads=2)),
    "attn-fp8-heads2-vec16": Kernel(PagedAttention(8, 2, 128, page_size=8, q_dtype="bf16", kv_dtype="fp8_e4m3",
                                                   softcap=30.0, alibi=True),
                                    TVMConfig(heads=2, lanes=8, vec=16)),
    "attn-int8-heads4-fused-lse": Kernel(PagedAttention(8, 2, 64, kv_dtype="int8", window=32, softcap=30.0,
                                                        alibi=True, return_lse=True),
                                         TVMConfig(heads=4, lanes=8, vec=8, num_splits=3, fused_merge=True)),
    "attn-unified-heads2-vec4": Kernel(PagedAttention(4, 2, 32, page_size=4, q_dtype="fp32", kv_dtype="fp32",
                                                      variant="unified_masked", return_lse=True),
                                       TVMConfig(heads=2, lanes=8, vec=4, threads=64)),
    "cache-fp16-rope": ReshapeAndCache(8, 128, dtype="fp16", kv_dtype="fp16", rope=True),
    "cache-bf16-fp8": ReshapeAndCache(2, 64, page_size=8, dtype="bf16", kv_dtype="fp8_e4m3"),
    "cache-fp16-int8-gptj": ReshapeAndCache(2, 32, dtype="fp16", kv_dtype="int8", rope=True, rope_interleaved=True),
    "copy-int8": CopyBlocks(8, 128, kv_dtype="int8"),
    "swap-bf16": SwapBlocks(8, 128, kv_dtype="bf16"),
    "merge-bf16-lse": MergeState(32, 128, 4, out_dtype="bf16", return_lse=True),
}


def nvcc_needed():
    if not HAVE_NVCC:
        pytest.skip("nvcc not on PATH: CUDA sources cannot be compiled here")
    import tvm  # noqa: F401


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cuda_library_builds(name, arch, tmp_path):
    nvcc_needed()
    from uacompile.lower.tvm_cuda import build_cuda_library

    op = VARIANTS[name]
    so = build_cuda_library(op, arch, tmp_path)
    src = so.with_suffix(".cu").read_text()
    assert f'extern "C" {c_signature(op)}' in src  # the launcher ABI, exactly
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert re.search(rf"\bT {op.symbol()}$", syms, re.M), f"{op.symbol()} not exported"


def test_cuda_source_vector_loads_and_staging():
    """vec > 1 moves a lane's q / K / V elements in 8- and 16-byte loads (scalar ones at vec 1); heads > 1 stages
    K/V tiles in shared memory for threadIdx.z's heads, over Hq // heads blocks a token."""
    pytest.importorskip("tvm")
    from uacompile.lower.tvm_cuda import cuda_source

    op = PagedAttention(32, 8, 128, page_size=16, q_dtype="bf16", kv_dtype="bf16")
    vector = re.compile(r"\*\((?:uint4|uint2|nv_bfloat164|int2|float4|half2)\*\)\((?:k|v)_cache_ptr")
    default = cuda_source(Kernel(op, TVMConfig()))
    assert not vector.search(default) and "threadIdx.z" not in default and "__shared__" in default
    assert re.search(r"\*\(uint4\*\)\(k_cache_ptr", cuda_source(VARIANTS["attn-bf16-gqa4-vec8"]))
    assert re.search(r"\*\(uint4\*\)\(v_cache_ptr", cuda_source(VARIANTS["attn-bf16-gqa4-vec8"]))
    src = cuda_source(VARIANTS["attn-bf16-gqa4-heads4-vec4"])
    assert re.search(r"\*\(nv_bfloat164\*\)\(sk_ptr[^=]*= \*\(nv_bfloat164\*\)\(k_cache_ptr", src)  # staged
    assert re.search(r"\*\(nv_bfloat164\*\)\(q_ptr", src)
    assert "threadIdx.z" in src and "__syncthreads" in src
    # grid (tokens, Hq / heads, splits), block (lanes, lane groups, heads)
    assert "{((int64_t)num_tokens), 8LL, 1LL}" in src and "(unsigned)32LL, (unsigned)2LL, (unsigned)4LL" in src


def test_cuda_build_is_cached(tmp_path):
    nvcc_needed()
    import time

    from uacompile.lower.tvm_cuda import build_cuda_library

    op = VARIANTS["merge-bf16-lse"]
    build_cuda_library(op, "sm_90")
    t0 = time.perf_counter()
    build_cuda_library(op, "sm_90", tmp_path)
    assert time.perf_counter() - t0 < 0.5


def test_cuda_bad_arch():
    from uacompile.lower.tvm_cuda import build_cuda_library

    with pytest.raises(ValueError, match="arch"):
        build_cuda_library(VARIANTS["copy-int8"], "cuda -arch=sm_90")


# ---------------------------------------------------------------- on the GPU
def launcher(op):
    """ctypes handle to op's extern "C" launcher (prebuilt, or built here for the local GPU)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if PREBUILT:
        so = Path(PREBUILT) / f"{op.symbol()}_{arch}.so"
        if not so.exists():
            pytest.skip(f"{so} not prebuilt")
    else:
        nvcc_needed()
        from uacompile.lower.tvm_cuda import build_cuda_library

        so = build_cuda_library(op, arch)
    fn = getattr(ctypes.CDLL(str(so)), op.symbol())
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * len(op.tensors()) + [ctypes.c_int64] * len(op.sizes()) + [ctypes.c_void_p]
    return fn


def to_device(a):
    import torch

    if a.dtype in (numpy_dtype("bf16"), numpy_dtype("fp8_e4m3")):
        raw = torch.from_numpy(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8).copy())
        return raw.cuda()  # same bits; the kernel reinterprets them
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def run_on_gpu(op, arrays: dict) -> dict:
    """Call the launcher with every op param (outputs poisoned with 0xFF bytes); return numpy copies."""
    import torch

    fn = launcher(op)
    dev = {}
    for p in op.tensors():
        if p.name in arrays:
            dev[p.name] = to_device(arrays[p.name])
        else:
            shape = [arrays[d] if isinstance(d, str) else d for d in p.shape]
            dev[p.name] = to_device(np.zeros(shape, numpy_dtype(p.dtype)))
            dev[p.name].view(torch.uint8).fill_(0xFF)  # NaN in every float format
    sizes = [int(arrays[p.name]) for p in op.sizes()]
    rc = fn(*[dev[p.name].data_ptr() for p in op.tensors()], *sizes, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert rc == 0, f"launcher returned CUDA error {rc}"
    out = {}
    for p in op.tensors():
        a = dev[p.name].cpu().numpy()
        out[p.name] = a.view(numpy_dtype(p.dtype)) if a.dtype != numpy_dtype(p.dtype) else a
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("attn")])
def test_gpu_attention(name, rng):
    op = VARIANTS[name]
    inp = testing.attention_inputs(op, rng, [1, 16, 17, 300, 45], [1, 16, 3, 1, 20])
    got = run_on_gpu(op, inp)
    ref_o, ref_lse = reference.run(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    tol = testing.tolerance(op.q_dtype, op.kv_dtype)
    partials = "out" not in got
    o = got["o_partial" if partials else "out"].astype(np.float64)
    np.testing.assert_allclose(o, ref_o, atol=tol, rtol=0)
    lse_name = "lse_partial" if partials else ("lse" if op.return_lse else None)
    if lse_name:
        assert (np.isneginf(got[lse_name]) == np.isneginf(ref_lse)).all()
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got[lse_name][fin], ref_lse[fin], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("cache")])
def test_gpu_reshape_and_cache(name, rng):
    op = VARIANTS[name]
    inp = testing.reshape_and_cache_inputs(op, rng, 37, 8)
    got = run_on_gpu(op, inp)
    want = {k: v.copy() for k, v in inp.items() if isinstance(v, np.ndarray)}
    reference.reshape_and_cache(op, **want)
    if op.rope:  # float64 sin/cos may differ by an ulp from libm's: compare values
        g = reference.dequantize(got["k_cache"], got["k_scale"]) if op.quantized else got["k_cache"].astype(np.float64)
        w = reference.dequantize(want["k_cache"], want["k_scale"]) if op.quantized else want["k_cache"].astype(np.float64)
        np.testing.assert_allclose(g, w, atol=3e-2 * np.abs(w).max() if op.quantized else 1e-3, rtol=2e-3)
    else:
        assert np.array_equal(got["k_cache"].view(np.uint8), want["k_cache"].view(np.uint8))
    assert np.array_equal(got["v_cache"].view(np.uint8), want["v_cache"].view(np.uint8))
    if op.quantized:
        assert np.array_equal(got["v_scale"], want["v_scale"])


@pytest.mark.gpu
def test_gpu_copy_swap_merge(rng):
    op = VARIANTS["copy-int8"]
    inp = testing.copy_blocks_inputs(op, rng, num_layers=2, num_pages=10, num_pairs=4)
    got = run_on_gpu(op, inp)
    reference.copy_blocks(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    assert np.array_equal(got["kv"], inp["kv"]) and np.array_equal(got["scales"], inp["scales"])

    op = VARIANTS["swap-bf16"]
    inp = testing.swap_blocks_inputs(op, rng, num_layers=2, num_src_pages=6, num_dst_pages=9, num_pairs=3)
    got = run_on_gpu(op, inp)
    reference.swap_blocks(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    assert np.array_equal(got["dst"].view(np.uint16), inp["dst"].view(np.uint16))

    op = VARIANTS["merge-bf16-lse"]
    inp = testing.merge_state_inputs(op, rng, 9)
    got = run_on_gpu(op, inp)
    ref_o, ref_lse = reference.merge_state(op, **{k: v for k, v in inp.items() if isinstance(v, np.ndarray)})
    np.testing.assert_allclose(got["out"].astype(np.float64), ref_o, atol=1.6e-2, rtol=1.6e-2)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(got["lse"][fin], ref_lse[fin], atol=1e-4)
