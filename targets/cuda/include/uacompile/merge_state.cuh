// merge_state: S split-KV partials of H heads of width D -> out (and lse). One lane group of GROUP lanes per
// (token, head), VEC floats a load: out = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m), lse = m + log(sum);
// every split empty (lse = -inf) gives out = 0, lse = -inf.
#ifndef UA_MERGE_STATE_CUH
#define UA_MERGE_STATE_CUH
#include "uacompile/common.cuh"

namespace ua {

template <typename OutT, int S, int H, int D, int VEC, int GROUP, int THREADS_, bool RETURN_LSE>
struct MergeState {
  typedef OutT out_t;
  static constexpr int THREADS = THREADS_;
  static constexpr int CHUNKS = D / VEC;
  static constexpr int PER_LANE = (CHUNKS + GROUP - 1) / GROUP;
  static constexpr int ROWS_PER_BLOCK = THREADS / GROUP;

  static __device__ __forceinline__ void run(const float* __restrict__ o_partial, const float* __restrict__ lse_partial,
                                             out_t* __restrict__ out, float* __restrict__ lse_out, int64_t num_tokens) {
    const int64_t row = (int64_t)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / GROUP;  // token * H + head
    const int lane = threadIdx.x % GROUP;
    const int64_t rows = num_tokens * H;
    if (row >= rows) return;  // no shuffles below: groups may leave independently
    float m = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < S; ++s) m = fmaxf(m, lse_partial[s * rows + row]);
    float acc[PER_LANE][VEC] = {};
    float denom = 0.0f;
    if (m != -INFINITY) {
#pragma unroll 4
      for (int s = 0; s < S; ++s) {
        const float w = expf(lse_partial[s * rows + row] - m);  // 0 for an empty split
        denom += w;
        const float* o = o_partial + (s * rows + row) * D;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int c = lane + i * GROUP;
          if (c < CHUNKS) {
            const Vec<float, VEC> x = load_vec<float, VEC>(o + c * VEC);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[i][j] += w * x.v[j];
          }
        }
      }
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * GROUP;
      if (c < CHUNKS) {
        Vec<out_t, VEC> y;
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = from_float<out_t>(acc[i][j] * inv);
        store_vec<out_t, VEC>(out + row * D + c * VEC, y);
      }
    }
    if constexpr (RETURN_LSE) {
      if (lane == 0) lse_out[row] = denom > 0.0f ? m + logf(denom) : -INFINITY;
    }
  }
};

}  // namespace ua
#endif  // UA_MERGE_STATE_CUH
