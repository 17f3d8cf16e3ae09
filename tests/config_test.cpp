// Tests for the DeepSpeed JSON config parser: real-world configs parse
// unchanged, aliases and "auto" behave like DeepSpeed, and every rejection
// names the JSON path, the value and what was expected.
#include "impl/config/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include "impl/common/error.h"

namespace {

using zs::Config;
using zs::parse_config;

// The message of the InvalidConfig error that parsing `json` raises.
std::string config_error(const std::string& json, int world_size = 0) {
  try {
    parse_config(json, world_size);
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::InvalidConfig) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "parse_config accepted: " << json;
  return "";
}

// The message of the InvalidConfig error that reading the file raises.
std::string config_file_error(const std::string& path) {
  try {
    zs::parse_config_file(path, 0);
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::InvalidConfig) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "parse_config_file accepted: " << path;
  return "";
}

void expect_mentions(const std::string& message,
                     std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "message lacks '" << part << "': " << message;
  }
}

// Fields compared by the round-trip and alias tests (everything but unused_keys).
void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.stage, b.stage);
  EXPECT_EQ(a.reduce_bucket_size, b.reduce_bucket_size);
  EXPECT_EQ(a.allgather_bucket_size, b.allgather_bucket_size);
  EXPECT_EQ(a.overlap_comm, b.overlap_comm);
  EXPECT_EQ(a.contiguous_gradients, b.contiguous_gradients);
  EXPECT_EQ(a.reduce_scatter, b.reduce_scatter);
  EXPECT_EQ(a.sub_group_size, b.sub_group_size);
  EXPECT_EQ(a.prefetch_bucket_size, b.prefetch_bucket_size);
  EXPECT_EQ(a.param_persistence_threshold, b.param_persistence_threshold);
  EXPECT_EQ(a.model_persistence_threshold, b.model_persistence_threshold);
  EXPECT_EQ(a.max_live_parameters, b.max_live_parameters);
  EXPECT_EQ(a.max_reuse_distance, b.max_reuse_distance);
  EXPECT_EQ(a.module_granularity_threshold, b.module_granularity_threshold);
  EXPECT_EQ(a.gather_16bit_weights_on_model_save, b.gather_16bit_weights_on_model_save);
  EXPECT_EQ(a.round_robin_gradients, b.round_robin_gradients);
  EXPECT_EQ(a.mics_shard_size, b.mics_shard_size);
  EXPECT_EQ(a.mics_hierarchical_params_gather, b.mics_hierarchical_params_gather);
  EXPECT_EQ(a.zero_hpz_partition_size, b.zero_hpz_partition_size);
  EXPECT_EQ(a.zero_quantized_weights, b.zero_quantized_weights);
  EXPECT_EQ(a.zero_quantized_weights_bits, b.zero_quantized_weights_bits);
  EXPECT_EQ(a.zero_quantized_weights_block_size, b.zero_quantized_weights_block_size);
  EXPECT_EQ(a.zero_quantized_nontrainable_weights, b.zero_quantized_nontrainable_weights);
  EXPECT_EQ(a.zero_quantized_gradients, b.zero_quantized_gradients);
  EXPECT_EQ(a.zero_quantized_gradients_bits, b.zero_quantized_gradients_bits);
  EXPECT_EQ(a.zero_quantized_gradients_block_size, b.zero_quantized_gradients_block_size);
  EXPECT_EQ(a.zeropp_loco, b.zeropp_loco);
  EXPECT_EQ(a.zeropp_loco_err_beta, b.zeropp_loco_err_beta);
  EXPECT_EQ(a.zeropp_loco_reset_T, b.zeropp_loco_reset_T);
  for (auto pair : {std::make_pair(&a.offload_param, &b.offload_param),
                    std::make_pair(&a.offload_optimizer, &b.offload_optimizer)}) {
    EXPECT_EQ(pair.first->device, pair.second->device);
    EXPECT_EQ(pair.first->nvme_path, pair.second->nvme_path);
    EXPECT_EQ(pair.first->pin_memory, pair.second->pin_memory);
    EXPECT_EQ(pair.first->buffer_count, pair.second->buffer_count);
    EXPECT_EQ(pair.first->buffer_size, pair.second->buffer_size);
    EXPECT_EQ(pair.first->max_in_cpu, pair.second->max_in_cpu);
    EXPECT_EQ(pair.first->ratio, pair.second->ratio);
  }
  EXPECT_EQ(a.aio.block_size, b.aio.block_size);
  EXPECT_EQ(a.aio.queue_depth, b.aio.queue_depth);
  EXPECT_EQ(a.aio.thread_count, b.aio.thread_count);
  EXPECT_EQ(a.aio.single_submit, b.aio.single_submit);
  EXPECT_EQ(a.aio.overlap_events, b.aio.overlap_events);
  EXPECT_EQ(a.bf16, b.bf16);
  EXPECT_EQ(a.fp16, b.fp16);
  EXPECT_EQ(a.loss_scale, b.loss_scale);
  EXPECT_EQ(a.initial_scale_power, b.initial_scale_power);
  EXPECT_EQ(a.loss_scale_window, b.loss_scale_window);
  EXPECT_EQ(a.hysteresis, b.hysteresis);
  EXPECT_EQ(a.consecutive_hysteresis, b.consecutive_hysteresis);
  EXPECT_EQ(a.min_loss_scale, b.min_loss_scale);
  EXPECT_EQ(a.gradient_clipping, b.gradient_clipping);
  EXPECT_EQ(a.zero_allow_untested_optimizer, b.zero_allow_untested_optimizer);
  EXPECT_EQ(a.zero_force_ds_cpu_optimizer, b.zero_force_ds_cpu_optimizer);
  EXPECT_EQ(a.communication_data_type, b.communication_data_type);
  EXPECT_EQ(a.prescale_gradients, b.prescale_gradients);
  EXPECT_EQ(a.gradient_predivide_factor, b.gradient_predivide_factor);
}

// ---- real-world configs

// transformers docs, "ZeRO-3 example" (ds_config_zero3.json).
const char* kHfTrainerZero3 = R"({
  "fp16": {
    "enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
    "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1
  },
  "bf16": {"enabled": "auto"},
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
  },
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
})";

TEST(ConfigRealWorld, HfTrainerZero3WithAutoValues) {
  const Config c = parse_config(kHfTrainerZero3, 8);
  const Config defaults;
  EXPECT_EQ(c.stage, 3);
  EXPECT_EQ(c.offload_optimizer.device, "cpu");
  EXPECT_TRUE(c.offload_optimizer.pin_memory);
  EXPECT_EQ(c.offload_param.device, "cpu");
  EXPECT_TRUE(c.offload_param.pin_memory);
  EXPECT_EQ(c.sub_group_size, 1000000000);
  EXPECT_EQ(c.max_live_parameters, 1000000000);
  EXPECT_EQ(c.max_reuse_distance, 1000000000);
  EXPECT_TRUE(c.gather_16bit_weights_on_model_save);
  // "auto" keeps the engine default.
  EXPECT_EQ(c.reduce_bucket_size, defaults.reduce_bucket_size);
  EXPECT_EQ(c.prefetch_bucket_size, defaults.prefetch_bucket_size);
  EXPECT_EQ(c.param_persistence_threshold, defaults.param_persistence_threshold);
  EXPECT_EQ(c.gradient_clipping, defaults.gradient_clipping);
  EXPECT_FALSE(c.fp16);
  EXPECT_FALSE(c.bf16);
  EXPECT_EQ(c.initial_scale_power, 16);
  EXPECT_EQ(c.unused_keys,
            (std::vector<std::string>{"optimizer", "scheduler", "gradient_accumulation_steps",
                                      "steps_per_print", "train_batch_size",
                                      "train_micro_batch_size_per_gpu",
                                      "wall_clock_breakdown"}));
}

TEST(ConfigRealWorld, AccelerateGeneratedConfig) {
  // What accelerate's DeepSpeedPlugin writes for `accelerate config` answers.
  const Config c = parse_config(R"({
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "none", "nvme_path": null},
      "offload_param": {"device": "none", "nvme_path": null},
      "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_clipping": 1.0,
    "steps_per_print": 9223372036854775807,
    "bf16": {"enabled": true},
    "fp16": {"enabled": false},
    "zero_allow_untested_optimizer": true
  })", 2);
  EXPECT_EQ(c.offload_param.device, "none");
  EXPECT_EQ(c.offload_param.nvme_path, "");
  EXPECT_TRUE(c.bf16);
  EXPECT_FALSE(c.fp16);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_TRUE(c.zero_allow_untested_optimizer);
  EXPECT_EQ(c.unused_keys,
            (std::vector<std::string>{"train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps", "steps_per_print"}));
}

TEST(ConfigRealWorld, AxolotlZero3Bf16) {
  // axolotl deepspeed_configs/zero3_bf16.json
  const Config c = parse_config(R"({
    "zero_optimization": {
      "stage": 3,
      "overlap_comm": true,
      "contiguous_gradients": true,
      "sub_group_size": 0,
      "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto",
      "stage3_max_live_parameters": 0,
      "stage3_max_reuse_distance": 0,
      "stage3_gather_16bit_weights_on_model_save": true
    },
    "bf16": {"enabled": true},
    "fp16": {
      "enabled": "auto", "auto_cast": false, "loss_scale": 0,
      "initial_scale_power": 32, "loss_scale_window": 1000,
      "hysteresis": 2, "min_loss_scale": 1
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
  })", 8);
  EXPECT_TRUE(c.bf16);
  EXPECT_FALSE(c.fp16);
  EXPECT_EQ(c.sub_group_size, 0);
  EXPECT_EQ(c.max_live_parameters, 0);
  EXPECT_EQ(c.initial_scale_power, 32);
  ASSERT_FALSE(c.unused_keys.empty());
  EXPECT_EQ(c.unused_keys[0], "fp16.auto_cast");
}

TEST(ConfigRealWorld, AxolotlZero3WithExponentSizes) {
  // axolotl deepspeed_configs/zero3.json writes sizes as 1e9 and 5e8.
  const Config c = parse_config(R"({
    "zero_optimization": {
      "stage": 3, "overlap_comm": true, "contiguous_gradients": true,
      "sub_group_size": 1e9, "reduce_bucket_size": 5e8,
      "stage3_prefetch_bucket_size": 4.5e8,
      "stage3_param_persistence_threshold": 1E5,
      "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
      "stage3_gather_16bit_weights_on_model_save": true
    },
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "gradient_clipping": "auto", "train_batch_size": "auto"
  })", 0);
  EXPECT_EQ(c.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.prefetch_bucket_size, 450000000);
  EXPECT_EQ(c.param_persistence_threshold, 100000);
  EXPECT_EQ(c.sub_group_size, 1000000000);
}

TEST(ConfigRealWorld, ZeroInfinityNvmeOffload) {
  const Config c = parse_config(R"({
    "zero_optimization": {
      "stage": 3,
      "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9
      },
      "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
        "buffer_count": 4, "fast_init": false, "pipeline_read": false,
        "pipeline_write": false
      },
      "stage3_max_live_parameters": 1e9
    },
    "aio": {
      "block_size": 262144, "queue_depth": 32, "thread_count": 1,
      "single_submit": false, "overlap_events": true
    },
    "fp16": {"enabled": true}
  })", 4);
  EXPECT_EQ(c.offload_param.device, "nvme");
  EXPECT_EQ(c.offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(c.offload_param.buffer_size, 100000000);
  EXPECT_EQ(c.offload_param.max_in_cpu, 1000000000);
  EXPECT_EQ(c.offload_optimizer.device, "nvme");
  EXPECT_EQ(c.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(c.offload_optimizer.pipeline_read);
  EXPECT_FALSE(c.offload_optimizer.pipeline_write);
  EXPECT_EQ(c.aio.block_size, 262144);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_TRUE(c.fp16);
  EXPECT_EQ(c.unused_keys,
            (std::vector<std::string>{"zero_optimization.offload_optimizer.fast_init"}));
}

TEST(ConfigRealWorld, DeepSpeedOnlyZeroKeysAreAcceptedAndReported) {
  const Config c = parse_config(R"({"zero_optimization": {
      "stage": 2, "allgather_partitions": true, "load_from_fp32_weights": true,
      "elastic_checkpoint": false, "ignore_unused_parameters": true,
      "legacy_stage1": false, "memory_efficient_linear": true,
      "use_multi_rank_bucket_allreduce": true,
      "zero_quantized_nontrainable_weights": false,
      "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
      "pipeline_loading_checkpoint": false, "override_module_apply": true,
      "log_trace_cache_warnings": false, "stage3_module_granularity_threshold": 0}})",
                                0);
  EXPECT_EQ(c.stage, 2);
  EXPECT_TRUE(c.zeropp_loco);  // read (it acts with qgZ), so not among the unused
  // zero_quantized_nontrainable_weights is read too (partition/freeze.h).
  // stage3_module_granularity_threshold is read too (zeroshard.torch's units).
  EXPECT_EQ(c.unused_keys.size(), 10u);
  EXPECT_EQ(c.unused_keys.front(), "zero_optimization.allgather_partitions");
  EXPECT_EQ(c.unused_keys.back(), "zero_optimization.log_trace_cache_warnings");
  EXPECT_EQ(c.module_granularity_threshold, 0);
}

// ---- defaults, "auto", numbers

TEST(ConfigValues, EmptyObjectIsAllDefaults) {
  const Config c = parse_config("{}", 0);
  expect_same(c, Config{});
  EXPECT_TRUE(c.unused_keys.empty());
}

TEST(ConfigValues, AutoTakesEngineDefaultForEveryType) {
  const Config c = parse_config(R"({
    "zero_optimization": {"stage": "auto", "overlap_comm": "auto",
      "reduce_bucket_size": "auto", "mics_shard_size": "auto",
      "offload_param": {"device": "auto", "nvme_path": "auto"},
      "offload_optimizer": {"ratio": "auto"}},
    "fp16": {"min_loss_scale": "auto"}, "communication_data_type": "auto",
    "gradient_clipping": "auto"
  })", 0);
  expect_same(c, Config{});
}

TEST(ConfigValues, ExactIntegerFloatsAreIntegers) {
  const Config c = parse_config(
      R"({"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 2e8}})", 0);
  EXPECT_EQ(c.stage, 2);
  EXPECT_EQ(c.reduce_bucket_size, 200000000);
}

TEST(ConfigValues, FractionalIntegerIsRejected) {
  const std::string msg =
      config_error(R"({"zero_optimization": {"reduce_bucket_size": 1.5}})");
  expect_mentions(msg, {"zero_optimization.reduce_bucket_size", "got 1.5",
                        "expected an integer"});
}

TEST(ConfigValues, IntegerOutOfInt64RangeIsRejected) {
  expect_mentions(config_error(R"({"zero_optimization": {"sub_group_size": 1e19}})"),
                  {"zero_optimization.sub_group_size", "expected an integer"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"sub_group_size": 18446744073709551615}})"),
      {"zero_optimization.sub_group_size", "got 18446744073709551615"});
}

TEST(ConfigValues, QuotedNumberIsRejected) {
  const std::string msg =
      config_error(R"({"zero_optimization": {"stage3_max_live_parameters": "1e9"}})");
  expect_mentions(msg, {"zero_optimization.stage3_max_live_parameters", "got \"1e9\"",
                        "expected an integer, not a string"});
}

TEST(ConfigValues, NegativeSizesAndCountsAreRejected) {
  expect_mentions(config_error(R"({"zero_optimization": {"allgather_bucket_size": -1}})"),
                  {"zero_optimization.allgather_bucket_size", "got -1",
                   "expected an integer in [0, 1125899906842624]"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_param": {"buffer_count": -5}}})"),
      {"zero_optimization.offload_param.buffer_count", "got -5", ">= 0"});
}

TEST(ConfigValues, FlagsMustBeJsonBooleans) {
  expect_mentions(config_error(R"({"zero_optimization": {"overlap_comm": "true"}})"),
                  {"zero_optimization.overlap_comm", "got \"true\"",
                   "expected true, false or \"auto\""});
  expect_mentions(config_error(R"({"bf16": {"enabled": 1}})"),
                  {"bf16.enabled", "got 1", "expected true, false"});
  // Options the engine only records are type-checked too.
  expect_mentions(config_error(R"({"zero_optimization": {"allgather_partitions": "yes"}})"),
                  {"zero_optimization.allgather_partitions", "got \"yes\""});
}

TEST(ConfigValues, StageMustBeZeroToThree) {
  expect_mentions(config_error(R"({"zero_optimization": {"stage": 4}})"),
                  {"zero_optimization.stage", "got 4", "expected an integer in [0, 3]"});
  expect_mentions(config_error(R"({"zero_optimization": {"stage": -1}})"),
                  {"zero_optimization.stage", "got -1"});
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage": 0}})", 0).stage, 0);
}

TEST(ConfigValues, WeightQuantizationBitsAndBlockSize) {
  const Config d = parse_config("{}", 0);
  EXPECT_EQ(d.zero_quantized_weights_bits, 8);
  EXPECT_EQ(d.zero_quantized_weights_block_size, 256);
  const Config c = parse_config(R"({"zero_optimization": {"zero_quantized_weights": true,
      "zero_quantized_weights_bits": 4, "zero_quantized_weights_block_size": 2048}})", 0);
  EXPECT_TRUE(c.zero_quantized_weights);
  EXPECT_EQ(c.zero_quantized_weights_bits, 4);
  EXPECT_EQ(c.zero_quantized_weights_block_size, 2048);
  EXPECT_FALSE(d.zero_quantized_nontrainable_weights);
  EXPECT_TRUE(parse_config(R"({"zero_optimization": {"zero_quantized_nontrainable_weights": true}})", 0)
                  .zero_quantized_nontrainable_weights);
  expect_mentions(config_error(R"({"zero_optimization": {"zero_quantized_weights_bits": 2}})"),
                  {"zero_optimization.zero_quantized_weights_bits", "got 2", "8 or 4"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"zero_quantized_weights_block_size": 255}})"),
      {"zero_optimization.zero_quantized_weights_block_size", "got 255", "an even integer"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"zero_quantized_weights_block_size": 0}})"),
      {"zero_optimization.zero_quantized_weights_block_size", "got 0"});
}

TEST(ConfigValues, GradientQuantizationBitsAndBlockSize) {
  const Config d = parse_config("{}", 0);
  EXPECT_EQ(d.zero_quantized_gradients_bits, 4);  // as ZeRO++
  EXPECT_EQ(d.zero_quantized_gradients_block_size, 256);
  const Config c = parse_config(R"({"zero_optimization": {"zero_quantized_gradients": true,
      "zero_quantized_gradients_bits": 8, "zero_quantized_gradients_block_size": 1024}})", 0);
  EXPECT_TRUE(c.zero_quantized_gradients);
  EXPECT_EQ(c.zero_quantized_gradients_bits, 8);
  EXPECT_EQ(c.zero_quantized_gradients_block_size, 1024);
  expect_mentions(config_error(R"({"zero_optimization": {"zero_quantized_gradients_bits": 16}})"),
                  {"zero_optimization.zero_quantized_gradients_bits", "got 16", "8 or 4"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"zero_quantized_gradients_block_size": 3}})"),
      {"zero_optimization.zero_quantized_gradients_block_size", "got 3", "an even integer"});
}

TEST(ConfigValues, LocoErrBetaAndResetT) {
  const Config d = parse_config("{}", 0);
  EXPECT_FALSE(d.zeropp_loco);
  const Config c = parse_config(R"({"zero_optimization": {"zero_quantized_gradients": true,
      "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 16}}})", 0);
  EXPECT_TRUE(c.zeropp_loco);
  EXPECT_EQ(c.zeropp_loco_err_beta, 0.5);
  EXPECT_EQ(c.zeropp_loco_reset_T, 16);
  EXPECT_FALSE(parse_config(R"({"zero_optimization": {"zeropp_loco_param": null}})", 0).zeropp_loco);
  for (const char* edge : {R"({"err_beta": 0, "reset_T": 1})", R"({"err_beta": 1, "reset_T": 1})"})
    EXPECT_TRUE(parse_config(std::string(R"({"zero_optimization": {"zeropp_loco_param": )") + edge + "}}", 0)
                    .zeropp_loco);
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"err_beta": 1.5, "reset_T": 8}}})"),
                  {"zero_optimization.zeropp_loco_param.err_beta", "got 1.5", "<= 1"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"err_beta": -0.1, "reset_T": 8}}})"),
                  {"zero_optimization.zeropp_loco_param.err_beta", "got -0.1", ">= 0"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 0}}})"),
                  {"zero_optimization.zeropp_loco_param.reset_T", "got 0", ">= 1"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"reset_T": 8}}})"),
                  {"zero_optimization.zeropp_loco_param.err_beta", "missing"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}})"),
                  {"zero_optimization.zeropp_loco_param.reset_T", "missing"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 8, "err_betta": 1}}})"),
                  {"zero_optimization.zeropp_loco_param.err_betta", "unknown key"});
  expect_mentions(config_error(R"({"zero_optimization": {"zeropp_loco_param": 3}})"),
                  {"zero_optimization.zeropp_loco_param", "an object"});
}

TEST(ConfigValues, NullIsOnlyAcceptedForOptionalOptions) {
  const Config c = parse_config(
      R"({"zero_optimization": {"overlap_comm": null, "offload_param": null,
          "offload_optimizer": null}, "communication_data_type": null})",
      0);
  EXPECT_EQ(c.offload_param.device, "none");
  EXPECT_TRUE(c.overlap_comm);
  expect_mentions(config_error(R"({"zero_optimization": {"stage": null}})"),
                  {"zero_optimization.stage", "got null", "expected an integer"});
}

TEST(ConfigValues, CommunicationDataType) {
  EXPECT_EQ(parse_config(R"({"communication_data_type": "BF16"})", 0).communication_data_type,
            "bf16");
  expect_mentions(config_error(R"({"communication_data_type": "int8"})"),
                  {"communication_data_type", "got \"int8\"", "\"fp32\", \"fp16\", \"bf16\""});
}

// ---- aliases

struct AliasPair {
  const char* stage3_spelling;
  const char* plain_spelling;
};

TEST(ConfigAliases, Stage3PrefixedAndPlainSpellingsAreOneKey) {
  for (const AliasPair& alias :
       {AliasPair{"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
        AliasPair{"stage3_param_persistence_threshold", "param_persistence_threshold"},
        AliasPair{"stage3_model_persistence_threshold", "model_persistence_threshold"},
        AliasPair{"stage3_max_live_parameters", "max_live_parameters"},
        AliasPair{"stage3_max_reuse_distance", "max_reuse_distance"},
        AliasPair{"stage3_module_granularity_threshold", "module_granularity_threshold"}}) {
    SCOPED_TRACE(alias.plain_spelling);
    const std::string value = "12345";
    const Config a = parse_config(std::string(R"({"zero_optimization": {")") +
                                      alias.stage3_spelling + "\": " + value + "}}",
                                  0);
    const Config b = parse_config(std::string(R"({"zero_optimization": {")") +
                                      alias.plain_spelling + "\": " + value + "}}",
                                  0);
    expect_same(a, b);
    // The value landed somewhere: a differs from the defaults.
    EXPECT_TRUE(a.prefetch_bucket_size == 12345 || a.param_persistence_threshold == 12345 ||
                a.model_persistence_threshold == 12345 ||
                a.max_live_parameters == 12345 || a.max_reuse_distance == 12345 ||
                a.module_granularity_threshold == 12345);
  }
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"max_reuse_distance": 7}})", 0)
                .max_reuse_distance,
            7);
  EXPECT_EQ(parse_config(R"({"zero_optimization": {"stage3_max_reuse_distance": 7}})", 0)
                .max_reuse_distance,
            7);
}

TEST(ConfigAliases, AllGather16BitSpellings) {
  for (const char* key :
       {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "gather_fp16_weights_on_model_save"}) {
    SCOPED_TRACE(key);
    const Config c = parse_config(
        std::string(R"({"zero_optimization": {")") + key + "\": true}}", 0);
    EXPECT_TRUE(c.gather_16bit_weights_on_model_save);
  }
}

TEST(ConfigAliases, BfloatIsBf16) {
  EXPECT_TRUE(parse_config(R"({"bfloat16": {"enabled": true}})", 0).bf16);
  EXPECT_TRUE(
      parse_config(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})", 0).bf16);
  expect_mentions(
      config_error(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": false}})"),
      {"bf16", "bfloat16", "different values"});
}

TEST(ConfigAliases, ConflictingAliasesNameBothPaths) {
  const std::string msg = config_error(R"({"zero_optimization": {
      "stage3_prefetch_bucket_size": 5e7, "prefetch_bucket_size": 1e8}})");
  expect_mentions(msg, {"zero_optimization.prefetch_bucket_size",
                        "zero_optimization.stage3_prefetch_bucket_size",
                        "different values"});
}

TEST(ConfigAliases, EqualAliasesWrittenDifferentlyAgree) {
  const Config c = parse_config(R"({"zero_optimization": {
      "stage3_prefetch_bucket_size": 5e7, "prefetch_bucket_size": 50000000}})",
                                0);
  EXPECT_EQ(c.prefetch_bucket_size, 50000000);
}

TEST(ConfigAliases, AioThreadCountAndIntraOpParallelism) {
  EXPECT_EQ(parse_config(R"({"aio": {"thread_count": 4}})", 0).aio.thread_count, 4);
  EXPECT_EQ(parse_config(R"({"aio": {"intra_op_parallelism": 4}})", 0).aio.thread_count, 4);
}

TEST(ConfigAliases, LegacyCpuOffloadFlags) {
  const Config c = parse_config(
      R"({"zero_optimization": {"cpu_offload": true, "cpu_offload_param": true}})", 0);
  EXPECT_EQ(c.offload_optimizer.device, "cpu");
  EXPECT_EQ(c.offload_param.device, "cpu");
  const Config off = parse_config(R"({"zero_optimization": {"cpu_offload": false}})", 0);
  EXPECT_EQ(off.offload_optimizer.device, "none");
  expect_mentions(
      config_error(R"({"zero_optimization": {"cpu_offload": true,
          "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})"),
      {"zero_optimization.cpu_offload", "zero_optimization.offload_optimizer.device",
       "\"nvme\""});
}

// ---- unknown keys

TEST(ConfigUnknownKeys, TypoInEngineSectionSuggestsKnownKey) {
  expect_mentions(
      config_error(R"({"zero_optimization": {"stage3_prefetch_bucket_sise": 1}})"),
      {"zero_optimization.stage3_prefetch_bucket_sise", "unknown key",
       "did you mean \"stage3_prefetch_bucket_size\""});
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_param": {"pin_memroy": true}}})"),
      {"zero_optimization.offload_param.pin_memroy", "did you mean \"pin_memory\""});
  expect_mentions(config_error(R"({"bf16": {"enable": true}})"),
                  {"bf16.enable", "did you mean \"enabled\""});
  expect_mentions(config_error(R"({"aio": {"queue_dept": 8}})"),
                  {"aio.queue_dept", "did you mean \"queue_depth\""});
}

TEST(ConfigUnknownKeys, FarOffKeyHasNoSuggestion) {
  const std::string msg = config_error(R"({"fp16": {"dynamic_scaling": true}})");
  expect_mentions(msg, {"fp16.dynamic_scaling", "unknown key"});
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST(ConfigUnknownKeys, OffloadOptimizerHasNoParamOnlyKeys) {
  // DeepSpeed's optimizer offload has no max_in_cpu; param offload has no ratio.
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_optimizer": {"max_in_cpu": 1}}})"),
      {"zero_optimization.offload_optimizer.max_in_cpu", "unknown key"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_param": {"ratio": 0.5}}})"),
      {"zero_optimization.offload_param.ratio", "unknown key"});
}

TEST(ConfigUnknownKeys, TopLevelUnknownKeysAreListedInInputOrder) {
  const Config c = parse_config(R"({
    "my_launcher_setting": 1,
    "zero_optimization": {"stage": 3, "load_from_fp32_weights": true},
    "optimizer": {"type": "AdamW"},
    "seed": 42
  })", 0);
  EXPECT_EQ(c.unused_keys,
            (std::vector<std::string>{"my_launcher_setting",
                                      "zero_optimization.load_from_fp32_weights",
                                      "optimizer", "seed"}));
}

// ---- invalid values

TEST(ConfigInvalid, OffloadDeviceMustBeKnown) {
  EXPECT_EQ(config_error(R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})"),
            "zero_optimization.offload_param.device: got \"gpu\", expected \"cpu\", "
            "\"nvme\" or \"none\"");
}

TEST(ConfigInvalid, NvmeRequiresPath) {
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})"),
      {"zero_optimization.offload_optimizer.nvme_path", "\"nvme\""});
  expect_mentions(config_error(R"({"zero_optimization": {"offload_param":
                                   {"device": "nvme", "nvme_path": ""}}})"),
                  {"zero_optimization.offload_param.nvme_path", "\"nvme\""});
}

TEST(ConfigInvalid, Bf16AndFp16TogetherAreRejected) {
  expect_mentions(config_error(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})"),
                  {"bf16.enabled", "fp16.enabled", "at most one"});
}

TEST(ConfigInvalid, LossScaleParametersMustBeSane) {
  struct Case {
    const char* fp16;
    const char* path;
    const char* expected;
  };
  for (const Case& bad : {
           Case{R"("initial_scale_power": 65)", "fp16.initial_scale_power", "[0, 64]"},
           Case{R"("loss_scale_window": 0)", "fp16.loss_scale_window", ">= 1"},
           Case{R"("hysteresis": 0)", "fp16.hysteresis", ">= 1"},
           Case{R"("min_loss_scale": 0)", "fp16.min_loss_scale", "> 0"},
           Case{R"("loss_scale": -1)", "fp16.loss_scale", ">= 0"},
           Case{R"("loss_scale": "dynamic")", "fp16.loss_scale", "a number"},
       }) {
    SCOPED_TRACE(bad.fp16);
    expect_mentions(config_error(std::string(R"({"fp16": {"enabled": true, )") +
                                 bad.fp16 + "}}"),
                    {bad.path, bad.expected});
  }
}

TEST(ConfigInvalid, GradientClippingMustBeNonNegative) {
  expect_mentions(config_error(R"({"gradient_clipping": -0.5})"),
                  {"gradient_clipping", "got -0.5", ">= 0"});
  EXPECT_DOUBLE_EQ(parse_config(R"({"gradient_clipping": 0.5})", 0).gradient_clipping, 0.5);
}

TEST(ConfigInvalid, PartialOptimizerOffloadNeedsStage3) {
  expect_mentions(config_error(R"({"zero_optimization": {"stage": 2,
                                   "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})"),
                  {"zero_optimization.offload_optimizer.ratio", "0.3", "stage is 3"});
  expect_mentions(
      config_error(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})"),
      {"zero_optimization.offload_optimizer.ratio", "<= 1"});
}

TEST(ConfigInvalid, MalformedJsonReportsPosition) {
  const std::string msg = config_error("{\n  \"zero_optimization\": {\"stage\": 3,}\n}");
  expect_mentions(msg, {"invalid JSON", "line 2", "column"});
}

// Found by tests/fuzz/config_fuzz.cpp: a number beyond a double made
// nlohmann throw out_of_range, which escaped as an internal error.
TEST(ConfigInvalid, NumberBeyondDoubleIsInvalidJson) {
  expect_mentions(config_error(R"({"zero_optimization": {"reduce_bucket_size": 1e400}})"),
                  {"invalid JSON", "number overflow", "1e400"});
  expect_mentions(config_error(R"({"gradient_clipping": -10000001e19000})"),
                  {"invalid JSON", "-10000001e19000"});
}

TEST(ConfigInvalid, TopLevelMustBeObject) {
  expect_mentions(config_error("[1, 2]"), {"got [1,2]", "expected a JSON object"});
  expect_mentions(config_error(R"({"zero_optimization": 3})"),
                  {"zero_optimization", "got 3", "expected an object"});
}

TEST(ConfigInvalid, DuplicateKeysAreRejectedLikeDeepSpeed) {
  expect_mentions(config_error(R"({"zero_optimization": {"stage": 2, "stage": 3}})"),
                  {"zero_optimization.stage", "duplicate key"});
}

// ---- topology

TEST(ConfigTopology, MicsShardSizeMustDivideWorldSize) {
  const std::string json = R"({"zero_optimization": {"mics_shard_size": 3}})";
  EXPECT_EQ(config_error(json, 4),
            "zero_optimization.mics_shard_size: 3 does not divide world size 4");
  EXPECT_EQ(parse_config(json, 6).mics_shard_size, 3);
  EXPECT_EQ(parse_config(json, 0).mics_shard_size, 3);  // no world size, no check
}

TEST(ConfigTopology, MicsShardSizeIsMinusOneOrPositive) {
  for (const char* bad : {"0", "-2"}) {
    SCOPED_TRACE(bad);
    expect_mentions(config_error(std::string(R"({"zero_optimization": {"mics_shard_size": )") +
                                 bad + "}}"),
                    {"zero_optimization.mics_shard_size", std::string("got ") + bad,
                     "-1 (off) or an integer >= 1"});
  }
}

TEST(ConfigTopology, HpzPartitionSizeMustDivideWorldSize) {
  const std::string json = R"({"zero_optimization": {"zero_hpz_partition_size": 8}})";
  EXPECT_EQ(config_error(json, 12),
            "zero_optimization.zero_hpz_partition_size: 8 does not divide world size 12");
  EXPECT_EQ(parse_config(json, 16).zero_hpz_partition_size, 8);
  expect_mentions(config_error(R"({"zero_optimization": {"zero_hpz_partition_size": 0}})"),
                  {"zero_optimization.zero_hpz_partition_size", "got 0", ">= 1"});
}

TEST(ConfigTopology, HpzAndMicsCannotBeCombined) {
  expect_mentions(config_error(R"({"zero_optimization": {"zero_hpz_partition_size": 2,
                                   "mics_shard_size": 4}})",
                               8),
                  {"zero_optimization.zero_hpz_partition_size",
                   "zero_optimization.mics_shard_size", "at most one"});
}

// ---- round trip and files

TEST(ConfigRoundTrip, DefaultsSurvive) {
  const Config c;
  expect_same(parse_config(zs::config_to_json(c), 0), c);
}

TEST(ConfigRoundTrip, EveryFieldSurvives) {
  Config c;
  c.stage = 3;  // below 3 the persistence thresholds are the whole model (apply_stage)
  c.reduce_bucket_size = 123;
  c.allgather_bucket_size = 456;
  c.overlap_comm = false;
  c.contiguous_gradients = false;
  c.reduce_scatter = false;
  c.sub_group_size = 789;
  c.prefetch_bucket_size = 11;
  c.param_persistence_threshold = 12;
  c.model_persistence_threshold = 13;
  c.max_live_parameters = 14;
  c.max_reuse_distance = 15;
  c.gather_16bit_weights_on_model_save = true;
  c.round_robin_gradients = true;
  c.mics_shard_size = 4;
  c.mics_hierarchical_params_gather = true;
  c.zero_quantized_weights = true;
  c.zero_quantized_weights_bits = 4;
  c.zero_quantized_weights_block_size = 2048;
  c.zero_quantized_gradients = true;
  c.zero_quantized_gradients_bits = 8;
  c.zero_quantized_gradients_block_size = 512;
  c.zeropp_loco = true;
  c.zeropp_loco_err_beta = 0.25;
  c.zeropp_loco_reset_T = 77;
  c.offload_param = {"nvme", "/nvme/params", true, 7, 1 << 20, 1 << 30, 1.0};
  c.offload_optimizer = {"cpu", "", true, 3, 100000000, 1000000000, 1.0};
  c.aio = {4096, 64, 2, true, false};
  c.fp16 = true;
  c.loss_scale = 128.5;
  c.initial_scale_power = 20;
  c.loss_scale_window = 500;
  c.hysteresis = 3;
  c.consecutive_hysteresis = true;
  c.min_loss_scale = 0.1;
  c.gradient_clipping = 0.3;
  c.zero_allow_untested_optimizer = true;
  c.zero_force_ds_cpu_optimizer = false;
  c.communication_data_type = "fp32";
  c.prescale_gradients = true;
  c.gradient_predivide_factor = 2.5;
  const Config back = parse_config(zs::config_to_json(c), 8);
  expect_same(back, c);
  EXPECT_TRUE(back.unused_keys.empty());
}

TEST(ConfigRoundTrip, PartialOffloadAndHpzSurvive) {
  Config c;
  c.offload_optimizer.device = "cpu";
  c.offload_optimizer.ratio = 0.25;
  c.zero_hpz_partition_size = 8;
  expect_same(parse_config(zs::config_to_json(c), 16), c);
}

TEST(ConfigRoundTrip, OutputUsesCanonicalKeys) {
  const std::string json = zs::config_to_json(parse_config(kHfTrainerZero3, 0));
  EXPECT_EQ(json.find("stage3_"), std::string::npos) << json;
  EXPECT_EQ(json.find("\"optimizer\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"prefetch_bucket_size\""), std::string::npos) << json;
}

TEST(ConfigFile, MissingFileNamesPathAndReason) {
  try {
    zs::parse_config_file("/nonexistent/ds_config.json", 0);
    FAIL() << "missing file accepted";
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::InvalidConfig);
    EXPECT_EQ(std::string(e.what()),
              "cannot read config file '/nonexistent/ds_config.json': No such file or "
              "directory");
  }
}

TEST(ConfigFile, DirectoryIsNotAConfig) {
  try {
    zs::parse_config_file("/tmp", 0);
    FAIL() << "directory accepted";
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::InvalidConfig);
    expect_mentions(e.what(), {"config file '/tmp' is a directory, expected a regular file"});
  }
}

// /dev/zero and a FIFO with no writer would be read forever (or block):
// refused up front, as anything but a regular file.
TEST(ConfigFile, DevicesAndFifosAreRefused) {
  expect_mentions(config_file_error("/dev/zero"), {"'/dev/zero' is a device, expected a regular file"});
  const std::string fifo = "/tmp/zs_config_fifo_" + std::to_string(static_cast<long>(::getpid()));
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string message = config_file_error(fifo);
  std::remove(fifo.c_str());
  expect_mentions(message, {"is a FIFO, expected a regular file"});
}

TEST(ConfigFile, LargerThanTheLimitIsRefused) {
  const std::string path =
      "/tmp/zs_config_big_" + std::to_string(static_cast<long>(::getpid())) + ".json";
  {
    std::ofstream out(path);
    out << "{\"x\": \"" << std::string(size_t{1} << 20, 'a') << "\"}";
  }
  const std::string message = config_file_error(path);
  std::remove(path.c_str());
  expect_mentions(message, {"is 1048585 bytes, expected at most 1048576"});
}

// Hostile text is refused as it is read: far too big, too deep, too many
// keys in one object. (Before the limits, 200k keys took 23 s and 100k
// levels of nesting 21 s: quadratic.)
TEST(ConfigLimits, SizeDepthAndKeysPerObject) {
  expect_mentions(config_error(std::string(size_t{1} << 21, ' ') + "{}"),
                  {"the config is 2097154 bytes, expected at most 1048576"});
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += "{\"a\":";
  deep += "1" + std::string(100000, '}');
  expect_mentions(config_error(deep), {"a.a.a", ": nested more than 32 levels deep"});
  std::string many = "{\"zero_optimization\": {";
  for (int i = 0; i < 20000; ++i) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": 1";
  many += "}}";
  expect_mentions(config_error(many),
                  {"zero_optimization: more than 512 keys in one object, expected at most 512"});
  // Arrays nest too.
  expect_mentions(config_error("{\"x\": " + std::string(40, '[') + std::string(40, ']') + "}"),
                  {"x[]", "nested more than 32 levels"});
}

// Element counts have a largest accepted value, named in the message, so a
// size near 2^62 cannot wrap into a small allocation later.
TEST(ConfigLimits, ElementCountsHaveALargestValue) {
  for (const char* key : {"reduce_bucket_size", "allgather_bucket_size", "sub_group_size"}) {
    expect_mentions(config_error(std::string("{\"zero_optimization\": {\"") + key +
                                 "\": 4611686018427387904}}"),
                    {key, "got 4611686018427387904", "[0, 1125899906842624]"});
  }
  expect_mentions(config_error("{\"aio\": {\"queue_depth\": 100000}}"), {"aio.queue_depth", "[1, 32768]"});
  expect_mentions(config_error("{\"aio\": {\"block_size\": 4e9}}"), {"aio.block_size", "[1, 1073741824]"});
  expect_mentions(config_error("{\"zero_optimization\": {\"offload_param\": {\"device\": \"cpu\", "
                               "\"buffer_size\": 1e17}}}"),
                  {"offload_param.buffer_size", "[0, 1125899906842624]"});
  // Limits that are only compared take any int64: DeepSpeed's own default
  // for model_persistence_threshold is sys.maxsize.
  EXPECT_EQ(parse_config("{\"zero_optimization\": {\"stage3_model_persistence_threshold\": "
                         "9223372036854775807}}", 0).model_persistence_threshold,
            INT64_MAX);
  // DeepSpeed's usual exponent spellings stay accepted.
  EXPECT_EQ(parse_config("{\"zero_optimization\": {\"reduce_bucket_size\": 5e8, "
                         "\"stage3_max_live_parameters\": 1e9}}", 0).reduce_bucket_size,
            500000000);
}

TEST(ConfigFile, ReadsAndParsesFile) {
  const std::string path =
      "/tmp/zs_config_test_" + std::to_string(static_cast<long>(::getpid())) + ".json";
  {
    std::ofstream out(path);
    out << kHfTrainerZero3;
  }
  const Config c = zs::parse_config_file(path, 8);
  std::remove(path.c_str());
  EXPECT_EQ(c.offload_param.device, "cpu");
  EXPECT_EQ(c.unused_keys.size(), 7u);
}

}  // namespace
