"""TIR for KV eviction: kv_score (the CPU) and gather_tokens (both targets).

kv_score: one parallel task per (sequence, KV head). Its window queries are found by scanning query_seq; for each
query and query head an online-softmax pass gives (max, sum) over the query's visible positions, then the weights
are recomputed where they are used (the anchor o_h, then the scores), so nothing of size kv_len is kept but the
scores row itself, which accumulates in place. Arithmetic in float32 (reference.kv_score is float64).
gather_tokens: one task (CUDA: one block) per kept token, a lane group over D, as copy_blocks.
"""
from __future__ import annotations

from ..ir import DTYPES, GatherTokens, KVScore
from .tvm_tir import ALIGN, lanes_for, loops, neg_inf


def gather_tokens(op: GatherTokens, gpu: bool):
    from tvm.script import tirx as T

    Hkv, D, P = op.num_kv_heads, op.head_dim, op.page_size
    kvdt, quant = DTYPES[op.kv_dtype].tir, op.quantized
    TX = lanes_for(D) if gpu else 1
    VEC = D // TX
    grid_x, grid_y, lanes = loops(gpu)

    @T.prim_func
    def kernel(kv_h: T.handle, sc_h: T.handle, src_h: T.handle, dst_h: T.handle, num_layers: T.int64,
               num_pages: T.int64, num_tokens: T.int64):
        kv = T.match_buffer(kv_h, (num_layers, 2, num_pages, P, Hkv, D), kvdt, align=ALIGN)
        scales = T.match_buffer(sc_h, (num_layers, 2, num_pages, P, Hkv), "float32", align=ALIGN)
        src_slots = T.match_buffer(src_h, (num_layers, Hkv, num_tokens), "int64", align=ALIGN)
        dst_slots = T.match_buffer(dst_h, (num_tokens,), "int64", align=ALIGN)
        for t in grid_x(num_tokens):
            for lg in grid_y(num_layers * Hkv):
                for tx in lanes(TX):
                    dst: T.let[T.int64] = dst_slots[t]
                    layer: T.let[T.int64] = T.Cast("int64", lg) // Hkv
                    g: T.let[T.int64] = T.Cast("int64", lg) % Hkv
                    src: T.let[T.int64] = src_slots[layer, g, t]
                    if dst >= 0:
                        for c in T.serial(2):
                            for v in T.serial(VEC):
                                kv[layer, c, dst // P, dst % P, g, tx * VEC + v] = \
                                    kv[layer, c, src // P, src % P, g, tx * VEC + v]
                            if quant and tx == 0:
                                scales[layer, c, dst // P, dst % P, g] = scales[layer, c, src // P, src % P, g]

    return kernel


def kv_score(op: KVScore, gpu: bool):
    if gpu:
        raise ValueError("kv_score: the TVM lowering is for the CPU (CUDA: the Jinja template)")
    from tvm import tirx
    from tvm.script import tirx as T

    Hq, Hkv, D, P, G = op.num_q_heads, op.num_kv_heads, op.head_dim, op.page_size, op.group_size
    qdt, kvdt = DTYPES[op.q_dtype].tir, DTYPES[op.kv_dtype].tir
    scale, method = float(op.sm_scale), op.method
    f32 = lambda v: tirx.Cast("float32", v)  # noqa: E731

    @T.prim_func
    def kernel(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, qs_h: T.handle, ql_h: T.handle, pt_h: T.handle,
               kl_h: T.handle, sc_h: T.handle, num_queries: T.int64, num_pages: T.int64, num_seqs: T.int64,
               max_pages: T.int64, max_kv_len: T.int64):
        q = T.match_buffer(q_h, (num_queries, Hq, D), qdt, align=ALIGN)
        k_cache = T.match_buffer(kc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        v_cache = T.match_buffer(vc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        query_seq = T.match_buffer(qs_h, (num_queries,), "int32", align=ALIGN)
        query_kv_len = T.match_buffer(ql_h, (num_queries,), "int32", align=ALIGN)
        page_table = T.match_buffer(pt_h, (num_seqs, max_pages), "int32", align=ALIGN)
        kv_len = T.match_buffer(kl_h, (num_seqs,), "int32", align=ALIGN)
        scores = T.match_buffer(sc_h, (num_seqs, Hkv, max_kv_len), "float32", align=ALIGN)
        for sg in T.parallel(num_seqs * Hkv):
            o = T.alloc_buffer((G, D), "float32", scope="local")   # the anchor (sum over the window)
            st = T.alloc_buffer((G, 3), "float32", scope="local")  # max, sum of exp, ||o||
            acc = T.alloc_buffer((3,), "float32", scope="local")   # q.k, v.o or |v|_1, the new max
            cnt = T.alloc_buffer((1,), "int64", scope="local")
            s: T.let[T.int64] = T.Cast("int64", sg) // Hkv
            g: T.let[T.int64] = T.Cast("int64", sg) % Hkv
            L: T.let[T.int64] = T.Cast("int64", kv_len[s])
            for i in T.serial(max_kv_len):
                scores[s, g, i] = T.Select(i < L, T.float32(0), neg_inf())
            cnt[0] = T.int64(0)
            for t in T.serial(num_queries):
                if T.Cast("int64", query_seq[t]) == s:
                    cnt[0] = cnt[0] + T.int64(1)
            for h in T.serial(G):
                for d in T.serial(D):
                    o[h, d] = T.float32(0)
            for phase in T.serial(2 if method == "andpro" else 1):  # andpro: 0 = the anchor, 1 = the scores
                for t in T.serial(num_queries):
                    if T.Cast("int64", query_seq[t]) == s:
                        n: T.let[T.int64] = T.Cast("int64", query_kv_len[t])
                        for h in T.serial(G):
                            st[h, 0] = neg_inf()
                            st[h, 1] = T.float32(0)
                            for i in T.serial(n):
                                acc[0] = T.float32(0)
                                for d in T.serial(D):
                                    acc[0] = acc[0] + f32(q[t, g * G + h, d]) * f32(
                                        k_cache[T.Cast("int64", page_table[s, i // P]), i % P, g, d])
                                acc[0] = acc[0] * T.float32(scale)
                                acc[2] = T.max(st[h, 0], acc[0])
                                st[h, 1] = st[h, 1] * T.exp(st[h, 0] - acc[2]) + T.exp(acc[0] - acc[2])
                                st[h, 0] = acc[2]
                            for i in T.serial(n):
                                acc[0] = T.float32(0)
                                for d in T.serial(D):
                                    acc[0] = acc[0] + f32(q[t, g * G + h, d]) * f32(
                                        k_cache[T.Cast("int64", page_table[s, i // P]), i % P, g, d])
                                acc[0] = T.exp(acc[0] * T.float32(scale) - st[h, 0]) / st[h, 1]  # A[h, t, i]
                                if method == "andpro" and phase == 0:
                                    for d in T.serial(D):
                                        o[h, d] = o[h, d] + acc[0] * f32(
                                            v_cache[T.Cast("int64", page_table[s, i // P]), i % P, g, d])
                                else:
                                    acc[1] = T.float32(0)
                                    if method == "attention":
                                        acc[1] = T.float32(1)
                                    elif method == "value_norm":
                                        for d in T.serial(D):
                                            acc[1] = acc[1] + T.abs(f32(
                                                v_cache[T.Cast("int64", page_table[s, i // P]), i % P, g, d]))
                                    else:
                                        if st[h, 2] > T.float32(0):
                                            for d in T.serial(D):
                                                acc[1] = acc[1] + o[h, d] * f32(
                                                    v_cache[T.Cast("int64", page_table[s, i // P]), i % P, g, d])
                                            acc[1] = acc[1] / st[h, 2]
                                    scores[s, g, i] = scores[s, g, i] + acc[0] * acc[1] / T.Cast(
                                        "float32", cnt[0] * T.int64(G))
                if method == "andpro" and phase == 0:
                    for h in T.serial(G):
                        st[h, 2] = T.float32(0)
                        for d in T.serial(D):
                            st[h, 2] = st[h, 2] + o[h, d] * o[h, d]
                        st[h, 2] = T.sqrt(st[h, 2])

    return kernel


__all__ = ["gather_tokens", "kv_score"]
