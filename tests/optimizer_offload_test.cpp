// Optimizer state on NVMe (offload_optimizer.device = "nvme") trains bit
// for bit as in memory: params and every rank's optimizer state after
// several steps on 2 and 3 real ranks, fp32 and bf16 params of odd sizes,
// AdamW and SGD with momentum, sub-groups that cut params, one buffer or
// several, pipelined or not. "cpu" on a CPU context is the state where it
// already is. Checkpoints save and load the swapped state; a bad nvme_path
// fails the optimizer's creation, naming it.
#include <gtest/gtest.h>

#include <sys/mount.h>

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

constexpr int64_t kBig = 3001;  // odd: padded shards at 2 and 3 ranks
constexpr int kSteps = 5;

std::string nvme_config(const std::string& dir, int64_t sub_group, int buffers, bool pipeline,
                        const char* aio = R"({"block_size": 8192, "queue_depth": 4})") {
  return R"({"zero_optimization": {"sub_group_size": )" + std::to_string(sub_group) +
         R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir +
         R"(", "buffer_count": )" + std::to_string(buffers) + R"(, "pipeline_read": )" +
         (pipeline ? "true" : "false") + R"(, "pipeline_write": )" + (pipeline ? "true" : "false") +
         R"(}}, "aio": )" + aio + "}";
}

// Full params, then this rank's optimizer state (every slot it has), per
// rank, after kSteps steps; every rank writes its own file.
std::vector<std::vector<float>> train(int world, zs_dtype dtype, zs_optimizer_kind kind,
                                      const std::string& config, const std::string& out) {
  run_ranks(world, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, dtype, kind, kBig, 30000,
                                            config.empty() ? nullptr : config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, kSteps);
    if (!config.empty() && config.find("\"nvme\"") != std::string::npos) {
      // The state really is in a swap file of this rank's.
      EXPECT_GT(zs::test::swap_file_bytes(zs::test::nvme_path_in(config), "optimizer", env.rank), 0u)
          << "no swap file of rank " << env.rank;
    }
    auto all = zs::test::full_values(m);
    const auto state = zs::test::optimizer_values(m);
    all.insert(all.end(), state.begin(), state.end());
    zs::test::write_floats(out + "." + std::to_string(env.rank), all);
    zs::test::destroy_ckpt_model(m);
  });
  return zs::test::read_per_rank(out, world);
}

struct Case {
  int world;
  zs_dtype dtype;
  zs_optimizer_kind kind;
  int64_t sub_group;
  int buffers;
  bool pipeline;
};

class OptimizerOffload : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerOffload, NvmeTrainsBitwiseAsInMemory) {
  ZS_SKIP_WITHOUT_IO_URING();
  const Case c = GetParam();
  const std::string dir = zs::test::make_temp_dir("offload");
  const auto plain = train(c.world, c.dtype, c.kind, "", dir + "/plain");
  const auto nvme = train(c.world, c.dtype, c.kind,
                          nvme_config(dir + "/swap", c.sub_group, c.buffers, c.pipeline), dir + "/nvme");
  for (int r = 0; r < c.world; ++r) {
    ASSERT_FALSE(plain[r].empty()) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(plain[r], nvme[r])) << "rank " << r << ": " << plain[r].size() << " vs "
                                                  << nvme[r].size() << " values";
  }
  // Every swap file is gone with its context.
  EXPECT_TRUE(fs::is_empty(dir + "/swap"));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OptimizerOffload,
    ::testing::Values(Case{2, ZS_FLOAT32, ZS_OPTIM_ADAMW, 333, 3, true},
                      Case{2, ZS_BFLOAT16, ZS_OPTIM_ADAMW, 333, 1, false},
                      Case{3, ZS_FLOAT32, ZS_OPTIM_SGD, 100, 2, true},
                      Case{3, ZS_BFLOAT16, ZS_OPTIM_ADAMW, 1000000000, 4, true},
                      Case{3, ZS_BFLOAT16, ZS_OPTIM_SGD, 7, 2, false}),
    [](const ::testing::TestParamInfo<Case>& i) {
      const Case& c = i.param;
      return "world" + std::to_string(c.world) + (c.dtype == ZS_FLOAT32 ? "_fp32" : "_bf16") +
             (c.kind == ZS_OPTIM_SGD ? "_sgd" : "_adamw") + "_subgroup" + std::to_string(c.sub_group) +
             "_buffers" + std::to_string(c.buffers) + (c.pipeline ? "_pipelined" : "_serial");
    });

TEST(OptimizerOffloadAio, EveryAioSettingTrainsTheSame) {
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("offload_aio");
  const auto plain = train(2, ZS_BFLOAT16, ZS_OPTIM_ADAMW, "", dir + "/plain");
  const char* aios[] = {R"({"block_size": 4096, "queue_depth": 1, "single_submit": true, "overlap_events": false})",
                        R"({"block_size": 12345, "queue_depth": 16, "intra_op_parallelism": 3})"};
  int i = 0;
  for (const char* aio : aios) {
    const auto nvme = train(2, ZS_BFLOAT16, ZS_OPTIM_ADAMW, nvme_config(dir + "/swap", 500, 2, true, aio),
                            dir + "/nvme" + std::to_string(i++));
    for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(plain[r], nvme[r])) << aio << " rank " << r;
  }
  fs::remove_all(dir);
}

TEST(OptimizerOffloadCpu, OnACpuContextTheStateIsAlreadyInHostMemory) {
  const std::string dir = zs::test::make_temp_dir("offload_cpu");
  const auto plain = train(2, ZS_BFLOAT16, ZS_OPTIM_ADAMW, "", dir + "/plain");
  const auto cpu = train(2, ZS_BFLOAT16, ZS_OPTIM_ADAMW,
                         R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", dir + "/cpu");
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(plain[r], cpu[r])) << "rank " << r;
  fs::remove_all(dir);
}

TEST(OptimizerOffloadCheckpoint, SavesAndLoadsTheSwappedState) {
  ZS_SKIP_WITHOUT_IO_URING();
  // Offloaded run: 3 steps, save, 3 more. A fresh offloaded run loads and
  // trains 3: the same params and state bit for bit; so does a run without
  // offload loading the same checkpoint.
  const std::string dir = zs::test::make_temp_dir("offload_ckpt");
  const std::string config = nvme_config(dir + "/swap", 400, 2, true);
  auto save_load = [&](zs_checkpoint_save_options* so, CkptModel& m, bool save) {
    if (save)
      return zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, (dir + "/ckpt").c_str(), so);
    zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
    return zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, (dir + "/ckpt").c_str(), &lo,
                              nullptr);
  };
  auto snapshot = [](CkptModel& m) {
    auto all = zs::test::full_values(m);
    const auto state = zs::test::optimizer_values(m);
    all.insert(all.end(), state.begin(), state.end());
    return all;
  };
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW, kBig, 30000, config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 3);
    zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    ZS_ASSERT_OK(save_load(&so, m, true));
    zs::test::train_ckpt_model(m, 3);
    zs::test::write_floats(dir + "/straight." + std::to_string(env.rank), snapshot(m));
    zs::test::destroy_ckpt_model(m);
  });
  for (const bool offload : {true, false}) {
    run_ranks(2, [&](const RankEnv& env) {
      CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW, kBig, 30000,
                                              offload ? config.c_str() : nullptr);
      ASSERT_NE(m.ctx, nullptr);
      zs::test::train_ckpt_model(m, 1);  // state the load must replace
      ZS_ASSERT_OK(save_load(nullptr, m, false));
      zs::test::train_ckpt_model(m, 3);
      zs::test::write_floats(dir + "/resumed." + std::to_string(env.rank), snapshot(m));
      zs::test::destroy_ckpt_model(m);
    });
    for (int r = 0; r < 2; ++r) {
      const auto a = zs::test::read_floats(dir + "/straight." + std::to_string(r));
      const auto b = zs::test::read_floats(dir + "/resumed." + std::to_string(r));
      ASSERT_FALSE(a.empty());
      EXPECT_TRUE(bitwise_equal(a, b)) << (offload ? "offloaded" : "in memory") << " resume, rank " << r;
    }
  }
  EXPECT_EQ(zs_checkpoint_verify((dir + "/ckpt").c_str(), nullptr, nullptr, nullptr), ZS_OK) << zs_last_error();
  fs::remove_all(dir);
}

TEST(OptimizerOffloadErrors, AnUnusableNvmePathFailsTheOptimizerNamingIt) {
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("offload_bad");
  const std::string file = dir + "/plain_file";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  const std::string config = nvme_config(file + "/sub", 100, 2, false);
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config.c_str());
    ASSERT_NE(ctx, nullptr);
    zs_optimizer opt = nullptr;
    EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("cannot create the swap file '" + file + "/sub/zeroshard-optimizer-rank0-"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("(offload_optimizer.nvme_path '" + file + "/sub'): Not a directory (errno 20)"),
              std::string::npos) << msg;
    zs_context_destroy(ctx);
  });
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(OptimizerOffloadFiles, TheSwapFileIsPreallocatedAtAddGroupAndGoesWithTheContext) {
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("offload_files");
  const std::string config = nvme_config(dir, 100, 2, true);
  run_ranks(1, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW, kBig, 30000, config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    // Before any step: the file holds every sub-group (masters and two
    // moments of each, each array rounded up to 4 KiB).
    uint64_t bytes = 0;
    int files = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      ++files;
      bytes += e.file_size();
    }
    EXPECT_EQ(files, 1);
    EXPECT_GE(bytes, 12u * (kBig + 7 * 5 + 5 + 3 * 11 + 1));
    EXPECT_EQ(bytes % 4096, 0u);
    // zs_context_memory reports the file's bytes as on NVMe.
    zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(m.ctx, &mem));
    EXPECT_EQ(mem.nvme_bytes, bytes);
    // The context goes first: the optimizer and its file go with it.
    zs_context_destroy(m.ctx);
    EXPECT_TRUE(fs::is_empty(dir));
  });
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(OptimizerOffloadErrors, ADiskTooSmallFailsAddGroupBeforeAnyStep) {
  // A 1 MiB tmpfs for the swap file (mounting needs root; elsewhere the
  // space check is covered by Swapper.NotEnoughSpace...).
  ZS_SKIP_WITHOUT_IO_URING();
  const std::string dir = zs::test::make_temp_dir("offload_small");
  if (const std::string why = zs::test::mount_small_tmpfs(dir); !why.empty()) GTEST_SKIP() << why;
  const std::string config = nvme_config(dir, 1000000, 2, true);
  run_ranks(1, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config.c_str());
    ASSERT_NE(ctx, nullptr);
    // Masters, two moments and the gradients: 4 x 802816 bytes (4 KiB-aligned).
    const int64_t n = 200000;
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    o.name = "w";
    o.dtype = ZS_BFLOAT16;
    o.ndim = 1;
    o.shape = &n;
    o.init = ZS_INIT_NORMAL;
    zs_param p = nullptr;
    ZS_ASSERT_OK(zs_param_register(&p, ctx, &o));
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    EXPECT_EQ(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("offload_optimizer.nvme_path '" + dir + "': needs 3211264 bytes, "), std::string::npos)
        << msg;
    EXPECT_NE(msg.find(" bytes free"), std::string::npos) << msg;
    zs_context_destroy(ctx);
  });
  EXPECT_EQ(umount(dir.c_str()), 0) << std::strerror(errno);
  fs::remove_all(dir);
}

}  // namespace

namespace {

TEST(OptimizerOffloadCuda, BothDevicesOfBothOffloadsAreRefusedOnACudaContext) {
  int count = 0;
  const char* reason = "";
  ZS_ASSERT_OK(zs_cuda_device_count(&count, &reason));
  if (count == 0) GTEST_SKIP() << "needs a CUDA device: " << reason;
  const std::string dir = zs::test::make_temp_dir("offload_cuda");
  for (const std::string where : {"cpu", "nvme"}) {
    const std::string config = R"({"zero_optimization": {"offload_optimizer": {"device": ")" + where +
                               R"(", "nvme_path": ")" + dir + R"("}}})";
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    o.rank = 0;
    o.world_size = 1;
    o.device = "cuda:0";
    o.config_json = config.c_str();
    zs_context ctx = nullptr;
    ZS_ASSERT_OK(zs_context_create(&ctx, &o));
    zs_optimizer opt = nullptr;
    EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_ERR_NOT_SUPPORTED);
    const std::string msg = zs_last_error();
    EXPECT_NE(msg.find("offload_optimizer.device \"" + where + "\" on a CUDA context (cuda:0)"),
              std::string::npos) << msg;
    zs_context_destroy(ctx);
    // Parameter offload likewise, at the first registration.
    const std::string params = R"({"zero_optimization": {"offload_param": {"device": ")" + where +
                               R"(", "nvme_path": ")" + dir + R"("}}})";
    o.config_json = params.c_str();
    ZS_ASSERT_OK(zs_context_create(&ctx, &o));
    const int64_t n = 10;
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = "w";
    po.ndim = 1;
    po.shape = &n;
    zs_param p = nullptr;
    EXPECT_EQ(zs_param_register(&p, ctx, &po), ZS_ERR_NOT_SUPPORTED);
    const std::string param_msg = zs_last_error();
    EXPECT_NE(param_msg.find("offload_param.device \"" + where + "\" on a CUDA context (cuda:0)"),
              std::string::npos) << param_msg;
    zs_context_destroy(ctx);
  }
  fs::remove_all(dir);
}

}  // namespace
