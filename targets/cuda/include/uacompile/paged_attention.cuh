// paged_attention: the UA paged-attention kernel, templated on a Config (templates/cuda/paged_attention.cu.j2 writes
// one from the op and its CUDA config; its __global__ entry calls PagedAttention<Config>::run, and its launcher
// fills Params).
//
// One launch serves any mix of decode tokens and prefill chunks (the UA form). Rows of a tile
// are (token, q head of one KV group) pairs, so the heads of a GQA group share every K/V load.
// The grid has two kinds of blocks (blockIdx.x < num_decode: decode, else prefill):
//  - decode: one token that is the only query token of its sequence in the ubatch. A group of
//    4 warps (a block has GROUPS of them, each with its own smem, running its own tokens) each
//    stream their own 16-position K/V tiles (cp.async, 16-byte loads, NSTAGE deep) of the split's
//    range and run mma.sync on them; their partial softmax states merge through smem at the end.
//  - prefill: TM consecutive tokens; each run of one sequence in it is a tile of up to
//    PREFILL_ROWS rows. Hopper: one warpgroup, wgmma and TMA (WGMMA, below); elsewhere
//    16 * MT_PRE rows per warp, FlashAttention-2 style (Q stays in smem), sharing BN_PRE-position
//    K/V tiles loaded by all warps, NSTAGE * KV_ROWS / BN_PRE tiles deep.
// Positions are "virtual": v = seq * max_pages * P + j, so the flat page table is indexed by
// v / P. unified_masked scans the virtual range of every sequence and masks foreign cells.
//
// Config: typedefs qt (q and out), kvt (the cache element); static constexpr int D, P, HQ, HKV, NSPLIT, WINDOW,
// GROUPS, PRODUCER_THREADS, MT_PRE, BN_PRE, KV_ROWS, NSTAGE, DW, PREFILL_ROWS, SMEM_BYTES, SMEM_PREFILL,
// MIN_BLOCKS; bool IS_BF16, QUANT, IS_FP8, UNIFIED, ALIBI, SOFTCAP, WRITE_LSE, FUSED_MERGE, MERGE_LSE, PDL,
// DYNAMIC, DECODE_ONLY; float SM_SCALE, CAP (targets/cuda/render.py and layout.py say what each is). The Hopper
// prefill path's: bool WGMMA; int BN_WG, NST_WG, CP_PRODUCER_BELOW, CP_ROW_LANES, Q_PREFETCH_MIN; and, with WGMMA,
// static __device__ wg_qk (m64nBN_WGk16, both operands from shared memory), wg_qk_half (m64n(BN_WG/2)k16) and
// wg_pv (m64nDWk16, A from registers, B transposed) wrapping wgmma.mma_async.
#ifndef UA_PAGED_ATTENTION_CUH
#define UA_PAGED_ATTENTION_CUH
#include <cudaTypedefs.h>  // the tensor-map encoder's type (encode_kv_map)
#include "uacompile/hopper.cuh"
#include "uacompile/ptx.cuh"

namespace ua {
template <class Config>
struct PagedAttention {
  typedef typename Config::qt qt;
  typedef typename Config::kvt kvt;

  static constexpr int D = Config::D, P = Config::P, HQ = Config::HQ, HKV = Config::HKV, G = HQ / HKV;
  static constexpr int NSPLIT = Config::NSPLIT;
  static constexpr bool IS_BF16 = Config::IS_BF16;
  static constexpr bool QUANT = Config::QUANT;
  static constexpr bool IS_FP8 = Config::IS_FP8;
  static constexpr bool UNIFIED = Config::UNIFIED;
  static constexpr bool ALIBI = Config::ALIBI;
  static constexpr bool SOFTCAP = Config::SOFTCAP;
  static constexpr bool WRITE_LSE = Config::WRITE_LSE;
  // fused split-KV merge (the config's fused_merge): the last split block of a work item writes out (and lse)
  static constexpr bool FUSED_MERGE = Config::FUSED_MERGE;
  static constexpr bool MERGE_LSE = Config::MERGE_LSE;
  // Decode fixed cost: a decode group loads its first token's metadata and Q before the lone-token scan,
  // guessing its rank is its token (true in a pure decode launch), and issues its first K/V tiles before Q
  // goes through smem (load_guess); a split arrives with one release/acquire atomic (no fence by every
  // thread) and a merge has up to MERGE_CHUNK partials in flight at once; the grid is 1-D with every decode
  // block ahead of every prefill block, and prefill blocks whose tile holds only lone tokens exit after
  // reading them. PDL (sm_90+): programmatic dependent launch (the next kernel's blocks start while this
  // one drains; each block waits for the previous kernel before touching memory).
  static constexpr bool PDL = Config::PDL;
  // Hopper prefill with the config's item_queue: min(items, SMs) persistent prefill blocks after the decode
  // blocks take (tile, KV head, split group) items from an atomic queue, heaviest first; without it
  // (and on the mma.sync path) a prefill block runs one item. (docs/attention-rationale.md, "The dynamic tile queue").
  static constexpr bool DYNAMIC = Config::DYNAMIC;
  // the config's decode_only: every block is a decode block and group b takes token b itself (no lone-token scan); no
  // prefill path, so ptxas sizes registers for decode alone (attention.py's decode-only layout)
  static constexpr bool DECODE_ONLY = Config::DECODE_ONLY;
  static constexpr int WINDOW = Config::WINDOW;
  static constexpr float SM_SCALE = Config::SM_SCALE;
  static constexpr float CAP = Config::CAP;
  static constexpr float LOG2E = 1.4426950408889634f;
  static constexpr float LN2 = 0.6931471805599453f;

  static constexpr int WARPS = 4, THREADS = 32 * WARPS;   // a decode group (and a mma.sync prefill block)
  static constexpr int GROUPS = Config::GROUPS;               // 2 on the Hopper path: decode groups, prefill consumer warpgroups
  static constexpr int CONSUMER_THREADS = THREADS * GROUPS;  // a decode block's groups; a prefill tile's computing warps
  static constexpr int PRODUCER_THREADS = Config::PRODUCER_THREADS;  // Hopper: the warpgroup that issues the K/V copies
  static constexpr int BLOCK_THREADS = CONSUMER_THREADS + PRODUCER_THREADS;
  static_assert(!DYNAMIC || PRODUCER_THREADS > 0, "the persistent prefill blocks are the Hopper path's");
  // With split-KV, a block's decode groups take consecutive splits of one item (so a single long
  // sequence still fills every group) and its prefill tile runs those splits one after another;
  // without, they take different items. grid.z = ceil(NSPLIT / SPLIT_GROUPS).
  static constexpr int SPLIT_GROUPS = NSPLIT > 1 ? GROUPS : 1;
  static constexpr int ZSPLITS = (NSPLIT + SPLIT_GROUPS - 1) / SPLIT_GROUPS;
  static constexpr int MT_PRE = Config::MT_PRE;          // 16-row mma tiles per warp in prefill blocks: each
                                                    // K/V fragment read from smem feeds MT_PRE mmas
  static constexpr int ROWS = 16 * WARPS * MT_PRE;         // query rows of a prefill tile
  static constexpr int BN_DEC = 16;                        // K/V positions per decode warp tile
  static constexpr int BN_PRE = Config::BN_PRE;          // K/V positions per prefill tile
  static constexpr int KV_ROWS = Config::KV_ROWS;            // K/V rows of one smem stage (4 * BN_DEC >= BN_PRE)
  static constexpr int NSTAGE = Config::NSTAGE;
  static constexpr int DPAD = D + 8;                       // +16 bytes per row: ldmatrix is conflict free
  static constexpr int DK = D / 16, DN = D / 8;            // mma k-steps and n-tiles over D
  // O's n-tiles in a State: DW / 8, where DW is the wgmma path's padded row width (attention.wgmma_width; D
  // elsewhere). The padded columns stay zero, and only the first DN n-tiles are stored.
  static constexpr int DW = Config::DW, DNS = DW / 8;
  static constexpr int PREFILL_ROWS = Config::PREFILL_ROWS;   // query rows of a prefill block
  static constexpr int TM = PREFILL_ROWS / G;              // tokens per prefill tile
  static constexpr int CHUNKS = D * (int)sizeof(kvt) / 16; // 16-byte chunks of one cached row
  static constexpr int64_t ROW_STRIDE = (int64_t)HKV * D;  // elements between positions of one head

  // shared memory (bytes); the layout is sized by attention.py (smem_bytes) and checked here
  static constexpr int TILE_BYTES = KV_ROWS * DPAD * 2;                       // one K or V tile, 16-bit
  static constexpr bool QFAST_D = D == 64 || D % 128 == 0;                    // head dims the raw-stage decode takes (QFAST)
  // quantised: one converted pair (none in decode-only kernels of QFAST_D: their decode reads the raw stage)
  static constexpr int TILES_BYTES = (QUANT ? (DECODE_ONLY && QFAST_D ? 0 : 2) : 2 * NSTAGE) * TILE_BYTES;
  static constexpr int RAW_ROW = QUANT ? D : 0;                               // raw bytes per cached row
  static constexpr int RAW_STAGE = QUANT ? 2 * KV_ROWS * (D + 4) : 0;         // raw K, V + their scales
  static constexpr int Q_OFFSET = TILES_BYTES + NSTAGE * RAW_STAGE;         // Q rows stay resident here
  static constexpr int Q_BYTES = ROWS * DPAD * 2;
  static constexpr int COMBINE_BYTES = WARPS * 16 * (D + 4) * 4 + 2 * WARPS * 16 * 4;
  static constexpr int SMEM_NEEDED = (Q_OFFSET + Q_BYTES) > COMBINE_BYTES ? (Q_OFFSET + Q_BYTES) : COMBINE_BYTES;
  static constexpr int SMEM_BYTES = Config::SMEM_BYTES;
  static constexpr int SMEM_PREFILL = Config::SMEM_PREFILL;  // the wgmma prefill stages (0: the mma.sync path's)
  static_assert((GROUPS * SMEM_NEEDED > SMEM_PREFILL ? GROUPS * SMEM_NEEDED : SMEM_PREFILL) == SMEM_BYTES,
                "attention.py and the template disagree on shared memory");
  static_assert(SMEM_NEEDED % 128 == 0, "each decode group's smem starts 128-byte aligned");

  // The barrier of one decode group's 128 threads (named barrier 1 + group; 0 is __syncthreads).
  static __device__ __forceinline__ void decode_group_sync() {
    if constexpr (GROUPS == 1) __syncthreads();
    else asm volatile("bar.sync %0, %1;\n" ::"r"(1 + (int)threadIdx.x / THREADS), "n"(THREADS) : "memory");
  }
  // The barrier of the threads that compute a prefill tile (a producer warpgroup takes no part).
  static __device__ __forceinline__ void consumer_sync() {
    if constexpr (PRODUCER_THREADS == 0) __syncthreads();
    else asm volatile("bar.sync 3, %0;\n" ::"n"(CONSUMER_THREADS) : "memory");
  }
  // Decode warps keep Q in registers, so the resident-Q region is free for a third K/V stage
  // (non-quantised KV with 2 prefill m-tiles: that region is exactly one more K + V stage, and
  // stage s of either kind starts at 2 * s * TILE_BYTES). Warp w's rows of it overlap only the
  // Q rows that warp w itself staged.
  static constexpr bool DEC_QSTAGE = !QUANT && Q_OFFSET == 2 * NSTAGE * TILE_BYTES && Q_BYTES >= 2 * TILE_BYTES;
  static constexpr int DEC_DEPTH = NSTAGE + (DEC_QSTAGE ? 1 : 0);
  // 16-bit K/V tile layout. Padded rows (DPAD: ldmatrix conflict free) start 272 bytes apart, so a 128-byte line
  // a cp.async warp copies would land across two 128-byte smem segments and L1TEX would split it into
  // partial-line L2 requests. Swizzled (TILE_SWIZZLE: 16-bit rows of whole 128-byte segments): within each
  // 16-row block (which keeps its DPAD-row footprint and offset) rows are D * 2 bytes apart and 16-byte chunk c
  // of row r sits at c ^ (r % 8): a line lands in one segment, ldmatrix stays conflict free. That needs the tile
  // to start 128-byte aligned, so the kernel's dynamic smem is declared __align__(128). Other tiles (quantised
  // KV's converted pair, D not a multiple of 64) keep the padded rows.
  static constexpr bool TILE_SWIZZLE = !QUANT && D % 64 == 0;
  // TILE_SWIZZLE: byte offset of 16-byte chunk c of row r of a K/V tile (r counted from a 16-row boundary)
  static __device__ __forceinline__ int tile_off(int r, int c) {
    return (r / 16) * (16 * DPAD * 2) + (r % 16) * (D * 2) + ((c ^ (r % 8)) * 16);
  }
  // Quantised decode on the raw stage (QFAST: head dims QFAST_D; others take the dequantising pass): decode warps read the raw 8-bit K/V rows straight from their cp.async stage (ldmatrix of the bytes as
  // b16 data, converted to q's dtype in registers, exact) and apply the per-position scales outside the
  // per-element path: each score is multiplied by its k scale after Q K^T, and P by the v scale before
  // P V. No converted tile, no smem round trip, no extra barrier per tile. The raw stage rows of decode
  // are XOR-swizzled by 16-byte chunk (raw_chunk) so those ldmatrix reads are conflict free. The
  // prefill (block) tiles keep dequant_tile.
  static constexpr bool QFAST = QUANT && QFAST_D;
  static_assert(D % 16 == 0 && BN_PRE % 16 == 0 && KV_ROWS % BN_PRE == 0 && 4 * BN_DEC <= KV_ROWS, "tile shapes");
  static_assert(G <= 16, "a decode token's group must fit one 16-row mma tile");

  struct Params {
    const qt* q;
    const kvt* k_cache;
    const kvt* v_cache;
    const int32_t* token_seq;
    const int32_t* page_table;
    const int32_t* token_kv_len;
    const float* k_scale;
    const float* v_scale;
    const float* alibi;
    qt* out;
    float* lse;
    float* o_partial;
    float* lse_partial;
    int32_t* split_counters;  // fused_merge: [num_tokens, HKV], zero between launches
    int32_t* item_queue;      // DYNAMIC: {next prefill item, prefill blocks done}, zero between launches
    int64_t num_tokens, num_seqs, max_pages, num_decode, num_decode_blocks, num_prefill_tiles;
    int64_t num_prefill_ctas;  // DYNAMIC: the persistent prefill blocks after the decode blocks
  };

  // A block's (x, KV head, split group), unpacked from the 1-D grid index: decode blocks, over every head and
  // split group, come before the prefill blocks, so a pure decode launch dispatches all its decode blocks in its
  // first wave.
  struct BlockCoord {
    int64_t x;
    int y, z;
  };
  static __device__ __forceinline__ BlockCoord block_coord(const Params& p) {
    const uint32_t id = blockIdx.x, ndb = (uint32_t)p.num_decode_blocks, decode_ids = ndb * (HKV * ZSPLITS);
    const bool decode = id < decode_ids;
    const uint32_t n = decode ? ndb : (uint32_t)p.num_prefill_tiles, r = decode ? id : id - decode_ids;
    const uint32_t yz = r / n;
    return {(int64_t)(r % n) + (decode ? 0 : (int64_t)ndb), (int)(yz % HKV), (int)(yz / HKV)};
  }
  static __device__ __forceinline__ int kv_head(const Params& p) { return block_coord(p).y; }

  // Programmatic dependent launch (PDL): let the next kernel launch now; wait for the previous one.
  static __device__ __forceinline__ void pdl_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (PDL) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if constexpr (PDL) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  }

  // PTX helpers: uacompile/ptx.cuh (mma16816 and pack2 in q's dtype: IS_BF16)

  // Barrier of the threads that share K/V tiles: one warp (decode) or the block (prefill).
  template <bool BLOCK>
  static __device__ __forceinline__ void group_sync() {
    if constexpr (BLOCK) __syncthreads(); else __syncwarp();
  }

  // ---------------------------------------------------------------- per-thread row state
  // Each thread owns rows g = lane/4 and g + 8 of its warp's 16-row tile.
  struct Rows {
    int64_t lo[2], hi[2];  // visible virtual positions [lo, hi) of this split (empty: lo = hi = 0)
    int64_t ref[2];        // virtual position of the row's last visible key (ALiBi distance 0)
    float slope[2];
    int64_t lo_max, hi_min;  // over the warp's valid rows: tiles inside need no mask
    int64_t lo_min, hi_max;  // tiles outside are skipped by this warp
  };

  struct State {
    float acc[DNS][4];
    float m[2], l[2];  // running max (log2 units) and this thread's partial row sums
  };

  static __device__ __forceinline__ void split_range(int kv_len, int sp, int& a, int& b) {
    const int lo = WINDOW > 0 ? max(0, kv_len - WINDOW) : 0;
    const int n = kv_len - lo;
    const int c = n > 0 ? (n + NSPLIT - 1) / NSPLIT : 0;
    a = min(lo + sp * c, kv_len);
    b = min(lo + (sp + 1) * c, kv_len);
  }

  static __device__ __forceinline__ int64_t warp_min(int64_t x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = min(x, (int64_t)__shfl_xor_sync(0xffffffffu, (long long)x, o));
    return x;
  }
  static __device__ __forceinline__ int64_t warp_max(int64_t x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = max(x, (int64_t)__shfl_xor_sync(0xffffffffu, (long long)x, o));
    return x;
  }

  // Fill Rows for row r (0..15 of the warp tile, r = g or g+8) of a token of sequence s with L
  // visible positions (valid false: a padding row).
  static __device__ __forceinline__ void set_row_of(const Params& p, Rows& rw, int i, bool valid, int s, int L, int head, int sp) {
    if (!valid) {
      rw.lo[i] = rw.hi[i] = 0, rw.ref[i] = 0, rw.slope[i] = 0.0f;
      return;
    }
    int a, b;
    split_range(L, sp, a, b);
    const int64_t base = (int64_t)s * p.max_pages * P;
    rw.lo[i] = a < b ? base + a : 0;
    rw.hi[i] = a < b ? base + b : 0;
    rw.ref[i] = base + L - 1;
    rw.slope[i] = ALIBI ? p.alibi[head] : 0.0f;
  }
  // ... given its token (or -1)
  static __device__ __forceinline__ void set_row(const Params& p, Rows& rw, int i, int64_t token, int head, int sp) {
    if (token < 0) {
      rw.lo[i] = rw.hi[i] = 0, rw.ref[i] = 0, rw.slope[i] = 0.0f;
      return;
    }
    set_row_of(p, rw, i, true, p.token_seq[token], p.token_kv_len[token], head, sp);
  }

  static __device__ __forceinline__ void finish_rows(Rows& rw, bool valid0, bool valid1) {
    // Skip bounds come from rows that see something; the no-mask test from every valid row,
    // so a valid row whose split is empty (lo == hi == 0) forces the mask. Invalid (padding)
    // rows are never stored and take no part.
    const bool s0 = rw.lo[0] < rw.hi[0], s1 = rw.lo[1] < rw.hi[1];
    const int64_t BIG = (int64_t)1 << 62;
    rw.lo_min = warp_min(min(s0 ? rw.lo[0] : BIG, s1 ? rw.lo[1] : BIG));
    rw.hi_max = warp_max(max(s0 ? rw.hi[0] : -BIG, s1 ? rw.hi[1] : -BIG));
    rw.lo_max = warp_max(max(valid0 ? rw.lo[0] : -BIG, valid1 ? rw.lo[1] : -BIG));
    rw.hi_min = warp_min(min(valid0 ? rw.hi[0] : BIG, valid1 ? rw.hi[1] : BIG));
  }

  // ---------------------------------------------------------------- K/V tile loads
  // QFAST decode: the physical 16-byte chunk of logical chunk c of raw stage row `row` (K and V alike).
  // An ldmatrix 8x8 matrix reads one chunk of 8 consecutive rows: rows D bytes apart fall in the same
  // banks (D = 128) or two rows share a 128-byte line (D = 64), so the XOR spreads the 8 over 8 chunks.
  static __device__ __forceinline__ int raw_chunk(int row, int c) {
    if constexpr (D == 64) return c ^ ((row >> 1) & 3);
    else return c ^ (row & 7);
  }
  // Issue the cp.async loads of positions [j0, j0 + BN) of KV head h into smem rows
  // [row0, row0 + BN) of a stage; positions outside [load_lo, load_hi) are zero filled.
  // SWIZZLE (QFAST decode): raw rows are stored chunk-swizzled (raw_chunk).
  template <int BN, int GT, bool SWIZZLE = false>
  static __device__ __forceinline__ void issue_tile(const Params& p, char* smem, int stage, int row0, int gtid, int h,
                                             int64_t j0, int64_t load_lo, int64_t load_hi) {
    constexpr int N = BN * CHUNKS;
    // 64-bit math once per tile; per row only 32-bit offsets and one wide multiply
    const int32_t* pt = p.page_table + j0 / P;  // page-table slot of the tile's first position
    const int o0 = (int)(j0 % P);
    const int lo_rel = (int)max((int64_t)0, min((int64_t)BN, load_lo - j0));
    const int hi_rel = (int)max((int64_t)0, min((int64_t)BN, load_hi - j0));
    const int head_off = h * D;
#pragma unroll
    for (int it = 0; it < (N + GT - 1) / GT; ++it) {
      const int idx = gtid + it * GT;
      if (N % GT != 0 && idx >= N) break;
      // GT % CHUNKS == 0: a thread keeps its chunk and steps GT / CHUNKS rows per iteration
      const int row = GT % CHUNKS == 0 ? gtid / CHUNKS + it * (GT / CHUNKS) : idx / CHUNKS;
      const int c = GT % CHUNKS == 0 ? gtid % CHUNKS : idx % CHUNKS;
      const int t = o0 + row;
      bool valid = row >= lo_rel && row < hi_rel;
      const int page = valid ? pt[t / P] : -1;
      valid = page >= 0;
      const int64_t elem = valid ? (int64_t)page * (P * ROW_STRIDE) + ((t % P) * (int)ROW_STRIDE + head_off) : 0;
      const int off = c * 16;
      if constexpr (QUANT) {
        char* raw = smem + TILES_BYTES + stage * RAW_STAGE;
        const int soff = SWIZZLE ? raw_chunk(row0 + row, c) * 16 : off;
        cp_async16(raw + (row0 + row) * RAW_ROW + soff, (const char*)(p.k_cache + elem) + off, valid);
        cp_async16(raw + (KV_ROWS + row0 + row) * RAW_ROW + soff, (const char*)(p.v_cache + elem) + off, valid);
        if (c == 0) {
          float* sc = reinterpret_cast<float*>(raw + 2 * KV_ROWS * RAW_ROW);
          const int64_t si = valid ? elem / D : 0;  // (page * P + offset) * HKV + h
          cp_async4(sc + row0 + row, p.k_scale + si, valid);
          cp_async4(sc + KV_ROWS + row0 + row, p.v_scale + si, valid);
        }
      } else {
        char* kt = smem + (2 * stage) * TILE_BYTES;
        char* vt = kt + TILE_BYTES;
        if constexpr (TILE_SWIZZLE) {
          cp_async16(kt + tile_off(row0 + row, c), (const char*)(p.k_cache + elem) + off, valid);
          cp_async16(vt + tile_off(row0 + row, c), (const char*)(p.v_cache + elem) + off, valid);
        } else {
          cp_async16(kt + (row0 + row) * DPAD * 2 + off, (const char*)(p.k_cache + elem) + off, valid);
          cp_async16(vt + (row0 + row) * DPAD * 2 + off, (const char*)(p.v_cache + elem) + off, valid);
        }
      }
    }
  }

  // Quantised KV: dequantise a stage's raw rows [row0, row0 + BN) into the 16-bit tiles
  // (value * scale, rounded to q's dtype), so the mma path is the same for every KV dtype.
  template <int BN, int GT>
  static __device__ __forceinline__ void dequant_tile(char* smem, int stage, int row0, int gtid) {
    if constexpr (QUANT) {
      const char* raw = smem + TILES_BYTES + stage * RAW_STAGE;
      const float* sc = reinterpret_cast<const float*>(raw + 2 * KV_ROWS * RAW_ROW);
      constexpr int N = 2 * BN * (D / 8);
#pragma unroll
      for (int it = 0; it < (N + GT - 1) / GT; ++it) {
        const int idx = gtid + it * GT;
        if (N % GT != 0 && idx >= N) break;
        const int kv = idx / (BN * (D / 8)), rem = idx % (BN * (D / 8));
        const int row = row0 + rem / (D / 8), c8 = rem % (D / 8);
        const uint2 bytes = *reinterpret_cast<const uint2*>(raw + (kv * KV_ROWS + row) * RAW_ROW + c8 * 8);
        const float s = sc[kv * KV_ROWS + row];
        const uint8_t* b = reinterpret_cast<const uint8_t*>(&bytes);
        uint32_t packed[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x0, x1;
          if constexpr (IS_FP8) {
            const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
                (__nv_fp8x2_storage_t)(b[2 * e] | (b[2 * e + 1] << 8)), __NV_E4M3);
            const float2 f = __half22float2(*reinterpret_cast<const half2*>(&h2));
            x0 = f.x, x1 = f.y;
          } else {
            x0 = (float)(int8_t)b[2 * e], x1 = (float)(int8_t)b[2 * e + 1];
          }
          packed[e] = pack2<IS_BF16>(x0 * s, x1 * s);
        }
        *reinterpret_cast<uint4*>(smem + kv * TILE_BYTES + (row * DPAD + c8 * 8) * 2) =
            make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
    }
  }

  // ---------------------------------------------------------------- one warp, one K/V tile
  static __device__ __forceinline__ float ex2(float x) {  // 2^x, one MUFU (ftz: results below 2^-126 are 0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
  }
  // A row's running max is raised only when a tile's max exceeds it by more than RESCALE_SLACK
  // (log2 units; FA4's lazy rescale): probabilities then stay <= 2^RESCALE_SLACK, and most tiles
  // skip the O rescale. out = O / l and lse = m + log2(l) use the same m, so the result is exact.
  static constexpr float RESCALE_SLACK = 8.0f;
  static constexpr bool PLAIN = !(SOFTCAP || ALIBI) && SM_SCALE > 0.0f;  // scores stay raw; the scale folds into the exp's FFMA
  static constexpr float SCALE_LOG2 = SM_SCALE * LOG2E;
  // Fixed cost a prefill item (of the Hopper dynamic schedule above all): every role finds a run's end with one ballot
  // per 32 tokens instead of a serial scan of shared memory (a load and a branch a token). Hopper: the V
  // producer warp prefetches a received item's Q rows into L2; the consumers stage Q with cp.async issued
  // before they read their rows' ranges (the two latencies overlap); a run's last K/V tile, when no row
  // sees past its first half, is half as wide in S = Q K^T and the softmax and half as deep in O += P V
  // (the other half is masked in every row: P = 0).
  // The tensor pipe kept busy across a run boundary of the Hopper consumers (PREFILL_OVERLAP): a run's last
  // O += P V is not issued at its end but in the warpgroup's next run's
  // first turn, ahead of that run's S(0) = Q K(0)^T, and the run's epilogue (O / l, lse, the stores) runs while
  // S(0) is in flight: one turn fewer a run, the last PV and S(0) back to back in the tensor pipe, S(0)'s latency
  // under the epilogue. Same values; same shared memory and stages (nothing is in flight while the next run's Q
  // is staged into the warpgroup's one Q tile).
  // Not with the fused merge: an item's rows are stored before its merge, so a one-run item (every item of a long
  // prompt) has nothing to overlap, and with the merge's code beside it ptxas serialises the wgmmas (C7511).
  static constexpr bool PREFILL_OVERLAP = !FUSED_MERGE;

  // Scores of one 16-row tile -> probabilities in place; online softmax update of m and l. MASK: some
  // cell of the tile may be outside a row's [lo, hi) (a warp-uniform choice, so the common tile runs
  // none of the mask code). Returns whether some row of the warp raised its max; alpha[r] is then the
  // factor for that row's O accumulators, which the caller applies (the wgmma path applies it only
  // once the O += P V in flight has finished).
  template <int BN, bool MASK>
  static __device__ __forceinline__ bool softmax_core(float (&s)[BN / 8][4], int64_t j0, const Rows& rw, float (&m)[2],
                                               float (&l)[2], float (&alpha)[2], int lane) {
    const int tig = lane % 4;
    int lo_rel[2], hi_rel[2], d0[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lo_rel[r] = MASK ? (int)max((int64_t)0, min((int64_t)BN, rw.lo[r] - j0)) : 0;
      hi_rel[r] = MASK ? (int)max((int64_t)0, min((int64_t)BN, rw.hi[r] - j0)) : BN;
      d0[r] = ALIBI ? (int)(j0 - rw.ref[r]) : 0;
    }
    // Row maxima and sums in CH independent chains, then a tree: short dependency chains, few registers
    // (the wgmma path holds S, O and P in registers across this).
    constexpr int CH = BN / 8 < 4 ? BN / 8 : 4;
    float tm[CH][2];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int col = nt * 8 + 2 * tig + (e & 1);
        float x = s[nt][e];
        if constexpr (!PLAIN) {
          x *= SM_SCALE;
          if constexpr (SOFTCAP) x = CAP * tanhf(x * (1.0f / CAP));
          if constexpr (ALIBI) x += rw.slope[r] * (float)(d0[r] + col);
          x *= LOG2E;
        }
        if constexpr (MASK) {
          if (!(col >= lo_rel[r] && col < hi_rel[r])) x = -INFINITY;
        }
        s[nt][e] = x;
      }
      const float m0 = fmaxf(s[nt][0], s[nt][1]), m1 = fmaxf(s[nt][2], s[nt][3]);
      tm[nt % CH][0] = nt < CH ? m0 : fmaxf(tm[nt % CH][0], m0);
      tm[nt % CH][1] = nt < CH ? m1 : fmaxf(tm[nt % CH][1], m1);
    }
#pragma unroll
    for (int w = 1; w < CH; w *= 2)
#pragma unroll
      for (int c = 0; c + w < CH; c += 2 * w) tm[c][0] = fmaxf(tm[c][0], tm[c + w][0]), tm[c][1] = fmaxf(tm[c][1], tm[c + w][1]);
    float mx[2] = {tm[0][0], tm[0][1]};
    float muse[2];
    bool need = false, raised[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float tmax = PLAIN ? mx[r] * SCALE_LOG2 : mx[r];  // == max of the scaled scores (monotone)
      raised[r] = tmax > m[r] + RESCALE_SLACK;  // also the first visible tile: m = -inf
      if (!MASK) {  // straight-line: tmax is finite here, and ex2(m - m) = 1 exactly
        const float mnew = raised[r] ? tmax : m[r];
        alpha[r] = ex2(m[r] - mnew);  // m = -inf: 0
        m[r] = mnew;
        l[r] *= alpha[r];
      } else if (raised[r]) {
        alpha[r] = ex2(m[r] - tmax);  // m = -inf: 0
        m[r] = tmax;
        l[r] *= alpha[r];
        need = true;
      } else {
        alpha[r] = 1.0f;
      }
      // All masked so far: exp2(-inf - 0) = 0. An unmasked tile leaves every row's m finite (its scores
      // are finite, and m = -inf is always raised), so it needs no test there.
      muse[r] = !MASK ? m[r] : m[r] == -INFINITY ? 0.0f : m[r];
    }
    // one vote on the two predicates (ptxas otherwise carries `need` as a byte through PRMTs)
    need = __any_sync(0xffffffffu, raised[0] || raised[1]);
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[nt][e] = PLAIN ? ex2(fmaf(s[nt][e], SCALE_LOG2, -muse[e >> 1])) : ex2(s[nt][e] - muse[e >> 1]);
      const float r0 = s[nt][0] + s[nt][1], r1 = s[nt][2] + s[nt][3];  // row sums: CH chains, then a tree
      tm[nt % CH][0] = nt < CH ? r0 : tm[nt % CH][0] + r0;
      tm[nt % CH][1] = nt < CH ? r1 : tm[nt % CH][1] + r1;
    }
#pragma unroll
    for (int w = 1; w < CH; w *= 2)
#pragma unroll
      for (int c = 0; c + w < CH; c += 2 * w) tm[c][0] += tm[c + w][0], tm[c][1] += tm[c + w][1];
    l[0] += tm[0][0];
    l[1] += tm[0][1];
    return need;
  }

  template <int BN>
  static __device__ __forceinline__ bool softmax_scores(float (&s)[BN / 8][4], int64_t j0, const Rows& rw, float (&m)[2],
                                                 float (&l)[2], float (&alpha)[2], int lane) {
    if (j0 >= rw.lo_max && j0 + BN <= rw.hi_min) return softmax_core<BN, false>(s, j0, rw, m, l, alpha, lane);
    return softmax_core<BN, true>(s, j0, rw, m, l, alpha, lane);
  }
  // The same, the no-mask test decided by the caller (a tile index against bounds set once a run).
  template <int BN>
  static __device__ __forceinline__ bool softmax_scores(float (&s)[BN / 8][4], int64_t j0, bool unmasked, const Rows& rw,
                                                 float (&m)[2], float (&l)[2], float (&alpha)[2], int lane) {
    if (unmasked) return softmax_core<BN, false>(s, j0, rw, m, l, alpha, lane);
    return softmax_core<BN, true>(s, j0, rw, m, l, alpha, lane);
  }

  static __device__ __forceinline__ void rescale_acc(float (&acc)[DNS][4], const float (&alpha)[2]) {
#pragma unroll
    for (int nt = 0; nt < DNS; ++nt) {
      acc[nt][0] *= alpha[0], acc[nt][1] *= alpha[0];
      acc[nt][2] *= alpha[1], acc[nt][3] *= alpha[1];
    }
  }

  template <int BN>
  static __device__ __forceinline__ void softmax_tile(float (&s)[BN / 8][4], int64_t j0, const Rows& rw, State& st, int lane) {
    float alpha[2];
    if (softmax_scores<BN>(s, j0, rw, st.m, st.l, alpha, lane)) rescale_acc(st.acc, alpha);
  }

  // S = Q K^T over BN positions for MT 16-row tiles, online softmax, O += P V. kt / vt point at
  // the warp's K/V rows; Q comes from registers (qf, MT = 1) or from smem rows qs (QS).
  template <int BN, int MT, bool QS>
  static __device__ __forceinline__ void attend_tile(const uint32_t (&qf)[DK][4], const char* qs, const char* kt,
                                              const char* vt, int64_t j0, const Rows (&rw)[MT], State (&st)[MT],
                                              int lane) {
    bool any = UNIFIED;  // unified_masked computes foreign cells anyway: that is its cost
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) any |= j0 < rw[mt].hi_max && j0 + BN > rw[mt].lo_min;
    if (!any) return;  // nothing visible for this warp's rows
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
    const int mi = lane / 8, ri = lane % 8;
    // TILE_SWIZZLE: a lane's row of every 8x8 matrix has r % 8 == ri, so chunk c sits at c ^ ri; with c
    // = (compile-time even part) + (lane bit), an address is a per-lane base + ((even part ^ lane's x) << 4)
    // + a constant (the K chunk 2 kk + mi % 2 = 2 kk ^ ((mi & 1) ^ ri); V's nt + mi / 2 alike).
    const uint32_t kb = TILE_SWIZZLE ? smem_addr(kt) + ((mi >> 1) * 8 + ri) * (D * 2) : 0;
    const int kx = (mi & 1) ^ ri;
    constexpr uint32_t BLOCK16 = 16 * DPAD * 2;  // bytes of a 16-row block of a tile
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (QS) {
          ldmatrix_x4(a[mt], qs + ((mt * 16 + lane % 16) * DPAD + kk * 16 + (lane / 16) * 8) * 2);
        } else {
          a[mt][0] = qf[kk][0], a[mt][1] = qf[kk][1], a[mt][2] = qf[kk][2], a[mt][3] = qf[kk][3];
        }
      }
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt += 2) {
        uint32_t b[4];
        if constexpr (TILE_SWIZZLE) ldmatrix_x4_at(b, kb + (((2 * (kk % 4)) ^ kx) << 4) + (nt / 2) * BLOCK16 + (kk / 4) * 128);
        else ldmatrix_x4(b, kt + (((nt + mi / 2) * 8 + ri) * DPAD + kk * 16 + (mi % 2) * 8) * 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IS_BF16>(s[mt][nt], a[mt], b[0], b[1]);
          mma16816<IS_BF16>(s[mt][nt + 1], a[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) softmax_tile<BN>(s[mt], j0, rw[mt], st[mt], lane);
    const uint32_t vb = TILE_SWIZZLE ? smem_addr(vt) + ((mi & 1) * 8 + ri) * (D * 2) : 0;
    const int vx = (mi >> 1) ^ ri;
    uint32_t vx4[TILE_SWIZZLE ? 4 : 1];  // V's four addresses, made once
    if constexpr (TILE_SWIZZLE) {
#pragma unroll
      for (int j = 0; j < 4; ++j) vx4[j] = vb + (((2 * j) ^ vx) << 4);
    }
    // O += P V: the S accumulators are the A fragments of P (FlashAttention-2 register reuse)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<IS_BF16>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<IS_BF16>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<IS_BF16>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<IS_BF16>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nt = 0; nt < DN; nt += 2) {
        uint32_t b[4];
        if constexpr (TILE_SWIZZLE) ldmatrix_x4_trans_at(b, vx4[(nt / 2) % 4] + kk * BLOCK16 + (nt / 8) * 128);
        else ldmatrix_x4_trans(b, vt + ((kk * 16 + (mi % 2) * 8 + ri) * DPAD + (nt + mi / 2) * 8) * 2);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IS_BF16>(st[mt].acc[nt], a[mt], b[0], b[1]);
          mma16816<IS_BF16>(st[mt].acc[nt + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // ---------------------------------------------------------------- QFAST: one warp, one raw 8-bit K/V tile
  // Bytes I and J of the 8-bit KV word r -> a pair of q's 16-bit dtype (I low), exact: int8 values are
  // exact in f16 and bf16, e4m3 values in f16 and bf16. int8, f16: r comes biased (kv_bias: u = x + 128
  // per byte), goes under the exponent of 1024 (0x64uu = 1024 + u), and one HADD2 subtracts 1152.
  // int8, bf16 (7 mantissa bits: u does not fit under one exponent): the byte's low 7 bits m under the
  // exponent of 128 (0x43mm = 128 + m), and its sign bit picks what to add: -128 (0xC300) or -256
  // (0xC380): x = m or m - 128, one HFMA2. e4m3 converts a pair with cvt.rn.f16x2.e4m3x2 (sm_89+;
  // emulated on sm_80), then to bf16 through fp32 if q is bf16.
  template <int SEL>
  static __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b) {  // one PRMT, as written
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "n"(SEL));
    return d;
  }
  template <int I, int J>
  static __device__ __forceinline__ uint32_t kv_pair(uint32_t r) {
    if constexpr (IS_FP8) {
      const uint32_t two = (I == 0 && J == 1) ? r : (I == 2 && J == 3) ? r >> 16 : prmt<I | (J << 4)>(r, 0u);
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
      if constexpr (IS_BF16) {
        const float2 f = __half22float2(*reinterpret_cast<const half2*>(&h));
        return pack2<IS_BF16>(f.x, f.y);
      } else {
        return *reinterpret_cast<const uint32_t*>(&h);
      }
    } else {
      if constexpr (IS_BF16) {
        const uint32_t w = prmt<I | (4 << 4) | (J << 8) | (4 << 12)>(r, 0x43434343u);  // 0x43xx, two
        const uint32_t y = w & 0xFF7FFF7Fu, add = (w & 0x00800080u) | 0xC300C300u;            // 128 + m; -128 / -256
        uint32_t x;
        asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(x) : "r"(y), "r"(0x3F803F80u), "r"(add));  // y * 1 + add
        return x;
      } else {  // r is biased: u = x ^ 0x80 per byte
        uint32_t h = prmt<I | (4 << 4) | (J << 8) | (4 << 12)>(r, 0x64646464u);  // 1024 + u, two of them
        asm("sub.f16x2 %0, %0, %1;\n" : "+r"(h) : "r"(0x64806480u));                    // - 1152 = x
        return h;
      }
    }
  }
  static __device__ __forceinline__ uint32_t kv_bias(uint32_t r) { return IS_FP8 || IS_BF16 ? r : r ^ 0x80808080u; }

  // Q fragments in the QFAST k order: mma k-step kk holds d = 16 kk + 4 tig + {0, 1} (k = 2 tig, +1) and
  // 16 kk + 4 tig + {2, 3} (k = 2 tig + 8, +9), the order in which ldmatrix hands out K's raw bytes
  // (four consecutive bytes of a row per thread). A permutation of the dot product's terms: exact.
  static __device__ __forceinline__ void load_q_fragments_raw_order(const char* qrows, uint32_t (&qf)[DK][4], int lane) {
    const int g = lane / 4, tig = lane % 4;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
      const uint2 lo = *reinterpret_cast<const uint2*>(qrows + (g * DPAD + 16 * kk + 4 * tig) * 2);
      const uint2 hi = *reinterpret_cast<const uint2*>(qrows + ((g + 8) * DPAD + 16 * kk + 4 * tig) * 2);
      qf[kk][0] = lo.x, qf[kk][1] = hi.x, qf[kk][2] = lo.y, qf[kk][3] = hi.y;
    }
  }

  // attend_tile of a decode warp on the raw stage: rows [row0, row0 + BN) of raw K (row r at raw + r * D,
  // chunk-swizzled), raw V (KV_ROWS rows later) and their scales (after both). qf in raw order.
  // S = (Q K_int^T) * ks per column; P V = (P * vs per row of V) V_int. V comes through ldmatrix.trans
  // of the bytes as b16 elements: a thread gets bytes {d 2g, 2g+1} of two consecutive positions, so one
  // register feeds the n-tile of even d (bytes 0, 2) and the one of odd d (bytes 1, 3): acc[2 c] holds
  // d = 16 c + 4 tig + {0, 2}, acc[2 c + 1] d = 16 c + 4 tig + {1, 3} (the decode merge stores that order).
  template <int BN>
  static __device__ __forceinline__ void attend_raw_tile(const uint32_t (&qf)[DK][4], const char* raw, int row0, int64_t j0,
                                                  const Rows& rw, State& st, int lane) {
    if (!UNIFIED && !(j0 < rw.hi_max && j0 + BN > rw.lo_min)) return;  // nothing visible for this warp's rows
    constexpr int CH = D / 16;  // 16-byte chunks of a raw row
    const float* ksc = reinterpret_cast<const float*>(raw + 2 * KV_ROWS * D) + row0;
    const float* vsc = ksc + KV_ROWS;
    const char* vraw = raw + KV_ROWS * D;
    const int mi = lane / 8, ri = lane % 8, tig = lane % 4;
    float s[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      const int r = row0 + nt * 8 + ri;  // the row this lane addresses (matrix mi: chunk 4 q + mi)
#pragma unroll
      for (int q4 = 0; q4 < CH / 4; ++q4) {
        uint32_t kr[4];
        ldmatrix_x4(kr, raw + r * D + raw_chunk(r, 4 * q4 + mi) * 16);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const uint32_t u = kv_bias(kr[m]);
          mma16816<IS_BF16>(s[nt], qf[4 * q4 + m], kv_pair<0, 1>(u), kv_pair<2, 3>(u));
        }
      }
      const float2 ks = *reinterpret_cast<const float2*>(ksc + nt * 8 + 2 * tig);
      s[nt][0] *= ks.x, s[nt][1] *= ks.y, s[nt][2] *= ks.x, s[nt][3] *= ks.y;
    }
    softmax_tile<BN>(s, j0, rw, st, lane);  // l sums the unscaled probabilities
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const float2 v0 = *reinterpret_cast<const float2*>(vsc + kk * 16 + 2 * tig);
      const float2 v1 = *reinterpret_cast<const float2*>(vsc + kk * 16 + 8 + 2 * tig);
      uint32_t a[4];
      a[0] = pack2<IS_BF16>(s[2 * kk][0] * v0.x, s[2 * kk][1] * v0.y);
      a[1] = pack2<IS_BF16>(s[2 * kk][2] * v0.x, s[2 * kk][3] * v0.y);
      a[2] = pack2<IS_BF16>(s[2 * kk + 1][0] * v1.x, s[2 * kk + 1][1] * v1.y);
      a[3] = pack2<IS_BF16>(s[2 * kk + 1][2] * v1.x, s[2 * kk + 1][3] * v1.y);
      const int r = row0 + kk * 16 + (mi % 2) * 8 + ri;  // matrix mi: positions (mi % 2) * 8.., chunk 2 c2 + mi / 2
#pragma unroll
      for (int c2 = 0; c2 < CH / 2; ++c2) {
        uint32_t vr[4];
        ldmatrix_x4_trans(vr, vraw + r * D + raw_chunk(r, 2 * c2 + mi / 2) * 16);
#pragma unroll
        for (int hc = 0; hc < 2; ++hc) {
          const int c = 2 * c2 + hc;
          const uint32_t lo = kv_bias(vr[2 * hc]), hi = kv_bias(vr[2 * hc + 1]);  // positions 2 tig.. / 2 tig + 8..
          mma16816<IS_BF16>(st.acc[2 * c], a, kv_pair<0, 2>(lo), kv_pair<0, 2>(hi));
          mma16816<IS_BF16>(st.acc[2 * c + 1], a, kv_pair<1, 3>(lo), kv_pair<1, 3>(hi));
        }
      }
    }
  }

  // ---------------------------------------------------------------- tile loop (cp.async pipeline)
  // The group (one warp, or the block) streams ntiles tiles: tile i covers [first + i*step, +BN).
  struct NoOp {
    __device__ __forceinline__ void operator()() const {}
  };
  // after_issue runs once the pipeline's first loads are out (prologue=spec: Q goes through smem then).
  template <int BN, int MT, bool QS, bool BLOCK, typename AfterIssue = NoOp>
  static __device__ __forceinline__ void run_tiles(const Params& p, char* smem, const uint32_t (&qf)[DK][4], const char* qs,
                                            const Rows (&rw)[MT], State (&st)[MT], int row0, int gtid, int h,
                                            int64_t first, int64_t step, int ntiles, int64_t load_lo, int64_t load_hi,
                                            int lane, const AfterIssue& after_issue = AfterIssue()) {
    constexpr int GT = BLOCK ? THREADS : 32;
    // A prefill tile narrower than a stage's KV_ROWS shares the stage: SUB tiles per stage buffer,
    // so the pipeline is NSTAGE * SUB tiles deep in the same shared memory.
    constexpr int SUB = BLOCK ? KV_ROWS / BN : 1;
    constexpr int DEPTH = BLOCK ? NSTAGE * SUB : DEC_DEPTH;
    constexpr bool RAW = QFAST && !BLOCK;  // decode warps attend the raw stage (attend_raw_tile)
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) {
      if (i < ntiles) issue_tile<BN, GT, RAW>(p, smem, i / SUB, row0 + (i % SUB) * BN, gtid, h, first + i * step, load_lo, load_hi);
      cp_async_commit();
    }
    after_issue();
    for (int i = 0; i < ntiles; ++i) {
      const int nxt = i + DEPTH - 1, ns = nxt % DEPTH;
      if constexpr (BLOCK) {
        // One block barrier per tile: it makes tile i visible and, since every warp has finished
        // tile i - 1, frees slot (i - 1) % DEPTH (and the dequantised pair) for the next load.
        cp_async_wait<DEPTH - 2>();
        group_sync<BLOCK>();
        if (nxt < ntiles)
          issue_tile<BN, GT, RAW>(p, smem, ns / SUB, row0 + (ns % SUB) * BN, gtid, h, first + nxt * step, load_lo, load_hi);
        cp_async_commit();
      } else {
        // a warp: the next load goes out before the wait, so two tiles are in flight while waiting
        if (nxt < ntiles)
          issue_tile<BN, GT, RAW>(p, smem, ns / SUB, row0 + (ns % SUB) * BN, gtid, h, first + nxt * step, load_lo, load_hi);
        cp_async_commit();
        cp_async_wait<DEPTH - 1>();
        group_sync<BLOCK>();
      }
      const int slot = i % DEPTH, stage = slot / SUB, rows = row0 + (slot % SUB) * BN;
      if constexpr (RAW) {
        attend_raw_tile<BN>(qf, smem + TILES_BYTES + stage * RAW_STAGE, rows, first + i * step, rw[0], st[0], lane);
      } else {
        if constexpr (QUANT) {
          dequant_tile<BN, GT>(smem, stage, rows, gtid);
          group_sync<BLOCK>();
        }
        const char* kt = smem + (QUANT ? 0 : 2 * stage) * TILE_BYTES + rows * DPAD * 2;
        attend_tile<BN, MT, QS>(qf, qs, kt, kt + TILE_BYTES, first + i * step, rw, st, lane);
      }
      if constexpr (!BLOCK) group_sync<BLOCK>();
    }
    cp_async_wait<0>();
    if constexpr (BLOCK) group_sync<BLOCK>();  // the caller may reuse the tiles' smem
  }

  // q rows [row0, row0 + nrows) of the resident Q region <- the rows given by row_src (null: zeros).
  template <bool BLOCK, typename RowFn>
  static __device__ __forceinline__ void stage_q(char* smem, int row0, int gtid, int nrows, RowFn row_src) {
    constexpr int GT = BLOCK ? THREADS : 32;
    char* qs = smem + Q_OFFSET;
    for (int idx = gtid; idx < nrows * (D / 8); idx += GT) {
      const int r = idx / (D / 8), c = idx % (D / 8);
      const qt* src = row_src(r);
      uint4 x = make_uint4(0, 0, 0, 0);
      if (src) x = *reinterpret_cast<const uint4*>(src + c * 8);
      *reinterpret_cast<uint4*>(qs + ((row0 + r) * DPAD + c * 8) * 2) = x;
    }
    group_sync<BLOCK>();
  }

  static __device__ __forceinline__ void init_state(State& st) {
#pragma unroll
    for (int nt = 0; nt < DNS; ++nt) st.acc[nt][0] = st.acc[nt][1] = st.acc[nt][2] = st.acc[nt][3] = 0.0f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;
  }

  // Write one finished row element pair: out (or o_partial) and lse.
  static __device__ __forceinline__ void store_pair(const Params& p, int sp, int64_t token, int head, int d, float o0, float o1) {
    const int64_t row = token * HQ + head;
    if constexpr (NSPLIT > 1) {
      *reinterpret_cast<float2*>(p.o_partial + ((int64_t)sp * p.num_tokens * HQ + row) * D + d) =
          make_float2(o0, o1);
    } else {
      *reinterpret_cast<uint32_t*>(p.out + row * D + d) = pack2<IS_BF16>(o0, o1);
    }
  }
  static __device__ __forceinline__ void store_lse(const Params& p, int sp, int64_t token, int head, float lse) {
    const int64_t row = token * HQ + head;
    if constexpr (NSPLIT > 1) p.lse_partial[(int64_t)sp * p.num_tokens * HQ + row] = lse;
    else if constexpr (WRITE_LSE) p.lse[row] = lse;
  }

  // Prefill runs: rows r of a run starting at token u0 are (token u0 + r / G, head h * G + r % G);
  // a 16-row mma tile starting at row `tile` gives this thread rows tile + g and tile + g + 8.
  static __device__ __forceinline__ void set_run_rows(const Params& p, Rows& rw, int tile, int64_t u0, int nrows, int h,
                                               int lane, int sp) {
    const int r0 = tile + lane / 4, r1 = r0 + 8;
    set_row(p, rw, 0, r0 < nrows ? u0 + r0 / G : -1, h * G + r0 % G, sp);
    set_row(p, rw, 1, r1 < nrows ? u0 + r1 / G : -1, h * G + r1 % G, sp);
    finish_rows(rw, r0 < nrows, r1 < nrows);
  }
  // out (or the split's partial) and lse of a finished 16-row tile of a run
  static __device__ __forceinline__ void store_run_rows(const Params& p, const State& st, int tile, int64_t u0, int nrows,
                                                 int h, int lane, int sp) {
    const int g = lane / 4, tig = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = tile + g + 8 * r;
      float l = st.l[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (row >= nrows) continue;
      const int64_t token = u0 + row / G;
      const int head = h * G + row % G;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
      for (int nt = 0; nt < DN; ++nt)
        store_pair(p, sp, token, head, nt * 8 + 2 * tig, st.acc[nt][2 * r] * inv, st.acc[nt][2 * r + 1] * inv);
      if (tig == 0) store_lse(p, sp, token, head, l > 0.0f ? (st.m[r] + log2f(l)) * LN2 : -INFINITY);
    }
  }

  // ---------------------------------------------------------------- fused split-KV merge
  // A work item is a decode token, or the non-isolated tokens of a prefill tile; all its splits
  // (of one KV head h) count on the counter split_counters[slot][h], slot = the item's
  // first token. Whoever stored the partials of some splits (a decode group: one, a prefill block:
  // its SPLIT_GROUPS) arrives with their number; the arrival that completes NSPLIT merges the
  // item's rows from the partials (in L2 by then) into out and lse, as merge_state does, and
  // zeroes the counter again for the next launch or graph replay.
  // tid: the thread's index among those arriving together; sync(): their barrier; flag: a shared
  // int of theirs. True in all of them for the completing arrival.
  template <typename Sync>
  static __device__ __forceinline__ bool arrive_last(const Params& p, int64_t slot, int h, int splits, int tid, int* flag,
                                              Sync sync) {
    int* counter = p.split_counters + slot * HKV + h;
    // The barrier orders every thread's partial stores before thread 0's release (cumulative), and
    // its acquire before the others' reads after the second barrier (CUTLASS's semaphore pattern).
    sync();
    if (tid == 0) {
      int old;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(splits) : "memory");
      const bool last = old + splits == NSPLIT;
      if (last) asm volatile("st.relaxed.gpu.global.s32 [%0], 0;\n" ::"l"(counter) : "memory");
      *flag = last;
    }
    sync();
    return *flag;
  }

  // out (and lse) of the G rows of KV head h's group of tokens token_of(i), i < n (-1: skip),
  // from all NSPLIT partials: a thread per (row, 4 columns), U splits in flight, online rescale.
  // Decode-only kernels have the registers to hold a chunk's o and lse at once: one L2 round trip a chunk of up to 32
  // splits at 2 blocks an SM; at 3 or 4 (168 or 128 registers), all of up to 24 splits, else chunks of 16 (ptxas: no
  // spill).
  static constexpr bool MERGE_ONE_TRIP = DECODE_ONLY;
  static constexpr int MERGE_CHUNK = !DECODE_ONLY || Config::MIN_BLOCKS <= 2 ? 32 : NSPLIT <= 24 ? 24 : 16;
  template <int NT, typename TokenFn>
  static __device__ void merge_partials(const Params& p, int h, int n, TokenFn token_of, int tid) {
    constexpr int UMAX = MERGE_CHUNK;  // up to MERGE_CHUNK splits' loads in flight at once
    constexpr int C4 = D / 4, U = NSPLIT < UMAX ? NSPLIT : UMAX;
    const int64_t split_rows = p.num_tokens * HQ;
    for (int idx = tid; idx < n * G * C4; idx += NT) {
      const int64_t t = token_of(idx / (G * C4));
      if (t < 0) continue;
      const int c = idx % C4;
      const int64_t row = t * HQ + (int64_t)h * G + idx / C4 % G;
      float m = -INFINITY, den = 0.0f;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int s0 = 0; s0 < NSPLIT; s0 += U) {
        float l[U];
        float4 o[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // L2 reads (.cg): other blocks wrote these in this launch
          const bool ok = NSPLIT % U == 0 || s0 + u < NSPLIT;
          const int64_t r = (s0 + u) * split_rows + row;
          l[u] = ok ? __ldcg(p.lse_partial + r) : -INFINITY;
          o[u] = ok ? __ldcg(reinterpret_cast<const float4*>(p.o_partial + r * D) + c)
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float mx = m;
        if constexpr (MERGE_ONE_TRIP) {
          // The max waits for o too (+ 0 * o.x: exact for finite o), or ptxas issues the o loads only after it: a
          // second L2 round trip. No branch: an all-empty chunk takes weights exp(-inf - 0) = 0.
#pragma unroll
          for (int u = 0; u < U; ++u) mx = fmaxf(mx, fmaf(o[u].x, 0.0f, l[u]));
        } else {
#pragma unroll
          for (int u = 0; u < U; ++u) mx = fmaxf(mx, l[u]);
          if (mx == -INFINITY) continue;  // every split so far is empty
        }
        const float ref = MERGE_ONE_TRIP && mx == -INFINITY ? 0.0f : mx;
        const float alpha = expf(m - ref);  // m = -inf: 0
        den *= alpha, acc.x *= alpha, acc.y *= alpha, acc.z *= alpha, acc.w *= alpha;
        m = mx;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float w = expf(l[u] - ref);  // an empty split (lse = -inf): 0
          den += w, acc.x += w * o[u].x, acc.y += w * o[u].y, acc.z += w * o[u].z, acc.w += w * o[u].w;
        }
      }
      const float inv = den > 0.0f ? 1.0f / den : 0.0f;
      *reinterpret_cast<uint2*>(p.out + row * D + c * 4) =
          make_uint2(pack2<IS_BF16>(acc.x * inv, acc.y * inv), pack2<IS_BF16>(acc.z * inv, acc.w * inv));
      if (MERGE_LSE && c == 0) p.lse[row] = den > 0.0f ? m + logf(den) : -INFINITY;
    }
  }

  // A decode group's token t: its one split is stored.
  static __device__ __forceinline__ void merge_decode_token(const Params& p, int64_t t) {
    __shared__ int last[GROUPS];
    const int tid = threadIdx.x % THREADS;
    if (arrive_last(p, t, kv_head(p), 1, tid, &last[threadIdx.x / THREADS], [] { decode_group_sync(); })) {
      merge_partials<THREADS>(p, kv_head(p), 1, [&](int) { return t; }, tid);
    }
  }

  // A prefill tile [tb, te) of KV head h after the runs of its split group zs: its item is its
  // non-isolated tokens (isolated ones are decode items); seq_smem[k] = token_seq[tb - 1 + k], with
  // sentinels outside the neighbourhood.
  static __device__ void merge_prefill_tile(const Params& p, int64_t tb, int64_t te, const int* seq_smem, int h, int zs) {
    auto token_of = [&](int i) -> int64_t {
      const int s = seq_smem[i + 1];
      return seq_smem[i] == s || seq_smem[i + 2] == s ? tb + i : -1;
    };
    const int n = (int)(te - tb);
    int first = 0;
    while (first < n && token_of(first) < 0) ++first;
    if (first == n) return;  // no prefill rows here: no block of this tile stored partials
    __shared__ int last;
    const int splits = min(SPLIT_GROUPS, NSPLIT - zs * SPLIT_GROUPS);  // the ones this block ran
    if (arrive_last(p, tb + first, h, splits, threadIdx.x, &last, [] { consumer_sync(); }))
      merge_partials<CONSUMER_THREADS>(p, h, n, token_of, threadIdx.x);
  }

  // ---------------------------------------------------------------- decode: one token, WARPS warps
  // A decode group's first token, loaded before the lone-token scan on the guess that
  // the group's rank is its token (every token lone, as in a pure decode launch). Explicit (volatile)
  // loads, so they leave before the scan's loads and barriers; decode_token uses them when the scan
  // picks that token and loads its own otherwise.
  static constexpr int Q_CHUNKS = G * (D / 8);  // 16-byte pieces of a token's G q rows (contiguous in q)
  static constexpr int Q_PER_LANE = (Q_CHUNKS + 31) / 32;
  static constexpr bool SPEC_Q = Q_PER_LANE <= 4;  // the guess holds Q in registers meanwhile
  struct Guess {
    int64_t t;  // -1: no guess
    int seq, kv_len;
    uint4 q[SPEC_Q ? Q_PER_LANE : 1];
  };
  static __device__ __forceinline__ int ld_nc_s32(const int32_t* a) {
    int v;
    asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(v) : "l"(a));
    return v;
  }
  static __device__ __forceinline__ uint4 ld_nc_v4(const void* a) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 { %0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    return v;
  }
  static __device__ __forceinline__ void load_guess(const Params& p, Guess& gs, int64_t t, int h, int lane) {
    gs.t = t;
    gs.seq = gs.kv_len = 0;
    if (t < 0) return;
    gs.seq = ld_nc_s32(p.token_seq + t);
    gs.kv_len = ld_nc_s32(p.token_kv_len + t);
    if constexpr (SPEC_Q) {
      const qt* qrows = p.q + (t * HQ + (int64_t)h * G) * D;
#pragma unroll
      for (int i = 0; i < Q_PER_LANE; ++i) {
        const int idx = lane + 32 * i;
        gs.q[i] = Q_CHUNKS % 32 == 0 || idx < Q_CHUNKS ? ld_nc_v4(qrows + idx * 8) : make_uint4(0, 0, 0, 0);
      }
    }
  }

  // Q fragments of this warp (rows warp * 16 + r of the resident-Q region; r >= G zero)
  static __device__ __forceinline__ void load_q_fragments(char* smem, uint32_t (&qf)[DK][4], int warp, int lane) {
    if constexpr (QFAST) {
      load_q_fragments_raw_order(smem + Q_OFFSET + warp * 16 * DPAD * 2, qf, lane);
    } else {
#pragma unroll
      for (int kk = 0; kk < DK; ++kk)
        ldmatrix_x4(qf[kk], smem + Q_OFFSET + ((warp * 16 + lane % 16) * DPAD + kk * 16 + (lane / 16) * 8) * 2);
    }
    __syncwarp();  // the Q rows are read before this warp's third K/V stage (DEC_QSTAGE) overwrites them
  }

  static __device__ void decode_token(const Params& p, char* smem, int64_t t, int sp, const Guess& guess) {
    const int warp = (threadIdx.x % THREADS) / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
    const int h = kv_head(p);
    const qt* qrow = p.q + (t * HQ + (int64_t)h * G) * D;
    const bool hit = guess.t == t;
    uint32_t qf[DK][4];
    // Q through smem into fragments, once the first K/V tiles are out
    auto stage_q_fragments = [&] {
      if (SPEC_Q && hit) {
#pragma unroll
        for (int i = 0; i < 16 * (D / 8) / 32; ++i) {  // every row of the warp's 16, rows >= G zero
          const int idx = lane + 32 * i, r = idx / (D / 8), c = idx % (D / 8);
          const uint4 x = i < Q_PER_LANE && idx < Q_CHUNKS ? guess.q[i < Q_PER_LANE ? i : 0] : make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(smem + Q_OFFSET + ((warp * 16 + r) * DPAD + c * 8) * 2) = x;
        }
        __syncwarp();
      } else {
        stage_q<false>(smem, warp * 16, lane, 16, [&](int r) { return r < G ? qrow + (int64_t)r * D : nullptr; });
      }
      load_q_fragments(smem, qf, warp, lane);
    };
    Rows rw[1];
    {
      const int s = hit ? guess.seq : p.token_seq[t], L = hit ? guess.kv_len : p.token_kv_len[t];
      set_row_of(p, rw[0], 0, g < G, s, L, h * G + g, sp);
      set_row_of(p, rw[0], 1, g + 8 < G, s, L, h * G + g + 8, sp);
    }
    finish_rows(rw[0], g < G, g + 8 < G);
    State st[1];
    init_state(st[0]);
    // the token's visible range of this split (every row of the token shares it)
    const int s = hit ? guess.seq : p.token_seq[t], L = hit ? guess.kv_len : p.token_kv_len[t];
    int a, b;
    split_range(L, sp, a, b);
    const int64_t base = (int64_t)s * p.max_pages * P;
    int64_t load_lo = base + a, load_hi = base + b;
    if (UNIFIED) load_lo = 0, load_hi = p.num_seqs * p.max_pages * P;
    if (a < b || UNIFIED) {
      const int64_t first = (load_lo / BN_DEC) * BN_DEC;
      const int ntiles_all = (int)((load_hi - first + BN_DEC - 1) / BN_DEC);
      const int mine = ntiles_all > warp ? (ntiles_all - warp + WARPS - 1) / WARPS : 0;
      run_tiles<BN_DEC, 1, false, false>(p, smem, qf, nullptr, rw, st, warp * 16, lane, h, first + warp * BN_DEC,
                                         WARPS * BN_DEC, mine, load_lo, load_hi, lane, stage_q_fragments);
    }
    // merge the warps' states through shared memory
    decode_group_sync();
    float* cacc = reinterpret_cast<float*>(smem);  // [WARPS][16][D + 4]
    float* cm = cacc + WARPS * 16 * (D + 4);       // [WARPS][16]
    float* cl = cm + WARPS * 16;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = st[0].l[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (tig == 0) cm[warp * 16 + g + 8 * r] = st[0].m[r], cl[warp * 16 + g + 8 * r] = l;
    }
    if constexpr (QFAST) {  // attend_raw_tile's column order: acc[2c], acc[2c + 1] hold d = 16 c + 4 tig + {0, 2}, {1, 3}
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        float* row_g = cacc + (warp * 16 + g) * (D + 4) + 16 * c + 4 * tig;
        const float(&e)[4] = st[0].acc[2 * c];
        const float(&o)[4] = st[0].acc[2 * c + 1];
        *reinterpret_cast<float4*>(row_g) = make_float4(e[0], o[0], e[1], o[1]);
        *reinterpret_cast<float4*>(row_g + 8 * (D + 4)) = make_float4(e[2], o[2], e[3], o[3]);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < DN; ++nt) {
        float* row_g = cacc + (warp * 16 + g) * (D + 4) + nt * 8 + 2 * tig;
        *reinterpret_cast<float2*>(row_g) = make_float2(st[0].acc[nt][0], st[0].acc[nt][1]);
        *reinterpret_cast<float2*>(row_g + 8 * (D + 4)) = make_float2(st[0].acc[nt][2], st[0].acc[nt][3]);
      }
    }
    decode_group_sync();
    for (int idx = threadIdx.x % THREADS; idx < G * (D / 2); idx += THREADS) {
      const int r = idx / (D / 2), d = (idx % (D / 2)) * 2;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) M = fmaxf(M, cm[w * 16 + r]);
      float denom = 0.0f, o0 = 0.0f, o1 = 0.0f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
          const float f = exp2f(cm[w * 16 + r] - M);
          denom += f * cl[w * 16 + r];
          const float2 x = *reinterpret_cast<const float2*>(cacc + (w * 16 + r) * (D + 4) + d);
          o0 += f * x.x, o1 += f * x.y;
        }
      }
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
      store_pair(p, sp, t, h * G + r, d, o0 * inv, o1 * inv);
      if (d == 0) store_lse(p, sp, t, h * G + r, denom > 0.0f ? (M + log2f(denom)) * LN2 : -INFINITY);
    }
    decode_group_sync();  // smem is reused by the next token of this group
    if constexpr (FUSED_MERGE) merge_decode_token(p, t);  // fused split-KV merge
  }

  // ---------------------------------------------------------------- prefill: a run of one sequence
  // Warp w owns rows [w * 16 * MT_PRE, (w + 1) * 16 * MT_PRE) of the tile; row r = (token u0 + r / G,
  // head h * G + r % G).
  static __device__ void prefill_run(const Params& p, char* smem, int64_t u0, int64_t u1, int sp) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = kv_head(p);
    const int nrows = (int)(u1 - u0) * G;
    stage_q<true>(smem, 0, threadIdx.x, ROWS, [&](int r) {
      return r < nrows ? p.q + ((u0 + r / G) * HQ + (int64_t)h * G + r % G) * D : nullptr;
    });
    Rows rw[MT_PRE];
    int64_t lo_min = (int64_t)1 << 62, hi_max = -lo_min;
#pragma unroll
    for (int mt = 0; mt < MT_PRE; ++mt) {
      set_run_rows(p, rw[mt], (warp * MT_PRE + mt) * 16, u0, nrows, h, lane, sp);
      lo_min = min(lo_min, rw[mt].lo_min), hi_max = max(hi_max, rw[mt].hi_max);
    }
    // the block's K/V range: the union of its warps' ranges
    __shared__ long long range_smem[2 * WARPS];
    if (lane == 0) range_smem[warp] = lo_min, range_smem[WARPS + warp] = hi_max;
    __syncthreads();
    int64_t load_lo = range_smem[0], load_hi = range_smem[WARPS];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) load_lo = min(load_lo, (int64_t)range_smem[w]), load_hi = max(load_hi, (int64_t)range_smem[WARPS + w]);
    __syncthreads();
    if (UNIFIED) load_lo = 0, load_hi = p.num_seqs * p.max_pages * P;
    State st[MT_PRE];
#pragma unroll
    for (int mt = 0; mt < MT_PRE; ++mt) init_state(st[mt]);
    if (load_lo < load_hi) {
      const int64_t first = (load_lo / BN_PRE) * BN_PRE;
      const int ntiles = (int)((load_hi - first + BN_PRE - 1) / BN_PRE);
      uint32_t unused[DK][4];
      run_tiles<BN_PRE, MT_PRE, true, true>(p, smem, unused, smem + Q_OFFSET + warp * MT_PRE * 16 * DPAD * 2, rw, st,
                                            0, threadIdx.x, h, first, BN_PRE, ntiles, load_lo, load_hi, lane);
    }
#pragma unroll
    for (int mt = 0; mt < MT_PRE; ++mt) store_run_rows(p, st[mt], (warp * MT_PRE + mt) * 16, u0, nrows, h, lane, sp);
    __syncthreads();  // smem is reused by the next run of this tile
  }

  // ---------------------------------------------------------------- prefill tiles and items
  // The token window of tile [tb, te): seqs[k] = token_seq[tb - 1 + k], k < TM + 2, with distinct
  // sentinels outside the tokens and past te (thread tid of nthreads filling it).
  static __device__ __forceinline__ void fill_window(const Params& p, int* seqs, int64_t tb, int64_t te, int tid, int nthreads) {
    for (int i = tid; i < TM + 2; i += nthreads) {
      const int64_t t = tb - 1 + i;
      seqs[i] = (t >= 0 && t < p.num_tokens && t <= te) ? p.token_seq[t] : -2 - i;
    }
  }
  // Whether this thread's share of the window of a tile of n tokens holds a token that is not lone
  // (a prefill row); the callers reduce it over their threads.
  static __device__ __forceinline__ bool window_has_run(const int* seqs, int64_t n, int tid, int nthreads) {
    bool any_run = false;
    for (int i = 1 + tid; i <= n; i += nthreads) any_run |= seqs[i - 1] == seqs[i] || seqs[i + 1] == seqs[i];
    return any_run;
  }
  // The runs of tile [tb, te) (consecutive tokens of one sequence, other than isolated decode tokens)
  // and the splits of split group zs_of() of each, in the order every role of a block walks them;
  // seqs: the tile's token window. (zs_of: the static blocks read theirs where used, not kept.)
  // The end of the run of sequence s from token u (the first later token of another sequence,
  // or te), 32 tokens a step, one a lane: the caller is a whole converged warp.
  static __device__ __forceinline__ int64_t run_end(int64_t tb, int64_t te, const int* seqs, int64_t u, int s) {
    const int lane = threadIdx.x % 32;
    for (int64_t c = u; c < te; c += 32) {
      const uint32_t other = __ballot_sync(0xffffffffu, c + lane < te && seqs[c + lane - tb + 1] != s);
      if (other) return c + __ffs(other) - 1;
    }
    return te;
  }
  template <typename ZsFn, typename RunFn>
  static __device__ __forceinline__ void for_each_run(int64_t tb, int64_t te, const int* seqs, ZsFn zs_of, RunFn&& run) {
    for (int64_t u = tb; u < te;) {
      const int s = seqs[u - tb + 1];
      const int64_t u1 = run_end(tb, te, seqs, u, s);
      const bool isolated = u1 - u == 1 && seqs[u - tb] != s && seqs[u1 - tb + 1] != s;
      for (int k = 0; k < SPLIT_GROUPS && !isolated; ++k) {
        const int sp = zs_of() * SPLIT_GROUPS + k;
        if (sp >= NSPLIT) break;
        run(u, u1, sp);
      }
      u = u1;
    }
  }
  // DYNAMIC: item i of the launch's num_prefill_tiles * HKV * ZSPLITS is tile num_prefill_tiles - 1 -
  // i / (HKV * ZSPLITS), KV head h, split group zs. Heaviest first as far as the index alone can tell
  // (no sort, no metadata pass): a sequence's tiles from its last (the longest causal K/V range) to
  // its first, sequences from the ubatch's last; a queue only needs the items taken last to be
  // light, and those are the first tiles of the ubatch's first sequences (decode tokens, which
  // schedulers put first, have no rows and are skipped a tile at a time). A tile's heads and split
  // groups are side by side, so the blocks running them share its K/V prefix in L2 and its splits
  // finish (and merge) close together.
  struct PrefillItem {
    int64_t tb, te;
    int h, zs;
  };
  static __device__ __forceinline__ PrefillItem prefill_item(const Params& p, int i) {
    const int64_t tile = p.num_prefill_tiles - 1 - i / (HKV * ZSPLITS);
    const int plane = i % (HKV * ZSPLITS);
    return {tile * TM, min(tile * TM + TM, p.num_tokens), plane / ZSPLITS, plane % ZSPLITS};
  }
  // The K producer warp of a persistent block: the next item with prefill rows, its token window in
  // seqs; -1 once the queue is empty. Lane 0 takes items from p.item_queue[0] (atomicAdd); a tile
  // of lone tokens only has no work in any of its items, so the warp skips the rest of them at once
  // (atomicMax past the tile: the counter only grows, so no item is taken twice or lost).
  static __device__ int take_item(const Params& p, int* seqs, int lane) {
    constexpr int PLANES = HKV * ZSPLITS;
    const int items = (int)(p.num_prefill_tiles * PLANES);  // int: the launcher checks
    for (;;) {
      int item = 0;
      if (lane == 0) item = atomicAdd(p.item_queue, 1);
      item = __shfl_sync(0xffffffffu, item, 0);
      if (item >= items) return -1;
      const PrefillItem it = prefill_item(p, item);
      fill_window(p, seqs, it.tb, it.te, lane, 32);
      __syncwarp();
      if (__any_sync(0xffffffffu, window_has_run(seqs, it.te - it.tb, lane, 32))) return item;
      if (lane == 0) atomicMax(p.item_queue, (item / PLANES + 1) * PLANES);
    }
  }
  // Lane 0 of the K producer warp after its last take (the one that found the queue empty): the
  // block's arrival on p.item_queue[1]. The last of the num_prefill_ctas arrivals zeroes both
  // counters for the next launch or graph replay: every block's takes precede its arrival (release),
  // the last arrival sees them all (acquire), so no take lands after the zeroing.
  static __device__ __forceinline__ void queue_done(const Params& p) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(p.item_queue + 1) : "memory");
    if (old + 1 == (int)p.num_prefill_ctas) {
      asm volatile("st.relaxed.gpu.global.s32 [%0], 0;\n" ::"l"(p.item_queue) : "memory");
      asm volatile("st.relaxed.gpu.global.s32 [%0], 0;\n" ::"l"(p.item_queue + 1) : "memory");
    }
  }

  // ---------------------------------------------------------------- Hopper prefill tiles (WGMMA)
  // Hopper (sm_90a) prefill tiles, where the Config says WGMMA. FlashAttention-3's structure: a block is three warpgroups. Warpgroup 2 is the
  // producer: one warp of it issues the bulk tensor copies (TMA, one box per page and 64-column half,
  // 128-byte swizzle) of K tiles, another those of V, into NST_WG stages, each on its own "full"
  // mbarrier, and refills a stage once every consumer warp has arrived on its "empty" one. Pages under
  // 8 positions are copied by cp.async instead, two warps for K and two for V (CP_PRODUCER). Warpgroups 0 and 1
  // are the consumers: 64 rows each of a 128-row tile (16 rows a warp, the row layout of the mma.sync
  // path, so the softmax and the stores are shared). S = Q K^T is wgmma with Q (swizzled in shared
  // memory) and K from shared memory; O += P V takes P from registers. Within a warpgroup the next
  // tile's S = Q K^T is in flight while the softmax of the current tile runs; between the two, turns
  // (named barriers) order their GEMM issues, so one warpgroup's softmax runs under the other's GEMMs.
  // setmaxnreg moves registers from the producer (24) to the consumers (240). With DYNAMIC (the config's item_queue) the
  // blocks are persistent, one a SM, each taking (tile, KV head, split group) items from an atomic queue:
  // the producer warps go on into the next item while the consumers finish the current one, so the
  // pipeline fills once a block, and the queue balances the blocks' loads.
  // The wgmma instructions (wg_qk, wg_qk_half, wg_pv: their operand lists follow the tile widths) are the Config's;
  // the members below are templates, instantiated only where the kernel takes the Hopper path.
  static constexpr bool WGMMA = Config::WGMMA;
  static constexpr int BN_WG = Config::BN_WG;                  // K/V positions per tile
  static constexpr int NST_WG = Config::NST_WG;             // TMA stages in flight
  static_assert(!WGMMA || NST_WG > 1, "the consumers hold V(i - 1) while K(i) lands: a ring of two stages or more");
  static constexpr int HALVES = DW / 64;                     // 64-column (128-byte) halves of a (padded) row
  // rows of one TMA box: a page, or a slice of it that tiles of BN_WG (D 64: 192) positions start on, gcd(P, BN_WG) for
  // pages of 2^k positions (BN_WG & -BN_WG: its lowest power of two)
  static constexpr int PB = P < (BN_WG & -BN_WG) ? P : (BN_WG & -BN_WG);
  static constexpr int BOXES = BN_WG / PB;                   // boxes per half of one K or V tile
  static constexpr int BOXES_A_LANE = (BOXES + 31) / 32;     // pages under 4 positions: a producer lane holds several
  // Pages under CP_PRODUCER_BELOW positions (the context's cp_producer_below, at most 8: TMA boxes need 8 rows or
  // more to be worth their issue cost): the producer warps copy K / V tiles with 16-byte cp.async instead of TMA.
  static constexpr int CP_PRODUCER_BELOW = Config::CP_PRODUCER_BELOW;
  static_assert(!WGMMA || CP_PRODUCER_BELOW <= 8, "TMA boxes of pages under 8 positions issue too slowly");
  static constexpr bool CP_PRODUCER = P < CP_PRODUCER_BELOW;
  // cp.async: two warps copy each of K and V, the producer warpgroup's otherwise idle half
  static constexpr int PRODUCER_PARTS = CP_PRODUCER ? 2 : 1;
  static constexpr int FULL_ARRIVALS = CP_PRODUCER ? 32 * PRODUCER_PARTS : 1;  // a stage's full barrier: the warps' cp.async, or the TMA bytes
  static constexpr int KV_TILE_BYTES = BN_WG * DW * 2;       // one K or V tile (16-bit elements, DW columns)
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
  static constexpr int Q_WG_BYTES = 64 * DW * 2;             // one consumer warpgroup's Q rows, swizzled as K
  static constexpr int WG_SMEM_BYTES = NST_WG * STAGE_BYTES + GROUPS * Q_WG_BYTES + 1024;  // + the slack that aligns to 1024 B
  static_assert(!WGMMA || WG_SMEM_BYTES == SMEM_PREFILL, "attention.py and the template disagree on wgmma shared memory");
  static constexpr int OOB_ROW = -256;                       // a box row that starts here is all out of bounds: zeros
  static_assert(!WGMMA || DW % 64 == 0 && DW - D < 64 && D % 16 == 0 && BN_WG % PB == 0 && BN_WG % 16 == 0 && BOXES <= 192, "wgmma tile shapes");
  static constexpr int WG_WARPS = WARPS * GROUPS;            // the consumer warps: GROUPS warpgroups
  static constexpr int PRODUCER_WARP = WG_WARPS;             // the producer warpgroup's first warp loads K, its second V
  static constexpr int CONSUMER_REGS = 240, PRODUCER_REGS = 24;  // setmaxnreg: 2 x 128 x 240 + 128 x 24 <= 64K
  static_assert(!WGMMA || WARPS == 4 && GROUPS == 2 && PREFILL_ROWS == 16 * WG_WARPS && PRODUCER_THREADS == 128,
                "two consumer warpgroups of 4 warps, 16 rows a warp, one producer warpgroup");
  // Named barriers (0 is __syncthreads; decode blocks use 1 and 2; 3 is consumer_sync):
  static constexpr int WG_BAR = 4;                           // + w: warpgroup w's 128 threads
  static constexpr int TURN_BAR = 6;                         // + w: warpgroup w may issue its GEMMs (256 threads)
  static_assert(!WGMMA || !QUANT && sizeof(kvt) == 2, "the wgmma path reads 16-bit KV");
  static constexpr int BN_HALF = BN_WG / 2;  // the width of a run's last tile when its second half is masked
  static_assert(!WGMMA || BN_HALF % 16 == 0, "a half tile is whole k-steps of O += P V");

  // mbarrier, TMA, named barrier, setmaxnreg, descriptor and wgmma fence wrappers: uacompile/hopper.cuh
  // A consumer's wait for a stage's K or V. cp.async (CP_PRODUCER) writes shared memory through the generic proxy,
  // and wgmma reads it through the async proxy: the fence orders the two for this thread's GEMMs.
  template <int = 0>
  static __device__ __forceinline__ void full_wait(uint32_t bar, uint32_t parity) {
    mbar_wait(bar, parity);
    if constexpr (CP_PRODUCER) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }


  // S = Q K^T over one K tile (Q rows of the warpgroup in smem); issued, not waited for.
  template <int = 0>
  static __device__ __forceinline__ void issue_qk(float (&s)[BN_WG / 8][4], Desc qd, Desc kd) {
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) Config::wg_qk(s, kmajor_desc<64>(qd, kk), kmajor_desc<BN_WG>(kd, kk), kk > 0);
  }
  template <int = 0>
  static __device__ __forceinline__ void issue_qk(float (&s)[BN_WG / 8][4], uint32_t qtile, uint32_t ktile) {
    issue_qk(s, smem_desc(qtile, 16), smem_desc(ktile, 16));
  }
  // The first BN_HALF columns of S, sh (the K tile's first BN_HALF rows: the same descriptors, fewer rows read).
  template <int = 0>
  static __device__ __forceinline__ void issue_qk_half(float (&sh)[BN_HALF / 8][4], uint32_t qtile, uint32_t ktile) {
    const Desc qd = smem_desc(qtile, 16), kd = smem_desc(ktile, 16);
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) Config::wg_qk_half(sh, kmajor_desc<64>(qd, kk), kmajor_desc<BN_WG>(kd, kk), kk > 0);
  }
  // O += P V over the first KSTEPS * 16 positions of one V tile (P fragments in registers); issued, not waited for.
  template <int KSTEPS = BN_WG / 16>
  static __device__ __forceinline__ void issue_pv(float (&acc)[DNS][4], const uint32_t (&pf)[BN_WG / 16][4], Desc vd) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) Config::wg_pv(acc, pf[kk], v_desc(vd, kk), 1);
  }
  template <int KSTEPS = BN_WG / 16>
  static __device__ __forceinline__ void issue_pv(float (&acc)[DNS][4], const uint32_t (&pf)[BN_WG / 16][4], uint32_t vtile) {
    issue_pv<KSTEPS>(acc, pf, smem_desc(vtile, BN_WG * 128));
  }
  // Probabilities -> the A fragments of P (the accumulator layout of S is the A layout of P), the first KSTEPS.
  template <int KSTEPS = BN_WG / 16, int NT = BN_WG / 8>
  static __device__ __forceinline__ void pack_p(uint32_t (&pf)[BN_WG / 16][4], const float (&s)[NT][4]) {
    static_assert(2 * KSTEPS <= NT, "KSTEPS k-steps of P take 2 KSTEPS n-tiles of S");
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      pf[kk][0] = pack2<IS_BF16>(s[2 * kk][0], s[2 * kk][1]);
      pf[kk][1] = pack2<IS_BF16>(s[2 * kk][2], s[2 * kk][3]);
      pf[kk][2] = pack2<IS_BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pf[kk][3] = pack2<IS_BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  }

  // The page of box `box` of tile [j0, j0 + BN_WG), or -1 (zero fill) for a box outside
  // [load_lo, load_hi). A volatile load is issued where it stands: ptxas would otherwise sink the
  // page-table read of the next tile down to its use and expose its latency on every tile.
  template <int = 0>
  static __device__ __forceinline__ int box_page(const Params& p, int64_t j0, int64_t load_lo, int64_t load_hi, int box) {
    const int64_t v = j0 + (int64_t)box * PB;  // first virtual position of the box
    int page = -1;
    if (box < BOXES && v + PB > load_lo && v < load_hi)
      asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(page) : "l"(p.page_table + v / P));
    return page;
  }
  // The pages of a lane's boxes lane, lane + 32, ... of one tile (one box a lane for pages of >= 4 positions);
  // all -1 unless `live` (no tile there).
  struct BoxPages {
    int page[BOXES_A_LANE];
  };
  template <int = 0>
  static __device__ __forceinline__ BoxPages box_pages(const Params& p, int64_t j0, int64_t load_lo, int64_t load_hi, int lane,
                                                bool live = true) {
    BoxPages b;
#pragma unroll
    for (int k = 0; k < BOXES_A_LANE; ++k) b.page[k] = live ? box_page(p, j0, load_lo, load_hi, lane + 32 * k) : -1;
    return b;
  }
  // Its TMA row: slot page * P + offset of the box's first position, or OOB_ROW (all zeros) for no page.
  template <int = 0>
  static __device__ __forceinline__ int box_row(int page, int64_t j0, int box) {
    return page >= 0 ? page * P + (int)((j0 + (int64_t)box * PB) % P) : OOB_ROW;
  }

  // CP_PRODUCER: a warp's part of a K or V tile by 16-byte cp.async, into the layout the TMA boxes give (chunk c of
  // row r at c ^ (r % 8) in its 128-byte half-row); the columns past D and the rows of no page are zero-filled.
  // L lanes take a row, 32 / L rows an instruction; a lane's chunks L i + q of a row share its page lookup (a shuffle:
  // row r's page is box r / P's, pages.page[r / P / 32] of lane r / P % 32) and its addresses up to constants. Part
  // `part` of PRODUCER_PARTS takes every other 32 / L rows. The copies are issue-bound, so L leaves a lane >= 4 chunks
  // a row (the context's cp_row_lanes).
  template <int = 0>
  static __device__ __forceinline__ void copy_tile_cp(const kvt* cache, const BoxPages& pages, uint32_t dst, int h, int lane,
                                               int part) {
    constexpr int L = Config::CP_ROW_LANES, RI = 32 / L, CH = DW / 8, GROUP_ROWS = 32 * P < BN_WG ? 32 * P : BN_WG;
    constexpr int64_t SLOT_BYTES = (int64_t)HKV * D * 2;
    static_assert((L == 2 || L == 4 || L == 8) && CH % L == 0 && GROUP_ROWS % (RI * PRODUCER_PARTS) == 0 &&
                  BOXES_A_LANE * GROUP_ROWS == BN_WG, "cp.async tile copy");
    const int q = lane % L;
    const char* base = (const char*)(cache + (int64_t)h * D) + q * 16;
#pragma unroll
    for (int k = 0; k < BOXES_A_LANE; ++k) {
#pragma unroll 2
      for (int g = part; g < GROUP_ROWS / RI; g += PRODUCER_PARTS) {
        const int rg = g * RI + lane / L, r = k * GROUP_ROWS + rg;  // the row in the box group, in the tile
        const int page = __shfl_sync(0xffffffffu, pages.page[k], (rg / P) % 32);
        const char* src = base + ((int64_t)max(page, 0) * P + r % P) * SLOT_BYTES;  // page -1: reads nothing, zeros
        // chunk L i + q sits at ((L i) % 8 + q) ^ (r % 8) = ((L i) % 8) ^ q ^ (r % 8) of half L i / 8 (q < L divides 8)
        const uint32_t row = dst + r * 128 + ((q ^ (r % 8)) << 4);
#pragma unroll
        for (int i = 0; i < CH / L; ++i) {
          const bool valid = page >= 0 && (DW == D || (L * i + q) * 8 < D);
          asm volatile(CP_ASYNC_CG " [%0], [%1], 16, %2;\n" ::"r"((row ^ (((L * i) % 8) << 4)) + (L * i / 8) * (BN_WG * 128)),
                       "l"(src + i * L * 16), "r"(valid ? 16 : 0) : "memory");
        }
      }
    }
  }

  // The virtual positions [lo, hi) that some row of the run [u0, u1) (one sequence) sees in split sp:
  // the union of its tokens' ranges (lo >= hi: none). One warp computes it, with no shared state,
  // so the producer and every consumer warp agree on the run's tiles without a barrier.
  template <int = 0>
  static __device__ __forceinline__ void run_range(const Params& p, int64_t u0, int64_t u1, int sp, int lane, int64_t& lo,
                                            int64_t& hi) {
    const int64_t BIG = (int64_t)1 << 62;
    lo = BIG, hi = -BIG;
    for (int64_t t = u0 + lane; t < u1; t += 32) {
      int a, b;
      split_range(p.token_kv_len[t], sp, a, b);
      const int64_t base = (int64_t)p.token_seq[t] * p.max_pages * P;
      if (a < b) lo = min(lo, base + a), hi = max(hi, base + b);
    }
    lo = warp_min(lo), hi = warp_max(hi);
  }

  // The stages' mbarriers: full_k, full_v (the producer's arrival + the copies' bytes), empty_k,
  // empty_v (an arrival of every consumer warp), NST_WG of each, 8 bytes apart.
  struct StageBars {
    uint32_t base;
    __device__ __forceinline__ uint32_t full_k(uint32_t s) const { return base + 8 * s; }
    __device__ __forceinline__ uint32_t full_v(uint32_t s) const { return base + 8 * (NST_WG + s); }
    __device__ __forceinline__ uint32_t empty_k(uint32_t s) const { return base + 8 * (2 * NST_WG + s); }
    __device__ __forceinline__ uint32_t empty_v(uint32_t s) const { return base + 8 * (3 * NST_WG + s); }
    // Every stage's barriers set up (one thread, before the fence and the block barrier that publish them).
    __device__ __forceinline__ void init() const {
      for (int i = 0; i < NST_WG; ++i) {
        mbar_init(full_k(i), FULL_ARRIVALS), mbar_init(full_v(i), FULL_ARRIVALS);
        mbar_init(empty_k(i), WG_WARPS), mbar_init(empty_v(i), WG_WARPS);
      }
    }
  };
  // The token-window ring of the persistent (DYNAMIC) blocks: full(b), empty(b) for slot b of 2, 8 bytes apart.
  struct WindowBars {
    uint32_t base;
    __device__ __forceinline__ uint32_t full(uint32_t b) const { return base + 8 * b; }
    __device__ __forceinline__ uint32_t empty(uint32_t b) const { return base + 8 * (2 + b); }
  };
  // A consumer warp is done reading a stage's K or V (its wgmma reads have completed).
  template <int = 0>
  static __device__ __forceinline__ void release(uint32_t empty_bar, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);
  }

  // A producer warp: the K (or V) tiles of one run of a tile, KV head h, split sp; warp PRODUCER_WARP
  // loads K, the next one V, each against its own barriers, so neither waits behind the other's refill.
  // `ticket` counts the block's tiles (over all its items when persistent): tile c lives in stage
  // c % NST_WG; its copies complete phase
  // (c / NST_WG) & 1 of the stage's full barrier, and the consumers' release of its previous use,
  // c - NST_WG, completes phase (c / NST_WG - 1) & 1 of the empty one.
  // CP_PRODUCER: `cache` instead of the tensor map, and `part` of the tile's rows.
  template <int = 0>
  static __device__ __forceinline__ void produce_run_wg(const Params& p, const CUtensorMap* tm, const kvt* cache, uint32_t tiles,
                                                 uint32_t full, uint32_t empty, int64_t u0, int64_t u1, int h,
                                                 uint32_t& ticket, int sp, int part = 0) {
    const int lane = threadIdx.x % 32;
    int64_t lo, hi;
    run_range(p, u0, u1, sp, lane, lo, hi);
    if (lo >= hi) return;
    const int64_t first = (lo / BN_WG) * BN_WG;
    const int n = (int)((hi - first + BN_WG - 1) / BN_WG);
    BoxPages pages = box_pages(p, first, lo, hi, lane);
    for (int i = 0; i < n; ++i) {
      const uint32_t c = ticket + i, s = c % NST_WG;
      const int64_t j0 = first + (int64_t)i * BN_WG;
      const BoxPages next = box_pages(p, j0 + BN_WG, lo, hi, lane, i + 1 < n);  // in flight during the wait
      if (c >= NST_WG) mbar_wait(empty + 8 * s, (c / NST_WG - 1) & 1);
      if constexpr (CP_PRODUCER) {  // each lane's arrival follows its copies
        copy_tile_cp(cache, pages, tiles + s * STAGE_BYTES, h, lane, part);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full + 8 * s) : "memory");
      } else {
        if (lane == 0) mbar_expect_tx(full + 8 * s, KV_TILE_BYTES);
        __syncwarp();
#pragma unroll
        for (int k = 0; k < BOXES_A_LANE; ++k) {
          const int box = lane + 32 * k;
          if (box < BOXES) {
            // a box of PB < 8 rows starts inside a 1024-byte swizzle atom: TMA swizzles by the shared-memory
            // address, so its rows land where a whole-atom box would put them
            const int row = box_row(pages.page[k], j0, box);
            const uint32_t dst = tiles + s * STAGE_BYTES + box * (PB * 128);
#pragma unroll
            for (int hf = 0; hf < HALVES; ++hf)
              tma_load_3d(dst + hf * (BN_WG * 128), tm, hf * 64, h, row, full + 8 * s);
          }
        }
      }
      pages = next;
    }
    ticket += n;
  }

  // This warp's 16 rows of its warpgroup's Q tile into shared memory, in the 128-byte swizzle TMA gives
  // K (16-byte chunk c of row r at chunk c ^ (r % 8)); rows past the run are zeros. A padded row's columns past D
  // are left as they are: S = Q K^T reads D / 16 k-steps only, by cp.async, waited for by q_staged().
  template <int = 0>
  static __device__ __forceinline__ void stage_q_wg(const Params& p, uint32_t qtile, int wrow, int64_t u0, int nrows, int h,
                                             int lane) {
    constexpr int CH = D / 8;  // 16-byte chunks of a row
#pragma unroll
    for (int k = 0; k < 16 * CH / 32; ++k) {
      const int idx = lane + 32 * k, rl = wrow % 64 + idx / CH, c = idx % CH, r = wrow + idx / CH;
      const uint32_t dst = qtile + (c / 8) * (64 * 128) + rl * 128 + (((c % 8) ^ (rl % 8)) * 16);
      // a row past the run reads nothing (source size 0) and is zero-filled
      const qt* src = r < nrows ? p.q + ((u0 + r / G) * HQ + (int64_t)h * G + r % G) * D + c * 8 : p.q;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(r < nrows ? 16 : 0)
                   : "memory");
    }
    cp_async_commit();
  }
  // The cp.async copies of stage_q_wg have landed and are visible to wgmma (the async proxy).
  template <int = 0>
  static __device__ __forceinline__ void q_staged() {
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // The V producer warp, on receiving an item, prefetches its Q rows into L2 (a token's G heads
  // of KV head h are G * D contiguous elements): the consumers stage them NST_WG or more tiles later, from
  // L2 instead of HBM. (The V warp: the K warp, which also takes the items, has no register to spare.)
  // Not where a token's rows are under Q_PREFETCH_MIN bytes (the context's q_prefetch_min; with MHA's small rows,
  // many bulk prefetches an item queue ahead of the V warp's tile copies and delay V(0)).
  static constexpr int Q_PREFETCH_MIN = Config::Q_PREFETCH_MIN;
  template <int = 0>
  static __device__ __forceinline__ void prefetch_q_l2(const Params& p, int64_t tb, int64_t te, int h, int lane) {
    static_assert(G * D * sizeof(qt) % 16 == 0, "bulk prefetch sizes are multiples of 16 bytes");
    if constexpr (G * D * (int)sizeof(qt) < Q_PREFETCH_MIN) return;
    const qt* q0 = p.q + (tb * HQ + (int64_t)h * G) * D;
#pragma unroll 1
    for (int i = lane; i < (int)(te - tb); i += 32)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(q0 + (int64_t)i * (HQ * D)),
                   "n"((int)(G * D * sizeof(qt))) : "memory");
  }

  // PREFILL_OVERLAP: a run of the consumer warpgroups stops before its last O += P V; the warpgroup's next run
  // issues it in its first turn, ahead of its own S(0) = Q K(0)^T, and stores the rows under S(0). What the run
  // leaves (registers only, nothing in flight between the runs): O, m and l, the last tile's P fragments, its
  // V stage and phase, whether it is half wide, where the rows go. The next run takes st and pf as its own once
  // it has stored them.
  struct RunTail {
    State st;
    uint32_t pf[BN_WG / 16][4];
    int64_t u0;
    int nrows, h, sp;
    uint32_t v_stage, v_phase;
    bool half, pending;  // pending: O += P V not issued, rows not stored (the same in every consumer warp)
  };
  // The last O += P V of the pending run has completed (the caller waited for it): release its V stage, store its rows.
  template <int = 0>
  static __device__ __forceinline__ void store_tail(const Params& p, StageBars bars, RunTail& t) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    fence_acc(t.st.acc);
    fence_frag(t.pf);
    release(bars.empty_v(t.v_stage), lane);
    store_run_rows(p, t.st, warp * 16, t.u0, t.nrows, t.h, lane, t.sp);
    t.pending = false;
  }
  // The pending run's O += P V in a turn of its own, as production's last tile (no S(0) to go with it: a run
  // that sees no position, the fused merge of the item, the block's end), then its rows. Off: never pending.
  template <int = 0>
  static __device__ __forceinline__ void flush_tail(const Params& p, uint32_t stages, StageBars bars, RunTail& t) {
    if constexpr (PREFILL_OVERLAP) {
      if (!t.pending) return;
      const int wg = threadIdx.x / THREADS;
      auto last_pv = [&](auto ksteps) {
        named_sync(TURN_BAR + wg, 2 * THREADS);
        fence_acc(t.st.acc);
        wg_arrive();
        issue_pv<decltype(ksteps)::value>(t.st.acc, t.pf, stages + t.v_stage * STAGE_BYTES + KV_TILE_BYTES);
        wg_commit();
        named_arrive(TURN_BAR + (1 - wg), 2 * THREADS);
      };
      full_wait(bars.full_v(t.v_stage), t.v_phase);
      if (t.half) last_pv(std::integral_constant<int, BN_HALF / 16>());
      else last_pv(std::integral_constant<int, BN_WG / 16>());
      wg_wait<0>();
      store_tail(p, bars, t);
    }
  }

  // Consumer warpgroups: one run of consecutive tokens of one sequence, KV head h, at most PREFILL_ROWS rows:
  // row r = (token u0 + r / G, head h * G + r % G); warpgroup w has rows [64 w, 64 w + 64), warp i of
  // it 16 of them. Both warpgroups read every K/V tile; `ticket` as in produce_run_wg. Each GEMM issue
  // is a turn: warpgroup w waits on TURN_BAR + w, issues, then lets the other one go. PREFILL_OVERLAP: the run's
  // first turn issues the last O += P V of the run before (tail) and then S(0), and stores the run before's rows
  // under S(0); it leaves its own last O += P V in tail. Both warpgroups walk the same runs with the same tail,
  // so they take the same number of turns.
  template <int = 0>
  static __device__ __forceinline__ void prefill_run_wg(const Params& p, uint32_t stages, uint32_t qtiles, StageBars bars,
                                                 int64_t u0, int64_t u1, int h, uint32_t& ticket, int sp,
                                                 RunTail& tail) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
    const int nrows = (int)(u1 - u0) * G;
    const uint32_t qtile = qtiles + wg * Q_WG_BYTES;
    auto turn_begin = [&] { named_sync(TURN_BAR + wg, 2 * THREADS); };
    auto turn_end = [&] { named_arrive(TURN_BAR + (1 - wg), 2 * THREADS); };
    // Q's copies in flight while the rows' ranges are read
    named_sync(WG_BAR + wg, THREADS);  // the warpgroup's GEMMs of the previous run are done with its Q tile
    stage_q_wg(p, qtile, warp * 16, u0, nrows, h, lane);
    Rows rw;
    set_run_rows(p, rw, warp * 16, u0, nrows, h, lane, sp);
    int64_t lo, hi;
    run_range(p, u0, u1, sp, lane, lo, hi);
    q_staged();
    named_sync(WG_BAR + wg, THREADS);
    State own;
    State& st = PREFILL_OVERLAP ? tail.st : own;  // OVERLAP: the run before's O until it is stored
    if constexpr (!PREFILL_OVERLAP) init_state(st);
    if (lo < hi) {
      const int64_t first = (lo / BN_WG) * BN_WG;
      const int n = (int)((hi - first + BN_WG - 1) / BN_WG);
      // No row of the run sees past the first BN_HALF positions of its last tile (hi is the
      // same in every warp): that tile, if not the first, runs half wide after the loop.
      const bool half_last = n > 1 && hi - (first + (int64_t)(n - 1) * BN_WG) <= BN_HALF;
      int n_loop = half_last ? n - 1 : n;
      asm volatile("" : "+r"(n_loop));  // kept in a register, not re-derived each tile
      const uint32_t base = ticket;
      float s[BN_WG / 8][4];
      uint32_t own_pf[BN_WG / 16][4];
      auto& pf = PREFILL_OVERLAP ? tail.pf : own_pf;  // OVERLAP: the run before's P until its O += P V is done
      float alpha[2];
      // tile 0: scores and probabilities
      {
        const uint32_t s0 = base % NST_WG;
        full_wait(bars.full_k(s0), (base / NST_WG) & 1);
        if constexpr (PREFILL_OVERLAP) {
          // one turn: the run before's last O += P V (none, half or whole: one wgmma sequence a path), then S(0)
          auto first_turn = [&](auto ksteps) {
            turn_begin();
            fence_acc(s);
            if constexpr (decltype(ksteps)::value > 0) fence_acc(st.acc);
            wg_arrive();
            if constexpr (decltype(ksteps)::value > 0) {
              issue_pv<decltype(ksteps)::value>(st.acc, pf, stages + tail.v_stage * STAGE_BYTES + KV_TILE_BYTES);
              wg_commit();
            }
            issue_qk(s, qtile, stages + s0 * STAGE_BYTES);
            wg_commit();
            turn_end();
          };
          // The wait and the stores on the pending path only: ptxas serialises every wgmma (C7515) when they
          // follow the paths' merge, and (C7511) when the rows' range loads move under the GEMMs too.
          if (!tail.pending) {
            first_turn(std::integral_constant<int, 0>());
          } else {
            full_wait(bars.full_v(tail.v_stage), tail.v_phase);
            if (tail.half) first_turn(std::integral_constant<int, BN_HALF / 16>());
            else first_turn(std::integral_constant<int, BN_WG / 16>());
            wg_wait<1>();  // the O += P V is done, S(0) may not be: the run before's stores under S(0)
            store_tail(p, bars, tail);
          }
          init_state(st);
        } else {
          turn_begin();
          fence_acc(s);
          wg_arrive();
          issue_qk(s, qtile, stages + s0 * STAGE_BYTES);
          wg_commit();
          turn_end();
        }
        wg_wait<0>();
        fence_acc(s);
        release(bars.empty_k(s0), lane);
        softmax_scores<BN_WG>(s, first, rw, st.m, st.l, alpha, lane);  // O is still zero: alpha unused
        pack_p(pf, s);
      }
      // LEAN: the stage and phase of tile i - 1 step with i (no division by NST_WG a tile), and tiles
      // [unmasked_lo, unmasked_hi) of the run need no mask (one 32-bit test a tile, not four 64-bit ones).
      // The descriptors' low words of stage 0's K and V tiles and of Q are set once a run (stage s: + s
      // STAGE_BYTES >> 4), and the barrier base is made opaque so ptxas keeps it in a register instead of
      // rebuilding the shared-window address every tile.
      uint32_t lean_stage = base % NST_WG, lean_phase = (base / NST_WG) & 1;
      int unmasked_lo = 0, unmasked_hi = 0;
      uint32_t k_lo0 = 0, v_lo0 = 0, q_lo = 0;
      {
        asm volatile("" : "+r"(bars.base));
        k_lo0 = desc_lo(stages, 16), v_lo0 = desc_lo(stages + KV_TILE_BYTES, BN_WG * 128), q_lo = desc_lo(qtile, 16);
        const int64_t to_lo = rw.lo_max - first, to_hi = rw.hi_min - first;  // tile i unmasked: i * BN_WG >= to_lo,
        unmasked_lo = (int)min((int64_t)n, to_lo <= 0 ? 0 : (to_lo + BN_WG - 1) / BN_WG);  // (i + 1) * BN_WG <= to_hi
        unmasked_hi = (int)min((int64_t)n, to_hi <= 0 ? 0 : to_hi / BN_WG);
      }
      for (int i = 1; i < n_loop; ++i) {
        uint32_t cur, prev, cur_phase, prev_phase;
        if constexpr (NST_WG > 1) {  // a ring of stages: tile i - 1's stage and phase, then tile i's
          prev = lean_stage, prev_phase = lean_phase;
          lean_stage = lean_stage + 1 == NST_WG ? 0 : lean_stage + 1;
          lean_phase ^= lean_stage == 0;
          cur = lean_stage, cur_phase = lean_phase;
        }
        full_wait(bars.full_k(cur), cur_phase);
        full_wait(bars.full_v(prev), prev_phase);
        turn_begin();
        fence_acc(s);
        fence_acc(st.acc);
        wg_arrive();
        issue_qk(s, broadcast_desc(q_lo), broadcast_desc(k_lo0 + cur * (STAGE_BYTES >> 4)));  // S(i) = Q K(i)^T ...
        wg_commit();
        issue_pv(st.acc, pf, broadcast_desc(v_lo0 + prev * (STAGE_BYTES >> 4)));  // ... while O += P(i-1) V(i-1)
        wg_commit();
        turn_end();
        wg_wait<1>();
        fence_acc(s);
        release(bars.empty_k(cur), lane);
        const int64_t j0 = first + (int64_t)i * BN_WG;
        const bool need = softmax_scores<BN_WG>(s, j0, i >= unmasked_lo && i < unmasked_hi, rw, st.m, st.l, alpha, lane);
        wg_wait<0>();
        fence_acc(st.acc);
        release(bars.empty_v(prev), lane);
        if (need) rescale_acc(st.acc, alpha);
        pack_p(pf, s);
      }
      const uint32_t c = base + n - 1, last = c % NST_WG;
      if (half_last) {  // the loop's step for tile n - 1 at half width: its other half is masked in every row
        const uint32_t prev = (c - 1) % NST_WG;
        full_wait(bars.full_k(last), (c / NST_WG) & 1);
        full_wait(bars.full_v(prev), ((c - 1) / NST_WG) & 1);
        // the tile's scores in an array of their own, undefined on entry like s at tile 0 (s is dead by then: its
        // probabilities are in P); in the first half of s, the loop's last S values would flow into the half-wide
        // wgmma as in-out accumulators, and ptxas serialises every wgmma of the kernel (C7511)
        float sh[BN_HALF / 8][4];
        turn_begin();
        fence_acc(sh);
        fence_acc(st.acc);
        wg_arrive();
        issue_qk_half(sh, qtile, stages + last * STAGE_BYTES);
        wg_commit();
        issue_pv(st.acc, pf, stages + prev * STAGE_BYTES + KV_TILE_BYTES);
        wg_commit();
        turn_end();
        wg_wait<1>();
        fence_acc(sh);
        release(bars.empty_k(last), lane);
        const bool need = softmax_core<BN_HALF, true>(sh, first + (int64_t)(n - 1) * BN_WG, rw, st.m, st.l, alpha, lane);
        wg_wait<0>();
        fence_acc(st.acc);
        release(bars.empty_v(prev), lane);
        if (need) rescale_acc(st.acc, alpha);
        pack_p<BN_HALF / 16>(pf, sh);
      }
      // O += P V of the last tile (its first KSTEPS k-steps); a path of its own for either depth (one wgmma
      // sequence after one arrive: ptxas serialises every wgmma of the kernel when a fence is shared by two)
      auto last_pv = [&](auto ksteps) {
        full_wait(bars.full_v(last), (c / NST_WG) & 1);
        turn_begin();
        fence_acc(st.acc);
        wg_arrive();
        issue_pv<decltype(ksteps)::value>(st.acc, pf, stages + last * STAGE_BYTES + KV_TILE_BYTES);
        wg_commit();
        turn_end();
      };
      if constexpr (PREFILL_OVERLAP) {  // the next run's first turn (or flush_tail) issues it
        tail.u0 = u0, tail.nrows = nrows, tail.h = h, tail.sp = sp;
        tail.v_stage = last, tail.v_phase = (c / NST_WG) & 1, tail.half = half_last, tail.pending = true;
        ticket = base + n;
        return;
      }
      if (half_last) last_pv(std::integral_constant<int, BN_HALF / 16>());
      else last_pv(std::integral_constant<int, BN_WG / 16>());
      wg_wait<0>();
      fence_acc(st.acc);
      release(bars.empty_v(last), lane);
      ticket = base + n;
    }
    if constexpr (PREFILL_OVERLAP) {  // no position seen: the run before first, then this one's rows (O = 0, lse = -inf)
      flush_tail(p, stages, bars, tail);
      init_state(st);
    }
    store_run_rows(p, st, warp * 16, u0, nrows, h, lane, sp);
  }


  // ---------------------------------------------------------------- the kernel
  // The __global__ entry's body (tmk, tmv: the K and V caches' tensor maps on the Hopper path, else null).
  template <int = 0>
  static __device__ __forceinline__ void run(const Params& p, const CUtensorMap* tmk, const CUtensorMap* tmv) {
    // 128-byte aligned for the swizzled tile rows (each row whole smem segments)
    extern __shared__ __align__(128) char smem[];
    // The prefill roles' shared arrays, declared here at the top (a kernel's arrays are laid out in the order they are
    // emitted, outer blocks' first): the persistent blocks' item ring and its barriers (DYNAMIC), a prefill tile's token
    // window and the Hopper stage barriers. A kernel keeps the ones it uses.
    __shared__ int seq_ring[2][TM + 2];
    __shared__ int item_ring[2];
    __shared__ __align__(8) uint64_t ring_bars[4 * NST_WG + 4];
    __shared__ int seq_smem[TM + 2];
    __shared__ __align__(8) uint64_t stage_bars[4 * NST_WG];
    const int64_t T = p.num_tokens;
    pdl_start();  // PDL: nothing below may touch global memory before the previous kernel is done
    // block_coord(p) is read where used, not kept: the prefill path has no register to spare
    if (DECODE_ONLY || block_coord(p).x < p.num_decode_blocks) {
      if constexpr (WGMMA) {
        // Decode blocks have no use for the producer warpgroup: its registers go to the decode groups.
        // (Each role's path ends in its own return: ptxas must know the register count everywhere.)
        if (threadIdx.x >= CONSUMER_THREADS) {
          regs_down<PRODUCER_REGS>();
          return;
        }
        regs_up<CONSUMER_REGS>();
      }
      // Decode group b (group g of block x: b = x * GROUPS + g) takes the isolated tokens of rank b,
      // b + num_decode, ... (rank = order among tokens that are the only token of their sequence in
      // their neighbourhood). Groups share nothing but the block: each has its own smem and barrier.
      __shared__ int warp_count_all[GROUPS][WARPS];
      __shared__ long long chosen_all[GROUPS];
      const int grp = threadIdx.x / THREADS, tid = threadIdx.x % THREADS;
      int* warp_count = warp_count_all[grp];
      long long& chosen = chosen_all[grp];
      char* gsmem = smem + grp * SMEM_NEEDED;
      const int warp = tid / 32, lane = threadIdx.x % 32;
      const int sp = SPLIT_GROUPS > 1 ? block_coord(p).z * SPLIT_GROUPS + grp : block_coord(p).z;
      if (sp >= NSPLIT) return;  // the odd split count's last block: a group without a split
      int64_t target = SPLIT_GROUPS > 1 ? block_coord(p).x : block_coord(p).x * GROUPS + grp, rank_base = 0;
      Guess guess;
      load_guess(p, guess, target < T ? target : -1, kv_head(p), lane);
      if constexpr (DECODE_ONLY) {
        for (; target < T; target += p.num_decode) {  // the guess is right: token `target` is this group's
          decode_token(p, gsmem, target, sp, guess);
        }
        (void)rank_base, (void)warp, (void)warp_count, (void)chosen;
      } else {
        for (int64_t c0 = 0; c0 < T; c0 += THREADS * 8) {
          const int64_t t0 = c0 + tid * 8;
          int seqs[10];
#pragma unroll
          for (int i = 0; i < 10; ++i) {
            const int64_t t = t0 - 1 + i;
            seqs[i] = (t >= 0 && t < T) ? p.token_seq[t] : -2 - i;  // distinct sentinels
          }
          uint32_t flags = 0;
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (t0 + i < T && seqs[i] != seqs[i + 1] && seqs[i + 2] != seqs[i + 1]) flags |= 1u << i;
          const int cnt = __popc(flags);
          int incl = cnt;
#pragma unroll
          for (int o = 1; o < 32; o *= 2) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
          }
          if (lane == 31) warp_count[warp] = incl;
          decode_group_sync();
          int total = 0, before = 0;
#pragma unroll
          for (int w = 0; w < WARPS; ++w) {
            before += w < warp ? warp_count[w] : 0;
            total += warp_count[w];
          }
          const int excl = before + incl - cnt;
          while (target < rank_base + total) {
            const int k = (int)(target - rank_base);
            if (k >= excl && k < excl + cnt) {
              uint32_t f = flags;
              for (int skip = k - excl; skip > 0; --skip) f &= f - 1;
              chosen = t0 + (__ffs(f) - 1);
            }
            decode_group_sync();
            decode_token(p, gsmem, chosen, sp, guess);
            target += p.num_decode;
          }
          rank_base += total;
          decode_group_sync();
        }
      }
      return;
    }
    if constexpr (!DECODE_ONLY) {
      if constexpr (DYNAMIC) {
        // Persistent prefill blocks (DYNAMIC): the K producer warp takes items from the queue (take_item)
        // and hands each over through a two-slot ring: its index and token window in slot k % 2, "full"
        // once written (1 arrival), "empty" once the V warp and every consumer warp are done with it
        // (WG_WARPS + 1 arrivals: the fused merge reads the window too); index -1 ends the block. The
        // producer warps run on into the next item (the stage tickets go on), so a block fills its
        // pipeline once, not once a tile.
        const StageBars bars{smem_addr(ring_bars)};
        const WindowBars windows{bars.base + 8 * 4 * NST_WG};
        const uint32_t stages = (smem_addr(smem) + 1023) & ~1023u;  // 128-byte swizzle atoms: 1024-aligned
        const uint32_t qtiles = stages + NST_WG * STAGE_BYTES;
        if (threadIdx.x == 0) {
          bars.init();
          // a window slot is free once the consumer warps and the producer warps other than the queue's are done with it
          for (int b = 0; b < 2; ++b) mbar_init(windows.full(b), 1), mbar_init(windows.empty(b), WG_WARPS + 2 * PRODUCER_PARTS - 1);
          asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if (threadIdx.x >= CONSUMER_THREADS) {
          regs_down<PRODUCER_REGS>();
          // role 0: K and the queue, 1: V; with cp.async (PRODUCER_PARTS 2) 2: K and 3: V of the other rows; else idle
          const int lane = threadIdx.x % 32, role = threadIdx.x / 32 - PRODUCER_WARP;
          uint32_t ticket = 0;
          if (role == 0) {
            for (uint32_t k = 0;; ++k) {
              const uint32_t b = k % 2;
              if (k >= 2) mbar_wait(windows.empty(b), (k / 2 - 1) & 1);  // item k - 2 is done with the slot
              const int item = take_item(p, seq_ring[b], lane);
              if (lane == 0) item_ring[b] = item;
              __syncwarp();
              if (lane == 0) mbar_arrive(windows.full(b));
              if (item < 0) break;
              const PrefillItem it = prefill_item(p, item);
              for_each_run(it.tb, it.te, seq_ring[b], [&] { return it.zs; }, [&](int64_t u, int64_t u1, int sp) {
                produce_run_wg(p, tmk, p.k_cache, stages, bars.full_k(0), bars.empty_k(0), u, u1, it.h, ticket, sp);
              });
            }
            if (lane == 0) queue_done(p);
          }
          if (role > 0 && role < 2 * PRODUCER_PARTS) {
            const bool v = PRODUCER_PARTS == 1 || role % 2 == 1, first = PRODUCER_PARTS == 1 || role == 1;
            const int part = PRODUCER_PARTS == 1 ? 0 : role / 2;
            for (uint32_t k = 0;; ++k) {
              const uint32_t b = k % 2;
              mbar_wait(windows.full(b), (k / 2) & 1);
              const int item = item_ring[b];
              if (item < 0) break;
              const PrefillItem it = prefill_item(p, item);
              if (first) prefetch_q_l2(p, it.tb, it.te, it.h, lane);
              for_each_run(it.tb, it.te, seq_ring[b], [&] { return it.zs; }, [&](int64_t u, int64_t u1, int sp) {
                produce_run_wg(p, v ? tmv : tmk, v ? p.v_cache : p.k_cache, stages + (v ? KV_TILE_BYTES : 0),
                               v ? bars.full_v(0) : bars.full_k(0), v ? bars.empty_v(0) : bars.empty_k(0), u, u1, it.h,
                               ticket, sp, part);
              });
              release(windows.empty(b), lane);
            }
          }
          return;
        }
        regs_up<CONSUMER_REGS>();
        const int wg = threadIdx.x / THREADS;
        if (wg == 1) named_arrive(TURN_BAR, 2 * THREADS);  // warpgroup 0 takes the first turn
        uint32_t ticket = 0;
        RunTail tail;  // PREFILL_OVERLAP: the warpgroup's last run, its last O += P V not yet issued, its rows not stored
        tail.pending = false;
        for (uint32_t k = 0;; ++k) {
          const uint32_t b = k % 2;
          mbar_wait(windows.full(b), (k / 2) & 1);
          const int item = item_ring[b];
          if (item < 0) break;
          const PrefillItem it = prefill_item(p, item);
          for_each_run(it.tb, it.te, seq_ring[b], [&] { return it.zs; }, [&](int64_t u, int64_t u1, int sp) {
            prefill_run_wg(p, stages, qtiles, bars, u, u1, it.h, ticket, sp, tail);
          });
          if (FUSED_MERGE) {  // once the tile's runs are stored
            flush_tail(p, stages, bars, tail);
            merge_prefill_tile(p, it.tb, it.te, seq_ring[b], it.h, it.zs);
          }
          release(windows.empty(b), threadIdx.x % 32);
        }
        flush_tail(p, stages, bars, tail);
        if (wg == 0) named_sync(TURN_BAR, 2 * THREADS);  // warpgroup 1's last turn: every arrival is matched
      } else {
        // prefill tile (heaviest, i.e. last, tiles first)
        const int64_t tile = p.num_prefill_tiles - 1 - (block_coord(p).x - p.num_decode_blocks);
        const int64_t tb = tile * TM, te = min(tb + TM, T);
        fill_window(p, seq_smem, tb, te, threadIdx.x, BLOCK_THREADS);
        // a tile of lone tokens only (every tile of a pure decode launch): nothing to do
        __syncthreads();
        if (!__syncthreads_or(window_has_run(seq_smem, te - tb, threadIdx.x, BLOCK_THREADS))) return;
        // The runs of the tile and the splits this block takes of each, in the order every role walks them.
        auto for_each_run_here = [&](auto&& run) { for_each_run(tb, te, seq_smem, [&] { return block_coord(p).z; }, run); };
        if constexpr (WGMMA) {
          const StageBars bars{smem_addr(stage_bars)};
          const uint32_t stages = (smem_addr(smem) + 1023) & ~1023u;  // 128-byte swizzle atoms: 1024-aligned
          const uint32_t qtiles = stages + NST_WG * STAGE_BYTES;
          if (threadIdx.x == 0) {
            bars.init();
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
          }
          __syncthreads();
          uint32_t ticket = 0;
          if (threadIdx.x >= CONSUMER_THREADS) {
            regs_down<PRODUCER_REGS>();
            const int role = threadIdx.x / 32 - PRODUCER_WARP;  // 0: K, 1: V (cp.async: 2 and 3 too), else idle
            if (role < 2 * PRODUCER_PARTS) {
              const bool v = PRODUCER_PARTS == 1 ? role == 1 : role % 2 == 1;
              const int part = role / 2;
              for_each_run_here([&](int64_t u, int64_t u1, int sp) {
                produce_run_wg(p, v ? tmv : tmk, v ? p.v_cache : p.k_cache, stages + (v ? KV_TILE_BYTES : 0), v ? bars.full_v(0) : bars.full_k(0),
                               v ? bars.empty_v(0) : bars.empty_k(0), u, u1, kv_head(p), ticket, sp, part);
              });
            }
            return;
          }
          regs_up<CONSUMER_REGS>();
          const int wg = threadIdx.x / THREADS;
          if (wg == 1) named_arrive(TURN_BAR, 2 * THREADS);  // warpgroup 0 takes the first turn
          RunTail tail;  // PREFILL_OVERLAP: as in the persistent blocks
          tail.pending = false;
          for_each_run_here([&](int64_t u, int64_t u1, int sp) {
            prefill_run_wg(p, stages, qtiles, bars, u, u1, kv_head(p), ticket, sp, tail);
          });
          flush_tail(p, stages, bars, tail);  // before the fused merge reads the tile's rows
          if (wg == 0) named_sync(TURN_BAR, 2 * THREADS);  // warpgroup 1's last turn: every arrival is matched
        } else {
          __syncthreads();
          for_each_run_here([&](int64_t u, int64_t u1, int sp) { prefill_run(p, smem, u, u1, sp); });
        }
        // fused split-KV merge once the tile's runs are stored
        if (FUSED_MERGE) merge_prefill_tile(p, tb, te, seq_smem, kv_head(p), block_coord(p).z);
      }
    }  // !DECODE_ONLY
  }

  // A K or V cache as a 3-D tensor (d, kv head, slot = page * P + offset) for the bulk tensor copy
  // engine: boxes of 64 d x 1 head x PB slots, 128-byte swizzle; out-of-bounds rows read as zeros, and so do
  // the columns past D of a padded row's last half (D 80, 96: attention.wgmma_width).
  static int encode_kv_map(CUtensorMap* map, const void* cache, int64_t num_pages) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
      cudaDriverEntryPointQueryResult found;
      void* fn = nullptr;
      const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                               cudaEnableDefault, &found);
      if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn) return (int)cudaErrorSymbolNotFound;
      encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    if (num_pages * P > 0x7fffffffLL) return (int)cudaErrorInvalidValue;  // box coordinates are int32
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)HKV, (cuuint64_t)(num_pages * P)};
    const cuuint64_t strides[2] = {(cuuint64_t)D * 2, (cuuint64_t)HKV * D * 2};  // bytes, dims 1 and 2
    const cuuint32_t box[3] = {64, 1, (cuuint32_t)PB};
    const cuuint32_t unit[3] = {1, 1, 1};
    const CUresult res = encode(map, IS_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                                const_cast<void*>(cache), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return res == CUDA_SUCCESS ? 0 : (int)cudaErrorInvalidValue;
  }
};
}  // namespace ua
#endif
