// Seeded initializers that need no communication: element i of a param
// depends only on (seed, i), so every rank fills its own shard and the
// gathered param is the same for any world size.
#pragma once

#include <cstdint>

#include "impl/common/dtype.h"

namespace zs {

enum class SeededDist { Normal, Uniform };

// Fill count elements for global indices [first, first + count) into dst.
// Normal: mean a, std b. Uniform: [a, b).
void fill_seeded(void* dst, DType dtype, uint64_t first, uint64_t count, SeededDist dist,
                 uint64_t seed, double a, double b);

}  // namespace zs
