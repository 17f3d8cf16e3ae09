// Settings read from the environment, strictly: a malformed value is an
// error naming the variable, never a silent default.
#pragma once

namespace zs {

// Strict integer from an environment variable; nullptr/absent -> fallback.
// Throws Code::Bootstrap for anything but a non-negative decimal <= 2^24.
int env_int(const char* name, int fallback);

}  // namespace zs
