// Engine-side error type. Every failure inside impl/ throws zs::Error with a
// status code and a message that names the offending value; capi/ turns it
// into a zs_status and the thread's last-error string. The numeric codes
// equal the public zs_status values (checked by static_assert in capi/).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace zs {

enum class Code : int {
  Ok = 0,
  InvalidArgument = 1,
  InvalidHandle = 2,
  InvalidState = 3,
  InvalidConfig = 4,
  OutOfMemory = 5,
  Timeout = 6,
  Comm = 7,
  Bootstrap = 8,
  NotSupported = 9,
  BufferSize = 10,
  Internal = 11,
  Io = 12,  // a file could not be read or written, or failed its checksum
  RankLost = 13,   // healing on: a rank fell silent (docs/healing.md, section 2)
  StateLost = 14,  // healing on: a shard and its copy were lost together
  NotTaken = 15,   // healing: a replacement the survivors shrank without
};

class Error : public std::runtime_error {
 public:
  Error(Code code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  Code code() const noexcept { return code_; }

 private:
  Code code_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, T&& first, Rest&&... rest) {
  os << std::forward<T>(first);
  append(os, std::forward<Rest>(rest)...);
}
}  // namespace detail

// fail(Code::InvalidArgument, "shape[", i, "] = ", v, ": expected >= 0")
template <typename... Parts>
[[noreturn]] void fail(Code code, Parts&&... parts) {
  std::ostringstream os;
  detail::append(os, std::forward<Parts>(parts)...);
  throw Error(code, os.str());
}

}  // namespace zs
