// qkv_rope_cache: the attention block's prologue in one launch. From the packed q/k/v projection
// qkv [T, HQ + 2 HKV, D]: each q and k head RMSNorm'd over D (QK_NORM), q and k rotated (RoPE), q written to
// q_out [T, HQ, D], the rotated K and V written into the paged cache at slot_mapping (-1 skips), quantised to
// int8 / fp8 with a scale a (token, head) where the cache is 8-bit.
//
// A block is one token's ROWS head rows (q, k and v heads in qkv's order: a block may hold rows of two kinds);
// a row is one lane group of GROUP lanes (a power of two >= D / VEC), each lane one vector of VEC elements, so a
// row is read once and held in registers. The token's D/2 angles are computed once a block (float64 sincos into
// shared memory). Every lane of a warp runs every shuffle (the norm's sum, RoPE's partner exchange, the amax);
// a row's kind only selects what is kept and where it is stored.
//
// The math is reference.qkv_rope_cache's: the norm in float32 with rms_norm's roundings
// (out = T(T(h * rstd) * w)), RoPE in float64 with every product rounded and one rounding to T
// (rope_pair), quantisation as reshape_and_cache (float32 scale = amax / QMAX, IEEE division, nearest-even).
#ifndef UA_QKV_ROPE_CACHE_CUH
#define UA_QKV_ROPE_CACHE_CUH
#include "uacompile/common.cuh"
#include "uacompile/layer_ops.cuh"

namespace ua {
namespace qrc {

// C: in_t (qkv, q_out, the norm weights), cache_t; HQ, HKV, D, VEC, GROUP, ROWS; QK_NORM, EPS; INTERLEAVED; QUANT;
// PDL; inv_freq() (D / 2 float64 frequencies in device memory). kernel() is the body of the __global__ function
// of a block of ROWS * GROUP threads, grid (T, ceil((HQ + 2 HKV) / ROWS)).
template <class C>
struct QKVRopeCache {
  typedef typename C::in_t T;
  typedef typename C::cache_t cache_t;
  static constexpr int HQ = C::HQ, HKV = C::HKV, D = C::D, VEC = C::VEC;
  static constexpr int HEADS = HQ + 2 * HKV;  // rows of a token: q heads, k heads, v heads
  static constexpr int CHUNKS = D / VEC;      // vectors of a row
  static constexpr int GROUP = C::GROUP, ROWS = C::ROWS;
  static constexpr int THREADS = ROWS * GROUP;
  static constexpr int HALF = CHUNKS / 2;
  static constexpr bool INTERLEAVED = C::INTERLEAVED, QK_NORM = C::QK_NORM, QUANT = C::QUANT, PDL = C::PDL;
  typedef Vec<T, VEC> vec_t;
  static_assert(D % VEC == 0 && CHUNKS <= GROUP && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0,
                "a head row is one lane group of at most 32 lanes");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps: every lane takes part in the shuffles");
  static_assert(INTERLEAVED ? VEC % 2 == 0 : CHUNKS % 2 == 0,
                "interleaved pairs lie inside a vector; a rotate-half partner vector starts D/2 further");

  static __device__ __forceinline__ void kernel(const T* __restrict__ qkv, const T* __restrict__ q_norm,
                                                const T* __restrict__ k_norm, const int64_t* __restrict__ positions,
                                                const int64_t* __restrict__ slot_mapping, T* __restrict__ q_out,
                                                cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
                                                float* __restrict__ k_scale, float* __restrict__ v_scale) {
    __shared__ double s_sin[D / 2], s_cos[D / 2];
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x % GROUP;
    const int row = blockIdx.y * ROWS + threadIdx.x / GROUP;
    const bool live = row < HEADS && lane < CHUNKS;  // a lane that holds a vector of a row
    const bool is_q = row < HQ, is_v = row >= HQ + HKV;
    vec_t w;  // the norm weights are no earlier kernel's output: read before waiting for it
#pragma unroll
    for (int j = 0; j < VEC; ++j) w.v[j] = from_float<T>(0.0f);
    if constexpr (QK_NORM) {
      if (live && !is_v) w = load_vec<T, VEC>((is_q ? q_norm : k_norm) + lane * VEC);
    }
    pdl_wait<PDL>();
    pdl_launch_dependents<PDL>();
    vec_t x;
#pragma unroll
    for (int j = 0; j < VEC; ++j) x.v[j] = from_float<T>(0.0f);
    if (live) x = load_vec<T, VEC>(qkv + (t * HEADS + row) * D + lane * VEC);
    const int64_t slot = slot_mapping[t];
    const double pos = (double)positions[t];
    for (int i = threadIdx.x; i < D / 2; i += THREADS) sincos(__dmul_rn(pos, __ldg(&C::inv_freq()[i])), &s_sin[i], &s_cos[i]);

    if constexpr (QK_NORM) {  // RMSNorm of the head (v rows compute it too, and keep x)
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = to_float(x.v[j]);
        ss = __fmaf_rn(f, f, ss);
      }
      const float rstd = __frsqrt_rn(__fadd_rn(__fdiv_rn(group_sum<GROUP>(ss), (float)D), C::EPS));
      if (!is_v) {
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          x.v[j] = from_float<T>(to_float(from_float<T>(to_float(x.v[j]) * rstd)) * to_float(w.v[j]));
      }
    }
    __syncthreads();  // the angles

    if constexpr (INTERLEAVED) {  // pairs (2i, 2i+1) of the vector
      if (!is_v && live) {
#pragma unroll
        for (int a = 0; a < VEC / 2; ++a) {
          const int i = lane * (VEC / 2) + a;
          rope_pair<T>(x.v[2 * a], x.v[2 * a + 1], s_cos[i], s_sin[i], x.v[2 * a], x.v[2 * a + 1]);
        }
      }
    } else {  // rotate-half: lane c < HALF holds a = x[c*VEC + j], lane c + HALF its partner b = x[D/2 + c*VEC + j]
      const bool first = lane < HALF;
      const vec_t other = shfl_vec<GROUP>(x, first ? lane + HALF : lane - HALF);
      if (!is_v && live) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const int i = (lane % HALF) * VEC + j;
          const double own = (double)to_float(x.v[j]), oth = (double)to_float(other.v[j]);
          const double p = __dmul_rn(own, s_cos[i]), r = __dmul_rn(oth, s_sin[i]);
          // first: a*cos - b*sin; partner: b*cos + a*sin (reference.rope)
          x.v[j] = round_double<T>(first ? __dsub_rn(p, r) : __dadd_rn(p, r));
        }
      }
    }

    if constexpr (QUANT) {
      // the row's amax as float bits (|x| orders as its bits); every lane of the warp shuffles
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = max(m, __float_as_uint(to_float(x.v[j])) & 0x7fffffffu);
#pragma unroll
      for (int o = GROUP / 2; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o, GROUP));
      if (!is_q && live && slot >= 0) {
        const int h = row - HQ - (is_v ? HKV : 0);
        const int64_t at = slot * HKV + h;
        const float scale = quant_scale<cache_t>(__uint_as_float(m));
        Vec<cache_t, VEC> y;
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = Quant<cache_t>::quantize(__fdiv_rn(to_float(x.v[j]), scale));
        store_vec<cache_t, VEC>((is_v ? v_cache : k_cache) + at * D + lane * VEC, y);
        if (lane == 0) (is_v ? v_scale : k_scale)[at] = scale;
      }
    } else {
      if (!is_q && live && slot >= 0) {
        const int h = row - HQ - (is_v ? HKV : 0);
        store_vec<T, VEC>((is_v ? v_cache : k_cache) + (slot * HKV + h) * D + lane * VEC, x);
      }
    }
    if (is_q && live) store_vec<T, VEC>(q_out + (t * HQ + row) * D + lane * VEC, x);
  }
};

}  // namespace qrc
}  // namespace ua
#endif  // UA_QKV_ROPE_CACHE_CUH
