// Self-tests of the emulator's documented edge semantics and of its rejections. Each
// st_* entry runs a tiny kernel through ICPU_RUN_KF on caller buffers and returns 0, or
// 1 with the emulator's message in st_last_error(). tests/targets/ascend/test_ascend_emulator.py checks
// the results against numpy; this file only drives the API.
#include <cmath>
#include <string>

#include "acl/acl.h"
#include "kernel_operator.h"

using namespace AscendC;

namespace {
std::string g_error;

template <typename F> int guarded(F body, std::initializer_list<ua_emu::GmScope::Buf> bufs, int64_t blocks = 1)
{
    try {
        ua_emu::GmScope gm(bufs);
        ua_emu::run_blocks(blocks, body);
        return 0;
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
}

// GM in -> UB -> GM out through one VECIN/VECOUT queue of ub_bytes: load(gin, ub) fills the UB
// tensor, store(gout, ub) writes it back (each self-test below varies only these two steps).
template <typename T, class Load, class Store>
void through_ub(T* in, int64_t in_len, T* out, int64_t out_len, uint32_t ub_bytes, Load load, Store store)
{
    TPipe pipe;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, 1> que;
    pipe.InitBuffer(que, 1, ub_bytes);
    GlobalTensor<T> gin, gout;
    gin.SetGlobalBuffer(in, in_len);
    gout.SetGlobalBuffer(out, out_len);
    LocalTensor<T> t = que.AllocTensor<T>();
    load(gin, t);
    que.EnQue(t);
    t = que.DeQue<T>();
    store(gout, t);
    que.FreeTensor(t);
}

// GM -> UB -> GM of `count` elements with plain DataCopy.
template <typename T> void copy_through(T* in, T* out, int64_t n, uint32_t count)
{
    through_ub(in, n, out, n, 4096, [&](GlobalTensor<T>& g, LocalTensor<T>& t) { DataCopy(t, g, count); },
               [&](GlobalTensor<T>& g, LocalTensor<T>& t) { DataCopy(g, t, count); });
}

// UB -> GM of the first ub_len floats, after the copy in has landed.
inline auto ub_to_out(int64_t ub_len)
{
    return [ub_len](GlobalTensor<float>& g, LocalTensor<float>& t) {
        PipeBarrier<PIPE_ALL>();
        DataCopy(g, t, (uint32_t)ub_len);
    };
}

// Cast fp32 -> D with a rounding mode; n a multiple of 32.
template <typename D> int cast_from_f32(float* in, D* out, int64_t n, int mode)
{
    return guarded(
        [&] {
            TPipe pipe;
            TQue<TPosition::VECIN, 1> inq;
            TQue<TPosition::VECOUT, 1> outq;
            pipe.InitBuffer(inq, 1, (uint32_t)(n * 4));
            pipe.InitBuffer(outq, 1, (uint32_t)(n * sizeof(D)));
            GlobalTensor<float> gin;
            GlobalTensor<D> gout;
            gin.SetGlobalBuffer(in, n);
            gout.SetGlobalBuffer(out, n);
            LocalTensor<float> x = inq.AllocTensor<float>();
            DataCopy(x, gin, (uint32_t)n);
            inq.EnQue(x);
            x = inq.DeQue<float>();
            LocalTensor<D> y = outq.AllocTensor<D>();
            Cast(y, x, (RoundMode)mode, (uint32_t)n);
            outq.EnQue(y);
            y = outq.DeQue<D>();
            DataCopy(gout, y, (uint32_t)n);
            outq.FreeTensor(y);
            inq.FreeTensor(x);
        },
        {{in, (size_t)n * 4, "in"}, {out, (size_t)n * sizeof(D), "out"}});
}

}  // namespace

extern "C" {

const char* st_last_error(void) { return g_error.c_str(); }

int st_datacopy_half(uint16_t* in, uint16_t* out, int64_t n, uint32_t count)
{
    return guarded([&] { copy_through((half*)in, (half*)out, n, count); }, {{in, (size_t)n * 2, "in"}, {out, (size_t)n * 2, "out"}});
}

// GM -> UB with DataCopyParams, then the first ub_len floats of UB -> out.
int st_datacopy_params(float* in, int64_t in_len, float* out, int64_t ub_len, uint16_t count, uint16_t len,
                       uint16_t src_gap, uint16_t dst_gap)
{
    return guarded(
        [&] {
            through_ub(
                in, in_len, out, ub_len, 16384,
                [&](GlobalTensor<float>& g, LocalTensor<float>& t) {
                    Duplicate(t, 0.0f, 4096);
                    PipeBarrier<PIPE_ALL>();
                    DataCopy(t, g, DataCopyParams(count, len, src_gap, dst_gap));
                },
                ub_to_out(ub_len));
        },
        {{in, (size_t)in_len * 4, "in"}, {out, (size_t)ub_len * 4, "out"}});
}

// GM -> UB with DataCopyPad (UB pre-filled with 7.0), then ub_len floats of UB -> out.
int st_datacopy_pad_in(float* in, int64_t in_len, float* out, int64_t ub_len, uint16_t count, uint32_t len_bytes,
                       uint32_t src_gap_bytes, uint32_t dst_gap_blocks, int is_pad, int left, int right, float value)
{
    return guarded(
        [&] {
            through_ub(
                in, in_len, out, ub_len, 16384,
                [&](GlobalTensor<float>& g, LocalTensor<float>& t) {
                    Duplicate(t, 7.0f, 4096);
                    PipeBarrier<PIPE_ALL>();
                    DataCopyPad(t, g, DataCopyExtParams(count, len_bytes, src_gap_bytes, dst_gap_blocks, 0),
                                DataCopyPadExtParams<float>(is_pad != 0, (uint8_t)left, (uint8_t)right, value));
                },
                ub_to_out(ub_len));
        },
        {{in, (size_t)in_len * 4, "in"}, {out, (size_t)ub_len * 4, "out"}});
}

// ub_len floats in -> UB, then UB -> GM with DataCopyPad (out keeps what it had elsewhere).
int st_datacopy_pad_out(float* in, int64_t ub_len, float* out, int64_t out_len, uint16_t count, uint32_t len_bytes,
                        uint32_t src_gap_blocks, uint32_t dst_gap_bytes)
{
    return guarded(
        [&] {
            through_ub(
                in, ub_len, out, out_len, 16384,
                [&](GlobalTensor<float>& g, LocalTensor<float>& t) { DataCopy(t, g, (uint32_t)ub_len); },
                [&](GlobalTensor<float>& g, LocalTensor<float>& t) {
                    DataCopyPad(g, t, DataCopyExtParams(count, len_bytes, src_gap_blocks, dst_gap_bytes, 0));
                });
        },
        {{in, (size_t)ub_len * 4, "in"}, {out, (size_t)out_len * 4, "out"}});
}

// which 0: ReduceMax with index -> out = {max, index}; 1: ReduceSum -> out = {sum, 0}.
int st_reduce(int which, float* in, int64_t n, float* out)
{
    return guarded(
        [&] {
            TPipe pipe;
            TQue<TPosition::VECIN, 1> inq;
            TBuf<TPosition::VECCALC> tmp, res;
            pipe.InitBuffer(inq, 1, (uint32_t)(n * 4));
            pipe.InitBuffer(tmp, (uint32_t)(n * 4));
            pipe.InitBuffer(res, 32);
            GlobalTensor<float> gin;
            gin.SetGlobalBuffer(in, n);
            LocalTensor<float> x = inq.AllocTensor<float>();
            DataCopyPad(x, gin, DataCopyExtParams(1, (uint32_t)(n * 4), 0, 0, 0), DataCopyPadExtParams<float>());
            inq.EnQue(x);
            x = inq.DeQue<float>();
            LocalTensor<float> r = res.Get<float>();
            if (which == 0) ReduceMax(r, x, tmp.Get<float>(), (int32_t)n, true);
            else ReduceSum(r, x, tmp.Get<float>(), (int32_t)n);
            const TEventID id = pipe.FetchEventID(HardEvent::V_S);
            SetFlag<HardEvent::V_S>(id);
            WaitFlag<HardEvent::V_S>(id);
            out[0] = r.GetValue(0);
            out[1] = which == 0 ? (float)r.ReinterpretCast<uint32_t>().GetValue(1) : 0.0f;
            inq.FreeTensor(x);
        },
        {{in, (size_t)n * 4, "in"}});
}

int st_cast_f32_f16(float* in, uint16_t* out, int64_t n, int mode) { return cast_from_f32(in, (half*)out, n, mode); }
int st_cast_f32_bf16(float* in, uint16_t* out, int64_t n, int mode) { return cast_from_f32(in, (bfloat16_t*)out, n, mode); }
int st_cast_f32_i32(float* in, int32_t* out, int64_t n, int mode) { return cast_from_f32(in, out, n, mode); }

// Every block writes (GetBlockIdx, GetBlockNum) into out[2 * idx..].
int st_block_ids(int64_t* out, int64_t blocks)
{
    return guarded(
        [&] {
            GlobalTensor<int64_t> g;
            g.SetGlobalBuffer(out, blocks * 2);
            g.SetValue(GetBlockIdx() * 2, GetBlockIdx());
            g.SetValue(GetBlockIdx() * 2 + 1, GetBlockNum());
        },
        {{out, (size_t)blocks * 16, "out"}}, blocks);
}

// Programs that break one rule each; the emulator must reject them.
int st_negative(const char* name)
{
    const std::string c = name;
    static float gm[1024];
    return guarded(
        [&] {
            TPipe pipe;
            TQue<TPosition::VECIN, 1> q;
            TQue<TPosition::VECIN, 1> q2;  // two buffers, depth 1
            TBuf<TPosition::VECCALC> a, b;
            GlobalTensor<float> g;
            g.SetGlobalBuffer(gm, 1024);
            if (c == "ub_overflow") {
                pipe.InitBuffer(a, 100000);
                pipe.InitBuffer(b, 100000);
                return;
            }
            pipe.InitBuffer(q, 1, 1024);
            pipe.InitBuffer(q2, 2, 1024);
            pipe.InitBuffer(a, 4096);
            pipe.InitBuffer(b, 4096);
            LocalTensor<float> x = a.Get<float>(), y = b.Get<float>();
            if (c == "datacopy_count") DataCopy(x, g, 12);  // 48 B
            if (c == "misaligned_ub") DataCopy(x[4], g, 8);  // UB offset 16 B
            if (c == "gm_out_of_bounds") DataCopy(x, g[1020], 8);
            if (c == "gm_unregistered") g.SetGlobalBuffer(gm + 1000, 64);
            if (c == "block_count") DataCopy(x, g, DataCopyParams(4096, 1, 0, 0));
            if (c == "pad_undefined") {  // isPad but the padded row is not 32 B
                DataCopyPad(x, g, DataCopyExtParams(1, 12, 0, 0, 0), DataCopyPadExtParams<float>(true, 0, 1, 0.0f));
            }
            if (c == "deque_empty") q.DeQue<float>();
            if (c == "alloc_beyond") {
                q.AllocTensor<float>();
                q.AllocTensor<float>();
            }
            if (c == "enque_beyond_depth") {
                q2.EnQue(q2.AllocTensor<float>());
                q2.EnQue(q2.AllocTensor<float>());
            }
            if (c == "double_free") {
                LocalTensor<float> t = q.AllocTensor<float>();
                q.FreeTensor(t);
                q.FreeTensor(t);
            }
            if (c == "free_queued") {
                LocalTensor<float> t = q.AllocTensor<float>();
                q.EnQue(t);
                q.FreeTensor(t);
            }
            if (c == "leak") q.AllocTensor<float>();
            if (c == "waitflag_unset") WaitFlag<HardEvent::V_S>(pipe.FetchEventID(HardEvent::V_S));
            if (c == "reduce_tmp_small") ReduceSum(y, x, y[1000], 64);
            if (c == "hazard_v_v") {
                Duplicate(x, 1.0f, 64);
                Add(y, x, x, 64);
            }
            if (c == "hazard_v_s") {
                Duplicate(x, 1.0f, 64);
                (void)x.GetValue(3);
            }
            if (c == "hazard_s_v") {
                x.SetValue(3, 1.0f);
                Adds(y, x, 1.0f, 64);
            }
            if (c == "hazard_mte2_v") {
                DataCopy(x, g, 64);
                Adds(y, x, 1.0f, 64);
            }
            if (c == "hazard_v_mte3") {
                Duplicate(x, 1.0f, 64);
                DataCopy(g, x, 64);
            }
            if (c == "partial_overlap") {
                Adds(x[8], x, 1.0f, 64);
            }
            if (c == "ok") {  // the control: the same calls, synchronised
                Duplicate(x, 1.0f, 64);
                PipeBarrier<PIPE_V>();
                Add(y, x, x, 64);
                const TEventID id = pipe.FetchEventID(HardEvent::V_S);
                SetFlag<HardEvent::V_S>(id);
                WaitFlag<HardEvent::V_S>(id);
                (void)y.GetValue(3);
                TEventID held = pipe.AllocEventID<HardEvent::S_V>();
                SetFlag<HardEvent::S_V>(held);
                WaitFlag<HardEvent::S_V>(held);
                pipe.ReleaseEventID<HardEvent::S_V>(held);
            }
            // ---- the contract rules of the TPipe, events, Cast and vector accuracy
            if (c == "ub_scratch_reserve") {  // fits the 192 KB UB but not the UB less its 8 KB scratch
                TBuf<TPosition::VECCALC> big;
                pipe.InitBuffer(big, 190000);
            }
            if (c == "event_id_literal") {  // what the templates did: SetFlag(0) with an ID the pipe never issued
                SetFlag<HardEvent::V_S>(0);
                WaitFlag<HardEvent::V_S>(0);
            }
            if (c == "event_id_literal_after_fetch") {  // a fetched ID serves one pair: a literal reuse is not issued
                const TEventID id = pipe.FetchEventID(HardEvent::V_S);
                SetFlag<HardEvent::V_S>(id);
                WaitFlag<HardEvent::V_S>(id);
                SetFlag<HardEvent::V_S>(0);
                WaitFlag<HardEvent::V_S>(0);
            }
            if (c == "scalar_war_mte3" || c == "scalar_war_mte3_synced") {  // SetValue on UB a copy to GM still reads
                Duplicate(x, 1.0f, 8);
                const TEventID vm = pipe.FetchEventID(HardEvent::V_MTE3);
                SetFlag<HardEvent::V_MTE3>(vm);
                WaitFlag<HardEvent::V_MTE3>(vm);
                const TEventID vs = pipe.FetchEventID(HardEvent::V_S);
                SetFlag<HardEvent::V_S>(vs);
                WaitFlag<HardEvent::V_S>(vs);
                DataCopy(g, x, 8);
                if (c == "scalar_war_mte3_synced") {
                    const TEventID ms = pipe.FetchEventID(HardEvent::MTE3_S);
                    SetFlag<HardEvent::MTE3_S>(ms);
                    WaitFlag<HardEvent::MTE3_S>(ms);
                }
                x.SetValue(0, 2.0f);
            }
            if (c == "event_id_reserved") {  // ID 7 belongs to the TPipe's automatic synchronisation
                SetFlag<HardEvent::V_S>(7);
                WaitFlag<HardEvent::V_S>(7);
            }
            if (c == "setflag_twice") {
                const TEventID id = pipe.FetchEventID(HardEvent::V_S);
                SetFlag<HardEvent::V_S>(id);
                SetFlag<HardEvent::V_S>(id);
            }
            if (c == "setflag_unwaited") SetFlag<HardEvent::V_S>(pipe.FetchEventID(HardEvent::V_S));
            if (c == "cast_bf16_none") {  // float -> bfloat16_t has no CAST_NONE on A2
                Cast(y.ReinterpretCast<bfloat16_t>(), x, RoundMode::CAST_NONE, 64);
            }
            if (c == "cast_i32_none") Cast(y.ReinterpretCast<int32_t>(), x, RoundMode::CAST_NONE, 64);
            if (c == "cast_i32_half_no_deqscale") Cast(y.ReinterpretCast<half>(), x.ReinterpretCast<int32_t>(), RoundMode::CAST_NONE, 64);
            if (c == "cast_i32_half_deqscale") {  // the control: with SetDeqScale the pair is valid
                Duplicate(x.ReinterpretCast<int32_t>(), 3, 64);
                PipeBarrier<PIPE_V>();
                SetDeqScale((half)0.5f);
                Cast(y.ReinterpretCast<half>(), x.ReinterpretCast<int32_t>(), RoundMode::CAST_NONE, 64);
                PipeBarrier<PIPE_V>();
                const TEventID id = pipe.FetchEventID(HardEvent::V_S);
                SetFlag<HardEvent::V_S>(id);
                WaitFlag<HardEvent::V_S>(id);
                UA_EMU_CHECK((float)y.ReinterpretCast<half>().GetValue(5) == 1.5f, "int32 -> half ignored the DeqScale");
            }
            if (c == "ln_zero") {  // what the templates did for an empty split: Ln(0)
                Duplicate(x, 0.0f, 8);
                PipeBarrier<PIPE_V>();
                Ln(y, x, 8);
            }
        },
        {{gm, sizeof(gm), "gm"}});
}

// Queue and buffer limits: each case sets up its own pipe.
int st_queue_limits(const char* name)
{
    const std::string c = name;
    return guarded(
        [&] {
            TPipe pipe;
            if (c == "attention_int8_queues") {  // the int8-KV attention layout the templates had: 9 VECIN buffers
                TQue<TPosition::VECIN, 1> q;
                TQue<TPosition::VECIN, 2> k, v, ks, vs;
                pipe.InitBuffer(q, 1, 512);
                pipe.InitBuffer(k, 2, 1024);
                pipe.InitBuffer(v, 2, 1024);
                pipe.InitBuffer(ks, 2, 512);
                pipe.InitBuffer(vs, 2, 512);
            }
            if (c == "attention_int8_queues_fixed") {  // both scales in one queue: 7 VECIN buffers
                TQue<TPosition::VECIN, 1> q;
                TQue<TPosition::VECIN, 2> k, v, scales;
                pipe.InitBuffer(q, 1, 512);
                pipe.InitBuffer(k, 2, 1024);
                pipe.InitBuffer(v, 2, 1024);
                pipe.InitBuffer(scales, 2, 1024);
            }
            if (c == "event_id_held_until_alloc") {  // 8 buffers, but an AllocEventID holds one V_MTE2 ID
                TQue<TPosition::VECIN, 1> q[8];
                for (auto& one : q) pipe.InitBuffer(one, 1, 256);
                TEventID id = pipe.AllocEventID<HardEvent::V_MTE2>();
                (void)id;
                for (auto& one : q) one.FreeTensor(one.AllocTensor<float>());  // the 8th freed buffer finds no ID
            }
            if (c == "event_id_freed_on_alloc") {  // the control: a freed buffer gives its ID back when reallocated
                TQue<TPosition::VECIN, 1> q[8];
                for (auto& one : q) pipe.InitBuffer(one, 1, 256);
                for (int round = 0; round < 3; ++round)
                    for (auto& one : q) one.FreeTensor(one.AllocTensor<float>());
            }
            if (c == "buffers_per_kernel") {
                static TBuf<TPosition::VECCALC> bufs[65];
                for (auto& b : bufs) b.addr_ = nullptr;
                for (auto& b : bufs) pipe.InitBuffer(b, 32);
            }
        },
        {});
}

// Soft-cap of n scores: cap - 2 cap / (exp(2 s / cap) + 1), the +1 reciprocal by Reciprocal
// (which = 0, what the templates did) or by Div (which = 1).
int st_softcap(int which, float* in, float* out, int64_t n, float cap)
{
    return guarded(
        [&] {
            through_ub(in, n, out, n, (uint32_t)(n * 4),
                       [&](GlobalTensor<float>& g, LocalTensor<float>& t) { DataCopy(t, g, (uint32_t)n); },
                       [&](GlobalTensor<float>& g, LocalTensor<float>& t) {
                           TBuf<TPosition::VECCALC> wb, cb;
                           GetTPipePtr()->InitBuffer(wb, (uint32_t)(n * 4));
                           GetTPipePtr()->InitBuffer(cb, (uint32_t)(n * 4));
                           LocalTensor<float> w = wb.Get<float>(), k = cb.Get<float>();
                           PipeBarrier<PIPE_ALL>();  // the scores have landed
                           Muls(w, t, 2.0f / cap, (int32_t)n);
                           Duplicate(k, -2.0f * cap, (int32_t)n);
                           PipeBarrier<PIPE_V>();
                           Exp(w, w, (int32_t)n);
                           PipeBarrier<PIPE_V>();
                           Adds(w, w, 1.0f, (int32_t)n);
                           PipeBarrier<PIPE_V>();
                           if (which == 0) {
                               Reciprocal(w, w, (int32_t)n);
                               PipeBarrier<PIPE_V>();
                               Muls(w, w, -2.0f * cap, (int32_t)n);
                           } else {
                               Div(w, k, w, (int32_t)n);
                           }
                           PipeBarrier<PIPE_V>();
                           Adds(t, w, cap, (int32_t)n);
                           PipeBarrier<PIPE_ALL>();
                           DataCopy(g, t, (uint32_t)n);
                       });
        },
        {{in, (size_t)n * 4, "in"}, {out, (size_t)n * 4, "out"}});
}

// The tiling upload the launchers had: slots sizeof(tiling) = 40 B apart (slot = 1 here),
// or 64 B apart; returns 0 when aclrtMemcpyAsync accepted the copy.
int st_tiling_slot(int64_t stride, int64_t slot)
{
    try {
        uint8_t *dev = nullptr, *host = nullptr;
        if (aclrtMalloc((void**)&dev, 64 * 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) return 2;
        if (aclrtMallocHost((void**)&host, 64 * 64) != ACL_SUCCESS) return 2;
        std::memset(host, 0, 64 * 64);
        const aclError rc =
            aclrtMemcpyAsync(dev + slot * stride, stride, host + slot * stride, 40, ACL_MEMCPY_HOST_TO_DEVICE, nullptr);
        aclrtFree(dev);
        aclrtFreeHost(host);
        return rc == ACL_SUCCESS ? 0 : 2;
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
}

// ICPU_RUN_KF over n int64 slots: every block writes its index at out[idx] and into a global
// the other processes never see. gmalloc = 0 passes the caller's buffer (what the launchers
// did), 1 a GmAlloc copy (what CANN requires). Returns how many blocks saw the global set.
namespace {
int64_t g_private = 0;
void ua_selftest_kernel(GM_ADDR out)
{
    GlobalTensor<int64_t> g;
    g.SetGlobalBuffer((__gm__ int64_t*)out, GetBlockNum());
    g.SetValue(GetBlockIdx(), GetBlockIdx() + g_private);
    g_private = 1000;  // stays in this block's process
}
}  // namespace

int st_icpu_run(int64_t* out, int64_t blocks, int gmalloc)
{
    try {
        g_private = 0;
        ua_emu::GmScope scope{{out, (size_t)blocks * 8, "out"}};
        if (gmalloc) {
            uint8_t* g = (uint8_t*)AscendC::GmAlloc((size_t)blocks * 8);
            ICPU_RUN_KF(ua_selftest_kernel, blocks, g);
            std::memcpy(out, g, (size_t)blocks * 8);
            AscendC::GmFree(g);
        } else {
            uint8_t* g = (uint8_t*)out;
            ICPU_RUN_KF(ua_selftest_kernel, blocks, g);
        }
        return g_private == 0 ? 0 : 3;  // a block's global write must not reach the host
    } catch (const std::exception& e) {
        g_error = e.what();
        return 1;
    }
}

}  // extern "C"
