"""Call generated kernels on torch CUDA tensors.

    from uacompile.targets.cuda import api
    kern = api.CudaKernel(op)          # build (cached) + load, once per kernel and process (op or ir.Kernel)
    kern(**tensors)                    # names as in op.params(); sizes inferred from shapes
    api.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)       # op inferred from tensors
    api.copy_blocks(kv, mapping); api.swap_blocks(src, dst, mapping); out = api.merge_state(o, lse)
    out = api.rms_norm(x, w, eps, residual=r); out = api.silu_and_mul(gate_up); api.rope(q, positions, theta)
    q = api.qkv_rope_cache(qkv, positions, slots, k_cache, v_cache, num_q_heads, theta, q_norm=qn, k_norm=kn)
    out = api.quant_matmul(x, weight, "q4_k"); w = api.dequantize(weight, "q4_k", in_features, torch.bfloat16)

Every call checks names, dtypes, shapes (symbolic dims bound consistently), contiguity,
alignment and devices against op.params(), and raises TypeError / ValueError naming the
argument. It launches on torch.cuda.current_stream() and does not synchronise or allocate,
so calls are CUDA-graph capturable. Index values (slots, page ids) are not range-checked
(that would need a device sync): out-of-range ids are undefined behaviour, as in vLLM.
"""
from __future__ import annotations

import torch

from uacompile import binding, ir
from .loader import load

# tensors that may live in pinned host memory (the kernel reaches them over PCIe)
HOST_OK = {"swap_blocks": {"src", "dst", "src_scales", "dst_scales", "mapping"}}
INDEX_DTYPES = ("int32", "int64")
ALIGN = 16  # bytes: data tensors are read with 16-byte vectors
# the current stream's handle as an int, without making a torch.cuda.Stream a call (as Triton's launcher reads it)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _error_name(code: int) -> str:
    """cudaGetErrorString of a launcher's return code (torch's binding takes its enum, not an int)."""
    try:
        rt = torch.cuda.cudart()
        return rt.cudaGetErrorString(rt.cudaError(code))
    except Exception:  # noqa: BLE001 - the name is a courtesy
        return "unknown"


class CudaKernel:
    """One kernel (an op and its config), built and loaded; call it with keyword tensors named as in its
    params()."""

    def __init__(self, op: ir.OpSpec | ir.Kernel, arch: str | None = None, library=None):
        self.kernel = ir.as_kernel(op)
        self.op = self.kernel.op
        self.library = library or load(self.kernel, arch)
        self.fn = self.library.function(self.kernel)
        self.ffi = self.library.ffi
        self.binder = binding.Binder(self.kernel, (binding.TORCH,))
        self.tensor_specs = self.binder.tensor_specs
        self.host_ok = HOST_OK.get(self.op.kind, set())

    def __repr__(self):
        return f"CudaKernel({self.kernel!r})"

    def bind(self, kwargs: dict) -> tuple[list, torch.device]:
        """Check the arguments; return the C argument list (without the stream) and the device."""
        kind = self.op.kind
        tensors, sizes = self.binder(kwargs)  # names, dtypes, shapes, dims, contiguity: uacompile.binding
        device, ptrs = None, []
        for p, t in zip(self.tensor_specs, tensors):  # placement last, so layout errors show on any device
            if t is None:  # an optional tensor not given
                ptrs.append(self.ffi.NULL)
                continue
            if t.is_cuda:
                if device is None:
                    device = t.device
                elif t.device != device:
                    raise ValueError(f"{kind}.{p.name}: on {t.device}, but other tensors are on {device}")
            elif p.name not in self.host_ok:
                raise ValueError(f"{kind}.{p.name}: must be a CUDA tensor, got device {t.device}")
            elif not t.is_pinned():
                raise ValueError(f"{kind}.{p.name}: a host tensor must be pinned (tensor.pin_memory()), got pageable memory")
            if p.dtype not in INDEX_DTYPES and t.data_ptr() % ALIGN:
                raise ValueError(f"{kind}.{p.name}: data must be {ALIGN}-byte aligned (data_ptr % {ALIGN} = {t.data_ptr() % ALIGN})")
            ptrs.append(self.ffi.cast("void*", t.data_ptr()))
        if device is None:
            raise ValueError(f"{kind}: at least one tensor must be on a CUDA device")
        return ptrs + sizes, device

    def __call__(self, **kwargs) -> None:
        args, device = self.bind(kwargs)
        self.launch(args, device)

    def launch(self, args: list, device: torch.device) -> None:
        """Run the launcher on torch's current stream of device with C arguments from bind()."""
        if device.index == torch.cuda.current_device():  # the launcher runs on the current device
            stream = _raw_stream(device.index) if _raw_stream else torch.cuda.current_stream().cuda_stream
            rc = self.fn(*args, self.ffi.cast("void*", stream))
        else:
            with torch.cuda.device(device):
                rc = self.fn(*args, self.ffi.cast("void*", torch.cuda.current_stream(device).cuda_stream))
        if rc:
            raise RuntimeError(f"{self.kernel.symbol()}: CUDA error {rc} ({_error_name(rc)}) at launch")

    def launcher(self, fixed: dict, varying: dict) -> "Launcher":
        """A call with `fixed` tensors checked and bound once (launch(**varying) then checks only the others)."""
        return Launcher(self, fixed, varying)


class Launcher:
    """A CudaKernel's call with some arguments bound once: made from one full check of every argument, each call
    takes the varying tensors (positionally, in the order `varying` named them) and checks only them against the
    dtype, shape, device and layout they had then (anything else is re-checked in full, so a mismatch raises the
    same error a plain call would) before swapping in their pointers. The fixed tensors must stay alive and keep
    their data where they are (a plan's step inputs and workspaces)."""

    def __init__(self, kernel: CudaKernel, fixed: dict, varying: dict):
        self.kernel, self.fixed, self.names = kernel, dict(fixed), tuple(varying)
        self.args, self.device = kernel.bind({**fixed, **varying})
        order = [p.name for p in kernel.tensor_specs]
        self.slots = tuple((order.index(name), t.dtype, tuple(t.shape)) for name, t in varying.items())
        self.cast, self.void_p = kernel.ffi.cast, kernel.ffi.typeof("void*")

    def __call__(self, *tensors) -> None:
        args, cast, void_p, device = list(self.args), self.cast, self.void_p, self.device
        for t, (i, dtype, shape) in zip(tensors, self.slots):
            if (t.dtype is not dtype or t.shape != shape or t.device != device or not t.is_contiguous()
                    or t.data_ptr() % ALIGN):  # the full check: its error, or the arguments of what was given
                args, _ = self.kernel.bind({**self.fixed, **dict(zip(self.names, tensors))})
                break
            args[i] = cast(void_p, t.data_ptr())
        self.kernel.launch(args, device)


_kernels: dict[tuple, CudaKernel] = {}


def kernel(op: ir.OpSpec | ir.Kernel, arch: str | None = None) -> CudaKernel:
    """The CudaKernel of a kernel (an op alone: its default config), built and loaded once per process (or taken
    from preload)."""
    key = (ir.as_kernel(op), arch)
    if key not in _kernels:
        _kernels[key] = CudaKernel(key[0], arch)
    return _kernels[key]


LIBRARY_KERNELS = 4  # kernels of one kind a preloaded library holds (one nvcc run each, run side by side)


def preload(ops, arch: str | None = None, workers: int | None = None, progress: bool = False) -> int:
    """Build (or load from the cache) many kernels at once, so later kernel(op) calls never build: libraries of up
    to LIBRARY_KERNELS kernels of one kind (a fixed grouping of the sorted kernels, so a second start finds the
    same cache entries), nvcc runs side by side on `workers` threads (default: the CPU count). Returns how many
    libraries came from the cache."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    kernels = sorted({ir.as_kernel(op) for op in ops if (ir.as_kernel(op), arch) not in _kernels},
                     key=lambda k: (k.kind, k.symbol()))
    groups: list[list] = []
    for k in kernels:
        if groups and groups[-1][0].kind == k.kind and len(groups[-1]) < LIBRARY_KERNELS:
            groups[-1].append(k)
        else:
            groups.append([k])
    hits = 0
    with ThreadPoolExecutor(max(1, min(workers or os.cpu_count() or 1, len(groups) or 1))) as pool, \
            tqdm(total=len(kernels), desc="kernels", unit="kernel", disable=not progress, dynamic_ncols=True) as bar:
        for group, lib in zip(groups, pool.map(lambda g: load(g, arch), groups)):
            hits += bool(lib.build and lib.build.hit)
            for k in group:
                _kernels.setdefault((k, arch), CudaKernel(k, arch, library=lib))
            bar.update(len(group))
    return hits


def _kv_dtype(name: str, t: torch.Tensor) -> str:
    """The IR dtype of a float / KV tensor (the friendly functions infer ops from them); uint8 is fp8's raw bytes."""
    dtype = "fp8_e4m3" if t.dtype == torch.uint8 else ir.from_torch(t.dtype)
    if dtype not in ir.KV_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}; use one of {[str(ir.torch_dtype(d)) for d in ir.KV_DTYPES]}"
                        " or torch.uint8 (fp8 bytes)")
    return dtype


def _need_dims(name: str, t, n: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != n:
        raise ValueError(f"{name}: expected {n} dims {layout}, got shape {tuple(t.shape)}")


def _scales(kind: str, quantized: bool, **scales) -> dict:
    for name, s in scales.items():
        if quantized and s is None:
            raise TypeError(f"{kind}: {name} is required with a quantised (int8 / fp8) KV cache")
        if not quantized and s is not None:
            raise TypeError(f"{kind}: {name} is only for a quantised (int8 / fp8) KV cache")
    return scales if quantized else {}


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, positions=None,
                      rope_theta: float = 10000.0, rope_interleaved: bool = False) -> None:
    """Write k, v [T, Hkv, D] into caches [num_pages, P, Hkv, D] at slot_mapping [T] (int64, -1 = skip);
    quantised caches (int8, fp8) also take k_scale, v_scale [num_pages, P, Hkv]; positions [T] fuses RoPE into K."""
    _need_dims("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    _need_dims("k_cache", k_cache, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    op = ir.ReshapeAndCache(num_kv_heads=k.shape[1], head_dim=k.shape[2], page_size=k_cache.shape[1],
                            dtype=_kv_dtype("k", k), kv_dtype=_kv_dtype("k_cache", k_cache), rope=positions is not None,
                            rope_theta=float(rope_theta), rope_interleaved=bool(rope_interleaved))
    extra = _scales(op.kind, op.quantized, k_scale=k_scale, v_scale=v_scale)
    if positions is not None:
        extra["positions"] = positions
    kernel(op)(k=k, v=v, slot_mapping=slot_mapping, k_cache=k_cache, v_cache=v_cache, **extra)


def copy_blocks(kv, mapping, scales=None) -> None:
    """kv [num_layers, 2, num_pages, P, Hkv, D]: kv[:, :, dst] = kv[:, :, src] for (src, dst) in mapping [N, 2] int64,
    in one launch (scales [num_layers, 2, num_pages, P, Hkv] too when quantised). Destinations must not be sources."""
    _need_dims("kv", kv, 6, "[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]")
    op = ir.CopyBlocks(num_kv_heads=kv.shape[4], head_dim=kv.shape[5], page_size=kv.shape[3],
                       kv_dtype=_kv_dtype("kv", kv))
    extra = _scales(op.kind, op.quantized, scales=scales)
    kernel(op)(kv=kv, mapping=mapping, **extra)


def swap_blocks(src, dst, mapping, src_scales=None, dst_scales=None) -> None:
    """Pages of the copy_blocks layout between two caches (device or pinned host), in one launch:
    dst[:, :, mapping[i, 1]] = src[:, :, mapping[i, 0]]."""
    _need_dims("src", src, 6, "[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]")
    op = ir.SwapBlocks(num_kv_heads=src.shape[4], head_dim=src.shape[5], page_size=src.shape[3],
                       kv_dtype=_kv_dtype("src", src))
    extra = _scales(op.kind, op.quantized, src_scales=src_scales, dst_scales=dst_scales)
    kernel(op)(src=src, dst=dst, mapping=mapping, **extra)


def merge_state(o_partial, lse_partial, out=None, lse=None, out_dtype: torch.dtype = torch.float16):
    """Merge split-KV partials o_partial [S, T, H, D], lse_partial [S, T, H] (float32) into out [T, H, D];
    returns out, or (out, lse) when lse [T, H] float32 is given. Allocates out when None (not graph-safe)."""
    _need_dims("o_partial", o_partial, 4, "[num_splits, num_tokens, num_heads, head_dim]")
    S, T, H, D = o_partial.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=out_dtype, device=o_partial.device)
    op = ir.MergeState(num_heads=H, head_dim=D, num_splits=S, out_dtype=_kv_dtype("out", out), return_lse=lse is not None)
    extra = {"lse": lse} if lse is not None else {}
    kernel(op)(o_partial=o_partial, lse_partial=lse_partial, out=out, **extra)
    return (out, lse) if lse is not None else out


def rms_norm(x, weight, eps: float, residual=None, out=None):
    """RMSNorm of the rows of x [T, E] (ir.RMSNorm): returns out (allocated when None; out may be x). With
    residual [T, E], residual += x in place first and the norm is of that sum (vLLM's fused_add_rms_norm)."""
    _need_dims("x", x, 2, "[num_tokens, hidden_size]")
    out = torch.empty_like(x) if out is None else out
    op = ir.RMSNorm(hidden_size=x.shape[1], dtype=_kv_dtype("x", x), eps=float(eps), residual=residual is not None)
    extra = {"residual": residual} if residual is not None else {}
    kernel(op)(x=x, weight=weight, out=out, **extra)
    return out


def silu_and_mul(x, out=None):
    """silu(x[:, :I]) * x[:, I:] of a merged gate/up projection x [T, 2I] (ir.SiluAndMul): returns out [T, I]."""
    _need_dims("x", x, 2, "[num_tokens, 2 * intermediate_size]")
    if x.shape[1] % 2:
        raise ValueError(f"x: the last dim holds gate and up halves and must be even, got shape {tuple(x.shape)}")
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device) if out is None else out
    kernel(ir.SiluAndMul(intermediate_size=inter, dtype=_kv_dtype("x", x)))(x=x, out=out)
    return out


def quantize_rows(x, out_dtype: str = "fp8_e4m3", out=None, scale=None):
    """Each row of x [T, E] (bf16, fp16, fp32) quantised to out_dtype (fp8_e4m3 or int8) with its own float32 scale
    (ir.QuantizeRows): returns (out [T, E], scale [T]), allocated when None. out is torch.float8_e4m3fn (or its uint8
    bytes) or torch.int8."""
    _need_dims("x", x, 2, "[num_tokens, hidden_size]")
    if out_dtype not in ir.QUANT_DTYPES:
        raise ValueError(f"out_dtype must be one of {list(ir.QUANT_DTYPES)}, got {out_dtype!r}")
    if out is None:
        out = torch.empty(x.shape, dtype=ir.torch_dtype(out_dtype), device=x.device)
    if scale is None:
        scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    op = ir.QuantizeRows(hidden_size=x.shape[1], dtype=_kv_dtype("x", x), out_dtype=out_dtype)
    kernel(op)(x=x, out=out, scale=scale)
    return out, scale


def rope(x, positions, rope_theta: float, interleaved: bool = False):
    """Rotary embedding of x [T, H, D] in place at positions [T] int64 (ir.Rope); returns x."""
    _need_dims("x", x, 3, "[num_tokens, num_heads, head_dim]")
    op = ir.Rope(num_heads=x.shape[1], head_dim=x.shape[2], dtype=_kv_dtype("x", x), rope_theta=float(rope_theta),
                 interleaved=bool(interleaved))
    kernel(op)(x=x, positions=positions)
    return x


def qkv_rope_cache(qkv, positions, slot_mapping, k_cache, v_cache, num_q_heads: int, rope_theta: float,
                   q_out=None, q_norm=None, k_norm=None, eps: float = 1e-6, k_scale=None, v_scale=None,
                   rope_interleaved: bool = False, freq_factors: tuple = ()):
    """From the packed projection qkv [T, Hq + 2 Hkv, D]: per-head RMSNorm of q and k (with q_norm, k_norm [D]),
    RoPE of both at positions [T] int64, K and V written into the caches at slot_mapping (ir.QKVRopeCache; 8-bit
    caches with their scales); returns q_out [T, Hq, D] (allocated when None: not graph-safe)."""
    _need_dims("qkv", qkv, 3, "[num_tokens, num_q_heads + 2 * num_kv_heads, head_dim]")
    _need_dims("k_cache", k_cache, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    T, heads, D = qkv.shape
    if (heads - num_q_heads) % 2 or heads <= num_q_heads:
        raise ValueError(f"qkv: {heads} heads do not hold {num_q_heads} q heads and equal k and v heads")
    if (q_norm is None) != (k_norm is None):
        raise TypeError("qkv_rope_cache: q_norm and k_norm go together")
    op = ir.QKVRopeCache(num_q_heads=num_q_heads, num_kv_heads=(heads - num_q_heads) // 2, head_dim=D,
                         page_size=k_cache.shape[1], dtype=_kv_dtype("qkv", qkv), kv_dtype=_kv_dtype("k_cache", k_cache),
                         qk_norm=q_norm is not None, eps=float(eps), rope_theta=float(rope_theta),
                         rope_interleaved=bool(rope_interleaved), freq_factors=tuple(freq_factors))
    extra = _scales(op.kind, op.quantized, k_scale=k_scale, v_scale=v_scale)
    if q_norm is not None:
        extra.update(q_norm=q_norm, k_norm=k_norm)
    q_out = torch.empty((T, num_q_heads, D), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    kernel(op)(qkv=qkv, positions=positions, slot_mapping=slot_mapping, q_out=q_out, k_cache=k_cache, v_cache=v_cache,
               **extra)
    return q_out


def _weight_format(weight, weight_format: str, in_features: int) -> ir.WeightFormat:
    _need_dims("weight", weight, 2, "[rows, in_features / block * block_bytes] uint8")
    if weight_format not in ir.WEIGHT_FORMATS:
        raise ValueError(f"weight_format: must be one of {sorted(ir.WEIGHT_FORMATS)}, got {weight_format!r}")
    fmt = ir.WEIGHT_FORMATS[weight_format]
    if in_features % fmt.block or weight.shape[1] != fmt.row_bytes(in_features):
        raise ValueError(f"weight: {weight_format} rows of {in_features} weights are {fmt.row_bytes(in_features)} bytes "
                         f"(in_features a multiple of {fmt.block}), got shape {tuple(weight.shape)}")
    return fmt


def quant_matmul_op(x, weight, weight_format: str) -> ir.QuantMatmul:
    """The ir.QuantMatmul of x [T, K] and packed weight [N, row_bytes] uint8 (the friendly call's inference)."""
    _need_dims("x", x, 2, "[num_tokens, in_features]")
    _weight_format(weight, weight_format, x.shape[1])
    return ir.QuantMatmul(in_features=x.shape[1], out_features=weight.shape[0], weight_format=weight_format,
                          dtype=_kv_dtype("x", x))


def quant_matmul(x, weight, weight_format: str, out=None):
    """out [T, N] = x [T, K] @ W^T over GGUF blocks weight [N, K / block * nbytes] uint8 (ir.QuantMatmul), x and
    out bf16, fp16 or fp32. Returns out (allocated when None: not graph-safe). A per-layer caller keeps
    kernel(quant_matmul_op(...)).launcher({"weight": weight}, {"x": x, "out": out}) instead (checks once)."""
    op = quant_matmul_op(x, weight, weight_format)
    out = torch.empty((x.shape[0], op.out_features), dtype=x.dtype, device=x.device) if out is None else out
    kernel(op)(x=x, weight=weight, out=out)
    return out


def dequantize(weight, weight_format: str, in_features: int, dtype: torch.dtype = torch.bfloat16, out=None):
    """W [rows, K] in dtype (bf16, fp16, fp32) decoded from GGUF blocks weight [rows, K / block * nbytes] uint8
    (ir.Dequantize, bit-exact to reference.dequantize_blocks rounded to dtype); returns out (allocated when None)."""
    _weight_format(weight, weight_format, int(in_features))
    if out is None:
        out = torch.empty((weight.shape[0], int(in_features)), dtype=dtype, device=weight.device)
    op = ir.Dequantize(in_features=int(in_features), weight_format=weight_format, dtype=_kv_dtype("out", out))
    kernel(op)(weight=weight, out=out)
    return out


def capture_graph(fns, calls: int = 1, stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` rounds of fns. Each fn runs once first on the capture stream (a new
    one, or `stream`), so whatever a fn builds or allocates on its first call (kernels, out tensors)
    exists before capture and the graph holds kernels only."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):  # other threads may run CUDA
        for _ in range(calls):
            for f in fns:
                f()
    return graph
