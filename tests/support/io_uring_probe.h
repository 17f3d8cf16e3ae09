// Whether this machine lets a process make an io_uring (a kernel built
// without it, io_uring_disabled=2, or a container's seccomp filter say no):
// tests of the NVMe swapper skip, saying so, where it does not.
#pragma once

#include <liburing.h>

namespace zs::test {

inline bool io_uring_available() {
  static const bool ok = [] {
    io_uring ring{};
    if (io_uring_queue_init(1, &ring, 0) < 0) return false;
    io_uring_queue_exit(&ring);
    return true;
  }();
  return ok;
}

}  // namespace zs::test

#define ZS_SKIP_WITHOUT_IO_URING()                                                     \
  do {                                                                                 \
    if (!zs::test::io_uring_available()) GTEST_SKIP() << "io_uring is not available"; \
  } while (0)
