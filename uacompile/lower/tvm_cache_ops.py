"""TIR for the cache ops and the split-KV reduce: one generator per op serves both targets.

The loop constructors are picked per target (blockIdx / threadIdx bindings on CUDA,
T.parallel / serial loops on the CPU); on the CPU a "block" is one parallel task and its
lanes collapse to one (TX = 1), so the same body runs with no shuffles.
"""
from __future__ import annotations

from ..ir import DTYPES, QMAX, CopyBlocks, MergeState, ReshapeAndCache, SwapBlocks, as_kernel
from .config import schedule_of
from .tvm_tir import ALIGN, FULL, lanes_for, loops, merge_row_macro, quantize_f32, rope_cos_sin

COPY_THREADS = 128


def reshape_and_cache(kernel, gpu: bool):
    """kernel: the op, or ir.Kernel(op, TVMConfig): on the CPU a parallel task takes config.grain tokens."""
    from tvm import tirx
    from tvm.script import tirx as T

    op: ReshapeAndCache = getattr(kernel, "op", kernel)
    GRAIN = 1 if gpu else schedule_of(as_kernel(kernel)).grain

    Hkv, D, P = op.num_kv_heads, op.head_dim, op.page_size
    in_dt, kvdt, kvd = DTYPES[op.dtype].tir, DTYPES[op.kv_dtype].tir, op.kv_dtype
    TX = lanes_for(D) if gpu else 1
    VEC, NSH = D // TX, TX.bit_length() - 1
    quant, rope = op.quantized, op.rope
    qmax = QMAX.get(op.kv_dtype, 1.0)
    grid_x, grid_y, lanes = loops(gpu)

    def element(src, t, h, d, pos, roped: bool):
        """k or v element as float32; RoPE in float64 (as the reference), rounded to the input dtype."""
        if not roped:
            return tirx.Cast("float32", src[t, h, d])
        f64 = lambda x: tirx.Cast("float64", x)  # noqa: E731
        if op.rope_interleaved:
            i = d // 2
            x_a, x_b, first = src[t, h, 2 * i], src[t, h, 2 * i + 1], d % 2 == 0
        else:
            i = d % (D // 2)
            x_a, x_b, first = src[t, h, i], src[t, h, i + D // 2], d < D // 2
        c, s = rope_cos_sin(i, pos, op.rope_theta, D)
        val = tirx.Select(first, f64(x_a) * c - f64(x_b) * s, f64(x_b) * c + f64(x_a) * s)
        return tirx.Cast("float32", tirx.Cast(in_dt, val))

    @T.macro
    def write_row(src, cache, scales, t, h, tx, page, off, row, st, pos, roped):
        for v in T.serial(VEC):
            row[v] = element(src, t, h, tx * VEC + v, pos, roped)
        if quant:
            st[0] = T.float32(0)
            for v in T.serial(VEC):
                st[0] = T.max(st[0], T.abs(row[v]))
            for r in T.unroll(NSH):
                st[0] = T.max(st[0], T.tvm_warp_shuffle_xor(FULL, st[0], (TX // 2) >> r, TX, 32))
            st[1] = T.Select(st[0] > T.float32(0), st[0] / T.float32(qmax), T.float32(1))
            for v in T.serial(VEC):
                cache[page, off, h, tx * VEC + v] = quantize_f32(kvd, row[v] / st[1])
            if tx == 0:
                scales[page, off, h] = st[1]
        else:
            for v in T.serial(VEC):
                cache[page, off, h, tx * VEC + v] = T.Cast(kvdt, row[v])

    @T.prim_func
    def kernel(k_h: T.handle, v_h: T.handle, sm_h: T.handle, pos_h: T.handle, kc_h: T.handle, vc_h: T.handle,
               ks_h: T.handle, vs_h: T.handle, num_tokens: T.int64, num_pages: T.int64):
        k = T.match_buffer(k_h, (num_tokens, Hkv, D), in_dt, align=ALIGN)
        v = T.match_buffer(v_h, (num_tokens, Hkv, D), in_dt, align=ALIGN)
        slot_mapping = T.match_buffer(sm_h, (num_tokens,), "int64", align=ALIGN)
        positions = T.match_buffer(pos_h, (num_tokens,), "int64", align=ALIGN)
        k_cache = T.match_buffer(kc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        v_cache = T.match_buffer(vc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        k_scale = T.match_buffer(ks_h, (num_pages, P, Hkv), "float32", align=ALIGN)
        v_scale = T.match_buffer(vs_h, (num_pages, P, Hkv), "float32", align=ALIGN)
        for bt0 in grid_x((num_tokens + GRAIN - 1) // GRAIN):
            for bt1 in T.serial(GRAIN):
                for bh in grid_y(Hkv):
                    for tx in lanes(TX):
                        row = T.alloc_buffer((VEC,), "float32", scope="local")
                        st = T.alloc_buffer((2,), "float32", scope="local")  # amax, scale
                        t: T.let[T.int64] = T.Cast("int64", bt0) * GRAIN + T.Cast("int64", bt1)
                        h: T.let[T.int64] = T.Cast("int64", bh)
                        if t < num_tokens:
                            slot: T.let[T.int64] = slot_mapping[t]
                            if slot >= 0:  # -1 = padding token
                                if rope:
                                    write_row(k, k_cache, k_scale, t, h, tx, slot // P, slot % P, row, st,
                                              positions[t], True)
                                else:
                                    write_row(k, k_cache, k_scale, t, h, tx, slot // P, slot % P, row, st, 0, False)
                                write_row(v, v_cache, v_scale, t, h, tx, slot // P, slot % P, row, st, 0, False)

    return kernel


def _page_copy(op, gpu: bool, swap: bool):
    """copy_blocks (in place) and swap_blocks (src -> dst): whole pages of every layer, K and V."""
    from tvm.script import tirx as T

    Hkv, D, P = op.num_kv_heads, op.head_dim, op.page_size
    kvdt, quant = DTYPES[op.kv_dtype].tir, op.quantized
    E, ES = P * Hkv * D, P * Hkv  # elements of one page of KV / of scales
    NT = COPY_THREADS if gpu else 1
    grid_x, grid_y, lanes = loops(gpu)

    @T.macro
    def copy_page(src, dst, src_page, dst_page, lc, n_src, n_dst, tx, n_elem):
        for e in T.serial((n_elem + NT - 1) // NT):
            if e * NT + tx < n_elem:
                dst[(lc * n_dst + dst_page) * n_elem + e * NT + tx] = src[(lc * n_src + src_page) * n_elem + e * NT + tx]

    @T.prim_func
    def kernel(kv_h: T.handle, sc_h: T.handle, src_h: T.handle, dst_h: T.handle, ssc_h: T.handle,
               dsc_h: T.handle, map_h: T.handle, num_layers: T.int64, num_pages: T.int64,
               num_src_pages: T.int64, num_dst_pages: T.int64, num_pairs: T.int64):
        kv = T.match_buffer(kv_h, (num_layers, 2, num_pages, P, Hkv, D), kvdt, align=ALIGN)
        scales = T.match_buffer(sc_h, (num_layers, 2, num_pages, P, Hkv), "float32", align=ALIGN)
        src = T.match_buffer(src_h, (num_layers, 2, num_src_pages, P, Hkv, D), kvdt, align=ALIGN)
        dst = T.match_buffer(dst_h, (num_layers, 2, num_dst_pages, P, Hkv, D), kvdt, align=ALIGN)
        src_scales = T.match_buffer(ssc_h, (num_layers, 2, num_src_pages, P, Hkv), "float32", align=ALIGN)
        dst_scales = T.match_buffer(dsc_h, (num_layers, 2, num_dst_pages, P, Hkv), "float32", align=ALIGN)
        mapping = T.match_buffer(map_h, (num_pairs, 2), "int64", align=ALIGN)
        for i in grid_x(num_pairs):
            for lc in grid_y(num_layers * 2):
                for tx in lanes(NT):
                    if swap:
                        src_f = T.decl_buffer((num_layers * 2 * num_src_pages * E,), kvdt, data=src.data)
                        dst_f = T.decl_buffer((num_layers * 2 * num_dst_pages * E,), kvdt, data=dst.data)
                        copy_page(src_f, dst_f, mapping[i, 0], mapping[i, 1], lc, num_src_pages, num_dst_pages,
                                  tx, E)
                        if quant:
                            ssc_f = T.decl_buffer((num_layers * 2 * num_src_pages * ES,), "float32",
                                                  data=src_scales.data)
                            dsc_f = T.decl_buffer((num_layers * 2 * num_dst_pages * ES,), "float32",
                                                  data=dst_scales.data)
                            copy_page(ssc_f, dsc_f, mapping[i, 0], mapping[i, 1], lc, num_src_pages,
                                      num_dst_pages, tx, ES)
                    else:
                        kv_f = T.decl_buffer((num_layers * 2 * num_pages * E,), kvdt, data=kv.data)
                        copy_page(kv_f, kv_f, mapping[i, 0], mapping[i, 1], lc, num_pages, num_pages, tx, E)
                        if quant:
                            sc_f = T.decl_buffer((num_layers * 2 * num_pages * ES,), "float32", data=scales.data)
                            copy_page(sc_f, sc_f, mapping[i, 0], mapping[i, 1], lc, num_pages, num_pages, tx, ES)

    return kernel


def copy_blocks(op: CopyBlocks, gpu: bool):
    """Destinations must not also be sources (vLLM's contract; reference reads all sources first)."""
    return _page_copy(op, gpu, swap=False)


def swap_blocks(op: SwapBlocks, gpu: bool):
    """On CUDA the host side must be pinned memory (mapped into the device's address space)."""
    return _page_copy(op, gpu, swap=True)


def merge_state(op: MergeState, gpu: bool):
    from tvm.script import tirx as T

    H, D, S = op.num_heads, op.head_dim, op.num_splits
    TX = lanes_for(D) if gpu else 1
    VEC = D // TX
    grid_x, grid_y, lanes = loops(gpu)
    merge_row = merge_row_macro(S, op.out_dtype, op.return_lse)

    @T.prim_func
    def kernel(op_h: T.handle, lp_h: T.handle, out_h: T.handle, lse_h: T.handle, num_tokens: T.int64):
        o_partial = T.match_buffer(op_h, (S, num_tokens, H, D), "float32", align=ALIGN)
        lse_partial = T.match_buffer(lp_h, (S, num_tokens, H), "float32", align=ALIGN)
        out = T.match_buffer(out_h, (num_tokens, H, D), DTYPES[op.out_dtype].tir, align=ALIGN)
        lse = T.match_buffer(lse_h, (num_tokens, H), "float32", align=ALIGN)
        for bt in grid_x(num_tokens):
            for h in grid_y(H):
                for tx in lanes(TX):
                    acc = T.alloc_buffer((VEC,), "float32", scope="local")
                    st = T.alloc_buffer((4,), "float32", scope="local")  # max lse, sum of weights, weight, 1/sum
                    merge_row(o_partial, lse_partial, out, lse, st, acc, bt, h, tx * VEC, VEC)

    return kernel


__all__ = ["reshape_and_cache", "copy_blocks", "swap_blocks", "merge_state"]
