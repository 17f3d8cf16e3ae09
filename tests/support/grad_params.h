// What the gradient-push tests share: a 1-D fp32 param registered under a
// name, and a copy of this rank's fp32 gradient shard of it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "zeroshard/zeroshard.h"

namespace zs::test {

inline zs_param register_vector(zs_context ctx, const std::string& name, int64_t n) {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name.c_str();
  o.ndim = 1;
  o.shape = &n;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

// Empty before the param's first push.
inline std::vector<float> grad_shard_copy(zs_param p) {
  float* data = nullptr;
  uint64_t n = 0;
  EXPECT_EQ(zs_grad_shard_data(p, &data, &n), ZS_OK) << zs_last_error();
  return data ? std::vector<float>(data, data + n) : std::vector<float>{};
}

}  // namespace zs::test
