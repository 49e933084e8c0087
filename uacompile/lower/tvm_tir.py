"""TIR helpers the generators share (tvm_attention, tvm_cache_ops): buffer alignment, lanes per
row, and the PrimExprs both targets use (quantised-KV decode/encode, score transforms, the merge
of split partials). tvm is imported lazily.
"""
from __future__ import annotations

import math

from ..ir import DTYPES

# Tensors come from numpy / torch, often as views into a cache (element-aligned only): never
# let codegen assume TVM's default 64-byte buffer alignment (aligned AVX loads would fault).
ALIGN = 1


FULL = 0xFFFFFFFF  # every lane of a warp (shuffle masks)


def loops(gpu: bool):
    """(grid x, grid y, lanes) loop constructors: blockIdx / threadIdx bindings on CUDA; on the CPU a parallel
    loop, a serial one, and lanes that collapse to one (callers pick TX = 1)."""
    from tvm.script import tirx as T

    if gpu:
        return (lambda e: T.thread_binding(e, thread="blockIdx.x"), lambda e: T.thread_binding(e, thread="blockIdx.y"),
                lambda e: T.thread_binding(e, thread="threadIdx.x"))
    return T.parallel, T.serial, T.serial



def lanes_for(head_dim: int, max_lanes: int = 32) -> int:
    """Threads that share one row of head_dim on the GPU: the largest power of two <= 32 dividing it."""
    tx = 1
    while tx * 2 <= max_lanes and head_dim % (tx * 2) == 0:
        tx *= 2
    return tx


def load_f32(dtype: str, value):
    """A stored KV/q element as float32 (fp8 e4m3fn decoded from its byte)."""
    from tvm import tirx

    if dtype != "fp8_e4m3":
        return tirx.Cast("float32", value)
    u = tirx.Cast("uint32", value)
    e = (u >> tirx.const(3, "uint32")) & tirx.const(15, "uint32")
    m = u & tirx.const(7, "uint32")
    normal = tirx.reinterpret("float32", ((e + tirx.const(120, "uint32")) << tirx.const(23, "uint32"))
                              | (m << tirx.const(20, "uint32")))
    sub = tirx.Cast("float32", m) * tirx.const(2.0 ** -9, "float32")
    mag = tirx.Select(e > tirx.const(0, "uint32"), normal, sub)
    return tirx.Select((u & tirx.const(0x80, "uint32")) != tirx.const(0, "uint32"), -mag, mag)


def quantize_f32(kv_dtype: str, y):
    """float32 y (already divided by its scale) -> stored int8 / fp8 byte, rounding as reference.quantize:
    int8 nearest-even clamped to +-127; fp8 e4m3fn nearest-even saturating at 448."""
    from tvm import tirx

    if kv_dtype == "int8":
        r = tirx.max(tirx.min(tirx.nearbyint(y), tirx.const(127.0, "float32")), tirx.const(-127.0, "float32"))
        return tirx.Cast("int8", r)
    c = tirx.max(tirx.min(y, tirx.const(448.0, "float32")), tirx.const(-448.0, "float32"))
    u = tirx.reinterpret("uint32", c)
    sign = (u >> tirx.const(24, "uint32")) & tirx.const(0x80, "uint32")
    a = u & tirx.const(0x7FFFFFFF, "uint32")
    # subnormal e4m3 (|y| < 2^-6): multiples of 2^-9; 8 * 2^-9 rounds up into the first normal (code 8)
    sub = tirx.Cast("uint32", tirx.nearbyint(tirx.reinterpret("float32", a) * tirx.const(512.0, "float32")))
    # normal: round the float32 mantissa to 3 bits (nearest-even), then rebias the exponent 127 -> 7
    r = a + tirx.const(0x7FFFF, "uint32") + ((a >> tirx.const(20, "uint32")) & tirx.const(1, "uint32"))
    normal = (r >> tirx.const(20, "uint32")) - tirx.const(960, "uint32")
    code = tirx.Select(a < tirx.const(0x3C800000, "uint32"), sub, normal)
    return tirx.Cast("uint8", sign | code)


def transform_score(op, score, h, j, kv_len, alibi_slopes=None):
    """Soft-cap, then ALiBi, on an already-scaled float32 score (see DESIGN.md)."""
    from tvm import tirx

    if op.softcap:
        cap = tirx.const(op.softcap, "float32")
        score = cap * tirx.tanh(score / cap)
    if op.alibi:
        # j and kv_len are int64 expressions
        score = score + alibi_slopes[h] * tirx.Cast("float32", j - kv_len + tirx.const(1, "int64"))
    return score


def neg_inf():
    from tvm import tirx

    return tirx.const(-math.inf, "float32")


def merge_row_macro(num_splits: int, out_dtype: str, with_lse: bool):
    """T.macro merge_row(o_partial, lse_partial, out, lse, st, acc, t, h, d0, n): out[t, h, d0:d0+n]
    (and lse[t, h] where d0 == 0) from the split partials, weighted by exp(lse - max): merge_state's
    math, shared by the merge_state kernel and fused-merge attention. st holds 4 floats, acc n."""
    from tvm.script import tirx as T

    S, odt, NEG = num_splits, DTYPES[out_dtype].tir, neg_inf()

    @T.macro
    def merge_row(o_partial, lse_partial, out, lse, st, acc, t, h, d0, n):
        st[0] = NEG
        for i in T.serial(S):
            st[0] = T.max(st[0], lse_partial[i, t, h])
        st[1] = T.float32(0)
        for v in T.serial(n):
            acc[v] = T.float32(0)
        for i in T.serial(S):
            if lse_partial[i, t, h] > NEG:  # empty splits carry no weight (and maybe no data)
                st[2] = T.exp(lse_partial[i, t, h] - st[0])
                st[1] = st[1] + st[2]
                for v in T.serial(n):
                    acc[v] = acc[v] + st[2] * o_partial[i, t, h, d0 + v]
        st[3] = T.Select(st[1] > T.float32(0), T.float32(1) / st[1], T.float32(0))
        for v in T.serial(n):
            out[t, h, d0 + v] = T.Cast(odt, acc[v] * st[3])
        if with_lse and d0 == 0:
            lse[t, h] = T.Select(st[1] > T.float32(0), st[0] + T.log(st[1]), NEG)

    return merge_row


def rope_cos_sin(i, pos, theta: float, head_dim: int, freq_factors=()):
    """cos and sin (float64) of RoPE pair i at position pos: angle = pos * inv_freq[i], inv_freq[i] =
    1 / theta^(2i / D) in float64 (divided by freq_factors[i] when given), reference.rope_inv_freq's expression."""
    from tvm import tirx

    expo = tirx.Cast("float64", 2 * i) / tirx.const(float(head_dim), "float64")
    inv_freq = tirx.const(1.0, "float64") / tirx.pow(tirx.const(theta, "float64"), expo)
    if freq_factors:  # the factor of pair i, picked from constants
        factor = tirx.const(freq_factors[-1], "float64")
        for j in range(len(freq_factors) - 2, -1, -1):
            factor = tirx.Select(i == j, tirx.const(freq_factors[j], "float64"), factor)
        inv_freq = inv_freq / factor
    ang = tirx.Cast("float64", pos) * inv_freq
    return tirx.cos(ang), tirx.sin(ang)
