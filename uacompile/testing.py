"""Random inputs for every op, shared by the tests of every lowering (TVM, CUDA, AscendC).

All arrays are numpy, keyed by the op's parameter names (ir.OpSpec.params()); sizes
are included as ints. Page tables are scattered and non-monotonic; entries past a
sequence's pages are -1 (kernels must never read them). Outputs are not included:
callers allocate and poison them.
"""
from __future__ import annotations

import math

import numpy as np

from . import reference
from .ir import (QUANT_DTYPES, WEIGHT_FORMATS, CopyBlocks, Dequantize, GatherTokens, KVScore, QuantMatmul, MergeState, PagedAttention, QKVRopeCache, ReshapeAndCache, RMSNorm, Rope, SiluAndMul,
                 SwapBlocks, numpy_dtype)


def random_floats(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(numpy_dtype(dtype))


def random_cache(rng, shape, kv_dtype: str, scale: float = 1.0):
    """A KV cache full of data (never zeros) and, when quantised, its scales."""
    if kv_dtype in QUANT_DTYPES:
        return reference.quantize(rng.standard_normal(shape).astype(np.float32) * scale, kv_dtype)
    return random_floats(rng, shape, kv_dtype, scale), None


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes (for a power-of-two head count)."""
    n = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8 * (i + 1) / n) for i in range(n)]
    extra = [2 ** (-4 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return np.array(base + extra, dtype=np.float32)


def scattered_page_table(rng, kv_lens, page_size: int, extra_pages: int = 3):
    """Each sequence gets ceil(len/P) distinct pages drawn from a shuffled pool."""
    need = [max(1, -(-int(n) // page_size)) for n in kv_lens]
    num_pages = sum(need) + extra_pages
    pool = rng.permutation(num_pages)
    table = np.full((len(kv_lens), max(need)), -1, dtype=np.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = pool[at:at + n]
        at += n
    return table, num_pages


def ubatch(kv_lens, q_lens):
    """token_seq and token_kv_len for a mixed ubatch: sequence s contributes q_lens[s]
    query tokens, the last chunk of its kv_lens[s] positions (q_len 1 = decode)."""
    token_seq, token_kv_len = [], []
    for s, (L, n) in enumerate(zip(kv_lens, q_lens)):
        assert 1 <= n <= L, (n, L)
        token_seq += [s] * n
        token_kv_len += list(range(L - n + 1, L + 1))
    return np.array(token_seq, np.int32), np.array(token_kv_len, np.int32)


def attention_inputs(op: PagedAttention, rng, kv_lens, q_lens=None) -> dict:
    q_lens = q_lens or [1] * len(kv_lens)
    token_seq, token_kv_len = ubatch(kv_lens, q_lens)
    table, num_pages = scattered_page_table(rng, kv_lens, op.page_size)
    T, Hkv, D, P = len(token_seq), op.num_kv_heads, op.head_dim, op.page_size
    k, ks = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    v, vs = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    d = dict(q=random_floats(rng, (T, op.num_q_heads, D), op.q_dtype), k_cache=k, v_cache=v,
             token_seq=token_seq, page_table=table, token_kv_len=token_kv_len,
             num_tokens=T, num_seqs=len(kv_lens), max_pages=table.shape[1], num_pages=num_pages)
    if op.quantized:
        d.update(k_scale=ks, v_scale=vs)
    if op.alibi:
        d["alibi_slopes"] = alibi_slopes(op.num_q_heads)
    return d


def reshape_and_cache_inputs(op: ReshapeAndCache, rng, num_tokens: int, num_pages: int, skip_every: int = 5) -> dict:
    """Distinct random slots; every skip_every-th token is padding (slot -1)."""
    P, Hkv, D = op.page_size, op.num_kv_heads, op.head_dim
    slots = rng.choice(num_pages * P, size=num_tokens, replace=False).astype(np.int64)
    if skip_every:
        slots[::skip_every] = -1
    kc, ksc = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    vc, vsc = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    d = dict(k=random_floats(rng, (num_tokens, Hkv, D), op.dtype), v=random_floats(rng, (num_tokens, Hkv, D), op.dtype),
             slot_mapping=slots, k_cache=kc, v_cache=vc, num_tokens=num_tokens, num_pages=num_pages)
    if op.rope:
        d["positions"] = rng.integers(0, 4096, size=num_tokens).astype(np.int64)
    if op.quantized:
        d.update(k_scale=ksc, v_scale=vsc)
    return d


def block_mapping(rng, num_pages: int, num_pairs: int) -> np.ndarray:
    """(src, dst) pairs with distinct destinations that are never also sources."""
    perm = rng.permutation(num_pages)
    return np.stack([perm[:num_pairs], perm[num_pairs:2 * num_pairs]], axis=1).astype(np.int64)


def copy_blocks_inputs(op: CopyBlocks, rng, num_layers: int, num_pages: int, num_pairs: int) -> dict:
    P, Hkv, D = op.page_size, op.num_kv_heads, op.head_dim
    kv, scales = random_cache(rng, (num_layers, 2, num_pages, P, Hkv, D), op.kv_dtype)
    d = dict(kv=kv, mapping=block_mapping(rng, num_pages, num_pairs),
             num_layers=num_layers, num_pages=num_pages, num_pairs=num_pairs)
    if op.quantized:
        d["scales"] = scales
    return d


def swap_blocks_inputs(op: SwapBlocks, rng, num_layers: int, num_src_pages: int, num_dst_pages: int, num_pairs: int) -> dict:
    P, Hkv, D = op.page_size, op.num_kv_heads, op.head_dim
    src, ss = random_cache(rng, (num_layers, 2, num_src_pages, P, Hkv, D), op.kv_dtype)
    dst, ds = random_cache(rng, (num_layers, 2, num_dst_pages, P, Hkv, D), op.kv_dtype)
    mapping = np.stack([rng.choice(num_src_pages, num_pairs, replace=False),
                        rng.choice(num_dst_pages, num_pairs, replace=False)], axis=1).astype(np.int64)
    d = dict(src=src, dst=dst, mapping=mapping, num_layers=num_layers, num_src_pages=num_src_pages,
             num_dst_pages=num_dst_pages, num_pairs=num_pairs)
    if op.quantized:
        d.update(src_scales=ss, dst_scales=ds)
    return d


def gather_tokens_inputs(op: GatherTokens, rng, num_layers: int, num_src_pages: int, num_tokens: int,
                         skip_every: int = 4) -> dict:
    """Each (layer, KV head) gathers its own random source tokens from the first num_src_pages pages into fresh
    destination pages after them (never sources), in scattered order; every skip_every-th destination is -1."""
    P, Hkv, D = op.page_size, op.num_kv_heads, op.head_dim
    num_dst_pages = -(-num_tokens // P) + 1
    num_pages = num_src_pages + num_dst_pages
    kv, scales = random_cache(rng, (num_layers, 2, num_pages, P, Hkv, D), op.kv_dtype)
    src = np.stack([np.stack([rng.choice(num_src_pages * P, num_tokens, replace=False) for _ in range(Hkv)])
                    for _ in range(num_layers)]).astype(np.int64)
    dst = (num_src_pages * P + rng.permutation(num_dst_pages * P)[:num_tokens]).astype(np.int64)
    if skip_every:
        dst[::skip_every] = -1
    d = dict(kv=kv, src_slots=src, dst_slots=dst, num_layers=num_layers, num_pages=num_pages, num_tokens=num_tokens)
    if op.quantized:
        d["scales"] = scales
    return d


def kv_score_inputs(op: KVScore, rng, kv_lens, windows, max_kv_len: int | None = None) -> dict:
    """Sequence s scores kv_lens[s] positions with a window of its last windows[s] queries (0: none); the queries
    interleave across sequences. Keys and queries are scaled so the softmax is peaked, not uniform."""
    seq, qlen = [], []
    for s, (L, w) in enumerate(zip(kv_lens, windows)):
        seq += [s] * w
        qlen += list(range(L - w + 1, L + 1))
    order = rng.permutation(len(seq))
    seq, qlen = np.array(seq, np.int32)[order], np.array(qlen, np.int32)[order]
    table, num_pages = scattered_page_table(rng, kv_lens, op.page_size)
    P, Hkv, D = op.page_size, op.num_kv_heads, op.head_dim
    return dict(q=random_floats(rng, (len(seq), op.num_q_heads, D), op.q_dtype, 2.0),
                k_cache=random_floats(rng, (num_pages, P, Hkv, D), op.kv_dtype, 2.0),
                v_cache=random_floats(rng, (num_pages, P, Hkv, D), op.kv_dtype), query_seq=seq, query_kv_len=qlen,
                page_table=table, kv_len=np.array(kv_lens, np.int32), num_queries=len(seq), num_pages=num_pages,
                num_seqs=len(kv_lens), max_pages=table.shape[1], max_kv_len=max_kv_len or max(kv_lens))


def merge_state_inputs(op: MergeState, rng, num_tokens: int, empty_fraction: float = 0.2) -> dict:
    S, H, D = op.num_splits, op.num_heads, op.head_dim
    lse = (rng.standard_normal((S, num_tokens, H)) * 3).astype(np.float32)
    empty = rng.random((S, num_tokens, H)) < empty_fraction
    lse[empty] = -np.inf
    o = rng.standard_normal((S, num_tokens, H, D)).astype(np.float32)
    o[empty] = 0
    return dict(o_partial=o, lse_partial=lse, num_tokens=num_tokens)


def rms_norm_inputs(op: RMSNorm, rng, num_tokens: int) -> dict:
    """Rows of varied scale (0.01 to 100: the norm must not depend on it); weights around 1; a residual of
    the same scale as x when op.residual."""
    E = op.hidden_size
    row_scale = np.exp(rng.uniform(np.log(0.01), np.log(100.0), size=(num_tokens, 1)))
    d = dict(x=random_floats(rng, (num_tokens, E), "fp32") * row_scale,
             weight=random_floats(rng, E, "fp32", 0.3) + 1, num_tokens=num_tokens)
    if op.residual:
        d["residual"] = random_floats(rng, (num_tokens, E), "fp32") * row_scale
    return {k: v.astype(np.float32).astype(numpy_dtype(op.dtype)) if isinstance(v, np.ndarray) else v
            for k, v in d.items()}


def silu_and_mul_inputs(op: SiluAndMul, rng, num_tokens: int) -> dict:
    """Gates over [-12, 12] (silu's tails and its minimum) and unit-variance up projections."""
    I = op.intermediate_size  # noqa: E741
    gate = rng.uniform(-12, 12, size=(num_tokens, I))
    up = rng.standard_normal((num_tokens, I))
    x = np.concatenate([gate, up], axis=1).astype(np.float32).astype(numpy_dtype(op.dtype))
    return dict(x=x, num_tokens=num_tokens)


def rope_inputs(op: Rope, rng, num_tokens: int, max_position: int = 1 << 17) -> dict:
    """Positions up to max_position (long-context angles, where float32 angles would go wrong), 0 included."""
    positions = rng.integers(0, max_position, size=num_tokens).astype(np.int64)
    positions[0] = 0
    return dict(x=random_floats(rng, (num_tokens, op.num_heads, op.head_dim), op.dtype), positions=positions,
                num_tokens=num_tokens)


def qkv_rope_cache_inputs(op: QKVRopeCache, rng, num_tokens: int, num_pages: int | None = None,
                          max_position: int = 1 << 17) -> dict:
    """Heads of varied scale (0.01 to 100 a head: the norm must not depend on it), norm weights around 1, long
    positions, a full cache (random data, never zeros) and a shuffled slot_mapping with a padding slot (-1)."""
    Hq, Hkv, D, P = op.num_q_heads, op.num_kv_heads, op.head_dim, op.page_size
    num_pages = num_pages or -(-num_tokens // P) + 2
    head_scale = np.exp(rng.uniform(np.log(0.01), np.log(100.0), size=(num_tokens, Hq + 2 * Hkv, 1)))
    qkv = (random_floats(rng, (num_tokens, Hq + 2 * Hkv, D), "fp32") * head_scale).astype(np.float32)
    positions = rng.integers(0, max_position, size=num_tokens).astype(np.int64)
    positions[0] = 0
    slots = rng.choice(num_pages * P, size=num_tokens, replace=False).astype(np.int64)
    if num_tokens > 1:
        slots[rng.integers(num_tokens)] = -1
    k_cache, k_scale = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    v_cache, v_scale = random_cache(rng, (num_pages, P, Hkv, D), op.kv_dtype)
    d = dict(qkv=qkv.astype(numpy_dtype(op.dtype)), positions=positions, slot_mapping=slots, k_cache=k_cache,
             v_cache=v_cache, num_tokens=num_tokens, num_pages=num_pages)
    if op.qk_norm:
        d["q_norm"] = (random_floats(rng, D, "fp32", 0.3) + 1).astype(numpy_dtype(op.dtype))
        d["k_norm"] = (random_floats(rng, D, "fp32", 0.3) + 1).astype(numpy_dtype(op.dtype))
    if op.quantized:
        d.update(k_scale=k_scale, v_scale=v_scale)
    return d


def random_quant_weight(rng, weight_format: str, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
    """Rows of GGUF blocks [rows, cols / block * nbytes] uint8: random quants (every bit pattern), fp16 scale
    fields drawn so the weights come out of order `scale` (signed d and minimums: every sign case)."""
    fmt = WEIGHT_FORMATS[weight_format]
    raw = rng.integers(0, 256, size=(rows, fmt.row_bytes(cols)), dtype=np.uint8)
    b = raw.reshape(-1, fmt.nbytes)
    qrange = {"q8_0": 64, "q4_0": 4, "q4_1": 8, "q4_k": 8 * 32, "q5_k": 16 * 32, "q6_k": 16 * 64}[weight_format]

    def put(offset, magnitude):
        v = (rng.uniform(0.5, 1.5, len(b)) * rng.choice([-1.0, 1.0], len(b)) * magnitude).astype(np.float16)
        b[:, offset:offset + 2] = v.view(np.uint8).reshape(-1, 2)

    d_at = 208 if weight_format == "q6_k" else 0
    put(d_at, scale / qrange)
    if weight_format in ("q4_1", "q4_k", "q5_k"):  # the minimum: m (q4_1) or dmin (times a 6-bit min)
        put(2, scale * (1.0 if weight_format == "q4_1" else 1.0 / 32))
    return raw


def quant_matmul_inputs(op: QuantMatmul, rng, num_tokens: int) -> dict:
    """Unit-variance activations in op.dtype and random packed weights (random_quant_weight)."""
    return dict(x=random_floats(rng, (num_tokens, op.in_features), op.dtype),
                weight=random_quant_weight(rng, op.weight_format, op.out_features, op.in_features),
                num_tokens=num_tokens)


def dequantize_inputs(op: Dequantize, rng, num_rows: int) -> dict:
    return dict(weight=random_quant_weight(rng, op.weight_format, num_rows, op.in_features), num_rows=num_rows)


def matmul_error(out, want) -> float:
    """||out - want|| / ||want|| over the whole output (float64): a float32-accumulated matmul lands near 1e-6
    before its output is rounded; the rounding adds fp16's 3e-4 or bf16's 2.3e-3 (relative, rms)."""
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30))


def matmul_tolerance(dtype: str) -> float:
    """The largest matmul_error accepted for outputs in dtype (twice the rounding's share)."""
    return {"fp32": 1e-5, "fp16": 1e-3, "bf16": 6e-3}[dtype]


def layer_tolerance(dtype: str) -> float:
    """Relative tolerance of the layer ops (rms_norm, silu_and_mul) against the float64 reference: a kernel in
    float32 may round an intermediate (the normalised row, silu) the other way, one ulp of dtype, before the
    last product."""
    return {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}[dtype]


def tolerance(dtype: str, kv_dtype: str | None = None) -> float:
    """Absolute tolerance on attention outputs of unit-variance data."""
    tol = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}[dtype]
    return max(tol, {"int8": 3e-2, "fp8_e4m3": 1.2e-1}.get(kv_dtype, 0.0))
