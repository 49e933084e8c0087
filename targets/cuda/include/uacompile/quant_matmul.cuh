// uacompile CUDA header of the GGUF block formats (ir.WEIGHT_FORMATS): dequantize and quant_matmul over weights
// kept packed on the device (after uacompile/common.cuh and uacompile/ptx.cuh). Include-guarded.
//
// Decoding comes in three kinds:
//  * exact (Block<F>::decode8): 8 consecutive weights in float32, ggml's arithmetic (reference.dequantize_blocks:
//    every product and sum rounded in float32 by __fmul_rn / __fadd_rn / __fsub_rn, no contraction). dequantize
//    and the float32 quant_matmul use it.
//  * packed (Block<F>::pairs16): 16 consecutive weights as 8 pairs of the activations' 16-bit type, for mma.sync.
//    Quants become 16-bit floats by the magic-exponent trick (0x6400 | q is fp16 1024 + q, 0x4300 | q is bf16
//    128 + q: exact), less the bias; the scale multiplies in the 16-bit type (its scale rounded to it), except
//    q8_0 in bf16, which goes through float32 (bf16 holds 8 bits of a quant exactly but not 256 + q).
//  * CUDA-core (Gemv<F>::unit, QuantGemv below): bytes 0x80 | q as floats 1 + q / 128 (exact), dotted with x in
//    float32, each scale applied once a block.
//
// quant_matmul's tensor-core kernel (QuantMatmul<...>::kernel): a block owns ROWS = 16 * MT weight rows and
// 8 * NT tokens; its WARPS warps split K into units of 256 weights (unit u goes to warp u % WARPS) and add up in
// shared memory at the end. A warp copies a unit of its ROWS rows into shared memory by 16-byte cp.async (the
// aligned words covering the unit's bytes, STAGES units in flight), then lane (g, t) = (lane / 4, lane % 4)
// decodes weights [64 t, 64 t + 64) of the unit for rows g and g + 8 of each 16-row tile. mma.sync m16n8k16's
// K slots are a free permutation of K as long as both operands agree: the 4 K slots lane t holds in an mma
// (2t, 2t + 1, 2t + 8, 2t + 9) are weights 4i .. 4i + 3 of its 64, so the activations it needs are 8
// consecutive values a 16-byte load (x: token g of each 8-token tile, read from global / L1). With PDL, the first
// units' copies are issued before griddepcontrol.wait (the weights do not depend on the kernel before).
#ifndef UA_QUANT_MATMUL_CUH
#define UA_QUANT_MATMUL_CUH
#include "uacompile/common.cuh"
#include "uacompile/ptx.cuh"

namespace ua {
namespace qm {

enum class Fmt { Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K };

// ---------------------------------------------------------------- byte access
// Blocks start at even byte offsets (every format's block size is even) but need not be 4-byte aligned.
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ float ld_f16(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
}
// N 32-bit words of bytes p[0 .. 4N) from a 2-byte aligned pointer: N + 1 aligned loads and funnel shifts
template <int N>
__device__ __forceinline__ void ld_words(const uint8_t* p, uint32_t (&w)[N]) {
  const uint32_t* a = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)3);
  if (reinterpret_cast<uintptr_t>(p) & 2) {
    uint32_t v[N + 1];
#pragma unroll
    for (int i = 0; i <= N; ++i) v[i] = a[i];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(v[i], v[i + 1], 16);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = a[i];
  }
}
// The same by 16-bit loads (global memory: no read past the block's last byte)
template <int N>
__device__ __forceinline__ void ld_words16(const uint8_t* p, uint32_t (&w)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = ld_u16(p + 4 * i) | (ld_u16(p + 4 * i + 2) << 16);
}

// Q4_K / Q5_K: (scale, min) of sub-block j from the 12 packed bytes s (ggml's get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(const uint8_t* s, int j, uint32_t& sc, uint32_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// byte k of a word, as a float (exact)
__device__ __forceinline__ float byte_f(uint32_t w, int k) { return (float)((w >> (8 * k)) & 0xFF); }

// ---------------------------------------------------------------- 16-bit pairs
template <class T> struct Pair;
template <> struct Pair<half> {
  static constexpr uint32_t MAGIC = 0x64006400u;  // fp16 1024.0 twice: 0x6400 | q = 1024 + q, q < 1024
  static constexpr float BASE = 1024.0f;
  __device__ static __forceinline__ uint32_t sub(uint32_t a, float b) {  // a - b, b exact in fp16
    half2 r = __hsub2(*reinterpret_cast<half2*>(&a), __float2half2_rn(b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    half2 r = __hmul2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    half2 r = __hfma2(*reinterpret_cast<half2*>(&a), *reinterpret_cast<half2*>(&b), *reinterpret_cast<half2*>(&c));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t splat(float x) {
    half2 r = __float2half2_rn(x);
    return *reinterpret_cast<uint32_t*>(&r);
  }
};
template <> struct Pair<bf16> {
  static constexpr uint32_t MAGIC = 0x43004300u;  // bf16 128.0 twice: 0x4300 | q = 128 + q, q < 128
  static constexpr float BASE = 128.0f;
  __device__ static __forceinline__ uint32_t sub(uint32_t a, float b) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), __float2bfloat162_rn(b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    __nv_bfloat162 r = __hfma2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b),
                               *reinterpret_cast<__nv_bfloat162*>(&c));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __forceinline__ uint32_t splat(float x) {
    __nv_bfloat162 r = __float2bfloat162_rn(x);
    return *reinterpret_cast<uint32_t*>(&r);
  }
};

// bytes 0 and 1 (SEL 0x4140) or 2 and 3 (SEL 0x4342) of w into the low byte of each 16-bit half
template <int HI>
__device__ __forceinline__ uint32_t spread(uint32_t w) { return __byte_perm(w, 0u, HI ? 0x4342 : 0x4140); }
// the 4 nibbles (low, or high when HI) of w's 4 bytes as two pairs of (MAGIC | q): the low nibbles of bytes 0, 1
// and of bytes 2, 3
template <class T, int HI>
__device__ __forceinline__ void nibble_pairs(uint32_t w, uint32_t& p0, uint32_t& p1) {
  const uint32_t v = HI ? w >> 4 : w;
  p0 = (spread<0>(v) & 0x000F000Fu) | Pair<T>::MAGIC;
  p1 = (spread<1>(v) & 0x000F000Fu) | Pair<T>::MAGIC;
}

// ---------------------------------------------------------------- the formats
template <Fmt F> struct Block;

template <> struct Block<Fmt::Q8_0> {
  static constexpr int QK = 32, NBYTES = 34;  // fp16 d; int8 q[32]: w = d * q
  __device__ static __forceinline__ void decode8(const uint8_t* b, int e, float (&y)[8]) {
    const float d = ld_f16(b);
    uint32_t w[2];
    ld_words16<2>(b + 2 + e, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(d, (float)(int8_t)((w[i / 4] >> (8 * (i % 4))) & 0xFF));
  }
  // unit: 8 blocks; seg: weights [64 t, 64 t + 64) = blocks 2t, 2t + 1; group gi: weights 16 gi .. + 16 of seg
  template <class T>
  __device__ static __forceinline__ void pairs16(const uint8_t* unit, int t, int gi, uint32_t (&p)[8]) {
    const uint8_t* b = unit + (2 * t + gi / 2) * NBYTES;
    uint32_t w[4];
    ld_words<4>(b + 2 + 16 * (gi & 1), w);
    const float d = ld_f16(b);
    if constexpr (sizeof(T) == 2 && Pair<T>::MAGIC == Pair<half>::MAGIC) {
      const uint32_t d2 = Pair<half>::splat(d);  // fp16 d exactly; 0x6400 | (q + 128) = 1152 + q
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t u = w[i] ^ 0x80808080u;
        p[2 * i] = Pair<half>::mul(Pair<half>::sub(__byte_perm(u, 0x64u, 0x4140), 1152.0f), d2);
        p[2 * i + 1] = Pair<half>::mul(Pair<half>::sub(__byte_perm(u, 0x64u, 0x4342), 1152.0f), d2);
      }
    } else {  // bf16: float32 d * q is exact, one rounding to bf16
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float y[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) y[k] = __fmul_rn(d, (float)(int8_t)((w[i] >> (8 * k)) & 0xFF));
        p[2 * i] = pack2<true>(y[0], y[1]);
        p[2 * i + 1] = pack2<true>(y[2], y[3]);
      }
    }
  }
};

template <> struct Block<Fmt::Q4_0> {
  static constexpr int QK = 32, NBYTES = 18;  // fp16 d; 16 bytes of nibbles (low: weights 0-15): w = (q - 8) * d
  __device__ static __forceinline__ void decode8(const uint8_t* b, int e, float (&y)[8]) {
    const float d = ld_f16(b);
    uint32_t w[2];
    ld_words16<2>(b + 2 + (e & 15), w);
    const int s = (e >> 4) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(__fsub_rn((float)((w[i / 4] >> (8 * (i % 4) + s)) & 0xF), 8.0f), d);
  }
  template <class T>
  __device__ static __forceinline__ void pairs16(const uint8_t* unit, int t, int gi, uint32_t (&p)[8]) {
    const uint8_t* b = unit + (2 * t + gi / 2) * NBYTES;
    uint32_t w[4];
    ld_words<4>(b + 2, w);
    const uint32_t d2 = Pair<T>::splat(ld_f16(b));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (gi & 1) nibble_pairs<T, 1>(w[i], p[2 * i], p[2 * i + 1]);
      else nibble_pairs<T, 0>(w[i], p[2 * i], p[2 * i + 1]);
      p[2 * i] = Pair<T>::mul(Pair<T>::sub(p[2 * i], Pair<T>::BASE + 8.0f), d2);
      p[2 * i + 1] = Pair<T>::mul(Pair<T>::sub(p[2 * i + 1], Pair<T>::BASE + 8.0f), d2);
    }
  }
};

template <> struct Block<Fmt::Q4_1> {
  static constexpr int QK = 32, NBYTES = 20;  // fp16 d, m; 16 bytes of nibbles: w = q * d + m
  __device__ static __forceinline__ void decode8(const uint8_t* b, int e, float (&y)[8]) {
    const float d = ld_f16(b), m = ld_f16(b + 2);
    uint32_t w[2];
    ld_words16<2>(b + 4 + (e & 15), w);
    const int s = (e >> 4) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fadd_rn(__fmul_rn((float)((w[i / 4] >> (8 * (i % 4) + s)) & 0xF), d), m);
  }
  template <class T>
  __device__ static __forceinline__ void pairs16(const uint8_t* unit, int t, int gi, uint32_t (&p)[8]) {
    const uint8_t* b = unit + (2 * t + gi / 2) * NBYTES;
    uint32_t w[4];
    ld_words<4>(b + 4, w);
    const uint32_t d2 = Pair<T>::splat(ld_f16(b)), m2 = Pair<T>::splat(ld_f16(b + 2));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (gi & 1) nibble_pairs<T, 1>(w[i], p[2 * i], p[2 * i + 1]);
      else nibble_pairs<T, 0>(w[i], p[2 * i], p[2 * i + 1]);
      p[2 * i] = Pair<T>::fma(Pair<T>::sub(p[2 * i], Pair<T>::BASE), d2, m2);
      p[2 * i + 1] = Pair<T>::fma(Pair<T>::sub(p[2 * i + 1], Pair<T>::BASE), d2, m2);
    }
  }
};

// Q4_K and Q5_K: fp16 d, dmin; 12 bytes of 6-bit (scale, min) x 8 sub-blocks of 32; [Q5_K: 32 bytes qh, bit j of
// qh[l] is weight l of sub-block j's fifth bit;] 128 bytes of nibbles: sub-block j = nibbles (j % 2) of bytes
// 32 (j / 2) .. + 32. w = (d * sc) * q - dmin * m.
template <bool Q5>
struct BlockK {
  static constexpr int QK = 256, NBYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  __device__ static __forceinline__ void decode8(const uint8_t* b, int e, float (&y)[8]) {
    const float d = ld_f16(b), dmin = ld_f16(b + 2);
    const int j = e >> 5, l = e & 31;
    uint32_t sc, m;
    scale_min_k4(b + 4, j, sc, m);
    const float ds = __fmul_rn(d, (float)sc), dm = __fmul_rn(dmin, (float)m);
    uint32_t w[2], h[2] = {0u, 0u};
    ld_words16<2>(b + QS + 32 * (j >> 1) + l, w);
    if (Q5) ld_words16<2>(b + 16 + l, h);
    const int s = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t q = (w[i / 4] >> (8 * (i % 4) + s)) & 0xF;
      if (Q5) q |= ((h[i / 4] >> (8 * (i % 4) + j)) & 1) << 4;
      y[i] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
    }
  }
  // unit: 1 block; seg t: sub-blocks 2t (low nibbles of bytes 32t .. + 32) and 2t + 1 (their high nibbles)
  template <class T>
  __device__ static __forceinline__ void pairs16(const uint8_t* b, int t, int gi, uint32_t (&p)[8]) {
    const int j = 2 * t + gi / 2;
    uint32_t sc, m;
    scale_min_k4(b + 4, j, sc, m);
    const uint32_t ds = Pair<T>::splat(__fmul_rn(ld_f16(b), (float)sc));
    const uint32_t dm = Pair<T>::splat(-__fmul_rn(ld_f16(b + 2), (float)m));
    // 144- and 176-byte blocks of 16-byte aligned rows: qs and qh are 16-byte aligned, one conflict-free load each
    const uint4 wv = *reinterpret_cast<const uint4*>(b + QS + 32 * t + 16 * (gi & 1));
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    uint4 hv = make_uint4(0u, 0u, 0u, 0u);
    if (Q5) hv = *reinterpret_cast<const uint4*>(b + 16 + 16 * (gi & 1));
    const uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (gi >= 2) nibble_pairs<T, 1>(w[i], p[2 * i], p[2 * i + 1]);
      else nibble_pairs<T, 0>(w[i], p[2 * i], p[2 * i + 1]);
      if (Q5) {  // bit j of each byte to bit 4
        const uint32_t hb = (j <= 4 ? h[i] << (4 - j) : h[i] >> (j - 4));
        p[2 * i] |= spread<0>(hb) & 0x00100010u;
        p[2 * i + 1] |= spread<1>(hb) & 0x00100010u;
      }
      p[2 * i] = Pair<T>::fma(Pair<T>::sub(p[2 * i], Pair<T>::BASE), ds, dm);
      p[2 * i + 1] = Pair<T>::fma(Pair<T>::sub(p[2 * i + 1], Pair<T>::BASE), ds, dm);
    }
  }
};
template <> struct Block<Fmt::Q4_K> : BlockK<false> {};
template <> struct Block<Fmt::Q5_K> : BlockK<true> {};

// Q6_K: 128 bytes ql, 64 bytes qh, int8 scales[16], fp16 d. Half h of 128 weights uses ql[64h .. + 64],
// qh[32h .. + 32]; its runs r = 0..3 of 32 are (ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high) of
// the half, with the bit pair 2r of qh; scale scales[8h + 2r + l / 16]. w = (d * sc) * (q - 32).
template <> struct Block<Fmt::Q6_K> {
  static constexpr int QK = 256, NBYTES = 210;
  __device__ static __forceinline__ void decode8(const uint8_t* b, int e, float (&y)[8]) {
    const int h = e >> 7, r = (e >> 5) & 3, l = e & 31;
    const float ds = __fmul_rn(ld_f16(b + 208), (float)(int8_t)b[192 + 8 * h + 2 * r + (l >> 4)]);
    uint32_t w[2], q2[2];
    ld_words16<2>(b + 64 * h + 32 * (r & 1) + l, w);
    ld_words16<2>(b + 128 + 32 * h + l, q2);
    const int s = (r >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = (int)(((w[i / 4] >> (8 * (i % 4) + s)) & 0xF) | (((q2[i / 4] >> (8 * (i % 4) + 2 * r)) & 3) << 4));
      y[i] = __fmul_rn(ds, (float)(q - 32));
    }
  }
  // seg t: half h = t / 2, runs 2 (t % 2) and 2 (t % 2) + 1: the low (t even) or high nibbles of ql[64h .. + 64]
  template <class T>
  __device__ static __forceinline__ void pairs16(const uint8_t* b, int t, int gi, uint32_t (&p)[8]) {
    const int h = t >> 1, r = 2 * (t & 1) + gi / 2, half16 = gi & 1;
    const uint32_t ds = Pair<T>::splat(
        __fmul_rn(ld_f16(b + 208), (float)(int8_t)b[192 + 8 * h + 2 * r + half16]));
    uint32_t w[4], q2[4];
    ld_words<4>(b + 64 * h + 32 * (r & 1) + 16 * half16, w);
    ld_words<4>(b + 128 + 32 * h + 16 * half16, q2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (r >> 1) nibble_pairs<T, 1>(w[i], p[2 * i], p[2 * i + 1]);
      else nibble_pairs<T, 0>(w[i], p[2 * i], p[2 * i + 1]);
      const uint32_t hb = r <= 2 ? q2[i] << (4 - 2 * r) : q2[i] >> 2;  // bits 2r, 2r + 1 of each byte to 4, 5
      p[2 * i] |= spread<0>(hb) & 0x00300030u;
      p[2 * i + 1] |= spread<1>(hb) & 0x00300030u;
      p[2 * i] = Pair<T>::mul(Pair<T>::sub(p[2 * i], Pair<T>::BASE + 32.0f), ds);
      p[2 * i + 1] = Pair<T>::mul(Pair<T>::sub(p[2 * i + 1], Pair<T>::BASE + 32.0f), ds);
    }
  }
};

// ---------------------------------------------------------------- dequantize
// One thread per 8 consecutive weights of a row: out[row, 8c .. 8c + 8) = T(decode8), one vector store.
template <Fmt F, class T>
__device__ __forceinline__ void dequantize(const uint8_t* __restrict__ w, T* __restrict__ out, int64_t num_rows,
                                           int K) {
  typedef Block<F> B;
  const int chunks = K / 8;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= num_rows * chunks) return;
  const int64_t row = idx / chunks;
  const int c = (int)(idx - row * chunks);
  const int k = 8 * c;
  const uint8_t* b = w + row * (int64_t)(K / B::QK * B::NBYTES) + (k / B::QK) * B::NBYTES;
  float y[8];
  B::decode8(b, k % B::QK, y);
  Vec<T, 8> v;
#pragma unroll
  for (int i = 0; i < 8; ++i) v.v[i] = from_float<T>(y[i]);
  T* o = out + row * K + k;
  if constexpr (sizeof(T) * 8 <= 16) {
    store_vec<T, 8>(o, v);
  } else {
    Vec<T, 4> a, b4;
#pragma unroll
    for (int i = 0; i < 4; ++i) a.v[i] = v.v[i], b4.v[i] = v.v[i + 4];
    store_vec<T, 4>(o, a);
    store_vec<T, 4>(o + 4, b4);
  }
}

// ---------------------------------------------------------------- quant_matmul, CUDA cores (float32)
// A warp per (weight row, 8 tokens): lanes stride over K by 8 weights (exact decode), sums by shuffles.
template <Fmt F, class T>
__device__ __forceinline__ void quant_matmul_simple(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                                    T* __restrict__ out, int64_t num_tokens, int N, int K) {
  typedef Block<F> B;
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t tok0 = (int64_t)blockIdx.y * 8;
  if (n >= N) return;
  const uint8_t* row = w + (int64_t)n * (K / B::QK * B::NBYTES);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 8 * lane; k < K; k += 256) {
    float y[8];
    B::decode8(row + (k / B::QK) * B::NBYTES, k % B::QK, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (tok0 + j < num_tokens) {
        const T* xr = x + (tok0 + j) * K + k;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j] = fmaf(to_float(xr[i]), y[i], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  }
  if (lane < 8 && tok0 + lane < num_tokens) {
    float v = acc[0];
#pragma unroll
    for (int j = 1; j < 8; ++j) v = lane == j ? acc[j] : v;
    out[(tok0 + lane) * N + n] = from_float<T>(v);
  }
}

// ---------------------------------------------------------------- quant_matmul, CUDA cores (16-bit x, few tokens)
// QuantGemv<...>::kernel: a block owns 32 weight rows (lane = row) and all NT tokens; its WARPS warps split K into
// stages of PAIR units of 256 weights (stage u goes to warp u % WARPS) and add up in shared memory at the end. A
// warp stages a stage of its 32 rows into shared memory by cp.async (16-byte words where rows and units are
// 16-byte aligned, the weight being 16-byte aligned (api.ALIGN), else 4-byte words, and the stage then starts at
// byte OFF = 0 or 2 of its first word; STAGES stages in flight), and the stage's activations as float32
// (x[NT][256], then the sum of each 16 of them, a unit), which every lane reads at the same address (a
// broadcast). With PDL, the first stages' copies are issued before griddepcontrol.wait. Quants become float32
// exactly without a conversion instruction: the byte 0x80 | q (q < 128) put into bits 16..23 of 0x3F000000 is
// 1 + q / 128, so S = sum x (1 + q / 128) gives sum x q = 128 (S - sum x); q8_0's q + 128 in the low byte of
// 0x4B000000 is 2^23 + 128 + q, less 2^23 + 128 exactly. Each scale multiplies once a block (a sub-block of the
// K-quants) and token.
namespace gv {
template <int V> struct Int { static constexpr int value = V; };
// fn(Int<I>{}) for I = B .. E - 1
template <int B, int E, class Fn>
__device__ __forceinline__ void static_for(Fn&& fn) {
  if constexpr (B < E) {
    fn(Int<B>{});
    static_for<B + 1, E>(fn);
  }
}
// a 16-byte shared-memory load (kept 16 bytes wide: lanes read rows an odd number of 16-byte words apart)
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr(p)));
  return v;
}
// component C of v
template <int C>
__device__ __forceinline__ uint32_t comp(const uint4& v) {
  if constexpr (C == 0) return v.x;
  else if constexpr (C == 1) return v.y;
  else if constexpr (C == 2) return v.z;
  else return v.w;
}
// bytes [P, P + 4) of a row's unit in registers s (P even, compile-time)
template <int P>
__device__ __forceinline__ uint32_t wd(const uint4* s) {
  static_assert(P % 2 == 0, "blocks start at even bytes");
  constexpr int q = P / 4, i = q / 4, c = q % 4;
  if constexpr (P % 4 == 0) {
    return comp<c>(s[i]);
  } else {
    return __funnelshift_r(comp<c>(s[i]), comp<(c + 1) % 4>(s[i + (c + 1) / 4]), 16);
  }
}
template <int P>
__device__ __forceinline__ float half_at(const uint4* s) {
  constexpr int A = P & ~3;  // the aligned word holding bytes P, P + 1
  const uint32_t w = wd<A>(s);
  return __half2float(__ushort_as_half((unsigned short)(P & 2 ? w >> 16 : w & 0xFFFFu)));
}
// byte K of v (bytes 0x80 | q) as 1 + q / 128
template <int K>
__device__ __forceinline__ float unit_q(uint32_t v) {
  return __int_as_float((int)__byte_perm(v, 0x3F000000u, 0x7054u | (K << 8)));
}
// S[t] += sum over the 4 bytes of v (0x80 | q each) of x[t][k + i] (1 + q_i / 128)
template <int NT>
__device__ __forceinline__ void dot4(uint32_t v, const float* xs, int k, float (&S)[NT]) {
  const float f0 = unit_q<0>(v), f1 = unit_q<1>(v), f2 = unit_q<2>(v), f3 = unit_q<3>(v);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float4 x = *reinterpret_cast<const float4*>(xs + t * 256 + k);
    S[t] = fmaf(x.x, f0, S[t]);
    S[t] = fmaf(x.y, f1, S[t]);
    S[t] = fmaf(x.z, f2, S[t]);
    S[t] = fmaf(x.w, f3, S[t]);
  }
}
// the low (HI = 0) or high nibbles of w's bytes as bytes 0x80 | q
template <int HI>
__device__ __forceinline__ uint32_t nib(uint32_t w) {
  return ((HI ? w >> 4 : w) & 0x0F0F0F0Fu) | 0x80808080u;
}
template <int NT>
__device__ __forceinline__ void zero(float (&S)[NT]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) S[t] = 0.f;
}
// the sum of x[t][16 g .. 16 g + 16 N)
template <int N>
__device__ __forceinline__ float xsum_of(const float* xsum, int t, int g) {
  float v = xsum[t * 16 + g];
#pragma unroll
  for (int i = 1; i < N; ++i) v += xsum[t * 16 + g + i];
  return v;
}
// the 6-bit (scale, min) of sub-block J of the K-quants' 12 bytes in words s0, s1, s2 (get_scale_min_k4)
template <int J>
__device__ __forceinline__ void scale_min(uint32_t s0, uint32_t s1, uint32_t s2, float& sc, float& m) {
  const uint32_t b[12] = {s0 & 255, (s0 >> 8) & 255, (s0 >> 16) & 255, s0 >> 24,
                          s1 & 255, (s1 >> 8) & 255, (s1 >> 16) & 255, s1 >> 24,
                          s2 & 255, (s2 >> 8) & 255, (s2 >> 16) & 255, s2 >> 24};
  if constexpr (J < 4) {
    sc = (float)(b[J] & 63);
    m = (float)(b[J + 4] & 63);
  } else {
    sc = (float)((b[J + 4] & 0xF) | ((b[J - 4] >> 6) << 4));
    m = (float)((b[J + 4] >> 4) | ((b[J] >> 6) << 4));
  }
}
}  // namespace gv

// Gemv<F>::unit<OFF, NT, FULL>(s, xs, xsum, nb, acc): acc[t] += the unit's 256 weights of one row (its staged
// words in registers s, the unit's first byte at byte OFF) times x[t] (xs[t * 256 ..], the 16-sums
// xsum[t * 16 ..]); nb: the unit's valid 32-weight blocks (the last unit of a K that is not a multiple of 256),
// all 8 when FULL.
template <Fmt F> struct Gemv;

template <> struct Gemv<Fmt::Q8_0> {
  template <int OFF, int NT, bool FULL>
  __device__ static __forceinline__ void unit(const uint4* s, const float* xs, const float* xsum, int nb,
                                              float (&acc)[NT]) {
    (void)xsum;
    gv::static_for<0, 8>([&](auto bi) {
      constexpr int b = decltype(bi)::value, P = OFF + 34 * b;
      if (FULL || b < nb) {
        const float d = gv::half_at<P>(s);
        float S[2][NT];
        gv::zero(S[0]);
        gv::zero(S[1]);
        gv::static_for<0, 8>([&](auto ii) {
          constexpr int i = decltype(ii)::value;
          const uint32_t u = gv::wd<P + 2 + 4 * i>(s) ^ 0x80808080u;  // q + 128
          float f[4];
#pragma unroll
          for (int k = 0; k < 4; ++k)
            f[k] = __int_as_float((int)__byte_perm(u, 0x4B000000u, 0x7650u | k)) - 8388736.0f;  // q exactly
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float4 x = *reinterpret_cast<const float4*>(xs + t * 256 + 32 * b + 4 * i);
            S[i & 1][t] = fmaf(x.x, f[0], S[i & 1][t]);
            S[i & 1][t] = fmaf(x.y, f[1], S[i & 1][t]);
            S[i & 1][t] = fmaf(x.z, f[2], S[i & 1][t]);
            S[i & 1][t] = fmaf(x.w, f[3], S[i & 1][t]);
          }
        });
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = fmaf(d, S[0][t] + S[1][t], acc[t]);
      }
    });
  }
};

// Q4_0 (w = d (q - 8): sum x w = d (128 S - 136 sum x)) and Q4_1 (w = d q + m: d 128 (S - sum x) + m sum x)
template <bool Q41>
struct Gemv4 {
  static constexpr int NBYTES = Q41 ? 20 : 18, QS = Q41 ? 4 : 2;
  template <int OFF, int NT, bool FULL>
  __device__ static __forceinline__ void unit(const uint4* s, const float* xs, const float* xsum, int nb,
                                              float (&acc)[NT]) {
    gv::static_for<0, 8>([&](auto bi) {
      constexpr int b = decltype(bi)::value, P = OFF + NBYTES * b;
      if (FULL || b < nb) {
        const float d = gv::half_at<P>(s);
        float lo[NT], hi[NT];
        gv::zero(lo);
        gv::zero(hi);
        gv::static_for<0, 4>([&](auto ii) {
          constexpr int i = decltype(ii)::value;
          const uint32_t w = gv::wd<P + QS + 4 * i>(s);
          gv::dot4<NT>(gv::nib<0>(w), xs, 32 * b + 4 * i, lo);
          gv::dot4<NT>(gv::nib<1>(w), xs, 32 * b + 16 + 4 * i, hi);
        });
        if constexpr (Q41) {
          const float m = gv::half_at<P + 2>(s);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float sx = gv::xsum_of<2>(xsum, t, 2 * b);
            acc[t] = fmaf(d * 128.f, (lo[t] + hi[t]) - sx, fmaf(m, sx, acc[t]));
          }
        } else {
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float sx = gv::xsum_of<2>(xsum, t, 2 * b);
            acc[t] = fmaf(d, fmaf(128.f, lo[t] + hi[t], -136.f * sx), acc[t]);
          }
        }
      }
    });
  }
};
template <> struct Gemv<Fmt::Q4_0> : Gemv4<false> {};
template <> struct Gemv<Fmt::Q4_1> : Gemv4<true> {};

// Q4_K / Q5_K (a unit = 1 block; w = ds q - dm a sub-block: sum x w = ds 128 (S - sum x) - dm sum x)
template <bool Q5>
struct GemvK {
  static constexpr int QS = Q5 ? 48 : 16;
  template <int OFF, int NT, bool FULL>
  __device__ static __forceinline__ void unit(const uint4* s, const float* xs, const float* xsum, int nb,
                                              float (&acc)[NT]) {
    (void)nb;
    const float d = gv::half_at<OFF>(s), dmin = gv::half_at<OFF + 2>(s);
    const uint32_t s0 = gv::wd<OFF + 4>(s), s1 = gv::wd<OFF + 8>(s), s2 = gv::wd<OFF + 12>(s);
    gv::static_for<0, 4>([&](auto pi) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) of bytes 32p .. + 32
      constexpr int p = decltype(pi)::value;
      float lo[NT], hi[NT];
      gv::zero(lo);
      gv::zero(hi);
      gv::static_for<0, 8>([&](auto ii) {
        constexpr int i = decltype(ii)::value;
        const uint32_t w = gv::wd<OFF + QS + 32 * p + 4 * i>(s);
        uint32_t a = gv::nib<0>(w), c = gv::nib<1>(w);
        if constexpr (Q5) {  // bit j of qh[l] is the fifth bit of weight l of sub-block j: to bit 4 of the byte
          const uint32_t h = gv::wd<OFF + 16 + 4 * i>(s);
          constexpr int j0 = 2 * p, j1 = 2 * p + 1;
          a |= (j0 <= 4 ? h << (4 - j0) : h >> (j0 - 4)) & 0x10101010u;
          c |= (j1 <= 4 ? h << (4 - j1) : h >> (j1 - 4)) & 0x10101010u;
        }
        gv::dot4<NT>(a, xs, 64 * p + 4 * i, lo);
        gv::dot4<NT>(c, xs, 64 * p + 32 + 4 * i, hi);
      });
      float sc0, m0, sc1, m1;
      gv::scale_min<2 * p>(s0, s1, s2, sc0, m0);
      gv::scale_min<2 * p + 1>(s0, s1, s2, sc1, m1);
      const float ds0 = __fmul_rn(d, sc0) * 128.f, dm0 = __fmul_rn(dmin, m0);
      const float ds1 = __fmul_rn(d, sc1) * 128.f, dm1 = __fmul_rn(dmin, m1);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float sx0 = gv::xsum_of<2>(xsum, t, 4 * p), sx1 = gv::xsum_of<2>(xsum, t, 4 * p + 2);
        acc[t] = fmaf(ds0, lo[t] - sx0, fmaf(-dm0, sx0, acc[t]));
        acc[t] = fmaf(ds1, hi[t] - sx1, fmaf(-dm1, sx1, acc[t]));
      }
    });
  }
};
template <> struct Gemv<Fmt::Q4_K> : GemvK<false> {};
template <> struct Gemv<Fmt::Q5_K> : GemvK<true> {};

// Q6_K (a unit = 1 block): run r of half h is bytes ql[64 h + 32 (r & 1) ..] (low nibbles for r < 2, else high)
// with bits 2r, 2r + 1 of qh[32 h ..]; each 16 weights have their own scale: sum x w = ds (128 S - 160 sum x)
template <> struct Gemv<Fmt::Q6_K> {
  template <int OFF, int NT, bool FULL>
  __device__ static __forceinline__ void unit(const uint4* s, const float* xs, const float* xsum, int nb,
                                              float (&acc)[NT]) {
    (void)nb;
    const float d = gv::half_at<OFF + 208>(s);
    gv::static_for<0, 2>([&](auto hI) {
      constexpr int h = decltype(hI)::value;
      gv::static_for<0, 2>([&](auto lI) {  // l in [16 lh, 16 lh + 16): scales 8h + 2r + lh
        constexpr int lh = decltype(lI)::value;
        float S[4][NT];
#pragma unroll
        for (int r = 0; r < 4; ++r) gv::zero(S[r]);
        gv::static_for<0, 4>([&](auto ii) {
          constexpr int i = 4 * lh + decltype(ii)::value;  // l = 4i .. 4i + 3
          const uint32_t qa = gv::wd<OFF + 64 * h + 4 * i>(s), qb = gv::wd<OFF + 64 * h + 32 + 4 * i>(s);
          const uint32_t qh = gv::wd<OFF + 128 + 32 * h + 4 * i>(s);
          const uint32_t v0 = (qa & 0x0F0F0F0Fu) | ((qh << 4) & 0x30303030u) | 0x80808080u;
          const uint32_t v1 = (qb & 0x0F0F0F0Fu) | ((qh << 2) & 0x30303030u) | 0x80808080u;
          const uint32_t v2 = ((qa >> 4) & 0x0F0F0F0Fu) | (qh & 0x30303030u) | 0x80808080u;
          const uint32_t v3 = ((qb >> 4) & 0x0F0F0F0Fu) | ((qh >> 2) & 0x30303030u) | 0x80808080u;
          gv::dot4<NT>(v0, xs, 128 * h + 4 * i, S[0]);
          gv::dot4<NT>(v1, xs, 128 * h + 32 + 4 * i, S[1]);
          gv::dot4<NT>(v2, xs, 128 * h + 64 + 4 * i, S[2]);
          gv::dot4<NT>(v3, xs, 128 * h + 96 + 4 * i, S[3]);
        });
        const uint32_t scw0 = gv::wd<OFF + 192 + 8 * h>(s), scw1 = gv::wd<OFF + 196 + 8 * h>(s);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int si = 2 * r + lh;  // scales[8h + si]: byte si of the two words
          const uint32_t sw = si < 4 ? scw0 : scw1;
          const float ds = __fmul_rn(d, (float)(int8_t)((sw >> (8 * (si & 3))) & 255));
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const float sx = xsum[t * 16 + 8 * h + 2 * r + lh];
            acc[t] = fmaf(ds, fmaf(128.f, S[r][t], -160.f * sx), acc[t]);
          }
        }
      });
    });
  }
};

template <Fmt F, class T, int NT, int WARPS, int STAGES, int PAIR>
struct QuantGemv {
  typedef Block<F> B;
  // a stage: PAIR (1 or 2) consecutive units of 256 weights of the 32 rows (2: two independent decode streams a
  // warp)
  static constexpr int ROWS = 32, THREADS = 32 * WARPS, UNIT = 256, SPAN = PAIR * UNIT;
  static_assert(PAIR == 1 || PAIR == 2, "one or two units a stage");
  static constexpr int UB = UNIT / B::QK * B::NBYTES;    // bytes a unit of a row
  static constexpr int XCHUNK = NT * (UNIT + 16);         // floats of a unit's x[NT][256] and sums[NT][16]
  static constexpr int XBYTES = PAIR * XCHUNK * 4;
  static constexpr int RED_BYTES = WARPS * NT * 32 * 4;

  // compile-time layout of the staged rows for row bytes RB: 16-byte copies when rows and units are 16-byte
  // aligned, else 4-byte copies (rows and blocks are 2-byte aligned: a stage starts at byte 0 or 2 of a word)
  template <int64_t RB_>
  struct Layout {
    static constexpr int64_t RB = RB_;
    static constexpr bool WIDE = RB % 16 == 0 && UB % 16 == 0;
    static constexpr bool EVEN = WIDE || (RB % 4 == 0 && (PAIR * UB) % 4 == 0);  // every stage at byte 0 of a word
    static constexpr int CW = WIDE ? 16 : 4;                                        // bytes a copy
    static constexpr int WMAX = WIDE ? PAIR * UB / 16 : (PAIR * UB + 2 + 3) / 4;    // copies a stage of a row
    static constexpr int STRIDE = ((WMAX * CW + 15) / 16) | 1;                      // 16-byte words a row (odd)
    static constexpr int STAGE_BYTES = ROWS * STRIDE * 16;
    static constexpr int WARP_BYTES = STAGES * STAGE_BYTES + XBYTES;
    static constexpr int SMEM_BYTES = WARPS * WARP_BYTES > RED_BYTES ? WARPS * WARP_BYTES : RED_BYTES;
  };

  // A lane's cp.async of a stage of the block's rows. Wide layout: lane l copies 16-byte words 2k + l % 2 of
  // rows l / 2 and l / 2 + 16 (a warp instruction: 32 contiguous bytes of each of 16 rows), from addresses set
  // up once. Else 4-byte words, lane by lane over the rows' covering words.
  template <class L>
  struct Copier {
    const uint8_t* src[2];
    uint32_t dst[2];
    const uint8_t* w;
    int row0, N, K, lane;
    __device__ __forceinline__ Copier(const uint8_t* w_, int row0_, int N_, int K_, int lane_)
        : w(w_), row0(row0_), N(N_), K(K_), lane(lane_) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int r = (lane >> 1) + 16 * p;
        src[p] = w + (int64_t)min(row0 + r, N - 1) * L::RB + 16 * (lane & 1);
        dst[p] = r * L::STRIDE * 16 + 16 * (lane & 1);
      }
    }
    __device__ __forceinline__ void operator()(uint8_t* st, int u) const {
      const int ub = (min(K, (u + 1) * SPAN) - u * SPAN) / B::QK * B::NBYTES;
      if constexpr (L::WIDE) {
        const int words = (ub + 15) / 16, h = lane & 1;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint8_t* a = src[p] + (int64_t)u * (PAIR * UB);
          uint8_t* d = st + dst[p];
#pragma unroll
          for (int k = 0; k < (L::WMAX + 1) / 2; ++k)
            if (2 * k + h < words) cp_async16(d + 32 * k, a + 32 * k, true);
        }
      } else {
#pragma unroll 4
        for (int idx = lane; idx < ROWS * L::WMAX; idx += 32) {
          const int r = idx / L::WMAX, wd = idx - r * L::WMAX;
          const uint8_t* a = w + (int64_t)min(row0 + r, N - 1) * L::RB + (int64_t)u * (PAIR * UB);
          const uintptr_t a0 = reinterpret_cast<uintptr_t>(a) & ~(uintptr_t)3;
          const int words = (int)((reinterpret_cast<uintptr_t>(a) + ub + 3 - a0) >> 2);
          if (wd < words) cp_async4(st + r * L::STRIDE * 16 + wd * 4, reinterpret_cast<const void*>(a0 + 4 * wd), true);
        }
      }
    }
  };

  // x[t][u * SPAN + 256 c + 8 lane .. + 8) of each token t and unit c of the stage (zero past num_tokens or K)
  __device__ static __forceinline__ void load_x(const T* __restrict__ x, int64_t num_tokens, int K, int u, int lane,
                                                uint4 (&v)[PAIR][NT]) {
#pragma unroll
    for (int c = 0; c < PAIR; ++c) {
      const int k = u * SPAN + c * UNIT + 8 * lane;
#pragma unroll
      for (int t = 0; t < NT; ++t)
        v[c][t] = (t < num_tokens && k < K) ? __ldg(reinterpret_cast<const uint4*>(x + (int64_t)t * K + k))
                                            : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __device__ static __forceinline__ void to_f2(uint32_t w, float& a, float& b) {
    if constexpr (Pair<T>::MAGIC == Pair<bf16>::MAGIC) {
      a = __uint_as_float(w << 16);
      b = __uint_as_float(w & 0xFFFF0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const half2*>(&w));
      a = f.x;
      b = f.y;
    }
  }
  // unit c's activations as float32 at xs + c * XCHUNK: x[t][256] then the sums of each 16, sums[t][16]
  __device__ static __forceinline__ void store_x(float* xs, int lane, const uint4 (&v)[PAIR][NT]) {
#pragma unroll
    for (int c = 0; c < PAIR; ++c) {
      float* xc = xs + c * XCHUNK;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float f[8];
        to_f2(v[c][t].x, f[0], f[1]);
        to_f2(v[c][t].y, f[2], f[3]);
        to_f2(v[c][t].z, f[4], f[5]);
        to_f2(v[c][t].w, f[6], f[7]);
        float4* o = reinterpret_cast<float4*>(xc + t * UNIT + 8 * lane);
        o[0] = make_float4(f[0], f[1], f[2], f[3]);
        o[1] = make_float4(f[4], f[5], f[6], f[7]);
        float sum = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        if ((lane & 1) == 0) xc[NT * UNIT + t * 16 + lane / 2] = sum;
      }
    }
  }

  // the stage's units for one row: unit c starts at byte OFF + c UB of the staged row st; FULL: every block of
  // the stage lies within K (no per-block tests: the units' code is one stream for the scheduler)
  template <int OFF, bool FULL>
  __device__ static __forceinline__ void stage(const uint8_t* st, const float* xs, int k0, int K, float (&acc)[NT]) {
    gv::static_for<0, PAIR>([&](auto ci) {
      constexpr int c = decltype(ci)::value, P = OFF + c * UB, W0 = P / 16;
      constexpr int NWC = (P % 16 + UB + 4 + 15) / 16;  // 16-byte words covering the unit (and a word past it)
      const int nb = FULL ? UNIT / 32 : max(0, min(UNIT, K - (k0 + c * UNIT)) / 32);
      // a unit past K (K an odd number of units in a two-unit stage): nothing was staged there, and a K-quant's
      // unit (one super-block) reads its whole block whatever nb says
      if (!FULL && nb == 0) return;
      uint4 s[NWC];
#pragma unroll
      for (int q = 0; q < NWC; ++q) s[q] = gv::lds128(st + 16 * (W0 + q));
      Gemv<F>::template unit<P % 16, NT, FULL>(s, xs + c * XCHUNK, xs + c * XCHUNK + NT * UNIT, nb, acc);
    });
  }

  template <int64_t RB, bool PDL>
  __device__ static __forceinline__ void kernel(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                                T* __restrict__ out, int64_t num_tokens, int N, int K,
                                                uint8_t* smem) {
    typedef Layout<RB> L;
    static_assert(L::SMEM_BYTES <= 227 * 1024, "shared memory of a block: fewer warps or stages");
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * ROWS;
    const int units = (K + SPAN - 1) / SPAN;
    const int mine = units > warp ? (units - warp + WARPS - 1) / WARPS : 0;
    uint8_t* ring = smem + warp * L::WARP_BYTES;
    float* xs = reinterpret_cast<float*>(ring + STAGES * L::STAGE_BYTES);
    const int row = min(row0 + lane, N - 1);
    const Copier<L> copy(w, row0, N, K, lane);

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < mine) copy(ring + s * L::STAGE_BYTES, warp + s * WARPS);
      cp_async_commit();
    }
    // the weights are in flight; x and out belong to the kernels before this one on the stream
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (PDL) {
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
#endif
    uint4 xv[PAIR][NT];
    if (mine > 0) {
      load_x(x, num_tokens, K, warp, lane, xv);
      store_x(xs, lane, xv);
    }
    float acc[NT];
    gv::zero(acc);
    for (int i = 0; i < mine; ++i) {
      const int u = warp + i * WARPS;
      cp_async_wait<STAGES - 2>();
      __syncwarp();
      {
        const int nx = i + STAGES - 1;
        if (nx < mine) copy(ring + (nx % STAGES) * L::STAGE_BYTES, warp + nx * WARPS);
        cp_async_commit();
      }
      if (i + 1 < mine) load_x(x, num_tokens, K, u + WARPS, lane, xv);
      const uint8_t* st = ring + (i % STAGES) * L::STAGE_BYTES + lane * L::STRIDE * 16;
      const int k0 = u * SPAN;
      const bool full = k0 + SPAN <= K;
      if constexpr (L::EVEN) {
        if (full) stage<0, true>(st, xs, k0, K, acc);
        else stage<0, false>(st, xs, k0, K, acc);
      } else {
        const bool odd = (reinterpret_cast<uintptr_t>(w + (int64_t)row * RB + (int64_t)u * (PAIR * UB)) & 2) != 0;
        if (odd) {
          if (full) stage<2, true>(st, xs, k0, K, acc);
          else stage<2, false>(st, xs, k0, K, acc);
        } else {
          if (full) stage<0, true>(st, xs, k0, K, acc);
          else stage<0, false>(st, xs, k0, K, acc);
        }
      }
      __syncwarp();
      if (i + 1 < mine) store_x(xs, lane, xv);
    }
    cp_async_wait<0>();

    // the warps' partial sums (their K stages), summed and stored
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int t = 0; t < NT; ++t) red[(warp * NT + t) * 32 + lane] = acc[t];
    __syncthreads();
    for (int e = threadIdx.x; e < NT * 32; e += THREADS) {
      float v = 0.f;
#pragma unroll
      for (int q = 0; q < WARPS; ++q) v += red[q * NT * 32 + e];
      const int t = e / 32, r = row0 + (e & 31);
      if (r < N && t < num_tokens) out[(int64_t)t * N + r] = from_float<T>(v);
    }
  }
};

// ---------------------------------------------------------------- quant_matmul, tensor cores
template <Fmt F, class T, int MT, int NT, int WARPS, int STAGES>
struct QuantMatmul {
  typedef Block<F> B;
  static constexpr bool BF16 = sizeof(T) == 2 && Pair<T>::MAGIC == Pair<bf16>::MAGIC;
  static constexpr int ROWS = 16 * MT, TOKENS = 8 * NT, THREADS = 32 * WARPS;
  static constexpr int UNIT = 256, UB = UNIT / B::QK * B::NBYTES;  // weights and bytes a unit of a row
  static constexpr int WMAX = (UB + 15) / 16 + 1;                   // 16-byte words covering a unit's bytes
  static constexpr int STRIDE = WMAX | 1;                           // words a staged row (odd: banks spread)
  static constexpr int STAGE_BYTES = ROWS * STRIDE * 16;
  static constexpr int COPIES = (ROWS * WMAX + 31) / 32;            // cp.async a lane a unit
  static constexpr int RED_BYTES = WARPS > 1 ? WARPS * MT * NT * 4 * 32 * 4 : 0;
  static constexpr int SMEM_BYTES =
      WARPS * STAGES * STAGE_BYTES > RED_BYTES ? WARPS * STAGES * STAGE_BYTES : RED_BYTES;
  static_assert(STAGES >= 2, "a unit in flight while one is decoded");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory of a block: fewer warps, stages or m_tiles");

  // stage unit u of rows row0 .. row0 + ROWS (clamped to N - 1) into st; returns nothing, commits nothing
  __device__ static __forceinline__ void copy_unit(uint8_t* st, const uint8_t* w, int64_t row_bytes, int row0,
                                                   int N, int K, int u, int lane) {
    const int ub = (min(K, (u + 1) * UNIT) - u * UNIT) / B::QK * B::NBYTES;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const int idx = lane + 32 * i;
      const int r = idx / WMAX, wd = idx - r * WMAX;
      if (r < ROWS) {
        const uint8_t* a = w + (int64_t)min(row0 + r, N - 1) * row_bytes + (int64_t)u * UB;
        const uintptr_t a0 = reinterpret_cast<uintptr_t>(a) & ~(uintptr_t)15;
        const int words = (int)((reinterpret_cast<uintptr_t>(a) + ub + 15 - a0) >> 4);
        if (wd < words) cp_async16(st + (r * STRIDE + wd) * 16, reinterpret_cast<const void*>(a0 + 16 * wd), true);
      }
    }
  }

  template <bool PDL>
  __device__ static __forceinline__ void kernel(const T* __restrict__ x, const uint8_t* __restrict__ w,
                                                T* __restrict__ out, int64_t num_tokens, int N, int K,
                                                uint8_t* smem) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const int64_t tok0 = (int64_t)blockIdx.y * TOKENS;
    const int64_t row_bytes = (int64_t)(K / B::QK) * B::NBYTES;
    const int units = (K + UNIT - 1) / UNIT;
    const int mine = units > warp ? (units - warp + WARPS - 1) / WARPS : 0;  // units of this warp
    uint8_t* ring = smem + warp * STAGES * STAGE_BYTES;

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
      for (int b = 0; b < NT; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    // activations: token g of each tile, or none past num_tokens
    const T* xrow[NT];
    bool xok[NT];
#pragma unroll
    for (int b = 0; b < NT; ++b) {
      const int64_t tok = tok0 + 8 * b + g;
      xok[b] = tok < num_tokens;
      xrow[b] = x + (xok[b] ? tok : 0) * K;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < mine) copy_unit(ring + s * STAGE_BYTES, w, row_bytes, row0, N, K, warp + s * WARPS, lane);
      cp_async_commit();
    }
    // the weights are in flight; x and out belong to the kernels before this one on the stream
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (PDL) {
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
#endif
    for (int i = 0; i < mine; ++i) {
      cp_async_wait<STAGES - 2>();
      __syncwarp();
      {
        const int nx = i + STAGES - 1;
        if (nx < mine) copy_unit(ring + (nx % STAGES) * STAGE_BYTES, w, row_bytes, row0, N, K, warp + nx * WARPS, lane);
        cp_async_commit();
      }
      const int u = warp + i * WARPS;
      const uint8_t* st = ring + (i % STAGES) * STAGE_BYTES;
      const int kseg = u * UNIT + 64 * t;  // this lane's 64 weights of the unit
      // rows' staged unit: the byte offset of the unit's first byte in its first word
      const uint8_t* rp[MT][2];
#pragma unroll
      for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * a + 8 * h + g;
          const uint8_t* src = w + (int64_t)min(row0 + r, N - 1) * row_bytes + (int64_t)u * UB;
          rp[a][h] = st + r * STRIDE * 16 + (reinterpret_cast<uintptr_t>(src) & 15);
        }
      if ((u + 1) * UNIT <= K) {
        unit_mma<false>(rp, xrow, xok, acc, kseg, t, K);
      } else {
        unit_mma<true>(rp, xrow, xok, acc, kseg, t, K);
      }
    }
    cp_async_wait<0>();

    // sum the warps' partial sums (their K units) and store
    if constexpr (WARPS > 1) {
      __syncthreads();
      float* red = reinterpret_cast<float*>(smem);
#pragma unroll
      for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) red[((warp * MT + a) * NT + b) * 128 + c * 32 + lane] = acc[a][b][c];
      __syncthreads();
      for (int e = threadIdx.x; e < MT * NT * 128; e += THREADS) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < WARPS; ++q) v += red[q * MT * NT * 128 + e];
        const int ab = e / 128, c = (e / 32) & 3, ln = e & 31;
        store_out(out, N, num_tokens, row0, tok0, ab / NT, ab % NT, c, ln, v);
      }
    } else {
#pragma unroll
      for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) store_out(out, N, num_tokens, row0, tok0, a, b, c, lane, acc[a][b][c]);
    }
  }

  // C fragment element c of lane ln: weight row g (c < 2) or g + 8, token 2t + (c & 1)
  __device__ static __forceinline__ void store_out(T* out, int N, int64_t num_tokens, int row0, int64_t tok0, int a,
                                                   int b, int c, int ln, float v) {
    const int row = row0 + 16 * a + (ln >> 2) + 8 * (c >> 1);
    const int64_t tok = tok0 + 8 * b + 2 * (ln & 3) + (c & 1);
    if (row < N && tok < num_tokens) out[tok * N + row] = from_float<T>(v);
  }

  // one unit: 4 groups of 16 weights a lane (4 mmas each) for every row tile and token tile. MASKED: the last
  // unit of a K that is not a multiple of 256 (weights past K count as zero, and their x is not read).
  template <bool MASKED>
  __device__ static __forceinline__ void unit_mma(const uint8_t* const (&rp)[MT][2], const T* const (&xrow)[NT],
                                                  const bool (&xok)[NT], float (&acc)[MT][NT][4], int kseg, int t,
                                                  int K) {
    constexpr int GROUPS_UNROLLED = NT >= 8 ? 1 : NT >= 4 ? 2 : 4;  // bounds the registers of loads in flight
#pragma unroll GROUPS_UNROLLED
    for (int gi = 0; gi < 4; ++gi) {
      const int k = kseg + 16 * gi;
      const bool kok = !MASKED || k < K;  // K is a multiple of 32, so a group is all in or all out
      uint4 xv[NT][2];
#pragma unroll
      for (int b = 0; b < NT; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xv[b][h] = (xok[b] && kok) ? __ldg(reinterpret_cast<const uint4*>(xrow[b] + k + 8 * h)) : make_uint4(0, 0, 0, 0);
      uint32_t p[MT][2][8];
#pragma unroll
      for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (kok) {
            B::template pairs16<T>(rp[a][h], t, gi, p[a][h]);
          } else {
#pragma unroll
            for (int q = 0; q < 8; ++q) p[a][h][q] = 0u;
          }
        }
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        // mma 4 gi + ii: weights 4 ii .. 4 ii + 3 of the group = pairs 2 ii, 2 ii + 1
#pragma unroll
        for (int a = 0; a < MT; ++a) {
          const uint32_t af[4] = {p[a][0][2 * ii], p[a][1][2 * ii], p[a][0][2 * ii + 1], p[a][1][2 * ii + 1]};
#pragma unroll
          for (int b = 0; b < NT; ++b) {
            const uint4& v = xv[b][ii >> 1];
            const uint32_t b0 = (ii & 1) ? v.z : v.x, b1 = (ii & 1) ? v.w : v.y;
            mma16816<BF16>(acc[a][b], af, b0, b1);
          }
        }
      }
    }
  }
};

}  // namespace qm
}  // namespace ua
#endif  // UA_QUANT_MATMUL_CUH
