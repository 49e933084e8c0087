// uacompile CUDA layer-op header: block reductions, SiLU and RoPE's pair rotation, programmatic dependent launch,
// shared by the rms_norm, silu_and_mul, rope and qkv_rope_cache templates (after uacompile/common.cuh).
// Include-guarded.
#ifndef UA_LAYER_OPS_CUH
#define UA_LAYER_OPS_CUH

#include "uacompile/common.cuh"

namespace ua {

// The sum of x over the block's THREADS threads (a multiple of 32), returned to every thread.
// warp_sums holds THREADS / 32 floats of shared memory; the call synchronises the block.
template <int THREADS>
__device__ __forceinline__ float block_sum(float x, float* warp_sums) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block_sum: THREADS must be a multiple of 32, <= 1024");
  constexpr int WARPS = THREADS / 32;
  x = group_sum<32>(x);
  if constexpr (WARPS == 1) {
    return x;
  } else {
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += warp_sums[w];  // every thread, the same order: the same sum
    return total;
  }
}

// silu(g) = g / (1 + exp(-g)) in float32 (g -> -inf gives -0, as the float64 reference's limit)
__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, 1.0f + expf(-g)); }

// RoPE's rotation of the pair (a, b) by the angle with cosine cs and sine sn, in float64 with every
// product rounded (no FMA contraction), each output rounded once to T: reference.rope's
// a*cos - b*sin and b*cos + a*sin (reshape_and_cache's fused RoPE does the same arithmetic).
template <typename T>
__device__ __forceinline__ void rope_pair(T a, T b, double cs, double sn, T& out_a, T& out_b) {
  const double da = (double)to_float(a), db = (double)to_float(b);
  out_a = round_double<T>(__dsub_rn(__dmul_rn(da, cs), __dmul_rn(db, sn)));
  out_b = round_double<T>(__dadd_rn(__dmul_rn(db, cs), __dmul_rn(da, sn)));
}

// Programmatic dependent launch (PDL, sm_90+): a kernel launched with launch_pdl may start while the previous
// kernel on the stream drains. It may read what no earlier kernel writes (weights) before pdl_wait(), which waits
// for the previous grid's completion and its memory; every kernel calls pdl_wait() unconditionally, so a chain of
// them is ordered. pdl_launch_dependents() lets the next kernel start its own prologue now.
template <bool PDL>
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (PDL) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
template <bool PDL>
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (PDL) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launch kernel on stream, with the PDL attribute when pdl and pdl_allowed; returns the CUDA error code (0: launched).
template <typename... Params, typename... Args>
inline int launch_pdl(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && pdl_allowed(stream) ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  return err != cudaSuccess ? (int)err : (int)cudaGetLastError();
}

// A vector from lane src of a width-WIDTH lane group (every lane of the warp takes part): 4-byte words where the
// vector is made of them, else element by element through float (exact for every float dtype).
template <int WIDTH, typename T, int N>
__device__ __forceinline__ Vec<T, N> shfl_vec(const Vec<T, N>& x, int src) {
  Vec<T, N> y;
  if constexpr (sizeof(Vec<T, N>) % 4 == 0) {
    constexpr int WORDS = sizeof(Vec<T, N>) / 4;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&x);
    uint32_t* o = reinterpret_cast<uint32_t*>(&y);
#pragma unroll
    for (int i = 0; i < WORDS; ++i) o[i] = __shfl_sync(0xffffffffu, w[i], src, WIDTH);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) y.v[j] = from_float<T>(__shfl_sync(0xffffffffu, to_float(x.v[j]), src, WIDTH));
  }
  return y;
}

}  // namespace ua
#endif  // UA_LAYER_OPS_CUH
