// The NCCL loader: where it looks, how it fails (a missing file, a library
// that is not NCCL) and, where the CUDA toolkit's NCCL is installed, that it
// loads and answers without a GPU. Each case runs in its own process (ctest),
// so setting the environment is safe; the cases that depend on the
// process-wide cache say so when they run after another load.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/expect_error.h"
#include "impl/comm/transport/nccl_library.h"
#include "impl/common/error.h"

namespace zs {
namespace {

namespace fs = std::filesystem;

constexpr const char* kToolkitNccl = "/usr/local/cuda/lib64/libnccl.so.2";

bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Sets (or with nullptr unsets) a variable for the scope of the object.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~EnvVar() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "zs_nccl_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

using zs::test::error_of;

void touch(const std::string& file) {
  fs::create_directories(fs::path(file).parent_path());
  std::ofstream(file) << "not a library";
}

size_t index_of(const std::vector<std::string>& v, const std::string& s) {
  return static_cast<size_t>(std::find(v.begin(), v.end(), s) - v.begin());
}

TEST(NcclLibrary, VersionCodes) {
  EXPECT_EQ(nccl::nccl_version_code(2, 14, 0), 21400);
  EXPECT_EQ(nccl::nccl_version_code(2, 8, 4), 2804);
  EXPECT_EQ(nccl_version_string(22809), "2.28.9");
  EXPECT_EQ(nccl_version_string(2804), "2.8.4");
  EXPECT_EQ(nccl_version_string(nccl::kMinVersion), "2.14.0");
  EXPECT_EQ(sizeof(nccl::ncclUniqueId), 128u);
  const nccl::ncclConfigV21400 c = nccl::nonblocking_config();
  EXPECT_EQ(c.size, sizeof(c));
  EXPECT_EQ(c.magic, 0xcafebeefu);
  EXPECT_EQ(c.version, 21400u);
  EXPECT_EQ(c.blocking, 0);
}

TEST(NcclLibrary, ExplicitPathIsTheOnlyCandidate) {
  EnvVar lib("ZS_NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
  EXPECT_EQ(nccl_detail::candidate_paths(), std::vector<std::string>{"/nonexistent/libnccl.so.2"});
}

TEST(NcclLibrary, MissingExplicitPathIsNotSupportedAndNamed) {
  EnvVar lib("ZS_NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
  const std::string msg = error_of(Code::NotSupported, [] { nccl_detail::load(); });
  EXPECT_NE(msg.find("ZS_NCCL_LIBRARY=/nonexistent/libnccl.so.2"), std::string::npos) << msg;
  // dlerror's own words are kept.
  EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
}

TEST(NcclLibrary, FailureIsCachedForTheProcess) {
  EnvVar lib("ZS_NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
  std::string first;
  try {
    nccl_library();
    GTEST_SKIP() << "NCCL was already loaded in this process (run this case on its own)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::NotSupported);
    first = e.what();
  }
  EXPECT_NE(first.find("/nonexistent/libnccl.so.2"), std::string::npos) << first;
  {
    // The environment no longer matters: the first answer stands.
    EnvVar other("ZS_NCCL_LIBRARY", "/also/missing/libnccl.so.2");
    EXPECT_EQ(error_of(Code::NotSupported, [] { nccl_library(); }), first);
  }
  std::string why;
  EXPECT_FALSE(nccl_available(&why));
  EXPECT_EQ(why, first);
  EXPECT_FALSE(nccl_available(nullptr));
}

TEST(NcclLibrary, LibraryThatIsNotNcclNamesTheMissingSymbol) {
  std::string libm;
  for (const char* p : {"/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                        "/lib64/libm.so.6", "/usr/lib64/libm.so.6",
                        "/lib/aarch64-linux-gnu/libm.so.6"})
    if (is_file(p)) {
      libm = p;
      break;
    }
  if (libm.empty()) GTEST_SKIP() << "no libm.so.6 at the usual places";
  EnvVar lib("ZS_NCCL_LIBRARY", libm.c_str());
  const std::string msg = error_of(Code::NotSupported, [] { nccl_detail::load(); });
  EXPECT_NE(msg.find(libm), std::string::npos) << msg;
  EXPECT_NE(msg.find("ncclGetVersion"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not NCCL"), std::string::npos) << msg;
}

TEST(NcclLibrary, FileThatIsNotALibraryIsRejected) {
  TempDir dir;
  const std::string fake = dir.path + "/libnccl.so.2";
  touch(fake);
  EnvVar lib("ZS_NCCL_LIBRARY", fake.c_str());
  const std::string msg = error_of(Code::NotSupported, [] { nccl_detail::load(); });
  EXPECT_NE(msg.find(fake), std::string::npos) << msg;
}

TEST(NcclLibrary, SearchOrderCoversWheelsAndTheToolkit) {
  TempDir venv, pypath;
  const std::string venv_lib =
      venv.path + "/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2";
  const std::string pypath_lib = pypath.path + "/nvidia/nccl/lib/libnccl.so.2";
  touch(venv_lib);
  touch(pypath_lib);
  EnvVar unset_lib("ZS_NCCL_LIBRARY", nullptr);
  EnvVar unset_conda("CONDA_PREFIX", nullptr);
  EnvVar v("VIRTUAL_ENV", venv.path.c_str());
  const std::string pp = "/nonexistent/dir::" + pypath.path;
  EnvVar p("PYTHONPATH", pp.c_str());

  std::vector<std::string> looked;
  const std::vector<std::string> paths = nccl_detail::candidate_paths(&looked);
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), "libnccl.so.2");
  const size_t i_venv = index_of(paths, venv_lib);
  const size_t i_pp = index_of(paths, pypath_lib);
  const size_t i_cuda64 = index_of(paths, "/usr/local/cuda/lib64/libnccl.so.2");
  const size_t i_cuda = index_of(paths, "/usr/local/cuda/lib/libnccl.so.2");
  ASSERT_LT(i_venv, paths.size());
  ASSERT_LT(i_pp, paths.size());
  ASSERT_LT(i_cuda64, paths.size());
  ASSERT_LT(i_cuda, paths.size());
  EXPECT_LT(i_venv, i_pp);
  EXPECT_LT(i_pp, i_cuda64);
  EXPECT_LT(i_cuda64, i_cuda);
  EXPECT_EQ(i_cuda, paths.size() - 1);
  EXPECT_LT(index_of(looked, venv.path + "/lib/python3.11/site-packages"), looked.size());
  EXPECT_LT(index_of(looked, pypath.path), looked.size());
  EXPECT_EQ(index_of(looked, "/nonexistent/dir"), looked.size());
}

TEST(NcclLibrary, LoadsTheToolkitNcclByPath) {
  if (!is_file(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is not installed";
  EnvVar lib("ZS_NCCL_LIBRARY", kToolkitNccl);
  const NcclLibrary nccl = nccl_detail::load();
  EXPECT_GE(nccl.version, nccl::kMinVersion) << nccl.version_string();
  EXPECT_TRUE(std::regex_match(nccl.version_string(), std::regex(R"(\d+\.\d+\.\d+)")))
      << nccl.version_string();
  EXPECT_EQ(fs::canonical(nccl.path), fs::canonical(kToolkitNccl)) << nccl.path;
  int v = 0;
  ASSERT_EQ(nccl.ncclGetVersion(&v), nccl::ncclSuccess);
  EXPECT_EQ(v, nccl.version);
  const char* s = nccl.ncclGetErrorString(nccl::ncclInvalidArgument);
  ASSERT_NE(s, nullptr);
  EXPECT_GT(std::strlen(s), 0u);
  const std::string d = nccl.describe(nccl::ncclInvalidArgument, nullptr);
  EXPECT_NE(d.find(s), std::string::npos) << d;
  EXPECT_NE(d.find("ncclInvalidArgument"), std::string::npos) << d;
  for (auto* fn : {reinterpret_cast<void*>(nccl.ncclGetUniqueId),
                   reinterpret_cast<void*>(nccl.ncclCommInitRankConfig),
                   reinterpret_cast<void*>(nccl.ncclCommFinalize),
                   reinterpret_cast<void*>(nccl.ncclCommAbort),
                   reinterpret_cast<void*>(nccl.ncclCommGetAsyncError),
                   reinterpret_cast<void*>(nccl.ncclAllGather),
                   reinterpret_cast<void*>(nccl.ncclReduceScatter),
                   reinterpret_cast<void*>(nccl.ncclGroupEnd)})
    EXPECT_NE(fn, nullptr);
}

TEST(NcclLibrary, DefaultSearchFindsAnNccl) {
  if (!is_file(kToolkitNccl)) GTEST_SKIP() << kToolkitNccl << " is not installed";
  EnvVar lib("ZS_NCCL_LIBRARY", nullptr);
  const std::vector<std::string> paths = nccl_detail::candidate_paths();
  EXPECT_LT(index_of(paths, kToolkitNccl), paths.size());
  const NcclLibrary fresh = nccl_detail::load();
  EXPECT_GE(fresh.version, nccl::kMinVersion);
  // Through the process-wide cache, as the backend sees it.
  std::string why;
  if (!nccl_available(&why) && why.find("/nonexistent/") != std::string::npos)
    GTEST_SKIP() << "the process-wide cache holds an earlier case's failure: " << why;
  ASSERT_TRUE(nccl_available(&why)) << why;
  const NcclLibrary& nccl = nccl_library();
  EXPECT_EQ(&nccl, &nccl_library());
  EXPECT_GE(nccl.version, nccl::kMinVersion);
  EXPECT_FALSE(nccl.path.empty());
  EXPECT_NE(nccl.ncclGetErrorString(nccl::ncclSystemError), nullptr);
}

}  // namespace
}  // namespace zs
