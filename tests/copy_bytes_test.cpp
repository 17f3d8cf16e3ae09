// zs_copied_bytes: the bytes a step copies, by kind, exactly what the
// params' sizes, the shard layout and the reducer's routes predict. fp32
// and bf16 params pushed to buckets and (on 2 and 3 ranks) on the direct
// route, AdamW (a bf16 param's fp32 master refreshes its working shard),
// on 1, 2 and 3 ranks; then a 16-bit wire on 2 ranks; a group of one's
// gradients straight into their shards, bit for bit as through a bucket;
// the spans (since the context began, the last step) and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kernels/convert.h"
#include "kernels/optim.h"
#include "tests/support/grad_params.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::register_vector;
using zs::test::run_ranks;

namespace {

constexpr int64_t kBucket = 4000;  // reduce_bucket_size: direct from 1000 elements
const int64_t kF32Sizes[] = {1001, 3000, 50};
constexpr int64_t kBf16Size = 640;

using Copies = std::map<std::string, uint64_t>;

Copies copied(zs_context ctx, zs_copy_span span) {
  std::vector<uint64_t> bytes(ZS_COPY_KIND_COUNT, ~0ull);
  size_t n = 0;
  uint64_t total = 0;
  EXPECT_EQ(zs_copied_bytes(ctx, span, bytes.data(), bytes.size(), &n, &total), ZS_OK) << zs_last_error();
  EXPECT_EQ(n, static_cast<size_t>(ZS_COPY_KIND_COUNT));
  Copies out;
  uint64_t sum = 0;
  for (int k = 0; k < ZS_COPY_KIND_COUNT; ++k) {
    out[zs_copy_kind_name(static_cast<zs_copy_kind>(k))] = bytes[static_cast<size_t>(k)];
    sum += bytes[static_cast<size_t>(k)];
  }
  EXPECT_EQ(total, sum) << "total is the kinds' sum";
  return out;
}

std::string describe(const Copies& c) {
  std::string s;
  for (const auto& [k, v] : c)
    if (v) s += k + "=" + std::to_string(v) + " ";
  return s.empty() ? "(none)" : s;
}

uint64_t shard_of(int64_t n, int world) { return static_cast<uint64_t>((n + world - 1) / world); }

// The reducer's direct route (reducer.h): fp32 wire, a host context, a
// group of more than one whose size divides numel, a quarter of the bucket.
bool direct(int64_t n, int world, bool f32_wire) {
  return f32_wire && world > 1 && n % world == 0 && n * 4 >= kBucket;
}

zs_param register_bf16(zs_context ctx, const std::string& name, int64_t n) {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name.c_str();
  o.dtype = ZS_BFLOAT16;
  o.ndim = 1;
  o.shape = &n;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

std::vector<float> grad_f32(int rank, size_t k, int64_t n) {
  std::vector<float> g(static_cast<size_t>(n));
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(static_cast<float>(i * 7 + k * 31 + static_cast<size_t>(rank))) * 0.1f;
  return g;
}

std::vector<uint16_t> grad_bf16(int rank, int64_t n) {
  std::vector<uint16_t> g(static_cast<size_t>(n));
  for (size_t i = 0; i < g.size(); ++i)
    g[i] = zs::kernels::float_to_bf16(std::cos(static_cast<float>(i + static_cast<size_t>(rank))) * 0.1f);
  return g;
}

class CopiedBytes : public ::testing::TestWithParam<int> {};

TEST_P(CopiedBytes, EachStepCopiesWhatTheSizesPredict) {
  const int world = GetParam();
  run_ranks(world, [](const RankEnv& env) {
    const int g = env.world;
    zs_context ctx = zs::test::make_context(env, "{\"zero_optimization\": {\"reduce_bucket_size\": 4000}}");
    ASSERT_NE(ctx, nullptr);
    EXPECT_EQ(describe(copied(ctx, ZS_COPIES_LAST_STEP)), "(none)") << "no step yet";
    std::vector<zs_param> ps;
    for (size_t k = 0; k < 3; ++k) ps.push_back(register_vector(ctx, "w" + std::to_string(k), kF32Sizes[k]));
    zs_param half = register_bf16(ctx, "half", kBf16Size);
    ps.push_back(half);
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, ps.data(), ps.size(), &hp, nullptr));
    const Copies made = copied(ctx, ZS_COPIES_TOTAL);
    // The bf16 param's fp32 master, cast from its shard.
    EXPECT_EQ(made.at("param_cast"), shard_of(kBf16Size, g) * 4) << describe(made);

    // What a step copies, from the rules: in a group of one every gradient
    // straight into its shard, widened to fp32, one pass and no bucket;
    // else every gradient into a bucket (or its private fp32 copy on the
    // direct route, pushed without a loan), widened to fp32; the ring's
    // last hop sums each bucketed shard straight into its gradient shard
    // (a direct one is reduced into its shard in place): no copy out of the
    // reduction; a partly filled bucket's blocks are read where they lie
    // (a strided reduce-scatter), not closed up; AdamW writes the bf16
    // working shard from its master.
    uint64_t numel = 0, bucketed = 0, direct_numel = 0;
    for (int64_t n : kF32Sizes) {
      numel += static_cast<uint64_t>(n);
      if (direct(n, g, true)) direct_numel += static_cast<uint64_t>(n);
      else bucketed += shard_of(n, g);
    }
    numel += kBf16Size;
    bucketed += shard_of(kBf16Size, g);
    // On 2 and 3 ranks the bucketed shards fit one block, partly filled.
    if (g > 1) {
      ASSERT_LT(bucketed, static_cast<uint64_t>(kBucket / g));
    }
    Copies want;
    for (int k = 0; k < ZS_COPY_KIND_COUNT; ++k) want[zs_copy_kind_name(static_cast<zs_copy_kind>(k))] = 0;
    want["grad_into_bucket"] = g > 1 ? numel * 4 : 0;
    want["into_grad_shard"] = g > 1 ? 0 : bucketed * 4;
    want["bucket_compaction"] = 0;
    want["master_refresh"] = shard_of(kBf16Size, g) * 2;

    auto step = [&](bool lend_large) {
      for (size_t k = 0; k < 3; ++k) {
        const auto gr = grad_f32(env.rank, k, kF32Sizes[k]);
        if (lend_large && direct(kF32Sizes[k], g, true)) {
          uint64_t ticket = 0;
          ZS_ASSERT_OK(zs_grad_push_borrowed(&ticket, ps[k], gr.data(), ZS_FLOAT32, gr.size() * 4));
          ZS_ASSERT_OK(zs_grad_sync(ctx));  // gr is read until the sync: it must outlive it
        } else {
          ZS_ASSERT_OK(zs_grad_push(ps[k], gr.data(), ZS_FLOAT32, gr.size() * 4));
        }
      }
      const auto gh = grad_bf16(env.rank, kBf16Size);
      ZS_ASSERT_OK(zs_grad_push(half, gh.data(), ZS_BFLOAT16, gh.size() * 2));
      ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    };
    step(false);
    const Copies first = copied(ctx, ZS_COPIES_LAST_STEP);
    // The first step's span starts at the context's creation: the master's cast too.
    Copies want_first = want;
    want_first["param_cast"] = made.at("param_cast");
    EXPECT_EQ(first, want_first) << "first step: " << describe(first) << "; expected " << describe(want_first);
    step(false);
    const Copies second = copied(ctx, ZS_COPIES_LAST_STEP);
    EXPECT_EQ(second, want) << "second step: " << describe(second) << "; expected " << describe(want);
    // A lent gradient on the direct route is reduced from the caller's
    // memory: no private copy.
    step(true);
    const Copies lent = copied(ctx, ZS_COPIES_LAST_STEP);
    Copies want_lent = want;
    want_lent["grad_into_bucket"] -= direct_numel * 4;
    EXPECT_EQ(lent, want_lent) << "lent: " << describe(lent) << "; expected " << describe(want_lent);
    const Copies total = copied(ctx, ZS_COPIES_TOTAL);
    for (const auto& [k, v] : total)
      EXPECT_EQ(v, first.at(k) + second.at(k) + lent.at(k)) << k << ": the spans add up";
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CopiedBytes, ::testing::Values(1, 2, 3));

// communication_data_type bf16: every gradient narrows into a 16-bit
// bucket (the direct route is fp32's), each reduce-scatter's result is
// widened once, then stored.
TEST(CopiedBytesWire, SixteenBitBucketsWidenOnce) {
  run_ranks(2, [](const RankEnv& env) {
    const int g = env.world;
    zs_context ctx = zs::test::make_context(
        env, "{\"communication_data_type\": \"bf16\", \"zero_optimization\": {\"reduce_bucket_size\": 4000}}");
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> ps;
    uint64_t numel = 0, shards = 0;
    for (size_t k = 0; k < 3; ++k) {
      ps.push_back(register_vector(ctx, "w" + std::to_string(k), kF32Sizes[k]));
      numel += static_cast<uint64_t>(kF32Sizes[k]);
      shards += shard_of(kF32Sizes[k], g);
    }
    const Copies before = copied(ctx, ZS_COPIES_TOTAL);
    for (size_t k = 0; k < 3; ++k) {
      const auto gr = grad_f32(env.rank, k, kF32Sizes[k]);
      ZS_ASSERT_OK(zs_grad_push(ps[k], gr.data(), ZS_FLOAT32, gr.size() * 4));
    }
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    Copies got = copied(ctx, ZS_COPIES_TOTAL);
    for (auto& [k, v] : got) v -= before.at(k);
    // Blocks of 2000 wire elements: 501, then 1500 + 25 (both flushes of
    // partly filled buckets, reduced from where their blocks lie).
    EXPECT_EQ(got.at("grad_into_bucket"), numel * 2) << describe(got);
    EXPECT_EQ(got.at("bucket_compaction"), 0u) << describe(got);
    EXPECT_EQ(got.at("wire_widen"), shards * 4) << describe(got);
    EXPECT_EQ(got.at("into_grad_shard"), shards * 4) << describe(got);
    uint64_t rest = 0;
    for (const auto& [k, v] : got)
      if (k != "grad_into_bucket" && k != "bucket_compaction" && k != "wire_widen" && k != "into_grad_shard") rest += v;
    EXPECT_EQ(rest, 0u) << describe(got);
    zs_context_destroy(ctx);
  });
}

// A group of one (here a world of one): its reduce-scatter is the
// identity, so each gradient goes straight into its shard in one pass, no
// bucket. The shard holds bit for bit what the bucket route gave: each
// value widened and divided by the accumulation steps (rounded through a
// 16-bit wire when there is one), the first micro-step assigned (0 + v),
// the next added; and the sum of squares the write took is the one a pass
// over the shard finds (zs_grad_clip_norm reads it). Sizes over the
// kernels' parallel grain (70001: blocks on several threads) and not.
struct OneCase {
  const char* config;
  int steps;          // accumulation steps: each micro-step pushes once
  zs_dtype dtype;     // of the pushed gradients
  bool bf16_wire;
};

class GroupOfOne : public ::testing::TestWithParam<OneCase> {};

TEST_P(GroupOfOne, StoresStraightIntoTheShardAsTheBucketDid) {
  const OneCase c = GetParam();
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, c.config);
    ASSERT_NE(ctx, nullptr);
    ZS_ASSERT_OK(zs_grad_set_accumulation_steps(ctx, c.steps));
    const int64_t sizes[] = {70001, 1001};
    const auto divisor = static_cast<float>(c.steps);
    for (size_t k = 0; k < 2; ++k) {
      const int64_t n = sizes[k];
      zs_param p = register_vector(ctx, "g" + std::to_string(k), n);
      std::vector<float> want(static_cast<size_t>(n));
      const Copies before = copied(ctx, ZS_COPIES_TOTAL);
      for (int m = 0; m < c.steps; ++m) {
        std::vector<float> g(static_cast<size_t>(n));
        for (size_t i = 0; i < g.size(); ++i)
          g[i] = std::sin(static_cast<float>(i) * 0.37f + static_cast<float>(m * 5 + k)) * (i % 7 == 0 ? -1e-3f : 3.1f);
        if (n > 8) g[3] = -0.0f;  // assigned: 0 + -0 is +0
        std::vector<uint16_t> h(g.size());
        for (size_t i = 0; i < g.size(); ++i) {
          h[i] = zs::kernels::float_to_bf16(g[i]);
          float v = c.dtype == ZS_BFLOAT16 ? zs::kernels::bf16_to_float(h[i]) : g[i];
          if (divisor != 1.0f) v = v / divisor;
          if (c.bf16_wire) v = zs::kernels::bf16_to_float(zs::kernels::float_to_bf16(v));
          want[i] = m == 0 ? 0.0f + v : want[i] + v;
        }
        if (c.dtype == ZS_BFLOAT16) ZS_ASSERT_OK(zs_grad_push(p, h.data(), ZS_BFLOAT16, h.size() * 2));
        else ZS_ASSERT_OK(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * 4));
      }
      ZS_ASSERT_OK(zs_grad_sync(ctx));
      Copies got = copied(ctx, ZS_COPIES_TOTAL);
      for (auto& [kind, v] : got) v -= before.at(kind);
      // One pass a micro-step, the shard's bytes; nothing else.
      EXPECT_EQ(got.at("into_grad_shard"), static_cast<uint64_t>(c.steps) * static_cast<uint64_t>(n) * 4)
          << describe(got);
      uint64_t all = 0;
      for (const auto& [kind, v] : got) all += v;
      EXPECT_EQ(all, got.at("into_grad_shard")) << describe(got);
      double norm = 0.0;
      ZS_ASSERT_OK(zs_grad_clip_norm(ctx, &p, 1, 1e30, &norm));  // before the read below forgets the sum
      const auto sumsq = static_cast<float>(zs::kernels::sum_squares(want.data(), want.size()));
      EXPECT_EQ(norm, std::sqrt(static_cast<double>(sumsq))) << "param " << k;
      const auto shard = zs::test::grad_shard_copy(p);
      ASSERT_EQ(shard.size(), want.size());
      EXPECT_EQ(std::memcmp(shard.data(), want.data(), want.size() * 4), 0) << "param " << k;
      ZS_ASSERT_OK(zs_param_destroy(p));
    }
    zs_context_destroy(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GroupOfOne,
    ::testing::Values(OneCase{"{}", 1, ZS_FLOAT32, false}, OneCase{"{}", 3, ZS_FLOAT32, false},
                      OneCase{"{}", 2, ZS_BFLOAT16, false},
                      OneCase{"{\"communication_data_type\": \"bf16\"}", 1, ZS_FLOAT32, true},
                      OneCase{"{\"communication_data_type\": \"bf16\"}", 3, ZS_FLOAT32, true},
                      OneCase{"{\"communication_data_type\": \"bf16\"}", 2, ZS_BFLOAT16, true}));

TEST(CopiedBytesApi, NamesAndRefusals) {
  run_ranks(1, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env);
    ASSERT_NE(ctx, nullptr);
    EXPECT_STREQ(zs_copy_kind_name(ZS_COPY_GRAD_INTO_BUCKET), "grad_into_bucket");
    EXPECT_STREQ(zs_copy_kind_name(ZS_COPY_INTO_GRAD_SHARD), "into_grad_shard");
    EXPECT_STREQ(zs_copy_kind_name(ZS_COPY_MASTER_REFRESH), "master_refresh");
    EXPECT_STREQ(zs_copy_kind_name(ZS_COPY_OTHER), "other");
    EXPECT_EQ(zs_copy_kind_name(ZS_COPY_KIND_COUNT), nullptr);
    EXPECT_EQ(zs_copy_kind_name(static_cast<zs_copy_kind>(-1)), nullptr);
    size_t n = 0;
    uint64_t total = 1;
    // A smaller array: the first kinds only; the count and total still come.
    uint64_t two[2] = {7, 7};
    EXPECT_EQ(zs_copied_bytes(ctx, ZS_COPIES_TOTAL, two, 2, &n, &total), ZS_OK) << zs_last_error();
    EXPECT_EQ(n, static_cast<size_t>(ZS_COPY_KIND_COUNT));
    EXPECT_EQ(zs_copied_bytes(ctx, ZS_COPIES_LAST_STEP, nullptr, 0, nullptr, &total), ZS_OK);
    EXPECT_EQ(total, 0u);
    EXPECT_EQ(zs_copied_bytes(ctx, ZS_COPIES_TOTAL, nullptr, 3, &n, &total), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(zs_copied_bytes(ctx, static_cast<zs_copy_span>(2), two, 2, &n, &total), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("ZS_COPIES_LAST_STEP"), std::string::npos) << zs_last_error();
    EXPECT_EQ(zs_copied_bytes(nullptr, ZS_COPIES_TOTAL, two, 2, &n, &total), ZS_ERR_INVALID_HANDLE);
    zs_context_destroy(ctx);
  });
}

}  // namespace
