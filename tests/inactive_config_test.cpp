// Config keys the engine accepts but does not act on yet: which are listed
// (path as written, value, reason), which are not (defaults, keys the engine
// reads, the effective config), and the C API that hands the list out.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "impl/config/config.h"
#include "tests/support/multirank.h"

namespace {

using zs::Config;
using zs::InactiveKey;
using zs::parse_config;

std::vector<InactiveKey> inactive(const std::string& json) {
  return zs::inactive_keys(zs::parse_config(json, 0));
}

std::vector<std::string> paths(const std::vector<InactiveKey>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(k.path);
  return out;
}

using Paths = std::vector<std::string>;

TEST(InactiveConfig, DefaultsAndEmptyConfigListNothing) {
  EXPECT_TRUE(inactive("{}").empty());
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e9,
      "zero_quantized_weights": false, "zero_quantized_gradients": false,
      "offload_param": {"device": "none", "pin_memory": true},
      "offload_optimizer": {"device": "none", "buffer_count": 4}},
      "aio": {"block_size": 1048576, "queue_depth": 8}})")
                  .empty());
}

TEST(InactiveConfig, TheEffectiveConfigListsNothing) {
  // Bindings may feed the effective config back in: its defaults (aio,
  // offload sections with device "none") must not turn into warnings.
  const zs::Config c = zs::parse_config(
      R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
          "stage3_prefetch_bucket_size": 2000, "mics_shard_size": 2},
          "fp16": {"enabled": true, "loss_scale": 128}, "gradient_clipping": 1.0})",
      0);
  EXPECT_TRUE(zs::inactive_keys(c).empty());
  EXPECT_TRUE(zs::inactive_keys(zs::parse_config(zs::config_to_json(c), 0)).empty());
}

TEST(InactiveConfig, KeysTheEngineReadsAreNeverListed) {
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 7,
      "overlap_comm": false, "stage3_prefetch_bucket_size": 9,
      "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 11,
      "stage3_max_reuse_distance": 0, "mics_shard_size": 1,
      "stage3_model_persistence_threshold": 1000,
      "mics_hierarchical_params_gather": true},
      "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 8,
               "loss_scale_window": 10, "hysteresis": 3, "min_loss_scale": 0.5},
      "gradient_clipping": 0.5, "device": "cpu", "zero_allow_untested_optimizer": true,
      "optimizer": {"type": "AdamW"}})")
                  .empty());
}

TEST(InactiveConfig, CpuOptimizerOffloadListsOnlyWhatItDoesNotDo) {
  // "cpu" is acted on (the state is in host memory); pinning, a partial
  // ratio, DeepSpeed's own knobs and the NVMe-only keys are not.
  const auto keys = inactive(R"({"zero_optimization": {"offload_optimizer":
      {"device": "cpu", "pin_memory": true, "ratio": 0.5, "fast_init": false,
       "buffer_count": 4, "pipeline_read": true}}})");
  // In the order the parser reads them.
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.offload_optimizer.pin_memory",
                                "zero_optimization.offload_optimizer.buffer_count",
                                "zero_optimization.offload_optimizer.ratio",
                                "zero_optimization.offload_optimizer.pipeline_read",
                                "zero_optimization.offload_optimizer.fast_init"}));
  ASSERT_EQ(keys.size(), 5u);
  EXPECT_EQ(keys[0].value, "true");
  EXPECT_NE(keys[0].reason.find("not pinned"), std::string::npos);
  EXPECT_NE(keys[1].reason.find("read only by NVMe optimizer offload"), std::string::npos);
  EXPECT_NE(keys[2].reason.find("no partial offload"), std::string::npos);
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"offload_optimizer":
      {"device": "cpu", "pin_memory": false, "ratio": 1.0}}})").empty());
}

TEST(InactiveConfig, NvmeOptimizerOffloadActsOnItsKeysSubGroupsAndAio) {
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"sub_group_size": 1e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4,
                            "pipeline_read": true, "pipeline_write": true}},
      "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2,
              "single_submit": true, "overlap_events": false, "use_gds": false}})")
                  .empty());
  EXPECT_EQ(paths(inactive(R"({"zero_optimization": {"offload_optimizer":
      {"device": "nvme", "nvme_path": "/nvme"}}, "aio": {"use_gds": true}})")),
            (Paths{"aio.use_gds"}));
}

// Zero-Infinity (params and optimizer state on NVMe) acts on its section
// and the aio keys; only a tuned param buffer pool is listed: offloaded
// shards are read into buffers of their own size, bounded by max_in_cpu.
TEST(InactiveConfig, ZeroInfinityActsAndListsOnlyTheParamBufferPool) {
  EXPECT_TRUE(inactive(R"({"zero_optimization": {
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_size": 1e8, "max_in_cpu": 1e6},
      "offload_optimizer": {"device": "cpu"}},
      "aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 2}})").empty());
  const auto keys = inactive(R"({"zero_optimization": {
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4, "buffer_size": 2e8}}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.offload_param.buffer_count",
                                "zero_optimization.offload_param.buffer_size"}));
  EXPECT_NE(keys[0].reason.find("bounded by offload_param.max_in_cpu"), std::string::npos);
}

// "cpu" param offload on a CPU context is where shards already are; the
// NVMe-only keys say so.
TEST(InactiveConfig, CpuParamOffloadListsItsNvmeKeys) {
  const auto keys = inactive(R"({"zero_optimization": {
      "offload_param": {"device": "cpu", "nvme_path": "/nvme", "max_in_cpu": 5}}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.offload_param.nvme_path",
                                "zero_optimization.offload_param.max_in_cpu"}));
  EXPECT_NE(keys[0].reason.find("read only by NVMe parameter offload"), std::string::npos);
}

TEST(InactiveConfig, AioWithoutNvmeListsOnlyTunedKeys) {
  EXPECT_EQ(paths(inactive(R"({"aio": {"block_size": 1048576, "queue_depth": 32,
                                        "use_gds": false}})")),
            (Paths{"aio.queue_depth"}));
}

TEST(InactiveConfig, LegacyCpuOffloadFlags) {
  EXPECT_EQ(paths(inactive(R"({"zero_optimization": {"cpu_offload": true,
      "cpu_offload_param": true, "cpu_offload_use_pin_memory": true}})")),
            (Paths{"zero_optimization.cpu_offload_use_pin_memory"}));
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"cpu_offload": false}})").empty());
}

// ZeRO-1/2 options of DeepSpeed 0.19.8 load, and are listed away from
// the value at which they change nothing here.
TEST(InactiveConfig, ZeroOneTwoOptionsLoadAndAreListedAwayFromTheirDefault) {
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"parameter_alignment": false,
      "compute_grad_norm": true}})").empty());
  const auto keys = inactive(R"({"zero_optimization": {"parameter_alignment": true,
      "compute_grad_norm": false}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.parameter_alignment",
                                "zero_optimization.compute_grad_norm"}));
  EXPECT_NE(keys[1].reason.find("always computed"), std::string::npos);
}

TEST(InactiveConfig, QuantizationListedOnlyWhenOn) {
  // qwZ (impl/fetch/gather.cpp), qgZ (impl/comm/algo/quantized_reduce.h) and
  // frozen-weight quantization (impl/partition/freeze.h) all act.
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"zero_quantized_weights": true,
      "zero_quantized_gradients": true, "zero_quantized_nontrainable_weights": true,
      "zero_quantized_weights_bits": 4, "zero_quantized_weights_block_size": 2048,
      "zero_quantized_gradients_bits": 8, "zero_quantized_gradients_block_size": 512,
      "zero_hpz_partition_size": 1}})").empty());
  // The weights' code shape acts for frozen weights alone too.
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"zero_quantized_nontrainable_weights": true,
      "zero_quantized_weights_bits": 4, "zero_quantized_weights_block_size": 2048}})").empty());
}

TEST(InactiveConfig, GradientQuantizationShapeListedWhenQgzIsOff) {
  const auto keys = inactive(R"({"zero_optimization": {"zero_quantized_gradients_bits": 8,
      "zero_quantized_gradients_block_size": 256}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.zero_quantized_gradients_bits"}));
  EXPECT_NE(keys[0].reason.find("zero_quantized_gradients is false"), std::string::npos);
}

// LoCo acts with qgZ; without it nothing is quantized, so it is listed.
TEST(InactiveConfig, LocoActsWithQgzAndIsListedWithout) {
  EXPECT_TRUE(inactive(R"({"zero_optimization": {"zero_quantized_gradients": true,
      "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}})").empty());
  const auto keys = inactive(R"({"zero_optimization": {
      "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.zeropp_loco_param"}));
  EXPECT_NE(keys[0].reason.find("zero_quantized_gradients is off"), std::string::npos);
}

TEST(InactiveConfig, WeightQuantizationShapeListedWhenQwzIsOff) {
  const auto keys = inactive(R"({"zero_optimization": {"zero_quantized_weights_bits": 4,
      "zero_quantized_weights_block_size": 256}})");
  EXPECT_EQ(paths(keys), (Paths{"zero_optimization.zero_quantized_weights_bits"}));
  EXPECT_NE(keys[0].reason.find("zero_quantized_nontrainable_weights are false"), std::string::npos);
}

TEST(InactiveConfig, OptionsNeverReadAreListedAwayFromTheirDefault) {
  const auto keys = inactive(R"({"zero_optimization": {"stage": 2, "sub_group_size": 1e8,
      "allgather_bucket_size": 2e8, "contiguous_gradients": false, "reduce_scatter": false,
      "stage3_model_persistence_threshold": 100, "round_robin_gradients": true,
      "stage3_module_granularity_threshold": 5, "load_from_fp32_weights": true,
      "zenflow": {"topk_ratio": 0.1}},
      "bfloat16": {"enabled": true, "bf16_master_weights_and_grads": false},
      "communication_data_type": "BF16", "prescale_gradients": true,
      "gradient_predivide_factor": 2.0})");
  EXPECT_EQ(paths(keys),
            (Paths{"zero_optimization.allgather_bucket_size",
                   "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
                   "zero_optimization.sub_group_size",
                   "zero_optimization.stage3_model_persistence_threshold",
                   "zero_optimization.stage3_module_granularity_threshold",
                   "zero_optimization.round_robin_gradients",
                   "zero_optimization.zenflow", "prescale_gradients", "gradient_predivide_factor"}));
  EXPECT_NE(keys[4].reason.find("only at ZeRO stage 3"), std::string::npos);
  EXPECT_NE(keys[5].reason.find("only at ZeRO stage 3"), std::string::npos);
  EXPECT_TRUE(inactive(R"({"communication_data_type": "fp32"})").empty());
}

// Stages 1 and 2 act: every param persistent (whole on every rank), which
// overrides the stage-3 windows; stage 0 runs as 2 and says so.
TEST(InactiveConfig, StagesBelowThreeKeepParamsWholeAndListStageThreeKeys) {
  for (int stage : {1, 2}) {
    const std::string text = R"({"zero_optimization": {"stage": )" + std::to_string(stage) + "}}";
    EXPECT_TRUE(inactive(text).empty()) << text;
    const Config c = parse_config(text, 0);
    EXPECT_EQ(c.param_persistence_threshold, INT64_MAX);
    EXPECT_EQ(c.model_persistence_threshold, INT64_MAX);
    EXPECT_EQ(parse_config(zs::config_to_json(c), 0).stage, stage);
  }
  const auto zero = inactive(R"({"zero_optimization": {"stage": 0}})");
  EXPECT_EQ(paths(zero), (Paths{"zero_optimization.stage"}));
  EXPECT_NE(zero[0].reason.find("runs as stage 2"), std::string::npos);
  const auto windows = inactive(R"({"zero_optimization": {"stage": 2,
      "stage3_param_persistence_threshold": 10, "stage3_max_live_parameters": 5,
      "stage3_max_reuse_distance": 5, "stage3_prefetch_bucket_size": 5}})");
  EXPECT_EQ(windows.size(), 4u);
  const Config three = parse_config(R"({"zero_optimization": {"stage": 3}})", 0);
  EXPECT_EQ(three.param_persistence_threshold, 100000);
}

// bf16.enabled, fp16.enabled and communication_data_type set the dtype
// gradients are reduced in; under qgZ, which quantizes from fp32, a 16-bit
// communication_data_type changes nothing.
TEST(InactiveConfig, CommunicationDtypeActsUnlessQgzQuantizes) {
  EXPECT_TRUE(inactive(R"({"bf16": {"enabled": true}, "communication_data_type": "bf16"})").empty());
  EXPECT_TRUE(inactive(R"({"fp16": {"enabled": true}, "communication_data_type": "FP16"})").empty());
  const auto keys = inactive(R"({"communication_data_type": "bf16",
      "zero_optimization": {"zero_quantized_gradients": true}})");
  EXPECT_EQ(paths(keys), (Paths{"communication_data_type"}));
  EXPECT_NE(keys[0].reason.find("qgZ quantizes"), std::string::npos);
  EXPECT_TRUE(inactive(R"({"communication_data_type": "fp32",
      "zero_optimization": {"zero_quantized_gradients": true}})").empty());
}

// ---- the C API

class InactiveConfigApi : public ::testing::Test {
 protected:
  zs_context make(const char* config_json) {
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    o.rank = 0;
    o.world_size = 1;
    o.config_json = config_json;
    zs_context ctx = nullptr;
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
    contexts_.push_back(ctx);
    return ctx;
  }
  void TearDown() override {
    for (zs_context c : contexts_) zs_context_destroy(c);
  }
  std::vector<zs_context> contexts_;
};

TEST_F(InactiveConfigApi, ListsKeyValueAndReasonOnce) {
  zs_context ctx = make(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "sub_group_size": 1e8}, "optimizer": {"type": "AdamW"}})");
  const char* text = nullptr;
  ZS_ASSERT_OK(zs_context_inactive_config_keys(ctx, &text));
  const auto got = nlohmann::json::parse(text);
  ASSERT_EQ(got.size(), 2u) << text;
  // In the order parsed: zero_optimization's own keys, then its offload
  // sections ("cpu" itself is acted on).
  EXPECT_EQ(got[0]["key"], "zero_optimization.sub_group_size");
  EXPECT_EQ(got[0]["value"], 1e8);
  EXPECT_NE(got[0]["reason"].get<std::string>().find("NVMe optimizer state"), std::string::npos);
  EXPECT_EQ(got[1]["key"], "zero_optimization.offload_optimizer.pin_memory");
  EXPECT_EQ(got[1]["value"], true);
  // Computed once: the same text at the same address.
  const char* again = nullptr;
  ZS_ASSERT_OK(zs_context_inactive_config_keys(ctx, &again));
  EXPECT_EQ(text, again);
  // Trainer keys stay where they were.
  ZS_ASSERT_OK(zs_context_unused_config_keys(ctx, &text));
  EXPECT_STREQ(text, R"(["optimizer"])");
}

TEST_F(InactiveConfigApi, EmptyArrayWithoutConfig) {
  zs_context ctx = make(nullptr);
  const char* text = nullptr;
  ZS_ASSERT_OK(zs_context_inactive_config_keys(ctx, &text));
  EXPECT_STREQ(text, "[]");
}

TEST_F(InactiveConfigApi, Misuse) {
  zs_context ctx = make(nullptr);
  EXPECT_EQ(zs_context_inactive_config_keys(ctx, nullptr), ZS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(zs_last_error()).find("json_array"), std::string::npos);
  const char* text = nullptr;
  EXPECT_EQ(zs_context_inactive_config_keys(nullptr, &text), ZS_ERR_INVALID_HANDLE);
}

}  // namespace
