"""TIR for the GGUF block-quantised weight ops (quant_matmul, dequantize): CPU (LLVM) kernels.

Every format splits a block into runs of 16 consecutive weights whose quant values are one vector expression of
the block's bytes (lane l of run r: byte offset + l, shifted and masked), and each run belongs to a scale group
(q8_0 / q4_0 / q4_1: the whole block; q4_k / q5_k: a 32-weight sub-block; q6_k: the run itself). A weight is
w = A_g * q + B_g over its group's A_g, B_g (scale, offset: q4_1's d and m, Q4_K's d * sc and -dmin * m, ...).

quant_matmul: out[t, n] = sum_g A_g * (x_g . q_g) + B_g * sum(x_g): each parallel task takes `rows` output rows
and a tile of `token_tile` tokens at a time; it sums x over each group of the tile once, then per row and group
decodes the group's quants into 16-lane float32 vectors once, multiplies them into the tile's tokens and
accumulates A_g * partial in 16 float32 lanes a token (B_g * sum(x_g) in one scalar a token), in float32. One
token (decode) takes a copy of the loops with a tile of one; in the formats with an offset B it decodes
DECODE_ROW_GROUP rows side by side (their independent sums overlap), each row's sums in the same order.
dequantize: out[r, k] = dtype(w) in the reference's float32 arithmetic (reference.dequantize_blocks: every
product in it is exact in float32, so the one rounding is the add, as in ggml), one parallel task a row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import DTYPES, Kernel, WEIGHT_FORMATS
from .config import schedule_of
from .tvm_tir import ALIGN

LANES = 16  # weights a run (every format's runs are 16 consecutive weights)
# the schedule's rules where the TVMConfig leaves a knob at 0
MATMUL_ROWS = 32  # output rows a parallel task (at most N)
TOKEN_TILE = 4  # tokens a decoded group of weights is multiplied into
DEQUANT_ROWS = 8  # rows a dequantize task
DECODE_ROW_GROUP = 4  # rows one token's matmul decodes side by side, in the formats with an offset B


@dataclass(frozen=True)
class BlockLayout:
    """How one format's block decodes, as TIR expressions over the weight buffer W at row n, block byte bb.

    runs: runs of 16 weights a block; group_runs: runs a scale group; quant(W, n, bb, r, l): the int32 quant of
    lane l of run r; scales(W, n, bb, g, hd): (A, B) float32 of group g, w = A * q + B (matmul form), hd(i) the
    block's fp16 header field i as float32; weight(W, n, bb, r, l): w in the reference's order of float32
    operations (dequantize); header: (first, count) of the block's fp16 fields (d, and m or dmin) counted in
    fp16 units, which quant_matmul loads as one vector a block."""

    runs: int
    group_runs: int
    quant: Callable
    scales: Callable
    weight: Callable
    header: tuple

    @property
    def groups(self) -> int:
        return self.runs // self.group_runs


def _layout(fmt: str) -> BlockLayout:
    from tvm import tirx

    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    f32c = lambda v: tirx.const(v, "float32")  # noqa: E731

    def byte(W, n, i):  # W[n, i] as uint32
        return tirx.Cast("uint32", W[n, i])

    def half(W, n, i):  # the little-endian fp16 field at W[n, i:i+2], as float32
        bits = tirx.Cast("uint16", byte(W, n, i) | (byte(W, n, i + 1) << u32(8)))
        return tirx.Cast("float32", tirx.reinterpret("float16", bits))

    def f32(v):
        return tirx.Cast("float32", v)

    def i32(v):
        return tirx.Cast("int32", v)

    if fmt == "q8_0":
        def quant(W, n, bb, r, l):
            return i32(tirx.Cast("int8", W[n, bb + 2 + 16 * r + l]))

        def scales(W, n, bb, g, hd):
            return hd(0), f32c(0.0)

        def weight(W, n, bb, r, l):
            return half(W, n, bb) * f32(quant(W, n, bb, r, l))

        return BlockLayout(2, 2, quant, scales, weight, (0, 1))
    if fmt in ("q4_0", "q4_1"):
        qs = 2 if fmt == "q4_0" else 4

        def quant(W, n, bb, r, l):  # run 0: the 16 bytes' low nibbles, run 1: their high ones
            return i32((byte(W, n, bb + qs + l) >> tirx.Cast("uint32", 4 * r)) & u32(15))

        if fmt == "q4_0":
            def scales(W, n, bb, g, hd):
                return hd(0), f32c(-8.0) * hd(0)

            def weight(W, n, bb, r, l):
                return (f32(quant(W, n, bb, r, l)) - f32c(8.0)) * half(W, n, bb)
        else:
            def scales(W, n, bb, g, hd):
                return hd(0), hd(1)

            def weight(W, n, bb, r, l):
                return f32(quant(W, n, bb, r, l)) * half(W, n, bb) + half(W, n, bb + 2)

        return BlockLayout(2, 2, quant, scales, weight, (0, 1 if fmt == "q4_0" else 2))
    if fmt in ("q4_k", "q5_k"):
        ql = 48 if fmt == "q5_k" else 16

        def sc_m(W, n, bb, j):  # ggml's get_scale_min_k4 of sub-block j (0..7) from the 12 bytes at bb + 4
            lo = lambda i: byte(W, n, bb + 4 + i)  # noqa: E731
            jj = tirx.floormod(j, 4)
            sc = tirx.Select(j < 4, lo(jj) & u32(63), (lo(8 + jj) & u32(15)) | ((lo(jj) >> u32(6)) << u32(4)))
            m = tirx.Select(j < 4, lo(4 + jj) & u32(63), (lo(8 + jj) >> u32(4)) | ((lo(4 + jj) >> u32(6)) << u32(4)))
            return f32(sc), f32(m)

        def quant(W, n, bb, r, l):  # sub-block j = r // 2: nibble j % 2 of bytes 32 * (j // 2) + 16 * (r % 2) + l
            j = tirx.floordiv(r, 2)
            e = 16 * tirx.floormod(r, 2) + l  # the weight within its sub-block
            q = (byte(W, n, bb + ql + 32 * tirx.floordiv(j, 2) + e) >> tirx.Cast("uint32", 4 * tirx.floormod(j, 2))) & u32(15)
            if fmt == "q5_k":  # the fifth bit: bit j of qh[e]
                q = q | (((byte(W, n, bb + 16 + e) >> tirx.Cast("uint32", j)) & u32(1)) << u32(4))
            return i32(q)

        def scales(W, n, bb, g, hd):
            sc, m = sc_m(W, n, bb, g)
            return hd(0) * sc, f32c(0.0) - hd(1) * m

        def weight(W, n, bb, r, l):
            sc, m = sc_m(W, n, bb, tirx.floordiv(r, 2))
            return (half(W, n, bb) * sc) * f32(quant(W, n, bb, r, l)) - half(W, n, bb + 2) * m

        return BlockLayout(16, 2, quant, scales, weight, (0, 2))
    if fmt == "q6_k":
        def quant(W, n, bb, r, l):
            # half h = r // 8 of 128 weights; its run of 32 rr = (r % 8) // 2 (ql[64h + 32 (rr % 2) + e] nibble rr // 2,
            # qh[128 + 32h + e] bits 2rr, 2rr+1), e = 16 (r % 2) + l the weight within that run
            h, rr = tirx.floordiv(r, 8), tirx.floordiv(tirx.floormod(r, 8), 2)
            e = 16 * tirx.floormod(r, 2) + l
            low = (byte(W, n, bb + 64 * h + 32 * tirx.floormod(rr, 2) + e) >> tirx.Cast("uint32", 4 * tirx.floordiv(rr, 2))) & u32(15)
            high = (byte(W, n, bb + 128 + 32 * h + e) >> tirx.Cast("uint32", 2 * rr)) & u32(3)
            return i32(low | (high << u32(4))) - tirx.const(32, "int32")

        def scale(W, n, bb, r):  # run r's scale: d * scales[r]
            return half(W, n, bb + 208) * f32(tirx.Cast("int8", W[n, bb + 192 + r]))

        def scales(W, n, bb, g, hd):
            return hd(0) * f32(tirx.Cast("int8", W[n, bb + 192 + g])), f32c(0.0)

        def weight(W, n, bb, r, l):
            return scale(W, n, bb, r) * f32(quant(W, n, bb, r, l))

        return BlockLayout(16, 1, quant, scales, weight, (104, 1))
    raise ValueError(f"unknown weight format {fmt!r}")


def _block_op(kernel, gpu: bool):
    """(op, its schedule, K, row bytes, blocks a row, bytes a block, weights a block, the format's BlockLayout) of a
    quant_matmul / dequantize kernel; NotImplementedError for the GPU (these lowerings are the CPU's)."""
    kernel = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    op = kernel.op
    if gpu:
        raise NotImplementedError(f"{op.kind} has no TVM CUDA lowering (the CPU kernel only)")
    K, fmt = op.in_features, WEIGHT_FORMATS[op.weight_format]
    return op, schedule_of(kernel), K, fmt.row_bytes(K), K // fmt.block, fmt.nbytes, fmt.block, _layout(op.weight_format)


def quant_matmul(kernel, gpu: bool):
    """out = dtype(x @ W^T) over packed GGUF blocks (module docstring: the CPU schedule)."""
    op, cfg, K, RB, NB, BW, BK, L = _block_op(kernel, gpu)
    from tvm import tirx
    from tvm.script import tirx as T

    N = op.out_features
    GR, NG = L.group_runs, L.groups  # runs a group, groups a block
    GW = GR * LANES  # weights a group
    dt = DTYPES[op.dtype].tir
    ROWS, TT = min(cfg.rows or MATMUL_ROWS, N), cfg.token_tile or TOKEN_TILE
    f32 = lambda v: tirx.Cast("float32", v)  # noqa: E731
    block_loop = T.unroll if cfg.unroll_dot else T.serial
    with_b = _has_offset(op.weight_format)

    H0, NH = L.header

    def scale_a(W, n, bb, g, hdr):
        return L.scales(W, n, bb, g, lambda i: hdr[i])[0]

    def scale_b(W, n, bb, g, hdr):
        return L.scales(W, n, bb, g, lambda i: hdr[i])[1]

    def x_f32(x, t, k):
        return f32(x[t, k])

    def partial(x, qf, t, k0, l):  # sum over the group's runs of x * q, lane l
        s = x_f32(x, t, k0 + l) * qf[0, l]
        for r in range(1, GR):
            s = s + x_f32(x, t, k0 + r * LANES + l) * qf[r, l]
        return s

    def body(TT: int):  # every row's out[t, n], the tokens TT at a time
        @T.macro
        def run(x, weight, out, num_tokens):
            for task in T.parallel((N + ROWS - 1) // ROWS):
                xs = T.alloc_buffer((TT, NB * NG), "float32")  # sum of x over each group, per token
                qf = T.alloc_buffer((GR, LANES), "float32")  # one group's quants
                acc = T.alloc_buffer((TT, LANES), "float32")  # A_g * (x_g . q_g), 16 lanes a token
                accb = T.alloc_buffer((TT,), "float32")  # B_g * sum(x_g)
                sc = T.alloc_buffer((2,), "float32")  # A_g, B_g
                hdr = T.alloc_buffer((2,), "float32")  # the block's fp16 fields
                weight_h = T.decl_buffer((N * RB // 2,), "float16", data=weight.data)  # the same bytes as fp16
                for tile in T.serial((num_tokens + TT - 1) // TT):
                    if with_b:
                        for t in T.serial(TT):
                            if tile * TT + t < num_tokens:
                                for g in T.serial(NB * NG):
                                    xs[t, g] = T.float32(0)
                                    for e in T.serial(GW):
                                        xs[t, g] = xs[t, g] + f32(x[tile * TT + t, g * GW + e])
                    for rr in T.serial(ROWS):
                        if task * ROWS + rr < N:
                            n: T.let[T.int64] = T.Cast("int64", task * ROWS + rr)
                            for t in T.serial(TT):
                                accb[t] = T.float32(0)
                                for l in T.vectorized(LANES):
                                    acc[t, l] = T.float32(0)
                            for b in block_loop(NB):
                                for v in T.vectorized(NH):  # the block's fp16 fields, one load
                                    hdr[v] = f32(weight_h[n * (RB // 2) + b * (BW // 2) + H0 + v])
                                for g in T.unroll(NG):
                                    for r in T.unroll(GR):
                                        for l in T.vectorized(LANES):
                                            qf[r, l] = f32(L.quant(weight, n, b * BW, g * GR + r, l))
                                    sc[0] = scale_a(weight, n, b * BW, g, hdr)
                                    if with_b:
                                        sc[1] = scale_b(weight, n, b * BW, g, hdr)
                                    for t in T.unroll(TT):
                                        if tile * TT + t < num_tokens:
                                            for l in T.vectorized(LANES):
                                                acc[t, l] = acc[t, l] + sc[0] * partial(x, qf, tile * TT + t, b * BK + g * GW, l)
                                            if with_b:
                                                accb[t] = accb[t] + sc[1] * xs[t, b * NG + g]
                            for t in T.serial(TT):
                                if tile * TT + t < num_tokens:
                                    for l in T.serial(LANES):
                                        accb[t] = accb[t] + acc[t, l]
                                    out[tile * TT + t, n] = T.Cast(dt, accb[t])

        return run

    def body_rows(RG: int):  # one token, RG rows at once: RG independent accumulations to overlap
        @T.macro
        def run(x, weight, out, num_tokens):
            for task in T.parallel((N + ROWS - 1) // ROWS):
                xs = T.alloc_buffer((NB * NG,), "float32")  # sum of x over each group
                qf = T.alloc_buffer((RG, GR, LANES), "float32")  # each row's group of quants
                acc = T.alloc_buffer((RG, LANES), "float32")  # A_g * (x_g . q_g), 16 lanes a row
                accb = T.alloc_buffer((RG,), "float32")  # B_g * sum(x_g)
                sc = T.alloc_buffer((RG, 2), "float32")  # A_g, B_g
                hdr = T.alloc_buffer((RG, 2), "float32")  # each row's block fp16 fields
                weight_h = T.decl_buffer((N * RB // 2,), "float16", data=weight.data)  # the same bytes as fp16
                if with_b:
                    for g in T.serial(NB * NG):
                        xs[g] = T.float32(0)
                        for e in T.serial(GW):
                            xs[g] = xs[g] + f32(x[0, g * GW + e])
                for rg in T.serial(ROWS // RG):
                    if task * ROWS + rg * RG < N:  # N % RG == 0: the whole group is in range
                        n0: T.let[T.int64] = T.Cast("int64", task * ROWS + rg * RG)
                        for j in T.unroll(RG):
                            accb[j] = T.float32(0)
                            for l in T.vectorized(LANES):
                                acc[j, l] = T.float32(0)
                        for b in block_loop(NB):
                            for j in T.unroll(RG):
                                for v in T.vectorized(NH):
                                    hdr[j, v] = f32(weight_h[(n0 + j) * (RB // 2) + b * (BW // 2) + H0 + v])
                            for g in T.unroll(NG):
                                for j in T.unroll(RG):
                                    for r in T.unroll(GR):
                                        for l in T.vectorized(LANES):
                                            qf[j, r, l] = f32(L.quant(weight, n0 + j, b * BW, g * GR + r, l))
                                    sc[j, 0] = L.scales(weight, n0 + j, b * BW, g, lambda i: hdr[j, i])[0]
                                    if with_b:
                                        sc[j, 1] = L.scales(weight, n0 + j, b * BW, g, lambda i: hdr[j, i])[1]
                                for j in T.unroll(RG):
                                    for l in T.vectorized(LANES):
                                        acc[j, l] = acc[j, l] + sc[j, 0] * partial_rows(x, qf, j, b * BK + g * GW, l)
                                    if with_b:
                                        accb[j] = accb[j] + sc[j, 1] * xs[b * NG + g]
                        for j in T.unroll(RG):
                            for l in T.serial(LANES):
                                accb[j] = accb[j] + acc[j, l]
                            out[0, n0 + j] = T.Cast(dt, accb[j])

        return run

    def partial_rows(x, qf, j, k0, l):  # partial() of row j of a row group, the one token
        s = x_f32(x, 0, k0 + l) * qf[j, 0, l]
        for r in range(1, GR):
            s = s + x_f32(x, 0, k0 + r * LANES + l) * qf[j, r, l]
        return s

    RG = DECODE_ROW_GROUP if with_b and N % DECODE_ROW_GROUP == 0 and ROWS % DECODE_ROW_GROUP == 0 else 1
    general = body(TT)
    single = body_rows(RG) if RG > 1 else body(1)  # decode's one token: no token loop, no guards

    @T.prim_func
    def kernel_fn(x_h: T.handle, w_h: T.handle, o_h: T.handle, num_tokens: T.int64):
        x = T.match_buffer(x_h, (num_tokens, K), dt, align=ALIGN)
        weight = T.match_buffer(w_h, (N, RB), "uint8", align=ALIGN)
        out = T.match_buffer(o_h, (num_tokens, N), dt, align=ALIGN)
        if TT == 1:
            general(x, weight, out, num_tokens)
        elif num_tokens == 1:
            single(x, weight, out, num_tokens)
        else:
            general(x, weight, out, num_tokens)

    return kernel_fn


def _has_offset(fmt: str) -> bool:
    """Whether the format's weights carry an offset B (w = A q + B)."""
    return fmt in ("q4_0", "q4_1", "q4_k", "q5_k")


def dequantize(kernel, gpu: bool):
    """out[r] = dtype(W[r]), W decoded in the reference's float32 arithmetic; a parallel task takes `rows` rows."""
    op, cfg, K, RB, NB, BW, BK, L = _block_op(kernel, gpu)
    from tvm.script import tirx as T

    dt = DTYPES[op.dtype].tir
    ROWS = cfg.rows or DEQUANT_ROWS

    @T.prim_func
    def kernel_fn(w_h: T.handle, o_h: T.handle, num_rows: T.int64):
        weight = T.match_buffer(w_h, (num_rows, RB), "uint8", align=ALIGN)
        out = T.match_buffer(o_h, (num_rows, K), dt, align=ALIGN)
        for task in T.parallel((num_rows + ROWS - 1) // ROWS):
            for rr in T.serial(ROWS):
                if task * ROWS + rr < num_rows:
                    n: T.let[T.int64] = T.Cast("int64", task * ROWS + rr)
                    for b in T.serial(NB):
                        for r in T.unroll(L.runs):
                            for l in T.vectorized(LANES):
                                out[n, b * BK + r * LANES + l] = T.Cast(dt, L.weight(weight, n, b * BW, r, l))

    return kernel_fn


__all__ = ["quant_matmul", "dequantize", "BlockLayout"]
