"""runtime.kernels' tvm-cuda backend on the CPU (nvcc, no GPU): a `uacompile build --preset tiny --target cuda`
folder, carried elsewhere, holds every kernel stories260K launches, found by symbol through manifest.json and
loaded with cffi without importing TVM; a missing kernel, a folder of another dtype or KV cache dtype, a missing TVM
are one-line errors that say what to do; cuda falls back to tvm-cuda where the templates do not cover the model.
The GPU run: test_tvm_cuda_backend_gpu.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from uacompile.runtime.kernels import KernelOps, TVMCUDABackend, cuda_template_gap, make_backend, tvm_cuda_kernels
from uacompile.runtime.loader import load, models_dir

ROOT = Path(__file__).resolve().parents[2]
STORIES = models_dir() / "stories260K.gguf"


def stories_ops(dtype=torch.float32, page_size=16) -> KernelOps:
    assert STORIES.exists(), f"{STORIES} not found (set UACOMPILE_MODELS_DIR to the folder holding stories260K.gguf)"
    cfg = load(STORIES).config
    return KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size, dtype, cfg.sliding_window)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """The tiny preset's CUDA kernels built by bench/prebuild_tvm_cuda.sh (`uacompile build --preset tiny --target
    cuda`), then moved, as the folder carried to a GPU machine is."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH: the TVM-CUDA libraries cannot be built here")
    pytest.importorskip("tvm")
    root = tmp_path_factory.mktemp("tvm-cuda")
    r = subprocess.run(["bash", str(ROOT / "bench" / "prebuild_tvm_cuda.sh"), str(root / "built")],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert "6 TVM-CUDA kernels in" in r.stdout, r.stdout  # the tiny preset's: attention in 2 configs, 4 other ops
    shutil.move(root / "built", root / "carried")
    return root / "carried"


LOOKUP = """
import json, sys, torch
from uacompile.runtime.kernels import KernelOps, make_backend
ops = KernelOps.for_model({Hq}, {Hkv}, {D}, {P}, torch.float32)
backend = make_backend("auto", ops, "cuda", {kernel_dir!r})  # arch: sm_90 where torch sees no GPU
backend.prepare()
print(json.dumps(dict(name=backend.name, arch=backend.arch,
                      loaded={{kind: [call.kernel.symbol(), str(call.library.path)] for kind, call in backend.calls.items()}},
                      tvm="tvm" in sys.modules)))
"""


def test_every_stories260k_kernel_is_found_by_symbol_and_loaded_without_tvm(kernel_dir):
    ops = stories_ops()
    code = LOOKUP.format(Hq=ops.attention.num_q_heads, Hkv=ops.attention.num_kv_heads, D=ops.attention.head_dim,
                         P=ops.attention.page_size, kernel_dir=str(kernel_dir))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["name"] == "tvm-cuda" and got["arch"] == "sm_90"
    assert got["tvm"] is False, "the kernel_dir path imported TVM"
    want = {k.kind: k.symbol() for k in tvm_cuda_kernels(ops)}
    assert {kind: sym for kind, (sym, _) in got["loaded"].items()} == want
    for kind, (sym, path) in got["loaded"].items():
        assert path == str(kernel_dir / "cuda" / "tvm" / f"{sym}_sm_90.so"), (kind, path)


def test_the_default_cuda_dtype_is_the_one_the_tiny_preset_builds_stories260k_in():
    """engine.default_dtype on CUDA gives stories260K (head_dim 8: no CUDA template) fp32, and every TVM-CUDA kernel
    the backend loads at that dtype is one `uacompile build --preset tiny --target cuda` makes (no build needed)."""
    from uacompile.build import preset_kernels
    from uacompile.runtime.engine import default_dtype

    dtype = default_dtype(load(STORIES).config, "cuda")
    assert dtype == torch.float32
    ops = stories_ops(dtype)
    assert cuda_template_gap(ops) is not None  # `auto` on CUDA runs it on tvm-cuda
    preset = {k.symbol() for k in preset_kernels("tiny", "cuda", "tvm")}
    assert {k.symbol() for k in tvm_cuda_kernels(ops)} <= preset
    assert not {k.symbol() for k in tvm_cuda_kernels(stories_ops(torch.float16))} & preset  # the old default's


def test_the_auto_backend_at_the_default_dtype_loads_stories260k_from_the_tiny_preset(kernel_dir):
    """LLM(stories260K, device="cuda", kernel_dir=<tiny preset>) without dtype: the backend `auto` picks at the
    default dtype finds every kernel in the folder (arch sm_90 where torch sees no GPU)."""
    from uacompile.runtime.engine import default_dtype

    ops = stories_ops(default_dtype(load(STORIES).config, "cuda"))
    backend = make_backend("auto", ops, "cuda", kernel_dir)
    assert backend.name == "tvm-cuda"
    assert set(backend.paths) == {k.symbol() for k in tvm_cuda_kernels(ops)}
    assert all(Path(p).is_relative_to(kernel_dir) for p in backend.paths.values())


def test_a_missing_kernel_is_one_line_naming_the_build_command(kernel_dir, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(kernel_dir, folder)
    ops = stories_ops()
    attention = tvm_cuda_kernels(ops)[0]
    whole = (folder / "manifest.json").read_text()
    manifest = json.loads(whole)
    manifest["kernels"] = [e for e in manifest["kernels"] if e["symbol"] != attention.symbol()]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as e:
        TVMCUDABackend(ops, folder, arch="sm_90")
    msg = str(e.value)
    assert "\n" not in msg and attention.symbol() in msg and "is not in" in msg
    assert f"`uacompile build --preset tiny --target cuda --out {folder}`" in msg

    (folder / "manifest.json").write_text(whole)
    shutil.rmtree(folder / "cuda" / "tvm")  # listed in the manifest, library gone
    with pytest.raises(ValueError, match=r"was not built in .*is missing\); build it where TVM is installed"):
        TVMCUDABackend(stories_ops(), folder, arch="sm_90")


def test_a_folder_of_another_dtype_or_arch_says_so(kernel_dir):
    with pytest.raises(ValueError) as e:
        TVMCUDABackend(stories_ops(torch.float16), kernel_dir, arch="sm_90")
    assert "\n" not in str(e.value) and "the folder holds this shape in fp32 (run the model with dtype='float32')" \
        in str(e.value)
    with pytest.raises(ValueError, match="built for sm_90, which does not run on sm_80"):
        TVMCUDABackend(stories_ops(), kernel_dir, arch="sm_80")
    with pytest.raises(ValueError, match="no `uacompile build` preset holds this shape"):
        TVMCUDABackend(stories_ops(page_size=8), kernel_dir, arch="sm_90")


def test_without_tvm_or_kernel_dir_the_error_says_to_pass_kernel_dir(monkeypatch):
    monkeypatch.setitem(sys.modules, "tvm", None)  # importlib.util.find_spec("tvm") is None: as if not installed
    with pytest.raises(NotImplementedError) as e:
        TVMCUDABackend(stories_ops(), arch="sm_90")
    msg = str(e.value)
    assert "\n" not in msg and "TVM is not installed" in msg and "pass kernel_dir=DIR" in msg
    assert "`uacompile build --preset tiny --target cuda --out DIR`" in msg


def test_cuda_falls_back_to_tvm_cuda_only_where_the_templates_do_not_cover_the_model(monkeypatch):
    assert "q_dtype" in cuda_template_gap(stories_ops())
    assert "head_dim" in cuda_template_gap(stories_ops(torch.float16))
    assert cuda_template_gap(KernelOps.for_model(32, 8, 128, 16, torch.bfloat16)) is None
    monkeypatch.setitem(sys.modules, "tvm", None)
    with pytest.raises(NotImplementedError, match="tvm-cuda backend: TVM is not installed"):
        make_backend("cuda", stories_ops(), "cuda")
    with pytest.raises(ValueError, match="kernel_backend='tvm-cuda' needs device='cuda'"):
        make_backend("tvm-cuda", stories_ops(), "cpu")


def test_a_folder_without_the_8_bit_cache_kernels_names_the_kv_cache_it_has(tmp_path):
    """stories260K with kv_cache_dtype='int8' against a folder of its fp32 kernels (a manifest alone: the lookup
    fails before any library loads): the one-line error names the KV cache the folder was built for."""
    plain = tvm_cuda_kernels(stories_ops())
    entries = [{"op": k.kind, "target": "cuda", "lowering": "tvm", "params": k.op.to_dict(), "symbol": k.symbol(),
                "library": None, "reason": "not built here"} for k in plain]
    (tmp_path / "manifest.json").write_text(json.dumps({"kernels": entries}))
    cfg = load(STORIES).config
    ops = KernelOps.for_model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32, kv_dtype="int8")
    with pytest.raises(ValueError) as e:
        TVMCUDABackend(ops, tmp_path, arch="sm_90")
    msg = str(e.value)
    assert "\n" not in msg and "kv_dtype=int8" in msg and "is not in" in msg
    assert "the folder holds this shape with a fp32 KV cache (run with kv_cache_dtype='auto')" in msg
