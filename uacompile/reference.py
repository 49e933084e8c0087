"""numpy float64 semantics of every op: the executable spec every lowering is tested on.

Inputs may be any numpy dtype (bf16 / fp8 via ml_dtypes); math is float64, except the
KV quantisation, which is specified in float32 arithmetic so kernels can match it bit
for bit. Functions that write caches work in place, like the kernels.
"""
from __future__ import annotations

import numpy as np

from .ir import (QMAX, CopyBlocks, MergeState, PagedAttention, ReshapeAndCache, RMSNorm, Rope, SiluAndMul, SwapBlocks,
                 numpy_dtype)


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------- KV quantisation
def quantize(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (last axis) quantisation: returns (values in kv_dtype, float32 scales)."""
    x32 = np.asarray(x).astype(np.float32)
    amax = np.abs(x32).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(QMAX[kv_dtype]), np.float32(1)).astype(np.float32)
    y = x32 / scale[..., None]  # float32 division, as the kernels do
    if kv_dtype == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        q = np.clip(y, -448, 448).astype(numpy_dtype("fp8_e4m3"))
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return f64(q) * f64(scale)[..., None]


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(theta: float, head_dim: int, freq_factors=()) -> np.ndarray:
    """RoPE's float64 frequencies [D/2]: 1 / theta^(2i / D), divided by freq_factors[i] when given."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return inv_freq / np.asarray(freq_factors, np.float64) if len(freq_factors) else inv_freq


def rope(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool = False, freq_factors=()) -> np.ndarray:
    """Rotary embedding of x [T, H, D] at positions [T] (NeoX rotate-half, or GPT-J pairs)."""
    x = f64(x)
    D = x.shape[-1]
    inv_freq = rope_inv_freq(theta, D, freq_factors)  # [D/2]
    ang = f64(positions)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    a, b = x[..., : D // 2], x[..., D // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


# ---------------------------------------------------------------- attention
def visible_range(op: PagedAttention, kv_len: int) -> tuple[int, int]:
    lo = max(0, kv_len - op.window) if op.window else 0
    return lo, kv_len


def split_ranges(lo: int, hi: int, num_splits: int) -> list[tuple[int, int]]:
    """The split-KV contract: split i covers [lo + i*c, min(lo + (i+1)*c, hi))."""
    c = -(-(hi - lo) // num_splits) if hi > lo else 0
    return [(min(lo + i * c, hi), min(lo + (i + 1) * c, hi)) for i in range(num_splits)]


def _attend(op, qt, keys, vals, positions, kv_len, slopes):
    """One token, all heads. qt [Hq, D]; keys/vals [n, Hkv, D] float64. Returns o [Hq, D], lse [Hq]."""
    Hq, D = qt.shape
    if len(positions) == 0:
        return np.zeros((Hq, D)), np.full(Hq, -np.inf)
    Hkv, G = keys.shape[1], op.group_size  # q head h reads KV head h // G
    qg = qt.reshape(Hkv, G, D)
    s = (qg @ keys.transpose(1, 2, 0)).reshape(Hq, -1) * op.sm_scale  # [Hq, n], one matmul per KV head
    if op.softcap:
        s = op.softcap * np.tanh(s / op.softcap)
    if op.alibi:
        s = s + slopes[:, None] * (positions[None, :] - (kv_len - 1))
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=1)
    o = (p.reshape(Hkv, G, -1) @ vals.transpose(1, 0, 2)).reshape(Hq, D) / denom[:, None]
    return o, m[:, 0] + np.log(denom)


def paged_attention(op: PagedAttention, q, k_cache, v_cache, token_seq, page_table, token_kv_len,
                    k_scale=None, v_scale=None, alibi_slopes=None, split_counters=None,
                    item_queue=None, *, num_splits: int = 1, fused_merge: bool = False):
    """Returns (out [T,Hq,D], lse [T,Hq]) in float64, or with num_splits > 1
    (o_partial [S,T,Hq,D], lse_partial [S,T,Hq]). With fused_merge it returns (out, lse),
    merged from its partials (the split_counters and item_queue workspaces carry no data).
    num_splits and fused_merge are a run config's fields (ir.Kernel): the split-KV contract."""
    q, P = f64(q), op.page_size
    K = dequantize(k_cache, k_scale) if op.quantized else f64(k_cache)
    V = dequantize(v_cache, v_scale) if op.quantized else f64(v_cache)
    slopes = f64(alibi_slopes) if op.alibi else None
    T, Hq, D = q.shape
    S = num_splits
    o_all, lse_all = np.zeros((S, T, Hq, D)), np.full((S, T, Hq), -np.inf)
    for t in range(T):
        s, L = int(token_seq[t]), int(token_kv_len[t])
        lo, hi = visible_range(op, L)
        for i, (a, b) in enumerate(split_ranges(lo, hi, S)):
            pos = np.arange(a, b)
            pages = np.asarray(page_table[s])[pos // P]
            o_all[i, t], lse_all[i, t] = _attend(op, q[t], K[pages, pos % P], V[pages, pos % P], pos, L, slopes)
    if fused_merge:
        return merge_state(MergeState(Hq, D, S), o_all, lse_all)
    if S > 1:
        return o_all, lse_all
    return o_all[0], lse_all[0]


def merge_state(op: MergeState, o_partial, lse_partial):
    """Returns (out [T,H,D], lse [T,H]) float64."""
    o, lse = f64(o_partial), f64(lse_partial)
    m = lse.max(axis=0)
    safe_m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - safe_m[None])  # exp(-inf) = 0 for empty splits
    denom = w.sum(axis=0)
    out = np.where(denom[..., None] > 0, (w[..., None] * o).sum(axis=0) / np.maximum(denom, 1e-300)[..., None], 0.0)
    return out, np.where(denom > 0, safe_m + np.log(np.maximum(denom, 1e-300)), -np.inf)


# ---------------------------------------------------------------- cache ops
def _store(values: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(values).astype(np.float32).astype(dtype) if values.dtype == np.float64 else values.astype(dtype)


def reshape_and_cache(op: ReshapeAndCache, k, v, slot_mapping, k_cache, v_cache,
                      k_scale=None, v_scale=None, positions=None) -> None:
    """In place: cache[slot // P, slot % P] = k (roped / quantised); slot -1 is skipped."""
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = slots >= 0
    pages, offs = slots[keep] // op.page_size, slots[keep] % op.page_size
    k_in = np.asarray(k)[keep]
    if op.rope:
        k_in = rope(k_in, np.asarray(positions)[keep], op.rope_theta, op.rope_interleaved)
        k_in = k_in.astype(numpy_dtype(op.dtype))  # the roped K is rounded to the input dtype first
    v_in = np.asarray(v)[keep]
    if op.quantized:
        kq, ks = quantize(k_in, op.kv_dtype)
        vq, vs = quantize(v_in, op.kv_dtype)
        k_cache[pages, offs], v_cache[pages, offs] = kq, vq
        k_scale[pages, offs], v_scale[pages, offs] = ks, vs
    else:
        k_cache[pages, offs] = k_in.astype(k_cache.dtype)
        v_cache[pages, offs] = v_in.astype(v_cache.dtype)


def copy_blocks(op: CopyBlocks, kv, mapping, scales=None) -> None:
    """In place over all layers: kv[:, :, dst] = kv[:, :, src] (sources read before writes)."""
    m = np.asarray(mapping).reshape(-1, 2)
    kv[:, :, m[:, 1]] = kv[:, :, m[:, 0]].copy()
    if op.quantized:
        scales[:, :, m[:, 1]] = scales[:, :, m[:, 0]].copy()


def swap_blocks(op: SwapBlocks, src, dst, mapping, src_scales=None, dst_scales=None) -> None:
    m = np.asarray(mapping).reshape(-1, 2)
    dst[:, :, m[:, 1]] = src[:, :, m[:, 0]]
    if op.quantized:
        dst_scales[:, :, m[:, 1]] = src_scales[:, :, m[:, 0]]


# ---------------------------------------------------------------- layer ops
def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> dtype -> float64 (bf16 through float32, as ml_dtypes rounds and common.cuh's round_double)."""
    return f64(np.asarray(x, np.float64).astype(numpy_dtype(dtype)))


def rms_norm(op: RMSNorm, x, weight, residual=None):
    """Returns out [T, E] float64; with op.residual, writes h = dtype(x + residual) into residual in place."""
    h = f64(x)
    if op.residual:
        h = _round(h + f64(residual), op.dtype)
        residual[...] = h.astype(residual.dtype)
    normed = h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + op.eps)
    return _round(normed, op.dtype) * f64(weight)


def silu_and_mul(op: SiluAndMul, x):
    """Returns out [T, I] float64 = dtype(silu(gate)) * up."""
    x = f64(x)
    g, u = x[:, :op.intermediate_size], x[:, op.intermediate_size:]
    return _round(g / (1.0 + np.exp(-g)), op.dtype) * u


def rope_op(op: Rope, x, positions):
    """In place: x = dtype(rope(x, positions)) (reference.rope's math); returns x."""
    x[...] = rope(x, positions, op.rope_theta, op.interleaved, op.freq_factors).astype(x.dtype)
    return x


def run(op, **arrays):
    """Dispatch by kind with keyword arrays named as in op.params(); op may be an ir.Kernel, whose config's
    split fields (signature()) select partials or the merged output."""
    from .ir import Kernel

    extra = {}
    if isinstance(op, Kernel):
        if op.kind == "paged_attention":
            sig = op.signature()
            extra = dict(num_splits=sig.get("num_splits", 1), fused_merge=sig.get("fused_merge", False))
        op = op.op
    fn = {"paged_attention": paged_attention, "merge_state": merge_state, "reshape_and_cache": reshape_and_cache,
          "copy_blocks": copy_blocks, "swap_blocks": swap_blocks, "rms_norm": rms_norm, "silu_and_mul": silu_and_mul,
          "rope": rope_op}[op.kind]
    return fn(op, **arrays, **extra)
