// NCCL, loaded at run time with dlopen: one build of the engine runs on
// machines with and without NCCL, and nothing links libnccl. This header
// declares the few NCCL ABI types the engine passes through (so it needs no
// NCCL or CUDA header and is compiled in every build); their values equal
// nccl.h's, which impl/comm/transport/cuda/nccl_abi_check.cpp checks with
// static_assert wherever nccl.h is on the include path.
//
// Which library: ZS_NCCL_LIBRARY if set (that path only), else in order
//   1. "libnccl.so.2" through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache),
//   2. the nvidia-nccl Python wheel, <site-packages>/nvidia/nccl/lib/libnccl.so.2,
//      for the site-packages of $VIRTUAL_ENV, $CONDA_PREFIX,
//      /usr/local/lib/python3*/{dist,site}-packages, /usr/lib/python3/dist-packages,
//      ~/.local/lib/python3*/site-packages and every entry of $PYTHONPATH,
//   3. /usr/local/cuda/lib64/libnccl.so.2 and /usr/local/cuda/lib/libnccl.so.2.
// The first file that loads, has every symbol below and is new enough wins;
// a candidate that fails is unloaded and the search goes on.
//
// Minimum NCCL 2.14.0 (Nov 2022; PyTorch 2.0 shipped 2.14.3): it is the
// first release with ncclCommInitRankConfig, non-blocking communicators and
// ncclCommFinalize, which is how the NCCL backend bounds init and teardown
// with a timeout instead of hanging on a missing peer. (ncclAvg and bf16 need
// 2.10, ncclGetLastError 2.13.)
#pragma once

#include <climits>
#include <cstddef>
#include <string>
#include <vector>

namespace zs {
namespace nccl {

// --- ABI types, as in nccl.h ---------------------------------------------
struct ncclComm;  // opaque
using ncclComm_t = ncclComm*;
using cudaStream_t = void*;  // a CUstream_st*, passed through unchanged

constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};

// Enums in nccl.h; passed as int (same size and calling convention).
using ncclResult_t = int;
constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclUnhandledCudaError = 1;
constexpr ncclResult_t ncclSystemError = 2;
constexpr ncclResult_t ncclInternalError = 3;
constexpr ncclResult_t ncclInvalidArgument = 4;
constexpr ncclResult_t ncclInvalidUsage = 5;
constexpr ncclResult_t ncclRemoteError = 6;
constexpr ncclResult_t ncclInProgress = 7;

using ncclDataType_t = int;
constexpr ncclDataType_t ncclInt8 = 0;
constexpr ncclDataType_t ncclUint8 = 1;
constexpr ncclDataType_t ncclInt32 = 2;
constexpr ncclDataType_t ncclFloat16 = 6;
constexpr ncclDataType_t ncclFloat32 = 7;
constexpr ncclDataType_t ncclBfloat16 = 9;

using ncclRedOp_t = int;
constexpr ncclRedOp_t ncclSum = 0;
constexpr ncclRedOp_t ncclProd = 1;
constexpr ncclRedOp_t ncclMax = 2;
constexpr ncclRedOp_t ncclMin = 3;
constexpr ncclRedOp_t ncclAvg = 4;

// NCCL_VERSION(X, Y, Z) of nccl.h (the code ncclGetVersion reports).
constexpr int nccl_version_code(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch
                                    : major * 10000 + minor * 100 + patch;
}
constexpr int kMinVersion = nccl_version_code(2, 14, 0);

// ncclConfig_t as of NCCL 2.14 (the first version that has it). The struct is
// versioned: NCCL copies min(size, its own sizeof) bytes over its defaults
// and resets every field newer than `version`, so a 2.14-layout config is
// valid for every later NCCL. `cgaClusterSize` (added in 2.17) is declared
// only so that the struct has no padding: it is sent as "undefined" and,
// because version says 2.14, NCCL ignores it anyway.
constexpr unsigned int kConfigMagic = 0xcafebeef;
constexpr int kConfigUndefInt = INT_MIN;  // NCCL_CONFIG_UNDEF_INT
struct ncclConfigV21400 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
};

inline ncclConfigV21400 nonblocking_config() {
  ncclConfigV21400 c{};
  c.size = sizeof(ncclConfigV21400);
  c.magic = kConfigMagic;
  c.version = static_cast<unsigned int>(nccl_version_code(2, 14, 0));
  c.blocking = 0;
  c.cgaClusterSize = kConfigUndefInt;
  return c;
}

}  // namespace nccl

// The loaded library: NCCL's entry points (named as in nccl.h) and where
// they came from. Loaded once per process and never unloaded.
struct NcclLibrary {
  using Result = nccl::ncclResult_t;
  using Comm = nccl::ncclComm_t;
  using DataType = nccl::ncclDataType_t;
  using RedOp = nccl::ncclRedOp_t;
  using Stream = nccl::cudaStream_t;

  Result (*ncclGetVersion)(int* version) = nullptr;
  Result (*ncclGetUniqueId)(nccl::ncclUniqueId* id) = nullptr;
  Result (*ncclCommInitRankConfig)(Comm* comm, int nranks, nccl::ncclUniqueId id, int rank,
                                   nccl::ncclConfigV21400* config) = nullptr;
  Result (*ncclCommInitRank)(Comm* comm, int nranks, nccl::ncclUniqueId id, int rank) = nullptr;
  Result (*ncclCommFinalize)(Comm comm) = nullptr;
  Result (*ncclCommDestroy)(Comm comm) = nullptr;
  Result (*ncclCommAbort)(Comm comm) = nullptr;
  Result (*ncclCommGetAsyncError)(Comm comm, Result* async_error) = nullptr;
  const char* (*ncclGetErrorString)(Result result) = nullptr;
  // Optional: null when the library does not export it.
  const char* (*ncclGetLastError)(Comm comm) = nullptr;
  Result (*ncclAllGather)(const void* send, void* recv, size_t sendcount, DataType dtype,
                          Comm comm, Stream stream) = nullptr;
  Result (*ncclReduceScatter)(const void* send, void* recv, size_t recvcount, DataType dtype,
                              RedOp op, Comm comm, Stream stream) = nullptr;
  Result (*ncclAllReduce)(const void* send, void* recv, size_t count, DataType dtype, RedOp op,
                          Comm comm, Stream stream) = nullptr;
  Result (*ncclBroadcast)(const void* send, void* recv, size_t count, DataType dtype, int root,
                          Comm comm, Stream stream) = nullptr;
  Result (*ncclSend)(const void* send, size_t count, DataType dtype, int peer, Comm comm,
                     Stream stream) = nullptr;
  Result (*ncclRecv)(void* recv, size_t count, DataType dtype, int peer, Comm comm,
                     Stream stream) = nullptr;
  Result (*ncclGroupStart)() = nullptr;
  Result (*ncclGroupEnd)() = nullptr;

  std::string path;  // the file that was loaded (as the loader resolved it)
  int version = 0;   // ncclGetVersion's code, e.g. 22809
  void* handle = nullptr;

  // "2.28.9"
  std::string version_string() const;
  // "unhandled system error (ncclSystemError, 2): <ncclGetLastError(comm)>";
  // comm may be null.
  std::string describe(Result result, Comm comm) const;
};

// The process's NCCL, loaded on first use (thread-safe). Throws
// zs::Error(Code::NotSupported) naming every path tried with its dlerror(),
// the missing symbol, or the version found and the minimum. A failure is
// remembered: later calls throw the same message without searching again.
const NcclLibrary& nccl_library();

// True if nccl_library() succeeds; otherwise false with its message in *why
// (why may be null).
bool nccl_available(std::string* why);

// "2.28.9" for a version code (either of NCCL's encodings).
std::string nccl_version_string(int code);

namespace nccl_detail {
// The candidate files in search order, as described at the top; with
// ZS_NCCL_LIBRARY set, that path alone. *wheel_dirs, if given, receives
// every site-packages folder looked in (with or without a wheel).
std::vector<std::string> candidate_paths(std::vector<std::string>* wheel_dirs = nullptr);
// One uncached search, as nccl_library() does on its first call (tests use
// it to try several settings of the environment in one process).
NcclLibrary load();
}  // namespace nccl_detail

}  // namespace zs
