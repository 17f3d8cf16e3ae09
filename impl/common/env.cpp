#include "impl/common/env.h"

#include <cerrno>
#include <cstdlib>

#include "impl/common/error.h"

namespace zs {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 1 << 24)
    fail(Code::Bootstrap, "environment variable ", name, "='", v,
         "': expected a non-negative integer");
  return static_cast<int>(x);
}

}  // namespace zs
