// Clean-room CPU emulation of the few AscendCL runtime calls the generated host code uses,
// so the same launcher source runs here (on the emulator) and on an NPU (with CANN's acl.h).
// Written from the public API descriptions; no Huawei code. "Device" memory is host memory
// registered as GM; copies are synchronous memcpy with bounds checks; streams are ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

inline aclError aclrtMalloc(void** ptr, size_t size, aclrtMemMallocPolicy) {
    if (!ptr || size == 0) return ACL_ERROR_INVALID_PARAM;
    *ptr = AscendC::GmAlloc(size);
    return ACL_SUCCESS;
}
inline aclError aclrtFree(void* ptr) {
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
