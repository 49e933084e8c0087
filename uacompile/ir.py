"""The IR: dtypes, tensor specs with symbolic dims, and one frozen dataclass per op.

Each op spec is a *static variant* (everything a kernel is specialised on). Its
`params()` list is the one place that says which tensors and sizes a kernel takes, in
which order: launcher signatures, cffi declarations, TVM buffer lists and docs all
come from it.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import ClassVar, Union

from .errors import IRError


@dataclass(frozen=True)
class DType:
    """One IR dtype and its name in each language and library that carries it.

    fp8 travels as raw bytes where a toolchain has no (correct) fp8 type: C launchers and
    kernels take uint8_t, TIR stores uint8 (TVM's LLVM fp8 legalisation gets subnormals wrong,
    and numpy cannot hand fp8 over DLPack) and decodes it by hand."""

    name: str  # the IR's name: "bf16"
    itemsize: int  # bytes per element
    c: str  # C type of the CUDA launchers and templates (templates/cuda/common.cuh typedefs bf16)
    ascendc: str  # AscendC type; "" where the AscendC target has none
    tir: str  # TVM TIR storage dtype
    numpy: str  # numpy name (bfloat16 and float8_e4m3fn from ml_dtypes)
    torch: str  # torch attribute name, resolved only when asked, so this module never imports torch

    def numpy_dtype(self):
        import ml_dtypes  # registers bfloat16 / float8 with numpy
        import numpy as np

        return np.dtype(getattr(ml_dtypes, self.numpy, self.numpy))

    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch)


DTYPES: dict[str, DType] = {d.name: d for d in (
    # name, bytes, C, AscendC, TIR, numpy, torch
    DType("fp32",     4, "float",   "float",      "float32",  "float32",       "float32"),
    DType("fp16",     2, "half",    "half",       "float16",  "float16",       "float16"),
    DType("bf16",     2, "bf16",    "bfloat16_t", "bfloat16", "bfloat16",      "bfloat16"),
    DType("int8",     1, "int8_t",  "int8_t",     "int8",     "int8",          "int8"),
    DType("fp8_e4m3", 1, "uint8_t", "",           "uint8",    "float8_e4m3fn", "float8_e4m3fn"),
    DType("int32",    4, "int32_t", "int32_t",    "int32",    "int32",         "int32"),
    DType("int64",    8, "int64_t", "int64_t",    "int64",    "int64",         "int64"),
)}
_BY_TORCH = {d.torch: d.name for d in DTYPES.values()}
FLOAT_DTYPES = ("fp32", "fp16", "bf16")
KV_DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3")
QUANT_DTYPES = ("int8", "fp8_e4m3")
# largest magnitude a quantised KV element can hold; scale = amax / QMAX
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}

Dim = Union[int, str]


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def numpy_dtype(dtype: str):
    return DTYPES[dtype].numpy_dtype()


def torch_dtype(dtype: str):
    return DTYPES[dtype].torch_dtype()


def from_torch(dtype) -> str | None:
    """The IR dtype of a torch dtype (read by its name: torch is not imported here), or None."""
    return _BY_TORCH.get(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class TensorSpec:
    """A kernel parameter: a tensor with symbolic dims, or a scalar size (shape ())."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]
    role: str = "in"  # in | out | inout
    optional: bool = False

    @property
    def is_scalar(self) -> bool:
        return self.shape == ()

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise IRError(f"{self.name}.dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.role not in ("in", "out", "inout"):
            raise IRError(f"{self.name}.role", f"must be in/out/inout, got {self.role!r}")
        for d in self.shape:
            if isinstance(d, int) and d < 0:
                raise IRError(f"{self.name}.shape", f"dims must be >= 0, got {self.shape}")


def size(name: str, dtype: str = "int64") -> TensorSpec:
    return TensorSpec(name, dtype, ())


def _check_positive(op, *names):
    for n in names:
        v = getattr(op, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise IRError(f"{op.kind}.{n}", f"must be a positive int, got {v!r}")


def _check_choice(op, name, choices):
    v = getattr(op, name)
    if v not in choices:
        raise IRError(f"{op.kind}.{name}", f"must be one of {list(choices)}, got {v!r}")


def _check_pow2(op, name, lo=1, hi=1 << 30):
    v = getattr(op, name)
    if not (lo <= v <= hi and v & (v - 1) == 0):
        raise IRError(f"{op.kind}.{name}", f"must be a power of two in [{lo}, {hi}], got {v!r}")


class OpSpec:
    """Mixin for op specs: validation, parameter list, stable hash, dict round trip."""

    kind: ClassVar[str]

    def params(self) -> list[TensorSpec]:
        raise NotImplementedError

    @property
    def quantized(self) -> bool:
        """KV stored as int8 / fp8 with per (token, head) scales."""
        return getattr(self, "kv_dtype", None) in QUANT_DTYPES

    def tensors(self) -> list[TensorSpec]:
        return [p for p in self.params() if not p.is_scalar]

    def sizes(self) -> list[TensorSpec]:
        return [p for p in self.params() if p.is_scalar]

    def to_dict(self) -> dict:
        return {"op": self.kind, **asdict(self)}

    def key(self) -> str:
        """Stable short hash of the variant (part of kernel names and cache keys)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def symbol(self) -> str:
        return f"ua_{self.kind}_{self.key()}"

    def replace(self, **changes):
        from dataclasses import replace

        return replace(self, **changes)


@dataclass(frozen=True)
class PagedAttention(OpSpec):
    """UA paged attention (see DESIGN.md). One launch for any mix of prefill and decode.

    num_splits > 1 writes split-KV partials instead of the final output: split i of
    token t covers positions [lo + i*c, min(lo + (i+1)*c, L)) of its visible range
    [lo, L), c = ceil((L - lo) / num_splits); an empty split has lse = -inf, o = 0.
    fused_merge (num_splits > 1 only) also writes out (and lse) in the same launch, as
    merge_state of the partials would: the last split to finish a (token, KV head) merges
    them. Its workspace split_counters [num_tokens, num_kv_heads] int32 must be all zero
    on entry and is all zero again on exit, so zero it once and reuse it (CUDA graph
    replays too); launches that share one counter buffer must not run concurrently.
    item_queue adds the workspace item_queue [2] int32, under the same rule (all zero on
    entry and on exit; one per stream): the CUDA Hopper path's persistent prefill blocks
    take their work items from it in heaviest-first order (a dynamic schedule); other
    targets and paths ignore it, and the TVM and AscendC lowerings reject it.
    decode_only attends every token as its own decode item (no tile of a sequence's tokens
    sharing K/V loads): the same result for any ubatch, a schedule for decode steps (each
    sequence one token), whose CUDA kernel then has no prefill path, its registers, shared
    memory and scan. The TVM and AscendC lowerings, which have one schedule, ignore it.
    variant "unified_masked" has the same result but scans every sequence's pages and
    masks foreign cells out (llama.cpp's unified KV buffer), as a measured baseline.
    """

    kind: ClassVar[str] = "paged_attention"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    q_dtype: str = "fp16"  # q and out
    kv_dtype: str = "fp16"
    scale: float | None = None  # None -> 1/sqrt(head_dim)
    window: int = 0  # 0 = no sliding window
    softcap: float = 0.0  # 0 = no soft-cap
    alibi: bool = False
    num_splits: int = 1
    return_lse: bool = False
    variant: str = "ua"  # ua | unified_masked
    fused_merge: bool = False
    item_queue: bool = False
    decode_only: bool = False

    def __post_init__(self):
        _check_positive(self, "num_q_heads", "num_kv_heads", "head_dim", "page_size", "num_splits")
        if self.num_q_heads % self.num_kv_heads:
            raise IRError(f"{self.kind}.num_q_heads",
                          f"must be a multiple of num_kv_heads ({self.num_q_heads} % {self.num_kv_heads} != 0)")
        _check_pow2(self, "page_size", 1, 256)
        _check_choice(self, "q_dtype", FLOAT_DTYPES)
        _check_choice(self, "kv_dtype", KV_DTYPES)
        _check_choice(self, "variant", ("ua", "unified_masked"))
        if self.kv_dtype not in QUANT_DTYPES and self.kv_dtype != self.q_dtype and self.kv_dtype != "fp32":
            raise IRError(f"{self.kind}.kv_dtype",
                          f"a float KV cache must match q_dtype ({self.q_dtype}) or be fp32, got {self.kv_dtype}")
        if not isinstance(self.window, int) or self.window < 0:
            raise IRError(f"{self.kind}.window", f"must be an int >= 0 (0 = off), got {self.window!r}")
        if not (self.softcap >= 0 and math.isfinite(self.softcap)):
            raise IRError(f"{self.kind}.softcap", f"must be finite and >= 0 (0 = off), got {self.softcap!r}")
        if self.scale is not None and not (self.scale > 0 and math.isfinite(self.scale)):
            raise IRError(f"{self.kind}.scale", f"must be finite and > 0, got {self.scale!r}")
        if not isinstance(self.fused_merge, bool):
            raise IRError(f"{self.kind}.fused_merge", f"must be a bool, got {self.fused_merge!r}")
        if self.fused_merge and self.num_splits == 1:
            raise IRError(f"{self.kind}.fused_merge", "needs num_splits > 1 (one split writes out directly)")
        if not isinstance(self.item_queue, bool):
            raise IRError(f"{self.kind}.item_queue", f"must be a bool, got {self.item_queue!r}")
        if not isinstance(self.decode_only, bool):
            raise IRError(f"{self.kind}.decode_only", f"must be a bool, got {self.decode_only!r}")
        if self.decode_only and self.item_queue:
            raise IRError(f"{self.kind}.decode_only", "has no prefill blocks to take items: build with item_queue=False")

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    def params(self) -> list[TensorSpec]:
        Hq, Hkv, D, P = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size
        ps = [
            TensorSpec("q", self.q_dtype, ("num_tokens", Hq, D)),
            TensorSpec("k_cache", self.kv_dtype, ("num_pages", P, Hkv, D)),
            TensorSpec("v_cache", self.kv_dtype, ("num_pages", P, Hkv, D)),
            TensorSpec("token_seq", "int32", ("num_tokens",)),
            TensorSpec("page_table", "int32", ("num_seqs", "max_pages")),
            TensorSpec("token_kv_len", "int32", ("num_tokens",)),
        ]
        if self.quantized:
            ps += [TensorSpec("k_scale", "fp32", ("num_pages", P, Hkv)),
                   TensorSpec("v_scale", "fp32", ("num_pages", P, Hkv))]
        if self.alibi:
            ps.append(TensorSpec("alibi_slopes", "fp32", (Hq,)))
        if self.num_splits > 1:
            S = self.num_splits
            ps += [TensorSpec("o_partial", "fp32", (S, "num_tokens", Hq, D), "out"),
                   TensorSpec("lse_partial", "fp32", (S, "num_tokens", Hq), "out")]
        if self.fused_merge:
            ps.append(TensorSpec("split_counters", "int32", ("num_tokens", Hkv), "inout"))
        if self.item_queue:
            ps.append(TensorSpec("item_queue", "int32", (2,), "inout"))
        if self.num_splits == 1 or self.fused_merge:
            ps.append(TensorSpec("out", self.q_dtype, ("num_tokens", Hq, D), "out"))
            if self.return_lse:
                ps.append(TensorSpec("lse", "fp32", ("num_tokens", Hq), "out"))
        return ps + [size("num_tokens"), size("num_seqs"), size("max_pages"), size("num_pages")]


@dataclass(frozen=True)
class ReshapeAndCache(OpSpec):
    """Write a ubatch's new K and V into the paged cache at slot_mapping (-1 = skip).

    Quantised KV (int8 / fp8_e4m3) stores per (token, head) scales: scale = amax / QMAX
    (1.0 when amax == 0), element = round(x / scale) (int8: nearest-even, clamp to
    +-127; fp8: e4m3fn nearest-even, saturating). With rope=True, K is rotated (NeoX
    rotate-half, or interleaved pairs with rope_interleaved) at `positions` first.
    """

    kind: ClassVar[str] = "reshape_and_cache"
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "fp16"  # incoming k, v
    kv_dtype: str = "fp16"
    rope: bool = False
    rope_theta: float = 10000.0
    rope_interleaved: bool = False

    def __post_init__(self):
        _check_positive(self, "num_kv_heads", "head_dim", "page_size")
        _check_pow2(self, "page_size", 1, 256)
        _check_choice(self, "dtype", FLOAT_DTYPES)
        _check_choice(self, "kv_dtype", KV_DTYPES)
        if self.kv_dtype not in QUANT_DTYPES and self.kv_dtype != self.dtype:
            raise IRError(f"{self.kind}.kv_dtype", f"a float KV cache must match dtype ({self.dtype}), got {self.kv_dtype}")
        if self.rope and self.head_dim % 2:
            raise IRError(f"{self.kind}.head_dim", f"must be even with rope=True, got {self.head_dim}")
        if self.rope and not self.rope_theta > 0:
            raise IRError(f"{self.kind}.rope_theta", f"must be > 0, got {self.rope_theta}")

    def params(self) -> list[TensorSpec]:
        Hkv, D, P = self.num_kv_heads, self.head_dim, self.page_size
        ps = [
            TensorSpec("k", self.dtype, ("num_tokens", Hkv, D)),
            TensorSpec("v", self.dtype, ("num_tokens", Hkv, D)),
            TensorSpec("slot_mapping", "int64", ("num_tokens",)),
        ]
        if self.rope:
            ps.append(TensorSpec("positions", "int64", ("num_tokens",)))
        ps += [TensorSpec("k_cache", self.kv_dtype, ("num_pages", P, Hkv, D), "inout"),
               TensorSpec("v_cache", self.kv_dtype, ("num_pages", P, Hkv, D), "inout")]
        if self.quantized:
            ps += [TensorSpec("k_scale", "fp32", ("num_pages", P, Hkv), "inout"),
                   TensorSpec("v_scale", "fp32", ("num_pages", P, Hkv), "inout")]
        return ps + [size("num_tokens"), size("num_pages")]


@dataclass(frozen=True)
class _PageOp(OpSpec):
    """Fields and checks shared by the ops that move whole pages."""

    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    kv_dtype: str = "fp16"

    def __post_init__(self):
        _check_positive(self, "num_kv_heads", "head_dim", "page_size")
        _check_pow2(self, "page_size", 1, 256)
        _check_choice(self, "kv_dtype", KV_DTYPES)


@dataclass(frozen=True)
class CopyBlocks(_PageOp):
    """Copy whole pages (K, V and scales) of all layers in one launch: mapping[i] = (src, dst).

    The cache of all layers is one tensor kv [num_layers, 2, num_pages, P, Hkv, D]
    (index 0 = K, 1 = V); scales [num_layers, 2, num_pages, P, Hkv] when quantised.
    """

    kind: ClassVar[str] = "copy_blocks"

    def params(self) -> list[TensorSpec]:
        Hkv, D, P = self.num_kv_heads, self.head_dim, self.page_size
        ps = [TensorSpec("kv", self.kv_dtype, ("num_layers", 2, "num_pages", P, Hkv, D), "inout")]
        if self.quantized:
            ps.append(TensorSpec("scales", "fp32", ("num_layers", 2, "num_pages", P, Hkv), "inout"))
        ps.append(TensorSpec("mapping", "int64", ("num_pairs", 2)))
        return ps + [size("num_layers"), size("num_pages"), size("num_pairs")]


@dataclass(frozen=True)
class SwapBlocks(_PageOp):
    """Move pages between two caches of the CopyBlocks layout (device <-> pinned host).

    dst[:, :, mapping[i, 1]] = src[:, :, mapping[i, 0]] for every layer and K/V, in one
    launch or one batched copy. Source and destination may have different page counts.
    """

    kind: ClassVar[str] = "swap_blocks"

    def params(self) -> list[TensorSpec]:
        Hkv, D, P = self.num_kv_heads, self.head_dim, self.page_size
        ps = [TensorSpec("src", self.kv_dtype, ("num_layers", 2, "num_src_pages", P, Hkv, D)),
              TensorSpec("dst", self.kv_dtype, ("num_layers", 2, "num_dst_pages", P, Hkv, D), "inout")]
        if self.quantized:
            ps += [TensorSpec("src_scales", "fp32", ("num_layers", 2, "num_src_pages", P, Hkv)),
                   TensorSpec("dst_scales", "fp32", ("num_layers", 2, "num_dst_pages", P, Hkv), "inout")]
        ps.append(TensorSpec("mapping", "int64", ("num_pairs", 2)))
        return ps + [size("num_layers"), size("num_src_pages"), size("num_dst_pages"), size("num_pairs")]


@dataclass(frozen=True)
class MergeState(OpSpec):
    """Combine split-KV partials by their LSE (the flash-decoding reduce).

    out = sum_i exp(lse_i - lse) * o_i, lse = logsumexp_i(lse_i); all splits empty
    (lse = -inf everywhere) gives out = 0, lse = -inf.
    """

    kind: ClassVar[str] = "merge_state"
    num_heads: int
    head_dim: int
    num_splits: int
    out_dtype: str = "fp16"
    return_lse: bool = False

    def __post_init__(self):
        _check_positive(self, "num_heads", "head_dim", "num_splits")
        _check_choice(self, "out_dtype", FLOAT_DTYPES)

    def params(self) -> list[TensorSpec]:
        S, H, D = self.num_splits, self.num_heads, self.head_dim
        ps = [TensorSpec("o_partial", "fp32", (S, "num_tokens", H, D)),
              TensorSpec("lse_partial", "fp32", (S, "num_tokens", H)),
              TensorSpec("out", self.out_dtype, ("num_tokens", H, D), "out")]
        if self.return_lse:
            ps.append(TensorSpec("lse", "fp32", ("num_tokens", H), "out"))
        return ps + [size("num_tokens")]


OPS: dict[str, type] = {c.kind: c for c in (PagedAttention, ReshapeAndCache, CopyBlocks, SwapBlocks, MergeState)}


def op_from_dict(d: dict) -> OpSpec:
    """Build an op spec from {'op': kind, field: value...}; unknown keys are IRErrors."""
    d = dict(d)
    kind = d.pop("op", None)
    if kind not in OPS:
        raise IRError("op", f"must be one of {sorted(OPS)}, got {kind!r}")
    cls = OPS[kind]
    names = {f.name for f in fields(cls)}
    for k in d:
        if k not in names:
            raise IRError(f"{kind}.{k}", f"is not a field of {kind}; fields: {sorted(names)}")
    for f in fields(cls):
        if f.name not in d and f.default is MISSING:
            raise IRError(f"{kind}.{f.name}", "is required")
    return cls(**d)


def c_signature(op: OpSpec, name: str | None = None, stream_type: str = "cudaStream_t") -> str:
    """`int name(void* t..., int64_t size..., stream)`: the launcher ABI of every target."""
    args = [f"void* {p.name}" for p in op.tensors()] + [f"int64_t {p.name}" for p in op.sizes()]
    return f"int {name or op.symbol()}({', '.join(args + [f'{stream_type} stream'])})"


def cffi_cdef(op: OpSpec, name: str | None = None) -> str:
    """The cffi declaration of the launcher (the stream is an opaque pointer)."""
    return c_signature(op, name, stream_type="void*") + ";"


def reference_doc() -> str:
    """docs/OPS.md: every op's contract, fields and kernel parameters, from this module."""
    full = [PagedAttention(32, 8, 128, 16, "bf16", "int8", alibi=True, return_lse=True),
            PagedAttention(32, 8, 128, 16, "bf16", "bf16", num_splits=4),
            PagedAttention(32, 8, 128, 16, "bf16", "bf16", num_splits=4, return_lse=True, fused_merge=True),
            PagedAttention(32, 8, 128, 16, "bf16", "bf16", item_queue=True),
            ReshapeAndCache(8, 128, 16, "bf16", "int8", rope=True), CopyBlocks(8, 128, 16, "int8"),
            SwapBlocks(8, 128, 16, "int8"), MergeState(32, 128, 4, "bf16", return_lse=True)]
    parts = ["# Ops (generated by `uacompile ops --markdown`; do not edit)", ""]
    for cls in OPS.values():
        doc = "\n".join(line.strip() for line in (cls.__doc__ or "").strip().splitlines())
        rows = [f"| `{f.name}` | {str(f.type).replace(' | ', ' or ')} | {'required' if f.default is MISSING else repr(f.default)} |"
                for f in fields(cls)]
        parts += [f"## {cls.kind}", "", doc, "", "| field | type | default |", "|---|---|---|", *rows, ""]
        for op in (o for o in full if o.kind == cls.kind):
            parts += [f"Kernel parameters of `{op!r}`:", "", describe(op).split("\n", 2)[2], "",
                      f"Launcher: `{c_signature(op, 'ua_' + op.kind + '_<hash>')}`", ""]
    return "\n".join(parts)


def describe(op: OpSpec) -> str:
    """Markdown table of an op's parameters (generated docs)."""
    rows = [f"| `{p.name}` | {p.dtype} | {'scalar' if p.is_scalar else list(p.shape)} | {p.role} |" for p in op.params()]
    return "\n".join([f"### `{op.kind}`", "", "| param | dtype | shape | role |", "|---|---|---|---|", *rows])


__all__ = [
    "DType", "DTYPES", "FLOAT_DTYPES", "KV_DTYPES", "QUANT_DTYPES", "QMAX", "TensorSpec", "OpSpec",
    "PagedAttention", "ReshapeAndCache", "CopyBlocks", "SwapBlocks", "MergeState", "OPS",
    "op_from_dict", "c_signature", "cffi_cdef", "describe", "itemsize", "numpy_dtype", "torch_dtype", "from_torch",
]
