// Runs fn, which must throw zs::Error with `code`; returns its message (or
// "" after recording a test failure).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "impl/common/error.h"

namespace zs::test {

template <typename Fn>
std::string error_of(Code code, Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected zs::Error with code " << static_cast<int>(code);
  return "";
}

}  // namespace zs::test
