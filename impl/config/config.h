// DeepSpeed-compatible JSON config, parsed into a typed struct.
// Accepted unchanged as people write it for HF Trainer, Accelerate, Axolotl
// or LLaMA-Factory: "auto" takes the engine default, 1e9 is an integer, the
// stage3_-prefixed and plain spellings of a key are the same key, and the
// trainer's keys (optimizer, scheduler, batch sizes, monitors) are accepted
// and listed in unused_keys. Invalid values throw zs::Error(InvalidConfig)
// with the JSON path, the value and what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zs {

struct OffloadConfig {
  std::string device = "none";  // "none" | "cpu" | "nvme"
  std::string nvme_path;        // required when device == "nvme"
  bool pin_memory = false;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  double ratio = 1.0;           // offload_optimizer only
  // offload_optimizer only: read the next sub-group while one steps, write
  // the last one back while the next steps (DeepSpeed's defaults: off).
  bool pipeline_read = false;
  bool pipeline_write = false;
};

struct AioConfig {
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
};

// A key the input gave a value to (not "auto", not null), as the parser met
// it: the canonical path (first spelling, e.g. "zero_optimization.
// prefetch_bucket_size"), the path as written ("zero_optimization.
// stage3_prefetch_bucket_size") and the value as JSON text.
struct WrittenKey {
  std::string canonical;
  std::string path;
  std::string value;
};

// A written key whose value asks for something the engine does not do yet:
// the path as written, the value as JSON text, and what happens instead.
struct InactiveKey {
  std::string path;
  std::string value;
  std::string reason;
};

struct Config {
  // zero_optimization
  int stage = 3;
  // Elements of fp32 gradient a bucket collects before its reduce-scatter
  // (over all ranks' blocks). DeepSpeed's default is 5e8, but here a bucket
  // is a fresh fp32 buffer the pushed gradients are copied into: at 5e8 a
  // model under 5e8 params kept a full-size copy of its whole gradient (plus
  // a packed copy and the receive buffer) until the step, with no overlap,
  // and the 2 GB buffer, too big for the host cache, faulted in anew each
  // step. 2e7 (80 MB) measured on 2 ranks: 117M-param Linear stack 2.62 vs
  // 3.83 s/step and peak RSS 2508 vs 3340 MiB; 57M GPT 2108 vs 2427 MiB at
  // the same step time (bench/bench_torch_step.py, bench_torch_memory.py).
  int64_t reduce_bucket_size = 20000000;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = true;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t sub_group_size = 1000000000;
  int64_t prefetch_bucket_size = 50000000;
  int64_t param_persistence_threshold = 100000;
  int64_t model_persistence_threshold = INT64_MAX;
  int64_t max_live_parameters = 1000000000;
  // DeepSpeed's default is 1e9: below 1e9 params, everything a forward
  // gathered stays gathered until its backward, the whole model at the
  // peak. Ours keeps only what the backward reuses within one prefetch
  // window, so the gathered working set is bounded by the windows, not by
  // the model (README: Config keys; zeroshard.torch saves gathered params
  // for backward by reference, so a release does free them).
  int64_t max_reuse_distance = 50000000;
  // DeepSpeed's module_granularity_threshold: a module whose params per
  // layer of its subtree are at most this many is gathered as one unit,
  // hooks on it alone. The engine never sees modules; zeroshard.torch acts
  // on it (hooks.py, unit_plan.py). 0: off.
  int64_t module_granularity_threshold = 0;
  bool gather_16bit_weights_on_model_save = false;
  bool round_robin_gradients = false;
  int64_t mics_shard_size = -1;  // -1: off
  bool mics_hierarchical_params_gather = false;
  int64_t zero_hpz_partition_size = 1;  // 1: off
  // ZeRO++ qwZ: gather weights as block-quantized codes (impl/fetch/
  // quantized.h), or exact where a shard is no larger than its codes
  // (partition/quant_packet.h); zeroshard's own keys pick the codes' width
  // (8 or 4 bits) and the elements per scale (even, 2 .. 2^24).
  bool zero_quantized_weights = false;
  int64_t zero_quantized_weights_bits = 8;
  int64_t zero_quantized_weights_block_size = 256;
  // ZeRO++ for frozen params: a param frozen with zs_param_freeze keeps
  // its shard as qwZ's codes (with the bits and block size above), quantized
  // once, and is gathered as them (partition/freeze.h).
  bool zero_quantized_nontrainable_weights = false;
  // ZeRO++ qgZ: reduce gradients as block-quantized codes over an
  // all-to-all (impl/comm/algo/quantized_reduce.h); zeroshard's own keys pick the
  // codes' width (4, as ZeRO++, or 8) and the elements per scale.
  bool zero_quantized_gradients = false;
  int64_t zero_quantized_gradients_bits = 4;
  int64_t zero_quantized_gradients_block_size = 256;
  // LoCo error feedback for qgZ (zeropp_loco_param: {"err_beta", "reset_T"};
  // impl/grad/loco.h): acts only with zero_quantized_gradients.
  bool zeropp_loco = false;
  double zeropp_loco_err_beta = 0.8;
  int64_t zeropp_loco_reset_T = 1024;
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer;
  AioConfig aio;
  // precision
  bool bf16 = false;
  // bf16.bf16_master_weights_and_grads (needs bf16.enabled): a bf16 param
  // has no fp32 master; the optimizer steps its bf16 shard in place (fp32
  // math per element, one round to bf16 on store), 4 bytes per shard
  // element less. Acts on the master weights only: gradient shards stay
  // fp32 on purpose (impl/grad/reducer.h: bf16 accumulation would round
  // every micro-step's sum to 8 bits; fp32 shards cost 4 bytes per element
  // of this rank's shard, 2 more than bf16 ones). fp32 and fp16 params keep
  // fp32 masters.
  bool bf16_master_weights_and_grads = false;
  // bf16.bf16_optimizer_states (needs bf16_master_weights_and_grads): the
  // moments of bf16 params (Adam's exp_avg and exp_avg_sq, SGD's momentum)
  // are kept in bf16, read as fp32, updated in fp32 and rounded once on
  // store: 2 bytes per element and moment instead of 4.
  bool bf16_optimizer_states = false;
  bool fp16 = false;
  double loss_scale = 0.0;  // 0: dynamic
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  double gradient_clipping = 0.0;  // 0: off
  // top-level engine options
  bool zero_allow_untested_optimizer = false;
  bool zero_force_ds_cpu_optimizer = true;
  std::string communication_data_type;  // "": the gradient dtype; "fp32" | "fp16" | "bf16"
  bool prescale_gradients = false;
  std::string device;  // "": not given; "cpu" | "cuda" | "cuda:N" (zeroshard's own key)
  double gradient_predivide_factor = 1.0;
  // zeroshard's own section "zeroshard": {"healing": {...}} (docs/healing.md).
  // healing.peer_copy: each rank's shard state copied into another rank's
  // host memory and kept current (impl/heal/). -1 "auto" (the default): on
  // when ZS_HEAL=1, which Context::create resolves it by, so the effective
  // config (and the ranks' agreement on it) carries 0 or 1; 0 false, 1 true.
  int heal_peer_copy = -1;
  // healing.min_ranks: a loss that leaves at least this many ranks live
  // shrinks in memory (zs_heal_join goes on without the lost ranks,
  // impl/heal/shrink.h) instead of waiting for a replacement; 0 (the
  // default): always a replacement. Unset, ZS_HEAL_MIN_RANKS sets it (zsrun
  // --min-nproc M --shrink exports it).
  int heal_min_ranks = 0;
  // healing.replacement_wait_s: with min_ranks, how long the survivors wait
  // for a lost rank's replacement before they shrink instead (the lowest
  // survivor decides, impl/heal/replacement_wait.h); 0 (the default): they
  // shrink at once. Unset, ZS_HEAL_REPLACEMENT_WAIT_S sets it (zsrun
  // --replacement-wait S exports it).
  double heal_replacement_wait_s = 0;
  // Keys seen in the input that the engine does not act on (JSON paths, e.g.
  // "optimizer", "train_micro_batch_size_per_gpu", and DeepSpeed options such
  // as "zero_optimization.load_from_fp32_weights"), in input order.
  std::vector<std::string> unused_keys;
  // Every key given a value, in the order the parser read them.
  std::vector<WrittenKey> written;
  // Whether the input gave `canonical` ("zero_optimization.
  // reduce_bucket_size") a value: not absent, not "auto".
  bool given(const std::string& canonical) const;
};

// Parse a DeepSpeed JSON text. world_size > 0 also checks the topology
// against it (mics_shard_size and zero_hpz_partition_size must divide it).
Config parse_config(const std::string& json_text, int world_size);

// zeroshard.healing.peer_copy on (c.heal_peer_copy == 1): refuses by name
// (InvalidConfig) what the peer copy cannot follow yet: a world of one
// (world_size <= 0 skips that), NVMe optimizer state, LoCo, MiCS.
// from_env: it was "auto", on because ZS_HEAL=1 (said in the message).
// parse_config runs it; Context::create again after resolving "auto".
void check_healing(const Config& c, bool from_env, int world_size);
// "zeroshard.healing.peer_copy (true)", or how "auto" turned it on.
std::string heal_config_key(bool from_env);

// Read a file and parse it; a missing or unreadable file is InvalidConfig
// naming the path.
Config parse_config_file(const std::string& path, int world_size);

// The written keys the engine accepts but does not act on yet, with the
// value they were given: offload (a device other than "none", and the
// section's other keys), NVMe aio settings, ZeRO++ quantization, ZeRO-1/2 and
// DeepSpeed implementation options set away from their defaults, and other
// options parsed but never read. A key at its default is not listed, so the
// effective config (config_to_json) lists nothing. In the order parsed.
std::vector<InactiveKey> inactive_keys(const Config& config);

// The effective config as DeepSpeed JSON (canonical key names, defaults
// filled in), which parse_config accepts again.
std::string config_to_json(const Config& config);

// Where two effective configs (config_to_json texts) differ, one entry per
// leaf key: "zero_optimization.reduce_bucket_size = 100 where <other_name>
// has 20000000". Keys that may differ per rank ("device") are left out.
std::vector<std::string> config_differences(const std::string& mine, const std::string& other,
                                            const std::string& other_name);

}  // namespace zs
