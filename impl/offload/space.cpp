#include "impl/offload/space.h"

#include <sys/statvfs.h>

#include <cerrno>
#include <cstring>

#include "impl/common/error.h"

namespace zs {

uint64_t free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0) {
    const int err = errno;
    fail(Code::Io, "cannot ask the free space of '", dir, "': ", std::strerror(err), " (errno ", err, ")");
  }
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

void check_free_space(const std::string& dir, uint64_t needed, const std::string& what) {
  const uint64_t free = free_bytes(dir);
  if (needed > free)
    fail(Code::Io, what, " '", dir, "': needs ", needed, " bytes, ", free, " bytes free");
}

}  // namespace zs
