// uacompile CUDA common header: dtypes, vectors, fp8/int8 quantisation, group reductions.
// Included by every kernel header and template; the guard lets several ops share one translation unit.
#ifndef UA_COMMON_CUH
#define UA_COMMON_CUH
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <math.h>

namespace ua {

typedef __nv_bfloat16 bf16;  // IR dtype "bf16" (the C type names of ir.DTYPES)

// A vector of N elements loaded / stored as one access (N * sizeof(T) <= 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& x) {
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

// Raw bytes moved by copy kernels: the widest access that divides the unit being copied.
template <int BYTES> struct RawBytes;
template <> struct RawBytes<16> { typedef uint4 type; };
template <> struct RawBytes<8> { typedef uint2 type; };
template <> struct RawBytes<4> { typedef uint32_t type; };
template <> struct RawBytes<2> { typedef uint16_t type; };
template <> struct RawBytes<1> { typedef uint8_t type; };

// ---------------------------------------------------------------- float conversions
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(int8_t x) { return (float)x; }
// fp8 e4m3 is stored as raw bytes (uint8_t)
__device__ __forceinline__ float to_float(uint8_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)x, __NV_E4M3)));
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// float64 -> storage dtype, rounded as the numpy reference rounds (numpy: float64 -> float16
// directly; ml_dtypes: float64 -> float32 -> bfloat16).
template <typename T> __device__ __forceinline__ T round_double(double x);
template <> __device__ __forceinline__ float round_double<float>(double x) { return __double2float_rn(x); }
template <> __device__ __forceinline__ half round_double<half>(double x) { return __double2half(x); }
template <> __device__ __forceinline__ bf16 round_double<bf16>(double x) {
  return __float2bfloat16_rn(__double2float_rn(x));
}

// ---------------------------------------------------------------- KV quantisation
// Matches reference.quantize bit for bit: float32 scale = amax / QMAX, y = x / scale (IEEE
// division), int8 = clamp(rint(y)), fp8 = e4m3fn(clip(y)) nearest-even, saturating.
template <typename Q> struct Quant;
template <> struct Quant<int8_t> {
  static constexpr float QMAX = 127.0f;
  __device__ static __forceinline__ int8_t quantize(float y) {
    return (int8_t)max(-127, min(127, __float2int_rn(y)));
  }
};
template <> struct Quant<uint8_t> {
  static constexpr float QMAX = 448.0f;
  __device__ static __forceinline__ uint8_t quantize(float y) {
    return (uint8_t)__nv_cvt_float_to_fp8(fminf(fmaxf(y, -448.0f), 448.0f), __NV_SATFINITE, __NV_E4M3);
  }
};
template <typename Q>
__device__ __forceinline__ float quant_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, Quant<Q>::QMAX) : 1.0f;
}

// x / s rounded exactly as IEEE division, cheaper when one s divides many x: the correctly
// rounded reciprocal once, then per x one product and one FMA correction (Markstein's
// theorem; checked bit for bit against x / s on 8e7 float pairs, every divisor mantissa).
// Valid while s is normal and far from overflow; otherwise the plain division.
__device__ __forceinline__ float div_rn(float x, float s, float rcp_s /* __frcp_rn(s) */) {
  if (!(s >= 0x1p-100f && s <= 0x1p100f)) return __fdiv_rn(x, s);
  const float q0 = __fmul_rn(x, rcp_s);
  return copysignf(__fmaf_rn(__fmaf_rn(-q0, s, x), rcp_s, q0), x);  // copysign keeps -0 / s = -0
}

// ---------------------------------------------------------------- reductions within a lane group
template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o, WIDTH));
  return x;
}
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o, WIDTH);
  return x;
}

// Copy the chunk-th slice (THREADS * UNROLL vectors) of a VECS-vector unit: all loads
// first, then all stores, so UNROLL accesses per thread are in flight.
template <typename V, int THREADS, int UNROLL, int64_t VECS>
__device__ __forceinline__ void copy_chunk(const V* __restrict__ from, V* __restrict__ to, int64_t chunk) {
  const int64_t base = chunk * THREADS * UNROLL + threadIdx.x;
  V tmp[UNROLL];
#pragma unroll
  for (int i = 0; i < UNROLL; ++i)
    if (base + i * THREADS < VECS) tmp[i] = from[base + i * THREADS];
#pragma unroll
  for (int i = 0; i < UNROLL; ++i)
    if (base + i * THREADS < VECS) to[base + i * THREADS] = tmp[i];
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether a launch on stream may carry the programmatic-stream-serialization attribute (PDL). Outside a stream
// capture always. Inside one the launch becomes a graph node with a programmatic edge to each node it depends on,
// and such an edge is defined between kernel nodes only: after a memset, a copy or an event wait (cuBLAS's split-K
// zeroing, a host-to-device copy, a fork-join) a programmatic launch invalidates the capture. There it launches
// plainly; griddepcontrol.wait in the kernel is then a no-op, the full dependency orders it.
inline bool pdl_allowed(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &num_deps) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaStreamCaptureStatusActive) return status == cudaStreamCaptureStatusNone;
  for (size_t i = 0; i < num_deps; ++i) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(deps[i], &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) return false;
  }
  return true;
}

}  // namespace ua
#endif  // UA_COMMON_CUH
