// reshape_and_cache: K and V rows of a batch's tokens written into the paged cache, with fused RoPE on K and
// quantisation (int8 / fp8 with a scale a row) as the config says.
//
// Work is split into tasks: a task is one token's K and V rows of R*S heads, done by one lane
// group (GROUP lanes per row, each lane VEC elements per 16-byte access) in S steps of R heads.
// A step moves the R K rows and the R V rows together (2R vectors per lane).
// The grid is at most WAVES resident waves; each lane group walks its tasks' steps as a
// pipeline, so a warp keeps loads in flight while it rotates, quantises and stores: with
// STAGES, the next STAGES-1 steps (rows, slot, position) are in flight into shared memory
// (cp.async; registers stay free for RoPE's float64 math); without, the next step is loaded
// into registers before the current one is finished. Rows are loaded before the slot is known
// (a padding token's rows are read and dropped), so the slot lookup never delays the loads.
// RoPE angles are computed once per task and lane and shared by its R*S heads. Quantisation
// reduces each row's amax across the group; rows without NaN/Inf and with a scale in div_rn's
// fast range (all real data) take a cheaper exact path: int8 rounding by the 1.5*2^23 add, fp8
// by paired conversions; other rows take the general code (the same results on all inputs).
// LEAN_QUANT takes the general code once per step (not per row) and computes the scale and its
// reciprocal without the division / reciprocal subroutines, so the fast path has no calls;
// PACKED_AMAX reduces a K row's and a V row's 16-bit |x| maxima in the same shuffle (u16x2 max).
// PREFETCH_TOKENS = N asks L2 for the rows N tokens ahead (one bulk request per row run), requests in
// flight that hold no registers.
#ifndef UA_RESHAPE_AND_CACHE_CUH
#define UA_RESHAPE_AND_CACHE_CUH
#include "uacompile/common.cuh"

namespace ua {
namespace rc {
__device__ __forceinline__ uint32_t bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ uint32_t bits_of(half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint32_t bits_of(bf16 x) { return __bfloat16_as_ushort(x); }
template <typename T> __device__ __forceinline__ T from_bits(uint32_t b);
template <> __device__ __forceinline__ float from_bits<float>(uint32_t b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ half from_bits<half>(uint32_t b) { return __ushort_as_half((unsigned short)b); }
template <> __device__ __forceinline__ bf16 from_bits<bf16>(uint32_t b) { return __ushort_as_bfloat16((unsigned short)b); }

template <typename T> struct Pair2;
template <> struct Pair2<half> { typedef __half2 type; };
template <> struct Pair2<bf16> { typedef __nv_bfloat162 type; };

__device__ __forceinline__ uint32_t abs_bits(float f) { return __float_as_uint(f) & 0x7fffffffu; }

// div_rn's fast branch (s normal and far from overflow): exactly x / s rounded, but for the
// sign of a zero quotient, which only fp8 keeps (copysign)
__device__ __forceinline__ float div_by_scale(float x, float s, float rcp_s) {
  const float q0 = __fmul_rn(x, rcp_s);
  return __fmaf_rn(__fmaf_rn(-q0, s, x), rcp_s, q0);
}

// __frcp_rn(s) for s in the fast range: the sequence ptxas expands rcp.rn.f32 into for normal s
// with a normal reciprocal (MUFU.RCP, then one FMA correction), without its out-of-range call
__device__ __forceinline__ float lean_rcp(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  const float e = __fmaf_rn(s, r, -1.0f);
  return __fmaf_rn(r, -e, r);
}

__device__ __forceinline__ bool in_fast_range(float scale) { return scale >= 0x1p-100f && scale <= 0x1p100f; }  // false for NaN

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

enum class RopeMode { NONE, INTERLEAVED, PAIRED, RELOAD };

// C: the configuration (the template's context): in_t, cache_t; HKV, D, VEC, GROUP, THREADS, WAVES (0: one task
// per lane group), ONE_ROUND, STAGES (0: a register double buffer), PREFETCH_TOKENS (0: none); ROPE (rc::RopeMode)
// and, with RoPE, inv_freq() (D / 2 float64 frequencies in device memory); QUANT, FAST_QUANT, LEAN_QUANT,
// PACKED_AMAX. kernel<R, S> is the body of the __global__ function the template instantiates.
template <class C>
struct ReshapeAndCache {
  typedef typename C::in_t in_t;
  typedef typename C::cache_t cache_t;
  static constexpr int HKV = C::HKV, D = C::D;  // the page size does not matter: slot * HKV * D is the row
  static constexpr int VEC = C::VEC;             // elements per vector access
  static constexpr int CHUNKS = D / VEC;         // vectors per row
  static constexpr int GROUP = C::GROUP;         // lanes per row (power of two, <= 32)
  static constexpr int PER_LANE = (CHUNKS + GROUP - 1) / GROUP;
  static constexpr int THREADS = C::THREADS;
  static constexpr int WARPS = THREADS / 32;
  static constexpr int GROUPS_PER_WARP = 32 / GROUP;
  static constexpr int WAVES = C::WAVES;
  static constexpr bool ONE_ROUND = C::ONE_ROUND && WAVES == 0;
  static constexpr int STAGES = C::STAGES;
  static constexpr int64_t PREFETCH_TOKENS = C::PREFETCH_TOKENS;
  static constexpr rc::RopeMode ROPE_MODE = C::ROPE;
  static constexpr bool ROPE = ROPE_MODE != rc::RopeMode::NONE;
  static constexpr bool QUANT = C::QUANT, FAST_QUANT = C::FAST_QUANT, LEAN_QUANT = C::LEAN_QUANT;
  // K and V rows' maxima as 16-bit |x| bits, two rows to a shuffle (16-bit inputs, even vectors)
  static constexpr bool PACKED_AMAX = C::PACKED_AMAX && sizeof(in_t) == 2 && VEC % 2 == 0;
  typedef Vec<in_t, VEC> vec_t;

  // Shuffles are masked to the lane group, so the groups of one warp may take different branches
  // (a padding token's group skips its step while the other group of the warp shuffles).
  static __device__ __forceinline__ unsigned group_lanes() {
    if (GROUP == 32) return 0xffffffffu;
    return ((1u << (GROUP % 32)) - 1u) << ((threadIdx.x % 32) & ~(GROUP - 1));
  }

  // a register vector from lane src of the group (16-bit elements two to a shuffle)
  template <typename T, int N>
  static __device__ __forceinline__ Vec<T, N> shfl_vec(unsigned lanes, const Vec<T, N>& x, int src) {
    Vec<T, N> y;
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
#pragma unroll
      for (int j = 0; j < N; j += 2) {
        const uint32_t w = __shfl_sync(lanes, rc::bits_of(x.v[j]) | rc::bits_of(x.v[j + 1]) << 16, src, GROUP);
        y.v[j] = rc::from_bits<T>(w & 0xffffu);
        y.v[j + 1] = rc::from_bits<T>(w >> 16);
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) y.v[j] = rc::from_bits<T>(__shfl_sync(lanes, rc::bits_of(x.v[j]), src, GROUP));
    }
    return y;
  }

  // ---------------------------------------------------------------- loads: a task's slot and position, a step's rows
  struct TaskHead {
    int64_t slot;  // -1: padding token, or past the last task (nothing is stored)
    double pos;    // RoPE only
  };

  template <int R>
  struct Step {
    vec_t x[2][R][PER_LANE];  // [K | V][head][vector]: element (lane + i * GROUP) * VEC + j of the row
  };

  template <int R, int S>
  static __device__ __forceinline__ int first_head(int64_t task, int s) {
    return (int)(task % (HKV / (R * S))) * (R * S) + s * R;
  }

  template <int R, int S>
  static __device__ __forceinline__ TaskHead load_head(const int64_t* __restrict__ slot_mapping, const int64_t* __restrict__ positions,
                                                int64_t task, int64_t tasks) {
    TaskHead h;
    h.slot = -1;
    if constexpr (ROPE) h.pos = 0.0;
    if (task < tasks) {
      const int64_t t = task / (HKV / (R * S));
      h.slot = slot_mapping[t];
      if constexpr (ROPE) h.pos = (double)positions[t];
    }
    return h;
  }

  // L2 prefetch of R rows of K and of V of token t (one lane per group; a no-op before sm_90 and
  // for rows that are not 16-byte multiples, which cp.async.bulk cannot name)
  template <int R>
  static __device__ __forceinline__ void prefetch_rows(const in_t* __restrict__ k, const in_t* __restrict__ v, int64_t t, int h0,
                                                int64_t num_tokens, int lane) {
#if __CUDA_ARCH__ >= 900
    constexpr unsigned BYTES = R * D * sizeof(in_t);
    if constexpr (BYTES % 16 == 0) {
      if (lane != 0 || t >= num_tokens) return;
      const in_t* rows[2] = {k + (t * HKV + h0) * D, v + (t * HKV + h0) * D};
#pragma unroll
      for (int kv = 0; kv < 2; ++kv)
        if ((reinterpret_cast<uintptr_t>(rows[kv]) & 15) == 0)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(rows[kv]), "r"(BYTES) : "memory");
    }
#endif
  }
  // f(kv, r, i, c) for each vector of a step this lane holds: x[kv][r][i], vector c = lane + i * GROUP of row r of K
  // (kv 0) or V (kv 1)
  template <int R, class F>
  static __device__ __forceinline__ void step_vecs(int lane, F&& f) {
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int c = lane + i * GROUP;
          if (c < CHUNKS) f(kv, r, i, c);
        }
  }
  template <int R, int S>
  static __device__ __forceinline__ void load_step(const in_t* __restrict__ k, const in_t* __restrict__ v, int64_t task,
                                            int64_t tasks, int s, int lane, Step<R>& st) {
    if (task >= tasks) return;  // never stored, never read
    const int64_t t = task / (HKV / (R * S));
    const int64_t row0 = t * HKV + first_head<R, S>(task, s);
    if constexpr (PREFETCH_TOKENS > 0)
      prefetch_rows<R>(k, v, t + PREFETCH_TOKENS, first_head<R, S>(task, s), tasks / (HKV / (R * S)), lane);
    step_vecs<R>(lane, [&](int kv, int r, int i, int c) {
      st.x[kv][r][i] = load_vec<in_t, VEC>((kv ? v : k) + (row0 + r) * D + c * VEC);
    });
  }

  // ---------------------------------------------------------------- RoPE on K (float64, as reference.rope)
  // C::inv_freq()[i] = 1 / theta^(2i / D), the reference's float64 values.
  // INTERLEAVED: pairs (2p, 2p+1) lie inside one vector: a lane needs the angles of its VEC/2 pairs per vector.
  // Rotate-half with one vector per lane: lane c < HALF holds a = x[c*VEC ...], its partner
  // c + HALF holds b = x[D/2 + c*VEC ...] (the same pairs). Each computes both outputs of half
  // of the pairs: one sincos per pair; the halves go back and forth by two shuffles per row.
  // With own / other = (a, b) on the first lane and (b, a) on the partner, both lanes compute
  // keep = own*cos + other*sn, give = other*cos - own*sn where the first lane's sn is -sin:
  // the reference's a*cos - b*sin and b*cos + a*sin exactly (RN(b*-s) = -RN(b*s), x + -y = x - y).
  // RELOAD: rotate-half, general layout: every element takes its own angle, and the partner vector
  // D/2 away is re-read (an L1 hit: the lane group loaded it for the row a moment earlier).
  static constexpr bool PAIRED = ROPE_MODE == rc::RopeMode::PAIRED, INTERLEAVED = ROPE_MODE == rc::RopeMode::INTERLEAVED;
  static_assert(!PAIRED || (PER_LANE == 1 && VEC % 2 == 0 && CHUNKS % 2 == 0), "paired rotate-half needs one even vector per lane");
  static constexpr int HALF = CHUNKS / 2, HV = VEC / 2;
  static constexpr int ANGLES = INTERLEAVED ? VEC / 2 : PAIRED ? HV : VEC;
  static __device__ __forceinline__ int angle_pair(int lane, int i, int a) {
    if constexpr (INTERLEAVED) return min(lane + i * GROUP, CHUNKS - 1) * (VEC / 2) + a;
    else if constexpr (PAIRED) return (lane % HALF) * VEC + (lane < HALF ? 0 : HV) + a;
    else return (min(lane + i * GROUP, CHUNKS - 1) * VEC + a) % (D / 2);
  }

  struct Angles {
    double sn[PER_LANE][ANGLES], cs[PER_LANE][ANGLES];
  };

  // the frequencies are re-read per task (L1 hits) rather than held in registers
  static __device__ __forceinline__ void task_angles(double pos, int lane, Angles& ang) {
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
#pragma unroll
      for (int a = 0; a < ANGLES; ++a) {
        sincos(__dmul_rn(pos, __ldg(&C::inv_freq()[angle_pair(lane, i, a)])), &ang.sn[i][a], &ang.cs[i][a]);
        if constexpr (PAIRED) {
          if (lane < HALF) ang.sn[i][a] = -ang.sn[i][a];
        }
      }
  }

  // a*cos - b*sin and b*cos + a*sin, each product rounded (no FMA contraction), as reference.rope
  static __device__ __forceinline__ void rotate(in_t a, in_t b, double cs, double sn, in_t& out_a, in_t& out_b) {
    const double da = (double)to_float(a), db = (double)to_float(b);
    out_a = round_double<in_t>(__dsub_rn(__dmul_rn(da, cs), __dmul_rn(db, sn)));
    out_b = round_double<in_t>(__dadd_rn(__dmul_rn(db, cs), __dmul_rn(da, sn)));
  }

  template <int R>
  static __device__ __forceinline__ void rope_rows(vec_t (&x)[R][PER_LANE], const Angles& ang, int lane,
                                                   const in_t* __restrict__ k_rows /* the step's first K row */) {
    if constexpr (INTERLEAVED) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i)
#pragma unroll
        for (int a = 0; a < ANGLES; ++a)
          rotate(x[r][i].v[2 * a], x[r][i].v[2 * a + 1], ang.cs[i][a], ang.sn[i][a], x[r][i].v[2 * a], x[r][i].v[2 * a + 1]);
    } else if constexpr (PAIRED) {
    typedef Vec<in_t, HV> half_t;
    const unsigned lanes = group_lanes();
    const bool first = lane < HALF;
    const int partner = first ? lane + HALF : lane - HALF;  // lanes past CHUNKS compute unused values
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // the first lane works on pairs [0, HV) of the vector, the partner on [HV, VEC); element-wise
      // selects (a select of whole vectors would go through local memory)
      half_t own, send;
#pragma unroll
      for (int j = 0; j < HV; ++j) {
        own.v[j] = first ? x[r][0].v[j] : x[r][0].v[HV + j];
        send.v[j] = first ? x[r][0].v[HV + j] : x[r][0].v[j];
      }
      const half_t other = shfl_vec(lanes, send, partner);
      half_t keep, give;
#pragma unroll
      for (int a = 0; a < HV; ++a) {
        const double d_own = (double)to_float(own.v[a]), d_other = (double)to_float(other.v[a]);
        const double cs = ang.cs[0][a], sn = ang.sn[0][a];
        keep.v[a] = round_double<in_t>(__dadd_rn(__dmul_rn(d_own, cs), __dmul_rn(d_other, sn)));
        give.v[a] = round_double<in_t>(__dsub_rn(__dmul_rn(d_other, cs), __dmul_rn(d_own, sn)));
      }
      const half_t back = shfl_vec(lanes, give, partner);
#pragma unroll
      for (int j = 0; j < HV; ++j) {
        x[r][0].v[j] = first ? keep.v[j] : back.v[j];
        x[r][0].v[HV + j] = first ? back.v[j] : keep.v[j];
      }
    }
    } else {
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * GROUP;
      if (c >= CHUNKS) continue;
      const int e0 = c * VEC;
      const bool first = e0 < D / 2;  // VEC divides D/2: a vector lies in one half
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const vec_t other = load_vec<in_t, VEC>(k_rows + r * D + (e0 + D / 2) % D);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const double xc = __dmul_rn((double)to_float(x[r][i].v[j]), ang.cs[i][j]);
          const double ps = __dmul_rn((double)to_float(other.v[j]), ang.sn[i][j]);
          x[r][i].v[j] = round_double<in_t>(first ? __dsub_rn(xc, ps) : __dadd_rn(xc, ps));
        }
      }
    }
    }
  }
  // ---------------------------------------------------------------- quantisation (QUANT)
  // max |x| of a vector as float bits; NaN-propagating (a NaN gives bits > 0x7f800000), so that
  // integer max over lanes finds both the row's amax and whether it holds a NaN
  template <typename T>
  static __device__ __forceinline__ uint32_t absmax_bits(const Vec<T, VEC>& x) {
    if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
      typedef typename Pair2<T>::type pair_t;
      const pair_t* p = reinterpret_cast<const pair_t*>(&x);
      pair_t m = __habs2(p[0]);
#pragma unroll
      for (int j = 1; j < VEC / 2; ++j) m = __hmax2_nan(m, __habs2(p[j]));
      return max(abs_bits(to_float(m.x)), abs_bits(to_float(m.y)));
    } else {
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = max(m, abs_bits(to_float(x.v[j])));
      return m;
    }
  }

  // |y| <= 127 * (1 + 2^-23) on the fast path, so y + 1.5 * 2^23 rounds y to the nearest integer
  // (ties to even, as __float2int_rn) into the low mantissa bits: the low byte is the int8.
  template <typename T>
  static __device__ __forceinline__ Vec<int8_t, VEC> quantize_fast(const Vec<T, VEC>& x, float s, float rcp_s, int8_t*) {
    uint32_t b[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) b[j] = __float_as_uint(__fadd_rn(div_by_scale(to_float(x.v[j]), s, rcp_s), 0x1.8p23f));
    Vec<int8_t, VEC> q;
    if constexpr (VEC % 4 == 0) {
      uint32_t* w = reinterpret_cast<uint32_t*>(&q);
#pragma unroll
      for (int j = 0; j < VEC; j += 4)
        w[j / 4] = __byte_perm(__byte_perm(b[j], b[j + 1], 0x0040), __byte_perm(b[j + 2], b[j + 3], 0x0040), 0x5410);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) q.v[j] = (int8_t)(b[j] & 0xff);
    }
    return q;
  }

  // |y| <= 448 * (1 + 2^-23): the satfinite conversion alone equals clamp-then-convert
  template <typename T>
  static __device__ __forceinline__ Vec<uint8_t, VEC> quantize_fast(const Vec<T, VEC>& x, float s, float rcp_s, uint8_t*) {
    float y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(x.v[j]);
      y[j] = copysignf(div_by_scale(f, s, rcp_s), f);
    }
    Vec<uint8_t, VEC> q;
    if constexpr (VEC % 2 == 0) {
      __nv_fp8x2_storage_t* w = reinterpret_cast<__nv_fp8x2_storage_t*>(&q);
#pragma unroll
      for (int j = 0; j < VEC; j += 2) w[j / 2] = __nv_cvt_float2_to_fp8x2(make_float2(y[j], y[j + 1]), __NV_SATFINITE, __NV_E4M3);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) q.v[j] = (uint8_t)__nv_cvt_float_to_fp8(y[j], __NV_SATFINITE, __NV_E4M3);
    }
    return q;
  }

  // the row's fast path: its lanes' vectors quantised by scale (in the fast range) and stored
  static __device__ __forceinline__ void store_row_fast(const vec_t (&x)[PER_LANE], float scale, float rcp, int lane, cache_t* __restrict__ dst) {
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * GROUP;
      if (c < CHUNKS) store_vec<cache_t, VEC>(dst + c * VEC, quantize_fast(x[i], scale, rcp, (cache_t*)nullptr));
    }
  }

  // The general path of a row (NaN, Inf, extreme scales): amax ignoring NaN (fmaxf), the checked
  // division, clamp and convert one by one. Returns the row's scale.
  static __device__ __forceinline__ float quantize_row_general(const vec_t (&x)[PER_LANE], int lane, cache_t* __restrict__ dst) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + i * GROUP < CHUNKS)
#pragma unroll
        for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, fabsf(to_float(x[i].v[j])));
    const unsigned lanes = group_lanes();
#pragma unroll
    for (int o = GROUP / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, o, GROUP));
    const float scale = quant_scale<cache_t>(amax);
    const float rcp = __frcp_rn(scale);  // y = x / scale via div_rn: bit-exact with the float32 division
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int c = lane + i * GROUP;
      if (c >= CHUNKS) continue;
      Vec<cache_t, VEC> q;
#pragma unroll
      for (int j = 0; j < VEC; ++j) q.v[j] = Quant<cache_t>::quantize(div_rn(to_float(x[i].v[j]), scale, rcp));
      store_vec<cache_t, VEC>(dst + c * VEC, q);
    }
    return scale;
  }

  // Quantise one row (its lanes' vectors) and store it; returns the row's scale.
  static __device__ __forceinline__ float quantize_row(const vec_t (&x)[PER_LANE], uint32_t amax_bits, int lane, cache_t* __restrict__ dst) {
    const float scale = quant_scale<cache_t>(__uint_as_float(amax_bits));
    if (FAST_QUANT && amax_bits <= 0x7f800000u && scale >= 0x1p-100f && scale <= 0x1p100f) {
      store_row_fast(x, scale, __frcp_rn(scale), lane, dst);
      return scale;
    }
    return quantize_row_general(x, lane, dst);
  }

  // lane r stores head r's scale (R consecutive floats from dst)
  template <int R>
  static __device__ __forceinline__ void store_scales(const float (&scale)[R], int lane, float* __restrict__ dst) {
#pragma unroll
    for (int base = 0; base < R; base += GROUP) {
      float mine = scale[base];
#pragma unroll
      for (int r = base + 1; r < R && r < base + GROUP; ++r) mine = lane == r - base ? scale[r] : mine;
      if (base + lane < R) dst[base + lane] = mine;
    }
  }

  // ---------------------------------------------------------------- LEAN_QUANT: no calls on the fast path
  // The general path of a whole step, one copy (rows one after another), reached only for steps
  // with a row outside the fast range. It reads the step's rows again (L2 hits) instead of keeping
  // the registers alive; with RoPE the rotated K rows are taken from the caller. (Out of line,
  // __noinline__, the call's ABI raised the kernel to 80 registers; passing the rows by reference
  // copied them to the stack on every step.)
  // With RoPE, the rotated K rows are the step's (st).
  template <int R>
  static __device__ __forceinline__ void quantize_step_cold(const Step<R>& st, int lane,
                                                            cache_t* __restrict__ k_rows, cache_t* __restrict__ v_rows,
                                                            float* __restrict__ k_scales, float* __restrict__ v_scales) {
#pragma unroll 1
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll 1
      for (int r = 0; r < R; ++r) {
        const vec_t (&x)[PER_LANE] = st.x[kv][r];
        const float scale = quantize_row_general(x, lane, (kv ? v_rows : k_rows) + r * D);
        if (lane == 0) (kv ? v_scales : k_scales)[r] = scale;
      }
  }
  // Without RoPE, the step's input rows read again from k_in, v_in.
  template <int R>
  static __device__ __forceinline__ void quantize_step_cold(const in_t* __restrict__ k_in, const in_t* __restrict__ v_in, int lane,
                                                            cache_t* __restrict__ k_rows, cache_t* __restrict__ v_rows,
                                                            float* __restrict__ k_scales, float* __restrict__ v_scales) {
#pragma unroll 1
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll 1
      for (int r = 0; r < R; ++r) {
        vec_t x[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int c = lane + i * GROUP;
          if (c < CHUNKS) x[i] = load_vec<in_t, VEC>((kv ? v_in : k_in) + r * D + c * VEC);
        }
        const float scale = quantize_row_general(x, lane, (kv ? v_rows : k_rows) + r * D);
        if (lane == 0) (kv ? v_scales : k_scales)[r] = scale;
      }
  }

  // amax / QMAX rounded as __fdiv_rn, by the reciprocal of the constant and one FMA correction
  // (div_by_scale: exact while the quotient is normal; the fast range's bounds are checked on it)
  static __device__ __forceinline__ float lean_scale(float amax) {
    constexpr float QMAX = Quant<cache_t>::QMAX, RCP_QMAX = 1.0f / Quant<cache_t>::QMAX;  // folded, correctly rounded
    return div_by_scale(amax, QMAX, RCP_QMAX);
  }

  // PACKED_AMAX: |x| maxima of one vector as two 16-bit halves (even, odd elements); integer max of
  // |x| bits is the max of |x| for non-NaN values, and a NaN's bits exceed every number's
  static __device__ __forceinline__ uint32_t absmax_u16x2(const vec_t& x) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&x);
    uint32_t m = w[0] & 0x7fff7fffu;
#pragma unroll
    for (int j = 1; j < VEC / 2; ++j) m = __vmaxu2(m, w[j] & 0x7fff7fffu);
    return m;
  }

  // The step's 2R rows' |x| maxima as float bits (absmax_bits), reduced across the lane group: one shuffle a row
  // and round, the 2R rows' reductions interleaved.
  template <int R>
  static __device__ __forceinline__ void step_amax_bits(const Step<R>& st, int lane, uint32_t (&bits)[2][R]) {
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        bits[kv][r] = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
          if (lane + i * GROUP < CHUNKS) bits[kv][r] = max(bits[kv][r], absmax_bits(st.x[kv][r][i]));
      }
    const unsigned lanes = group_lanes();
#pragma unroll
    for (int o = GROUP / 2; o > 0; o /= 2)
#pragma unroll
      for (int kv = 0; kv < 2; ++kv)
#pragma unroll
        for (int r = 0; r < R; ++r) bits[kv][r] = max(bits[kv][r], __shfl_xor_sync(lanes, bits[kv][r], o, GROUP));
  }

  // The step's 2R rows' amax (float; NaN if the row holds one), reduced across the lane group:
  // packed, one shuffle per K/V row pair and round; otherwise the rows' float bits, one each (step_amax_bits).
  template <int R>
  static __device__ __forceinline__ void step_amax(const Step<R>& st, int lane, float (&amax)[2][R]) {
    if constexpr (PACKED_AMAX) {
      const unsigned lanes = group_lanes();
      uint32_t pair[R];  // low half: K row r, high half: V row r
#pragma unroll
      for (int r = 0; r < R; ++r) {
        uint32_t m[2] = {0, 0};
#pragma unroll
        for (int kv = 0; kv < 2; ++kv)
#pragma unroll
          for (int i = 0; i < PER_LANE; ++i)
            if (lane + i * GROUP < CHUNKS) m[kv] = __vmaxu2(m[kv], absmax_u16x2(st.x[kv][r][i]));
        pair[r] = __vmaxu2(__byte_perm(m[0], m[1], 0x5410), __byte_perm(m[0], m[1], 0x7632));
      }
#pragma unroll
      for (int o = GROUP / 2; o > 0; o /= 2)
#pragma unroll
        for (int r = 0; r < R; ++r) pair[r] = __vmaxu2(pair[r], __shfl_xor_sync(lanes, pair[r], o, GROUP));
#pragma unroll
      for (int r = 0; r < R; ++r) {
        amax[0][r] = to_float(from_bits<in_t>(pair[r] & 0xffffu));
        amax[1][r] = to_float(from_bits<in_t>(pair[r] >> 16));
      }
    } else {
      uint32_t bits[2][R];
      step_amax_bits<R>(st, lane, bits);
#pragma unroll
      for (int kv = 0; kv < 2; ++kv)
#pragma unroll
        for (int r = 0; r < R; ++r) amax[kv][r] = __uint_as_float(bits[kv][r]);
    }
  }
  // ---------------------------------------------------------------- one step: rotate, quantise, store
  template <int R, int S>
  static __device__ __forceinline__ void finish_step(const in_t* __restrict__ k, const in_t* __restrict__ v, cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
                                              float* __restrict__ k_scale, float* __restrict__ v_scale, int64_t task, int s,
                                              const TaskHead& head, Step<R>& st, int lane, const Angles& ang) {
    if (head.slot < 0) return;  // uniform in the lane group
    const int h0 = first_head<R, S>(task, s);
    const int64_t row0 = head.slot * HKV + h0;  // slot = page * P + offset: the cache row of head h0
    if constexpr (ROPE) rope_rows<R>(st.x[0], ang, lane, k + (task / (HKV / (R * S)) * HKV + h0) * D);
    if constexpr (!QUANT) {
      step_vecs<R>(lane, [&](int kv, int r, int i, int c) {
        store_vec<cache_t, VEC>((kv ? v_cache : k_cache) + (row0 + r) * D + c * VEC, st.x[kv][r][i]);
      });
    } else if constexpr (LEAN_QUANT) {
    float amax[2][R], scale[2][R], rcp[2][R];
    step_amax<R>(st, lane, amax);
    bool fast = FAST_QUANT;  // uniform in the lane group (amax is)
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        scale[kv][r] = lean_scale(amax[kv][r]);
        fast = fast && in_fast_range(scale[kv][r]);
        rcp[kv][r] = lean_rcp(scale[kv][r]);
      }
    if (fast) {
#pragma unroll
      for (int kv = 0; kv < 2; ++kv)
#pragma unroll
        for (int r = 0; r < R; ++r) store_row_fast(st.x[kv][r], scale[kv][r], rcp[kv][r], lane, (kv ? v_cache : k_cache) + (row0 + r) * D);
      store_scales<R>(scale[0], lane, k_scale + row0);
      store_scales<R>(scale[1], lane, v_scale + row0);
    } else if constexpr (ROPE) {
      quantize_step_cold<R>(st, lane, k_cache + row0 * D, v_cache + row0 * D, k_scale + row0, v_scale + row0);
    } else {
      const int64_t in0 = (task / (HKV / (R * S)) * HKV + h0) * D;  // the step's first input row
      quantize_step_cold<R>(k + in0, v + in0, lane, k_cache + row0 * D, v_cache + row0 * D, k_scale + row0, v_scale + row0);
    }
    } else {
    uint32_t amax[2][R];
    step_amax_bits<R>(st, lane, amax);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      float scale[R];
#pragma unroll
      for (int r = 0; r < R; ++r) scale[r] = quantize_row(st.x[kv][r], amax[kv][r], lane, (kv ? v_cache : k_cache) + (row0 + r) * D);
      store_scales<R>(scale, lane, (kv ? v_scale : k_scale) + row0);
    }
    }
  }

  // ---------------------------------------------------------------- the kernel: R heads per step, S steps per task
  // STAGES steps in flight per lane through shared memory (cp.async): a lane's cells are its own
  // (no block barriers); cell c of stage st is ring[(st * CELLS + c) * THREADS + threadIdx.x],
  // 16 bytes: the step's 2R * PER_LANE vectors, then the task's slot and position.
  template <int R> static __host__ __device__ constexpr int cells() { return 2 * R * PER_LANE + 1; }
  // the kernel's dynamic shared memory
  template <int R> static __host__ __device__ constexpr int ring_bytes() { return STAGES ? STAGES * cells<R>() * THREADS * 16 : 0; }
  static_assert(STAGES == 0 || (STAGES >= 2 && (sizeof(vec_t) == 4 || sizeof(vec_t) == 8 || sizeof(vec_t) == 16)),
                "cp.async moves 4, 8 or 16 bytes");

  // The kernel's body (R heads a step, S steps a task), a block of THREADS threads with ring_bytes<R>() of dynamic
  // shared memory, grid.x = launch_blocks<R, S>(...).
  template <int R, int S>
  static __device__ __forceinline__ void kernel(const in_t* __restrict__ k, const in_t* __restrict__ v,
                                                const int64_t* __restrict__ slot_mapping, const int64_t* __restrict__ positions,
                                                cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
                                                float* __restrict__ k_scale, float* __restrict__ v_scale, int64_t num_tokens) {
    static_assert(HKV % (R * S) == 0, "a task covers R * S of the token's heads");
    const int64_t tasks = num_tokens * (HKV / (R * S));
    const int lane = threadIdx.x % GROUP;
    const int sub = (threadIdx.x % 32) / GROUP;  // lane group within the warp
    // a warp takes GROUPS_PER_WARP consecutive tasks per round; rounds stride over the grid's warps
    const int64_t warp_stride = (int64_t)gridDim.x * WARPS;
    const int64_t w0 = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    if (w0 * GROUPS_PER_WARP >= tasks) return;  // whole warps
    Angles ang;  // RoPE only
    if constexpr (STAGES > 0) {
    extern __shared__ uint4 ring[];
    const int64_t rounds = (ceil_div(tasks, GROUPS_PER_WARP) - w0 + warp_stride - 1) / warp_stride;
    const int64_t steps = rounds * S;  // this lane group's steps: (round n / S, step n % S)
    auto cell = [&](int64_t n, int c) { return ring + ((int)(n % STAGES) * cells<R>() + c) * THREADS + threadIdx.x; };
    auto issue = [&](int64_t n) {  // start the copies of step n (an empty group past the end)
      if (n < steps) {
        const int64_t task = (w0 + n / S * warp_stride) * GROUPS_PER_WARP + sub;
        int64_t* head = reinterpret_cast<int64_t*>(cell(n, cells<R>() - 1));
        if (task < tasks) {
          const int64_t t = task / (HKV / (R * S));
          const int64_t row0 = t * HKV + first_head<R, S>(task, (int)(n % S));
          if constexpr (PREFETCH_TOKENS > 0)
            prefetch_rows<R>(k, v, t + PREFETCH_TOKENS, first_head<R, S>(task, (int)(n % S)), tasks / (HKV / (R * S)), lane);
          step_vecs<R>(lane, [&](int kv, int r, int i, int c) {
            cp_async<sizeof(vec_t)>(cell(n, (kv * R + r) * PER_LANE + i), (kv ? v : k) + (row0 + r) * D + c * VEC);
          });
          cp_async<8>(head, slot_mapping + t);
          if constexpr (ROPE) cp_async<8>(head + 1, positions + t);
        } else {
          head[0] = -1;  // nothing to store (no copy is pending on this stage)
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int n = 0; n < STAGES - 1; ++n) issue(n);
    for (int64_t n = 0; n < steps; ++n) {
      issue(n + STAGES - 1);  // into the stage step n - 1 freed
      cp_async_wait<STAGES - 1>();  // step n has landed
      const int s = (int)(n % S);
      const int64_t task = (w0 + n / S * warp_stride) * GROUPS_PER_WARP + sub;
      const int64_t* h = reinterpret_cast<const int64_t*>(cell(n, cells<R>() - 1));
      TaskHead head;
      head.slot = h[0];
      if constexpr (ROPE) head.pos = (double)h[1];
      Step<R> cur;
      step_vecs<R>(lane, [&cur, &cell, n](int kv, int r, int i, int) {  // n by value: [&] changes the register allocation
        cur.x[kv][r][i] = *reinterpret_cast<const vec_t*>(cell(n, (kv * R + r) * PER_LANE + i));
      });
      if constexpr (ROPE) {
        if (s == 0 && head.slot >= 0) task_angles(head.pos, lane, ang);
      }
      finish_step<R, S>(k, v, k_cache, v_cache, k_scale, v_scale, task, s, head, cur, lane, ang);
    }
    } else {
    // register double buffer: the next step's rows are loaded before the current step is finished
    int64_t w = w0;
    int64_t task = w * GROUPS_PER_WARP + sub;
    TaskHead head = load_head<R, S>(slot_mapping, positions, task, tasks);
    Step<R> cur;
    load_step<R, S>(k, v, task, tasks, 0, lane, cur);
    for (;;) {
      const int64_t next_w = w + warp_stride;
      const bool more = !ONE_ROUND && next_w * GROUPS_PER_WARP < tasks;  // warp-uniform
      const int64_t next_task = next_w * GROUPS_PER_WARP + sub;
      TaskHead next_head = head;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        Step<R> nxt;  // the next step of this task, or the first of the next task
        if (s + 1 < S) {
          load_step<R, S>(k, v, task, tasks, s + 1, lane, nxt);
        } else if (more) {
          next_head = load_head<R, S>(slot_mapping, positions, next_task, tasks);
          load_step<R, S>(k, v, next_task, tasks, 0, lane, nxt);
        }
        if constexpr (ROPE) {
          if (s == 0 && head.slot >= 0) task_angles(head.pos, lane, ang);
        }
        finish_step<R, S>(k, v, k_cache, v_cache, k_scale, v_scale, task, s, head, cur, lane, ang);
        cur = nxt;
      }
      if (!more) break;
      w = next_w;
      task = next_task;
      head = next_head;
    }
    }
  }
};

}  // namespace rc
}  // namespace ua
#endif  // UA_RESHAPE_AND_CACHE_CUH
