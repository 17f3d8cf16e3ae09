// Free space under a directory, checked before a swap file grows, so that a
// disk too small is an error before training starts rather than ENOSPC in
// the middle of a step.
#pragma once

#include <cstdint>
#include <string>

namespace zs {

// Bytes an unprivileged writer may still use under dir (statvfs f_bavail).
// Throws Io naming dir and errno when it cannot be asked.
uint64_t free_bytes(const std::string& dir);

// Throws Io "<what> '<dir>': needs N bytes, M bytes free" when needed
// exceeds free_bytes(dir).
void check_free_space(const std::string& dir, uint64_t needed, const std::string& what);

}  // namespace zs
