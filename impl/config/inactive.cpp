// Which written config keys the engine accepts but does not act on yet.
//
// The parser accepts every DeepSpeed option so that real configs load
// unchanged; this file is the one place that says which of them change
// nothing today. Each rule names a canonical key, the value at which the
// engine's behaviour and the key agree (usually DeepSpeed's default), and
// what the engine does instead. Keys the engine reads (buckets, prefetch,
// param and model persistence, MiCS, hpZ, qwZ, qgZ and its LoCo, fp16 loss
// scaling, clipping, device, bf16.enabled / fp16.enabled /
// communication_data_type, which set the dtype gradients are reduced in,
// and bf16.bf16_master_weights_and_grads / bf16.bf16_optimizer_states,
// which set the dtypes of the optimizer's masters and moments) have no rule (communication_data_type only while qgZ, which quantizes
// from fp32, is off). bf16.enabled also makes zeroshard.torch partition
// floating params as bf16; through the C ABI the caller registers the
// dtype. When the engine starts to act on a key, delete its rule here and
// its case in tests/inactive_config_test.cpp.
//
// Deliberately without a rule:
// - zero_allow_untested_optimizer: the engine runs only its own optimizers,
//   so either value describes what happens.
// - zero_force_ds_cpu_optimizer: the engine's own kernels step offloaded
//   state, which is what the option asks for.
// - offload_optimizer.device, and with "nvme" its nvme_path, buffer_count,
//   pipeline_read, pipeline_write, sub_group_size and the aio section: the
//   optimizer acts on them ("cpu" on a CPU context is where the state
//   already is; a CUDA context refuses optimizer offload at creation).
// - offload_param.device, and with "nvme" its nvme_path, max_in_cpu and the
//   aio section: partition/shard_residence acts on them ("cpu" on a CPU
//   context is where shards already are; a CUDA context refuses it at the
//   first registration). zero_optimization.cpu_offload_param likewise.
// - gather_16bit_weights_on_model_save: bindings consolidate a model on
//   request (zeroshard.torch.consolidated_state_dict) whatever its value.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "impl/config/config.h"

namespace zs {
namespace {

using Json = nlohmann::json;

constexpr const char* kDeepSpeedOnly =
    "a DeepSpeed implementation option the engine has no counterpart for";
constexpr const char* kParamBuffers =
    "offloaded parameter shards are read into buffers of their own size; the memory they "
    "take is bounded by offload_param.max_in_cpu";
constexpr const char* kNvmeOnly =
    "read only by NVMe optimizer offload (offload_optimizer.device is \"cpu\")";
constexpr const char* kNotPinned =
    "offloaded optimizer state is not pinned (a CPU context has no device to pin it for; "
    "NVMe buffers are aligned, not pinned)";
constexpr const char* kAio =
    "asynchronous I/O serves NVMe offload, which this config does not ask for";

// Keys that change nothing at `agrees` and ask for something the engine
// does not do at any other value.
struct Rule {
  const char* canonical;
  Json agrees;
  const char* reason;
};

const std::vector<Rule>& rules() {
  static const std::vector<Rule> kRules = {
      {"zero_optimization.allgather_bucket_size", 500000000,
       "parameter gathers are sized by prefetch_bucket_size (a ZeRO-1/2 option)"},
      {"zero_optimization.contiguous_gradients", true,
       "gradients always go through contiguous reduce buckets"},
      {"zero_optimization.reduce_scatter", true,
       "gradients are always reduce-scattered into each rank's shard"},
      {"zero_optimization.round_robin_gradients", false,
       "gradient shards are not assigned round-robin (a ZeRO-1/2 option)"},
      {"zero_optimization.use_multi_rank_bucket_allreduce", true, kDeepSpeedOnly},
      {"zero_optimization.allgather_partitions", true, kDeepSpeedOnly},
      {"zero_optimization.load_from_fp32_weights", true, kDeepSpeedOnly},
      {"zero_optimization.elastic_checkpoint", false, kDeepSpeedOnly},
      {"zero_optimization.ignore_unused_parameters", true, kDeepSpeedOnly},
      {"zero_optimization.legacy_stage1", false, kDeepSpeedOnly},
      {"zero_optimization.memory_efficient_linear", true, kDeepSpeedOnly},
      {"zero_optimization.pipeline_loading_checkpoint", false, kDeepSpeedOnly},
      {"zero_optimization.override_module_apply", true, kDeepSpeedOnly},
      {"zero_optimization.log_trace_cache_warnings", false, kDeepSpeedOnly},
      {"zero_optimization.enable_sanity_checks", false, kDeepSpeedOnly},
      {"zero_optimization.save_muon_momentum_buffer_in_memory", false, kDeepSpeedOnly},
      {"zero_optimization.parameter_alignment", false,
       "params are not padded to 16-byte boundaries in flat buffers (a ZeRO-1/2 option)"},
      {"zero_optimization.compute_grad_norm", true,
       "the gradient norm is always computed (DeepSpeed allows false only at ZeRO stage 1 or 2)"},
      {"zero_optimization.use_all_reduce_for_fetch_params", false,
       "parameters are always gathered with all-gather"},
      {"zero_optimization.allgather_sequential", false, kDeepSpeedOnly},
      {"bf16.immediate_grad_update", false, kDeepSpeedOnly},
      {"bf16.check_grad_overflow", true, kDeepSpeedOnly},
      {"fp16.auto_cast", false,
       "the engine never sees the model's inputs: a binding casts them (zeroshard.torch casts "
       "floating inputs to the 16-bit dtype at the root's forward whatever this key says; "
       "partition_module(cast_forward_inputs=False) leaves them)"},
      {"fp16.fp16_master_weights_and_grads", false,
       "16-bit parameters always have fp32 master weights and gradients"},
      {"prescale_gradients", false, "gradients are averaged once, in the reduce-scatter"},
      {"gradient_predivide_factor", 1.0, "gradients are averaged once, in the reduce-scatter"},
  };
  return kRules;
}

const Rule* rule_for(const std::string& canonical) {
  for (const Rule& r : rules())
    if (canonical == r.canonical) return &r;
  return nullptr;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// Whole values of the aio section that change nothing, to tell a section
// written out at its defaults (as config_to_json does) from a tuned one.
bool aio_at_default(const std::string& canonical, const Json& v) {
  if (canonical == "aio.block_size") return v == 1048576;
  if (canonical == "aio.queue_depth") return v == 8;
  if (canonical == "aio.intra_op_parallelism") return v == 1;
  if (canonical == "aio.single_submit") return v == false;
  if (canonical == "aio.overlap_events") return v == true;
  if (canonical == "aio.use_gds") return v == false;
  return false;
}

// The reason `key` is not acted on, or nullptr when the engine acts on it
// (or its value changes nothing).
const char* reason_for(const WrittenKey& key, const Json& v, const Config& c) {
  const std::string& k = key.canonical;
  const bool param_offload = c.offload_param.device != "none";
  const bool optimizer_offload = c.offload_optimizer.device != "none";
  const bool nvme = c.offload_param.device == "nvme" || c.offload_optimizer.device == "nvme";

  const bool optimizer_nvme = c.offload_optimizer.device == "nvme";
  const bool param_nvme = c.offload_param.device == "nvme";

  // Offload sections matter only when they name a device.
  if (starts_with(k, "zero_optimization.offload_param.")) {
    if (!param_offload) return nullptr;
    const std::string leaf = k.substr(std::string("zero_optimization.offload_param.").size());
    if (leaf == "device") return nullptr;
    if (leaf == "pin_memory") return v == true ? kNotPinned : nullptr;
    if (leaf == "nvme_path" || leaf == "max_in_cpu")
      return param_nvme ? nullptr : "read only by NVMe parameter offload (offload_param.device is \"cpu\")";
    if (leaf == "buffer_count")
      return v == 5 ? nullptr : kParamBuffers;
    if (leaf == "buffer_size")
      return v == 100000000 ? nullptr : kParamBuffers;
    return kDeepSpeedOnly;
  }
  if (starts_with(k, "zero_optimization.offload_optimizer.")) {
    if (!optimizer_offload) return nullptr;
    const std::string leaf = k.substr(std::string("zero_optimization.offload_optimizer.").size());
    if (leaf == "device") return nullptr;
    if (leaf == "nvme_path" || leaf == "buffer_count" || leaf == "pipeline_read" || leaf == "pipeline_write")
      return optimizer_nvme ? nullptr : kNvmeOnly;
    if (leaf == "pin_memory") return v == true ? kNotPinned : nullptr;
    if (leaf == "ratio")
      return v == 1.0 ? nullptr : "the whole optimizer step runs where its state lives (no partial offload)";
    return kDeepSpeedOnly;  // fast_init, super_offload, convert_grad_on_cpu, cpuadam_cores_perc
  }
  if (k == "zero_optimization.cpu_offload_use_pin_memory")
    return v == true && (param_offload || optimizer_offload) ? kNotPinned : nullptr;
  // Sub-groups cut the step over NVMe state; in memory each shard steps at once.
  if (k == "zero_optimization.sub_group_size")
    return optimizer_nvme || v == 1000000000
               ? nullptr
               : "sub-groups cut only the step over NVMe optimizer state; in memory the "
                 "optimizer steps each rank's shards at once";
  // aio: acted on under NVMe optimizer offload; GPUDirect Storage never.
  if (k == "aio.use_gds") return v == true ? "GPUDirect Storage is not used" : nullptr;
  if (starts_with(k, "aio."))
    return !nvme && !aio_at_default(k, v) ? kAio : nullptr;
  // Objects DeepSpeed leaves unset by default: any content is a request.
  // LoCo compensates qgZ's quantization; without qgZ nothing is quantized.
  if (k == "zero_optimization.zeropp_loco_param")
    return c.zero_quantized_gradients ? nullptr : "zero_quantized_gradients is off";
  if (starts_with(k, "zero_optimization.zeropp_loco_param.")) return nullptr;  // named above
  if (k == "zero_optimization.zenflow") return "the optimizer steps every shard every step";
  if (k == "zero_optimization.leaf_module")
    return v.is_object() && !v.empty()
               ? "leaf modules are named through the binding (zs_leaf_group), not the config"
               : nullptr;
  if (k == "zero_optimization.partition_stream_chunk_size") return kDeepSpeedOnly;
  // qwZ's shape matters only with qwZ or frozen-weight quantization on.
  const bool qwz_bits = k == "zero_optimization.zero_quantized_weights_bits";
  if (qwz_bits || k == "zero_optimization.zero_quantized_weights_block_size")
    return c.zero_quantized_weights || c.zero_quantized_nontrainable_weights ||
                   v == (qwz_bits ? Json(8) : Json(256))
               ? nullptr
               : "weights are gathered unquantized (zero_quantized_weights and "
                 "zero_quantized_nontrainable_weights are false)";
  // qgZ's likewise.
  const bool qgz_bits = k == "zero_optimization.zero_quantized_gradients_bits";
  if (qgz_bits || k == "zero_optimization.zero_quantized_gradients_block_size")
    return c.zero_quantized_gradients || v == (qgz_bits ? Json(4) : Json(256))
               ? nullptr
               : "gradients are reduced unquantized (zero_quantized_gradients is false)";
  // The reducer's wire dtype (grad/reducer.h), except under qgZ.
  if (k == "communication_data_type")
    return c.zero_quantized_gradients && c.communication_data_type != "fp32"
               ? "qgZ quantizes the gradients from fp32 (zero_quantized_gradients is on)"
               : nullptr;
  // Stages 1 and 2 act (config.cpp, apply_stage); stage 0 runs as 2.
  if (k == "zero_optimization.stage")
    return v == 0 ? "stage 0 (no ZeRO) runs as stage 2: parameters whole on every rank, gradients "
                    "and optimizer state sharded; the same numbers as unsharded training"
                  : nullptr;
  if (c.stage < 3 && (k == "zero_optimization.param_persistence_threshold" ||
                      k == "zero_optimization.model_persistence_threshold" ||
                      k == "zero_optimization.max_live_parameters" ||
                      k == "zero_optimization.max_reuse_distance" ||
                      k == "zero_optimization.module_granularity_threshold" ||
                      k == "zero_optimization.prefetch_bucket_size"))
    return "read only at ZeRO stage 3: below it every parameter stays gathered on every rank";
  if (const Rule* rule = rule_for(k)) return v == rule->agrees ? nullptr : rule->reason;
  return nullptr;
}

}  // namespace

std::vector<InactiveKey> inactive_keys(const Config& config) {
  std::vector<InactiveKey> out;
  for (const WrittenKey& key : config.written) {
    const Json value = Json::parse(key.value);
    if (const char* reason = reason_for(key, value, config))
      out.push_back({key.path, key.value, reason});
  }
  return out;
}

}  // namespace zs
