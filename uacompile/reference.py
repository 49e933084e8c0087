"""numpy float64 semantics of every op: the executable spec every lowering is tested on.

Inputs may be any numpy dtype (bf16 / fp8 via ml_dtypes); math is float64, except the
KV quantisation, which is specified in float32 arithmetic so kernels can match it bit
for bit. Functions that write caches work in place, like the kernels.
"""
from __future__ import annotations

import numpy as np

from .ir import (QMAX, WEIGHT_FORMATS, CopyBlocks, Dequantize, GatherTokens, KVScore, MergeState, PagedAttention,
                 QKVRopeCache, QuantizeRows, QuantMatmul, ReshapeAndCache, RMSNorm, Rope, SiluAndMul, SwapBlocks,
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


def gather_tokens(op: GatherTokens, kv, src_slots, dst_slots, scales=None) -> None:
    """In place over all layers and both of K, V: each (layer, KV head)'s source tokens into the destination slots
    (sources read before any write); dst -1 skips."""
    P = op.page_size
    src, dst = np.asarray(src_slots).astype(np.int64), np.asarray(dst_slots).astype(np.int64)
    keep = dst >= 0
    src, dst = src[:, :, keep], dst[keep]
    L, H, N = src.shape
    li, hi = np.arange(L)[:, None, None], np.arange(H)[None, :, None]
    for arr in (kv, scales) if op.quantized else (kv,):
        rows = arr[li, :, src // P, src % P, hi].copy()  # [L, H, N, 2, ...]
        arr[li, :, (dst // P)[None, None, :], (dst % P)[None, None, :], hi] = rows


def kv_score(op: KVScore, q, k_cache, v_cache, query_seq, query_kv_len, page_table, kv_len, max_kv_len=None):
    """Returns scores [num_seqs, Hkv, max_kv_len] float64 (max_kv_len: the scores' length, default max(kv_len))."""
    q, K, V, P = f64(q), f64(k_cache), f64(v_cache), op.page_size
    qs, qlen, lens = np.asarray(query_seq), np.asarray(query_kv_len), np.asarray(kv_len)
    S, Hkv, G, D = len(lens), op.num_kv_heads, op.group_size, op.head_dim
    width = int(max_kv_len if max_kv_len is not None else lens.max(initial=0))
    out = np.full((S, Hkv, width), -np.inf)
    for s in range(S):
        L = int(lens[s])
        pos = np.arange(L)
        pages = np.asarray(page_table[s])[pos // P]
        keys, vals = K[pages, pos % P], V[pages, pos % P]  # [L, Hkv, D]
        ts = np.flatnonzero(qs == s)
        a = np.zeros((Hkv, G, L))
        for t in ts:
            n = int(qlen[t])
            sc = np.einsum("hgd,nhd->hgn", q[t].reshape(Hkv, G, D), keys[:n]) * op.sm_scale
            p = np.exp(sc - sc.max(axis=-1, keepdims=True))
            a[:, :, :n] += p / p.sum(axis=-1, keepdims=True)
        a /= max(1, len(ts))
        if op.method == "attention":
            per_head = a
        elif op.method == "value_norm":
            per_head = a * np.abs(vals).sum(axis=-1).T[:, None, :]
        else:
            o = np.einsum("hgn,nhd->hgd", a, vals)
            norm = np.sqrt((o * o).sum(axis=-1))
            proj = np.einsum("nhd,hgd->hgn", vals, o) / np.where(norm > 0, norm, 1.0)[..., None]
            per_head = np.where(norm[..., None] > 0, a * proj, 0.0)
        out[s, :, :L] = per_head.mean(axis=1)
    return out


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


def qkv_rope_cache(op: QKVRopeCache, qkv, positions, slot_mapping, k_cache, v_cache, q_norm=None, k_norm=None,
                   k_scale=None, v_scale=None):
    """rms_norm of each q / k head (qk_norm), rope of q and k, reshape_and_cache of the rotated K and V, in place;
    returns q_out [T, Hq, D] float64 (dtype values: rope's one rounding)."""
    Hq, Hkv, D, dt = op.num_q_heads, op.num_kv_heads, op.head_dim, numpy_dtype(op.dtype)
    qkv = np.asarray(qkv)
    T = qkv.shape[0]
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    if op.qk_norm:
        norm = RMSNorm(D, op.dtype, op.eps)
        q = rms_norm(norm, q.reshape(T * Hq, D), q_norm).astype(dt).reshape(T, Hq, D)
        k = rms_norm(norm, k.reshape(T * Hkv, D), k_norm).astype(dt).reshape(T, Hkv, D)
    pos = np.asarray(positions)
    q = rope(q, pos, op.rope_theta, op.rope_interleaved, op.freq_factors).astype(dt)
    k = rope(k, pos, op.rope_theta, op.rope_interleaved, op.freq_factors).astype(dt)
    write = ReshapeAndCache(Hkv, D, op.page_size, op.dtype, op.kv_dtype)
    reshape_and_cache(write, k, np.ascontiguousarray(v), slot_mapping, k_cache, v_cache, k_scale, v_scale)
    return f64(q)


# ---------------------------------------------------------------- GGUF weight blocks
def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (the last axis: 2 bytes) as float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of packed 6-bit (scale, min) pairs [n, 12] -> (scales, mins) [n, 8] float32
    (ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 split
    between the nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7)."""
    q = scales.astype(np.uint8)
    lo_sc, lo_m, hi = q[:, 0:4], q[:, 4:8], q[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """[n, bytes] packed nibbles -> [n, 2 * bytes] values: each `chunk` bytes give `chunk` low nibbles, then
    the same bytes' `chunk` high nibbles (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk)
    return np.concatenate([q & 0xF, q >> 4], axis=2).reshape(n, -1)


def dequantize_blocks(weight: np.ndarray, weight_format: str, cols: int) -> np.ndarray:
    """Rows of GGUF blocks [rows, cols / block * nbytes] uint8 -> the weights [rows, cols] float32, in ggml's
    float32 arithmetic (ggml-quants.c's dequantize_row_*; each product rounded in float32, no fused multiply-add)."""
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN / inf scale in the file gives what ggml gives
        return _dequantize_blocks(weight, weight_format, cols)


def _dequantize_blocks(weight, weight_format: str, cols: int) -> np.ndarray:
    fmt = WEIGHT_FORMATS[weight_format]
    w = np.ascontiguousarray(weight, dtype=np.uint8)
    rows = w.shape[0]
    b = w.reshape(-1, fmt.nbytes)  # one block a row
    f32 = np.float32
    if weight_format == "q8_0":
        y = _f16(b[:, 0:2]) * b[:, 2:].view(np.int8).astype(f32)
    elif weight_format == "q4_0":
        y = (_nibbles(b[:, 2:], 16).astype(f32) - f32(8)) * _f16(b[:, 0:2])
    elif weight_format == "q4_1":
        y = _nibbles(b[:, 4:], 16).astype(f32) * _f16(b[:, 0:2]) + _f16(b[:, 2:4])
    elif weight_format in ("q4_k", "q5_k"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = k_scale_min(b[:, 4:16])
        ql = b[:, 48:] if weight_format == "q5_k" else b[:, 16:]
        q = _nibbles(ql, 32).reshape(-1, 8, 32)  # sub-block j = nibbles (j % 2) of bytes 32 * (j // 2) ...
        if weight_format == "q5_k":  # sub-block j's fifth bit: bit j of qh[l]
            qh = b[:, 16:48]
            q = q + (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        y = (d * sc)[:, :, None] * q.astype(f32) - (dmin * m)[:, :, None]
    elif weight_format == "q6_k":
        ql, qh, scales, d = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        # two halves of 128 weights: half h uses ql[64h:64h+64], qh[32h:32h+32]; its four runs of 32 are
        # (ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high) with qh's bit pairs 0, 2, 4, 6
        ql = ql.reshape(-1, 2, 1, 64)
        low = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.int8).astype(f32) - f32(32)  # [n, 2, 4, 32]
        scale = (d * scales.astype(f32)).reshape(-1, 2, 4, 2)  # 16 weights a scale: run r's halves 2r, 2r+1
        y = (scale[..., None] * q.reshape(-1, 2, 4, 2, 16))
    else:
        raise ValueError(f"unknown weight format {weight_format!r}")
    return np.asarray(y, f32).reshape(rows, cols)


def _np_roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), as ggml's reference quantisers."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def quantize_blocks(w: np.ndarray, weight_format: str) -> np.ndarray:
    """Weights [rows, cols] -> GGUF blocks [rows, cols / block * nbytes] uint8, by ggml's reference quantisers
    (quantize_row_*_ref) for q8_0, q4_0 and q4_1 (the formats a checkpoint is quantised to at load)."""
    fmt = WEIGHT_FORMATS[weight_format]
    x = np.asarray(w, np.float32)
    rows = x.shape[0]
    b = x.reshape(-1, fmt.block)
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        if weight_format == "q8_0":
            d = np.abs(b).max(axis=1, keepdims=True) / f32(127)
            q = _np_roundf(b * np.where(d == 0, f32(0), f32(1) / d)).astype(np.int8).view(np.uint8)
            out = np.concatenate([d.astype(np.float16).view(np.uint8), q], axis=1)
        elif weight_format == "q4_0":  # the element of largest magnitude maps to -8
            idx = np.abs(b).argmax(axis=1)
            mx = b[np.arange(len(b)), idx][:, None]
            d = mx / f32(-8)
            q = np.clip(np.trunc(b * np.where(d == 0, f32(0), f32(1) / d) + f32(8.5)), 0, 15).astype(np.uint8)
            out = np.concatenate([d.astype(np.float16).view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)
        elif weight_format == "q4_1":
            lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
            d = (hi - lo) / f32(15)
            q = np.clip(np.trunc((b - lo) * np.where(d == 0, f32(0), f32(1) / d) + f32(0.5)), 0, 15).astype(np.uint8)
            out = np.concatenate([d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8),
                                  q[:, :16] | (q[:, 16:] << 4)], axis=1)
        else:
            raise ValueError(f"quantize_blocks: {weight_format!r} has no quantiser here (q8_0, q4_0, q4_1)")
    return out.reshape(rows, fmt.row_bytes(x.shape[1]))


def quant_matmul(op: QuantMatmul, x, weight):
    """Returns out [T, N] float64 = x @ W^T, W decoded by dequantize_blocks."""
    return f64(x) @ f64(dequantize_blocks(weight, op.weight_format, op.in_features)).T


def dequantize_op(op: Dequantize, weight):
    """Returns out [rows, K] float64 = dtype(W)."""
    return _round(dequantize_blocks(weight, op.weight_format, op.in_features), op.dtype)


def quantize_rows(op: QuantizeRows, x):
    """Returns (out [T, E] in op.out_dtype, scale [T] float32): reference.quantize of each row."""
    return quantize(x, op.out_dtype)


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
          "copy_blocks": copy_blocks, "swap_blocks": swap_blocks, "gather_tokens": gather_tokens, "kv_score": kv_score,
          "rms_norm": rms_norm, "silu_and_mul": silu_and_mul,
          "rope": rope_op, "qkv_rope_cache": qkv_rope_cache, "quant_matmul": quant_matmul, "dequantize": dequantize_op,
          "quantize_rows": quantize_rows}[op.kind]
    return fn(op, **arrays, **extra)
