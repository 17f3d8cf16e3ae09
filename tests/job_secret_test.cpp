// The job secret (ZS_JOB_SECRET): the store serves only connections that
// prove it, the ranks prove it to each other over every transport pair, and
// every disagreement is a Bootstrap error that says which secret to fix.
#include <gtest/gtest.h>

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "impl/comm/store/job_secret.h"
#include "impl/comm/store/store.h"
#include "impl/common/error.h"
#include "tests/support/expect_error.h"
#include "tests/support/multirank.h"

using namespace std::chrono_literals;
using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

constexpr const char* kSecret = "0123456789abcdef-this-job";
constexpr const char* kOther = "fedcba9876543210-another-job";

std::string bootstrap_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::Bootstrap) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected a Bootstrap error";
  return "";
}

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(JobSecret, StoreServesOnlyClientsThatProveIt) {
  setenv("ZS_JOB_SECRET", kSecret, 1);
  int port = 0;
  auto server = zs::make_tcp_store("127.0.0.1", 0, true, 2000ms, &port, "rank 0");
  auto good = zs::make_tcp_store("127.0.0.1", port, false, 2000ms, nullptr, "rank 1");
  good->set("k", bytes("v"));

  setenv("ZS_JOB_SECRET", kOther, 1);
  std::string msg = bootstrap_error([&] { zs::make_tcp_store("127.0.0.1", port, false, 2000ms, nullptr, "rank 2"); });
  EXPECT_NE(msg.find("refused this rank's job secret"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ZS_JOB_SECRET"), std::string::npos) << msg;
  // The impostor named itself "rank 2" and was dropped: that is not rank 2
  // leaving the job.
  EXPECT_FALSE(server->check(zs::kGoneKey));

  unsetenv("ZS_JOB_SECRET");
  msg = bootstrap_error([&] { zs::make_tcp_store("127.0.0.1", port, false, 2000ms); });
  EXPECT_NE(msg.find("checks a job secret and this rank has none"), std::string::npos) << msg;

  // The store goes on serving the job.
  EXPECT_EQ(good->get("k"), bytes("v"));
}

TEST(JobSecret, ARankWithASecretRefusesAStoreWithout) {
  unsetenv("ZS_JOB_SECRET");
  int port = 0;
  auto server = zs::make_tcp_store("127.0.0.1", 0, true, 2000ms, &port);
  setenv("ZS_JOB_SECRET", kSecret, 1);
  const std::string msg =
      bootstrap_error([&] { zs::make_tcp_store("127.0.0.1", port, false, 2000ms); });
  EXPECT_NE(msg.find("checks none"), std::string::npos) << msg;
  unsetenv("ZS_JOB_SECRET");
}

TEST(JobSecret, ShortSecretIsRefused) {
  setenv("ZS_JOB_SECRET", "short", 1);
  const std::string msg = bootstrap_error([] { zs::job_secret(); });
  EXPECT_NE(msg.find("at least 16"), std::string::npos) << msg;
  unsetenv("ZS_JOB_SECRET");
}

TEST(JobSecret, ProofsDependOnSecretPurposeAndChallenge) {
  const std::string c = zs::make_challenge();
  EXPECT_EQ(c.size(), zs::kChallengeBytes);
  EXPECT_NE(c, zs::make_challenge());
  const std::string p = zs::job_proof(kSecret, "store client rank 1", c);
  EXPECT_TRUE(zs::proofs_equal(p, zs::job_proof(kSecret, "store client rank 1", c)));
  EXPECT_FALSE(zs::proofs_equal(p, zs::job_proof(kOther, "store client rank 1", c)));
  EXPECT_FALSE(zs::proofs_equal(p, zs::job_proof(kSecret, "store client rank 2", c)));
  EXPECT_FALSE(zs::proofs_equal(p, zs::job_proof(kSecret, "store client rank 1", zs::make_challenge())));
  EXPECT_FALSE(zs::proofs_equal(p, p.substr(1)));
}

TEST(JobSecret, RanksSharingTheSecretTrain) {
  run_ranks(3, [](const RankEnv& env) {
    setenv("ZS_JOB_SECRET", kSecret, 1);
    zs_context ctx = zs::test::make_context(env, nullptr, 10000);
    ASSERT_NE(ctx, nullptr);
    const int64_t shape[1] = {1001};
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "w";
    o.ndim = 1;
    o.shape = shape;
    zs_param p = nullptr;
    ZS_ASSERT_OK(zs_param_register(&p, ctx, &o));
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    ZS_ASSERT_OK(zs_gather_destroy(g));
    ZS_ASSERT_OK(zs_release(ctx, &p, 1));
    ZS_ASSERT_OK(zs_param_destroy(p));
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}

// Rank 1 of another job (another secret) reaching this job's store is
// refused at once with a message that names the variable.
TEST(JobSecret, ARankWithAnotherSecretIsRefusedAtCreate) {
  run_ranks(2, [](const RankEnv& env) {
    setenv("ZS_JOB_SECRET", env.rank == 0 ? kSecret : kOther, 1);
    zs_context_options o = zs::test::rank_options(env, nullptr, 3000);
    zs_context ctx = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const zs_status s = zs_context_create(&ctx, &o);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(s, ZS_OK);
    if (env.rank == 1) {
      EXPECT_EQ(s, ZS_ERR_BOOTSTRAP) << zs_last_error();
      EXPECT_LT(secs, 2.0);
      EXPECT_NE(std::string(zs_last_error()).find("ZS_JOB_SECRET differs from rank 0's"),
                std::string::npos)
          << zs_last_error();
    }
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
}

// Over a file store (which checks nobody), the transport pairs still do:
// ranks with different secrets never form a group.
TEST(JobSecret, TransportPairsProveTheSecret) {
  const std::string dir = ::testing::TempDir() + "zs_secret_store_" + std::to_string(getpid());
  run_ranks(2, [&](const RankEnv& env) {
    setenv("ZS_JOB_SECRET", env.rank == 0 ? kSecret : kOther, 1);
    zs_context_options o = zs::test::rank_options(env, nullptr, 5000);
    o.file_store_path = dir.c_str();
    zs_context ctx = nullptr;
    const zs_status s = zs_context_create(&ctx, &o);
    EXPECT_EQ(s, ZS_ERR_BOOTSTRAP) << zs_last_error();
    EXPECT_NE(std::string(zs_last_error()).find("failed the job-secret check"), std::string::npos)
        << zs_last_error();
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  });
  // The ranks leave without a goodbye: the directory is a failed job's.
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace
