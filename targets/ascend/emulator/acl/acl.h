// Clean-room CPU emulation of the few AscendCL runtime calls the generated host code uses,
// so the same launcher source runs here (on the emulator) and on an NPU (with CANN's acl.h).
// Written from the public API descriptions; no Huawei code. "Device" memory is host memory
// registered as GM; copies are synchronous memcpy with bounds checks; streams are ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "../emu_core.h"

typedef int aclError;
typedef void* aclrtStream;
constexpr aclError ACL_SUCCESS = 0;
constexpr aclError ACL_ERROR_INVALID_PARAM = 100000;

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEFAULT,
} aclrtMemcpyKind;

typedef enum aclrtMemMallocPolicy { ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY, ACL_MEM_MALLOC_NORMAL_ONLY } aclrtMemMallocPolicy;

namespace ua_emu {
// The calling thread's current device (aclrtSetDevice; 0 until set). Device memory belongs
// to the device current at its aclrtMalloc; a copy into it from another device's context
// is rejected (aclrtSetDevice: resources are per device).
inline int32_t& current_device() {
    static thread_local int32_t d = 0;
    return d;
}
// aclrtMalloc blocks (base -> size, device), for the rules of aclrtMemcpyAsync.
struct DeviceBlock {
    size_t size;
    int32_t device;
};
struct DeviceBlocks {
    std::mutex mu;
    std::map<const uint8_t*, DeviceBlock> size;
};
inline DeviceBlocks& device_blocks() {
    static DeviceBlocks d;
    return d;
}
// A block divided into pieces: each piece of len bytes takes m = ALIGN_UP(len, 32) + 32
// bytes and starts 64-byte aligned, ALIGN_UP(m, 64) apart (aclrtMallocAlign32, constraints:
// https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0096.html).
// A copy into a block that does not fill it from its base is a copy into a piece: its room
// (destMax) must be m and its offset a multiple of ALIGN_UP(m, 64).
inline void check_piece(const void* dst, size_t destMax, size_t count) {
    auto& d = device_blocks();
    std::lock_guard<std::mutex> lock(d.mu);
    auto* p = static_cast<const uint8_t*>(dst);
    auto it = d.size.upper_bound(p);
    if (it == d.size.begin()) return;
    --it;
    if (p >= it->first + it->second.size) return;
    UA_EMU_CHECK(it->second.device == current_device(),
                 "aclrtMemcpyAsync: dst %p is memory of device %d, the current device is %d", dst, it->second.device,
                 current_device());
    const size_t off = static_cast<size_t>(p - it->first);
    if (off == 0 && count == it->second.size) return;
    const size_t m = (count + 31) / 32 * 32 + 32, stride = (m + 63) / 64 * 64;
    UA_EMU_CHECK(destMax >= m && off % stride == 0,
                 "aclrtMemcpyAsync: a %zu B piece of an aclrtMalloc block needs ALIGN_UP(len, 32) + 32 = %zu B of room "
                 "at a multiple of %zu B; it has %zu B at offset %zu",
                 count, m, stride, destMax, off);
}
}  // namespace ua_emu

inline aclError aclrtMalloc(void** ptr, size_t size, aclrtMemMallocPolicy) {
    if (!ptr || size == 0) return ACL_ERROR_INVALID_PARAM;
    *ptr = AscendC::GmAlloc(size);
    auto& d = ua_emu::device_blocks();
    std::lock_guard<std::mutex> lock(d.mu);
    d.size[static_cast<const uint8_t*>(*ptr)] = {size, ua_emu::current_device()};
    return ACL_SUCCESS;
}
inline aclError aclrtFree(void* ptr) {
    {
        auto& d = ua_emu::device_blocks();
        std::lock_guard<std::mutex> lock(d.mu);
        d.size.erase(static_cast<const uint8_t*>(ptr));
    }
    AscendC::GmFree(ptr);
    return ACL_SUCCESS;
}
// Page-aligned, like the pinned memory the real call returns.
inline aclError aclrtMallocHost(void** ptr, size_t size) {
    if (!ptr || size == 0) return ACL_ERROR_INVALID_PARAM;
    *ptr = std::aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    return *ptr ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}
inline aclError aclrtFreeHost(void* ptr) {
    std::free(ptr);
    return ACL_SUCCESS;
}
// The emulator checks the device side of a copy against registered GM; a copy larger than
// destMax is refused, as the real call does. CANN 8.0's aclrtMemcpyAsync wants 64-byte
// aligned source and destination addresses: anything else is an error here.
inline aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                                 aclrtStream) {
    if (count > destMax || (!dst && count) || (!src && count)) return ACL_ERROR_INVALID_PARAM;
    UA_EMU_CHECK(reinterpret_cast<uintptr_t>(dst) % 64 == 0 && reinterpret_cast<uintptr_t>(src) % 64 == 0,
                 "aclrtMemcpyAsync: dst %p / src %p must both be 64-byte aligned", dst, src);
    if (kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE) ua_emu::gm_check(dst, count, "aclrtMemcpyAsync(dst)");
    if (kind != ACL_MEMCPY_DEVICE_TO_HOST && kind != ACL_MEMCPY_HOST_TO_HOST) ua_emu::check_piece(dst, destMax, count);
    if (kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE) ua_emu::gm_check(src, count, "aclrtMemcpyAsync(src)");
    if (kind == ACL_MEMCPY_DEFAULT) {  // direction from the addresses: here every side of a launch is registered
        ua_emu::gm_check(dst, count, "aclrtMemcpyAsync(dst)");
        ua_emu::gm_check(src, count, "aclrtMemcpyAsync(src)");
    }
    if (count) std::memmove(dst, src, count);
    return ACL_SUCCESS;
}
inline aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind) {
    return aclrtMemcpyAsync(dst, destMax, src, count, kind, nullptr);
}
inline aclError aclrtSynchronizeStream(aclrtStream) { return ACL_SUCCESS; }

// The current device of the calling thread (ua_emu::current_device).
inline aclError aclrtSetDevice(int32_t deviceId) {
    if (deviceId < 0) return ACL_ERROR_INVALID_PARAM;
    ua_emu::current_device() = deviceId;
    return ACL_SUCCESS;
}
inline aclError aclrtGetDevice(int32_t* deviceId) {
    if (!deviceId) return ACL_ERROR_INVALID_PARAM;
    *deviceId = ua_emu::current_device();
    return ACL_SUCCESS;
}
// Exported from every emulator build, so a host program (or a test through cffi) can make
// another device current on its thread without a CANN runtime.
extern "C" __attribute__((used, visibility("default"))) inline aclError ua_emu_set_device(int32_t deviceId) {
    return aclrtSetDevice(deviceId);
}

// Events: every stream operation here completes before it returns, so a recorded event
// has always completed.
typedef void* aclrtEvent;
inline aclError aclrtCreateEvent(aclrtEvent* event) {
    if (!event) return ACL_ERROR_INVALID_PARAM;
    *event = new int(0);
    return ACL_SUCCESS;
}
inline aclError aclrtRecordEvent(aclrtEvent event, aclrtStream) {
    if (!event) return ACL_ERROR_INVALID_PARAM;
    *static_cast<int*>(event) = 1;
    return ACL_SUCCESS;
}
inline aclError aclrtSynchronizeEvent(aclrtEvent event) { return event ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM; }
inline aclError aclrtDestroyEvent(aclrtEvent event) {
    delete static_cast<int*>(event);
    return ACL_SUCCESS;
}

// ascendc_library generates aclrtlaunch_<kernel>(blockDim, stream, args...) per kernel; here
// ACLRT_LAUNCH_KERNEL(kernel) gives a callable with that shape that runs the blocks as threads.
namespace ua_emu {
// The launch returns a status the caller must check ([[nodiscard]]: ignoring it does not
// build with -Werror).
template <typename... Args> struct KernelLauncher {
    void (*fn)(Args...);
    template <typename... Actual> [[nodiscard]] uint32_t operator()(uint32_t block_dim, aclrtStream, Actual... args) const {
        run_blocks(block_dim, [&]() { fn(static_cast<Args>(args)...); });
        return 0;
    }
};
template <typename... Args> KernelLauncher<Args...> launcher(void (*fn)(Args...)) { return {fn}; }
}  // namespace ua_emu
#define ACLRT_LAUNCH_KERNEL(kernel_func) ::ua_emu::launcher(kernel_func)
