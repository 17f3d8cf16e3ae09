// Ranks that disagree on a collective get an error naming both sides within
// a second or so, on every rank, instead of an abort inside Gloo (sizes
// differ), silently mixed numbers (sizes agree), or a hang. Each rank's
// stderr carries its last collectives (the flight recorder).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

constexpr int kTimeoutMs = 20000;  // the collective timeout: never what ends these cases

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

zs_param make_param(zs_context ctx, const char* name, std::vector<int64_t> shape,
                    zs_dtype dtype = ZS_FLOAT32) {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name;
  o.ndim = static_cast<int>(shape.size());
  o.shape = shape.data();
  o.dtype = dtype;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

// Fetches one param and returns (status, message, seconds).
struct Outcome {
  zs_status status;
  std::string message;
  double seconds;
};
Outcome fetch_one(zs_context ctx, zs_param p) {
  const auto t0 = std::chrono::steady_clock::now();
  zs_gather g = nullptr;
  zs_status s = zs_fetch(&g, ctx, &p, 1);
  if (s == ZS_OK) s = zs_gather_wait(g, ZS_WAIT_FOREVER);
  Outcome out{s, s == ZS_OK ? "" : zs_last_error(), seconds_since(t0)};
  if (g) zs_gather_destroy(g);
  return out;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Sends this rank's stderr to a file, to read the flight recorder back.
std::string capture_stderr(const RankEnv& env) {
  const std::string path = ::testing::TempDir() + "zs_identity_stderr_" + std::to_string(getpid()) +
                           "_" + std::to_string(env.rank);
  const int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  EXPECT_GE(fd, 0);
  dup2(fd, 2);
  close(fd);
  return path;
}
std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Same sizes, different params: before, both ranks got ZS_OK and each
// other's bytes.
TEST(CollectiveIdentity, RanksFetchingDifferentParamsOfTheSameSizeAreTold) {
  run_ranks(2, [](const RankEnv& env) {
    const std::string log = capture_stderr(env);
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param a = make_param(ctx, "layer3.weight", {64, 64});
    zs_param b = make_param(ctx, "layer4.weight", {64, 64});
    ASSERT_EQ(fetch_one(ctx, a).status, ZS_OK);  // in step: works
    ZS_ASSERT_OK(zs_release(ctx, &a, 1));
    const Outcome o = fetch_one(ctx, env.rank == 0 ? a : b);
    EXPECT_EQ(o.status, ZS_ERR_COMM) << o.message;
    EXPECT_LT(o.seconds, 3.0) << o.message;
    EXPECT_TRUE(contains(o.message, "ranks disagree on collective")) << o.message;
    EXPECT_TRUE(contains(o.message, "rank 0 runs")) << o.message;
    EXPECT_TRUE(contains(o.message, "'layer3.weight' (float32 [64, 64])")) << o.message;
    EXPECT_TRUE(contains(o.message, "where rank 1 runs")) << o.message;
    EXPECT_TRUE(contains(o.message, "'layer4.weight' (float32 [64, 64])")) << o.message;
    // The flight recorder: this rank's collectives, the one that parted last.
    const std::string err = read_file(log);
    EXPECT_TRUE(contains(err, "its last collectives on the group")) << err;
    EXPECT_TRUE(contains(err, "did not complete")) << err;
    EXPECT_TRUE(contains(err, "'layer3.weight'")) << err;
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// Params of one name and shape (every expert's "Linear.weight", as a
// binding names params by their module's type): before, ranks fetching
// different ones agreed and mixed their bytes. The registration number
// tells them apart, alone and among more params than the label names.
TEST(CollectiveIdentity, RanksFetchingDifferentParamsOfTheSameNameAndShapeAreTold) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> experts;
    for (int i = 0; i < 4; ++i) experts.push_back(make_param(ctx, "Linear.weight", {16, 16}));
    ASSERT_EQ(fetch_one(ctx, experts[1]).status, ZS_OK);  // in step: works
    ZS_ASSERT_OK(zs_release(ctx, &experts[1], 1));
    const Outcome o = fetch_one(ctx, experts[env.rank == 0 ? 0 : 1]);
    EXPECT_EQ(o.status, ZS_ERR_COMM) << o.message;
    EXPECT_LT(o.seconds, 3.0) << o.message;
    EXPECT_TRUE(contains(o.message, "ranks disagree on collective")) << o.message;
    EXPECT_TRUE(contains(o.message, "'Linear.weight' (float32 [16, 16]) #1")) << o.message;
    EXPECT_TRUE(contains(o.message, "'Linear.weight' (float32 [16, 16]) #2")) << o.message;
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    std::vector<zs_param> experts;
    for (int i = 0; i < 4; ++i) experts.push_back(make_param(ctx, "Linear.weight", {16, 16}));
    // Three of the four: the first two named, the third only in the hash.
    std::vector<zs_param> mine = {experts[0], experts[1], experts[env.rank == 0 ? 2 : 3]};
    const auto t0 = std::chrono::steady_clock::now();
    zs_gather g = nullptr;
    zs_status s = zs_fetch(&g, ctx, mine.data(), mine.size());
    if (s == ZS_OK) s = zs_gather_wait(g, ZS_WAIT_FOREVER);
    const std::string msg = s == ZS_OK ? "" : zs_last_error();
    EXPECT_EQ(s, ZS_ERR_COMM) << msg;
    EXPECT_LT(seconds_since(t0), 3.0) << msg;
    EXPECT_TRUE(contains(msg, "and 1 more [params ")) << msg;
    if (g) zs_gather_destroy(g);
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// Different sizes: before, Gloo's "op.preamble.length <= op.nbytes" killed
// the process on its own thread.
TEST(CollectiveIdentity, DifferentSizesAreAnErrorNotAnAbort) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, "w", {env.rank == 0 ? int64_t{1000} : int64_t{1001}});
    const Outcome o = fetch_one(ctx, p);
    EXPECT_EQ(o.status, ZS_ERR_COMM) << o.message;
    EXPECT_LT(o.seconds, 3.0) << o.message;
    EXPECT_TRUE(contains(o.message, "param 'w' (float32 [1000])")) << o.message;
    EXPECT_TRUE(contains(o.message, "param 'w' (float32 [1001])")) << o.message;
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// [3, 4] against [4, 3]: the same bytes, a different tensor.
TEST(CollectiveIdentity, TransposedShapesAreTold) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, "w", env.rank == 0 ? std::vector<int64_t>{3, 4}
                                                    : std::vector<int64_t>{4, 3});
    const Outcome o = fetch_one(ctx, p);
    EXPECT_EQ(o.status, ZS_ERR_COMM) << o.message;
    EXPECT_TRUE(contains(o.message, "[3, 4]") && contains(o.message, "[4, 3]")) << o.message;
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// Evaluating on rank 0 only: rank 0 runs an all-reduce of its own while
// rank 1 goes on to the barrier both meant to meet at.
TEST(CollectiveIdentity, ACollectiveOnOneRankOnlyIsTold) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_group group = nullptr;
    const int ranks[2] = {0, 1};
    ZS_ASSERT_OK(zs_group_create(&group, ctx, ranks, 2));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> x(256, 1.0f);
    zs_work w = nullptr;
    if (env.rank == 0) {
      ZS_ASSERT_OK(zs_allreduce(&w, group, x.data(), x.data(), x.size(), ZS_FLOAT32, ZS_SUM));
    } else {
      ZS_ASSERT_OK(zs_barrier(&w, group));
    }
    const zs_status s = zs_work_wait(w, ZS_WAIT_FOREVER);
    const std::string msg = zs_last_error();
    EXPECT_EQ(s, ZS_ERR_COMM) << msg;
    EXPECT_LT(seconds_since(t0), 3.0) << msg;
    EXPECT_TRUE(contains(msg, "rank 0 runs #1 all-reduce (256 x float32, sum)")) << msg;
    EXPECT_TRUE(contains(msg, "rank 1 runs #1 barrier")) << msg;
    zs_work_destroy(w);
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// `world` ranks, of which `differing` alone fetches another param: every
// rank is told within `within_s`, the agreeing ones included, naming both
// params, and a verdict passed on names who stopped first once.
void one_rank_differs(int world, int differing, double within_s) {
  run_ranks(world, [=](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param a = make_param(ctx, "a", {300});
    zs_param b = make_param(ctx, "b", {300});
    const Outcome o = fetch_one(ctx, env.rank == differing ? b : a);
    EXPECT_EQ(o.status, ZS_ERR_COMM) << o.message;
    EXPECT_LT(o.seconds, within_s) << o.message;
    EXPECT_TRUE(contains(o.message, "param 'a'") && contains(o.message, "param 'b'")) << o.message;
    const size_t first = o.message.find("stopped first");
    EXPECT_TRUE(first == std::string::npos || o.message.find("stopped first", first + 1) == std::string::npos)
        << o.message;
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  }, 60);
}

TEST(CollectiveIdentity, EveryRankIsToldWhenOneOfThreeDiffers) { one_rank_differs(3, 2, 3.0); }

// Past the full mesh each rank reads only its pair peers' notes (2 log N,
// not N): of 8 ranks with ZS_FULL_MESH_MAX=2, rank 3 alone differs; its
// neighbours find it, and the verdict passes on to every rank.
TEST(CollectiveIdentity, EveryRankPastTheFullMeshIsToldWhenOneDiffers) {
  const zs::test::ScopedEnv sparse("ZS_FULL_MESH_MAX", "2");
  one_rank_differs(8, 3, 6.0);
}

// Agreeing ranks whose collective is merely slow (one rank arrives 1.5 s
// late) are not told anything: the check compares identities, not time.
TEST(CollectiveIdentity, ALateRankIsNotAMismatch) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, "w", {4096});
    if (env.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const Outcome o = fetch_one(ctx, p);
    EXPECT_EQ(o.status, ZS_OK) << o.message;
    ZS_EXPECT_OK(zs_release(ctx, &p, 1));
    zs_param_destroy(p);
    EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
  });
}

}  // namespace

// A rank that is late by more than ZS_STRAGGLER_WARN_MS is named, with the
// collective, by the ranks that wait for it, long before the timeout; the
// collective then completes as usual, and the late rank warns of nothing.
TEST(StragglerWarning, WaitingRanksNameTheRankThatHasNotArrived) {
  run_ranks(3, [](const RankEnv& env) {
    setenv("ZS_STRAGGLER_WARN_MS", "800", 1);
    const std::string log = capture_stderr(env);
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_param p = make_param(ctx, "late.weight", {4096});
    if (env.rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    const Outcome o = fetch_one(ctx, p);
    EXPECT_EQ(o.status, ZS_OK) << o.message;
    const std::string text = read_file(log);
    if (env.rank == 2) {
      EXPECT_FALSE(contains(text, "warning")) << text;
    } else {
      EXPECT_TRUE(contains(text, "zeroshard: warning: rank " + std::to_string(env.rank) +
                                     " of group")) << text;
      EXPECT_TRUE(contains(text, "1 of 3 ranks have not arrived: rank 2")) << text;
      EXPECT_TRUE(contains(text, "late.weight")) << text;
      EXPECT_FALSE(contains(text, "rank 0 (")) << text;
    }
    ZS_EXPECT_OK(zs_release(ctx, &p, 1));
    zs_param_destroy(p);
    EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// In a sub-group the straggler is named by its group rank and its world
// rank; a wait in which everyone has arrived (here: none, the late rank is
// not in the group) warns of nothing.
TEST(StragglerWarning, SubGroupNamesWorldRanks) {
  run_ranks(3, [](const RankEnv& env) {
    setenv("ZS_STRAGGLER_WARN_MS", "800", 1);
    const std::string log = capture_stderr(env);
    zs_context ctx = zs::test::make_context(env, nullptr, kTimeoutMs);
    ASSERT_NE(ctx, nullptr);
    zs_group group = nullptr;
    const int ranks[2] = {1, 2};
    ZS_ASSERT_OK(zs_group_create(&group, ctx, ranks, 2));
    if (env.rank != 0) {
      if (env.rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      std::vector<float> x(1000, 1.0f);
      zs_work w = nullptr;
      ZS_ASSERT_OK(zs_allreduce(&w, group, x.data(), x.data(), x.size(), ZS_FLOAT32, ZS_SUM));
      ZS_EXPECT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
      EXPECT_EQ(x[999], 2.0f);
      zs_work_destroy(w);
      const std::string text = read_file(log);
      if (env.rank == 1) {
        EXPECT_TRUE(contains(text, "rank 0 (world rank 1) of group")) << text;
        EXPECT_TRUE(contains(text, "rank 1 (world rank 2)")) << text;
        EXPECT_TRUE(contains(text, "all-reduce (1000 x float32, sum)")) << text;
      } else {
        EXPECT_FALSE(contains(text, "warning")) << text;
      }
    }
    zs_group_destroy(group);
    EXPECT_EQ(zs_context_destroy(ctx), ZS_OK) << zs_last_error();
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}
