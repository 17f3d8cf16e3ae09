#include "impl/device/dynamic_library.h"

#include <dlfcn.h>

#include <cstdlib>

namespace zs {

void* DynamicLibrary::symbol(const char* name) const { return handle ? ::dlsym(handle, name) : nullptr; }

DynamicLibrary open_first(const char* env_var, const std::vector<std::string>& names) {
  const char* env = std::getenv(env_var);
  const std::vector<std::string> tried = env != nullptr && *env != '\0' ? std::vector<std::string>{env} : names;
  DynamicLibrary lib;
  for (const auto& t : tried) {
    lib.handle = ::dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib.handle != nullptr) {
      lib.path = t;
      lib.tried.clear();
      return lib;
    }
    const char* e = ::dlerror();
    lib.tried += (lib.tried.empty() ? "" : "; ") + t + ": " + (e ? e : "not found");
  }
  return lib;
}

}  // namespace zs
