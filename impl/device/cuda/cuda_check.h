// CUDA runtime errors as zs::Error: OutOfMemory for allocation failures,
// Internal for the rest, with the runtime's own words and what we did.
#pragma once

#include <cuda_runtime_api.h>

#include "impl/common/error.h"

namespace zs {

template <typename... Parts>
void check_cuda(cudaError_t e, Parts&&... what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so later calls do not see it
  fail(e == cudaErrorMemoryAllocation ? Code::OutOfMemory : Code::Internal,
       std::forward<Parts>(what)..., ": CUDA error ", static_cast<int>(e), " (",
       cudaGetErrorName(e), "): ", cudaGetErrorString(e));
}

}  // namespace zs
