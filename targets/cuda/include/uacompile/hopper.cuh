// PTX wrappers of the Hopper (sm_90a) attention path: mbarriers, TMA tensor copies, named barriers, setmaxnreg,
// wgmma shared-memory descriptors (128-byte swizzle), register fences and wgmma fence / commit / wait.
#ifndef UA_HOPPER_CUH
#define UA_HOPPER_CUH
#include <cuda.h>  // CUtensorMap
#include "uacompile/common.cuh"

namespace ua {

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// No watchdog trap in here: a trap's exit path is shared by the producer's and the consumers' code,
// and ptxas then cannot give the consumers their setmaxnreg registers (it spills and serialises the
// wgmmas). The launcher checks the tensor maps instead.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4}], [%5];\n"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Shared-memory matrix descriptor, 128-byte swizzle (addresses and offsets in bytes), as its low
// word (start address >> 4 in bits 0-13, leading offset >> 4 in bits 16-29) and the constant high
// word (stride offset >> 4, the swizzle mode). The descriptor of tile + off is the low word plus
// off >> 4: shared memory ends below 256 KB, so the add never carries out of the address field,
// and a k-step's descriptor costs one integer add instead of rebuilding it from the address.
struct Desc {
  uint32_t lo;
  __device__ __forceinline__ uint64_t at(uint32_t off, uint32_t hi) const { return ((uint64_t)hi << 32) | (lo + (off >> 4)); }
};
// The tile addresses are the same in every lane; a broadcast from lane 0 lets ptxas see that and keep
// the descriptors in uniform registers (no per-wgmma register-to-uniform moves).
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo) { return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16); }
__device__ __forceinline__ Desc broadcast_desc(uint32_t lo) { return Desc{__shfl_sync(0xffffffffu, lo, 0)}; }
__device__ __forceinline__ Desc smem_desc(uint32_t addr, uint32_t lbo) { return broadcast_desc(desc_lo(addr, lbo)); }
constexpr uint32_t DESC_HI = (1024 >> 4) | (1u << 30);  // 8-row atoms 1024 B apart; 128-byte swizzle
// K tile (B of S = Q K^T) or Q rows (A), K-major: ROWS rows of 128 bytes per half, 8-row atoms
// 1024 B apart; k-step kk of 16 columns starts 32 B into its half.
template <int ROWS>
__device__ __forceinline__ uint64_t kmajor_desc(Desc tile, int kk) {
  return tile.at((kk / 4) * (ROWS * 128) + (kk % 4) * 32, DESC_HI);
}
// V tile (B of O += P V, N-major: d is contiguous): k-step kk takes 16 rows; the halves of d are
// (rows of the tile) * 128 B apart (the leading offset, in the descriptor's low word), 8-row groups 1024 B apart
// (stride offset).
__device__ __forceinline__ uint64_t v_desc(Desc tile, int kk) { return tile.at(kk * 2048, DESC_HI); }

template <typename T>
__device__ __forceinline__ void reg_fence(T& x) {  // keep the compiler from moving accesses across wgmma
  asm volatile("" : "+f"(x)::"memory");
}
template <int N>
__device__ __forceinline__ void fence_acc(float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(a[i][0]), reg_fence(a[i][1]), reg_fence(a[i][2]), reg_fence(a[i][3]);
}
// The A fragments of an O += P V: kept where they are until the wgmma that reads them has completed.
template <int N>
__device__ __forceinline__ void fence_frag(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}
__device__ __forceinline__ void wg_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

}  // namespace ua
#endif  // UA_HOPPER_CUH
