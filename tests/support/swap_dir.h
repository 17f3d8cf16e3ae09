// What the NVMe offload tests need of a swap directory: the bytes of one
// rank's swap files of one kind, and a directory too small for them.
#pragma once

#include <sys/mount.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace zs::test {

// Bytes of rank's swap files of `kind` ("optimizer" or "params") in dir.
inline uint64_t swap_file_bytes(const std::string& dir, const std::string& kind, int rank) {
  const std::string prefix = "zeroshard-" + kind + "-rank" + std::to_string(rank) + "-";
  uint64_t bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind(prefix, 0) == 0) bytes += e.file_size();
  return bytes;
}

// The nvme_path a test's config JSON names (the first one).
inline std::string nvme_path_in(const std::string& config) {
  const std::string key = "nvme_path\": \"";
  const size_t at = config.find(key) + key.size();
  return config.substr(at, config.find('"', at) - at);
}

// Mounts a 1 MiB tmpfs on dir (needs root). On failure, removes dir and
// returns why, for the test's skip message; an empty string on success.
inline std::string mount_small_tmpfs(const std::string& dir) {
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") == 0) return "";
  const std::string why = "cannot mount a small tmpfs here (" + std::string(std::strerror(errno)) + ")";
  std::filesystem::remove_all(dir);
  return why;
}

}  // namespace zs::test
