// Parameter shards on NVMe (offload_param.device = "nvme") train bit for bit
// as in memory: full params and every rank's optimizer state after 20 steps
// on 1 to 4 real ranks, fp32, bf16 and fp16 params of odd sizes, with a
// cache of none, part or all of the shards (max_in_cpu), alone and with the
// optimizer state on NVMe too (sub-groups cutting params), and under MiCS
// shard groups and hpZ secondary shards. The shards in
// memory stay within max_in_cpu between calls; checkpoints save and load
// offloaded shards; a disk too small fails registration before step 1 and a
// truncated swap file is an I/O error naming it, not wrong numbers.
#include <gtest/gtest.h>

#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/ckpt_model.h"
#include "tests/support/io_uring_probe.h"
#include "tests/support/multirank.h"
#include "tests/support/swap_dir.h"

using zs::test::bitwise_equal;
using zs::test::CkptModel;
using zs::test::RankEnv;
using zs::test::run_ranks;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBig = 3001;  // odd: padded shards at 2, 3 and 4 ranks
constexpr int kSteps = 20;

std::string param_nvme(const std::string& dir, int64_t max_in_cpu, const std::string& optimizer = "",
                       const std::string& topology = "") {
  return R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": ")" + dir +
         R"(", "max_in_cpu": )" + std::to_string(max_in_cpu) + "}" +
         (optimizer.empty() ? "" : ", " + optimizer) + (topology.empty() ? "" : ", " + topology) +
         R"(}, "aio": {"block_size": 8192, "queue_depth": 4}})";
}

std::string optimizer_nvme(const std::string& dir, int64_t sub_group) {
  return R"("sub_group_size": )" + std::to_string(sub_group) +
         R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir +
         R"(", "buffer_count": 2, "pipeline_read": true, "pipeline_write": true})";
}

// Optimizer state (every slot the optimizer has) then full params, per
// rank, after kSteps steps. State first: slot 0 of an fp32 param is its
// shard, which zs_optimizer_state_data brings back into memory for good.
std::vector<std::vector<float>> train(int world, zs_dtype dtype, const std::string& config,
                                      const std::string& out, int64_t max_in_cpu = -1) {
  run_ranks(world, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, dtype, ZS_OPTIM_ADAMW, kBig, 30000,
                                            config.empty() ? nullptr : config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, kSteps);
    zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(m.ctx, &mem));
    // A CPU context: every engine byte is in (unpinned) host memory.
    EXPECT_EQ(mem.device_bytes, 0u);
    EXPECT_EQ(mem.host_bytes, mem.shard_bytes + mem.gathered_bytes + mem.grad_bytes + mem.optimizer_bytes +
                                  mem.hpz_secondary_bytes + mem.loco_error_bytes);
    EXPECT_GT(mem.host_bytes, 0u);
    EXPECT_EQ(mem.host_pinned_bytes, 0u);
    if (max_in_cpu >= 0) {
      // Between calls only the cache is in memory; the file holds them all.
      const uint64_t elem = dtype == ZS_FLOAT32 ? 4 : 2;
      EXPECT_LE(mem.shard_bytes, static_cast<uint64_t>(max_in_cpu) * elem) << "rank " << env.rank;
      const uint64_t file = zs::test::swap_file_bytes(zs::test::nvme_path_in(config), "params", env.rank);
      EXPECT_GE(file, kBig / world * elem) << "rank " << env.rank;
      EXPECT_LE(file, mem.nvme_bytes) << "rank " << env.rank;
    }
    auto all = zs::test::optimizer_values(m);
    const auto full = zs::test::full_values(m);
    all.insert(all.end(), full.begin(), full.end());
    zs::test::write_floats(out + "." + std::to_string(env.rank), all);
    zs::test::destroy_ckpt_model(m);
  });
  return zs::test::read_per_rank(out, world);
}

struct Case {
  int world;
  zs_dtype dtype;
  int64_t max_in_cpu;       // elements of idle shards kept in memory
  int64_t optimizer_subgroup;  // 0: optimizer state in memory
  const char* topology = "";   // zero_optimization keys for MiCS or hpZ, in both runs
  const char* name = "";
};

class ParamOffload : public ::testing::TestWithParam<Case> {};

TEST_P(ParamOffload, NvmeTrainsBitwiseAsInMemory) {
  ZS_SKIP_WITHOUT_IO_URING();
  const Case c = GetParam();
  const std::string dir = zs::test::make_temp_dir("param_offload");
  const std::string topology = c.topology;
  const auto plain = train(c.world, c.dtype, topology.empty() ? "" : R"({"zero_optimization": {)" + topology + "}}",
                           dir + "/plain");
  const std::string opt = c.optimizer_subgroup > 0 ? optimizer_nvme(dir + "/swap", c.optimizer_subgroup) : "";
  const auto nvme = train(c.world, c.dtype, param_nvme(dir + "/swap", c.max_in_cpu, opt, topology),
                          dir + "/nvme", c.max_in_cpu);
  for (int r = 0; r < c.world; ++r) {
    ASSERT_FALSE(plain[r].empty()) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(plain[r], nvme[r])) << "rank " << r << ": " << plain[r].size() << " vs "
                                                  << nvme[r].size() << " values";
  }
  EXPECT_TRUE(fs::is_empty(dir + "/swap")) << "a swap file outlived its context";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ParamOffload,
    ::testing::Values(Case{1, ZS_FLOAT32, 0, 0}, Case{2, ZS_FLOAT32, 0, 0}, Case{2, ZS_BFLOAT16, 500, 0},
                      Case{3, ZS_FLOAT32, 1000000000, 0}, Case{3, ZS_FLOAT16, 0, 0},
                      Case{4, ZS_BFLOAT16, 100, 0}, Case{2, ZS_FLOAT32, 0, 333},
                      Case{3, ZS_BFLOAT16, 40, 7},
                      Case{4, ZS_FLOAT32, 0, 0, R"("mics_shard_size": 2)", "_mics2"},
                      Case{4, ZS_BFLOAT16, 0, 100, R"("zero_hpz_partition_size": 2)", "_hpz2"}),
    [](const ::testing::TestParamInfo<Case>& i) {
      const Case& c = i.param;
      const char* dt = c.dtype == ZS_FLOAT32 ? "_fp32" : c.dtype == ZS_BFLOAT16 ? "_bf16" : "_fp16";
      return "world" + std::to_string(c.world) + dt + "_maxincpu" + std::to_string(c.max_in_cpu) +
             (c.optimizer_subgroup > 0 ? "_optimizernvme_subgroup" + std::to_string(c.optimizer_subgroup)
                                       : "") +
             c.name;
    });

TEST(ParamOffloadCpu, OnACpuContextShardsAreAlreadyInHostMemory) {
  const std::string dir = zs::test::make_temp_dir("param_offload_cpu");
  const auto plain = train(2, ZS_BFLOAT16, "", dir + "/plain");
  const auto cpu = train(2, ZS_BFLOAT16, R"({"zero_optimization": {"offload_param": {"device": "cpu"}}})",
                         dir + "/cpu");
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(plain[r], cpu[r])) << "rank " << r;
  fs::remove_all(dir);
}

TEST(ParamOffloadCheckpoint, SavesAndLoadsOffloadedShards) {
  ZS_SKIP_WITHOUT_IO_URING();
  // Offloaded run: 3 steps, save, 3 more. A fresh offloaded run, and one
  // without offload, load and train 3: the same full params bit for bit.
  const std::string dir = zs::test::make_temp_dir("param_offload_ckpt");
  const std::string config = param_nvme(dir + "/swap", 0);
  auto write_params = [&](CkptModel& m, const std::string& name) {
    zs::test::write_floats(dir + "/" + name + "." + std::to_string(m.rank), zs::test::full_values(m));
  };
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW, kBig, 30000, config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 3);
    zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    ZS_ASSERT_OK(zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, (dir + "/ckpt").c_str(), &so));
    zs::test::train_ckpt_model(m, 3);
    write_params(m, "straight");
    zs::test::destroy_ckpt_model(m);
  });
  EXPECT_EQ(zs_checkpoint_verify((dir + "/ckpt").c_str(), nullptr, nullptr, nullptr), ZS_OK) << zs_last_error();
  for (const bool offload : {true, false}) {
    run_ranks(2, [&](const RankEnv& env) {
      CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW, kBig, 30000,
                                              offload ? config.c_str() : nullptr);
      ASSERT_NE(m.ctx, nullptr);
      zs::test::train_ckpt_model(m, 1);  // values the load must replace
      zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
      ZS_ASSERT_OK(zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, (dir + "/ckpt").c_str(),
                                      &lo, nullptr));
      zs::test::train_ckpt_model(m, 3);
      write_params(m, "resumed");
      zs::test::destroy_ckpt_model(m);
    });
    for (int r = 0; r < 2; ++r) {
      const auto a = zs::test::read_floats(dir + "/straight." + std::to_string(r));
      const auto b = zs::test::read_floats(dir + "/resumed." + std::to_string(r));
      ASSERT_FALSE(a.empty());
      EXPECT_TRUE(bitwise_equal(a, b)) << (offload ? "offloaded" : "in memory") << " resume, rank " << r;
    }
  }
  fs::remove_all(dir);
}

zs_param register_big(zs_context ctx, int64_t n, const char* name = "w") {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = name;
  o.dtype = ZS_FLOAT32;
  o.ndim = 1;
  o.shape = &n;
  o.init = ZS_INIT_NORMAL;
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

TEST(ParamOffloadErrors, ADiskTooSmallFailsRegistrationBeforeAnyStep) {
  // A 1 MiB tmpfs for the swap file (mounting needs root).
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("param_offload_small");
  if (const std::string why = zs::test::mount_small_tmpfs(dir); !why.empty()) GTEST_SKIP() << why;
  const std::string config = param_nvme(dir, 0);
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config.c_str());
    ASSERT_NE(ctx, nullptr);
    zs_param small = register_big(ctx, 1000, "fits");
    ASSERT_NE(small, nullptr);
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    const int64_t n = 600000;  // 2400000 bytes: more than the disk
    o.name = "too_big";
    o.ndim = 1;
    o.shape = &n;
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("offload_param.nvme_path '" + dir + "': needs 2400256 bytes, "), std::string::npos) << msg;
    EXPECT_NE(msg.find(" bytes free"), std::string::npos) << msg;
    // The param that fitted is intact.
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &small, 1));
    ZS_ASSERT_OK(zs_gather_wait(g, -1));
    zs_gather_destroy(g);
    ZS_ASSERT_OK(zs_release(ctx, &small, 1));
    zs_context_destroy(ctx);
  });
  EXPECT_EQ(umount(dir.c_str()), 0) << std::strerror(errno);
  fs::remove_all(dir);
}

TEST(ParamOffloadErrors, ATruncatedSwapFileIsAnIoErrorNamingIt) {
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("param_offload_trunc");
  const std::string config = param_nvme(dir, 0);
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config.c_str());
    ASSERT_NE(ctx, nullptr);
    zs_param p = register_big(ctx, 5000);
    ASSERT_NE(p, nullptr);
    std::string file;
    for (const auto& e : fs::directory_iterator(dir)) file = e.path().string();
    ASSERT_FALSE(file.empty());
    ASSERT_EQ(::truncate(file.c_str(), 0), 0);
    // The read-back runs on the gather's thread: the gather fails with it.
    zs_gather g = nullptr;
    ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
    EXPECT_EQ(zs_gather_wait(g, -1), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("reading back param 'w' (float32 [5000]) from the param swap file"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected end of file"), std::string::npos) << msg;
    zs_gather_destroy(g);
    zs_context_destroy(ctx);
  });
  fs::remove_all(dir);
}

}  // namespace
