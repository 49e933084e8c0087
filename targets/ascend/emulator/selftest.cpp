// Self-tests of the emulator's documented edge semantics and of its rejections. Each
// st_* entry runs a tiny kernel through ICPU_RUN_KF on caller buffers and returns 0, or
// 1 with the emulator's message in st_last_error(). tests/test_ascend_emulator.py checks
// the results against numpy; this file only drives the API.
#include <string>

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
            SetFlag<HardEvent::V_S>(0);
            WaitFlag<HardEvent::V_S>(0);
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
            if (c == "waitflag_unset") WaitFlag<HardEvent::V_S>(0);
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
                SetFlag<HardEvent::V_S>(0);
                WaitFlag<HardEvent::V_S>(0);
                (void)y.GetValue(3);
            }
        },
        {{gm, sizeof(gm), "gm"}});
}

}  // extern "C"
