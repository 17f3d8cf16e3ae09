// Scalar conversions between fp32 and the 16-bit float formats, round to
// nearest even, NaN preserved: float_to_bf16, bf16_to_float, float_to_fp16,
// fp16_to_float, and the bit casts float_bits / bits_float.
//
// They live in kernels/elementwise.h, shared with the CUDA kernels
// (__host__ __device__ under nvcc); this header is kept for the code that
// only wants the conversions.
#pragma once

#include "kernels/elementwise.h"
