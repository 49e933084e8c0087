"""CUDA from the TVM lowering: TVM-generated kernels + an extern "C" launcher, built by nvcc.

    src = cuda_source(PagedAttention(32, 8, 128, q_dtype="bf16", kv_dtype="bf16"), arch="sm_90")
    so = build_cuda_library(op, "sm_90", out_dir)     # cached; needs nvcc, not a GPU

The launcher has exactly ir.c_signature(op): it evaluates each kernel's grid/block from the
sizes (the thread extents TVM leaves in the lowered device functions, printed as C) and
launches the kernels in program order on the given stream. TVM is needed only to generate
the source; a cache hit runs neither TVM nor an nvcc compile.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

from .. import nvcc
from ..cache import cached_build, content_hash, toolchain_versions
from ..ir import OpSpec, as_kernel, c_signature
from .config import SHARED_BYTES
from .tvm_kernels import generator_source, prim_func

CACHE_KIND = "tvm_cuda"
# TVM's generated code trips these front-end remarks (unused variables, deprecated casts): not ours to fix
EXTRA_FLAGS = ("-diag-suppress=1444,177,1046,20054",)


def cuda_target(arch: str):
    import tvm

    cfg = {"kind": "cuda", "arch": nvcc.check_arch(arch), "max_shared_memory_per_block": SHARED_BYTES,
           "max_threads_per_block": 1024}
    return tvm.target.Target(cfg, host="llvm")


def _pass_context():
    """Host-side CSE would turn common size expressions into extra kernel params computed only in
    TVM's own host code; keep kernel params to buffers and sizes so our launcher can fill them."""
    import tvm

    return tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True})


def _device_functions(func, target) -> list:
    """The lowered device PrimFuncs (same steps as tvm.tirx.build), in launch order."""
    import importlib

    import tvm
    from tvm import tirx

    build_mod = importlib.import_module("tvm.tirx.build")  # the attribute tvm.tirx.build is the function
    mod = tirx.transform.BindTarget(target)(tvm.IRModule.from_expr(func))
    pipeline, _, finalize_device = tirx.get_tir_pipeline("default")
    with _pass_context():
        _, dev_mods = build_mod.split_host_device_mods(pipeline(mod))
        funcs = [f for m in dev_mods.values() for f in finalize_device()(m).functions.values()]

    def order(f):  # kernels are named <symbol>_kernel, <symbol>_kernel_1, ... in program order
        m = re.search(r"_kernel(?:_(\d+))?$", str(f.attrs["global_symbol"]))
        return int(m.group(1) or 0) if m else 0

    return sorted(funcs, key=order)


def _thread_extents(stmt, out: dict) -> dict:
    from tvm import tirx

    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        out[stmt.node.thread_tag] = stmt.value
    for name in ("body", "then_case", "else_case"):
        child = getattr(stmt, name, None)
        if isinstance(child, tirx.Stmt):
            _thread_extents(child, out)
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _thread_extents(s, out)
    return out


def c_expr(e) -> str:
    """A launch-extent PrimExpr (over the size params) as a C int64 expression."""
    from tvm import tirx

    binary = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "/", tirx.Div: "/",
              tirx.FloorMod: "%", tirx.Mod: "%"}  # extents are non-negative: floor == trunc
    if isinstance(e, int):
        return f"{e}LL"
    if isinstance(e, tirx.IntImm):
        return f"{int(e.value)}LL"
    if isinstance(e, tirx.Var):
        return f"((int64_t){e.name})"
    if isinstance(e, tirx.Cast):
        return c_expr(e.value)
    for cls, sym in binary.items():
        if isinstance(e, cls):
            return f"({c_expr(e.a)} {sym} {c_expr(e.b)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        a, b, cmp = c_expr(e.a), c_expr(e.b), "<" if isinstance(e, tirx.Min) else ">"
        return f"(({a}) {cmp} ({b}) ? ({a}) : ({b}))"
    if isinstance(e, tirx.Call) and str(e.op.name) in ("tirx.shift_right", "tirx.shift_left"):
        return f"({c_expr(e.args[0])} {'>>' if 'right' in str(e.op.name) else '<<'} {c_expr(e.args[1])})"
    raise NotImplementedError(f"launch extent {e!r} ({type(e).__name__}) has no C form")


def _kernel_params(src: str, name: str) -> list[tuple[str, str]]:
    """[(C type, param name)] of kernel `name`, read from its declaration in the generated source."""
    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?' + re.escape(name) + r"\(([^)]*)\)", src)
    if not m:
        raise RuntimeError(f"kernel {name} not found in the generated CUDA source")
    out = []
    for decl in filter(None, (d.strip() for d in m.group(1).split(","))):
        ctype, pname = decl.rsplit(None, 1)
        out.append((ctype.replace("__restrict__", "").strip(), pname))
    return out


def launcher_source(op: OpSpec, src: str, device_funcs) -> str:
    tensors, sizes = {p.name for p in op.tensors()}, {p.name for p in op.sizes()}
    body = []
    for f in device_funcs:
        name = str(f.attrs["global_symbol"])
        tags = [str(t) for t in f.attrs.get("tirx.kernel_launch_params", [])]
        if any("dyn_shared" in t for t in tags):
            raise NotImplementedError(f"{name}: dynamic shared memory is not supported by the launcher")
        ext = _thread_extents(f.body, {})
        grid = [c_expr(ext.get(f"blockIdx.{a}", 1)) for a in "xyz"]
        block = [c_expr(ext.get(f"threadIdx.{a}", 1)) for a in "xyz"]
        args = []
        for ctype, pname in _kernel_params(src, name):
            base = pname[:-4] if pname.endswith("_ptr") else pname
            if "*" in ctype and base in tensors:
                args.append(f"({ctype}){base}")
            elif base in sizes:
                args.append(f"({ctype}){base}")
            else:
                raise RuntimeError(f"{name}: kernel param {ctype} {pname} maps to no launcher argument")
        body.append(
            f"  {{\n    const int64_t g[3] = {{{', '.join(grid)}}};\n"
            f"    if (g[0] > 0 && g[1] > 0 && g[2] > 0) {{\n"
            f"      {name}<<<dim3((unsigned)g[0], (unsigned)g[1], (unsigned)g[2]), "
            f"dim3({', '.join(f'(unsigned){b}' for b in block)}), 0, stream>>>({', '.join(args)});\n"
            f"    }}\n  }}")
    return ("\n// ---- host launcher (uacompile): grid/block from the sizes, kernels in program order\n"
            f'extern "C" {c_signature(op)} {{\n' + "\n".join(body) + "\n  return (int)cudaGetLastError();\n}\n")


def cuda_source(op: OpSpec, arch: str = "sm_90") -> str:
    """TVM-generated CUDA for op plus its extern "C" launcher `ir.c_signature(op)`."""
    import tvm

    op = as_kernel(op)
    target = cuda_target(arch)
    func = prim_func(op, "cuda")
    with _pass_context():
        ex = tvm.compile(func, target=target)
    cuda_mods = [m for m in ex.mod.imports if m.kind == "cuda"]
    if not cuda_mods:
        raise RuntimeError(f"TVM emitted no CUDA kernel for {op.kind} (unscheduled loops?)")
    src = cuda_mods[0].inspect_source()
    header = f"// {op.symbol()}: generated by uacompile (TVM lowering) for {arch}\n// op: {json.dumps(op.to_dict())}\n"
    return header + "#include <cuda_runtime.h>\n" + src + launcher_source(op, src, _device_functions(func, target))


def cuda_cache_key(op: OpSpec, arch: str) -> str:
    return content_hash(op.to_dict(), generator_source(), Path(__file__).read_text(), toolchain_versions("tvm"),
                        nvcc.toolchain(), nvcc.flags(arch, EXTRA_FLAGS))


def build_cuda_library(op: OpSpec, arch: str = "sm_90", out_dir: str | Path | None = None) -> Path:
    """nvcc-build op's CUDA source into a shared library (through the cache) and return its path;
    with out_dir, the .so and its .cu are copied there as <symbol>_<arch>.so/.cu. Raises
    nvcc.NvccNotFound where there is no nvcc, nvcc.NvccError where it fails."""
    op = as_kernel(op)
    flags = nvcc.flags(nvcc.check_arch(arch), EXTRA_FLAGS)
    nvcc.nvcc_path()  # NvccNotFound before any TVM work

    def build(d: Path):
        (d / "kernel.cu").write_text(cuda_source(op, arch))
        nvcc.compile_library(d / "kernel.cu", d / "kernel.so", flags, f"{op.symbol()} ({arch})")
        (d / "kernel.json").write_text(json.dumps({"op": op.to_dict(), "symbol": op.symbol(), "arch": arch,
                                                   "signature": c_signature(op), "nvcc": flags}))

    folder, _ = cached_build(CACHE_KIND, cuda_cache_key(op, arch), build)
    if out_dir is None:
        return folder / "kernel.so"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    so = out / prebuilt_name(op, arch)
    shutil.copyfile(folder / "kernel.cu", so.with_suffix(".cu"))
    shutil.copyfile(folder / "kernel.so", so)
    return so


def prebuilt_name(kernel, arch: str) -> str:
    """A kernel's library in a folder of prebuilt ones (build_cuda_library's out_dir): <symbol>_<arch>.so."""
    return f"{as_kernel(kernel).symbol()}_{arch}.so"


def cuda_library(kernel, arch: str = "sm_90", kernel_dir: str | Path | None = None) -> Path:
    """The shared library of kernel: <symbol>_<arch>.so in kernel_dir (a folder of prebuilt libraries, made where
    TVM is: bench/prebuild_tvm_cuda.sh) where it is there, else built here (build_cuda_library, through the
    cache). FileNotFoundError, one line naming the symbol, where it is not in kernel_dir and TVM is not here."""
    kernel = as_kernel(kernel)
    if kernel_dir is not None:
        path = Path(kernel_dir) / prebuilt_name(kernel, arch)
        if path.is_file():
            return path
        if importlib.util.find_spec("tvm") is None:
            raise FileNotFoundError(f"TVM-CUDA kernel {kernel.symbol()} ({kernel.kind}) is not in {kernel_dir} (no "
                                    f"{path.name}) and TVM is not installed here to build it: prebuild it where TVM is "
                                    "(bench/prebuild_tvm_cuda.sh) and carry the folder")
    elif importlib.util.find_spec("tvm") is None:
        raise FileNotFoundError(f"TVM-CUDA kernel {kernel.symbol()} ({kernel.kind}) needs TVM to build, which is not "
                                "installed here: pass a folder of prebuilt kernels (bench/prebuild_tvm_cuda.sh)")
    return build_cuda_library(kernel, arch)


__all__ = ["cuda_source", "build_cuda_library", "cuda_library", "prebuilt_name", "cuda_cache_key", "launcher_source",
           "cuda_target"]
