"""TIR for paged_attention (UA and unified_masked), CPU and CUDA.

Both targets do the same math: q is pre-scaled into fp32, scores get soft-cap / ALiBi,
an online softmax keeps (max, sum, acc[D]) in fp32, and split i of a token covers
reference.split_ranges. They differ in how work is spread:
- cpu: one task per `grain` (token, q head) rows under T.parallel; KV is walked `page_group`
  pages at a time, so the softmax rescale happens once per group of pages and the inner loops
  vectorise over D (dot_lanes partial sums for q.k, acc_vec lanes for the V accumulation).
- cuda: one block per (token, q head, split); TX = `lanes` lanes share a row of D (warp-shuffle
  dot product), NY = threads / TX lane groups take interleaved positions, then merge through shared memory.
  With `heads` > 1 a block serves that many q heads of one KV head (threadIdx.z, NY = threads / (TX * heads)):
  each iteration the block copies the K/V rows of its NY positions into shared memory once and every head reads
  them there. `vec` > 1 moves a lane's q / K / V elements `vec` at a time (vector loads).
unified_masked scans every page-table entry of every sequence (skipping -1) and masks out
cells of other sequences and positions outside the token's range: llama.cpp's cost model.
"""
from __future__ import annotations

from ..ir import DTYPES, Kernel, PagedAttention
from .config import TVMConfig, schedule_of, splits_of
from .tvm_tir import ALIGN, load_f32, merge_row_macro, neg_inf, transform_score


def paged_attention(kernel: Kernel, gpu: bool):
    """kernel: the op and its config (a TVMConfig: splits and schedule knobs; another target's config: its
    signature()'s splits, default knobs)."""
    S, fused = splits_of(kernel)
    cfg = schedule_of(kernel)
    return _cuda(kernel.op, S, fused, cfg) if gpu else _cpu(kernel.op, S, fused, cfg)


def _ranges(op: PagedAttention, S: int):
    """Python helpers building the visible range [lo, L) and split i's [a, b) as int64 exprs."""
    from tvm import tirx

    def lo_of(L):
        return tirx.max(L - tirx.const(op.window, "int64"), tirx.const(0, "int64")) if op.window else tirx.const(0, "int64")

    def split(lo, L, i):
        if S == 1:
            return lo, L
        c = tirx.floordiv(L - lo + tirx.const(S - 1, "int64"), tirx.const(S, "int64"))
        i = tirx.Cast("int64", i)
        return tirx.min(lo + i * c, L), tirx.min(lo + (i + tirx.const(1, "int64")) * c, L)

    return lo_of, split


def _with_buffers(op: PagedAttention, S: int, body):
    """The kernel: the IR's parameters as buffers, then `body` (a T.macro of the buffers and sizes,
    one per target) as its whole body, so both targets share one declaration of the signature."""
    from tvm.script import tirx as T

    Hq, Hkv, D, P = op.num_q_heads, op.num_kv_heads, op.head_dim, op.page_size
    qdt, kvdt = DTYPES[op.q_dtype].tir, DTYPES[op.kv_dtype].tir

    @T.prim_func
    def kernel(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, ts_h: T.handle, pt_h: T.handle, kl_h: T.handle,
               ks_h: T.handle, vs_h: T.handle, al_h: T.handle, op_h: T.handle, lp_h: T.handle, sc_h: T.handle,
               out_h: T.handle, lse_h: T.handle, num_tokens: T.int64, num_seqs: T.int64, max_pages: T.int64,
               num_pages: T.int64):
        q = T.match_buffer(q_h, (num_tokens, Hq, D), qdt, align=ALIGN)
        k_cache = T.match_buffer(kc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        v_cache = T.match_buffer(vc_h, (num_pages, P, Hkv, D), kvdt, align=ALIGN)
        token_seq = T.match_buffer(ts_h, (num_tokens,), "int32", align=ALIGN)
        page_table = T.match_buffer(pt_h, (num_seqs, max_pages), "int32", align=ALIGN)
        token_kv_len = T.match_buffer(kl_h, (num_tokens,), "int32", align=ALIGN)
        k_scale = T.match_buffer(ks_h, (num_pages, P, Hkv), "float32", align=ALIGN)
        v_scale = T.match_buffer(vs_h, (num_pages, P, Hkv), "float32", align=ALIGN)
        alibi_slopes = T.match_buffer(al_h, (Hq,), "float32", align=ALIGN)
        o_partial = T.match_buffer(op_h, (S, num_tokens, Hq, D), "float32", align=ALIGN)
        lse_partial = T.match_buffer(lp_h, (S, num_tokens, Hq), "float32", align=ALIGN)
        # fused_merge's workspace: declared for the signature, the TVM merge pass needs no counters
        split_counters = T.match_buffer(sc_h, (num_tokens, Hkv), "int32", align=ALIGN)  # noqa: F841
        out = T.match_buffer(out_h, (num_tokens, Hq, D), qdt, align=ALIGN)
        lse = T.match_buffer(lse_h, (num_tokens, Hq), "float32", align=ALIGN)
        body(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes, o_partial,
             lse_partial, out, lse, num_tokens, num_seqs, max_pages)

    return kernel


def _cpu(op: PagedAttention, S: int, fused: bool, cfg: TVMConfig):
    from tvm.script import tirx as T

    Hq, D, P, G = op.num_q_heads, op.head_dim, op.page_size, op.group_size
    qdt, kvd = DTYPES[op.q_dtype].tir, op.kv_dtype
    LN = cfg.dot_lanes_for(D)  # dot-product lanes (fp32 partial sums)
    W = cfg.acc_vec_for(D)  # vector width of the V accumulation
    PG, GRAIN = cfg.page_group, cfg.grain  # pages a softmax update, rows a parallel task
    NC = PG * P  # score cells of one update
    dot_loop = T.unroll if cfg.unroll_dot else T.serial
    quant, unified, with_lse = op.quantized, op.variant == "unified_masked", op.return_lse
    scale, NEG = op.sm_scale, neg_inf()
    lo_of, split = _ranges(op, S)
    merge_row = merge_row_macro(S, op.q_dtype, op.return_lse)

    def tf(x, h, j, L, slopes):
        return transform_score(op, x, h, j, L, slopes)

    @T.macro
    def dot_into(sc, c, o, qv, part, k_cache, k_scale, page, g):
        # sc[c] = q . k_cache[page, o, g]
        for ln in T.vectorized(LN):
            part[ln] = T.float32(0)
        for d0 in dot_loop(D // LN):
            for ln in T.vectorized(LN):
                part[ln] = part[ln] + qv[d0 * LN + ln] * load_f32(kvd, k_cache[page, o, g, d0 * LN + ln])
        sc[c] = T.float32(0)
        for ln in T.serial(LN):
            sc[c] = sc[c] + part[ln]
        if quant:
            sc[c] = sc[c] * k_scale[page, o, g]

    @T.macro
    def cells_update(sc, pb, st, acc, v_cache, v_scale, pages, g, n):
        # sc[c] holds final scores (-inf = masked) of cells c < n, cell c at (pages[c // P], c % P):
        # fold them into (m, l, acc)
        st[2] = NEG
        for c in T.serial(n):
            st[2] = T.max(st[2], sc[c])
        if st[2] > NEG:
            m_new: T.let[T.float32] = T.max(st[0], st[2])
            alpha: T.let[T.float32] = T.exp(st[0] - m_new)
            st[3] = T.float32(0)
            for c in T.serial(n):
                pb[c] = T.exp(sc[c] - m_new)
                st[3] = st[3] + pb[c]
            st[1] = st[1] * alpha + st[3]
            st[0] = m_new
            for d0 in T.serial(D // W):
                for d1 in T.vectorized(W):
                    acc[d0 * W + d1] = acc[d0 * W + d1] * alpha
            for c in T.serial(n):
                if sc[c] > NEG:  # masked cells may hold garbage (even NaN): never touch their V
                    if quant:
                        pb[c] = pb[c] * v_scale[pages[c // P], c % P, g]
                    for d0 in T.serial(D // W):
                        for d1 in T.vectorized(W):
                            acc[d0 * W + d1] = acc[d0 * W + d1] + pb[c] * load_f32(
                                kvd, v_cache[pages[c // P], c % P, g, d0 * W + d1])

    @T.macro
    def row(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes, o_partial,
            lse_partial, out, lse, num_seqs, max_pages, th):
        qv = T.alloc_buffer((D,), "float32", scope="local")
        acc = T.alloc_buffer((D,), "float32", scope="local")
        sc = T.alloc_buffer((NC,), "float32", scope="local")
        pb = T.alloc_buffer((NC,), "float32", scope="local")
        pages = T.alloc_buffer((PG,), "int64", scope="local")
        part = T.alloc_buffer((LN,), "float32", scope="local")
        st = T.alloc_buffer((4,), "float32", scope="local")  # m, l, update max, update sum
        t: T.let[T.int64] = th // Hq
        h: T.let[T.int64] = th % Hq
        g: T.let[T.int64] = h // G
        s: T.let[T.int64] = T.Cast("int64", token_seq[t])
        L: T.let[T.int64] = T.Cast("int64", token_kv_len[t])
        lo: T.let[T.int64] = lo_of(L)
        for d in T.serial(D):
            qv[d] = T.Cast("float32", q[t, h, d]) * T.float32(scale)
        for sp in T.serial(S):
            a: T.let[T.int64] = split(lo, L, sp)[0]
            b: T.let[T.int64] = split(lo, L, sp)[1]
            st[0] = NEG
            st[1] = T.float32(0)
            for d in T.vectorized(D):
                acc[d] = T.float32(0)
            if unified:
                for s2 in T.serial(num_seqs):
                    for pi in T.serial(max_pages):
                        page: T.let[T.int64] = T.Cast("int64", page_table[s2, pi])
                        if page >= 0:
                            pages[0] = page
                            for o in T.serial(P):  # every cell is scored, then masked
                                dot_into(sc, o, o, qv, part, k_cache, k_scale, page, g)
                                sc[o] = T.Select(s2 == s and pi * P + o >= a and pi * P + o < b,
                                                 tf(sc[o], h, pi * P + o, L, alibi_slopes), NEG)
                            cells_update(sc, pb, st, acc, v_cache, v_scale, pages, g, P)
            elif a < b:
                p0: T.let[T.int64] = a // P
                p1: T.let[T.int64] = (b + P - 1) // P
                for gi in T.serial((p1 - p0 + PG - 1) // PG):
                    for k in T.serial(PG):
                        pi: T.let[T.int64] = p0 + gi * PG + k
                        for o in T.serial(P):
                            sc[k * P + o] = NEG
                        if pi < p1:
                            pages[k] = T.Cast("int64", page_table[s, pi])
                            for o in T.serial(T.max(a - pi * P, 0), T.min(b - pi * P, P)):
                                dot_into(sc, k * P + o, o, qv, part, k_cache, k_scale, pages[k], g)
                                sc[k * P + o] = tf(sc[k * P + o], h, pi * P + o, L, alibi_slopes)
                    cells_update(sc, pb, st, acc, v_cache, v_scale, pages, g, NC)
            inv: T.let[T.float32] = T.Select(st[1] > T.float32(0), T.float32(1) / st[1], T.float32(0))
            lse_v: T.let[T.float32] = T.Select(st[1] > T.float32(0), st[0] + T.log(st[1]), NEG)
            if S == 1:
                for d in T.serial(D):
                    out[t, h, d] = T.Cast(qdt, acc[d] * inv)
                if with_lse:
                    lse[t, h] = lse_v
            else:
                for d in T.serial(D):
                    o_partial[sp, t, h, d] = acc[d] * inv
                lse_partial[sp, t, h] = lse_v
        if fused:  # this task wrote every split of (t, h): merge them as merge_state does
            merge_row(o_partial, lse_partial, out, lse, st, acc, t, h, 0, D)

    @T.macro
    def body(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes, o_partial,
             lse_partial, out, lse, num_tokens, num_seqs, max_pages):
        if GRAIN == 1:
            for th in T.parallel(num_tokens * Hq):
                row(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes,
                    o_partial, lse_partial, out, lse, num_seqs, max_pages, th)
        else:
            for th0 in T.parallel((num_tokens * Hq + GRAIN - 1) // GRAIN):
                for th1 in T.serial(GRAIN):
                    if th0 * GRAIN + th1 < num_tokens * Hq:
                        row(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale,
                            alibi_slopes, o_partial, lse_partial, out, lse, num_seqs, max_pages, th0 * GRAIN + th1)

    return _with_buffers(op, S, body)


def _row(buf, *index):
    """Element d of one row of buf (the last axis) as a function of d: a K/V row in the cache or in a staged tile."""
    return lambda d: buf[(*index, d)]


def _cuda(op: PagedAttention, S: int, fused: bool, cfg: TVMConfig):
    from tvm import tirx
    from tvm.script import tirx as T

    Hq, D, P, G = op.num_q_heads, op.head_dim, op.page_size, op.group_size
    qdt, kvd = DTYPES[op.q_dtype].tir, op.kv_dtype
    kvdt = DTYPES[kvd].tir
    TX = cfg.row_lanes(D)  # lanes per row of D
    VEC = D // TX  # elements per lane
    H = cfg.heads  # q heads a block (threadIdx.z), all of one KV head's group
    NY = cfg.threads // (TX * H)  # lane groups a head, each over interleaved KV positions
    W = cfg.vec  # K/V elements a load
    WQ = max(1, min(W, 16 // DTYPES[op.q_dtype].itemsize))  # q elements a load (at most 16 bytes)
    NT = H * NY * TX  # threads a block
    CH = D // W  # loads a staged row
    KIT = (NY * CH + NT - 1) // NT  # staging loads a thread an iteration
    NSH = TX.bit_length() - 1  # butterfly steps over the TX lanes of a row
    quant, unified, with_lse = op.quantized, op.variant == "unified_masked", op.return_lse
    scale, NEG = op.sm_scale, neg_inf()
    lo_of, split = _ranges(op, S)
    FULL = 0xFFFFFFFF
    merge_row = merge_row_macro(S, op.q_dtype, op.return_lse)

    def tf(x, h, j, L, slopes):
        return transform_score(op, x, h, j, L, slopes)

    def head_of(bh, hz):  # the q head of block row bh, threadIdx.z hz
        return tirx.Cast("int64", bh) if H == 1 else tirx.Cast("int64", bh) * H + tirx.Cast("int64", hz)

    @T.macro
    def lane_load(dst, row, tx):
        # dst[v] = row(tx * VEC + v), W elements a (vector) load
        for v0 in T.unroll(VEC // W):
            for v1 in T.vectorized(W):
                dst[v0 * W + v1] = row(tx * VEC + v0 * W + v1)

    @T.macro
    def lane_dot(st, qv, kr, row, k_scale_of_row, tx, valid):
        # every lane reaches the shuffles (loop trip counts are block-uniform); loads are guarded
        st[2] = T.float32(0)
        if valid:
            if W == 1:
                for v in T.serial(VEC):
                    st[2] = st[2] + qv[v] * load_f32(kvd, row(tx * VEC + v))
            else:
                lane_load(kr, row, tx)
                for v in T.unroll(VEC):
                    st[2] = st[2] + qv[v] * load_f32(kvd, kr[v])
        for r in T.unroll(NSH):
            st[2] = st[2] + T.tvm_warp_shuffle_xor(FULL, st[2], (TX // 2) >> r, TX, 32)
        if quant and valid:
            st[2] = st[2] * k_scale_of_row

    @T.macro
    def online_update(st, acc, vr, row, v_scale_of_row, tx, score):
        m_new: T.let[T.float32] = T.max(st[0], score)
        alpha: T.let[T.float32] = T.exp(st[0] - m_new)
        p: T.let[T.float32] = T.exp(score - m_new)
        st[1] = st[1] * alpha + p
        st[0] = m_new
        st[3] = p
        if quant:
            st[3] = p * v_scale_of_row
        if W == 1:
            for v in T.serial(VEC):
                acc[v] = acc[v] * alpha + st[3] * load_f32(kvd, row(tx * VEC + v))
        else:
            lane_load(vr, row, tx)
            for v in T.unroll(VEC):
                acc[v] = acc[v] * alpha + st[3] * load_f32(kvd, vr[v])

    @T.macro
    def copy_row(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page, o, g, y, d0):
        # W elements of position (page, o)'s K and V rows into row y of sk / sv (and its scales, once a row)
        for w in T.vectorized(W):
            sk[y, d0 + w] = k_cache[page, o, g, d0 + w]
            sv[y, d0 + w] = v_cache[page, o, g, d0 + w]
        if quant and d0 == 0:
            sks[y] = k_scale[page, o, g]
            svs[y] = v_scale[page, o, g]

    @T.macro
    def stage(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page_table, s, g, a, b, it, num_seqs, max_pages,
              tid):
        # the block's threads copy the K/V rows of this iteration's NY positions (W elements a load) into sk / sv,
        # row y the position lane groups ty == y take; rows past the range (or on no page) are left as they are
        for k in T.serial(KIT):
            ch: T.let[T.int64] = T.Cast("int64", k * NT + tid)
            y: T.let[T.int64] = ch // CH
            d0: T.let[T.int64] = ch % CH * W
            if unified:
                cells: T.let[T.int64] = num_seqs * max_pages * P
                c: T.let[T.int64] = it * NY + y
                page: T.let[T.int64] = T.Cast("int64", T.if_then_else(
                    c < cells and ch < NY * CH, page_table[c // (max_pages * P) % num_seqs, c // P % max_pages], -1))
                if page >= 0:
                    copy_row(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page, c % P, g, y, d0)
            else:
                j: T.let[T.int64] = a + it * NY + y
                if j < b and ch < NY * CH:
                    page: T.let[T.int64] = T.Cast("int64", page_table[s, j // P])
                    copy_row(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page, j % P, g, y, d0)

    @T.macro
    def block(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes, o_partial,
              lse_partial, out, lse, num_seqs, max_pages, bt, bh, sp, hz, ty, tx):
        # one thread of the block of (token bt, q heads bh * H .. + H, split sp): head hz, lane group ty, lane tx
        qv = T.alloc_buffer((VEC,), "float32", scope="local")
        acc = T.alloc_buffer((VEC,), "float32", scope="local")
        st = T.alloc_buffer((4,), "float32", scope="local")  # m, l, dot, p*v_scale
        kr = T.alloc_buffer((VEC,), kvdt, scope="local")  # a lane's K / V elements (vector loads)
        vr = T.alloc_buffer((VEC,), kvdt, scope="local")
        qr = T.alloc_buffer((VEC,), qdt, scope="local")
        sm_m = T.alloc_buffer((H * NY,), "float32", scope="shared")
        sm_l = T.alloc_buffer((H * NY,), "float32", scope="shared")
        sm_acc = T.alloc_buffer((H * NY, D), "float32", scope="shared")
        t: T.let[T.int64] = T.Cast("int64", bt)
        h: T.let[T.int64] = head_of(bh, hz)
        g: T.let[T.int64] = h // G
        s: T.let[T.int64] = T.Cast("int64", token_seq[t])
        L: T.let[T.int64] = T.Cast("int64", token_kv_len[t])
        lo: T.let[T.int64] = lo_of(L)
        a: T.let[T.int64] = split(lo, L, sp)[0]
        b: T.let[T.int64] = split(lo, L, sp)[1]
        if W == 1:
            for v in T.serial(VEC):
                qv[v] = T.Cast("float32", q[t, h, tx * VEC + v]) * T.float32(scale)
                acc[v] = T.float32(0)
        else:
            for v0 in T.unroll(VEC // WQ):
                for v1 in T.vectorized(WQ):
                    qr[v0 * WQ + v1] = q[t, h, tx * VEC + v0 * WQ + v1]
            for v in T.unroll(VEC):
                qv[v] = T.Cast("float32", qr[v]) * T.float32(scale)
                acc[v] = T.float32(0)
        st[0] = NEG
        st[1] = T.float32(0)
        if H == 1:  # each lane reads its K/V elements from global memory
            if unified:
                cells: T.let[T.int64] = num_seqs * max_pages * P
                for it in T.serial((cells + NY - 1) // NY):
                    c: T.let[T.int64] = it * NY + T.Cast("int64", ty)
                    s2: T.let[T.int64] = c // (max_pages * P)
                    pi: T.let[T.int64] = c // P % max_pages
                    o: T.let[T.int64] = c % P
                    page: T.let[T.int64] = T.Cast("int64", T.if_then_else(
                        c < cells, page_table[s2 % num_seqs, pi], -1))
                    lane_dot(st, qv, kr, _row(k_cache, page, o, g), k_scale[page, o, g], tx, page >= 0)
                    if page >= 0 and s2 == s and pi * P + o >= a and pi * P + o < b:
                        online_update(st, acc, vr, _row(v_cache, page, o, g), v_scale[page, o, g], tx,
                                      tf(st[2], h, pi * P + o, L, alibi_slopes))
            else:
                for it in T.serial((b - a + NY - 1) // NY):
                    j: T.let[T.int64] = a + it * NY + T.Cast("int64", ty)
                    page: T.let[T.int64] = T.Cast("int64", T.if_then_else(
                        j < b, page_table[s, j // P], 0))
                    lane_dot(st, qv, kr, _row(k_cache, page, j % P, g), k_scale[page, j % P, g], tx, j < b)
                    if j < b:
                        online_update(st, acc, vr, _row(v_cache, page, j % P, g), v_scale[page, j % P, g], tx,
                                      tf(st[2], h, j, L, alibi_slopes))
        else:  # the block stages each iteration's K/V rows in shared memory once for its H heads
            sk = T.alloc_buffer((NY, D), kvdt, scope="shared")
            sv = T.alloc_buffer((NY, D), kvdt, scope="shared")
            sks = T.alloc_buffer((NY,), "float32", scope="shared")
            svs = T.alloc_buffer((NY,), "float32", scope="shared")
            tid: T.let[T.int32] = (hz * NY + ty) * TX + tx
            yy: T.let[T.int64] = T.Cast("int64", ty)
            if unified:
                cells: T.let[T.int64] = num_seqs * max_pages * P
                for it in T.serial((cells + NY - 1) // NY):
                    stage(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page_table, s, g, a, b, it,
                          num_seqs, max_pages, tid)
                    T.tvm_storage_sync("shared")
                    c: T.let[T.int64] = it * NY + yy
                    s2: T.let[T.int64] = c // (max_pages * P)
                    pi: T.let[T.int64] = c // P % max_pages
                    o: T.let[T.int64] = c % P
                    page: T.let[T.int64] = T.Cast("int64", T.if_then_else(
                        c < cells, page_table[s2 % num_seqs, pi], -1))
                    lane_dot(st, qv, kr, _row(sk, yy), sks[yy], tx, page >= 0)
                    if page >= 0 and s2 == s and pi * P + o >= a and pi * P + o < b:
                        online_update(st, acc, vr, _row(sv, yy), svs[yy], tx,
                                      tf(st[2], h, pi * P + o, L, alibi_slopes))
                    T.tvm_storage_sync("shared")
            else:
                for it in T.serial((b - a + NY - 1) // NY):
                    stage(sk, sv, sks, svs, k_cache, v_cache, k_scale, v_scale, page_table, s, g, a, b, it,
                          num_seqs, max_pages, tid)
                    T.tvm_storage_sync("shared")
                    j: T.let[T.int64] = a + it * NY + yy
                    lane_dot(st, qv, kr, _row(sk, yy), sks[yy], tx, j < b)
                    if j < b:
                        online_update(st, acc, vr, _row(sv, yy), svs[yy], tx, tf(st[2], h, j, L, alibi_slopes))
                    T.tvm_storage_sync("shared")
        if tx == 0:
            sm_m[hz * NY + ty] = st[0]
            sm_l[hz * NY + ty] = st[1]
        for v in T.serial(VEC):
            sm_acc[hz * NY + ty, tx * VEC + v] = acc[v]
        T.tvm_storage_sync("shared")
        if ty == 0:  # merge the NY partial softmax states of the head
            st[0] = NEG
            for y in T.serial(NY):
                st[0] = T.max(st[0], sm_m[hz * NY + y])
            st[1] = T.float32(0)
            for v in T.serial(VEC):
                acc[v] = T.float32(0)
            if st[0] > NEG:
                for y in T.serial(NY):
                    st[3] = T.exp(sm_m[hz * NY + y] - st[0])
                    st[1] = st[1] + sm_l[hz * NY + y] * st[3]
                    for v in T.serial(VEC):
                        acc[v] = acc[v] + sm_acc[hz * NY + y, tx * VEC + v] * st[3]
            inv: T.let[T.float32] = T.Select(st[1] > T.float32(0), T.float32(1) / st[1], T.float32(0))
            lse_v: T.let[T.float32] = T.Select(st[1] > T.float32(0), st[0] + T.log(st[1]), NEG)
            if S == 1:
                for v in T.serial(VEC):
                    out[t, h, tx * VEC + v] = T.Cast(qdt, acc[v] * inv)
                if with_lse and tx == 0:
                    lse[t, h] = lse_v
            else:
                for v in T.serial(VEC):
                    o_partial[sp, t, h, tx * VEC + v] = acc[v] * inv
                if tx == 0:
                    lse_partial[sp, t, h] = lse_v

    @T.macro
    def body(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale, alibi_slopes, o_partial,
             lse_partial, out, lse, num_tokens, num_seqs, max_pages):
        if H == 1:
            for bt in T.thread_binding(num_tokens, thread="blockIdx.x"):
                for bh in T.thread_binding(Hq, thread="blockIdx.y"):
                    for sp in T.thread_binding(S, thread="blockIdx.z"):
                        for ty in T.thread_binding(NY, thread="threadIdx.y"):
                            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                                block(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale, v_scale,
                                      alibi_slopes, o_partial, lse_partial, out, lse, num_seqs, max_pages, bt, bh, sp,
                                      0, ty, tx)
        else:
            for bt in T.thread_binding(num_tokens, thread="blockIdx.x"):
                for bh in T.thread_binding(Hq // H, thread="blockIdx.y"):
                    for sp in T.thread_binding(S, thread="blockIdx.z"):
                        for hz in T.thread_binding(H, thread="threadIdx.z"):
                            for ty in T.thread_binding(NY, thread="threadIdx.y"):
                                for tx in T.thread_binding(TX, thread="threadIdx.x"):
                                    block(q, k_cache, v_cache, token_seq, page_table, token_kv_len, k_scale,
                                          v_scale, alibi_slopes, o_partial, lse_partial, out, lse, num_seqs,
                                          max_pages, bt, bh, sp, hz, ty, tx)
        if fused:  # a second kernel (launched after the first, in program order) merges the partials
            for bt in T.thread_binding(num_tokens, thread="blockIdx.x"):
                for bh in T.thread_binding(Hq, thread="blockIdx.y"):
                    for tx in T.thread_binding(TX, thread="threadIdx.x"):
                        acc = T.alloc_buffer((VEC,), "float32", scope="local")
                        st = T.alloc_buffer((4,), "float32", scope="local")
                        merge_row(o_partial, lse_partial, out, lse, st, acc, T.Cast("int64", bt), T.Cast("int64", bh),
                                  tx * VEC, VEC)

    return _with_buffers(op, S, body)
