// A shared library loaded with dlopen on first use rather than linked, so
// that one build runs on machines without it and a process that never needs
// it never loads it: the host BLAS (blas.cpp) and cuBLAS (cuda/).
#pragma once

#include <string>
#include <vector>

namespace zs {

struct DynamicLibrary {
  void* handle = nullptr;  // null: none of the names loaded
  std::string path;        // the name that loaded
  std::string tried;       // each name tried, with dlopen's reason (when none loaded)

  void* symbol(const char* name) const;
  // *out = the function `name` (null if absent); whether it was there.
  template <typename F>
  bool bind(const char* name, F* out) const {
    *out = reinterpret_cast<F>(symbol(name));
    return *out != nullptr;
  }
};

// The library named by the environment variable env_var when it is set and
// not empty, else the first of `names` that dlopen loads (RTLD_LOCAL).
DynamicLibrary open_first(const char* env_var, const std::vector<std::string>& names);

}  // namespace zs
