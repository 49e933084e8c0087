// uacompile CUDA layer-op header: block reductions, SiLU and RoPE's pair rotation, shared by the
// rms_norm, silu_and_mul and rope templates (after uacompile/common.cuh). Include-guarded.
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

}  // namespace ua
#endif  // UA_LAYER_OPS_CUH
