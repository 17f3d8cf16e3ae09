#include "impl/comm/transport/nccl_library.h"

#include <dlfcn.h>
#include <glob.h>
#include <sys/stat.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <type_traits>

#include "impl/common/error.h"

namespace zs {
namespace {

const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Appends the folders matching pattern (sorted, as glob returns them).
void add_glob(const std::string& pattern, std::vector<std::string>* out) {
  glob_t g{};
  if (::glob(pattern.c_str(), GLOB_ONLYDIR, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out->push_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
}

void add_unique(const std::string& s, std::vector<std::string>* out) {
  for (const auto& e : *out)
    if (e == s) return;
  out->push_back(s);
}

std::string last_dlerror() {
  const char* e = ::dlerror();
  return e != nullptr ? e : "unknown dlerror";
}

const char* result_name(nccl::ncclResult_t r) {
  switch (r) {
    case nccl::ncclSuccess: return "ncclSuccess";
    case nccl::ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case nccl::ncclSystemError: return "ncclSystemError";
    case nccl::ncclInternalError: return "ncclInternalError";
    case nccl::ncclInvalidArgument: return "ncclInvalidArgument";
    case nccl::ncclInvalidUsage: return "ncclInvalidUsage";
    case nccl::ncclRemoteError: return "ncclRemoteError";
    case nccl::ncclInProgress: return "ncclInProgress";
  }
  return "ncclResult";
}

// Loads path and checks it is a usable NCCL; on failure unloads it and
// says why in *why.
bool try_load(const std::string& path, NcclLibrary* lib, std::string* why) {
  ::dlerror();
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    // dlerror starts with the path, which the caller already names.
    *why = last_dlerror();
    if (why->compare(0, path.size() + 2, path + ": ") == 0) why->erase(0, path.size() + 2);
    return false;
  }
  NcclLibrary out;
  out.handle = handle;
  out.path = path;
  std::string missing;
  auto sym = [&](const char* name, auto* fn, bool required) {
    ::dlerror();
    void* p = ::dlsym(handle, name);
    if (p == nullptr) {
      if (required && missing.empty())
        missing = std::string("symbol ") + name + " is missing (" + last_dlerror() + ")";
      return;
    }
    // POSIX guarantees that a dlsym result converts to a function pointer.
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
  };
  auto reject = [&](const std::string& reason) {
    *why = reason;
    ::dlclose(handle);
    return false;
  };

  // The version first, so that an old NCCL is named as old rather than as
  // missing a newer entry point.
  sym("ncclGetVersion", &out.ncclGetVersion, true);
  if (!missing.empty()) return reject("loaded, but it is not NCCL: " + missing);
  int version = 0;
  const nccl::ncclResult_t vr = out.ncclGetVersion(&version);
  if (vr != nccl::ncclSuccess)
    return reject("loaded, but ncclGetVersion failed with " + std::to_string(vr));
  out.version = version;
  if (version < nccl::kMinVersion)
    return reject("NCCL " + nccl_version_string(version) + " is too old: zeroshard needs " +
                  nccl_version_string(nccl::kMinVersion) +
                  " or newer (non-blocking ncclCommInitRankConfig and ncclCommFinalize)");

  sym("ncclGetUniqueId", &out.ncclGetUniqueId, true);
  sym("ncclCommInitRankConfig", &out.ncclCommInitRankConfig, true);
  sym("ncclCommInitRank", &out.ncclCommInitRank, true);
  sym("ncclCommFinalize", &out.ncclCommFinalize, true);
  sym("ncclCommDestroy", &out.ncclCommDestroy, true);
  sym("ncclCommAbort", &out.ncclCommAbort, true);
  sym("ncclCommGetAsyncError", &out.ncclCommGetAsyncError, true);
  sym("ncclGetErrorString", &out.ncclGetErrorString, true);
  sym("ncclGetLastError", &out.ncclGetLastError, false);
  sym("ncclAllGather", &out.ncclAllGather, true);
  sym("ncclReduceScatter", &out.ncclReduceScatter, true);
  sym("ncclAllReduce", &out.ncclAllReduce, true);
  sym("ncclBroadcast", &out.ncclBroadcast, true);
  sym("ncclSend", &out.ncclSend, true);
  sym("ncclRecv", &out.ncclRecv, true);
  sym("ncclGroupStart", &out.ncclGroupStart, true);
  sym("ncclGroupEnd", &out.ncclGroupEnd, true);
  if (!missing.empty())
    return reject("loaded NCCL " + nccl_version_string(version) + ", but " + missing);

  // Report the file the loader actually picked (a bare soname otherwise).
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(out.ncclGetVersion), &info) != 0 &&
      info.dli_fname != nullptr && info.dli_fname[0] != '\0')
    out.path = info.dli_fname;
  *lib = out;
  return true;
}

struct Loaded {
  std::optional<NcclLibrary> lib;
  std::string error;
};

Loaded load_once() {
  Loaded r;
  try {
    r.lib = nccl_detail::load();
  } catch (const Error& e) {
    r.error = e.what();
  }
  return r;
}

}  // namespace

std::string nccl_version_string(int code) {
  int major, minor, patch;
  if (code >= 10000) {
    major = code / 10000;
    minor = (code % 10000) / 100;
  } else {
    major = code / 1000;
    minor = (code % 1000) / 100;
  }
  patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string NcclLibrary::version_string() const { return nccl_version_string(version); }

std::string NcclLibrary::describe(Result result, Comm comm) const {
  std::ostringstream os;
  const char* text = ncclGetErrorString != nullptr ? ncclGetErrorString(result) : nullptr;
  os << (text != nullptr ? text : "NCCL error") << " (" << result_name(result) << ", " << result
     << ")";
  if (ncclGetLastError != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') os << ": " << last;
  }
  return os.str();
}

namespace nccl_detail {

std::vector<std::string> candidate_paths(std::vector<std::string>* wheel_dirs) {
  if (const char* explicit_path = env_value("ZS_NCCL_LIBRARY")) return {explicit_path};

  std::vector<std::string> dirs;
  if (const char* venv = env_value("VIRTUAL_ENV"))
    add_glob(std::string(venv) + "/lib/python3*/site-packages", &dirs);
  if (const char* conda = env_value("CONDA_PREFIX"))
    add_glob(std::string(conda) + "/lib/python3*/site-packages", &dirs);
  add_glob("/usr/local/lib/python3*/dist-packages", &dirs);
  add_glob("/usr/local/lib/python3*/site-packages", &dirs);
  if (is_dir("/usr/lib/python3/dist-packages")) dirs.push_back("/usr/lib/python3/dist-packages");
  if (const char* home = env_value("HOME"))
    add_glob(std::string(home) + "/.local/lib/python3*/site-packages", &dirs);
  if (const char* pp = env_value("PYTHONPATH")) {
    std::string entry;
    std::istringstream in(pp);
    while (std::getline(in, entry, ':'))
      if (!entry.empty() && is_dir(entry)) dirs.push_back(entry);
  }

  std::vector<std::string> out{"libnccl.so.2"};
  std::vector<std::string> looked;
  for (const auto& d : dirs) {
    add_unique(d, &looked);
    const std::string f = d + "/nvidia/nccl/lib/libnccl.so.2";
    if (is_file(f)) add_unique(f, &out);
  }
  add_unique("/usr/local/cuda/lib64/libnccl.so.2", &out);
  add_unique("/usr/local/cuda/lib/libnccl.so.2", &out);
  if (wheel_dirs != nullptr) *wheel_dirs = looked;
  return out;
}

NcclLibrary load() {
  if (const char* explicit_path = env_value("ZS_NCCL_LIBRARY")) {
    NcclLibrary lib;
    std::string why;
    if (try_load(explicit_path, &lib, &why)) return lib;
    fail(Code::NotSupported, "NCCL could not be loaded from ZS_NCCL_LIBRARY=", explicit_path,
         ": ", why);
  }

  std::vector<std::string> wheel_dirs;
  const std::vector<std::string> paths = candidate_paths(&wheel_dirs);
  std::ostringstream tried;
  for (const auto& p : paths) {
    NcclLibrary lib;
    std::string why;
    if (try_load(p, &lib, &why)) return lib;
    if (tried.tellp() > 0) tried << "; ";
    tried << p << ": " << why;
  }
  std::ostringstream looked;
  for (const auto& d : wheel_dirs) looked << (looked.tellp() > 0 ? ", " : "") << d;
  fail(Code::NotSupported, "NCCL (libnccl.so.2, ", nccl_version_string(nccl::kMinVersion),
       " or newer) was not found; tried ", tried.str(),
       wheel_dirs.empty()
           ? std::string("; no Python site-packages folder was found to look for the "
                         "nvidia-nccl wheel")
           : "; site-packages searched for the nvidia-nccl wheel (nvidia/nccl/lib/libnccl.so.2): " +
                 looked.str(),
       ". Set ZS_NCCL_LIBRARY to the library's path, add its folder to LD_LIBRARY_PATH, "
       "or install NCCL (e.g. pip install nvidia-nccl-cu12)");
}

}  // namespace nccl_detail

const NcclLibrary& nccl_library() {
  // Initialised once, thread-safely; a failure is kept as its message.
  static const Loaded loaded = load_once();
  if (!loaded.lib) throw Error(Code::NotSupported, loaded.error);
  return *loaded.lib;
}

bool nccl_available(std::string* why) {
  try {
    nccl_library();
    return true;
  } catch (const Error& e) {
    if (why != nullptr) *why = e.what();
    return false;
  }
}

}  // namespace zs
