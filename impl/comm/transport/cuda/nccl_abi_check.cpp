// Compile-time cross-check of the NCCL ABI declared by hand in
// impl/comm/transport/nccl_library.h against the real nccl.h, where the toolkit (or an
// NCCL install) puts it on the include path. Nothing here is linked into a
// call: it only fails the build if a value or layout drifts.
#include "impl/comm/transport/nccl_library.h"

#if defined(__has_include)
#if __has_include(<nccl.h>)
#define ZS_HAVE_NCCL_H 1
#endif
#endif

#ifdef ZS_HAVE_NCCL_H
#include <nccl.h>

#include <cstddef>
#include <type_traits>

namespace zs::nccl_abi_check {

namespace n = ::zs::nccl;

// Handles and the unique id.
static_assert(sizeof(::ncclComm_t) == sizeof(n::ncclComm_t), "ncclComm_t is a pointer");
static_assert(sizeof(::ncclUniqueId) == sizeof(n::ncclUniqueId), "ncclUniqueId size");
static_assert(NCCL_UNIQUE_ID_BYTES == n::kUniqueIdBytes, "NCCL_UNIQUE_ID_BYTES");
static_assert(alignof(::ncclUniqueId) == alignof(n::ncclUniqueId), "ncclUniqueId alignment");
static_assert(std::is_trivially_copyable<n::ncclUniqueId>::value, "ncclUniqueId is plain bytes");

// Enums travel as int.
static_assert(sizeof(::ncclResult_t) == sizeof(n::ncclResult_t), "ncclResult_t size");
static_assert(sizeof(::ncclDataType_t) == sizeof(n::ncclDataType_t), "ncclDataType_t size");
static_assert(sizeof(::ncclRedOp_t) == sizeof(n::ncclRedOp_t), "ncclRedOp_t size");

static_assert(::ncclSuccess == n::ncclSuccess, "ncclSuccess");
static_assert(::ncclUnhandledCudaError == n::ncclUnhandledCudaError, "ncclUnhandledCudaError");
static_assert(::ncclSystemError == n::ncclSystemError, "ncclSystemError");
static_assert(::ncclInternalError == n::ncclInternalError, "ncclInternalError");
static_assert(::ncclInvalidArgument == n::ncclInvalidArgument, "ncclInvalidArgument");
static_assert(::ncclInvalidUsage == n::ncclInvalidUsage, "ncclInvalidUsage");
static_assert(::ncclRemoteError == n::ncclRemoteError, "ncclRemoteError");
static_assert(::ncclInProgress == n::ncclInProgress, "ncclInProgress");

static_assert(::ncclInt8 == n::ncclInt8, "ncclInt8");
static_assert(::ncclUint8 == n::ncclUint8, "ncclUint8");
static_assert(::ncclInt32 == n::ncclInt32, "ncclInt32");
static_assert(::ncclFloat16 == n::ncclFloat16, "ncclFloat16");
static_assert(::ncclFloat32 == n::ncclFloat32, "ncclFloat32");
static_assert(::ncclBfloat16 == n::ncclBfloat16, "ncclBfloat16");

static_assert(::ncclSum == n::ncclSum, "ncclSum");
static_assert(::ncclProd == n::ncclProd, "ncclProd");
static_assert(::ncclMax == n::ncclMax, "ncclMax");
static_assert(::ncclMin == n::ncclMin, "ncclMin");
static_assert(::ncclAvg == n::ncclAvg, "ncclAvg");

// The version encoding.
static_assert(NCCL_VERSION(2, 14, 0) == n::nccl_version_code(2, 14, 0), "NCCL_VERSION");
static_assert(NCCL_VERSION(2, 8, 4) == n::nccl_version_code(2, 8, 4), "NCCL_VERSION (old)");
static_assert(NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) >= n::kMinVersion,
              "the nccl.h on the include path is older than the minimum NCCL");

// ncclConfig_t: our 2.14-layout prefix must match the real struct field by
// field, and be no larger (NCCL copies min(size, sizeof(ncclConfig_t))).
static_assert(offsetof(::ncclConfig_t, size) == offsetof(n::ncclConfigV21400, size), "size");
static_assert(offsetof(::ncclConfig_t, magic) == offsetof(n::ncclConfigV21400, magic), "magic");
static_assert(offsetof(::ncclConfig_t, version) == offsetof(n::ncclConfigV21400, version),
              "version");
static_assert(offsetof(::ncclConfig_t, blocking) == offsetof(n::ncclConfigV21400, blocking),
              "blocking");
static_assert(offsetof(::ncclConfig_t, cgaClusterSize) ==
                  offsetof(n::ncclConfigV21400, cgaClusterSize),
              "cgaClusterSize");
static_assert(sizeof(n::ncclConfigV21400) <= sizeof(::ncclConfig_t), "config prefix size");
static_assert(std::is_same<decltype(::ncclConfig_t::size), size_t>::value, "size type");
static_assert(std::is_same<decltype(::ncclConfig_t::magic), unsigned int>::value, "magic type");
static_assert(std::is_same<decltype(::ncclConfig_t::version), unsigned int>::value,
              "version type");
static_assert(std::is_same<decltype(::ncclConfig_t::blocking), int>::value, "blocking type");
static_assert(NCCL_CONFIG_UNDEF_INT == n::kConfigUndefInt, "NCCL_CONFIG_UNDEF_INT");

constexpr ::ncclConfig_t kInitializer = NCCL_CONFIG_INITIALIZER;
static_assert(kInitializer.magic == n::kConfigMagic, "ncclConfig_t magic");
static_assert(kInitializer.blocking == NCCL_CONFIG_UNDEF_INT, "blocking defaults to undefined");

// Entry points: same arity and parameter sizes (enums as int).
template <typename A, typename B>
struct same_abi : std::false_type {};
template <typename R1, typename... A1, typename R2, typename... A2>
struct same_abi<R1 (*)(A1...), R2 (*)(A2...)>
    : std::bool_constant<sizeof...(A1) == sizeof...(A2) && sizeof(R1) == sizeof(R2) &&
                         ((sizeof(A1) == sizeof(A2)) && ...)> {};

#define ZS_CHECK_NCCL_FN(name)                                                            \
  static_assert(same_abi<decltype(&::name), decltype(::zs::NcclLibrary::name)>::value, \
                #name " signature")
ZS_CHECK_NCCL_FN(ncclGetVersion);
ZS_CHECK_NCCL_FN(ncclGetUniqueId);
ZS_CHECK_NCCL_FN(ncclCommInitRankConfig);
ZS_CHECK_NCCL_FN(ncclCommInitRank);
ZS_CHECK_NCCL_FN(ncclCommFinalize);
ZS_CHECK_NCCL_FN(ncclCommDestroy);
ZS_CHECK_NCCL_FN(ncclCommAbort);
ZS_CHECK_NCCL_FN(ncclCommGetAsyncError);
ZS_CHECK_NCCL_FN(ncclGetErrorString);
ZS_CHECK_NCCL_FN(ncclGetLastError);
ZS_CHECK_NCCL_FN(ncclAllGather);
ZS_CHECK_NCCL_FN(ncclReduceScatter);
ZS_CHECK_NCCL_FN(ncclAllReduce);
ZS_CHECK_NCCL_FN(ncclBroadcast);
ZS_CHECK_NCCL_FN(ncclSend);
ZS_CHECK_NCCL_FN(ncclRecv);
ZS_CHECK_NCCL_FN(ncclGroupStart);
ZS_CHECK_NCCL_FN(ncclGroupEnd);
#undef ZS_CHECK_NCCL_FN

}  // namespace zs::nccl_abi_check
#endif  // ZS_HAVE_NCCL_H
