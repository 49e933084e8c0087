"""CPU: each kernel header of targets/cuda/include/uacompile compiles on its own (nvcc -c of a .cu that includes it
and instantiates its templates), for sm_80 and sm_90a; the package ships them."""
from __future__ import annotations

import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

# reshape_and_cache: a kernel over each of three configurations (RoPE rotate-half with the classic quantisation and
# cp.async stages; the lean quantisation with packed maxima, an L2 prefetch and interleaved RoPE; plain 16-bit)
RC_CONFIGS = """
__device__ const double RC_FREQ[64] = {};
template <class In, class Cache, ua::rc::RopeMode MODE, bool Q, bool LEAN, int STAGES_, int PREFETCH>
struct RcConfig {
  typedef In in_t;
  typedef Cache cache_t;
  static constexpr int HKV = 8, D = 128, VEC = 8, GROUP = 16, THREADS = 256, WAVES = 0, STAGES = STAGES_;
  static constexpr int64_t PREFETCH_TOKENS = PREFETCH;
  static constexpr bool ONE_ROUND = false;
  static constexpr ua::rc::RopeMode ROPE = MODE;
  static constexpr bool QUANT = Q, FAST_QUANT = true, LEAN_QUANT = LEAN, PACKED_AMAX = LEAN;
  static __device__ __forceinline__ const double* inv_freq() { return RC_FREQ; }
};
template <class C, int R, int S>
__global__ void rc_kernel(const typename C::in_t* k, const typename C::in_t* v, const int64_t* slots,
                          const int64_t* pos, typename C::cache_t* kc, typename C::cache_t* vc, float* ks, float* vs,
                          int64_t n) {
  ua::rc::ReshapeAndCache<C>::template kernel<R, S>(k, v, slots, pos, kc, vc, ks, vs, n);
}
template __global__ void rc_kernel<RcConfig<half, int8_t, ua::rc::RopeMode::RELOAD, true, false, 3, 0>, 2, 4>(
    const half*, const half*, const int64_t*, const int64_t*, int8_t*, int8_t*, float*, float*, int64_t);
template __global__ void rc_kernel<RcConfig<ua::bf16, uint8_t, ua::rc::RopeMode::INTERLEAVED, true, true, 0, 4>, 8, 1>(
    const ua::bf16*, const ua::bf16*, const int64_t*, const int64_t*, uint8_t*, uint8_t*, float*, float*, int64_t);
template __global__ void rc_kernel<RcConfig<half, half, ua::rc::RopeMode::NONE, false, false, 0, 0>, 1, 1>(
    const half*, const half*, const int64_t*, const int64_t*, half*, half*, float*, float*, int64_t);
"""
# paged_attention: a kernel over each of two configurations (fp16 with an mma.sync prefill path; a decode-only int8 cache with split-KV merged in the
# launch, a window, ALiBi and soft-cap), their shared-memory sizes as targets/cuda/layout.py gives them
PA_CONFIGS = """
template <class Q, class KV, int D_, int MT, int ST, int SMEM, int MINB, bool QNT, bool SPLIT>
struct PaConfig {
  typedef Q qt;
  typedef KV kvt;
  static constexpr int D = D_, P = 16, HQ = 4 * D_ / 32, HKV = D_ / 32, NSPLIT = SPLIT ? 4 : 1, WINDOW = SPLIT ? 32 : 0;
  static constexpr bool IS_BF16 = QNT, QUANT = QNT, IS_FP8 = false, UNIFIED = false, ALIBI = SPLIT, SOFTCAP = SPLIT;
  static constexpr bool WRITE_LSE = false, FUSED_MERGE = SPLIT, MERGE_LSE = SPLIT, PDL = false, DYNAMIC = false;
  static constexpr bool DECODE_ONLY = SPLIT;
  static constexpr float SM_SCALE = 0.125f, CAP = 20.0f;
  static constexpr int GROUPS = 1, PRODUCER_THREADS = 0, MT_PRE = MT, BN_PRE = 32, KV_ROWS = 64, NSTAGE = ST, DW = D_;
  static constexpr int PREFILL_ROWS = 64 * MT, SMEM_BYTES = SMEM, SMEM_PREFILL = 0, MIN_BLOCKS = MINB;
  static constexpr bool WGMMA = false;
  static constexpr int BN_WG = 64, NST_WG = 2, CP_PRODUCER_BELOW = 8, CP_ROW_LANES = 4, Q_PREFETCH_MIN = 0;
};
using PaHalf = ua::PagedAttention<PaConfig<half, half, 128, 2, 2, 104448, 2, false, false>>;
using PaInt8 = ua::PagedAttention<PaConfig<ua::bf16, int8_t, 64, 1, 3, 35328, 3, true, true>>;
template struct ua::PagedAttention<PaConfig<half, half, 128, 2, 2, 104448, 2, false, false>>;
template struct ua::PagedAttention<PaConfig<ua::bf16, int8_t, 64, 1, 3, 35328, 3, true, true>>;
__global__ void __launch_bounds__(PaHalf::BLOCK_THREADS, 2) pa_half(const PaHalf::Params p) {
  PaHalf::run<>(p, nullptr, nullptr);
}
__global__ void __launch_bounds__(PaInt8::BLOCK_THREADS, 3) pa_int8(const PaInt8::Params p) {
  PaInt8::run<>(p, nullptr, nullptr);
}
"""
# header -> an explicit instantiation of its templates (every member compiled), or "" for plain code
HEADERS = {
    "common.cuh": "",
    "page_copy.cuh": "template struct ua::PageCopy<256, 4, 32768, 16, 512, 16>;\n"
                     "template struct ua::PageCopy<256, 4, 1024, 16, 0, 1>;\n",
    "merge_state.cuh": "template struct ua::MergeState<half, 7, 16, 96, 4, 8, 256, true>;\n"
                       "template struct ua::MergeState<ua::bf16, 2, 32, 128, 4, 32, 256, false>;\n",
    "reshape_and_cache.cuh": RC_CONFIGS,
    "paged_attention.cuh": PA_CONFIGS,
    "layer_ops.cuh": """
__global__ void layer_ops_kernel(float* out, const half* in) {
  __shared__ float sums[32];
  half a, b;
  ua::rope_pair<half>(in[0], in[1], 0.5, 0.25, a, b);
  ua::pdl_wait<true>();
  ua::pdl_launch_dependents<true>();
  const ua::Vec<half, 2> v = ua::shfl_vec<16>(ua::Vec<half, 2>{{a, b}}, 3);
  const ua::Vec<half, 1> w = ua::shfl_vec<8>(ua::Vec<half, 1>{{b}}, 1);  // element by element
  out[threadIdx.x] = ua::block_sum<128>(ua::silu(__half2float(v.v[0]) + __half2float(b)), sums) + __half2float(w.v[0]);
}
int launch_layer_ops(float* out, const half* in, cudaStream_t s) {
  return ua::launch_pdl(true, layer_ops_kernel, dim3(1), dim3(128), s, out, in);
}
""",
    "qkv_rope_cache.cuh": """
__device__ const double QRC_FREQ[64] = {};
#define QRC_CONFIG(NAME, IN, CACHE, HQ_, HKV_, D_, VEC_, GROUP_, ROWS_, NORM_, INTER_, QUANT_)        \
  struct NAME {                                                                                     \
    typedef IN in_t;                                                                                \
    typedef CACHE cache_t;                                                                          \
    static constexpr int HQ = HQ_, HKV = HKV_, D = D_, VEC = VEC_, GROUP = GROUP_, ROWS = ROWS_;    \
    static constexpr bool QK_NORM = NORM_, INTERLEAVED = INTER_, QUANT = QUANT_, PDL = true;        \
    static constexpr float EPS = 1e-6f;                                                             \
    static __device__ __forceinline__ const double* inv_freq() { return QRC_FREQ; }                 \
  };
QRC_CONFIG(QrcBf16, ua::bf16, ua::bf16, 32, 8, 128, 8, 16, 8, true, false, false)
QRC_CONFIG(QrcFp8, ua::bf16, uint8_t, 32, 8, 128, 8, 16, 8, true, false, true)
QRC_CONFIG(QrcInt8Gptj, half, int8_t, 4, 2, 64, 8, 8, 16, false, true, true)
QRC_CONFIG(QrcFp32, float, float, 6, 3, 6, 1, 8, 4, true, false, false)
template <class C>
__global__ void qrc_kernel(const typename C::in_t* qkv, const typename C::in_t* qn, const typename C::in_t* kn,
                           const int64_t* pos, const int64_t* slots, typename C::in_t* q, typename C::cache_t* kc,
                           typename C::cache_t* vc, float* ks, float* vs) {
  ua::qrc::QKVRopeCache<C>::kernel(qkv, qn, kn, pos, slots, q, kc, vc, ks, vs);
}
template __global__ void qrc_kernel<QrcBf16>(const ua::bf16*, const ua::bf16*, const ua::bf16*, const int64_t*,
                                             const int64_t*, ua::bf16*, ua::bf16*, ua::bf16*, float*, float*);
template __global__ void qrc_kernel<QrcFp8>(const ua::bf16*, const ua::bf16*, const ua::bf16*, const int64_t*,
                                            const int64_t*, ua::bf16*, uint8_t*, uint8_t*, float*, float*);
template __global__ void qrc_kernel<QrcInt8Gptj>(const half*, const half*, const half*, const int64_t*, const int64_t*,
                                                 half*, int8_t*, int8_t*, float*, float*);
template __global__ void qrc_kernel<QrcFp32>(const float*, const float*, const float*, const int64_t*, const int64_t*,
                                             float*, float*, float*, float*, float*);
""",
    "ptx.cuh": """
__global__ void ptx_kernel(float* out, const uint4* in) {
  __shared__ __align__(16) char tile[16 * 16 * 2];
  ua::cp_async16(tile + threadIdx.x * 16, in + threadIdx.x, threadIdx.x < 32);
  ua::cp_async_commit();
  ua::cp_async_wait<0>();
  __syncthreads();
  uint32_t a[4], b[4];
  ua::ldmatrix_x4(a, tile + (threadIdx.x % 16) * 32);
  ua::ldmatrix_x4_trans(b, tile + (threadIdx.x % 16) * 32);
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  ua::mma16816<true>(c, a, b[0], b[1]);
  ua::mma16816<false>(c, a, b[2], ua::pack2<false>(c[0], c[1]));
  out[threadIdx.x] = c[0] + c[1] + c[2] + c[3] + (float)ua::pack2<true>(c[2], c[3]);
}
""",
    "quant_matmul.cuh": """
template <ua::qm::Fmt F, class T, int MT, int NT, int W, int S>
__global__ void qm_kernel(const T* x, const uint8_t* w, T* out, int64_t n) {
  extern __shared__ __align__(16) uint8_t smem[];
  ua::qm::QuantMatmul<F, T, MT, NT, W, S>::template kernel<false>(x, w, out, n, 4096, 4096, smem);
}
template <ua::qm::Fmt F, class T, int NT, int W, int S, int P, int64_t RB>
__global__ void qm_gemv(const T* x, const uint8_t* w, T* out, int64_t n) {
  extern __shared__ __align__(16) uint8_t smem[];
  ua::qm::QuantGemv<F, T, NT, W, S, P>::template kernel<RB, true>(x, w, out, n, 4096, 4096, smem);  // RB: K = 4096
}
template <ua::qm::Fmt F, class T>
__global__ void qm_simple(const T* x, const uint8_t* w, T* out, int64_t n) {
  ua::qm::quant_matmul_simple<F, T>(x, w, out, n, 4096, 576);
}
template <ua::qm::Fmt F, class T>
__global__ void qm_dequantize(const uint8_t* w, T* out, int64_t n) { ua::qm::dequantize<F, T>(w, out, n, 4096); }
template __global__ void qm_kernel<ua::qm::Fmt::Q8_0, ua::bf16, 1, 1, 4, 2>(const ua::bf16*, const uint8_t*, ua::bf16*, int64_t);
template __global__ void qm_kernel<ua::qm::Fmt::Q4_0, half, 2, 2, 8, 2>(const half*, const uint8_t*, half*, int64_t);
template __global__ void qm_kernel<ua::qm::Fmt::Q4_1, ua::bf16, 2, 4, 4, 3>(const ua::bf16*, const uint8_t*, ua::bf16*, int64_t);
template __global__ void qm_kernel<ua::qm::Fmt::Q4_K, half, 1, 8, 4, 2>(const half*, const uint8_t*, half*, int64_t);
template __global__ void qm_kernel<ua::qm::Fmt::Q5_K, ua::bf16, 1, 1, 1, 4>(const ua::bf16*, const uint8_t*, ua::bf16*, int64_t);
template __global__ void qm_kernel<ua::qm::Fmt::Q6_K, half, 2, 2, 2, 2>(const half*, const uint8_t*, half*, int64_t);
template __global__ void qm_gemv<ua::qm::Fmt::Q8_0, ua::bf16, 1, 8, 3, 1, 4352>(const ua::bf16*, const uint8_t*, ua::bf16*, int64_t);
template __global__ void qm_gemv<ua::qm::Fmt::Q4_K, half, 2, 4, 2, 2, 2304>(const half*, const uint8_t*, half*, int64_t);
template __global__ void qm_gemv<ua::qm::Fmt::Q6_K, ua::bf16, 8, 8, 2, 1, 3360>(const ua::bf16*, const uint8_t*, ua::bf16*, int64_t);
template __global__ void qm_simple<ua::qm::Fmt::Q8_0, float>(const float*, const uint8_t*, float*, int64_t);
template __global__ void qm_simple<ua::qm::Fmt::Q6_K, float>(const float*, const uint8_t*, float*, int64_t);
template __global__ void qm_dequantize<ua::qm::Fmt::Q4_1, float>(const uint8_t*, float*, int64_t);
template __global__ void qm_dequantize<ua::qm::Fmt::Q5_K, half>(const uint8_t*, half*, int64_t);
""",
    "quantize_rows.cuh": """
template __global__ void ua::quantize_rows_kernel<ua::bf16, uint8_t, 4096, 8, 128>(const ua::bf16*, uint8_t*, float*);
template __global__ void ua::quantize_rows_kernel<half, int8_t, 27, 1, 32>(const half*, int8_t*, float*);
template __global__ void ua::quantize_rows_kernel<float, uint8_t, 12288, 4, 768>(const float*, uint8_t*, float*);
""",
    "kv_evict.cuh": "template struct ua::KVScore<ua::bf16, ua::bf16, 128, 16, 8, 4, ua::SCORE_ANDPRO, 128>;\n"
                    "template struct ua::KVScore<half, float, 80, 4, 2, 3, ua::SCORE_VALUE_NORM, 64>;\n"
                    "template __device__ void ua::gather_tokens<uint8_t, 128, 16, 8, true>(uint8_t*, float*, "
                    "const int64_t*, const int64_t*, int64_t, int64_t, int64_t);\n",
    "hopper.cuh": """
__global__ void hopper_kernel(float* out) {
#if __CUDA_ARCH__ >= 900
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) ua::mbar_init(b, 1);
  ua::named_sync(1, 128);
  if (threadIdx.x == 0) ua::mbar_arrive(b);
  ua::mbar_wait(b, 0);
  float acc[2][4] = {};
  ua::wg_arrive();
  ua::fence_acc(acc);
  ua::wg_commit();
  ua::wg_wait<0>();
  out[threadIdx.x] = acc[0][0] + (float)ua::kmajor_desc<64>(ua::smem_desc(b, 16), 1);
#endif
}
""",
}


def test_every_header_is_listed():
    from uacompile.targets.cuda.build import INCLUDE_DIR

    assert sorted(p.name for p in (INCLUDE_DIR / "uacompile").glob("*.cuh")) == sorted(HEADERS)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("header", list(HEADERS))
def test_header_compiles_on_its_own(header, arch, tmp_path):
    from uacompile.nvcc import nvcc_path
    from uacompile.targets.cuda.build import INCLUDE_DIR

    cu = tmp_path / "one.cu"
    cu.write_text(f'#include "uacompile/{header}"\n{HEADERS[header]}')
    num = arch[3:]
    res = subprocess.run([nvcc_path(), "-std=c++17", f"-I{INCLUDE_DIR}", f"-gencode=arch=compute_{num},code=sm_{num}",
                          "-c", "-o", str(tmp_path / "one.o"), str(cu)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def test_headers_are_part_of_the_build_key():
    """A header's contents are in every build's key (headers_digest), its install path is not."""
    from uacompile.targets.cuda import build

    digest = build.headers_digest()
    assert len(digest) == 64 and digest == build.headers_digest()
    assert any(f.startswith("-I") for f in build.nvcc_flags("sm_80", ""))
