// Gradient shards on NVMe (offload_optimizer.device = "nvme"): each shard
// goes to the optimizer's swap file as its reduction writes it, so after a
// backward the engine holds no gradient memory, and training is bit for bit
// what it is with everything in memory: on 1, 2 and 3 real ranks, fp32 and
// bf16 params of odd sizes, AdamW and SGD, sub-groups that cut params, two
// micro-steps accumulated per step (a shard read back and added to), the
// bucket route and the direct one, gradient_clipping, a caller's
// clip_grad_norm and zs_grad_shard_data, MiCS's replica average.
// ZS_NVME_GRADS=0 keeps them in memory, training the same.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <ostream>
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
constexpr int kSteps = 3;
constexpr int kMicro = 2;

struct Case {
  int world;
  zs_dtype dtype;
  zs_optimizer_kind kind;
  int64_t sub_group;
  const char* extra;  // more zero_optimization keys, or ""
  bool user_clip;     // zs_grad_clip_norm before each step
  bool read_shard;    // zs_grad_shard_data of the big param before each step
  const char* name;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string config_of(const Case& c, const std::string& swap_dir) {
  std::string zero = R"("sub_group_size": )" + std::to_string(c.sub_group) + c.extra;
  if (!swap_dir.empty())
    zero += R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap_dir +
            R"(", "buffer_count": 2})";
  return R"({"gradient_clipping": 3.0, "zero_optimization": {)" + zero +
         R"(}, "aio": {"block_size": 8192, "queue_depth": 4}})";
}

// Per rank: full params, optimizer state, each step's norm and the shard
// read through zs_grad_shard_data; then the engine's gradient bytes in
// memory after each step's backward, kept apart.
struct Result {
  std::vector<std::vector<float>> values;
  std::vector<std::vector<float>> grad_memory;
};

Result train(const Case& c, const std::string& swap_dir, const std::string& out, bool grads_env_off = false) {
  run_ranks(c.world, [&](const RankEnv& env) {
    if (grads_env_off) setenv("ZS_NVME_GRADS", "0", 1);
    const std::string config = config_of(c, swap_dir);
    CkptModel m = zs::test::make_ckpt_model(env, c.dtype, c.kind, kBig, 30000, config.c_str());
    ASSERT_NE(m.ctx, nullptr);
    ASSERT_EQ(zs_grad_set_accumulation_steps(m.ctx, kMicro), ZS_OK);
    std::vector<float> extra, memory;
    for (int k = 0; k < kSteps; ++k) {
      for (int micro = 0; micro < kMicro; ++micro) zs::test::push_ckpt_grads(m, micro);
      ASSERT_EQ(zs_grad_sync(m.ctx), ZS_OK) << zs_last_error();
      uint64_t kinds[ZS_MEM_KIND_COUNT] = {};
      ASSERT_EQ(zs_memory_by_kind(m.ctx, ZS_PHASE_NOW, kinds, ZS_MEM_KIND_COUNT, nullptr, nullptr), ZS_OK);
      memory.push_back(static_cast<float>(kinds[ZS_MEM_GRADS]));
      if (c.user_clip) {
        double norm = 0.0;
        ASSERT_EQ(zs_grad_clip_norm(m.ctx, m.params.data(), m.params.size(), 0.5, &norm), ZS_OK)
            << zs_last_error();
        extra.push_back(static_cast<float>(norm));
      }
      if (c.read_shard) {
        float* data = nullptr;
        uint64_t n = 0;
        ASSERT_EQ(zs_grad_shard_data(m.params.back(), &data, &n), ZS_OK) << zs_last_error();
        extra.insert(extra.end(), data, data + n);
      }
      zs_step_result r = ZS_STEP_RESULT_INIT;
      ASSERT_EQ(zs_optimizer_step(m.opt, &r), ZS_OK) << zs_last_error();
      ASSERT_FALSE(r.skipped);
      extra.push_back(static_cast<float>(r.grad_norm));
    }
    auto all = zs::test::full_values(m);
    const auto state = zs::test::optimizer_values(m);
    all.insert(all.end(), state.begin(), state.end());
    all.insert(all.end(), extra.begin(), extra.end());
    zs::test::write_floats(out + "." + std::to_string(env.rank), all);
    zs::test::write_floats(out + ".memory." + std::to_string(env.rank), memory);
    zs::test::destroy_ckpt_model(m);
  });
  return {zs::test::read_per_rank(out, c.world), zs::test::read_per_rank(out + ".memory", c.world)};
}

class OptimizerOffloadGrads : public ::testing::TestWithParam<Case> {};

TEST_P(OptimizerOffloadGrads, GradientsLiveInTheSwapFileAndTrainBitwiseAsInMemory) {
  ZS_SKIP_WITHOUT_IO_URING();
  const Case c = GetParam();
  const std::string dir = zs::test::make_temp_dir("offload_grads");
  const Result plain = train(c, "", dir + "/plain");
  const Result nvme = train(c, dir + "/swap", dir + "/nvme");
  for (int r = 0; r < c.world; ++r) {
    ASSERT_FALSE(plain.values[r].empty()) << "rank " << r;
    EXPECT_TRUE(bitwise_equal(plain.values[r], nvme.values[r]))
        << "rank " << r << ": " << plain.values[r].size() << " vs " << nvme.values[r].size() << " values";
    ASSERT_EQ(nvme.grad_memory[r].size(), static_cast<size_t>(kSteps));
    for (int k = 0; k < kSteps; ++k) {
      // In memory the backward leaves the shards there; on NVMe none (the
      // shard a caller read at the previous step was freed by that step).
      EXPECT_GT(plain.grad_memory[r][k], 0.0f) << "rank " << r << " step " << k;
      EXPECT_EQ(nvme.grad_memory[r][k], 0.0f) << "rank " << r << " step " << k << ": gradient bytes in memory";
    }
  }
  EXPECT_TRUE(fs::is_empty(dir + "/swap"));  // the file goes with the context
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OptimizerOffloadGrads,
    ::testing::Values(Case{1, ZS_FLOAT32, ZS_OPTIM_ADAMW, 1000, "", false, false, "world1_fp32_adamw"},
                      Case{2, ZS_FLOAT32, ZS_OPTIM_ADAMW, 333, "", true, false, "world2_fp32_adamw_clip"},
                      Case{2, ZS_BFLOAT16, ZS_OPTIM_SGD, 100, "", false, true, "world2_bf16_sgd_read"},
                      // A bucket of 100 elements: w2 [3, 11] is reduced on its own at 3 ranks.
                      Case{3, ZS_FLOAT32, ZS_OPTIM_ADAMW, 7, R"(, "reduce_bucket_size": 100)", true, true,
                           "world3_fp32_adamw_direct_clip_read"},
                      Case{3, ZS_BFLOAT16, ZS_OPTIM_ADAMW, 1000000000, "", false, false, "world3_bf16_one_subgroup"},
                      Case{2, ZS_FLOAT32, ZS_OPTIM_ADAMW, 500, R"(, "mics_shard_size": 1)", false, false,
                           "world2_mics_replicas"}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(OptimizerOffloadGradsEnv, ZsNvmeGrads0KeepsThemInMemoryAndTrainsTheSame) {
  ZS_SKIP_WITHOUT_IO_URING();
  const Case c{2, ZS_FLOAT32, ZS_OPTIM_ADAMW, 333, "", false, false, "env"};
  const std::string dir = zs::test::make_temp_dir("offload_grads_env");
  const Result in_file = train(c, dir + "/swap", dir + "/file");
  const Result in_memory = train(c, dir + "/swap", dir + "/memory", true);
  for (int r = 0; r < c.world; ++r) {
    EXPECT_TRUE(bitwise_equal(in_file.values[r], in_memory.values[r])) << "rank " << r;
    for (int k = 0; k < kSteps; ++k) EXPECT_GT(in_memory.grad_memory[r][k], 0.0f) << "rank " << r;
  }
  fs::remove_all(dir);
}

}  // namespace
