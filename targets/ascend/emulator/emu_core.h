// Clean-room CPU emulation of the AscendC programming model: core runtime.
//
// Written by this project from the documented semantics in docs/ASCENDC.md; no Huawei code.
// What lives here: the scalar types (half, bfloat16_t), the qualifiers, the error type,
// the per-block context (one thread per block, each with its own 192 KB Unified Buffer),
// the GM registry that bounds every GlobalTensor, and ICPU_RUN_KF / GmAlloc.
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
#include <vector>

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
enum Hazard { V_V, V_MTE3, V_S, MTE2_V, MTE2_S, MTE2_MTE3, S_V, S_MTE3, kNumHazards };

struct BlockContext {
    int64_t idx = 0, num = 1;
    std::vector<uint8_t> storage;
    uint8_t* ub = nullptr;        // 32 B aligned base of this core's UB
    bool pipe_active = false;     // one TPipe per kernel instance
    // Pipe hazards: UB ranges written by one pipe that another pipe may not touch yet,
    // indexed by Hazard; a sync (barrier, flag wait, queue hand-over) clears its list.
    std::vector<std::pair<const uint8_t*, const uint8_t*>> pending[kNumHazards];
    std::map<int, int> flags;     // (event, id) -> SetFlag count not yet waited
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
};
inline std::mutex gm_mutex;
inline std::vector<GmRegion> gm_regions;

inline void gm_register(const void* p, size_t bytes, const char* name) {
    std::lock_guard<std::mutex> g(gm_mutex);
    auto* b = static_cast<const uint8_t*>(p);
    gm_regions.push_back({b, b + bytes, name});
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
        if (b >= r.lo && b + bytes <= r.hi) return;
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

// ------------------------------------------------------------------ the block runner
// One std::thread per block over shared GM, like CANN's CPU debug runs one process per
// block. Each block has its own UB and checks; the first failing block's error is thrown.
inline void run_blocks(int64_t block_dim, const std::function<void()>& body) {
    UA_EMU_CHECK(block_dim >= 1 && block_dim <= 65535, "launch: blockDim must be in [1, 65535], got %lld",
                 static_cast<long long>(block_dim));
    std::vector<std::string> errors(static_cast<size_t>(block_dim));
    auto one = [&](int64_t i) {
        BlockContext ctx(i, block_dim);
        tls_block = &ctx;
        try {
            body();
        } catch (const std::exception& e) {
            errors[static_cast<size_t>(i)] = e.what();
        }
        if (errors[static_cast<size_t>(i)].empty() && !ctx.deferred.empty()) errors[static_cast<size_t>(i)] = ctx.deferred[0];
        tls_block = nullptr;
    };
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

// The message of the last failed launch on this thread (launchers return non-zero).
inline std::string& last_error() {
    static thread_local std::string msg;
    return msg;
}

}  // namespace ua_emu

namespace AscendC {

inline int64_t GetBlockIdx() { return ua_emu::block().idx; }
inline int64_t GetBlockNum() { return ua_emu::block().num; }

// GM for CPU debugging: registered, 64 B aligned, poisoned.
inline void* GmAlloc(size_t bytes) {
    size_t padded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, padded ? padded : 64);
    if (!p) throw ua_emu::Error("GmAlloc: out of host memory");
    std::memset(p, ua_emu::kPoison, padded ? padded : 64);
    ua_emu::gm_register(p, bytes, "GmAlloc");
    return p;
}
inline void GmFree(void* p) {
    ua_emu::gm_unregister(p);
    std::free(p);
}

enum class KernelMode { MIX_MODE, AIC_MODE, AIV_MODE };
inline void SetKernelMode(KernelMode) {}

}  // namespace AscendC

using AscendC::KernelMode;

// CANN's CPU-debug launch macro, here over threads.
#define ICPU_RUN_KF(func, blockdim, ...) ::ua_emu::run_blocks((blockdim), [&]() { func(__VA_ARGS__); })
