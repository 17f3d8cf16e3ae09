// The reductions of the gradient path on the GPU: sum of squares (in
// double, deterministic) and the all-finite check.
#include "kernels/cuda/common.cuh"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;
using detail::kThreads;

// ---- sum_squares -------------------------------------------------------------
//
// The decomposition depends only on n: G = min(kSumMaxBlocks,
// ceil(n / kSumPerBlock)) blocks of kThreads threads; thread t of the grid
// (T threads in all) adds, in order, the groups of 4 consecutive elements
// t, t + T, t + 2T, ..., element by element; the n % 4 elements of the
// last, partial group go to the thread whose turn that group would be. Each
// block sums its threads in a fixed tree (warp shuffles, then the warps in
// order); a second one-block pass sums the G block results the same way.
// Whether a group is read as one float4 (x 16-byte aligned) or as four
// floats changes nothing in the order, so the result depends on the values
// and n only.

constexpr size_t kSumPerBlock = 16384;  // up to this many elements: one block, one pass
constexpr unsigned kSumMaxBlocks = 1024;

// Sum over the block, in a fixed order; the result is valid in thread 0.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[kThreads / 32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = d_add(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = d_add(v, __shfl_down_sync(0xffffffffu, v, o));
  }
  return v;
}

// Writes the block's sum to out[blockIdx.x].
template <int V>
__global__ void __launch_bounds__(kThreads) sumsq_pass1(const float* x, size_t n, double* out) {
  const size_t threads = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t tid = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t groups = n / 4;
  double acc = 0.0;
  for (size_t gi = tid; gi < groups; gi += threads) {
    float a[4];
    if constexpr (V == 4) {
      detail::ld<4>(x + 4 * gi, a);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = x[4 * gi + k];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) acc = d_add(acc, d_square(a[k]));
  }
  if (tid == groups % threads)
    for (size_t i = 4 * groups; i < n; ++i) acc = d_add(acc, d_square(x[i]));
  const double s = block_sum(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// *out = the sum of part[0 .. count), one block.
__global__ void __launch_bounds__(kThreads) sumsq_pass2(const double* part, unsigned count,
                                                        double* out) {
  double acc = 0.0;
  for (unsigned i = threadIdx.x; i < count; i += kThreads) acc = d_add(acc, part[i]);
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

int launch_pass1(const float* x, size_t n, double* out, unsigned blocks, cudaStream_t s) {
  if (detail::aligned(x, 16))
    sumsq_pass1<4><<<blocks, kThreads, 0, s>>>(x, n, out);
  else
    sumsq_pass1<1><<<blocks, kThreads, 0, s>>>(x, n, out);
  return detail::launch_result();
}

// ---- all_finite ----------------------------------------------------------------

// Largest |bits| of the thread's elements; a block that saw an inf or NaN
// stores 0 to *out. `single` (a grid of one block): the block writes the
// answer, 1 or 0; else *out was set to 1 before (set_one).
template <int V>
__global__ void __launch_bounds__(kThreads) finite_scan(const float* x, size_t n, int* out,
                                                        bool single) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t tid = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  const size_t nv = n / V;
  uint32_t mx = 0;
  for (size_t j = tid; j < nv; j += stride) {
    float a[V];
    detail::ld<V>(x + j * V, a);
#pragma unroll
    for (int k = 0; k < V; ++k) mx = max(mx, abs_bits(a[k]));
  }
  for (size_t i = nv * V + tid; i < n; i += stride) mx = max(mx, abs_bits(x[i]));
  const int bad = __syncthreads_or(!is_finite_bits(mx));
  if (threadIdx.x == 0) {
    if (single)
      *out = bad ? 0 : 1;
    else if (bad)
      atomicExch(out, 0);  // every writer stores the same 0
  }
}

__global__ void set_one(int* out) { *out = 1; }

}  // namespace

int sum_squares(const float* x, size_t n, double* out, void* stream) {
  if (!out) return kInvalid;
  const cudaStream_t s = detail::as_stream(stream);
  if (n == 0) return detail::api_result(cudaMemsetAsync(out, 0, sizeof(double), s));  // +0.0
  if (!x) return kInvalid;
  size_t want = (n + kSumPerBlock - 1) / kSumPerBlock;
  const unsigned blocks = want > kSumMaxBlocks ? kSumMaxBlocks : static_cast<unsigned>(want);
  if (blocks == 1) return launch_pass1(x, n, out, 1, s);
  // One slot per block from the stream-ordered allocator, freed in stream
  // order after pass 2 (the pool recycles it; no device-wide sync).
  void* scratch = nullptr;
  bool pooled = true;
  cudaError_t e = cudaMallocAsync(&scratch, blocks * sizeof(double), s);
  if (e == cudaErrorNotSupported) {  // no memory pools here: the synchronous allocator
    cudaGetLastError();
    pooled = false;
    e = cudaMalloc(&scratch, blocks * sizeof(double));
  }
  if (e != cudaSuccess) return detail::api_result(e);
  auto* part = static_cast<double*>(scratch);
  int r = launch_pass1(x, n, part, blocks, s);
  if (r == 0) {
    sumsq_pass2<<<1, kThreads, 0, s>>>(part, blocks, out);
    r = detail::launch_result();
  }
  e = pooled ? cudaFreeAsync(scratch, s) : cudaFree(scratch);  // cudaFree waits for the kernels
  const int freed = detail::api_result(e);
  return r != 0 ? r : freed;
}

int all_finite(const float* x, size_t n, int* out, void* stream) {
  if (!out) return kInvalid;
  if (n > 0 && !x) return kInvalid;
  const cudaStream_t s = detail::as_stream(stream);
  const bool vec4 = detail::aligned(x, 16);
  unsigned blocks = 1;
  if (n > kSumPerBlock) {
    const cudaError_t e = detail::grid_for(vec4 ? (n + 3) / 4 : n, &blocks);
    if (e != cudaSuccess) return detail::api_result(e);
  }
  const bool single = blocks == 1;
  if (!single) {
    set_one<<<1, 1, 0, s>>>(out);
    const int r = detail::launch_result();
    if (r != 0) return r;
  }
  if (vec4)
    finite_scan<4><<<blocks, kThreads, 0, s>>>(x, n, out, single);
  else
    finite_scan<1><<<blocks, kThreads, 0, s>>>(x, n, out, single);
  return detail::launch_result();
}

}  // namespace zs::kernels::cuda
