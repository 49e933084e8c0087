// uacompile CUDA header: quantize_rows (ir.QuantizeRows), each row of x to 8 bits with its own float32 scale, bit for
// bit reference.quantize (the KV caches' math: common.cuh's Quant and quant_scale). One block a row, the row held in
// registers (PER_THREAD vectors a thread), so x is read once: the row's amax over the block (a NaN anywhere makes the
// scale 1, as amax > 0 fails on NaN), then every element divided by the scale (IEEE division) and converted.
// Include-guarded.
#ifndef UA_QUANTIZE_ROWS_CUH
#define UA_QUANTIZE_ROWS_CUH

#include "uacompile/common.cuh"

namespace ua {

// T: the activations' type; Q: int8_t (int8) or uint8_t (e4m3 bytes); E elements a row in vectors of VEC.
template <typename T, typename Q, int E, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_rows_kernel(const T* __restrict__ x, Q* __restrict__ out, float* __restrict__ scale) {
  static_assert(E % VEC == 0 && THREADS % 32 == 0 && THREADS <= 1024, "quantize_rows: bad shape");
  constexpr int CHUNKS = E / VEC, PER_THREAD = (CHUNKS + THREADS - 1) / THREADS, WARPS = THREADS / 32;
  __shared__ float warp_max[WARPS];
  const int64_t row = (int64_t)blockIdx.x * E;
  Vec<T, VEC> v[PER_THREAD];
  float amax = 0.0f;
  int nan = 0;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int c = threadIdx.x + i * THREADS;
    if (c < CHUNKS) {
      v[i] = load_vec<T, VEC>(x + row + c * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = fabsf(to_float(v[i].v[j]));
        nan |= a != a;
        amax = fmaxf(amax, a);  // fmaxf skips NaN: the flag carries it
      }
    }
  }
  amax = group_max<32>(amax);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  const bool any_nan = __syncthreads_or(nan);  // also the barrier before warp_max is read
#pragma unroll
  for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, warp_max[w]);
  const float s = any_nan ? 1.0f : quant_scale<Q>(amax);
  const float rcp = __frcp_rn(s);
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int c = threadIdx.x + i * THREADS;
    if (c < CHUNKS) {
      Vec<Q, VEC> q;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float y = div_rn(to_float(v[i].v[j]), s, rcp);
        q.v[j] = y != y ? (Q)0x7F : Quant<Q>::quantize(y);  // e4m3's NaN (int8 has none: the reference's cast)
      }
      store_vec<Q, VEC>(out + row + c * VEC, q);
    }
  }
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

}  // namespace ua
#endif  // UA_QUANTIZE_ROWS_CUH
