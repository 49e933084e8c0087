// PTX wrappers of the attention kernels (sm_80 and newer): shared-memory addresses, cp.async, ldmatrix,
// mma.sync m16n8k16 with fp32 accumulation, 16-bit pair packing.
#ifndef UA_PTX_CUH
#define UA_PTX_CUH
#include "uacompile/common.cuh"

namespace ua {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// K/V loads carry the L2 prefetch-size hint .L2::128B: a warp's 16-byte loads cover whole 128-byte lines
// (without the hint, 1.5 L2 sectors a DRAM sector).
#define CP_ASYNC_CG "cp.async.cg.shared.global.L2::128B"
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile(CP_ASYNC_CG " [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix at a shared-space address (_at) or a generic pointer into shared memory
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4_at(r, smem_addr(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t (&r)[4], uint32_t a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ldmatrix_x4_trans_at(r, smem_addr(p)); }
// C[16x8] += A[16x16] * B[16x8], fp32 accumulate; A and B bf16 (BF16) or f16
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, "
                 "{ %0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, "
                 "{ %0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// two floats rounded to a pair of bf16 (BF16) or f16, as one 32-bit register
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (BF16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

}  // namespace ua
#endif  // UA_PTX_CUH
