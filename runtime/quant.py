"""Quantised linear layers: weights kept packed on the device and run by the layer backend.

  QuantLinear   GGUF block formats (ir.WEIGHT_FORMATS: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k), the rows of each
                output part packed as in the file; a fused projection whose parts differ in format (a Q4_K_M
                file's q/k in Q4_K, v in Q6_K) holds one packed tensor a run of equal formats
  Fp8Linear     e4m3 weights with one float32 scale an output row, for torch._scaled_mm (Hopper / Ada)
  QuantEmbedding  token embeddings in a block format: the looked-up rows are decoded

The arithmetic of a block format is reference.dequantize_blocks (ggml's float32 products); dequantize here is
the same in torch, on any device (the backends without kernels for a format run it). quantize_q8_0 is ggml's
reference quantiser (quantization="q8_0" at load), fp8_rows the per-row e4m3 quantiser (quantization="fp8").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from uacompile import ir

QUANTIZATIONS = ("auto", "none", "fp8", "q8_0")  # EngineConfig.quantization
FP8_MAX = 448.0


# ---------------------------------------------------------------- the block formats in torch
def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes]: each `chunk` bytes give their low nibbles, then their high nibbles."""
    q = qs.reshape(qs.shape[0], -1, 1, chunk)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(qs.shape[0], -1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc.float(), m.float()


def dequantize(weight: torch.Tensor, weight_format: str, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of GGUF blocks [rows, cols / block * nbytes] uint8 -> [rows, cols] in dtype: reference.dequantize_blocks's
    float32 values (bit for bit), rounded once to dtype."""
    fmt = ir.WEIGHT_FORMATS[weight_format]
    rows = weight.shape[0]
    b = weight.reshape(-1, fmt.nbytes)
    if weight_format == "q8_0":
        y = _f16(b[:, 0:2]) * b[:, 2:].view(torch.int8).float()
    elif weight_format == "q4_0":
        y = (_nibbles(b[:, 2:], 16).float() - 8.0) * _f16(b[:, 0:2])
    elif weight_format == "q4_1":
        y = _nibbles(b[:, 4:], 16).float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])
    elif weight_format in ("q4_k", "q5_k"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _k_scale_min(b[:, 4:16])
        q = _nibbles(b[:, 48:] if weight_format == "q5_k" else b[:, 16:], 32).reshape(-1, 8, 32)
        if weight_format == "q5_k":
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
            q = q + (((b[:, None, 16:48] >> shifts) & 1) << 4)
        y = (d * sc)[:, :, None] * q.float() - (dmin * m)[:, :, None]
    elif weight_format == "q6_k":
        ql, qh = b[:, 0:128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        scales, d = b[:, 192:208].contiguous().view(torch.int8).float(), _f16(b[:, 208:210])
        low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
        shifts = (2 * torch.arange(4, dtype=torch.uint8, device=b.device))[None, None, :, None]
        q = (low | (((qh >> shifts) & 3) << 4)).view(torch.int8).float() - 32.0
        y = (d * scales).reshape(-1, 2, 4, 2)[..., None] * q.reshape(-1, 2, 4, 2, 16)
    else:
        raise ValueError(f"unknown weight format {weight_format!r} (supported: {list(ir.WEIGHT_FORMATS)})")
    return y.reshape(rows, cols).to(dtype)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Rows [rows, cols] -> Q8_0 blocks [rows, cols / 32 * 34] uint8 on w's device: ggml's quantize_row_q8_0_ref
    (d = amax / 127 in float32, q = roundf(x / d) with halves away from zero; reference.quantize_blocks)."""
    rows, cols = w.shape
    x = w.float().reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    y = x * inv
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return out.reshape(rows, cols // 32 * 34)


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [rows, cols] -> (e4m3 weights [rows, cols], float32 scales [rows]): scale = amax / 448 (1 for a zero
    row), weight = e4m3(x / scale) saturating."""
    x = w.float()
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# ---------------------------------------------------------------- modules
@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of a projection's output, packed in one weight format."""

    weight_format: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class QuantLinear(nn.Module):
    """A linear layer over packed GGUF blocks: out = x @ W^T (+ bias). parts: the output rows' runs of one format,
    in order; run i's packed rows are the buffer `weight{i}` [rows, K / block * nbytes] uint8 (the fused layer's
    checkpoint tensors are read into their rows, as into a dense fused weight)."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool, dtype: torch.dtype, device="meta"):
        super().__init__()
        self.in_features, self.out_features = in_features, parts[-1].stop
        self.parts = tuple(parts)
        for i, p in enumerate(parts):
            fmt = ir.WEIGHT_FORMATS[p.weight_format]
            if in_features % fmt.block:
                raise ValueError(f"{p.weight_format} weights need in_features divisible by {fmt.block}, "
                                 f"got {in_features}")
            self.register_buffer(f"weight{i}", torch.empty((p.rows, fmt.row_bytes(in_features)), dtype=torch.uint8,
                                                           device=device))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device)) if bias else None

    def packed(self) -> list[tuple[Part, torch.Tensor]]:
        return [(p, getattr(self, f"weight{i}")) for i, p in enumerate(self.parts)]

    def place(self, start: int, stop: int) -> tuple[str, int, int]:
        """(buffer name, first row, end row) holding output rows [start, stop), which lie in one part."""
        for i, p in enumerate(self.parts):
            if p.start <= start and stop <= p.stop:
                return f"weight{i}", start - p.start, stop - p.start
        raise ValueError(f"rows [{start}, {stop}) span parts of different formats {self.parts}")

    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.packed())

    def extra_repr(self) -> str:
        formats = "+".join(f"{p.weight_format}[{p.rows}]" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {formats}"


class Fp8Linear(nn.Module):
    """e4m3 weights [N, K] with per-row float32 scales [N]: out = (x @ (weight * scale)^T) (+ bias), run by
    torch._scaled_mm with the activations quantised per token (their own e4m3 scale a row)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device="meta"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None


class QuantEmbedding(nn.Module):
    """Token embeddings in a block format ([V, E / block * nbytes] uint8): a lookup gathers the packed rows and
    decodes them. A tied lm_head is a QuantLinear over the same buffer."""

    def __init__(self, num_embeddings: int, embedding_dim: int, weight_format: str, dtype: torch.dtype, device="meta"):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.weight_format = num_embeddings, embedding_dim, weight_format
        self.dtype = dtype  # of the decoded rows
        fmt = ir.WEIGHT_FORMATS[weight_format]
        self.register_buffer("weight", torch.empty((num_embeddings, fmt.row_bytes(embedding_dim)), dtype=torch.uint8,
                                                   device=device))


def linear_weight_bytes(module: nn.Module) -> int:
    """The bytes a linear layer's weights take on the device (packed, fp8 + scales, or dense)."""
    if isinstance(module, QuantLinear):
        return module.nbytes()
    if isinstance(module, Fp8Linear):
        return module.weight.nbytes + module.scale.nbytes
    return module.weight.nbytes


__all__ = ["QUANTIZATIONS", "Part", "QuantLinear", "Fp8Linear", "QuantEmbedding", "dequantize", "quantize_q8_0",
           "fp8_rows", "linear_weight_bytes"]
