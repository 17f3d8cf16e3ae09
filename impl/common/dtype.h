// Element types as the engine sees them; numerically equal to zs_dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include "impl/common/error.h"

namespace zs {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, U8 = 3 };
enum class ReduceOp : int { Sum = 0, Avg = 1, Max = 2, Min = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16:
    case DType::F16: return 2;
    case DType::U8: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::U8: return "uint8";
  }
  return "unknown";
}

// Checks a dtype value that crossed the C ABI.
inline DType checked_dtype(int value, bool param_dtype) {
  if (value < 0 || value > 3 || (param_dtype && value == 3))
    fail(Code::InvalidArgument, "dtype ", value, ": expected ",
         param_dtype ? "ZS_FLOAT32 (0), ZS_BFLOAT16 (1) or ZS_FLOAT16 (2)"
                     : "ZS_FLOAT32 (0), ZS_BFLOAT16 (1), ZS_FLOAT16 (2) or ZS_UINT8 (3)");
  return static_cast<DType>(value);
}

inline ReduceOp checked_reduce_op(int value) {
  if (value < 0 || value > 3)
    fail(Code::InvalidArgument, "reduce op ", value,
         ": expected ZS_SUM (0), ZS_AVG (1), ZS_MAX (2) or ZS_MIN (3)");
  return static_cast<ReduceOp>(value);
}

}  // namespace zs
