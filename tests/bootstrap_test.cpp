// Bringing a context up from what launchers set: torchrun's, Open MPI's and
// Slurm's variables, a file-store rendezvous, and zsrun end to end.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "impl/comm/bootstrap.h"
#include "impl/common/error.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

void expect_identity(zs_context ctx, int rank, int world, int local_rank, int local_world) {
  int r = -1, w = -1, lr = -1, lw = -1;
  ZS_ASSERT_OK(zs_context_rank(ctx, &r));
  ZS_ASSERT_OK(zs_context_world_size(ctx, &w));
  ZS_ASSERT_OK(zs_context_local_rank(ctx, &lr));
  ZS_ASSERT_OK(zs_context_local_world_size(ctx, &lw));
  EXPECT_EQ(r, rank);
  EXPECT_EQ(w, world);
  EXPECT_EQ(lr, local_rank);
  EXPECT_EQ(lw, local_world);
}

// A context from the environment alone must also be able to communicate.
void allreduce_ranks(zs_context ctx, int world) {
  zs_group g = nullptr;
  ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
  float x = 1.0f;
  zs_work w = nullptr;
  ZS_ASSERT_OK(zs_allreduce(&w, g, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
  ZS_ASSERT_OK(zs_work_wait(w, 20000));
  EXPECT_EQ(x, static_cast<float>(world));
  zs_work_destroy(w);
  zs_group_destroy(g);
}

void set(const char* k, const std::string& v) { setenv(k, v.c_str(), 1); }

zs_context from_env() {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.timeout_ms = 20000;
  zs_context ctx = nullptr;
  const zs_status s = zs_context_create(&ctx, &o);
  EXPECT_EQ(s, ZS_OK) << zs_last_error();
  return ctx;
}

// Joins from the environment alone, checks the identity the launcher's
// variables give, and proves the context can communicate.
void join_from_env(int rank, int world, int local_rank, int local_world) {
  zs_context ctx = from_env();
  ASSERT_NE(ctx, nullptr);
  expect_identity(ctx, rank, world, local_rank, local_world);
  allreduce_ranks(ctx, world);
  zs_context_destroy(ctx);
}

TEST(Bootstrap, TorchrunVariables) {
  run_ranks(4, [](const RankEnv& env) {
    set("RANK", std::to_string(env.rank));
    set("WORLD_SIZE", "4");
    set("LOCAL_RANK", std::to_string(env.rank % 2));
    set("LOCAL_WORLD_SIZE", "2");
    set("MASTER_ADDR", "127.0.0.1");
    set("MASTER_PORT", std::to_string(env.port));
    join_from_env(env.rank, 4, env.rank % 2, 2);
  });
}

TEST(Bootstrap, StorePortFromOptionsThenZsStorePortThenMasterPort) {
  unsetenv("ZS_STORE_PORT");
  unsetenv("MASTER_PORT");
  unsetenv("MASTER_ADDR");
  EXPECT_EQ(zs::resolve_store_address(nullptr, -1).port, 29500);
  EXPECT_EQ(zs::resolve_store_address(nullptr, -1).host, "127.0.0.1");
  set("MASTER_PORT", "29600");
  EXPECT_EQ(zs::resolve_store_address(nullptr, -1).port, 29600);
  set("ZS_STORE_PORT", "29601");  // zsrun's: MASTER_PORT stays torch's
  EXPECT_EQ(zs::resolve_store_address(nullptr, -1).port, 29601);
  EXPECT_EQ(zs::resolve_store_address(nullptr, 29602).port, 29602);
  set("ZS_STORE_PORT", "70000");
  try {
    zs::resolve_store_address(nullptr, -1);
    ADD_FAILURE() << "a store port out of range was accepted";
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::Bootstrap);
    EXPECT_NE(std::string(e.what()).find("70000 (from ZS_STORE_PORT)"), std::string::npos)
        << e.what();
  }
  unsetenv("ZS_STORE_PORT");  // the other tests here read MASTER_PORT
  unsetenv("MASTER_PORT");
}

// A context from the environment alone rendezvouses on ZS_STORE_PORT and
// leaves MASTER_PORT alone, so another server can hold it meanwhile.
TEST(Bootstrap, ContextRendezvousOnZsStorePort) {
  run_ranks(2, [](const RankEnv& env) {
    set("RANK", std::to_string(env.rank));
    set("WORLD_SIZE", "2");
    set("MASTER_ADDR", "127.0.0.1");
    set("MASTER_PORT", "0");  // not a port: the context would fail on it
    set("ZS_STORE_PORT", std::to_string(env.port));
    join_from_env(env.rank, 2, env.rank, 2);
  });
}

TEST(Bootstrap, OpenMpiVariables) {
  run_ranks(3, [](const RankEnv& env) {
    set("OMPI_COMM_WORLD_RANK", std::to_string(env.rank));
    set("OMPI_COMM_WORLD_SIZE", "3");
    set("OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(env.rank));
    set("OMPI_COMM_WORLD_LOCAL_SIZE", "3");
    set("MASTER_PORT", std::to_string(env.port));
    join_from_env(env.rank, 3, env.rank, 3);
  });
}

TEST(Bootstrap, SlurmVariables) {
  run_ranks(4, [](const RankEnv& env) {
    set("SLURM_PROCID", std::to_string(env.rank));
    set("SLURM_NTASKS", "4");
    set("SLURM_LOCALID", std::to_string(env.rank % 2));
    set("SLURM_TASKS_PER_NODE", "2(x2)");
    set("MASTER_ADDR", "localhost");
    set("MASTER_PORT", std::to_string(env.port));
    join_from_env(env.rank, 4, env.rank % 2, 2);
  });
}

TEST(Bootstrap, FileStoreRendezvous) {
  char dir[] = "/tmp/zs_file_store_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = dir;
  run_ranks(3, [&](const RankEnv& env) {
    zs_context_options o = zs::test::rank_options(env);
    o.store_port = -1;
    o.file_store_path = path.c_str();
    zs_context ctx = nullptr;
    ZS_ASSERT_OK(zs_context_create(&ctx, &o));
    allreduce_ranks(ctx, 3);
    zs_context_destroy(ctx);
  });
  ASSERT_EQ(std::system(("rm -rf " + path).c_str()), 0);
}

TEST(Bootstrap, WorldOfOneNeedsNoEnvironment) {
  run_ranks(1, [](const RankEnv&) {
    for (const char* k : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "MASTER_PORT"}) unsetenv(k);
    join_from_env(0, 1, 0, 1);
  });
}

TEST(Bootstrap, MalformedVariablesAreNamed) {
  run_ranks(1, [](const RankEnv&) {
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    zs_context ctx = nullptr;
    set("RANK", "abc");
    set("WORLD_SIZE", "2");
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP);
    EXPECT_NE(std::string(zs_last_error()).find("RANK='abc'"), std::string::npos) << zs_last_error();
    set("RANK", "4");
    set("WORLD_SIZE", "4");
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP);
    EXPECT_NE(std::string(zs_last_error()).find("rank 4 is out of range for world size 4"), std::string::npos);
    unsetenv("RANK");
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP);
    EXPECT_NE(std::string(zs_last_error()).find("rank is unknown"), std::string::npos) << zs_last_error();
    set("RANK", "0");
    set("MASTER_PORT", "70000");
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP);
    EXPECT_NE(std::string(zs_last_error()).find("store port 70000"), std::string::npos) << zs_last_error();
  });
}

std::string run_command(const std::string& cmd, int* rc) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  *rc = pclose(f);
  return out;
}

// The C example under the launcher: every rank checks every value.
TEST(Bootstrap, ExampleUnderZsrunOnFourRanks) {
  int rc = -1;
  const std::string out = run_command(std::string(ZS_ZSRUN_PATH) + " -n 4 -- " ZS_BIN_DIR "/gather_layers 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  for (int r = 0; r < 4; ++r) {
    const std::string line = "[rank " + std::to_string(r) + "] rank " + std::to_string(r) + "/4:";
    EXPECT_NE(out.find(line), std::string::npos) << out;
  }
  EXPECT_NE(out.find("(4.00x less)"), std::string::npos) << out;
  size_t clean = 0;
  for (size_t at = out.find(", 0 wrong values"); at != std::string::npos; at = out.find(", 0 wrong values", at + 1))
    ++clean;
  EXPECT_EQ(clean, 4u) << out;
}

}  // namespace
