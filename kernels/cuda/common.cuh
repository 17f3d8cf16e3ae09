// What the CUDA kernels of this folder share: launch configuration, the
// element-wise kernel driver, and vector loads and stores. Internal to
// kernels/cuda/ (nvcc only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/kernels.h"
#include "kernels/elementwise.h"

namespace zs::kernels::cuda::detail {

// Threads per block of every kernel here. With kBlocksPerSm blocks per SM
// the grid fills an sm_80/sm_90 SM (2048 resident threads) once, and the
// kernels grid-stride beyond that.
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

// Multiprocessors of the current device, queried once per device and cached
// (kernels/cuda/launch.cu).
cudaError_t sm_count(int* out);

// Blocks for `items` work items (one per thread): enough to cover them, at
// most kBlocksPerSm per SM, at least 1.
inline cudaError_t grid_for(size_t items, unsigned* blocks) {
  int sms = 0;
  const cudaError_t e = sm_count(&sms);
  if (e != cudaSuccess) return e;
  const size_t cap = static_cast<size_t>(sms) * kBlocksPerSm;
  size_t b = (items + kThreads - 1) / kThreads;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  *blocks = static_cast<unsigned>(b);
  return cudaSuccess;
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline bool aligned(const void* p, size_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// Bytes of one element of the working dtype, and the alignment a pointer of
// it needs for 4-element vector access.
inline size_t work_size(WorkDtype t) { return t == WorkDtype::F32 ? 4 : 2; }
inline size_t vec4_align(WorkDtype t) { return 4 * work_size(t); }

inline bool valid_dtype(WorkDtype t) {
  return t == WorkDtype::F32 || t == WorkDtype::BF16 || t == WorkDtype::F16;
}

// The error of the launch just made (cudaGetLastError also clears a
// non-sticky error so that it does not surface at the next call).
inline int launch_result() { return static_cast<int>(cudaGetLastError()); }

// A runtime call's error as a launcher's result. A failed call also sets the
// thread's last error; it is cleared here (as launch_result and check_cuda
// do), else the next launcher's launch_result would report it for a launch
// that succeeded.
inline int api_result(cudaError_t e) {
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

constexpr int kInvalid = static_cast<int>(cudaErrorInvalidValue);

// ---- vector loads and stores (V = 1 or 4 elements) -------------------------
// V = 4 needs 16-byte aligned float pointers and 8-byte aligned 16-bit
// pointers; the launchers check before choosing it.

template <int V>
__device__ __forceinline__ void ld(const float* p, float (&a)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    a[0] = t.x;
    a[1] = t.y;
    a[2] = t.z;
    a[3] = t.w;
  } else {
    static_assert(V == 1, "V is 1 or 4");
    a[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void st(float* p, const float (&a)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
  } else {
    static_assert(V == 1, "V is 1 or 4");
    *p = a[0];
  }
}

template <int V>
__device__ __forceinline__ void ld16(const uint16_t* p, uint16_t (&a)[V]) {
  if constexpr (V == 4) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);  // little-endian: p[0] is t.x's low half
    a[0] = static_cast<uint16_t>(t.x & 0xffffu);
    a[1] = static_cast<uint16_t>(t.x >> 16);
    a[2] = static_cast<uint16_t>(t.y & 0xffffu);
    a[3] = static_cast<uint16_t>(t.y >> 16);
  } else {
    static_assert(V == 1, "V is 1 or 4");
    a[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void st16(uint16_t* p, const uint16_t (&a)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(static_cast<uint32_t>(a[0]) | (static_cast<uint32_t>(a[1]) << 16),
                                              static_cast<uint32_t>(a[2]) | (static_cast<uint32_t>(a[3]) << 16));
  } else {
    static_assert(V == 1, "V is 1 or 4");
    *p = a[0];
  }
}

// Elements i .. i+V-1 of a working-dtype buffer, through the shared
// conversions of kernels/elementwise.h.
template <WorkDtype T, int V>
__device__ __forceinline__ void ld_work(const void* w, size_t i, float (&a)[V]) {
  if constexpr (T == WorkDtype::F32) {
    ld<V>(static_cast<const float*>(w) + i, a);
  } else {
    uint16_t h[V];
    ld16<V>(static_cast<const uint16_t*>(w) + i, h);
#pragma unroll
    for (int k = 0; k < V; ++k)
      a[k] = T == WorkDtype::BF16 ? bf16_to_float(h[k]) : fp16_to_float(h[k]);
  }
}

template <WorkDtype T, int V>
__device__ __forceinline__ void st_work(void* w, size_t i, const float (&a)[V]) {
  if constexpr (T == WorkDtype::F32) {
    st<V>(static_cast<float*>(w) + i, a);
  } else {
    uint16_t h[V];
#pragma unroll
    for (int k = 0; k < V; ++k)
      h[k] = T == WorkDtype::BF16 ? float_to_bf16(a[k]) : float_to_fp16(a[k]);
    st16<V>(static_cast<uint16_t*>(w) + i, h);
  }
}

// ---- the element-wise driver -----------------------------------------------

// Op::run<W>(i) processes elements i .. i+W-1 (W = V or 1). The grid strides
// over n / V vectors, then over the n % V elements left.
template <int V, class Op>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const Op op, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nv = n / V;
  for (size_t j = tid; j < nv; j += stride) op.template run<V>(j * V);
  if constexpr (V > 1)
    for (size_t i = nv * V + tid; i < n; i += stride) op.template run<1>(i);
}

// Launches op over n elements, 4 at a time when `vec4` (every pointer of op
// aligned for it), else one at a time. The results do not depend on the
// choice: the operations are per element.
template <class Op>
int launch_elementwise(const Op& op, size_t n, bool vec4, void* stream) {
  unsigned blocks = 0;
  const cudaError_t e = grid_for(vec4 ? (n + 3) / 4 : n, &blocks);
  if (e != cudaSuccess) return api_result(e);
  if (vec4)
    elementwise_kernel<4, Op><<<blocks, kThreads, 0, as_stream(stream)>>>(op, n);
  else
    elementwise_kernel<1, Op><<<blocks, kThreads, 0, as_stream(stream)>>>(op, n);
  return launch_result();
}

// Calls f(std::integral_constant<WorkDtype, T>{}) for the runtime dtype t.
template <class F>
int with_dtype(WorkDtype t, F&& f) {
  switch (t) {
    case WorkDtype::F32: return f(std::integral_constant<WorkDtype, WorkDtype::F32>{});
    case WorkDtype::BF16: return f(std::integral_constant<WorkDtype, WorkDtype::BF16>{});
    case WorkDtype::F16: return f(std::integral_constant<WorkDtype, WorkDtype::F16>{});
  }
  return kInvalid;
}

}  // namespace zs::kernels::cuda::detail
