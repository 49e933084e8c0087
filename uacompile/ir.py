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
    DType("uint8",    1, "uint8_t", "uint8_t",    "uint8",    "uint8",         "uint8"),
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


@dataclass(frozen=True)
class WeightFormat:
    """A GGUF block format of quantised weights (ggml's layouts): a row of K weights is K / block blocks of
    `nbytes` bytes each, stored one after another."""

    name: str  # the IR's name: "q4_k"
    gguf: str  # GGMLQuantizationType name: "Q4_K"
    block: int  # weights a block
    nbytes: int  # bytes a block

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.nbytes

    @property
    def bits(self) -> float:
        """Bits a weight, scales included (Q8_0: 8.5, Q4_K: 4.5)."""
        return 8.0 * self.nbytes / self.block


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("q8_0", "Q8_0", 32, 34),     # fp16 d; int8 q[32]:                         w = d * q
    WeightFormat("q4_0", "Q4_0", 32, 18),     # fp16 d; 16 bytes of nibbles:                w = d * (q - 8)
    WeightFormat("q4_1", "Q4_1", 32, 20),     # fp16 d, m; 16 bytes of nibbles:             w = d * q + m
    WeightFormat("q4_k", "Q4_K", 256, 144),   # fp16 d, dmin; 12 bytes of 6-bit (scale, min) x 8; 128 bytes of nibbles
    WeightFormat("q5_k", "Q5_K", 256, 176),   # as q4_k, plus 32 bytes of fifth bits
    WeightFormat("q6_k", "Q6_K", 256, 210),   # 128 bytes low nibbles, 64 bytes high 2 bits, int8 scales[16], fp16 d
)}

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


def _check_freq_factors(op) -> None:
    """RoPE's per-frequency factors (Llama 3's rope scaling): a tuple of head_dim / 2 finite numbers > 0, or empty."""
    try:
        object.__setattr__(op, "freq_factors", tuple(float(f) for f in op.freq_factors))
    except (TypeError, ValueError):
        raise IRError(f"{op.kind}.freq_factors", f"must be a sequence of numbers, got {op.freq_factors!r}") from None
    if op.freq_factors and (len(op.freq_factors) != op.head_dim // 2
                            or not all(f > 0 and math.isfinite(f) for f in op.freq_factors)):
        raise IRError(f"{op.kind}.freq_factors",
                      f"must be empty or head_dim / 2 = {op.head_dim // 2} finite numbers > 0, got {op.freq_factors!r}")


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


def check_splits(num_splits, fused_merge, where: str = "config") -> None:
    """The split fields every target's config shares: a positive int, and a fused merge only with splits."""
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise IRError(f"{where}.num_splits", f"must be a positive int, got {num_splits!r}")
    if not isinstance(fused_merge, bool):
        raise IRError(f"{where}.fused_merge", f"must be a bool, got {fused_merge!r}")
    if fused_merge and num_splits == 1:
        raise IRError(f"{where}.fused_merge", "needs num_splits > 1 (one split writes out directly)")


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
        return hashlib.sha256(_blob(self.to_dict()).encode()).hexdigest()[:12]

    def symbol(self) -> str:
        return f"ua_{self.kind}_{self.key()}"

    def replace(self, **changes):
        from dataclasses import replace

        return replace(self, **changes)


def _blob(d: dict) -> str:
    return json.dumps(d, sort_keys=True, default=str)


@dataclass(frozen=True)
class Kernel:
    """What a target builds and launches: an op (the math) and how the target runs it (its config).

    config is a target's frozen config dataclass (targets.cuda.config.AttentionConfig, ...), or None
    for an op no config changes. A config's signature() gives the fields that change the op's parameters
    (op.params(**signature)): split-KV partials and workspaces. key() and symbol() hash both halves, so
    the kernel cache holds one entry per (op, config)."""

    op: OpSpec
    config: object = None

    def __post_init__(self):
        if not isinstance(self.op, OpSpec):
            raise IRError("kernel.op", f"must be an op spec, got {type(self.op).__name__}")

    def __getattr__(self, name):  # the op's fields and properties read through the kernel (kernel.head_dim)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.op, name)

    @property
    def kind(self) -> str:
        return self.op.kind

    def signature(self) -> dict:
        return self.config.signature() if self.config is not None and hasattr(self.config, "signature") else {}

    def replace(self, **changes) -> "Kernel":
        """The same config over the op with `changes` (op fields)."""
        return Kernel(self.op.replace(**changes), self.config)

    def params(self) -> list[TensorSpec]:
        return self.op.params(**self.signature())

    def tensors(self) -> list[TensorSpec]:
        return [p for p in self.params() if not p.is_scalar]

    def sizes(self) -> list[TensorSpec]:
        return [p for p in self.params() if p.is_scalar]

    def to_dict(self) -> dict:
        if self.config is None:
            return {"op": self.op.to_dict(), "config": None}
        fields = self.config.to_dict() if hasattr(self.config, "to_dict") else asdict(self.config)
        cfg = {"config": type(self.config).__name__, **fields}
        return {"op": self.op.to_dict(), "config": cfg}

    def key(self) -> str:
        if self.config is None:
            return self.op.key()
        return hashlib.sha256(_blob(self.to_dict()).encode()).hexdigest()[:12]

    def symbol(self) -> str:
        return f"ua_{self.kind}_{self.key()}"


def as_kernel(x) -> Kernel:
    """x itself when a Kernel; an op alone is the kernel with no config."""
    return x if isinstance(x, Kernel) else Kernel(x)


class _AttentionHeads(OpSpec):
    """What attention and the scores over its cache share: the head layout (q heads in groups over the KV heads),
    the page size and the softmax scale. Subclasses have the fields num_q_heads, num_kv_heads, head_dim,
    page_size and scale."""

    def _check_heads(self) -> None:
        _check_positive(self, "num_q_heads", "num_kv_heads", "head_dim", "page_size")
        if self.num_q_heads % self.num_kv_heads:
            raise IRError(f"{self.kind}.num_q_heads",
                          f"must be a multiple of num_kv_heads ({self.num_q_heads} % {self.num_kv_heads} != 0)")
        _check_pow2(self, "page_size", 1, 256)
        if self.scale is not None and not (self.scale > 0 and math.isfinite(self.scale)):
            raise IRError(f"{self.kind}.scale", f"must be finite and > 0, got {self.scale!r}")

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class PagedAttention(_AttentionHeads):
    """UA paged attention (see DESIGN.md). One launch for any mix of prefill and decode.

    The op is the math: out[t] (and lse[t] with return_lse) attends token t's query to positions
    [lo, token_kv_len[t]) of its sequence's pages (lo > 0 only with a sliding window).
    How a target runs it is the target's config, not the op (ir.Kernel). The parameter list
    depends on three of a config's fields (params(num_splits, fused_merge, item_queue)):
    num_splits > 1 writes split-KV partials instead of the final output: split i of
    token t covers positions [lo + i*c, min(lo + (i+1)*c, L)) of its visible range
    [lo, L), c = ceil((L - lo) / num_splits); an empty split has lse = -inf, o = 0.
    fused_merge (num_splits > 1 only) also writes out (and lse) in the same launch, as
    merge_state of the partials would: the last split to finish a (token, KV head) merges
    them. Its workspace split_counters [num_tokens, num_kv_heads] int32 must be all zero
    on entry and is all zero again on exit, so zero it once and reuse it (CUDA graph
    replays too); launches that share one counter buffer must not run concurrently.
    item_queue adds the workspace item_queue [2] int32, under the same rule (all zero on
    entry and on exit; one per stream), from which persistent blocks take their work items.
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
    return_lse: bool = False
    variant: str = "ua"  # ua | unified_masked

    def __post_init__(self):
        self._check_heads()
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
        for name in ("alibi", "return_lse"):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"{self.kind}.{name}", f"must be a bool, got {getattr(self, name)!r}")

    def params(self, num_splits: int = 1, fused_merge: bool = False, item_queue: bool = False) -> list[TensorSpec]:
        """The kernel parameters; the three arguments are the run config's fields that change them (Kernel)."""
        check_splits(num_splits, fused_merge, self.kind)
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
        if num_splits > 1:
            S = num_splits
            ps += [TensorSpec("o_partial", "fp32", (S, "num_tokens", Hq, D), "out"),
                   TensorSpec("lse_partial", "fp32", (S, "num_tokens", Hq), "out")]
        if fused_merge:
            ps.append(TensorSpec("split_counters", "int32", ("num_tokens", Hkv), "inout"))
        if item_queue:
            ps.append(TensorSpec("item_queue", "int32", (2,), "inout"))
        if num_splits == 1 or fused_merge:
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
class GatherTokens(_PageOp):
    """Token-granular copy of K, V (and scales) of all layers in one launch: the kept tokens of KV eviction, each
    (layer, KV head) its own choice of source tokens, packed into the destination slots.

    For layer l, KV head g and token t: kv[l, c, dst // P, dst % P, g] = kv[l, c, src // P, src % P, g] for K and V
    (c = 0, 1), src = src_slots[l, g, t], dst = dst_slots[t] (slot = page * P + offset, as reshape_and_cache);
    scales likewise when quantised. dst -1 skips the token. No destination slot may be a source slot of any
    (layer, head): the runtime gathers into fresh pages, so every source is read unchanged.
    """

    kind: ClassVar[str] = "gather_tokens"

    def params(self) -> list[TensorSpec]:
        Hkv, D, P = self.num_kv_heads, self.head_dim, self.page_size
        ps = [TensorSpec("kv", self.kv_dtype, ("num_layers", 2, "num_pages", P, Hkv, D), "inout")]
        if self.quantized:
            ps.append(TensorSpec("scales", "fp32", ("num_layers", 2, "num_pages", P, Hkv), "inout"))
        ps += [TensorSpec("src_slots", "int64", ("num_layers", Hkv, "num_tokens")),
               TensorSpec("dst_slots", "int64", ("num_tokens",))]
        return ps + [size("num_layers"), size("num_pages"), size("num_tokens")]


SCORE_METHODS = ("andpro", "attention", "value_norm")


@dataclass(frozen=True)
class KVScore(_AttentionHeads):
    """Importance of each cached token for KV eviction, per sequence and KV head, from an observation window of
    queries (SnapKV's window; the runtime passes a sequence's last W queries).

    Sequence s's window is the queries t with query_seq[t] = s (n_s of them); query t sees its sequence's positions
    [0, query_kv_len[t]) of the pages page_table[s] (as paged_attention). For query head h:
    A[h, t, i] = softmax_i(scale * q[t, h] . k_i) over those positions (0 beyond them), a[h, i] = mean_t A[h, t, i]
    (the attention weight over the window) and o_h = sum_i a[h, i] v_i (the window's mean output, the anchor).
    method (per query head, then averaged over the G = Hq / Hkv query heads of KV head g, the GQA aggregate):
      andpro:     a[h, i] <v_i, o_h> / ||o_h||  (the weighted value projected on the anchor direction; 0 if o_h = 0)
      attention:  a[h, i]                      (H2O / SnapKV)
      value_norm: a[h, i] ||v_i||_1            (VATP)
    scores[s, g, i] for i < kv_len[s] (the positions scored; every query_kv_len of s is <= kv_len[s]), -inf for
    i in [kv_len[s], max_kv_len); a sequence with no window query scores 0. Float KV only; math in float32
    in the kernels, float64 in the reference.
    """

    kind: ClassVar[str] = "kv_score"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    q_dtype: str = "fp16"
    kv_dtype: str = "fp16"
    scale: float | None = None  # None -> 1/sqrt(head_dim)
    method: str = "andpro"

    def __post_init__(self):
        self._check_heads()
        _check_choice(self, "q_dtype", FLOAT_DTYPES)
        _check_choice(self, "kv_dtype", FLOAT_DTYPES)
        _check_choice(self, "method", SCORE_METHODS)
        if self.kv_dtype != self.q_dtype and self.kv_dtype != "fp32":
            raise IRError(f"{self.kind}.kv_dtype",
                          f"must match q_dtype ({self.q_dtype}) or be fp32, got {self.kv_dtype}")

    def params(self) -> list[TensorSpec]:
        Hq, Hkv, D, P = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size
        return [TensorSpec("q", self.q_dtype, ("num_queries", Hq, D)),
                TensorSpec("k_cache", self.kv_dtype, ("num_pages", P, Hkv, D)),
                TensorSpec("v_cache", self.kv_dtype, ("num_pages", P, Hkv, D)),
                TensorSpec("query_seq", "int32", ("num_queries",)),
                TensorSpec("query_kv_len", "int32", ("num_queries",)),
                TensorSpec("page_table", "int32", ("num_seqs", "max_pages")),
                TensorSpec("kv_len", "int32", ("num_seqs",)),
                TensorSpec("scores", "fp32", ("num_seqs", Hkv, "max_kv_len"), "out"),
                size("num_queries"), size("num_pages"), size("num_seqs"), size("max_pages"), size("max_kv_len")]


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


@dataclass(frozen=True)
class RMSNorm(OpSpec):
    """RMSNorm of each token row, optionally with the residual add fused in (vLLM's fused_add_rms_norm).

    Without residual: out = dtype(x / rms(x)) * weight, rms(x) = sqrt(mean(x^2) + eps).
    With residual: h = dtype(x + residual) is written back to residual (the new residual stream),
    then out = dtype(h / rms(h)) * weight, the norm taken over the rounded h. The normalised row is
    rounded to dtype before the weight multiplies it, as transformers and vLLM do. Kernels compute
    in float32; out may be x itself (each row is read whole before it is written).
    """

    kind: ClassVar[str] = "rms_norm"
    hidden_size: int
    dtype: str = "fp16"  # x, residual, weight, out
    eps: float = 1e-6
    residual: bool = False

    def __post_init__(self):
        _check_positive(self, "hidden_size")
        _check_choice(self, "dtype", FLOAT_DTYPES)
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise IRError(f"{self.kind}.eps", f"must be finite and > 0, got {self.eps!r}")
        if not isinstance(self.residual, bool):
            raise IRError(f"{self.kind}.residual", f"must be a bool, got {self.residual!r}")

    def params(self) -> list[TensorSpec]:
        E = self.hidden_size
        ps = [TensorSpec("x", self.dtype, ("num_tokens", E))]
        if self.residual:
            ps.append(TensorSpec("residual", self.dtype, ("num_tokens", E), "inout"))
        ps += [TensorSpec("weight", self.dtype, (E,)), TensorSpec("out", self.dtype, ("num_tokens", E), "out")]
        return ps + [size("num_tokens")]


@dataclass(frozen=True)
class SiluAndMul(OpSpec):
    """The SwiGLU activation over a merged gate/up projection: out = dtype(silu(x[:, :I])) * x[:, I:].

    x [T, 2I] holds the gate in its first I columns and the up projection in the last I; silu(g) =
    g / (1 + exp(-g)) is rounded to dtype before the product, as transformers' F.silu(gate) * up.
    """

    kind: ClassVar[str] = "silu_and_mul"
    intermediate_size: int
    dtype: str = "fp16"

    def __post_init__(self):
        _check_positive(self, "intermediate_size")
        _check_choice(self, "dtype", FLOAT_DTYPES)

    def params(self) -> list[TensorSpec]:
        I = self.intermediate_size  # noqa: E741
        return [TensorSpec("x", self.dtype, ("num_tokens", 2 * I)),
                TensorSpec("out", self.dtype, ("num_tokens", I), "out"), size("num_tokens")]


@dataclass(frozen=True)
class Rope(OpSpec):
    """Rotary embedding of x [T, H, D] in place at positions [T]: reshape_and_cache's RoPE on any tensor (q, or k
    where the cache write does not rotate it).

    inv_freq[i] = 1 / rope_theta^(2i / D) and angle = position * inv_freq[i] in float64; NeoX rotate-half
    (element i pairs with i + D/2) or, with interleaved, GPT-J pairs (2i, 2i+1); a*cos - b*sin and
    b*cos + a*sin in float64, rounded once to dtype (reference.rope). freq_factors (D/2 positive
    numbers, or empty) divide the frequencies: inv_freq[i] / freq_factors[i], which states scaled RoPE
    (linear: every factor the same; llama3's per-frequency rule; GGUF's rope_freqs).
    """

    kind: ClassVar[str] = "rope"
    num_heads: int
    head_dim: int
    dtype: str = "fp16"
    rope_theta: float = 10000.0
    interleaved: bool = False
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        _check_positive(self, "num_heads", "head_dim")
        _check_freq_factors(self)
        _check_choice(self, "dtype", FLOAT_DTYPES)
        if self.head_dim % 2:
            raise IRError(f"{self.kind}.head_dim", f"must be even, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise IRError(f"{self.kind}.rope_theta", f"must be finite and > 0, got {self.rope_theta!r}")
        if not isinstance(self.interleaved, bool):
            raise IRError(f"{self.kind}.interleaved", f"must be a bool, got {self.interleaved!r}")

    def params(self) -> list[TensorSpec]:
        return [TensorSpec("x", self.dtype, ("num_tokens", self.num_heads, self.head_dim), "inout"),
                TensorSpec("positions", "int64", ("num_tokens",)), size("num_tokens")]


@dataclass(frozen=True)
class QKVRopeCache(OpSpec):
    """The attention block's prologue in one launch: the packed q/k/v projection qkv [T, Hq + 2 Hkv, D] (q heads,
    then k, then v, as the fused matmul writes them) -> q_out [T, Hq, D] for attention, K and V into the paged cache.

    With qk_norm (Qwen3), each q and k head is first RMSNorm'd over head_dim with q_norm / k_norm [D] (rms_norm's
    math and roundings: out = dtype(dtype(h / rms(h)) * weight)). Then q and k are rotated at positions (rope's
    math: NeoX rotate-half, or interleaved pairs; freq_factors divide the frequencies), each output rounded once to
    dtype. The rotated K and V are written as reshape_and_cache writes them (slot_mapping, -1 skips; int8 / fp8
    caches quantised per (token, head) with their scales). q_out is written for every token.
    """

    kind: ClassVar[str] = "qkv_rope_cache"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "fp16"  # qkv, q_out and the norm weights
    kv_dtype: str = "fp16"
    qk_norm: bool = False
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        _check_positive(self, "num_q_heads", "num_kv_heads", "head_dim", "page_size")
        _check_pow2(self, "page_size", 1, 256)
        _check_choice(self, "dtype", FLOAT_DTYPES)
        _check_choice(self, "kv_dtype", KV_DTYPES)
        if self.kv_dtype not in QUANT_DTYPES and self.kv_dtype != self.dtype:
            raise IRError(f"{self.kind}.kv_dtype", f"a float KV cache must match dtype ({self.dtype}), got {self.kv_dtype}")
        if self.num_q_heads % self.num_kv_heads:
            raise IRError(f"{self.kind}.num_q_heads", f"must be a multiple of num_kv_heads ({self.num_kv_heads}), "
                                                      f"got {self.num_q_heads}")
        if self.head_dim % 2:
            raise IRError(f"{self.kind}.head_dim", f"must be even, got {self.head_dim}")
        for name in ("qk_norm", "rope_interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise IRError(f"{self.kind}.{name}", f"must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise IRError(f"{self.kind}.eps", f"must be finite and > 0, got {self.eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise IRError(f"{self.kind}.rope_theta", f"must be finite and > 0, got {self.rope_theta!r}")
        _check_freq_factors(self)

    def params(self) -> list[TensorSpec]:
        Hq, Hkv, D, P = self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size
        ps = [TensorSpec("qkv", self.dtype, ("num_tokens", Hq + 2 * Hkv, D))]
        if self.qk_norm:
            ps += [TensorSpec("q_norm", self.dtype, (D,)), TensorSpec("k_norm", self.dtype, (D,))]
        ps += [TensorSpec("positions", "int64", ("num_tokens",)), TensorSpec("slot_mapping", "int64", ("num_tokens",)),
               TensorSpec("q_out", self.dtype, ("num_tokens", Hq, D), "out"),
               TensorSpec("k_cache", self.kv_dtype, ("num_pages", P, Hkv, D), "inout"),
               TensorSpec("v_cache", self.kv_dtype, ("num_pages", P, Hkv, D), "inout")]
        if self.quantized:
            ps += [TensorSpec("k_scale", "fp32", ("num_pages", P, Hkv), "inout"),
                   TensorSpec("v_scale", "fp32", ("num_pages", P, Hkv), "inout")]
        return ps + [size("num_tokens"), size("num_pages")]


def _check_weight_format(op) -> WeightFormat:
    _check_choice(op, "weight_format", WEIGHT_FORMATS)
    fmt = WEIGHT_FORMATS[op.weight_format]
    if op.in_features % fmt.block:
        raise IRError(f"{op.kind}.in_features",
                      f"must be a multiple of {op.weight_format}'s block of {fmt.block} weights, got {op.in_features}")
    return fmt


class _BlockWeights:
    """What the block-quantised weight ops share: their format and the checks of their fields."""

    @property
    def format(self) -> WeightFormat:
        return WEIGHT_FORMATS[self.weight_format]

    def _check_fields(self, *positive: str) -> None:
        _check_positive(self, *positive)
        _check_weight_format(self)
        _check_choice(self, "dtype", FLOAT_DTYPES)


@dataclass(frozen=True)
class QuantMatmul(_BlockWeights, OpSpec):
    """A linear layer over GGUF block-quantised weights, kept packed: out = dtype(x @ W^T).

    weight [N, K / block * nbytes] uint8 holds each output row's K weights as consecutive blocks of
    weight_format (ggml's layout, byte for byte as in a GGUF file); W = its decoded values (reference.
    dequantize_blocks: ggml's float32 arithmetic). out[t, n] = sum_k x[t, k] * W[n, k], rounded once to dtype;
    kernels accumulate in float32.
    """

    kind: ClassVar[str] = "quant_matmul"
    in_features: int  # K
    out_features: int  # N
    weight_format: str = "q8_0"
    dtype: str = "bf16"  # x and out

    def __post_init__(self):
        self._check_fields("in_features", "out_features")

    def params(self) -> list[TensorSpec]:
        K, N = self.in_features, self.out_features
        return [TensorSpec("x", self.dtype, ("num_tokens", K)),
                TensorSpec("weight", "uint8", (N, self.format.row_bytes(K))),
                TensorSpec("out", self.dtype, ("num_tokens", N), "out"), size("num_tokens")]


@dataclass(frozen=True)
class Dequantize(_BlockWeights, OpSpec):
    """Decode rows of GGUF block-quantised weights: out = dtype(W), W as in quant_matmul (ggml's float32
    arithmetic, rounded once to dtype). A layer's weights decoded into a scratch buffer feed a dense matmul
    (prefill), rows gathered from a quantised embedding give its lookup."""

    kind: ClassVar[str] = "dequantize"
    in_features: int  # K: weights a row
    weight_format: str = "q8_0"
    dtype: str = "bf16"

    def __post_init__(self):
        self._check_fields("in_features")

    def params(self) -> list[TensorSpec]:
        K = self.in_features
        return [TensorSpec("weight", "uint8", ("num_rows", self.format.row_bytes(K))),
                TensorSpec("out", self.dtype, ("num_rows", K), "out"), size("num_rows")]


@dataclass(frozen=True)
class QuantizeRows(OpSpec):
    """Each row of x quantised to 8 bits with its own float32 scale: the activations of an 8-bit matmul (e4m3 rows
    feed FP8 weights' torch._scaled_mm, out and scale as they are). The KV caches' math (reference.quantize):
    scale = float32(amax |x|) / QMAX (448 for fp8_e4m3, 127 for int8), 1 where the row's amax is 0 or NaN; out =
    e4m3(clip(x / scale, -448, 448)) nearest-even, or int8(clip(rint(x / scale), -127, 127)), the division in
    float32. A NaN element stays NaN (e4m3) at its place."""

    kind: ClassVar[str] = "quantize_rows"
    hidden_size: int
    dtype: str = "bf16"          # x
    out_dtype: str = "fp8_e4m3"  # out

    def __post_init__(self):
        _check_positive(self, "hidden_size")
        _check_choice(self, "dtype", FLOAT_DTYPES)
        _check_choice(self, "out_dtype", QUANT_DTYPES)

    def params(self) -> list[TensorSpec]:
        E = self.hidden_size
        return [TensorSpec("x", self.dtype, ("num_tokens", E)),
                TensorSpec("out", self.out_dtype, ("num_tokens", E), "out"),
                TensorSpec("scale", "fp32", ("num_tokens",), "out"), size("num_tokens")]


OPS: dict[str, type] = {c.kind: c for c in (PagedAttention, ReshapeAndCache, CopyBlocks, SwapBlocks, GatherTokens,
                                            KVScore, MergeState, RMSNorm, SiluAndMul, Rope, QKVRopeCache, QuantMatmul,
                                            Dequantize, QuantizeRows)}


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


def _signature(params: list[TensorSpec], name: str, stream_type: str) -> str:
    args = [f"void* {p.name}" for p in params if not p.is_scalar] + [f"int64_t {p.name}" for p in params if p.is_scalar]
    return f"int {name}({', '.join(args + [f'{stream_type} stream'])})"


def c_signature(op: OpSpec | Kernel, name: str | None = None, stream_type: str = "cudaStream_t") -> str:
    """`int name(void* t..., int64_t size..., stream)`: the launcher ABI of every target."""
    return _signature(op.params(), name or op.symbol(), stream_type)


def cffi_cdef(op: OpSpec | Kernel, name: str | None = None) -> str:
    """The cffi declaration of the launcher (the stream is an opaque pointer)."""
    return c_signature(op, name, stream_type="void*") + ";"


def reference_doc() -> str:
    """docs/OPS.md: every op's contract, fields and kernel parameters, from this module."""
    pa = PagedAttention(32, 8, 128, 16, "bf16", "bf16", return_lse=True)
    full = [PagedAttention(32, 8, 128, 16, "bf16", "int8", alibi=True, return_lse=True),
            (pa, dict(num_splits=4)), (pa, dict(num_splits=4, fused_merge=True)), (pa, dict(item_queue=True)),
            ReshapeAndCache(8, 128, 16, "bf16", "int8", rope=True), CopyBlocks(8, 128, 16, "int8"),
            SwapBlocks(8, 128, 16, "int8"), GatherTokens(8, 128, 16, "int8"), KVScore(32, 8, 128, 16, "bf16", "bf16"),
            MergeState(32, 128, 4, "bf16", return_lse=True),
            RMSNorm(4096, "bf16", 1e-6), RMSNorm(4096, "bf16", 1e-6, residual=True), SiluAndMul(12288, "bf16"),
            Rope(32, 128, "bf16", 1e6), QKVRopeCache(32, 8, 128, 16, "bf16", "fp8_e4m3", qk_norm=True, rope_theta=1e6),
            QuantMatmul(4096, 6144, "q4_k", "bf16"), Dequantize(4096, "q8_0", "bf16"), QuantizeRows(4096, "bf16", "fp8_e4m3")]
    parts = ["# Ops (generated by `uacompile ops --markdown`; do not edit)", ""]
    for cls in OPS.values():
        doc = "\n".join(line.strip() for line in (cls.__doc__ or "").strip().splitlines())
        rows = [f"| `{f.name}` | {str(f.type).replace(' | ', ' or ')} | {'required' if f.default is MISSING else repr(f.default)} |"
                for f in fields(cls)]
        parts += [f"## {cls.kind}", "", doc, "", "| field | type | default |", "|---|---|---|", *rows, ""]
        for op, sig in (o if isinstance(o, tuple) else (o, {}) for o in full):
            if op.kind != cls.kind:
                continue
            with_sig = "".join(f", {k}={v}" for k, v in sig.items())
            params = op.params(**sig)
            parts += [f"Kernel parameters of `{op!r}`{' with the config fields `' + with_sig[2:] + '`' if sig else ''}:",
                      "", _param_table(params), "",
                      f"Launcher: `{_signature(params, 'ua_' + op.kind + '_<hash>', 'cudaStream_t')}`", ""]
    return "\n".join(parts)


def _param_table(params: list[TensorSpec]) -> str:
    rows = [f"| `{p.name}` | {p.dtype} | {'scalar' if p.is_scalar else list(p.shape)} | {p.role} |" for p in params]
    return "\n".join(["| param | dtype | shape | role |", "|---|---|---|---|", *rows])


def describe(op: OpSpec | Kernel) -> str:
    """Markdown table of an op's (or kernel's) parameters (generated docs)."""
    return "\n".join([f"### `{op.kind}`", "", _param_table(op.params())])


__all__ = [
    "DType", "DTYPES", "FLOAT_DTYPES", "KV_DTYPES", "QUANT_DTYPES", "QMAX", "TensorSpec", "OpSpec", "Kernel",
    "as_kernel", "check_splits",
    "PagedAttention", "ReshapeAndCache", "CopyBlocks", "SwapBlocks", "GatherTokens", "KVScore", "SCORE_METHODS",
    "MergeState", "RMSNorm", "SiluAndMul", "Rope", "QKVRopeCache",
    "QuantMatmul", "Dequantize", "QuantizeRows", "WeightFormat", "WEIGHT_FORMATS",
    "OPS", "op_from_dict", "c_signature", "cffi_cdef", "describe", "itemsize", "numpy_dtype", "torch_dtype",
    "from_torch",
]
