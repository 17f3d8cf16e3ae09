// Structs that cross the ABI and grow over releases. Each starts with its
// `size` (what the caller's header says it is). A caller compiled against an
// older header passes a smaller struct: the library reads and writes only its
// first `size` bytes and gives the fields after them their defaults (the
// _INIT macro's values). Below the struct's size in the first release, or
// above the size this library knows (a newer header than the library), the
// call fails naming both sizes.
//
// Adding a field: append it at the end, make sure sizeof grows (a field that
// fits in the old tail padding cannot be told apart from it), give it a
// default in the _INIT macro, and leave FirstRelease below as it is.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>

#include "impl/common/error.h"
#include "zeroshard/zeroshard.h"

namespace zs::capi {

// Per struct: its name, its defaults (the header's _INIT macro), and its
// size in the first release (0.1): the end of its last field then.
template <typename T>
struct Sized;

#if defined(ZS_ABI_TEST_ANY_SIZE)
// tests/abi builds a second library with this, standing for a later release
// whose structs have grown past an old caller's: every field after `size`
// counts as added later, so the old-caller test can run against today's
// header with fields removed.
#define ZS_FIRST_RELEASE_END(T, last) (offsetof(T, size) + sizeof(size_t))
#else
#define ZS_FIRST_RELEASE_END(T, last) (offsetof(T, last) + sizeof(static_cast<T*>(nullptr)->last))
#endif

#define ZS_SIZED(T, INIT, last)                                             \
  template <>                                                               \
  struct Sized<T> {                                                         \
    static constexpr const char* name = #T;                                 \
    static constexpr size_t first_release = ZS_FIRST_RELEASE_END(T, last);  \
    static T defaults() { return T INIT; }                                  \
  };

ZS_SIZED(zs_context_options, ZS_CONTEXT_OPTIONS_INIT, backend)
ZS_SIZED(zs_param_options, ZS_PARAM_OPTIONS_INIT, group)
ZS_SIZED(zs_optim_hparams, ZS_OPTIM_HPARAMS_INIT, bias_correction)
ZS_SIZED(zs_memory_stats, ZS_MEMORY_STATS_INIT, device_reuses)
ZS_SIZED(zs_fetch_stats, ZS_FETCH_STATS_INIT, hierarchical_gathers)
ZS_SIZED(zs_param_info, ZS_PARAM_INFO_INIT, device_id)
ZS_SIZED(zs_step_result, ZS_STEP_RESULT_INIT, step)
ZS_SIZED(zs_coord_stats, ZS_COORD_STATS_INIT, trace_length)
ZS_SIZED(zs_step_stats, ZS_STEP_STATS_INIT, optimizer_seconds)
ZS_SIZED(zs_checkpoint_save_options, ZS_CHECKPOINT_SAVE_OPTIONS_INIT, progress_user)
ZS_SIZED(zs_checkpoint_load_options, ZS_CHECKPOINT_LOAD_OPTIONS_INIT, progress_user)
ZS_SIZED(zs_checkpoint_info, ZS_CHECKPOINT_INFO_INIT, user_json)
ZS_SIZED(zs_checkpoint_export_options, ZS_CHECKPOINT_EXPORT_OPTIONS_INIT, progress_user)
ZS_SIZED(zs_export_options, ZS_EXPORT_OPTIONS_INIT, progress_user)
ZS_SIZED(zs_safetensors_load_options, ZS_SAFETENSORS_LOAD_OPTIONS_INIT, progress_user)

#undef ZS_SIZED

// A caller's size for T: at least the first release's, at most sizeof(T).
template <typename T>
size_t checked_size(size_t size, const char* arg) {
  if (size < Sized<T>::first_release)
    fail(Code::InvalidArgument, arg, " is ", size, ", below ", Sized<T>::first_release,
         ", the size of ", Sized<T>::name, " in zeroshard's first release (initialise it with its "
         "_INIT macro or _init function)");
  if (size > sizeof(T))
    fail(Code::InvalidArgument, arg, " is ", size, ", but this zeroshard (", ZS_VERSION_MAJOR, ".",
         ZS_VERSION_MINOR, ".", ZS_VERSION_PATCH, ") knows ", Sized<T>::name, " of at most ",
         sizeof(T), " bytes: the caller was compiled against a newer header than the library");
  return size;
}

// An input struct as this library knows it: the caller's first `size` bytes
// over the defaults.
template <typename T>
T read_sized(const T* p, const char* arg) {
  if (p == nullptr) fail(Code::InvalidArgument, arg, " is NULL");
  const size_t n = checked_size<T>(p->size, (std::string(arg) + "->size").c_str());
  T out = Sized<T>::defaults();
  std::memcpy(static_cast<void*>(&out), static_cast<const void*>(p), n);
  out.size = sizeof(T);
  return out;
}

// An output struct: filled in full here, then its first `size` bytes copied
// to the caller's when the call succeeds (not while an exception unwinds).
template <typename T>
class SizedOut {
 public:
  SizedOut(T* p, const char* arg, bool nullable = false) : dst_(p) {
    if (p == nullptr) {
      if (!nullable) fail(Code::InvalidArgument, arg, " is NULL");
      return;
    }
    n_ = checked_size<T>(p->size, (std::string(arg) + "->size").c_str());
    local_ = Sized<T>::defaults();
    local_.size = n_;
  }
  ~SizedOut() {
    if (dst_ != nullptr && std::uncaught_exceptions() == unwinding_)
      std::memcpy(static_cast<void*>(dst_), static_cast<const void*>(&local_), n_);
  }
  SizedOut(const SizedOut&) = delete;
  SizedOut& operator=(const SizedOut&) = delete;

  T* operator->() { return &local_; }
  explicit operator bool() const { return dst_ != nullptr; }

 private:
  T* dst_;
  T local_{};
  size_t n_ = 0;
  int unwinding_ = std::uncaught_exceptions();
};

// zs_xxx_init: the defaults into the caller's first `size` bytes.
template <typename T>
void init_sized(T* p, size_t size, const char* arg) {
  if (p == nullptr) fail(Code::InvalidArgument, arg, " is NULL");
  const size_t n = checked_size<T>(size, "size");
  T d = Sized<T>::defaults();
  d.size = n;
  std::memcpy(static_cast<void*>(p), static_cast<const void*>(&d), n);
}

}  // namespace zs::capi
