// Clean-room CPU emulation of the AscendC programming model: core runtime.
//
// Written by this project from the documented semantics in docs/ASCENDC.md; no Huawei code.
// What lives here: the scalar types (half, bfloat16_t), the qualifiers, the error type,
// the per-block context (its own 192 KB Unified Buffer and event IDs), the GM registry that
// bounds every GlobalTensor, the block runners (threads for the NPU-style launch; one
// process per block for ICPU_RUN_KF, as CANN's CPU debug does) and GmAlloc.
#pragma once

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

// ------------------------------------------------------------------ qualifiers
#define __global__
#define __aicore__
#define __gm__
typedef uint8_t* GM_ADDR;

// ------------------------------------------------------------------ scalar types
using half = _Float16;

// bf16 as a struct: float -> bf16 rounds to nearest even (NaN stays NaN), bf16 -> float is exact.
struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    bfloat16_t(float f) {  // NOLINT: implicit, like the device type
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            bits = static_cast<uint16_t>(u >> 16);
        }
    }
    operator float() const {  // NOLINT
        uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

namespace ua_emu {

constexpr uint32_t kUbBytes = 196608;  // Unified Buffer per vector core (910B)
// UB the kernel's InitBuffer calls may take: the rest stays free as API scratch space
// (the generator's plan keeps the same reserve, see generate.UB_SCRATCH_RESERVE).
constexpr uint32_t kUbScratchReserve = 8192;
constexpr uint32_t kUbUsable = kUbBytes - kUbScratchReserve;
constexpr int kEventIds = 8;             // event IDs per HardEvent on A2 (0-7)
constexpr int kMaxQueBuffersPerPos = 8;  // TQue buffers per TPosition (each holds an event ID)
constexpr int kMaxBuffersPerKernel = 64; // every InitBuffer'd buffer of one kernel
constexpr int kNumHardEvents = 12;
constexpr uint32_t kBlockBytes = 32;   // DataCopy / UB alignment unit
constexpr uint8_t kPoison = 0xFF;      // fill of undefined UB bytes (NaN for floats)

// Every rule violation raises this; the runner reports the first one per launch.
struct Error : std::exception {
    std::string msg;
    explicit Error(std::string m) : msg(std::move(m)) {}
    const char* what() const noexcept override { return msg.c_str(); }
};

inline std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

#define UA_EMU_CHECK(cond, ...)                                        \
    do {                                                               \
        if (!(cond)) throw ::ua_emu::Error(::ua_emu::format(__VA_ARGS__)); \
    } while (0)

// ------------------------------------------------------------------ per-block context
// Producer -> consumer pairs of the pipes (V vector, S scalar, MTE2 GM->UB, MTE3 UB->GM).
// All are read-after-write except the two write-after-read lists of the scalar unit:
// MTE3_S_WAR, UB an MTE3 copy may still read, which SetValue may overwrite only after
// WaitFlag<HardEvent::MTE3_S>; and MTE3_S_VIA_V, such UB whose VECOUT buffer was allocated
// again: AllocTensor orders the vector unit behind MTE3 (its MTE3_V wait), not the scalar
// unit, so the scalar unit is ordered once it waits on the vector unit (WaitFlag<V_S>) or on
// MTE3 (TQue AllocTensor / SetFlag-WaitFlag pages of the AscendC API reference).
enum Hazard { V_V, V_MTE3, V_S, MTE2_V, MTE2_S, MTE2_MTE3, S_V, S_MTE3, MTE3_S_WAR, MTE3_S_VIA_V, kNumHazards };

struct BlockContext {
    int64_t idx = 0, num = 1;
    std::vector<uint8_t> storage;
    uint8_t* ub = nullptr;        // 32 B aligned base of this core's UB
    bool pipe_active = false;     // one TPipe per kernel instance
    // Pipe hazards: UB ranges written by one pipe that another pipe may not touch yet,
    // indexed by Hazard; a sync (barrier, flag wait, queue hand-over) clears its list.
    std::vector<std::pair<const uint8_t*, const uint8_t*>> pending[kNumHazards];
    std::map<int, int> flags;     // (event, id) -> SetFlag count not yet waited
    // Event IDs in use per HardEvent: bit i of held[e] = ID i is held by a freed queue
    // buffer or an AllocEventID; issued[e] = IDs the pipe handed out and not yet spent: a
    // fetched ID serves one SetFlag/WaitFlag pair, an allocated one until ReleaseEventID.
    uint8_t held[kNumHardEvents] = {};
    uint8_t issued[kNumHardEvents] = {};
    void* pipe = nullptr;         // the kernel's TPipe (GetTPipePtr)
    bool deq_scale_set = false;   // SetDeqScale called (int32 -> half Cast)
    float deq_scale = 1.0f;
    std::vector<std::string> deferred;  // errors found in destructors (leaks)
    BlockContext(int64_t i, int64_t n) : idx(i), num(n), storage(kUbBytes + kBlockBytes, kPoison) {
        uintptr_t p = reinterpret_cast<uintptr_t>(storage.data());
        ub = storage.data() + ((kBlockBytes - p % kBlockBytes) % kBlockBytes);
    }
};

inline thread_local BlockContext* tls_block = nullptr;

inline BlockContext& block() {
    UA_EMU_CHECK(tls_block != nullptr, "AscendC API used outside a kernel launch (no ICPU_RUN_KF block)");
    return *tls_block;
}

// ------------------------------------------------------------------ GM registry
// Kernels may only touch GM inside registered regions (GmAlloc, aclrtMalloc, or the
// launcher's GmScope around caller buffers); SetGlobalBuffer checks against them.
struct GmRegion {
    const uint8_t* lo;
    const uint8_t* hi;
    std::string name;
    bool shared;  // GmAlloc: shared memory that every block process sees
};
inline std::mutex gm_mutex;
inline std::vector<GmRegion> gm_regions;
// Set in ICPU_RUN_KF's block processes: there only GmAlloc memory is GM (what a block
// writes anywhere else stays in its own process and is lost, as under CANN's CPU debug).
inline bool in_block_process = false;

inline void gm_register(const void* p, size_t bytes, const char* name, bool shared = false) {
    std::lock_guard<std::mutex> g(gm_mutex);
    auto* b = static_cast<const uint8_t*>(p);
    gm_regions.push_back({b, b + bytes, name, shared});
}
// True when p lies inside a GmAlloc region.
inline bool gm_is_shared(const void* p) {
    auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> g(gm_mutex);
    for (auto& r : gm_regions)
        if (r.shared && b >= r.lo && b < r.hi) return true;
    return false;
}
inline void gm_unregister(const void* p) {
    std::lock_guard<std::mutex> g(gm_mutex);
    for (size_t i = gm_regions.size(); i-- > 0;)
        if (gm_regions[i].lo == p) {
            gm_regions.erase(gm_regions.begin() + static_cast<long>(i));
            return;
        }
}
// Throws unless [p, p + bytes) lies inside one registered region.
inline void gm_check(const void* p, size_t bytes, const char* what) {
    if (bytes == 0) return;
    auto* b = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> g(gm_mutex);
    for (auto& r : gm_regions)
        if (b >= r.lo && b + bytes <= r.hi) {
            if (in_block_process && !r.shared)
                throw Error(format("%s: GM range [%p, +%zu B) is in '%s', which is not GmAlloc memory: ICPU_RUN_KF runs "
                                   "each block in its own process, so its writes there are lost",
                                   what, p, bytes, r.name.c_str()));
            return;
        }
    throw Error(format("%s: GM range [%p, +%zu B) is outside every registered GM buffer", what, p, bytes));
}

// RAII registration of caller buffers for one launch (the emulated launcher uses it).
struct GmScope {
    std::vector<const void*> ptrs;
    struct Buf {
        const void* p;
        size_t bytes;
        const char* name;
    };
    GmScope(std::initializer_list<Buf> bufs) {
        for (auto& b : bufs)
            if (b.p && b.bytes) {
                gm_register(b.p, b.bytes, b.name);
                ptrs.push_back(b.p);
            }
    }
    ~GmScope() {
        for (auto* p : ptrs) gm_unregister(p);
    }
    GmScope(const GmScope&) = delete;
    GmScope& operator=(const GmScope&) = delete;
};

// ------------------------------------------------------------------ the block runners
// One block's body with its own context; returns its first error ("" when clean). A
// SetFlag without its WaitFlag at kernel exit is an error (SetFlag/WaitFlag come in pairs).
inline std::string run_one_block(int64_t i, int64_t n, const std::function<void()>& body) {
    BlockContext ctx(i, n);
    tls_block = &ctx;
    std::string err;
    try {
        body();
    } catch (const std::exception& e) {
        err = e.what();
    }
    if (err.empty() && !ctx.deferred.empty()) err = ctx.deferred[0];
    if (err.empty())
        for (auto& f : ctx.flags)
            if (f.second > 0) {
                err = format("SetFlag (HardEvent #%d, event ID %d) without a WaitFlag before the kernel ends", f.first / 8,
                             f.first % 8);
                break;
            }
    tls_block = nullptr;
    return err;
}

// The NPU-style launch: one std::thread per block over shared GM. Each block has its own UB
// and checks; the first failing block's error is thrown.
inline void run_blocks(int64_t block_dim, const std::function<void()>& body) {
    UA_EMU_CHECK(block_dim >= 1 && block_dim <= 65535, "launch: blockDim must be in [1, 65535], got %lld",
                 static_cast<long long>(block_dim));
    std::vector<std::string> errors(static_cast<size_t>(block_dim));
    auto one = [&](int64_t i) { errors[static_cast<size_t>(i)] = run_one_block(i, block_dim, body); };
    const char* serial = std::getenv("UA_EMU_SERIAL");
    if (serial && serial[0] == '1') {
        for (int64_t i = 0; i < block_dim; ++i) one(i);
    } else {
        std::vector<std::thread> threads;
        threads.reserve(static_cast<size_t>(block_dim));
        for (int64_t i = 0; i < block_dim; ++i) threads.emplace_back(one, i);
        for (auto& t : threads) t.join();
    }
    for (int64_t i = 0; i < block_dim; ++i)
        if (!errors[static_cast<size_t>(i)].empty())
            throw Error(format("block %lld/%lld: %s", static_cast<long long>(i), static_cast<long long>(block_dim),
                               errors[static_cast<size_t>(i)].c_str()));
}

// ICPU_RUN_KF: one child process per block, like CANN's CPU debug. Only GmAlloc memory
// (shared mappings) carries results back; each block's error comes back through a shared
// page. Arguments must be GmAlloc pointers (checked before any block runs).
inline void run_block_processes(int64_t block_dim, const std::function<void()>& body) {
    UA_EMU_CHECK(block_dim >= 1 && block_dim <= 65535, "ICPU_RUN_KF: blockDim must be in [1, 65535], got %lld",
                 static_cast<long long>(block_dim));
    constexpr size_t kMsg = 512;
    const size_t bytes = kMsg * static_cast<size_t>(block_dim);
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    UA_EMU_CHECK(m != MAP_FAILED, "ICPU_RUN_KF: no shared memory for %lld block results", static_cast<long long>(block_dim));
    char* msgs = static_cast<char*>(m);
    std::memset(msgs, 0, bytes);
    std::vector<pid_t> pids;
    for (int64_t i = 0; i < block_dim; ++i) {
        pid_t pid = fork();
        if (pid == 0) {
            in_block_process = true;
            std::string err = run_one_block(i, block_dim, body);
            std::snprintf(msgs + kMsg * static_cast<size_t>(i), kMsg, "%s", err.empty() ? "" : err.c_str());
            _exit(err.empty() ? 0 : 1);
        }
        if (pid < 0) {
            std::snprintf(msgs + kMsg * static_cast<size_t>(i), kMsg, "fork failed");
            break;
        }
        pids.push_back(pid);
    }
    std::string first;
    for (size_t i = 0; i < pids.size(); ++i) {
        int status = 0;
        waitpid(pids[i], &status, 0);
        const char* msg = msgs + kMsg * i;
        if (first.empty() && msg[0])
            first = format("block %zu/%lld: %s", i, static_cast<long long>(block_dim), msg);
        else if (first.empty() && WIFSIGNALED(status))
            first = format("block %zu/%lld: killed by signal %d", i, static_cast<long long>(block_dim), WTERMSIG(status));
    }
    if (first.empty() && pids.size() < static_cast<size_t>(block_dim)) first = "ICPU_RUN_KF: fork failed";
    munmap(m, bytes);
    if (!first.empty()) throw Error(first);
}

// ICPU_RUN_KF's argument rule: every kernel argument is a GmAlloc pointer (or null).
template <typename... Args> inline void check_icpu_args(const char* kernel, Args... args) {
    int i = 0;
    auto one = [&](auto a) {
        ++i;
        if constexpr (std::is_pointer_v<decltype(a)>) {
            UA_EMU_CHECK(a == nullptr || gm_is_shared(a),
                         "ICPU_RUN_KF(%s): argument %d is not GmAlloc memory: CANN runs each block in its own process "
                         "and only GmAlloc shared memory carries the kernel's writes back",
                         kernel, i);
        }
    };
    (one(args), ...);
}

// The message of the last failed launch on this thread (launchers return non-zero).
inline std::string& last_error() {
    static thread_local std::string msg;
    return msg;
}

}  // namespace ua_emu

namespace AscendC {

inline int64_t GetBlockIdx() { return ua_emu::block().idx; }
inline int64_t GetBlockNum() { return ua_emu::block().num; }

// GM for CPU debugging: a shared mapping (seen by every block process), registered,
// page aligned, poisoned.
namespace detail_gm {
inline std::map<void*, size_t>& sizes() {
    static std::map<void*, size_t> m;
    return m;
}
}  // namespace detail_gm
inline void* GmAlloc(size_t bytes) {
    size_t padded = bytes ? bytes : 64;
    void* p = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw ua_emu::Error("GmAlloc: out of shared memory");
    std::memset(p, ua_emu::kPoison, padded);
    ua_emu::gm_register(p, bytes, "GmAlloc", true);
    std::lock_guard<std::mutex> g(ua_emu::gm_mutex);
    detail_gm::sizes()[p] = padded;
    return p;
}
inline void GmFree(void* p) {
    if (!p) return;
    ua_emu::gm_unregister(p);
    size_t n = 0;
    {
        std::lock_guard<std::mutex> g(ua_emu::gm_mutex);
        auto it = detail_gm::sizes().find(p);
        UA_EMU_CHECK(it != detail_gm::sizes().end(), "GmFree: %p did not come from GmAlloc", p);
        n = it->second;
        detail_gm::sizes().erase(it);
    }
    munmap(p, n);
}

enum class KernelMode { MIX_MODE, AIC_MODE, AIV_MODE };
inline void SetKernelMode(KernelMode) {}

}  // namespace AscendC

using AscendC::KernelMode;

// CANN's CPU-debug launch macro: arguments checked to be GmAlloc memory, then one process
// per block.
#define ICPU_RUN_KF(func, blockdim, ...)                            \
    do {                                                            \
        ::ua_emu::check_icpu_args(#func, __VA_ARGS__);              \
        ::ua_emu::run_block_processes((blockdim), [&]() { func(__VA_ARGS__); }); \
    } while (0)
