// copy_blocks and swap_blocks: whole pages of one layer's K or V (and their scales) moved by chunks of
// THREADS * UNROLL vectors, all layers in one launch. grid.x = pair x chunk of the page (then of its scales),
// grid.y = layer x (K|V).
#ifndef UA_PAGE_COPY_CUH
#define UA_PAGE_COPY_CUH
#include "uacompile/common.cuh"

namespace ua {

// PAGE_BYTES of a page in VEC_BYTES vectors; SCALE_BYTES of its scales (0: no scales, unquantised KV) in
// SCALE_VEC_BYTES vectors.
template <int THREADS_, int UNROLL, int64_t PAGE_BYTES, int VEC_BYTES, int64_t SCALE_BYTES, int SCALE_VEC_BYTES>
struct PageCopy {
  static constexpr int THREADS = THREADS_;
  static constexpr bool SCALES = SCALE_BYTES > 0;
  typedef typename RawBytes<VEC_BYTES>::type V;
  typedef typename RawBytes<SCALE_VEC_BYTES>::type SV;
  static constexpr int64_t PAGE_VECS = PAGE_BYTES / sizeof(V);
  static constexpr int64_t PAGE_CHUNKS = (PAGE_VECS + THREADS * UNROLL - 1) / (THREADS * UNROLL);
  static constexpr int64_t SCALE_VECS = SCALE_BYTES / sizeof(SV);
  static constexpr int64_t SCALE_CHUNKS = SCALES ? (SCALE_VECS + THREADS * UNROLL - 1) / (THREADS * UNROLL) : 0;
  static constexpr int64_t CHUNKS = PAGE_CHUNKS + SCALE_CHUNKS;

  // copy_blocks (precondition, as vLLM's: no destination page is also a source page).
  static __device__ __forceinline__ void copy_blocks(V* kv, void* scales, const int64_t* __restrict__ mapping,
                                                     int64_t num_pages) {
    move_pair(kv, kv, scales, scales, mapping, num_pages, num_pages);
  }

  // swap_blocks: src / dst may be device memory or pinned host memory (mapped under UVA: the kernel reads or
  // writes it over PCIe directly), so one launch moves every page instead of one memcpy a page.
  static __device__ __forceinline__ void swap_blocks(const V* __restrict__ src, V* __restrict__ dst,
                                                     const void* src_scales, void* dst_scales,
                                                     const int64_t* __restrict__ mapping, int64_t num_src_pages,
                                                     int64_t num_dst_pages) {
    move_pair(src, dst, src_scales, dst_scales, mapping, num_src_pages, num_dst_pages);
  }

  // The body of both: this block's chunk of pair blockIdx.x / CHUNKS (of the page, then of its scales) from page
  // mapping[2 pair] of src to page mapping[2 pair + 1] of dst, layer x K/V blockIdx.y. The callers' pointers say
  // what may alias (copy_blocks: src and dst are one cache; swap_blocks: two, __restrict__).
  static __device__ __forceinline__ void move_pair(const V* src, V* dst, const void* src_scales, void* dst_scales,
                                                   const int64_t* __restrict__ mapping, int64_t num_src_pages,
                                                   int64_t num_dst_pages) {
    const int64_t pair = blockIdx.x / CHUNKS, chunk = blockIdx.x % CHUNKS;
    const int64_t lk = blockIdx.y;  // layer * 2 + (0 = K, 1 = V)
    const int64_t s = mapping[2 * pair], d = mapping[2 * pair + 1];
    if (chunk < PAGE_CHUNKS) {
      copy_chunk<V, THREADS, UNROLL, PAGE_VECS>(src + (lk * num_src_pages + s) * PAGE_VECS,
                                                dst + (lk * num_dst_pages + d) * PAGE_VECS, chunk);
    } else if constexpr (SCALES) {
      copy_chunk<SV, THREADS, UNROLL, SCALE_VECS>((const SV*)src_scales + (lk * num_src_pages + s) * SCALE_VECS,
                                                  (SV*)dst_scales + (lk * num_dst_pages + d) * SCALE_VECS,
                                                  chunk - PAGE_CHUNKS);
    }
  }
};

}  // namespace ua
#endif  // UA_PAGE_COPY_CUH
