#include "impl/partition/seeded_init.h"

#include <cmath>
#include <vector>

#include "impl/common/reduce.h"

namespace zs {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 53 random bits, from a counter.
double unit(uint64_t seed, uint64_t counter) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ counter);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace

void fill_seeded(void* dst, DType dtype, uint64_t first, uint64_t count, SeededDist dist,
                 uint64_t seed, double a, double b) {
  constexpr double kTwoPi = 6.283185307179586;
  std::vector<float> values(count);
  for (uint64_t k = 0; k < count; ++k) {
    const uint64_t i = first + k;
    if (dist == SeededDist::Uniform) {
      values[k] = static_cast<float>(a + (b - a) * unit(seed, i));
    } else {  // Box-Muller on two independent counters per element
      const double u1 = 1.0 - unit(seed, 2 * i);  // (0, 1]: log is finite
      const double u2 = unit(seed, 2 * i + 1);
      values[k] = static_cast<float>(a + b * std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
    }
  }
  narrow_from_f32(values.data(), dtype, dst, count);
}

}  // namespace zs
