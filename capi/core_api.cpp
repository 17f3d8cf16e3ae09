// Version, status names and the context-free config check.
#include "capi/handles.h"

using namespace zs;
using namespace zs::capi;

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)

extern "C" {

ZS_API const char* zs_version(int* major, int* minor, int* patch) {
  if (major) *major = ZS_VERSION_MAJOR;
  if (minor) *minor = ZS_VERSION_MINOR;
  if (patch) *patch = ZS_VERSION_PATCH;
  return ZS_STR(ZS_VERSION_MAJOR) "." ZS_STR(ZS_VERSION_MINOR) "." ZS_STR(ZS_VERSION_PATCH);
}

ZS_API const char* zs_status_string(zs_status status) {
  switch (status) {
    case ZS_OK: return "ZS_OK";
    case ZS_ERR_INVALID_ARGUMENT: return "ZS_ERR_INVALID_ARGUMENT";
    case ZS_ERR_INVALID_HANDLE: return "ZS_ERR_INVALID_HANDLE";
    case ZS_ERR_INVALID_STATE: return "ZS_ERR_INVALID_STATE";
    case ZS_ERR_INVALID_CONFIG: return "ZS_ERR_INVALID_CONFIG";
    case ZS_ERR_OUT_OF_MEMORY: return "ZS_ERR_OUT_OF_MEMORY";
    case ZS_ERR_TIMEOUT: return "ZS_ERR_TIMEOUT";
    case ZS_ERR_COMM: return "ZS_ERR_COMM";
    case ZS_ERR_BOOTSTRAP: return "ZS_ERR_BOOTSTRAP";
    case ZS_ERR_NOT_SUPPORTED: return "ZS_ERR_NOT_SUPPORTED";
    case ZS_ERR_BUFFER_SIZE: return "ZS_ERR_BUFFER_SIZE";
    case ZS_ERR_INTERNAL: return "ZS_ERR_INTERNAL";
    case ZS_ERR_IO: return "ZS_ERR_IO";
    case ZS_ERR_RANK_LOST: return "ZS_ERR_RANK_LOST";
    case ZS_ERR_STATE_LOST: return "ZS_ERR_STATE_LOST";
    case ZS_ERR_NOT_TAKEN: return "ZS_ERR_NOT_TAKEN";
    default: break;
  }
  return "ZS_UNKNOWN_STATUS";
}

ZS_API zs_status zs_config_check(const char* config_json, int world_size) {
  return guarded([&] {
    if (config_json == nullptr) fail(Code::InvalidArgument, "config_json is NULL");
    parse_config(config_json, world_size);
  });
}

}  // extern "C"
