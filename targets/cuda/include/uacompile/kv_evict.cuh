// KV eviction kernels: kv_score (the importance of each cached token, per sequence and KV head, from a window of
// queries: AnDPro, attention-only or value-norm weighted; ir.KVScore) and gather_tokens (the kept tokens of every
// layer and KV head copied into fresh slots; ir.GatherTokens).
#pragma once
#include "uacompile/common.cuh"

namespace ua {

enum ScoreMethod { SCORE_ANDPRO = 0, SCORE_ATTENTION = 1, SCORE_VALUE_NORM = 2 };

// One block per (sequence, KV head). Thread r owns positions i = r + k * THREADS of the scores row throughout, so
// the row accumulates in global memory without races. For each window query and query head of the group: an
// online softmax over the thread's positions, reduced over the block, gives (max, sum); the weights are then
// recomputed where used: the anchor o_h (andpro's first phase: a chunk of THREADS weights in shared memory, the
// threads over D), then the scores. float32 throughout; expf / sqrtf (not the fast intrinsics).
template <typename Q, typename KV, int D, int P, int HKV, int G, int METHOD, int THREADS>
struct KVScore {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS: whole warps");
  static constexpr int HQ = HKV * G, WARPS = THREADS / 32;
  struct Smem {
    float q[D];
    float o[G][D];  // the anchor of each query head (a sum over the window: its direction is all that counts)
    float norm[G];
    float p[THREADS];
    float red_m[WARPS], red_l[WARPS];
    float stat[2];  // the block's max and sum
  };

  __device__ static __forceinline__ const KV* row(const KV* cache, const int32_t* table, int64_t i, int g) {
    const int64_t page = table[i / P];
    return cache + ((page * P + i % P) * HKV + g) * (int64_t)D;
  }

  __device__ static __forceinline__ float qk(const float* q, const KV* k) {
    float a = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) a = fmaf(q[d], to_float(k[d]), a);
    return a;
  }

  __device__ static __forceinline__ void combine(float& m, float& l, float m2, float l2) {
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;
    l = (m == -INFINITY ? 0.0f : l * expf(m - mn)) + (m2 == -INFINITY ? 0.0f : l2 * expf(m2 - mn));
    m = mn;
  }

  // (max, sum of exp) of the scaled scores over positions [0, n) into s.stat
  __device__ static void softmax_stats(Smem& s, const KV* k_cache, const int32_t* table, int64_t n, int g,
                                       float scale) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += THREADS) combine(m, l, qk(s.q, row(k_cache, table, i, g)) * scale, 1.0f);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
      combine(m, l, m2, l2);
    }
    if (threadIdx.x % 32 == 0) s.red_m[threadIdx.x / 32] = m, s.red_l[threadIdx.x / 32] = l;
    __syncthreads();
    if (threadIdx.x == 0) {
      float bm = -INFINITY, bl = 0.0f;
      for (int w = 0; w < WARPS; ++w) combine(bm, bl, s.red_m[w], s.red_l[w]);
      s.stat[0] = bm, s.stat[1] = bl;
    }
    __syncthreads();
  }

  __device__ static void load_q(Smem& s, const Q* q, int64_t t, int h) {
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += THREADS) s.q[d] = to_float(q[(t * HQ + h) * D + d]);
    __syncthreads();
  }

  __device__ static void run(Smem& s, const Q* __restrict__ q, const KV* __restrict__ k_cache,
                             const KV* __restrict__ v_cache, const int32_t* __restrict__ query_seq,
                             const int32_t* __restrict__ query_kv_len, const int32_t* __restrict__ page_table,
                             const int32_t* __restrict__ kv_len, float* __restrict__ scores, int64_t num_queries,
                             int64_t max_pages, int64_t max_kv_len, float scale) {
    const int64_t seq = blockIdx.x;
    const int g = blockIdx.y;
    const int64_t L = kv_len[seq];
    const int32_t* table = page_table + seq * max_pages;
    float* out = scores + (seq * HKV + g) * max_kv_len;
    for (int64_t i = threadIdx.x; i < max_kv_len; i += THREADS) out[i] = i < L ? 0.0f : -INFINITY;
    int64_t count = 0;
    for (int64_t t = 0; t < num_queries; ++t) count += query_seq[t] == seq;
    if (count == 0) return;
    const float inv = 1.0f / (float)(count * G);
    if (METHOD == SCORE_ANDPRO) {
      for (int e = threadIdx.x; e < G * D; e += THREADS) s.o[e / D][e % D] = 0.0f;
      for (int64_t t = 0; t < num_queries; ++t) {
        if (query_seq[t] != seq) continue;
        const int64_t n = query_kv_len[t];
        for (int h = 0; h < G; ++h) {
          load_q(s, q, t, g * G + h);
          softmax_stats(s, k_cache, table, n, g, scale);
          const float m = s.stat[0], l = s.stat[1];
          for (int64_t c0 = 0; c0 < n; c0 += THREADS) {
            const int64_t i = c0 + threadIdx.x;
            s.p[threadIdx.x] = i < n ? expf(qk(s.q, row(k_cache, table, i, g)) * scale - m) / l : 0.0f;
            __syncthreads();
            const int64_t chunk = n - c0 < THREADS ? n - c0 : THREADS;
            for (int d = threadIdx.x; d < D; d += THREADS) {
              float a = s.o[h][d];
              for (int64_t j = 0; j < chunk; ++j) a = fmaf(s.p[j], to_float(row(v_cache, table, c0 + j, g)[d]), a);
              s.o[h][d] = a;
            }
            __syncthreads();
          }
        }
      }
      __syncthreads();
      if (threadIdx.x < G) {
        float ss = 0.0f;
        for (int d = 0; d < D; ++d) ss = fmaf(s.o[threadIdx.x][d], s.o[threadIdx.x][d], ss);
        s.norm[threadIdx.x] = sqrtf(ss);
      }
      __syncthreads();
    }
    for (int64_t t = 0; t < num_queries; ++t) {
      if (query_seq[t] != seq) continue;
      const int64_t n = query_kv_len[t];
      for (int h = 0; h < G; ++h) {
        load_q(s, q, t, g * G + h);
        softmax_stats(s, k_cache, table, n, g, scale);
        const float m = s.stat[0], l = s.stat[1];
        for (int64_t i = threadIdx.x; i < n; i += THREADS) {
          const float p = expf(qk(s.q, row(k_cache, table, i, g)) * scale - m) / l;
          float w = 1.0f;
          if (METHOD == SCORE_VALUE_NORM) {
            const KV* v = row(v_cache, table, i, g);
            w = 0.0f;
            for (int d = 0; d < D; ++d) w += fabsf(to_float(v[d]));
          } else if (METHOD == SCORE_ANDPRO) {
            const float nrm = s.norm[h];
            if (nrm > 0.0f) {
              const KV* v = row(v_cache, table, i, g);
              w = 0.0f;
              for (int d = 0; d < D; ++d) w = fmaf(s.o[h][d], to_float(v[d]), w);
              w /= nrm;
            } else {
              w = 0.0f;
            }
          }
          out[i] += p * w * inv;
        }
      }
    }
  }
};

// One block per kept token, threads over (layer, KV head) rows of D elements: K and V (and the scales) of
// src_slots[l, g, t] into dst_slots[t]; dst -1 skips. Destinations are never sources (ir.GatherTokens).
template <typename T, int D, int P, int HKV, bool QUANT>
__device__ void gather_tokens(T* kv, float* scales, const int64_t* __restrict__ src_slots,
                              const int64_t* __restrict__ dst_slots, int64_t num_layers, int64_t num_pages,
                              int64_t num_tokens) {
  const int64_t t = blockIdx.x;
  const int64_t dst = dst_slots[t];
  if (dst < 0) return;
  const int64_t rows = num_layers * HKV * 2;
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D;
    const int64_t c = r % 2, lg = r / 2, layer = lg / HKV, g = lg % HKV;
    const int64_t src = src_slots[(layer * HKV + g) * num_tokens + t];
    const int64_t base = (layer * 2 + c) * num_pages;
    kv[((base * P + dst) * HKV + g) * D + d] = kv[((base * P + src) * HKV + g) * D + d];
    if (QUANT && d == 0) scales[(base * P + dst) * HKV + g] = scales[(base * P + src) * HKV + g];
  }
}

}  // namespace ua
