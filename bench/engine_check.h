// What the engine benchmarks share: stop at the first failed call with the
// engine's own message, and the median of repeated timings.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "zeroshard/zeroshard.h"

#define CHECK(call)                                                                       \
  do {                                                                                    \
    zs_status s_ = (call);                                                                \
    if (s_ != ZS_OK) {                                                                    \
      std::fprintf(stderr, "%s: %s: %s\n", #call, zs_status_string(s_), zs_last_error()); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace zs::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace zs::bench
