// zs_grad_push_borrowed on real ranks: a large gradient reduce-scattered
// straight from the caller's memory gives the shards zs_grad_push gives
// (bit for bit without accumulation), the memory is only read and is the
// caller's again once zs_grad_released reaches its ticket, ranks may mix
// the two calls, and what stays on the bucket route says so (ticket 0).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/grad_params.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::grad_shard_copy;
using zs::test::register_vector;
using zs::test::run_ranks;

namespace {

// reduce_bucket_size 1200: a gradient of 300 elements or more whose numel
// the group size divides goes direct.
const char* kConfig = "{\"zero_optimization\": {\"reduce_bucket_size\": 1200}}";

std::vector<float> grad(int rank, size_t k, int64_t n, int round = 0) {
  std::vector<float> g(static_cast<size_t>(n));
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = std::sin(static_cast<float>(i * 13 + k * 101 + static_cast<size_t>(rank) * 7 +
                                       static_cast<size_t>(round) * 3)) * 0.3f;
  return g;
}

uint64_t released(zs_context ctx) {
  uint64_t t = 0;
  EXPECT_EQ(zs_grad_released(ctx, &t), ZS_OK) << zs_last_error();
  return t;
}

// Sizes for `world` ranks: direct (a multiple of world, >= 300), padded
// (not a multiple: bucket), small (bucket), direct again.
std::vector<int64_t> sizes_for(int world) {
  return {300L * world, 300L * world + 1, 8, 1000L * world};
}

bool direct(int64_t n, int world) { return n % world == 0 && n * 4 >= 1200; }

}  // namespace

TEST(GradPushBorrowed, EqualsPushBitwiseAndOnlyReadsTheGradient) {
  for (int ranks : {2, 3}) {
    run_ranks(ranks, [](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env, kConfig);
      ASSERT_NE(ctx, nullptr);
      const auto sizes = sizes_for(env.world);
      std::vector<zs_param> copied, lent;
      std::vector<std::vector<float>> grads, originals;
      for (size_t k = 0; k < sizes.size(); ++k) {
        copied.push_back(register_vector(ctx, "copied." + std::to_string(k), sizes[k]));
        lent.push_back(register_vector(ctx, "lent." + std::to_string(k), sizes[k]));
        grads.push_back(grad(env.rank, k, sizes[k]));
      }
      originals = grads;
      for (size_t k = 0; k < sizes.size(); ++k)
        ZS_ASSERT_OK(zs_grad_push(copied[k], grads[k].data(), ZS_FLOAT32, grads[k].size() * 4));
      EXPECT_EQ(released(ctx), 0u) << "no ticket handed out yet";
      uint64_t last = 0;
      for (size_t k = 0; k < sizes.size(); ++k) {
        uint64_t ticket = 99;
        ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, lent[k], grads[k].data(), ZS_FLOAT32, grads[k].size() * 4));
        if (direct(sizes[k], env.world)) {
          EXPECT_EQ(ticket, last + 1) << "param " << k << ": tickets count up from 1";
          last = ticket;
        } else {
          EXPECT_EQ(ticket, 0u) << "param " << k << " (" << sizes[k] << " elements) is on the bucket route";
        }
      }
      ZS_ASSERT_OK(zs_grad_sync(ctx));
      EXPECT_EQ(released(ctx), last) << "after the sync every ticket is released";
      for (size_t k = 0; k < sizes.size(); ++k) {
        const auto a = grad_shard_copy(copied[k]), b = grad_shard_copy(lent[k]);
        ASSERT_EQ(a.size(), b.size()) << "param " << k;
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "param " << k;
        EXPECT_EQ(std::memcmp(grads[k].data(), originals[k].data(), grads[k].size() * 4), 0)
            << "param " << k << ": the engine wrote into the caller's gradient";
      }
      zs_context_destroy(ctx);
    });
  }
}

TEST(GradPushBorrowed, AccumulatedGradientsAddUpAsPushes) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, kConfig);
    ASSERT_NE(ctx, nullptr);
    ZS_ASSERT_OK(zs_grad_set_accumulation_steps(ctx, 2));
    const int64_t n = 900;  // direct on 3 ranks
    zs_param copied = register_vector(ctx, "copied", n), lent = register_vector(ctx, "lent", n);
    std::vector<std::vector<float>> rounds = {grad(env.rank, 0, n, 0), grad(env.rank, 0, n, 1)};
    for (auto& g : rounds) {
      ZS_ASSERT_OK(zs_grad_push(copied, g.data(), ZS_FLOAT32, g.size() * 4));
      uint64_t ticket = 0;
      ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, lent, g.data(), ZS_FLOAT32, g.size() * 4));
      EXPECT_GT(ticket, 0u);
    }
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    // The mean of two micro-steps: the first write assigned the shard, the
    // second added to it; divided once per shard instead of per gradient.
    const auto a = grad_shard_copy(copied), b = grad_shard_copy(lent);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6f * (1.0f + std::fabs(a[i]))) << i;
    zs_context_destroy(ctx);
  });
}

TEST(GradPushBorrowed, ReleasedMemoryIsTheCallersAgain) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, kConfig);
    ASSERT_NE(ctx, nullptr);
    const int64_t n = 4000;
    zs_param copied = register_vector(ctx, "copied", n), lent = register_vector(ctx, "lent", n);
    auto g = grad(env.rank, 0, n);
    ZS_ASSERT_OK(zs_grad_push(copied, g.data(), ZS_FLOAT32, g.size() * 4));
    // Rank 1 comes late, so rank 0's reduction cannot be done before it.
    if (env.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    uint64_t ticket = 0;
    ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, lent, g.data(), ZS_FLOAT32, g.size() * 4));
    ASSERT_GT(ticket, 0u);
    // Once released reaches the ticket the reduction is done with g: a
    // scribble over it must not reach the shard.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (released(ctx) < ticket && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GE(released(ctx), ticket) << "the reduction never finished";
    std::fill(g.begin(), g.end(), 1e6f);
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    const auto a = grad_shard_copy(copied), b = grad_shard_copy(lent);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
    zs_context_destroy(ctx);
  });
}

TEST(GradPushBorrowed, RanksMayMixBorrowedAndCopiedPushes) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, kConfig);
    ASSERT_NE(ctx, nullptr);
    const auto sizes = sizes_for(env.world);
    std::vector<zs_param> ref, mixed;
    std::vector<std::vector<float>> grads;
    for (size_t k = 0; k < sizes.size(); ++k) {
      ref.push_back(register_vector(ctx, "ref." + std::to_string(k), sizes[k]));
      mixed.push_back(register_vector(ctx, "mixed." + std::to_string(k), sizes[k]));
      grads.push_back(grad(env.rank, k, sizes[k]));
    }
    for (size_t k = 0; k < sizes.size(); ++k)
      ZS_ASSERT_OK(zs_grad_push(ref[k], grads[k].data(), ZS_FLOAT32, grads[k].size() * 4));
    // Rank 1 copies, the others lend: the same collectives all the same.
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t bytes = grads[k].size() * 4;
      if (env.rank == 1) {
        ZS_ASSERT_OK(zs_grad_push(mixed[k], grads[k].data(), ZS_FLOAT32, bytes));
      } else {
        uint64_t ticket = 0;
        ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, mixed[k], grads[k].data(), ZS_FLOAT32, bytes));
      }
    }
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    for (size_t k = 0; k < sizes.size(); ++k) {
      const auto a = grad_shard_copy(ref[k]), b = grad_shard_copy(mixed[k]);
      ASSERT_EQ(a.size(), b.size()) << "param " << k;
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "param " << k;
    }
    // A 16-bit gradient of a direct param is widened into a copy: ticket 0.
    zs_param half = register_vector(ctx, "half", 600);
    std::vector<uint16_t> h(600, 0x3f80);  // bf16 1.0
    uint64_t ticket = 7;
    ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, half, h.data(), ZS_BFLOAT16, h.size() * 2));
    EXPECT_EQ(ticket, 0u) << "a bf16 gradient cannot be reduced in place";
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    for (float v : grad_shard_copy(half)) ASSERT_EQ(v, 1.0f);
    zs_context_destroy(ctx);
  });
}

namespace {

// A direct param's fp32 host gradient pushed under `config` on 2 ranks:
// nothing is lent (ticket 0), for the reason `why`; then `more` runs.
void expect_not_lent(const char* config, const char* why,
                     void (*more)(zs_context, zs_param, const std::vector<float>&) = nullptr) {
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config);
    ASSERT_NE(ctx, nullptr);
    zs_param p = register_vector(ctx, "p", 800);
    auto g = grad(env.rank, 0, 800);
    uint64_t ticket = 5;
    ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, p, g.data(), ZS_FLOAT32, g.size() * 4));
    EXPECT_EQ(ticket, 0u) << why;
    if (more) more(ctx, p, g);
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    zs_context_destroy(ctx);
  });
}

}  // namespace

TEST(GradPushBorrowed, WhatIsNotLentSaysSoAndBadCallsAreRefused) {
  expect_not_lent("{\"zero_optimization\": {\"reduce_bucket_size\": 1200, \"overlap_comm\": false}}",
                  "overlap_comm off: nothing is read after the call",
                  [](zs_context ctx, zs_param p, const std::vector<float>& g) {
                    uint64_t ticket = 5;
                    EXPECT_EQ(zs_grad_push_borrowed(&ticket, p, g.data(), ZS_FLOAT32, g.size() * 4 - 4),
                              ZS_ERR_BUFFER_SIZE);
                    EXPECT_EQ(ticket, 0u) << "a refused call lends nothing";
                    EXPECT_NE(std::string(zs_last_error()).find("grad_bytes is 3196, expected 3200"),
                              std::string::npos)
                        << zs_last_error();
                    EXPECT_EQ(zs_grad_push_borrowed(nullptr, p, g.data(), ZS_FLOAT32, g.size() * 4),
                              ZS_ERR_INVALID_ARGUMENT);
                    EXPECT_EQ(zs_grad_released(ctx, nullptr), ZS_ERR_INVALID_ARGUMENT);
                  });
  const zs::test::QuantizeWithinHost quantize_within_host;  // else one host's qgZ moves fp32
  expect_not_lent(
      "{\"zero_optimization\": {\"reduce_bucket_size\": 1200, \"zero_quantized_gradients\": true}}",
      "qgZ reduces from quantized buckets");
}
