// Block quantization on the GPU (kernels/quant.h): one thread block per
// quantization block (grid-striding over blocks) for quantize, whose
// max|x| is a bitwise max (order-free, so the scale is the CPU's bit for
// bit); one thread per code byte for dequantize. Codes and scales come
// from the shared formulas of kernels/quant.h.
#include "kernels/cuda/common.cuh"
#include "kernels/quant.h"

namespace zs::kernels::cuda {
namespace {

using detail::kInvalid;
using detail::kThreads;

template <WorkDtype T>
__device__ __forceinline__ float load(const void* p, size_t i) {
  float a[1];
  detail::ld_work<T, 1>(p, i, a);
  return a[0];
}

template <WorkDtype T>
__device__ __forceinline__ void store(void* p, size_t i, float x) {
  const float a[1] = {x};
  detail::st_work<T, 1>(p, i, a);
}

template <WorkDtype T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const void* src, size_t n, size_t block, int bits, uint8_t* codes,
                    float* scales, size_t nblocks) {
  __shared__ uint32_t maxbits;
  const int qmax = quant_qmax(bits);
  for (size_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const size_t first = b * block;
    const size_t len = n - first < block ? n - first : block;
    if (threadIdx.x == 0) maxbits = 0;
    __syncthreads();
    uint32_t m = 0;
    for (size_t j = threadIdx.x; j < len; j += kThreads) {
      const uint32_t a = abs_bits(load<T>(src, first + j));
      m = a > m ? a : m;
    }
    atomicMax(&maxbits, m);
    __syncthreads();
    const uint32_t mb = maxbits;
    const float scale = quant_scale(bits_float(mb), is_finite_bits(mb), qmax);
    if (threadIdx.x == 0) scales[b] = scale;
    if (bits == 8) {
      auto* out = reinterpret_cast<int8_t*>(codes) + first;
      for (size_t j = threadIdx.x; j < block; j += kThreads)
        out[j] = static_cast<int8_t>(j < len ? quant_code(load<T>(src, first + j), scale, qmax) : 0);
    } else {
      uint8_t* out = codes + first / 2;
      for (size_t k = threadIdx.x; k < block / 2; k += kThreads) {
        const size_t j = 2 * k;
        const int lo = j < len ? quant_code(load<T>(src, first + j), scale, qmax) : 0;
        const int hi = j + 1 < len ? quant_code(load<T>(src, first + j + 1), scale, qmax) : 0;
        out[k] = static_cast<uint8_t>(nibble_of(lo) | (nibble_of(hi) << 4));
      }
    }
    __syncthreads();  // maxbits is reset for the next block
  }
}

template <WorkDtype T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* codes, const float* scales, size_t n, size_t block, int bits,
                      void* dst) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bits == 8) {
    const auto* in = reinterpret_cast<const int8_t*>(codes);
    for (size_t i = tid; i < n; i += stride) store<T>(dst, i, quant_value(in[i], scales[i / block]));
  } else {
    const size_t pairs = (n + 1) / 2;
    for (size_t k = tid; k < pairs; k += stride) {
      const uint8_t v = codes[k];
      const size_t i = 2 * k;
      const float scale = scales[i / block];  // block is even: a pair shares it
      store<T>(dst, i, quant_value(code_of_nibble(v), scale));
      if (i + 1 < n) store<T>(dst, i + 1, quant_value(code_of_nibble(static_cast<uint8_t>(v >> 4)), scale));
    }
  }
}

// LoCo (kernels/quant.h quantize_with_error): quantize_kernel on x = g + e,
// then e updated per element; one thread owns an element pair end to end,
// so no element's error is read after another thread wrote it.
__global__ void __launch_bounds__(kThreads)
    quantize_with_error_kernel(const float* g, float* err, float beta, size_t n, size_t block,
                               int bits, uint8_t* codes, float* scales, size_t nblocks) {
  __shared__ uint32_t maxbits;
  const int qmax = quant_qmax(bits);
  const float keep = f_sub(1.0f, beta);
  for (size_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const size_t first = b * block;
    const size_t len = n - first < block ? n - first : block;
    if (threadIdx.x == 0) maxbits = 0;
    __syncthreads();
    uint32_t m = 0;
    for (size_t j = threadIdx.x; j < len; j += kThreads) {
      const uint32_t a = abs_bits(f_add(g[first + j], err[first + j]));
      m = a > m ? a : m;
    }
    atomicMax(&maxbits, m);
    __syncthreads();
    const uint32_t mb = maxbits;
    const bool finite = is_finite_bits(mb);
    const float scale = quant_scale(bits_float(mb), finite, qmax);
    if (threadIdx.x == 0) scales[b] = scale;
    // The code of element j (0 for padding), updating its error.
    auto code = [&](size_t j) {
      if (j >= len) return 0;
      const float x = f_add(g[first + j], err[first + j]);
      const int q = quant_code(x, scale, qmax);
      err[first + j] = loco_error(err[first + j], x, quant_value(q, scale), beta, keep, finite);
      return q;
    };
    if (bits == 8) {
      auto* out = reinterpret_cast<int8_t*>(codes) + first;
      for (size_t j = threadIdx.x; j < block; j += kThreads) out[j] = static_cast<int8_t>(code(j));
    } else {
      uint8_t* out = codes + first / 2;
      for (size_t k = threadIdx.x; k < block / 2; k += kThreads) {
        const int lo = code(2 * k);
        const int hi = code(2 * k + 1);
        out[k] = static_cast<uint8_t>(nibble_of(lo) | (nibble_of(hi) << 4));
      }
    }
    __syncthreads();  // maxbits is reset for the next block
  }
}

}  // namespace

int quantize_with_error(const float* g, float* err, float beta, size_t n, int bits, size_t block,
                        uint8_t* codes, float* scales, void* stream) {
  const QuantSpec spec{bits, block};
  if (!quant_spec_valid(spec)) return kInvalid;
  if (n == 0) return 0;
  if (g == nullptr || err == nullptr || codes == nullptr || scales == nullptr) return kInvalid;
  const size_t nblocks = quant_blocks(n, spec);
  int sms = 0;
  const cudaError_t e = detail::sm_count(&sms);
  if (e != cudaSuccess) return detail::api_result(e);
  const size_t cap = static_cast<size_t>(sms) * detail::kBlocksPerSm;
  const unsigned grid = static_cast<unsigned>(nblocks < cap ? nblocks : cap);
  quantize_with_error_kernel<<<grid, kThreads, 0, detail::as_stream(stream)>>>(
      g, err, beta, n, block, bits, codes, scales, nblocks);
  return detail::launch_result();
}

int quantize(const void* src, WorkDtype t, size_t n, int bits, size_t block, uint8_t* codes,
             float* scales, void* stream) {
  const QuantSpec spec{bits, block};
  if (!quant_spec_valid(spec) || !detail::valid_dtype(t)) return kInvalid;
  if (n == 0) return 0;
  if (src == nullptr || codes == nullptr || scales == nullptr) return kInvalid;
  const size_t nblocks = quant_blocks(n, spec);
  int sms = 0;
  const cudaError_t e = detail::sm_count(&sms);
  if (e != cudaSuccess) return detail::api_result(e);
  const size_t cap = static_cast<size_t>(sms) * detail::kBlocksPerSm;
  const unsigned grid = static_cast<unsigned>(nblocks < cap ? nblocks : cap);
  return detail::with_dtype(t, [&](auto tag) {
    quantize_kernel<decltype(tag)::value><<<grid, kThreads, 0, detail::as_stream(stream)>>>(
        src, n, block, bits, codes, scales, nblocks);
    return detail::launch_result();
  });
}

int dequantize(const uint8_t* codes, const float* scales, size_t n, int bits, size_t block,
               void* dst, WorkDtype t, void* stream) {
  const QuantSpec spec{bits, block};
  if (!quant_spec_valid(spec) || !detail::valid_dtype(t)) return kInvalid;
  if (n == 0) return 0;
  if (dst == nullptr || codes == nullptr || scales == nullptr) return kInvalid;
  unsigned grid = 0;
  const cudaError_t e = detail::grid_for(bits == 8 ? n : (n + 1) / 2, &grid);
  if (e != cudaSuccess) return detail::api_result(e);
  return detail::with_dtype(t, [&](auto tag) {
    dequantize_kernel<decltype(tag)::value><<<grid, kThreads, 0, detail::as_stream(stream)>>>(
        codes, scales, n, block, bits, dst);
    return detail::launch_result();
  });
}

}  // namespace zs::kernels::cuda
