// zs_grad_push_many on real ranks: the same gradient shards, bit for bit,
// as one zs_grad_push per param (a NULL gradient skipped as if not pushed),
// and a refused call, named by index, that pushes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/grad_params.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::grad_shard_copy;
using zs::test::register_vector;
using zs::test::run_ranks;

namespace {

const std::vector<int64_t> kSizes = {7, 1003, 64, 0, 5};

std::vector<float> grad(int rank, size_t k, int64_t n) {
  std::vector<float> g(static_cast<size_t>(n));
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = std::sin(static_cast<float>(i * 13 + k * 101 + static_cast<size_t>(rank) * 7)) * 0.3f;
  return g;
}

TEST(GradPushMany, EqualsOnePushPerParamBitwise) {
  for (int ranks : {2, 3}) {
    run_ranks(ranks, [](const RankEnv& env) {
      // Small buckets: the pushes of both lists span several reduce-scatters.
      zs_context ctx = zs::test::make_context(env, "{\"zero_optimization\": {\"reduce_bucket_size\": 900}}");
      ASSERT_NE(ctx, nullptr);
      std::vector<zs_param> one, many;
      for (size_t k = 0; k < kSizes.size(); ++k) {
        one.push_back(register_vector(ctx, "one." + std::to_string(k), kSizes[k]));
        many.push_back(register_vector(ctx, "many." + std::to_string(k), kSizes[k]));
      }
      const size_t skipped = 2;  // no gradient for it in the batch
      std::vector<std::vector<float>> grads;
      for (size_t k = 0; k < kSizes.size(); ++k) grads.push_back(grad(env.rank, k, kSizes[k]));
      for (size_t k = 0; k < kSizes.size(); ++k)
        if (k != skipped) ZS_ASSERT_OK(zs_grad_push(one[k], grads[k].data(), ZS_FLOAT32, grads[k].size() * 4));
      std::vector<const void*> ptrs;
      std::vector<size_t> bytes;
      for (size_t k = 0; k < kSizes.size(); ++k) {
        ptrs.push_back(k == skipped ? nullptr : grads[k].data());
        bytes.push_back(grads[k].size() * 4);
      }
      ZS_ASSERT_OK(zs_grad_push_many(ctx, many.data(), many.size(), ptrs.data(), bytes.data(), ZS_FLOAT32));
      ZS_ASSERT_OK(zs_grad_sync(ctx));
      for (size_t k = 0; k < kSizes.size(); ++k) {
        const auto a = grad_shard_copy(one[k]), b = grad_shard_copy(many[k]);
        ASSERT_EQ(a.size(), b.size()) << "param " << k;
        // (an empty vector's data() may be null: no memcmp of it)
        EXPECT_TRUE(a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0) << "param " << k;
      }
      EXPECT_TRUE(grad_shard_copy(many[skipped]).empty()) << "a skipped param got a gradient shard";
      zs_context_destroy(ctx);
    });
  }
}

TEST(GradPushMany, ARefusedCallPushesNothingAndNamesTheIndex) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> params;
    for (size_t k = 0; k < 3; ++k) params.push_back(register_vector(ctx, "p" + std::to_string(k), 10));
    std::vector<float> g(10, 1.0f);
    std::vector<const void*> ptrs(3, g.data());
    std::vector<size_t> bytes = {40, 40, 36};  // params[2]: one element short
    EXPECT_EQ(zs_grad_push_many(ctx, params.data(), 3, ptrs.data(), bytes.data(), ZS_FLOAT32),
              ZS_ERR_BUFFER_SIZE);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("params[2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'p2'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("grad_bytes is 36, expected 40"), std::string::npos) << msg;
    EXPECT_EQ(zs_grad_push_many(ctx, params.data(), 3, nullptr, bytes.data(), ZS_FLOAT32),
              ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("grads is NULL"), std::string::npos) << zs_last_error();
    EXPECT_EQ(zs_grad_push_many(ctx, params.data(), 3, ptrs.data(), bytes.data(), ZS_UINT8),
              ZS_ERR_INVALID_ARGUMENT);
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    for (zs_param p : params) EXPECT_TRUE(grad_shard_copy(p).empty()) << "a refused call took a gradient";
    zs_context_destroy(ctx);
  });
}

}  // namespace
