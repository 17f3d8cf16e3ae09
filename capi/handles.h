// Handle tables and error plumbing for the C ABI. A handle is a number, not
// a pointer: ids grow forever and are never reused, so a stale, destroyed
// or foreign handle is found missing in the table (ZS_ERR_INVALID_HANDLE)
// instead of being dereferenced.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "impl/comm/group.h"
#include "impl/comm/work.h"
#include "impl/core/context.h"
#include "impl/fetch/gather.h"
#include "impl/optim/optimizer.h"
#include "impl/partition/param.h"
#include "capi/sized.h"
#include "zeroshard/zeroshard.h"

namespace zs::capi {

enum class Kind : uint8_t { Context = 1, Group = 2, Param = 3, Gather = 4, Work = 5, Optimizer = 6, StoreServer = 7 };

struct GatherState {
  std::shared_ptr<Work> work;
  ParamList params;
};

// What a handle resolves to: its object and the context that owns it.
template <typename T>
struct Resolved {
  std::shared_ptr<Context> ctx;
  std::shared_ptr<T> obj;
};

uintptr_t add_handle(Kind kind, uint64_t ctx_id, std::shared_ptr<void> obj);
// Removes a handle and returns its object (null if missing / wrong kind).
std::shared_ptr<void> take_handle(Kind kind, uintptr_t handle, uint64_t* ctx_id);
// Removes every handle owned by a context (when it is destroyed).
void drop_context_handles(uint64_t ctx_id);

// Lookups throw Error(InvalidHandle) naming the argument.
std::shared_ptr<Context> context_of(zs_context h, const char* arg);
Resolved<Group> group_of(zs_group h, const char* arg);
Resolved<Param> param_of(zs_param h, const char* arg);
Resolved<GatherState> gather_of(zs_gather h, const char* arg);
Resolved<Work> work_of(zs_work h, const char* arg);
Resolved<Optimizer> optimizer_of(zs_optimizer h, const char* arg);
// Many params at once, all from ctx (one table lock).
ParamList params_of(const std::shared_ptr<Context>& ctx, const zs_param* handles, size_t n,
                    const char* arg);

// Records the message for zs_last_error and returns the status.
zs_status set_error(zs_status status, const std::string& message);

// Runs fn, turning any exception into a status and the thread's message.
template <typename Fn>
zs_status guarded(Fn&& fn) noexcept {
  try {
    fn();
    return ZS_OK;
  } catch (const Error& e) {
    return set_error(static_cast<zs_status>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(ZS_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return set_error(ZS_ERR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return set_error(ZS_ERR_INTERNAL, "internal error: unknown exception");
  }
}

template <typename T>
T* checked_out(T* out, const char* arg) {
  if (out == nullptr) fail(Code::InvalidArgument, arg, " is NULL");
  return out;
}

// An options struct as this library knows it, read up to the caller's
// `size` with defaults after it (capi/sized.h).
template <typename T>
T checked_options(const T* options, const char* arg) {
  return read_sized(options, arg);
}

template <typename H>
H to_handle(uintptr_t v) {
  return reinterpret_cast<H>(v);
}

}  // namespace zs::capi
