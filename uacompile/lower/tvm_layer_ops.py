"""TIR for the layer ops (rms_norm, silu_and_mul, rope): one generator per op serves both targets.

As in tvm_cache_ops: on CUDA a block is one token (rope: one token and head) and TX lanes share its row,
reducing by warp shuffles; on the CPU a block is one parallel task and its lanes collapse to one (TX = 1).
Arithmetic follows the reference's order of roundings (reference.rms_norm, silu_and_mul, rope_op):
float32 for the norm and SiLU, float64 for RoPE's angles and rotation.
"""
from __future__ import annotations

from ..ir import DTYPES, RMSNorm, Rope, SiluAndMul
from .tvm_tir import ALIGN, FULL, lanes_for, loops, rope_cos_sin


def rms_norm(op: RMSNorm, gpu: bool):
    """out = dtype(dtype(h * rstd) * weight), h = x or dtype(x + residual) (written back to residual)."""
    from tvm import tirx
    from tvm.script import tirx as T

    E, dt, with_residual = op.hidden_size, DTYPES[op.dtype].tir, op.residual
    TX = lanes_for(E) if gpu else 1
    VEC, NSH = E // TX, TX.bit_length() - 1
    grid_x, _, lanes = loops(gpu)
    f32 = lambda v: tirx.Cast("float32", v)  # noqa: E731

    @T.prim_func
    def kernel(x_h: T.handle, r_h: T.handle, w_h: T.handle, o_h: T.handle, num_tokens: T.int64):
        x = T.match_buffer(x_h, (num_tokens, E), dt, align=ALIGN)
        residual = T.match_buffer(r_h, (num_tokens, E), dt, align=ALIGN)
        weight = T.match_buffer(w_h, (E,), dt, align=ALIGN)
        out = T.match_buffer(o_h, (num_tokens, E), dt, align=ALIGN)
        for bt in grid_x(num_tokens):
            for tx in lanes(TX):
                st = T.alloc_buffer((2,), "float32", scope="local")  # sum of squares, rstd
                t: T.let[T.int64] = T.Cast("int64", bt)
                st[0] = T.float32(0)
                for v in T.serial(VEC):
                    if with_residual:
                        residual[t, tx * VEC + v] = T.Cast(dt, f32(x[t, tx * VEC + v]) + f32(residual[t, tx * VEC + v]))
                        st[0] = st[0] + f32(residual[t, tx * VEC + v]) * f32(residual[t, tx * VEC + v])
                    else:
                        st[0] = st[0] + f32(x[t, tx * VEC + v]) * f32(x[t, tx * VEC + v])
                for r in T.unroll(NSH):
                    st[0] = st[0] + T.tvm_warp_shuffle_xor(FULL, st[0], (TX // 2) >> r, TX, 32)
                st[1] = T.float32(1) / T.sqrt(st[0] / T.float32(E) + T.float32(op.eps))
                for v in T.serial(VEC):
                    if with_residual:
                        out[t, tx * VEC + v] = T.Cast(dt, f32(T.Cast(dt, f32(residual[t, tx * VEC + v]) * st[1]))
                                                      * f32(weight[tx * VEC + v]))
                    else:
                        out[t, tx * VEC + v] = T.Cast(dt, f32(T.Cast(dt, f32(x[t, tx * VEC + v]) * st[1]))
                                                      * f32(weight[tx * VEC + v]))

    return kernel


def silu_and_mul(op: SiluAndMul, gpu: bool):
    """out = dtype(dtype(silu(gate)) * up), silu in float32."""
    from tvm import tirx
    from tvm.script import tirx as T

    I, dt = op.intermediate_size, DTYPES[op.dtype].tir  # noqa: E741
    TX = lanes_for(I) if gpu else 1
    VEC = I // TX
    grid_x, _, lanes = loops(gpu)
    f32 = lambda v: tirx.Cast("float32", v)  # noqa: E731

    @T.prim_func
    def kernel(x_h: T.handle, o_h: T.handle, num_tokens: T.int64):
        x = T.match_buffer(x_h, (num_tokens, 2 * I), dt, align=ALIGN)
        out = T.match_buffer(o_h, (num_tokens, I), dt, align=ALIGN)
        for bt in grid_x(num_tokens):
            for tx in lanes(TX):
                t: T.let[T.int64] = T.Cast("int64", bt)
                for v in T.serial(VEC):
                    out[t, tx * VEC + v] = T.Cast(dt, f32(T.Cast(dt, f32(x[t, tx * VEC + v])
                                                                 / (T.float32(1) + T.exp(-f32(x[t, tx * VEC + v])))))
                                                  * f32(x[t, I + tx * VEC + v]))

    return kernel


def rope(op: Rope, gpu: bool):
    """In place: each pair (a, b) of x[t, h] -> (a*cos - b*sin, b*cos + a*sin) in float64, rounded to dtype."""
    from tvm import tirx
    from tvm.script import tirx as T

    H, D, dt = op.num_heads, op.head_dim, DTYPES[op.dtype].tir
    HALF = D // 2
    TX = lanes_for(HALF) if gpu else 1
    VEC = HALF // TX
    grid_x, grid_y, lanes = loops(gpu)
    f64 = lambda v: tirx.Cast("float64", v)  # noqa: E731
    first = (lambda i: 2 * i) if op.interleaved else (lambda i: i)  # the pair's elements
    second = (lambda i: 2 * i + 1) if op.interleaved else (lambda i: i + HALF)

    @T.prim_func
    def kernel(x_h: T.handle, p_h: T.handle, num_tokens: T.int64):
        x = T.match_buffer(x_h, (num_tokens, H, D), dt, align=ALIGN)
        positions = T.match_buffer(p_h, (num_tokens,), "int64", align=ALIGN)
        for bt in grid_x(num_tokens):
            for bh in grid_y(H):
                for tx in lanes(TX):
                    ab = T.alloc_buffer((4,), "float64", scope="local")  # a, b, cos, sin
                    t: T.let[T.int64] = T.Cast("int64", bt)
                    h: T.let[T.int64] = T.Cast("int64", bh)
                    for v in T.serial(VEC):
                        ab[0] = f64(x[t, h, first(tx * VEC + v)])
                        ab[1] = f64(x[t, h, second(tx * VEC + v)])
                        ab[2] = rope_cos_sin(tx * VEC + v, positions[t], op.rope_theta, D, op.freq_factors)[0]
                        ab[3] = rope_cos_sin(tx * VEC + v, positions[t], op.rope_theta, D, op.freq_factors)[1]
                        x[t, h, first(tx * VEC + v)] = T.Cast(dt, ab[0] * ab[2] - ab[1] * ab[3])
                        x[t, h, second(tx * VEC + v)] = T.Cast(dt, ab[1] * ab[2] + ab[0] * ab[3])

    return kernel


__all__ = ["rms_norm", "silu_and_mul", "rope"]
