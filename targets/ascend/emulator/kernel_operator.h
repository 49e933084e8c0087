// Clean-room CPU emulation of the AscendC kernel API subset in docs/ASCENDC.md.
//
// Written by this project from documented semantics; no Huawei code. Strict by design:
// where the hardware silently misbehaves (DataCopy rounding a byte count down, a queue
// used out of order, UB overflow, unsynchronised scalar/vector access) the emulator
// throws ua_emu::Error with a one-line reason instead. Where the public description is
// vague we pick the stricter reading and say so next to the code. The documented contract
// it enforces (queue buffers per position, event IDs, the A2 Cast table, Reciprocal's
// accuracy, ...) is listed with its sources in targets/ascend/README.md.
#pragma once

#include <cmath>
#include <deque>
#include <map>
#include <limits>
#include <type_traits>

#include "emu_core.h"

enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };

namespace AscendC {

enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class HardEvent { MTE2_V, V_MTE2, MTE3_V, V_MTE3, MTE2_MTE3, MTE3_MTE2, S_V, V_S, MTE2_S, S_MTE2, MTE3_S, S_MTE3 };
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

template <typename T> class LocalTensor;

namespace detail {
using ua_emu::kBlockBytes;
using ua_emu::kUbBytes;

inline uint64_t round32(uint64_t bytes) { return (bytes + kBlockBytes - 1) / kBlockBytes * kBlockBytes; }

// [p, p + bytes) must lie in this core's UB and start 32 B aligned.
inline void check_ub(const void* p, uint64_t bytes, const char* api, const char* arg) {
    auto& b = ua_emu::block();
    auto* q = static_cast<const uint8_t*>(p);
    UA_EMU_CHECK(q != nullptr, "%s: %s is an empty LocalTensor (not from AllocTensor/DeQue/TBuf::Get)", api, arg);
    UA_EMU_CHECK(q >= b.ub && q + bytes <= b.ub + kUbBytes, "%s: %s range is outside this core's Unified Buffer", api, arg);
    UA_EMU_CHECK((q - b.ub) % kBlockBytes == 0, "%s: %s starts at UB offset %td, which is not 32 B aligned", api, arg,
                 q - b.ub);
}

template <typename T>
inline void check_local(const LocalTensor<T>& t, uint64_t count, const char* api, const char* arg) {
    UA_EMU_CHECK(count <= t.GetSize(), "%s: count %llu exceeds %s's %u elements", api,
                 static_cast<unsigned long long>(count), arg, t.GetSize());
    check_ub(t.addr_, count * sizeof(T), api, arg);
}

// ---- pipe hazards. The vector, scalar and two copy pipes run concurrently on the
// hardware; a pipe may touch UB another pipe wrote only after a sync. Each producer
// records the range it wrote under the hazards it creates; each consumer checks its
// ranges against the hazards it is exposed to; syncs clear lists.
using ua_emu::Hazard;
inline const char* hazard_fix(Hazard h) {
    switch (h) {
        case ua_emu::V_V: return "written by an earlier vector op, without PipeBarrier<PIPE_V>() in between";
        case ua_emu::V_MTE3: return "written by a vector op, without a VECOUT queue EnQue/DeQue or WaitFlag<HardEvent::V_MTE3>";
        case ua_emu::V_S: return "written by a vector op, without WaitFlag<HardEvent::V_S>";
        case ua_emu::MTE2_V: return "loaded by DataCopy, without a VECIN queue EnQue/DeQue or WaitFlag<HardEvent::MTE2_V>";
        case ua_emu::MTE2_S: return "loaded by DataCopy, without WaitFlag<HardEvent::MTE2_S>";
        case ua_emu::MTE2_MTE3: return "loaded by DataCopy, without a TQueBind EnQue/DeQue or WaitFlag<HardEvent::MTE2_MTE3>";
        case ua_emu::S_V: return "written by SetValue, without WaitFlag<HardEvent::S_V>";
        case ua_emu::MTE3_S_WAR:
        case ua_emu::MTE3_S_VIA_V:
            return "still read by a DataCopy to GM, without WaitFlag<HardEvent::MTE3_S> before the scalar write "
                   "(write-after-read)";
        default: return "written by SetValue, without WaitFlag<HardEvent::S_MTE3>";
    }
}
inline void produce(std::initializer_list<Hazard> hs, const void* p, uint64_t bytes) {
    auto* lo = static_cast<const uint8_t*>(p);
    auto* hi = lo + bytes;
    for (Hazard h : hs) {
        auto& v = ua_emu::block().pending[h];
        bool covered = false;
        for (size_t i = v.size(); i-- > 0;) {
            if (v[i].first <= lo && hi <= v[i].second) covered = true;
            else if (lo <= v[i].first && v[i].second <= hi) v.erase(v.begin() + static_cast<long>(i));
        }
        if (!covered) v.emplace_back(lo, hi);
    }
}
inline void consume(std::initializer_list<Hazard> hs, const void* p, uint64_t bytes, const char* api, const char* arg) {
    auto* lo = static_cast<const uint8_t*>(p);
    auto* hi = lo + bytes;
    for (Hazard h : hs)
        for (auto& r : ua_emu::block().pending[h])
            UA_EMU_CHECK(!(lo < r.second && r.first < hi), "%s: %s overlaps UB %s", api, arg, hazard_fix(h));
}
inline void clear(Hazard h) { ua_emu::block().pending[h].clear(); }

// A vector op: its operands must be free of unsynced writes; its outputs become pending.
struct VectorOp {
    const char* api;
    void in(const void* p, uint64_t bytes, const char* arg) const {
        consume({ua_emu::V_V, ua_emu::MTE2_V, ua_emu::S_V}, p, bytes, api, arg);
    }
    void out(const void* p, uint64_t bytes, const char* arg) const {
        in(p, bytes, arg);
        produce({ua_emu::V_V, ua_emu::V_MTE3, ua_emu::V_S}, p, bytes);
    }
};

// Distinct or identical operands only: a partial overlap has no defined result.
inline void check_alias(const void* a, uint64_t abytes, const void* b, uint64_t bbytes, const char* api) {
    auto *pa = static_cast<const uint8_t*>(a), *pb = static_cast<const uint8_t*>(b);
    bool overlap = pa < pb + bbytes && pb < pa + abytes;
    UA_EMU_CHECK(!overlap || pa == pb, "%s: operands partially overlap", api);
}

// Arithmetic of half/bf16 is done in float and rounded back (exact for + - * / since float
// carries more than twice their precision); integer types in int64.
template <typename T> struct Calc { using type = float; };
template <> struct Calc<int32_t> { using type = int64_t; };
template <> struct Calc<int16_t> { using type = int64_t; };
template <typename T> using calc_t = typename Calc<T>::type;
template <typename T> inline calc_t<T> up(T v) { return static_cast<calc_t<T>>(static_cast<float>(v)); }
template <> inline int64_t up<int32_t>(int32_t v) { return v; }
template <> inline int64_t up<int16_t>(int16_t v) { return v; }
template <typename T, typename C> inline T down(C v) { return static_cast<T>(v); }
template <> inline bfloat16_t down<bfloat16_t, float>(float v) { return bfloat16_t(v); }

template <typename T> struct NonDeduced { using type = T; };
}  // namespace detail

// ------------------------------------------------------------------ tensors
template <typename T> class GlobalTensor {
  public:
    void SetGlobalBuffer(__gm__ T* buffer, uint64_t size) {
        ua_emu::gm_check(buffer, size * sizeof(T), "GlobalTensor::SetGlobalBuffer");
        addr_ = buffer;
        size_ = size;
    }
    GlobalTensor operator[](uint64_t offset) const {
        UA_EMU_CHECK(offset <= size_, "GlobalTensor[%llu]: offset past the buffer's %llu elements",
                     static_cast<unsigned long long>(offset), static_cast<unsigned long long>(size_));
        GlobalTensor t;
        t.addr_ = addr_ + offset;
        t.size_ = size_ - offset;
        return t;
    }
    T GetValue(uint64_t i) const {
        UA_EMU_CHECK(i < size_, "GlobalTensor::GetValue(%llu): out of bounds (%llu elements)",
                     static_cast<unsigned long long>(i), static_cast<unsigned long long>(size_));
        return addr_[i];
    }
    void SetValue(uint64_t i, T v) const {
        UA_EMU_CHECK(i < size_, "GlobalTensor::SetValue(%llu): out of bounds (%llu elements)",
                     static_cast<unsigned long long>(i), static_cast<unsigned long long>(size_));
        addr_[i] = v;
    }
    uint64_t GetSize() const { return size_; }
    __gm__ T* GetPhyAddr() const { return addr_; }

    T* addr_ = nullptr;
    uint64_t size_ = 0;  // elements
};

template <typename T> class LocalTensor {
  public:
    LocalTensor() = default;
    LocalTensor(T* addr, uint32_t size) : addr_(addr), size_(size) {}
    LocalTensor operator[](uint32_t offset) const {
        UA_EMU_CHECK(offset <= size_, "LocalTensor[%u]: offset past the tensor's %u elements", offset, size_);
        return LocalTensor(addr_ + offset, size_ - offset);
    }
    T GetValue(uint32_t i) const {
        check_scalar("LocalTensor::GetValue", i);
        return addr_[i];
    }
    void SetValue(uint32_t i, T v) const {
        check_scalar("LocalTensor::SetValue", i);
        detail::consume({ua_emu::MTE3_S_WAR, ua_emu::MTE3_S_VIA_V}, addr_ + i, sizeof(T), "LocalTensor::SetValue",
                        "the element");
        addr_[i] = v;
        detail::produce({ua_emu::S_V, ua_emu::S_MTE3}, addr_ + i, sizeof(T));
    }
    template <typename U> LocalTensor<U> ReinterpretCast() const {
        return LocalTensor<U>(reinterpret_cast<U*>(addr_), static_cast<uint32_t>(uint64_t(size_) * sizeof(T) / sizeof(U)));
    }
    uint32_t GetSize() const { return size_; }
    T* GetPhyAddr() const { return addr_; }

    T* addr_ = nullptr;
    uint32_t size_ = 0;  // elements

  private:
    void check_scalar(const char* api, uint32_t i) const {
        UA_EMU_CHECK(addr_ != nullptr, "%s: empty LocalTensor", api);
        UA_EMU_CHECK(i < size_, "%s(%u): out of bounds (%u elements)", api, i, size_);
        detail::consume({ua_emu::V_S, ua_emu::MTE2_S}, addr_ + i, sizeof(T), api, "the element");
    }
};

// ------------------------------------------------------------------ queues and the pipe
namespace detail {
// A queue owns `num` equal buffers. A buffer is free, held (allocated or dequeued), or
// queued. Misuse is an error: Alloc with every buffer taken, EnQue beyond the depth or of
// a foreign tensor, DeQue of an empty queue, Free of a queued/free buffer, leaks at exit.
// Event IDs: a freed buffer keeps an event ID of its queue's "buffer free again" event
// (VECIN: V_MTE2, VECOUT: MTE3_V, VECIN->VECOUT: MTE3_MTE2) until it is allocated again,
// so a position holds at most kEventIds buffers (TQue docs, "TQue Buffer limit").
inline int take_event_id(int event, const char* api) {
    auto& b = ua_emu::block();
    for (int id = 0; id < ua_emu::kEventIds; ++id)
        if (!(b.held[event] & (1u << id))) {
            b.held[event] |= static_cast<uint8_t>(1u << id);
            return id;
        }
    throw ua_emu::Error(ua_emu::format("%s: no free event ID (all %d of HardEvent #%d are held by freed queue buffers or "
                                       "AllocEventID): more buffers on one position than the hardware has event IDs",
                                       api, ua_emu::kEventIds, event));
}
inline void give_event_id(int event, int id) { ua_emu::block().held[event] &= static_cast<uint8_t>(~(1u << id)); }

class QueueBase {
  public:
    // `handover`: the hazard a DeQue clears (data produced before EnQue is visible after it);
    // `position`: where the buffers count (TPosition as int); `free_event`: the HardEvent a
    // freed buffer holds an ID of.
    QueueBase(int32_t depth, int handover, int position, int free_event)
        : depth_(depth), handover_(handover), position_(position), free_event_(free_event) {}
    QueueBase(const QueueBase&) = delete;
    QueueBase& operator=(const QueueBase&) = delete;
    ~QueueBase() {
        int live = 0;
        for (auto& s : slots_) live += s.state != kFree;
        if (live && ua_emu::tls_block)
            ua_emu::tls_block->deferred.push_back(
                ua_emu::format("TQue destroyed with %d tensor(s) not freed (leaked at kernel exit)", live));
    }
    template <typename T> LocalTensor<T> AllocTensor() {
        UA_EMU_CHECK(!slots_.empty(), "TQue::AllocTensor before TPipe::InitBuffer");
        for (auto& s : slots_)
            if (s.state == kFree) {
                s.state = kHeld;
                if (s.event_id >= 0) give_event_id(free_event_, s.event_id);  // the wait on the free event
                s.event_id = -1;
                if (free_event_ == static_cast<int>(HardEvent::MTE3_V)) order_vector_after_mte3(s.addr);
                return LocalTensor<T>(reinterpret_cast<T*>(s.addr), static_cast<uint32_t>(bytes_ / sizeof(T)));
            }
        throw ua_emu::Error(ua_emu::format("TQue::AllocTensor: all %zu buffers are in use (FreeTensor missing?)", slots_.size()));
    }
    template <typename T> bool EnQue(const LocalTensor<T>& t) {
        int i = find(t.addr_, "TQue::EnQue");
        UA_EMU_CHECK(slots_[i].state == kHeld, "TQue::EnQue: tensor is %s", slots_[i].state == kQueued ? "already queued" : "not allocated");
        UA_EMU_CHECK(static_cast<int32_t>(fifo_.size()) < depth_, "TQue::EnQue beyond the queue depth %d", depth_);
        slots_[i].state = kQueued;
        fifo_.push_back(i);
        return true;
    }
    template <typename T> LocalTensor<T> DeQue() {
        UA_EMU_CHECK(!fifo_.empty(), "TQue::DeQue on an empty queue");
        int i = fifo_.front();
        fifo_.pop_front();
        slots_[i].state = kHeld;
        if (handover_ >= 0) clear(static_cast<Hazard>(handover_));
        return LocalTensor<T>(reinterpret_cast<T*>(slots_[i].addr), static_cast<uint32_t>(bytes_ / sizeof(T)));
    }
    template <typename T> void FreeTensor(const LocalTensor<T>& t) {
        int i = find(t.addr_, "TQue::FreeTensor");
        UA_EMU_CHECK(slots_[i].state == kHeld, "TQue::FreeTensor: tensor is %s",
                     slots_[i].state == kQueued ? "still queued (DeQue it first)" : "already free (double free)");
        slots_[i].event_id = take_event_id(free_event_, "TQue::FreeTensor");
        slots_[i].state = kFree;
    }
    // The MTE3_V wait of a VECOUT AllocTensor: the buffer's pending copy-out reads are
    // ordered for the vector unit; the scalar unit still needs a V_S or MTE3_S wait.
    void order_vector_after_mte3(const uint8_t* lo) {
        auto& war = ua_emu::block().pending[ua_emu::MTE3_S_WAR];
        auto& via = ua_emu::block().pending[ua_emu::MTE3_S_VIA_V];
        const uint8_t* hi = lo + bytes_;
        for (size_t i = war.size(); i-- > 0;)
            if (war[i].first < hi && lo < war[i].second) {
                via.push_back(war[i]);
                war.erase(war.begin() + static_cast<long>(i));
            }
    }
    void init(std::vector<uint8_t*> addrs, uint32_t bytes) {
        for (auto* a : addrs) slots_.push_back({a, kFree, -1});
        bytes_ = bytes;
    }
    bool initialised() const { return !slots_.empty(); }
    int position() const { return position_; }

  private:
    enum State { kFree, kHeld, kQueued };
    struct Slot {
        uint8_t* addr;
        State state;
        int event_id;  // held while free after a FreeTensor, else -1
    };
    int find(const void* p, const char* api) const {
        for (size_t i = 0; i < slots_.size(); ++i)
            if (slots_[i].addr == p) return static_cast<int>(i);
        throw ua_emu::Error(ua_emu::format("%s: tensor is not a whole buffer of this queue", api));
    }
    int32_t depth_;
    int handover_;
    int position_;
    int free_event_;
    uint32_t bytes_ = 0;
    std::vector<Slot> slots_;
    std::deque<int> fifo_;
};
}  // namespace detail

namespace detail {
constexpr int handover(TPosition src, TPosition dst) {
    return src == TPosition::VECIN && dst == TPosition::VECOUT ? ua_emu::MTE2_MTE3
           : src == TPosition::VECIN                          ? ua_emu::MTE2_V
           : src == TPosition::VECOUT                         ? ua_emu::V_MTE3
                                                              : -1;
}
}  // namespace detail

// VECIN: DataCopy in, vector ops out (MTE2 -> V); VECOUT: vector ops in, DataCopy out (V -> MTE3).
namespace detail {
constexpr int free_event(TPosition src, TPosition dst) {
    return src == TPosition::VECIN && dst == TPosition::VECOUT ? static_cast<int>(HardEvent::MTE3_MTE2)
           : src == TPosition::VECIN                          ? static_cast<int>(HardEvent::V_MTE2)
                                                              : static_cast<int>(HardEvent::MTE3_V);
}
}  // namespace detail
template <TPosition pos, int32_t depth = 1> class TQue : public detail::QueueBase {
  public:
    TQue() : QueueBase(depth, detail::handover(pos, pos), static_cast<int>(pos), detail::free_event(pos, pos)) {}
};
// A queue between two positions (VECIN -> VECOUT: GM -> UB -> GM copies, MTE2 -> MTE3); its
// buffers count on the source position.
template <TPosition src, TPosition dst, int32_t depth = 1> class TQueBind : public detail::QueueBase {
  public:
    TQueBind() : QueueBase(depth, detail::handover(src, dst), static_cast<int>(src), detail::free_event(src, dst)) {}
};

template <TPosition pos = TPosition::VECCALC> class TBuf {
  public:
    template <typename T> LocalTensor<T> Get() const {
        UA_EMU_CHECK(addr_ != nullptr, "TBuf::Get before TPipe::InitBuffer");
        return LocalTensor<T>(reinterpret_cast<T*>(addr_), static_cast<uint32_t>(bytes_ / sizeof(T)));
    }
    template <typename T> LocalTensor<T> Get(uint32_t len) const {
        UA_EMU_CHECK(addr_ != nullptr, "TBuf::Get before TPipe::InitBuffer");
        UA_EMU_CHECK(uint64_t(len) * sizeof(T) <= bytes_, "TBuf::Get(%u): more than the buffer's %u B", len, bytes_);
        return LocalTensor<T>(reinterpret_cast<T*>(addr_), len);
    }
    uint8_t* addr_ = nullptr;
    uint32_t bytes_ = 0;
};

using TEventID = int8_t;
namespace detail {
inline const char* event_name(HardEvent e) {
    static const char* names[] = {"MTE2_V", "V_MTE2", "MTE3_V", "V_MTE3", "MTE2_MTE3", "MTE3_MTE2",
                                  "S_V",    "V_S",    "MTE2_S", "S_MTE2", "MTE3_S",    "S_MTE3"};
    return names[static_cast<int>(e)];
}
// IDs 6 and 7 are not the kernel's: 6 is reserved by the system, 7 is used by the
// TPipe's automatic synchronisation (SetFlag/WaitFlag docs, constraints).
constexpr int kUserEventIds = 6;
}  // namespace detail

// Carves this core's UB into queue buffers and TBufs: everything within the UB less the
// scratch reserve, at most 8 queue buffers per TPosition, at most 64 buffers in all.
// Hands out event IDs for SetFlag/WaitFlag (FetchEventID, AllocEventID/ReleaseEventID).
class TPipe {
  public:
    TPipe() {
        auto& b = ua_emu::block();
        UA_EMU_CHECK(!b.pipe_active, "a second TPipe in one kernel instance");
        b.pipe_active = true;
        b.pipe = this;
    }
    ~TPipe() {
        if (ua_emu::tls_block) {
            ua_emu::tls_block->pipe_active = false;
            ua_emu::tls_block->pipe = nullptr;
        }
    }
    TPipe(const TPipe&) = delete;
    TPipe& operator=(const TPipe&) = delete;

    void InitBuffer(detail::QueueBase& que, uint8_t num, uint32_t len) {
        UA_EMU_CHECK(!que.initialised(), "TPipe::InitBuffer: queue initialised twice");
        UA_EMU_CHECK(num >= 1 && len > 0, "TPipe::InitBuffer: num (%u) and len (%u) must be > 0", num, len);
        int& at = per_position_[que.position()];
        UA_EMU_CHECK(at + num <= ua_emu::kMaxQueBuffersPerPos,
                     "TPipe::InitBuffer: %d queue buffers on one TPosition (#%d), the hardware has %d event IDs per "
                     "position and each freed buffer holds one (TQue buffer limit)",
                     at + num, que.position(), ua_emu::kMaxQueBuffersPerPos);
        at += num;
        count_buffers(num);
        uint32_t each = static_cast<uint32_t>(detail::round32(len));
        std::vector<uint8_t*> addrs;
        for (int i = 0; i < num; ++i) addrs.push_back(take(each));
        que.init(addrs, each);
    }
    template <TPosition p> void InitBuffer(TBuf<p>& buf, uint32_t len) {
        UA_EMU_CHECK(buf.addr_ == nullptr, "TPipe::InitBuffer: TBuf initialised twice");
        UA_EMU_CHECK(len > 0, "TPipe::InitBuffer: len must be > 0");
        count_buffers(1);
        buf.bytes_ = static_cast<uint32_t>(detail::round32(len));
        buf.addr_ = take(buf.bytes_);
    }
    void Destroy() {}
    uint32_t UsedBytes() const { return used_; }

    // An event ID free right now (not held by a queue buffer or AllocEventID); not reserved.
    TEventID FetchEventID(HardEvent e) {
        auto& b = ua_emu::block();
        const int ev = static_cast<int>(e);
        for (int id = 0; id < detail::kUserEventIds; ++id)
            if (!(b.held[ev] & (1u << id))) {
                b.issued[ev] |= static_cast<uint8_t>(1u << id);
                return static_cast<TEventID>(id);
            }
        throw ua_emu::Error(ua_emu::format("FetchEventID<%s>: every event ID is held", detail::event_name(e)));
    }
    template <HardEvent e> TEventID FetchEventID() { return FetchEventID(e); }
    // An event ID held until ReleaseEventID.
    template <HardEvent e> TEventID AllocEventID() {
        TEventID id = FetchEventID(e);
        ua_emu::block().held[static_cast<int>(e)] |= static_cast<uint8_t>(1u << id);
        return id;
    }
    template <HardEvent e> void ReleaseEventID(TEventID id) {
        auto& b = ua_emu::block();
        const int ev = static_cast<int>(e);
        UA_EMU_CHECK(id >= 0 && id < ua_emu::kEventIds && (b.held[ev] & (1u << id)),
                     "ReleaseEventID<%s>(%d): the ID was not allocated", detail::event_name(e), id);
        b.held[ev] &= static_cast<uint8_t>(~(1u << id));
        b.issued[ev] &= static_cast<uint8_t>(~(1u << id));
    }

  private:
    void count_buffers(int n) {
        buffers_ += n;
        UA_EMU_CHECK(buffers_ <= ua_emu::kMaxBuffersPerKernel,
                     "TPipe::InitBuffer: %d buffers in one kernel, at most %d are allowed", buffers_,
                     ua_emu::kMaxBuffersPerKernel);
    }
    uint8_t* take(uint32_t bytes) {
        UA_EMU_CHECK(uint64_t(used_) + bytes <= ua_emu::kUbUsable,
                     "UB overflow: InitBuffer of %u B brings this core to %llu B, the Unified Buffer holds %u B of which "
                     "%u B stay free as API scratch",
                     bytes, static_cast<unsigned long long>(uint64_t(used_) + bytes), ua_emu::kUbBytes,
                     ua_emu::kUbScratchReserve);
        uint8_t* p = ua_emu::block().ub + used_;
        used_ += bytes;
        return p;
    }
    uint32_t used_ = 0;
    int buffers_ = 0;
    std::map<int, int> per_position_;
};

inline TPipe* GetTPipePtr() {
    auto* p = static_cast<TPipe*>(ua_emu::block().pipe);
    UA_EMU_CHECK(p != nullptr, "GetTPipePtr: no TPipe in this kernel");
    return p;
}

// ------------------------------------------------------------------ data movement
struct DataCopyParams {  // lengths and gaps in 32 B blocks
    uint16_t blockCount = 1;
    uint16_t blockLen = 0;
    uint16_t srcStride = 0;  // gap between blocks on the source side
    uint16_t dstStride = 0;  // gap between blocks on the destination side
    DataCopyParams() = default;
    DataCopyParams(uint16_t count, uint16_t len, uint16_t src_gap, uint16_t dst_gap)
        : blockCount(count), blockLen(len), srcStride(src_gap), dstStride(dst_gap) {}
};

struct DataCopyExtParams {  // blockLen in bytes; GM gaps in bytes, UB gaps in 32 B blocks
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;
    uint32_t srcStride = 0;
    uint32_t dstStride = 0;
    uint32_t rsv = 0;
    DataCopyExtParams() = default;
    DataCopyExtParams(uint16_t count, uint32_t len, uint32_t src_gap, uint32_t dst_gap, uint32_t r = 0)
        : blockCount(count), blockLen(len), srcStride(src_gap), dstStride(dst_gap), rsv(r) {}
};

template <typename T> struct DataCopyPadExtParams {
    bool isPad = false;
    uint8_t leftPadding = 0;   // elements
    uint8_t rightPadding = 0;  // elements
    T paddingValue = T(0);
    DataCopyPadExtParams() = default;
    DataCopyPadExtParams(bool pad, uint8_t left, uint8_t right, T value)
        : isPad(pad), leftPadding(left), rightPadding(right), paddingValue(value) {}
};

namespace detail {
template <typename T> inline void check_count_rule(uint32_t count, const char* api) {
    UA_EMU_CHECK(count > 0, "%s: count must be > 0", api);
    UA_EMU_CHECK(uint64_t(count) * sizeof(T) % kBlockBytes == 0,
                 "%s: count*sizeof(T) = %llu B is not a multiple of 32 B (the hardware silently rounds it down; "
                 "use DataCopyPad)",
                 api, static_cast<unsigned long long>(uint64_t(count) * sizeof(T)));
}
inline void check_params(const DataCopyParams& p, const char* api) {
    UA_EMU_CHECK(p.blockCount >= 1 && p.blockCount <= 4095, "%s: blockCount %u not in [1, 4095]", api, p.blockCount);
    UA_EMU_CHECK(p.blockLen >= 1, "%s: blockLen must be >= 1 (32 B blocks)", api);
}
template <typename T> inline void check_gm(const GlobalTensor<T>& g, uint64_t elems, const char* api) {
    UA_EMU_CHECK(g.addr_ != nullptr, "%s: GlobalTensor without SetGlobalBuffer", api);
    UA_EMU_CHECK(elems <= g.size_, "%s: GM access of %llu elements past the GlobalTensor's %llu", api,
                 static_cast<unsigned long long>(elems), static_cast<unsigned long long>(g.size_));
}
// Strided block copy between two byte spans: `count` blocks of `len` bytes.
inline void copy_blocks(uint8_t* dst, uint64_t dst_step, const uint8_t* src, uint64_t src_step, uint32_t count,
                        uint64_t len) {
    for (uint32_t i = 0; i < count; ++i) std::memmove(dst + i * dst_step, src + i * src_step, len);
}
}  // namespace detail

template <typename T> void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
    detail::check_count_rule<T>(count, "DataCopy(GM->UB)");
    detail::check_local(dst, count, "DataCopy(GM->UB)", "dst");
    detail::check_gm(src, count, "DataCopy(GM->UB)");
    std::memcpy(dst.addr_, src.addr_, uint64_t(count) * sizeof(T));
    detail::produce({ua_emu::MTE2_V, ua_emu::MTE2_S, ua_emu::MTE2_MTE3}, dst.addr_, uint64_t(count) * sizeof(T));
}
template <typename T> void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
    detail::check_count_rule<T>(count, "DataCopy(UB->GM)");
    detail::check_local(src, count, "DataCopy(UB->GM)", "src");
    detail::check_gm(dst, count, "DataCopy(UB->GM)");
    detail::consume({ua_emu::V_MTE3, ua_emu::MTE2_MTE3, ua_emu::S_MTE3}, src.addr_, uint64_t(count) * sizeof(T), "DataCopy(UB->GM)", "src");
    detail::produce({ua_emu::MTE3_S_WAR}, src.addr_, uint64_t(count) * sizeof(T));
    std::memcpy(dst.addr_, src.addr_, uint64_t(count) * sizeof(T));
}
template <typename T> void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
    detail::check_count_rule<T>(count, "DataCopy(UB->UB)");
    detail::check_local(dst, count, "DataCopy(UB->UB)", "dst");
    detail::check_local(src, count, "DataCopy(UB->UB)", "src");
    detail::check_alias(dst.addr_, count * sizeof(T), src.addr_, count * sizeof(T), "DataCopy(UB->UB)");
    detail::VectorOp op{"DataCopy(UB->UB)"};  // a UB -> UB copy runs on the vector pipe
    op.in(src.addr_, uint64_t(count) * sizeof(T), "src");
    op.out(dst.addr_, uint64_t(count) * sizeof(T), "dst");
    std::memmove(dst.addr_, src.addr_, uint64_t(count) * sizeof(T));
}
template <typename T> void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& p) {
    const char* api = "DataCopy(GM->UB, params)";
    detail::check_params(p, api);
    uint64_t len = uint64_t(p.blockLen) * 32, n = p.blockCount;
    uint64_t src_step = len + uint64_t(p.srcStride) * 32, dst_step = len + uint64_t(p.dstStride) * 32;
    detail::check_local(dst, ((n - 1) * dst_step + len) / sizeof(T), api, "dst");
    detail::check_gm(src, ((n - 1) * src_step + len) / sizeof(T), api);
    detail::copy_blocks(reinterpret_cast<uint8_t*>(dst.addr_), dst_step, reinterpret_cast<const uint8_t*>(src.addr_),
                        src_step, p.blockCount, len);
    detail::produce({ua_emu::MTE2_V, ua_emu::MTE2_S, ua_emu::MTE2_MTE3}, dst.addr_, (n - 1) * dst_step + len);
}
template <typename T> void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& p) {
    const char* api = "DataCopy(UB->GM, params)";
    detail::check_params(p, api);
    uint64_t len = uint64_t(p.blockLen) * 32, n = p.blockCount;
    uint64_t src_step = len + uint64_t(p.srcStride) * 32, dst_step = len + uint64_t(p.dstStride) * 32;
    detail::check_local(src, ((n - 1) * src_step + len) / sizeof(T), api, "src");
    detail::check_gm(dst, ((n - 1) * dst_step + len) / sizeof(T), api);
    detail::consume({ua_emu::V_MTE3, ua_emu::MTE2_MTE3, ua_emu::S_MTE3}, src.addr_, (n - 1) * src_step + len, api, "src");
    detail::produce({ua_emu::MTE3_S_WAR}, src.addr_, (n - 1) * src_step + len);
    detail::copy_blocks(reinterpret_cast<uint8_t*>(dst.addr_), dst_step, reinterpret_cast<const uint8_t*>(src.addr_),
                        src_step, p.blockCount, len);
}

// GM -> UB of blockCount rows of blockLen bytes (GM gap srcStride bytes). Each UB row is
// [leftPadding elems][data][rightPadding elems] rounded up to 32 B, rows dstStride blocks
// apart. Stricter reading: with isPad the padded row must be exactly 32 B aligned (every
// byte defined); without isPad left/right must be 0 and the round-up tail is left
// undefined (filled with 0xFF here so kernels that read it fail their tests).
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
    const char* api = "DataCopyPad(GM->UB)";
    constexpr uint32_t sz = sizeof(T);
    UA_EMU_CHECK(p.blockCount >= 1 && p.blockCount <= 4095, "%s: blockCount %u not in [1, 4095]", api, p.blockCount);
    UA_EMU_CHECK(p.blockLen >= 1 && p.blockLen % sz == 0, "%s: blockLen %u B must be > 0 and a multiple of sizeof(T)",
                 api, p.blockLen);
    UA_EMU_CHECK(pad.leftPadding * sz <= 32 && pad.rightPadding * sz <= 32, "%s: left/right padding exceed 32 B", api);
    uint64_t left = uint64_t(pad.leftPadding) * sz, right = uint64_t(pad.rightPadding) * sz;
    if (pad.isPad) {
        UA_EMU_CHECK((left + p.blockLen + right) % 32 == 0,
                     "%s: with isPad, left + blockLen + right = %llu B must be a multiple of 32 B", api,
                     static_cast<unsigned long long>(left + p.blockLen + right));
    } else {
        UA_EMU_CHECK(left == 0 && right == 0, "%s: leftPadding/rightPadding need isPad = true", api);
    }
    uint64_t row = detail::round32(left + p.blockLen + right), ub_step = row + uint64_t(p.dstStride) * 32;
    uint64_t gm_step = uint64_t(p.blockLen) + p.srcStride, n = p.blockCount;
    detail::check_local(dst, ((n - 1) * ub_step + row) / sz, api, "dst");
    detail::check_gm(src, ((n - 1) * gm_step + p.blockLen) / sz, api);
    auto* d = reinterpret_cast<uint8_t*>(dst.addr_);
    auto* s = reinterpret_cast<const uint8_t*>(src.addr_);
    for (uint64_t r = 0; r < n; ++r) {
        uint8_t* out = d + r * ub_step;
        std::memset(out, ua_emu::kPoison, row);
        if (pad.isPad) {
            for (uint64_t i = 0; i < row / sz; ++i) std::memcpy(out + i * sz, &pad.paddingValue, sz);
        }
        std::memcpy(out + left, s + r * gm_step, p.blockLen);
    }
    detail::produce({ua_emu::MTE2_V, ua_emu::MTE2_S, ua_emu::MTE2_MTE3}, dst.addr_, (n - 1) * ub_step + row);
}

// UB -> GM of blockCount rows of exactly blockLen bytes: UB rows 32 B padded and srcStride
// blocks apart, GM rows dstStride bytes apart.
template <typename T> void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
    const char* api = "DataCopyPad(UB->GM)";
    constexpr uint32_t sz = sizeof(T);
    UA_EMU_CHECK(p.blockCount >= 1 && p.blockCount <= 4095, "%s: blockCount %u not in [1, 4095]", api, p.blockCount);
    UA_EMU_CHECK(p.blockLen >= 1 && p.blockLen % sz == 0, "%s: blockLen %u B must be > 0 and a multiple of sizeof(T)",
                 api, p.blockLen);
    uint64_t row = detail::round32(p.blockLen), ub_step = row + uint64_t(p.srcStride) * 32;
    uint64_t gm_step = uint64_t(p.blockLen) + p.dstStride, n = p.blockCount;
    detail::check_local(src, ((n - 1) * ub_step + row) / sz, api, "src");
    detail::check_gm(dst, ((n - 1) * gm_step + p.blockLen) / sz, api);
    detail::consume({ua_emu::V_MTE3, ua_emu::MTE2_MTE3, ua_emu::S_MTE3}, src.addr_, (n - 1) * ub_step + row, api, "src");
    detail::produce({ua_emu::MTE3_S_WAR}, src.addr_, (n - 1) * ub_step + row);
    detail::copy_blocks(reinterpret_cast<uint8_t*>(dst.addr_), gm_step, reinterpret_cast<const uint8_t*>(src.addr_),
                        ub_step, p.blockCount, p.blockLen);
}

// ------------------------------------------------------------------ vector ops
namespace detail {
template <typename T, typename F>
void unary(const char* api, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count, F f) {
    UA_EMU_CHECK(count >= 0, "%s: count must be >= 0", api);
    check_local(dst, count, api, "dst");
    check_local(src, count, api, "src");
    check_alias(dst.addr_, count * sizeof(T), src.addr_, count * sizeof(T), api);
    VectorOp op{api};
    op.in(src.addr_, count * sizeof(T), "src");
    op.out(dst.addr_, count * sizeof(T), "dst");
    for (int32_t i = 0; i < count; ++i) dst.addr_[i] = down<T>(f(up(src.addr_[i])));
}
template <typename T, typename F>
void binary(const char* api, const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, int32_t count,
            F f) {
    UA_EMU_CHECK(count >= 0, "%s: count must be >= 0", api);
    check_local(dst, count, api, "dst");
    check_local(a, count, api, "src0");
    check_local(b, count, api, "src1");
    check_alias(dst.addr_, count * sizeof(T), a.addr_, count * sizeof(T), api);
    check_alias(dst.addr_, count * sizeof(T), b.addr_, count * sizeof(T), api);
    VectorOp op{api};
    op.in(a.addr_, count * sizeof(T), "src0");
    op.in(b.addr_, count * sizeof(T), "src1");
    op.out(dst.addr_, count * sizeof(T), "dst");
    for (int32_t i = 0; i < count; ++i) dst.addr_[i] = down<T>(f(up(a.addr_[i]), up(b.addr_[i])));
}
template <typename T> using scalar_t = typename NonDeduced<T>::type;
}  // namespace detail

#define UA_EMU_BINARY(NAME, EXPR)                                                                             \
    template <typename T>                                                                                     \
    void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, int32_t count) { \
        detail::binary(#NAME, dst, src0, src1, count, [](auto a, auto b) { return EXPR; });                  \
    }
UA_EMU_BINARY(Add, a + b)
UA_EMU_BINARY(Sub, a - b)
UA_EMU_BINARY(Mul, a* b)
UA_EMU_BINARY(Div, a / b)
UA_EMU_BINARY(Max, a > b ? a : b)
UA_EMU_BINARY(Min, a < b ? a : b)
#undef UA_EMU_BINARY

#define UA_EMU_SCALAR(NAME, EXPR)                                                                               \
    template <typename T>                                                                                       \
    void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, detail::scalar_t<T> scalar, int32_t count) { \
        auto s = detail::up<T>(T(scalar));                                                                      \
        detail::unary(#NAME, dst, src, count, [s](auto a) { return EXPR; });                                    \
    }
UA_EMU_SCALAR(Adds, a + s)
UA_EMU_SCALAR(Muls, a* s)
UA_EMU_SCALAR(Maxs, a > s ? a : s)
UA_EMU_SCALAR(Mins, a < s ? a : s)
#undef UA_EMU_SCALAR

#define UA_EMU_UNARY(NAME, EXPR)                                                                 \
    template <typename T> void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count) { \
        static_assert(std::is_same_v<detail::calc_t<T>, float>, #NAME ": floating-point types only"); \
        detail::unary(#NAME, dst, src, count, [](float a) { return EXPR; });                     \
    }
// Exp of an infinity is rejected (stricter by choice: the Exp page gives no result for it);
// a running max starts at a finite floor (-2e38 in CANN's attention operators).
template <typename T> void Exp(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count) {
    static_assert(std::is_same_v<detail::calc_t<T>, float>, "Exp: floating-point types only");
    for (int32_t i = 0; i < count && i < static_cast<int32_t>(src.GetSize()); ++i)
        UA_EMU_CHECK(std::isfinite(static_cast<float>(src.addr_[i])),
                     "Exp: input %d is %g; Exp of an infinity is undocumented (start a running max at -2e38)", i,
                     static_cast<double>(static_cast<float>(src.addr_[i])));
    detail::unary("Exp", dst, src, count, [](float a) { return std::exp(a); });
}
UA_EMU_UNARY(Sqrt, std::sqrt(a))
UA_EMU_UNARY(Abs, std::fabs(a))
#undef UA_EMU_UNARY

// Ln of 0 or a negative number has no documented result on A2: rejected.
template <typename T> void Ln(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count) {
    static_assert(std::is_same_v<detail::calc_t<T>, float>, "Ln: floating-point types only");
    for (int32_t i = 0; i < count && i < static_cast<int32_t>(src.GetSize()); ++i)
        UA_EMU_CHECK(!(static_cast<float>(src.addr_[i]) <= 0.0f),
                     "Ln: input %d is %g; Ln of a value <= 0 is undocumented on A2 (write -inf on the scalar unit)", i,
                     static_cast<double>(static_cast<float>(src.addr_[i])));
    detail::unary("Ln", dst, src, count, [](float a) { return std::log(a); });
}

// Reciprocal is documented as less accurate than the 1e-4 (float) / 1e-3 (half) relative
// criterion ("use Div where accuracy matters"): the emulator returns 1/x off by that bound.
template <typename T> void Reciprocal(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count) {
    static_assert(std::is_same_v<detail::calc_t<T>, float>, "Reciprocal: floating-point types only");
    constexpr float rel = sizeof(T) == 4 ? 1e-4f : 1e-3f;
    detail::unary("Reciprocal", dst, src, count, [](float a) { return (1.0f / a) * (1.0f + rel); });
}

template <typename T> void Duplicate(const LocalTensor<T>& dst, detail::scalar_t<T> scalar, int32_t count) {
    UA_EMU_CHECK(count >= 0, "Duplicate: count must be >= 0");
    detail::check_local(dst, count, "Duplicate", "dst");
    detail::VectorOp{"Duplicate"}.out(dst.addr_, count * sizeof(T), "dst");
    for (int32_t i = 0; i < count; ++i) dst.addr_[i] = T(scalar);
}

// ------------------------------------------------------------------ Cast
namespace detail {
// The Atlas A2 Cast table (Cast docs, "Atlas A2 ... supported data type combinations"):
// for each (src, dst) the round modes it accepts, as a bit mask over RoundMode. 0 = the
// pair is not in the table. int32 -> half ignores the mode and needs SetDeqScale.
constexpr uint32_t bit(RoundMode m) { return 1u << static_cast<int>(m); }
constexpr uint32_t kNone = bit(RoundMode::CAST_NONE);
constexpr uint32_t kDirected = bit(RoundMode::CAST_RINT) | bit(RoundMode::CAST_FLOOR) | bit(RoundMode::CAST_CEIL) |
                               bit(RoundMode::CAST_ROUND) | bit(RoundMode::CAST_TRUNC);
constexpr uint32_t kAny = 0xFFu;
template <typename D, typename S> constexpr uint32_t cast_modes() {
    using std::is_same_v;
    if constexpr (is_same_v<S, int8_t> || is_same_v<S, uint8_t>) return is_same_v<D, half> ? kNone : 0;
    else if constexpr (is_same_v<S, int16_t>) return is_same_v<D, half> ? kDirected | kNone : is_same_v<D, float> ? kNone : 0;
    else if constexpr (is_same_v<S, half>) {
        if constexpr (is_same_v<D, int8_t> || is_same_v<D, uint8_t>) return kDirected | kNone;
        else if constexpr (is_same_v<D, int16_t> || is_same_v<D, int32_t>) return kDirected;
        else return is_same_v<D, float> ? kNone : 0;
    } else if constexpr (is_same_v<S, bfloat16_t>) return is_same_v<D, int32_t> ? kDirected : is_same_v<D, float> ? kNone : 0;
    else if constexpr (is_same_v<S, int32_t>) {
        if constexpr (is_same_v<D, int16_t> || is_same_v<D, int64_t>) return kNone;
        else if constexpr (is_same_v<D, half>) return kAny;
        else return is_same_v<D, float> ? kDirected | kNone : 0;
    } else if constexpr (is_same_v<S, float>) {
        if constexpr (is_same_v<D, half>) return kAny;
        else if constexpr (is_same_v<D, int16_t> || is_same_v<D, bfloat16_t> || is_same_v<D, int32_t> ||
                           is_same_v<D, float> || is_same_v<D, int64_t>) return kDirected;
        else return 0;
    } else if constexpr (is_same_v<S, int64_t>) return is_same_v<D, int32_t> ? kNone : is_same_v<D, float> ? kDirected : 0;
    else return 0;
}
inline const char* mode_name(RoundMode m) {
    static const char* names[] = {"CAST_NONE", "CAST_RINT", "CAST_FLOOR", "CAST_CEIL", "CAST_ROUND", "CAST_TRUNC", "CAST_ODD"};
    return names[static_cast<int>(m)];
}
template <typename T> constexpr const char* type_name() {
    if constexpr (std::is_same_v<T, float>) return "float";
    else if constexpr (std::is_same_v<T, half>) return "half";
    else if constexpr (std::is_same_v<T, bfloat16_t>) return "bfloat16_t";
    else if constexpr (std::is_same_v<T, int8_t>) return "int8_t";
    else if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t";
    else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
    else if constexpr (std::is_same_v<T, int32_t>) return "int32_t";
    else return "int64_t";
}
template <typename T> struct Format;  // significand bits (with the hidden one), min / max exponent
template <> struct Format<half> { static constexpr int p = 11, emin = -14, emax = 15; };
template <> struct Format<bfloat16_t> { static constexpr int p = 8, emin = -126, emax = 127; };
template <> struct Format<float> { static constexpr int p = 24, emin = -126, emax = 127; };
template <> struct Format<double> { static constexpr int p = 53, emin = -1022, emax = 1023; };

inline double round_integral(double s, RoundMode m) {
    switch (m) {
        case RoundMode::CAST_FLOOR: return std::floor(s);
        case RoundMode::CAST_CEIL: return std::ceil(s);
        case RoundMode::CAST_ROUND: return std::round(s);  // ties away from zero
        case RoundMode::CAST_TRUNC: return std::trunc(s);
        case RoundMode::CAST_ODD: {  // inexact results take the odd neighbour
            double t = std::trunc(s);
            if (t != s && std::fmod(t, 2.0) == 0.0) t += s > 0 ? 1.0 : -1.0;
            return t;
        }
        default: return std::nearbyint(s);  // CAST_NONE (when lossy) and CAST_RINT: ties to even
    }
}
// x (exact in double) rounded to a float format under mode m, with its overflow rule.
template <typename D> double round_float(double x, RoundMode m) {
    using F = Format<D>;
    if (!std::isfinite(x) || x == 0) return x;
    int e;
    std::frexp(x, &e);
    int lead = std::max(e - 1, F::emin);
    double quantum = std::ldexp(1.0, lead - (F::p - 1));
    double y = round_integral(x / quantum, m) * quantum;
    double maxf = std::ldexp(2.0 - std::ldexp(1.0, 1 - F::p), F::emax);
    if (std::fabs(y) <= maxf) return y;
    double inf = std::numeric_limits<double>::infinity();
    bool pos = x > 0;
    switch (m) {
        case RoundMode::CAST_TRUNC:
        case RoundMode::CAST_ODD: return pos ? maxf : -maxf;
        case RoundMode::CAST_FLOOR: return pos ? maxf : -inf;
        case RoundMode::CAST_CEIL: return pos ? inf : -maxf;
        default: return pos ? inf : -inf;
    }
}
template <typename D> D convert(double x, RoundMode m) {
    if constexpr (std::is_integral_v<D>) {
        if (std::isnan(x)) return D(0);
        double r = round_integral(x, m == RoundMode::CAST_NONE ? RoundMode::CAST_RINT : m);
        r = std::min<double>(std::max<double>(r, std::numeric_limits<D>::min()), std::numeric_limits<D>::max());
        return static_cast<D>(r);  // saturating
    } else {
        return D(static_cast<float>(round_float<D>(x, m)));
    }
}
template <typename S> double to_double(S v) {
    if constexpr (std::is_integral_v<S>) return static_cast<double>(v);
    else return static_cast<double>(static_cast<float>(v));
}
}  // namespace detail

// int32 -> half Cast scale (the mode is ignored for that pair; the scale must be set).
inline void SetDeqScale(half scale) {
    auto& b = ua_emu::block();
    b.deq_scale_set = true;
    b.deq_scale = static_cast<float>(scale);
}

// Only the pairs and round modes of the A2 table. Lossless conversions ignore the mode;
// lossy ones round by it (CAST_NONE = CAST_RINT). Float -> integer saturates.
template <typename D, typename S>
void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, RoundMode mode, uint32_t count) {
    static_assert(detail::cast_modes<D, S>() != 0, "Cast: conversion pair not in the Atlas A2 Cast table");
    const char* api = "Cast";
    constexpr uint32_t modes = detail::cast_modes<D, S>();
    UA_EMU_CHECK(modes & detail::bit(mode), "Cast %s -> %s: %s is not in the A2 Cast table for this pair",
                 detail::type_name<S>(), detail::type_name<D>(), detail::mode_name(mode));
    constexpr bool deq = std::is_same_v<S, int32_t> && std::is_same_v<D, half>;
    if constexpr (deq)
        UA_EMU_CHECK(ua_emu::block().deq_scale_set, "Cast int32_t -> half: needs SetDeqScale(half) first (the mode is ignored)");
    detail::check_local(dst, count, api, "dst");
    detail::check_local(src, count, api, "src");
    if constexpr (sizeof(D) == sizeof(S)) {
        detail::check_alias(dst.addr_, count * sizeof(D), src.addr_, count * sizeof(S), api);
    } else {
        auto *d = reinterpret_cast<uint8_t*>(dst.addr_), *s = reinterpret_cast<uint8_t*>(src.addr_);
        UA_EMU_CHECK(d + count * sizeof(D) <= s || s + count * sizeof(S) <= d, "Cast: operands of different widths overlap");
    }
    detail::VectorOp op{api};
    op.in(src.addr_, count * sizeof(S), "src");
    op.out(dst.addr_, count * sizeof(D), "dst");
    if constexpr (deq) {
        const double scale = ua_emu::block().deq_scale;
        for (uint32_t i = 0; i < count; ++i) dst.addr_[i] = detail::convert<D>(detail::to_double(src.addr_[i]) * scale, mode);
    } else {
        for (uint32_t i = 0; i < count; ++i) dst.addr_[i] = detail::convert<D>(detail::to_double(src.addr_[i]), mode);
    }
}

// ------------------------------------------------------------------ reductions
// dst[0] = result. Rule chosen here (conservative): the work tensor `tmp` holds at least
// `count` elements, does not overlap src/dst, and is clobbered. ReduceMax with calIndex
// also writes the index of the first maximum into dst[1] as the raw bits of an unsigned
// integer of T's width (read it through ReinterpretCast<uint32_t/uint16_t>()).
namespace detail {
template <typename T>
void check_reduce(const char* api, const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp,
                  int32_t count, uint32_t dst_elems) {
    UA_EMU_CHECK(count >= 1, "%s: count must be >= 1", api);
    check_local(dst, dst_elems, api, "dst");
    check_local(src, count, api, "src");
    check_local(tmp, count, api, "tmp");
    auto *t = reinterpret_cast<const uint8_t*>(tmp.addr_), *s = reinterpret_cast<const uint8_t*>(src.addr_),
         *d = reinterpret_cast<const uint8_t*>(dst.addr_);
    uint64_t tb = count * sizeof(T);
    UA_EMU_CHECK(t + tb <= s || s + tb <= t, "%s: tmp overlaps src", api);
    UA_EMU_CHECK(t + tb <= d || d + dst_elems * sizeof(T) <= t, "%s: tmp overlaps dst", api);
    VectorOp op{api};
    op.in(src.addr_, tb, "src");
    op.out(tmp.addr_, tb, "tmp");
    op.out(dst.addr_, dst_elems * sizeof(T), "dst");
}
}  // namespace detail

template <typename T>
void ReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp, int32_t count,
               bool calIndex = false) {
    detail::check_reduce("ReduceMax", dst, src, tmp, count, calIndex ? 2 : 1);
    int32_t best = 0;
    for (int32_t i = 1; i < count; ++i)
        if (detail::up(src.addr_[i]) > detail::up(src.addr_[best])) best = i;  // first max wins ties
    T value = src.addr_[best];
    std::memset(tmp.addr_, ua_emu::kPoison, count * sizeof(T));
    dst.addr_[0] = value;
    if (calIndex) {
        if constexpr (sizeof(T) == 4) {
            uint32_t idx = static_cast<uint32_t>(best);
            std::memcpy(&dst.addr_[1], &idx, 4);
        } else {
            uint16_t idx = static_cast<uint16_t>(best);
            std::memcpy(&dst.addr_[1], &idx, 2);
        }
    }
}

// Pairwise (tree) summation, each partial sum rounded to T.
template <typename T>
void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp, int32_t count) {
    detail::check_reduce("ReduceSum", dst, src, tmp, count, 1);
    std::vector<T> v(src.addr_, src.addr_ + count);
    for (size_t n = v.size(); n > 1; n = (n + 1) / 2) {
        for (size_t i = 0; i < n / 2; ++i) v[i] = detail::down<T>(detail::up(v[2 * i]) + detail::up(v[2 * i + 1]));
        if (n % 2) v[n / 2] = v[n - 1];
    }
    std::memset(tmp.addr_, ua_emu::kPoison, count * sizeof(T));
    dst.addr_[0] = v[0];
}

// ------------------------------------------------------------------ synchronisation
namespace detail {
// SetFlag/WaitFlag IDs (docs, constraints): 0-7 on A2; 6 and 7 are not the kernel's; with a
// TPipe the ID comes from FetchEventID/AllocEventID for the same HardEvent. A fetched ID is
// not occupied and serves the SetFlag/WaitFlag right after the fetch (FetchEventID,
// atlasascendc_api_07_0116): its WaitFlag spends it.
inline void check_event_id(const char* api, HardEvent e, int32_t id) {
    UA_EMU_CHECK(id >= 0 && id < ua_emu::kEventIds, "%s<%s>(%d): event id must be in [0, 8)", api, event_name(e), id);
    UA_EMU_CHECK(id < kUserEventIds, "%s<%s>(%d): event IDs 6 and 7 are reserved (6 system, 7 TPipe automatic sync)", api,
                 event_name(e), id);
    auto& b = ua_emu::block();
    if (b.pipe)
        UA_EMU_CHECK(b.issued[static_cast<int>(e)] & (1u << id),
                     "%s<%s>(%d): event ID not issued by the TPipe (take it from GetTPipePtr()->FetchEventID or "
                     "AllocEventID; a hard-coded ID can collide with the queues' and the compiler's own)",
                     api, event_name(e), id);
}
}  // namespace detail

template <pipe_t p> inline void PipeBarrier() {
    ua_emu::block();
    if (p == PIPE_V) detail::clear(ua_emu::V_V);
    if (p == PIPE_ALL)
        for (int h = 0; h < ua_emu::kNumHazards; ++h) detail::clear(static_cast<ua_emu::Hazard>(h));
}
template <HardEvent e> inline void SetFlag(int32_t id) {
    detail::check_event_id("SetFlag", e, id);
    int& n = ua_emu::block().flags[static_cast<int>(e) * 8 + id];
    UA_EMU_CHECK(n == 0, "SetFlag<%s>(%d) twice without a WaitFlag in between (undefined; hangs at the next barrier)",
                 detail::event_name(e), id);
    ++n;
}
template <HardEvent e> inline void WaitFlag(int32_t id) {
    detail::check_event_id("WaitFlag", e, id);
    auto& b = ua_emu::block();
    int& n = b.flags[static_cast<int>(e) * 8 + id];
    UA_EMU_CHECK(n > 0, "WaitFlag<%s>(%d) without a matching SetFlag (would hang)", detail::event_name(e), id);
    --n;
    const int ev = static_cast<int>(e);
    if (!(b.held[ev] & (1u << id))) b.issued[ev] &= static_cast<uint8_t>(~(1u << id));  // a fetched ID is spent
    switch (e) {  // the wait makes the producer pipe's earlier writes visible to the consumer
        case HardEvent::V_MTE3: detail::clear(ua_emu::V_MTE3); break;
        case HardEvent::V_S:
            detail::clear(ua_emu::V_S);
            detail::clear(ua_emu::MTE3_S_VIA_V);
            break;
        case HardEvent::MTE2_V: detail::clear(ua_emu::MTE2_V); break;
        case HardEvent::MTE2_S: detail::clear(ua_emu::MTE2_S); break;
        case HardEvent::MTE2_MTE3: detail::clear(ua_emu::MTE2_MTE3); break;
        case HardEvent::S_V: detail::clear(ua_emu::S_V); break;
        case HardEvent::S_MTE3: detail::clear(ua_emu::S_MTE3); break;
        case HardEvent::MTE3_S:
            detail::clear(ua_emu::MTE3_S_WAR);
            detail::clear(ua_emu::MTE3_S_VIA_V);
            break;
        default: break;  // the other write-after-read events are ordered by the queues
    }
}

}  // namespace AscendC
