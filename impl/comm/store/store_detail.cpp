#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "impl/comm/store/store.h"

namespace zs::store_detail {

bool parse_int64(const std::string& s, int64_t* out) {
  // strtoll alone would also take leading blanks and '+'.
  if (s.empty() || s.size() > 20) return false;
  if (s[0] != '-' && !std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

}  // namespace zs::store_detail
