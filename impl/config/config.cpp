// DeepSpeed JSON config -> zs::Config. The parser reads each section through a
// Section, which resolves key aliases, treats "auto" as "keep the engine
// default", type-checks values and remembers which keys it saw, so unknown
// keys can be reported (engine-owned sections) or listed as unused (top level).
#include "impl/config/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "impl/common/error.h"
#include "impl/device/device.h"

namespace zs {
namespace {

// ordered_json keeps input order, so unused_keys come out as written.
using Json = nlohmann::ordered_json;

constexpr size_t kMaxShownValue = 60;
// A DeepSpeed config is a few KiB, a few levels deep, tens of keys per
// section. The limits refuse hostile or broken input (a 200k-key object,
// 100k levels of nesting, /dev/zero) in time linear in what was read,
// long before ordered_json's per-key insertion cost could grow.
constexpr size_t kMaxConfigBytes = size_t{1} << 20;
constexpr int kMaxConfigDepth = 32;
constexpr size_t kMaxKeysPerObject = 512;
// Element counts the engine allocates buffers of (bucket and sub-group
// sizes): 2^50 is beyond any model, and far from where a size in bytes
// wraps. Thresholds and limits that are only compared (persistence,
// max_live_parameters; DeepSpeed writes sys.maxsize for "none") take any
// int64.
constexpr int64_t kMaxElements = int64_t{1} << 50;
constexpr size_t kMaxSuggestDistance = 2;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// The value as written, shortened so a whole section does not flood a message.
std::string show(const Json& value) {
  std::string text = value.dump();
  if (text.size() > kMaxShownValue) text = text.substr(0, kMaxShownValue) + "...";
  return text;
}

// A JSON value together with the path it was found under.
struct Entry {
  const Json* value;
  std::string path;
};

[[noreturn]] void fail_value(const Entry& entry, const std::string& expected) {
  fail(Code::InvalidConfig, entry.path, ": got ", show(*entry.value),
       ", expected ", expected);
}

bool is_auto(const Json& value) { return value.is_string() && value == "auto"; }

// DeepSpeed declares these Optional, so null means "not given".
bool is_nullable(const std::string& key) {
  static const std::set<std::string> kNullable = {
      "overlap_comm", "offload_param", "offload_optimizer", "nvme_path",
      "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
      "zeropp_loco_param", "zenflow", "aio", "communication_data_type"};
  return kNullable.count(key) > 0;
}

// ---- scalar conversions (the value is known to be neither absent nor "auto")

int64_t to_int(const Entry& entry) {
  const Json& v = *entry.value;
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      fail_value(entry, "an integer <= 9223372036854775807");
    }
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    // DeepSpeed configs write sizes as 5e8; accept floats that are integers.
    const double d = v.get<double>();
    const double limit = 9223372036854775808.0;  // 2^63
    if (std::trunc(d) != d || d < -limit || d >= limit) {
      fail_value(entry, "an integer");
    }
    return static_cast<int64_t>(d);
  }
  if (v.is_string()) fail_value(entry, "an integer, not a string");
  fail_value(entry, "an integer");
}

bool to_bool(const Entry& entry) {
  if (!entry.value->is_boolean()) fail_value(entry, "true, false or \"auto\"");
  return entry.value->get<bool>();
}

double to_number(const Entry& entry) {
  const Json& v = *entry.value;
  if (v.is_string()) fail_value(entry, "a number, not a string");
  if (!v.is_number()) fail_value(entry, "a number");
  return v.get<double>();
}

std::string to_string(const Entry& entry) {
  if (!entry.value->is_string()) fail_value(entry, "a string");
  return entry.value->get<std::string>();
}

std::string format_number(double d) {
  std::ostringstream os;
  os << d;
  return os.str();
}

// ---- typo suggestions

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

// The closest known key within kMaxSuggestDistance edits, or "".
std::string closest_key(const std::string& key,
                        const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = kMaxSuggestDistance + 1;
  for (const std::string& candidate : known) {
    const size_t d = edit_distance(key, candidate);
    if (d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

// Kinds of DeepSpeed options the engine accepts without acting on them.
enum class Kind { Bool, Count, Int, Number, Object, Any };

// One JSON object being read. Every lookup records the names it knows, so
// after all reads the remaining keys are exactly the unknown ones.
class Section {
 public:
  Section(const Json& object, std::string path, std::string canonical,
          std::set<std::string>& unused, std::vector<WrittenKey>& written)
      : object_(object), path_(std::move(path)), canonical_(std::move(canonical)),
        unused_(unused), written_(written) {}

  const std::string& path() const { return path_; }

  // The value under any of `names` (spellings of one option), or none when
  // absent, "auto", or null for an Optional option. Two spellings with
  // different values are an error naming both.
  std::optional<Entry> given(std::initializer_list<const char*> names) {
    auto found = find(names);
    if (found) written_.push_back({join_path(canonical_, *names.begin()), found->path,
                                   found->value->dump()});
    return found;
  }

  // The sub-section under `names`, or none when absent, null (if Optional)
  // or "auto".
  std::optional<Section> child(std::initializer_list<const char*> names) {
    auto e = find(names);
    if (!e) return std::nullopt;
    if (!e->value->is_object()) fail_value(*e, "an object");
    return Section(*e->value, e->path, join_path(canonical_, *names.begin()), unused_,
                   written_);
  }

  void read(std::initializer_list<const char*> names, bool& out) {
    if (auto e = given(names)) out = to_bool(*e);
  }

  // Integers in [lo, hi].
  void read(std::initializer_list<const char*> names, int64_t& out, int64_t lo,
            int64_t hi = INT64_MAX) {
    auto e = given(names);
    if (!e) return;
    const int64_t v = to_int(*e);
    if (v < lo || v > hi) {
      fail_value(*e, hi == INT64_MAX ? "an integer >= " + std::to_string(lo)
                                     : "an integer in [" + std::to_string(lo) +
                                           ", " + std::to_string(hi) + "]");
    }
    out = v;
  }

  void read(std::initializer_list<const char*> names, int& out, int lo, int hi) {
    int64_t wide = out;
    read(names, wide, lo, hi);
    out = static_cast<int>(wide);
  }

  // Finite numbers >= lo (> lo when lo_open) and <= hi.
  void read(std::initializer_list<const char*> names, double& out, double lo,
            double hi, bool lo_open = false) {
    auto e = given(names);
    if (!e) return;
    const double v = to_number(*e);
    const bool above = lo_open ? v > lo : v >= lo;
    if (!above || v > hi || !std::isfinite(v)) {
      std::string expected = std::string("a number ") + (lo_open ? "> " : ">= ") +
                             format_number(lo);
      if (std::isfinite(hi)) expected += " and <= " + format_number(hi);
      fail_value(*e, expected);
    }
    out = v;
  }

  // A DeepSpeed option the engine does not act on: type-checked, then listed
  // in unused_keys.
  void skip(std::initializer_list<const char*> names, Kind kind) {
    auto e = given(names);
    if (e) check_kind(*e, kind);
    for (const char* name : names) {
      if (object_.contains(name)) unused_.insert(join_path(path_, name));
    }
  }

  // Engine-owned sections: any key no read asked for is an error.
  void reject_unknown() const {
    for (const auto& item : object_.items()) {
      if (is_known(item.key())) continue;
      const std::string path = join_path(path_, item.key());
      const std::string suggestion = closest_key(item.key(), known_);
      if (!suggestion.empty()) {
        fail(Code::InvalidConfig, path, ": unknown key, did you mean \"",
             suggestion, "\"?");
      }
      fail(Code::InvalidConfig, path, ": unknown key, expected a ",
           path_.rfind("zeroshard", 0) == 0 ? "zeroshard " : "DeepSpeed ", path_, " option");
    }
  }

  // Top level: keys no read asked for belong to the trainer; list them.
  void collect_unknown() const {
    for (const auto& item : object_.items()) {
      if (!is_known(item.key())) unused_.insert(join_path(path_, item.key()));
    }
  }

 private:
  // given() without recording the key as written (sections are not values).
  std::optional<Entry> find(std::initializer_list<const char*> names) {
    std::optional<Entry> found;
    const char* found_name = nullptr;
    for (const char* name : names) {
      known_.emplace_back(name);
      auto it = object_.find(name);
      if (it == object_.end()) continue;
      Entry entry{&*it, join_path(path_, name)};
      if (found && *found->value != *entry.value) {
        fail(Code::InvalidConfig, found->path, " (", show(*found->value), ") and ",
             entry.path, " (", show(*entry.value),
             ") are the same option with different values, expected one value");
      }
      if (!found) {
        found = entry;
        found_name = name;
      }
    }
    if (!found || is_auto(*found->value)) return std::nullopt;
    if (found->value->is_null() && is_nullable(found_name)) return std::nullopt;
    return found;
  }

  bool is_known(const std::string& key) const {
    return std::find(known_.begin(), known_.end(), key) != known_.end();
  }

  static void check_kind(const Entry& e, Kind kind) {
    switch (kind) {
      case Kind::Bool: to_bool(e); break;
      case Kind::Count:
        if (to_int(e) < 0) fail_value(e, "an integer >= 0");
        break;
      case Kind::Int: to_int(e); break;
      case Kind::Number: to_number(e); break;
      case Kind::Object:
        if (!e.value->is_object()) fail_value(e, "an object");
        break;
      case Kind::Any: break;
    }
  }

  const Json& object_;
  std::string path_;
  std::string canonical_;  // path_ with each section's first spelling
  std::vector<std::string> known_;
  std::set<std::string>& unused_;
  std::vector<WrittenKey>& written_;
};

// ---- sections

void read_device(Section& s, OffloadConfig& out) {
  auto e = s.given({"device"});
  if (!e) return;
  const std::string device = e->value->is_string() ? e->value->get<std::string>() : "";
  if (device != "cpu" && device != "nvme" && device != "none") {
    fail_value(*e, "\"cpu\", \"nvme\" or \"none\"");
  }
  out.device = device;
}

void require_nvme_path(const Section& s, const OffloadConfig& out) {
  if (out.device != "nvme" || !out.nvme_path.empty()) return;
  fail(Code::InvalidConfig, join_path(s.path(), "nvme_path"),
       ": missing or empty, expected a directory path when device is \"nvme\"");
}

void parse_offload_param(Section& s, OffloadConfig& out) {
  read_device(s, out);
  if (auto e = s.given({"nvme_path"})) out.nvme_path = to_string(*e);
  s.read({"pin_memory"}, out.pin_memory);
  s.read({"buffer_count"}, out.buffer_count, 0);
  s.read({"buffer_size"}, out.buffer_size, 0, kMaxElements);
  s.read({"max_in_cpu"}, out.max_in_cpu, 0);
  s.reject_unknown();
  require_nvme_path(s, out);
}

void parse_offload_optimizer(Section& s, OffloadConfig& out) {
  read_device(s, out);
  if (auto e = s.given({"nvme_path"})) out.nvme_path = to_string(*e);
  s.read({"pin_memory"}, out.pin_memory);
  s.read({"buffer_count"}, out.buffer_count, 0);
  s.read({"ratio"}, out.ratio, 0.0, 1.0);
  s.read({"pipeline_read"}, out.pipeline_read);
  s.read({"pipeline_write"}, out.pipeline_write);
  s.skip({"fast_init"}, Kind::Bool);
  s.skip({"super_offload"}, Kind::Bool);
  s.skip({"convert_grad_on_cpu"}, Kind::Bool);
  s.skip({"cpuadam_cores_perc"}, Kind::Number);
  s.reject_unknown();
  require_nvme_path(s, out);
}

// Legacy `cpu_offload: true` spells `offload_X: {"device": "cpu"}`; together
// with an offload section that names another device it is a contradiction.
void apply_legacy_offload(Section& zero, const char* legacy_key,
                          const char* section_key, OffloadConfig& out) {
  auto e = zero.given({legacy_key});
  if (!e || !to_bool(*e)) return;
  if (out.device != "none" && out.device != "cpu") {
    fail(Code::InvalidConfig, e->path, " (true) and ",
         join_path(zero.path(), section_key), ".device (\"", out.device,
         "\") disagree, expected one of them");
  }
  out.device = "cpu";
}

void parse_offloads(Section& zero, Config& c) {
  if (auto s = zero.child({"offload_param"})) {
    parse_offload_param(*s, c.offload_param);
  }
  if (auto s = zero.child({"offload_optimizer"})) {
    parse_offload_optimizer(*s, c.offload_optimizer);
  }
  apply_legacy_offload(zero, "cpu_offload_param", "offload_param", c.offload_param);
  apply_legacy_offload(zero, "cpu_offload", "offload_optimizer", c.offload_optimizer);
}

void read_mics_shard_size(Section& zero, Config& c) {
  auto e = zero.given({"mics_shard_size"});
  if (!e) return;
  const int64_t v = to_int(*e);
  if (v != -1 && v < 1) fail_value(*e, "-1 (off) or an integer >= 1");
  c.mics_shard_size = v;
}

// A code width and block size of qwZ or qgZ (zeroshard's keys;
// kernels/quant.h): `<prefix>_bits` and `<prefix>_block_size`.
void read_quant_shape(Section& zero, const std::string& prefix, int64_t& bits,
                      int64_t& block_size) {
  const std::string bits_key = prefix + "_bits", block_key = prefix + "_block_size";
  if (auto e = zero.given({bits_key.c_str()})) {
    const int64_t v = to_int(*e);
    if (v != 8 && v != 4) fail_value(*e, "8 or 4");
    bits = v;
  }
  if (auto e = zero.given({block_key.c_str()})) {
    const int64_t v = to_int(*e);
    if (v < 2 || v > (int64_t{1} << 24) || v % 2 != 0)
      fail_value(*e, "an even integer from 2 to 16777216");
    block_size = v;
  }
}

// zeropp_loco_param: DeepSpeed reads both keys (no defaults), so both are
// required; the object is recorded as written so inactive_keys can name it.
void read_loco(Section& zero, Config& c) {
  if (!zero.given({"zeropp_loco_param"})) return;
  auto s = zero.child({"zeropp_loco_param"});
  if (!s) return;
  double beta = std::nan("");
  int64_t reset = 0;
  s->read({"err_beta"}, beta, 0.0, 1.0);
  s->read({"reset_T"}, reset, 1);
  s->reject_unknown();
  auto missing = [&](const char* key) {
    fail(Code::InvalidConfig, s->path(), ".", key,
         ": missing, expected both err_beta (a number in [0, 1]) and reset_T (an integer >= 1)");
  };
  if (std::isnan(beta)) missing("err_beta");
  if (reset == 0) missing("reset_T");
  c.zeropp_loco_err_beta = beta;
  c.zeropp_loco_reset_T = reset;
  c.zeropp_loco = true;
}

void read_quantization(Section& zero, Config& c) {
  zero.read({"zero_quantized_weights"}, c.zero_quantized_weights);
  zero.read({"zero_quantized_nontrainable_weights"}, c.zero_quantized_nontrainable_weights);
  read_quant_shape(zero, "zero_quantized_weights", c.zero_quantized_weights_bits,
                   c.zero_quantized_weights_block_size);
  zero.read({"zero_quantized_gradients"}, c.zero_quantized_gradients);
  read_quant_shape(zero, "zero_quantized_gradients", c.zero_quantized_gradients_bits,
                   c.zero_quantized_gradients_block_size);
  read_loco(zero, c);
}

// DeepSpeed options inside zero_optimization that the engine does not act on.
void skip_zero_extras(Section& zero) {
  for (const char* key :
       {"use_multi_rank_bucket_allreduce", "allgather_partitions",
        "load_from_fp32_weights", "elastic_checkpoint", "cpu_offload_use_pin_memory",
        "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply",
        "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "parameter_alignment", "compute_grad_norm"}) {
    zero.skip({key}, Kind::Bool);
  }
  zero.skip({"use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params"},
            Kind::Bool);
  zero.skip({"allgather_sequential", "stage3_allgather_sequential"}, Kind::Bool);
  zero.skip({"partition_stream_chunk_size", "stage3_partition_stream_chunk_size"},
            Kind::Count);
  zero.skip({"zenflow"}, Kind::Object);
  zero.skip({"leaf_module"}, Kind::Object);
}

void parse_zero(Section& zero, Config& c) {
  zero.read({"stage"}, c.stage, 0, 3);
  zero.read({"reduce_bucket_size"}, c.reduce_bucket_size, 0, kMaxElements);
  zero.read({"allgather_bucket_size"}, c.allgather_bucket_size, 0, kMaxElements);
  zero.read({"overlap_comm"}, c.overlap_comm);
  zero.read({"contiguous_gradients"}, c.contiguous_gradients);
  zero.read({"reduce_scatter"}, c.reduce_scatter);
  zero.read({"sub_group_size"}, c.sub_group_size, 0, kMaxElements);
  zero.read({"prefetch_bucket_size", "stage3_prefetch_bucket_size"},
            c.prefetch_bucket_size, 0);
  zero.read({"param_persistence_threshold", "stage3_param_persistence_threshold"},
            c.param_persistence_threshold, 0);
  zero.read({"model_persistence_threshold", "stage3_model_persistence_threshold"},
            c.model_persistence_threshold, 0);
  zero.read({"max_live_parameters", "stage3_max_live_parameters"},
            c.max_live_parameters, 0);
  zero.read({"max_reuse_distance", "stage3_max_reuse_distance"},
            c.max_reuse_distance, 0);
  zero.read({"module_granularity_threshold", "stage3_module_granularity_threshold"},
            c.module_granularity_threshold, 0);
  zero.read({"gather_16bit_weights_on_model_save",
             "stage3_gather_16bit_weights_on_model_save",
             "stage3_gather_fp16_weights_on_model_save",
             "gather_fp16_weights_on_model_save"},
            c.gather_16bit_weights_on_model_save);
  zero.read({"round_robin_gradients"}, c.round_robin_gradients);
  read_mics_shard_size(zero, c);
  zero.read({"mics_hierarchical_params_gather"}, c.mics_hierarchical_params_gather);
  zero.read({"zero_hpz_partition_size"}, c.zero_hpz_partition_size, 1);
  read_quantization(zero, c);
  parse_offloads(zero, c);
  skip_zero_extras(zero);
  zero.reject_unknown();
}

void parse_aio(Section& aio, AioConfig& out) {
  // Bounds: a 1 GiB I/O block, io_uring's largest ring (32768 entries), and
  // more I/O threads than any machine has cores.
  aio.read({"block_size"}, out.block_size, 1, int64_t{1} << 30);
  aio.read({"queue_depth"}, out.queue_depth, 1, 32768);
  // Older DeepSpeed calls it thread_count, newer intra_op_parallelism.
  aio.read({"intra_op_parallelism", "thread_count"}, out.thread_count, 1, 1024);
  aio.read({"single_submit"}, out.single_submit);
  aio.read({"overlap_events"}, out.overlap_events);
  aio.skip({"use_gds"}, Kind::Bool);
  aio.reject_unknown();
}

void parse_bf16(Section& bf16, Config& c) {
  bf16.read({"enabled"}, c.bf16);
  bf16.skip({"immediate_grad_update"}, Kind::Bool);
  bf16.skip({"check_grad_overflow"}, Kind::Bool);
  bf16.read({"bf16_master_weights_and_grads"}, c.bf16_master_weights_and_grads);
  bf16.read({"bf16_optimizer_states"}, c.bf16_optimizer_states);
  bf16.reject_unknown();
}

void parse_fp16(Section& fp16, Config& c) {
  fp16.read({"enabled"}, c.fp16);
  fp16.read({"loss_scale"}, c.loss_scale, 0.0, kInf);
  fp16.read({"initial_scale_power"}, c.initial_scale_power, 0, 64);
  fp16.read({"loss_scale_window"}, c.loss_scale_window, 1);
  fp16.read({"hysteresis"}, c.hysteresis, 1);
  fp16.read({"consecutive_hysteresis"}, c.consecutive_hysteresis);
  fp16.read({"min_loss_scale"}, c.min_loss_scale, 0.0, kInf, /*lo_open=*/true);
  fp16.skip({"auto_cast"}, Kind::Bool);
  fp16.skip({"fp16_master_weights_and_grads"}, Kind::Bool);
  fp16.reject_unknown();
}

void read_communication_data_type(Section& top, Config& c) {
  auto e = top.given({"communication_data_type"});
  if (!e) return;
  std::string type = e->value->is_string() ? e->value->get<std::string>() : "";
  // DeepSpeed lower-cases this one.
  std::transform(type.begin(), type.end(), type.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  if (type != "fp32" && type != "fp16" && type != "bf16") {
    fail_value(*e, "\"fp32\", \"fp16\", \"bf16\" or null");
  }
  c.communication_data_type = type;
}

// zeroshard's own: where the engine keeps its memory ("cpu", "cuda:N").
void read_device(Section& top, Config& c) {
  auto e = top.given({"device"});
  if (!e) return;
  const std::string text = e->value->is_string() ? e->value->get<std::string>() : "";
  DeviceRef ref;
  if (!try_parse_device(text, &ref)) fail_value(*e, "\"cpu\", \"cuda\" or \"cuda:N\"");
  c.device = text;
}

// zeroshard's own section: healing.peer_copy, healing.min_ranks and
// healing.replacement_wait_s (landing steps 1 and 6 of docs/healing.md).
void parse_zeroshard(Section& zs, Config& c) {
  if (auto healing = zs.child({"healing"})) {
    if (auto e = healing->given({"peer_copy"})) {
      if (!e->value->is_boolean()) fail_value(*e, "true, false or \"auto\"");
      c.heal_peer_copy = e->value->get<bool>() ? 1 : 0;
    }
    healing->read({"min_ranks"}, c.heal_min_ranks, 1, 1 << 20);
    healing->read({"replacement_wait_s"}, c.heal_replacement_wait_s, 0, 86400);
    healing->reject_unknown();
  }
  zs.reject_unknown();
}

void parse_top(Section& top, Config& c) {
  if (auto zero = top.child({"zero_optimization"})) {
    parse_zero(*zero, c);
  }
  if (auto aio = top.child({"aio"})) parse_aio(*aio, c.aio);
  if (auto bf16 = top.child({"bf16", "bfloat16"})) parse_bf16(*bf16, c);
  if (auto fp16 = top.child({"fp16"})) parse_fp16(*fp16, c);
  top.read({"gradient_clipping"}, c.gradient_clipping, 0.0, kInf);
  top.read({"zero_allow_untested_optimizer"}, c.zero_allow_untested_optimizer);
  top.read({"zero_force_ds_cpu_optimizer"}, c.zero_force_ds_cpu_optimizer);
  read_communication_data_type(top, c);
  read_device(top, c);
  top.read({"prescale_gradients"}, c.prescale_gradients);
  top.read({"gradient_predivide_factor"}, c.gradient_predivide_factor, 0.0, kInf,
           /*lo_open=*/true);
  if (auto zs = top.child({"zeroshard"})) parse_zeroshard(*zs, c);
  top.collect_unknown();
}

// ZeRO stages below 3 keep every parameter whole on each rank, as
// DeepSpeed's stages 1 and 2 do: each param is persistent (gathered at its
// first use, kept, and refreshed in place by the step's gather), so no
// forward or backward gathers, while gradients and optimizer state stay
// sharded. Stage 1 thereby shards gradients too (DeepSpeed's all-reduces
// them whole): the same numbers, less memory. inactive.cpp lists the
// stage-3 keys this overrides.
void apply_stage(Config& c) {
  if (c.stage >= 3) return;
  c.param_persistence_threshold = INT64_MAX;
  c.model_persistence_threshold = INT64_MAX;
}

// ---- checks across options

void check_precision(const Config& c) {
  if (c.bf16 && c.fp16) {
    fail(Code::InvalidConfig,
         "bf16.enabled (true) and fp16.enabled (true): expected at most one of them");
  }
  // DeepSpeed's rules (runtime/config.py, base_optimizer.py): bf16 masters
  // and states are bf16 training's options, and bf16 states need bf16
  // masters.
  if (c.bf16_master_weights_and_grads && !c.bf16) {
    fail(Code::InvalidConfig, "bf16.bf16_master_weights_and_grads (true) needs bf16.enabled (true), "
         "which is ", c.fp16 ? "off (fp16.enabled is on)" : "off");
  }
  if (c.bf16_optimizer_states && !c.bf16) {
    fail(Code::InvalidConfig, "bf16.bf16_optimizer_states (true) needs bf16.enabled (true), which is ",
         c.fp16 ? "off (fp16.enabled is on)" : "off");
  }
  if (c.bf16_optimizer_states && !c.bf16_master_weights_and_grads) {
    fail(Code::InvalidConfig, "bf16.bf16_optimizer_states (true) needs "
         "bf16.bf16_master_weights_and_grads (true), which is off: bf16 optimizer states go with "
         "bf16 master weights (as in DeepSpeed)");
  }
}

void check_partial_offload(const Config& c) {
  // DeepSpeed: partial optimizer offload exists only in ZeRO-3.
  if (c.offload_optimizer.ratio < 1.0 && c.stage != 3) {
    fail(Code::InvalidConfig, "zero_optimization.offload_optimizer.ratio: got ",
         Json(c.offload_optimizer.ratio).dump(), ", expected 1.0 unless stage is 3 (stage is ",
         c.stage, ")");
  }
}

void check_topology(const Config& c, int world_size) {
  const bool mics = c.mics_shard_size != -1;
  const bool hpz = c.zero_hpz_partition_size > 1;
  if (mics && hpz) {
    fail(Code::InvalidConfig, "zero_optimization.zero_hpz_partition_size (",
         c.zero_hpz_partition_size, ") and zero_optimization.mics_shard_size (",
         c.mics_shard_size,
         "): expected at most one of them, DeepSpeed does not combine hpZ and MiCS");
  }
  if (world_size <= 0) return;
  if (mics && world_size % c.mics_shard_size != 0) {
    fail(Code::InvalidConfig, "zero_optimization.mics_shard_size: ", c.mics_shard_size,
         " does not divide world size ", world_size);
  }
  if (world_size % c.zero_hpz_partition_size != 0) {
    fail(Code::InvalidConfig, "zero_optimization.zero_hpz_partition_size: ",
         c.zero_hpz_partition_size, " does not divide world size ", world_size);
  }
}

// ---- JSON text

// DeepSpeed loads configs with a hook that rejects duplicate keys; so do we,
// and refuse nesting deeper than kMaxConfigDepth and objects of more than
// kMaxKeysPerObject keys as they are read.
class DuplicateKeyCheck {
 public:
  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (frames_.size() >= static_cast<size_t>(kMaxConfigDepth))
          fail(Code::InvalidConfig, child_path().empty() ? "the config" : child_path(),
               ": nested more than ", kMaxConfigDepth, " levels deep, expected at most ",
               kMaxConfigDepth);
        frames_.push_back({child_path(), {}, {},
                           event == Json::parse_event_t::array_start});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        frames_.pop_back();
        break;
      case Json::parse_event_t::key: {
        Frame& frame = frames_.back();
        frame.key = parsed.get<std::string>();
        if (frame.keys.size() >= kMaxKeysPerObject)
          fail(Code::InvalidConfig, frame.path.empty() ? "the config" : frame.path,
               ": more than ", kMaxKeysPerObject, " keys in one object, expected at most ",
               kMaxKeysPerObject);
        if (!frame.keys.insert(frame.key).second) {
          fail(Code::InvalidConfig, join_path(frame.path, frame.key),
               ": duplicate key, expected each key once");
        }
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  struct Frame {
    std::string path;
    std::set<std::string> keys;
    std::string key;  // the latest key, which names the next child
    bool array;
  };

  std::string child_path() const {
    if (frames_.empty()) return "";
    const Frame& top = frames_.back();
    return top.array ? top.path + "[]" : join_path(top.path, top.key);
  }

  std::vector<Frame> frames_;
};

Json parse_json(const std::string& text) {
  if (text.size() > kMaxConfigBytes)
    fail(Code::InvalidConfig, "the config is ", text.size(), " bytes, expected at most ",
         kMaxConfigBytes);
  DuplicateKeyCheck check;
  try {
    return Json::parse(text, [&check](int depth, Json::parse_event_t event, Json& parsed) {
      return check(depth, event, parsed);
    });
  } catch (const Json::exception& e) {
    // parse_error, or out_of_range for a number beyond a double ("1e400",
    // found by tests/fuzz/config_fuzz.cpp). Drop nlohmann's
    // "[json.exception.parse_error.101] " prefix.
    std::string what = e.what();
    const size_t prefix_end = what.find("] ");
    if (prefix_end != std::string::npos) what = what.substr(prefix_end + 2);
    fail(Code::InvalidConfig, "invalid JSON: ", what);
  }
}

// The paths in `wanted` in the order they appear in the document.
void collect_in_order(const Json& object, const std::string& path,
                      const std::set<std::string>& wanted,
                      std::vector<std::string>& out) {
  for (const auto& item : object.items()) {
    const std::string child = join_path(path, item.key());
    if (wanted.count(child)) {
      out.push_back(child);
    } else if (item.value().is_object()) {
      collect_in_order(item.value(), child, wanted, out);
    }
  }
}

Json offload_to_json(const OffloadConfig& o) {
  Json j;
  j["device"] = o.device;
  j["nvme_path"] = o.nvme_path.empty() ? Json(nullptr) : Json(o.nvme_path);
  j["pin_memory"] = o.pin_memory;
  j["buffer_count"] = o.buffer_count;
  return j;
}

Json zero_to_json(const Config& c) {
  Json z;
  z["stage"] = c.stage;
  z["reduce_bucket_size"] = c.reduce_bucket_size;
  z["allgather_bucket_size"] = c.allgather_bucket_size;
  z["overlap_comm"] = c.overlap_comm;
  z["contiguous_gradients"] = c.contiguous_gradients;
  z["reduce_scatter"] = c.reduce_scatter;
  z["sub_group_size"] = c.sub_group_size;
  z["prefetch_bucket_size"] = c.prefetch_bucket_size;
  z["param_persistence_threshold"] = c.param_persistence_threshold;
  z["model_persistence_threshold"] = c.model_persistence_threshold;
  z["max_live_parameters"] = c.max_live_parameters;
  z["max_reuse_distance"] = c.max_reuse_distance;
  z["module_granularity_threshold"] = c.module_granularity_threshold;
  z["gather_16bit_weights_on_model_save"] = c.gather_16bit_weights_on_model_save;
  z["round_robin_gradients"] = c.round_robin_gradients;
  z["mics_shard_size"] = c.mics_shard_size;
  z["mics_hierarchical_params_gather"] = c.mics_hierarchical_params_gather;
  z["zero_hpz_partition_size"] = c.zero_hpz_partition_size;
  z["zero_quantized_weights"] = c.zero_quantized_weights;
  z["zero_quantized_weights_bits"] = c.zero_quantized_weights_bits;
  z["zero_quantized_weights_block_size"] = c.zero_quantized_weights_block_size;
  z["zero_quantized_nontrainable_weights"] = c.zero_quantized_nontrainable_weights;
  z["zero_quantized_gradients"] = c.zero_quantized_gradients;
  z["zero_quantized_gradients_bits"] = c.zero_quantized_gradients_bits;
  z["zero_quantized_gradients_block_size"] = c.zero_quantized_gradients_block_size;
  if (c.zeropp_loco) {
    Json loco;
    loco["err_beta"] = c.zeropp_loco_err_beta;
    loco["reset_T"] = c.zeropp_loco_reset_T;
    z["zeropp_loco_param"] = loco;
  }
  Json param = offload_to_json(c.offload_param);
  param["buffer_size"] = c.offload_param.buffer_size;
  param["max_in_cpu"] = c.offload_param.max_in_cpu;
  z["offload_param"] = param;
  Json optimizer = offload_to_json(c.offload_optimizer);
  optimizer["ratio"] = c.offload_optimizer.ratio;
  optimizer["pipeline_read"] = c.offload_optimizer.pipeline_read;
  optimizer["pipeline_write"] = c.offload_optimizer.pipeline_write;
  z["offload_optimizer"] = optimizer;
  return z;
}

Json aio_to_json(const AioConfig& a) {
  Json j;
  j["block_size"] = a.block_size;
  j["queue_depth"] = a.queue_depth;
  j["intra_op_parallelism"] = a.thread_count;
  j["single_submit"] = a.single_submit;
  j["overlap_events"] = a.overlap_events;
  return j;
}

Json fp16_to_json(const Config& c) {
  Json j;
  j["enabled"] = c.fp16;
  j["loss_scale"] = c.loss_scale;
  j["initial_scale_power"] = c.initial_scale_power;
  j["loss_scale_window"] = c.loss_scale_window;
  j["hysteresis"] = c.hysteresis;
  j["consecutive_hysteresis"] = c.consecutive_hysteresis;
  j["min_loss_scale"] = c.min_loss_scale;
  return j;
}

}  // namespace

// How healing was switched on, for messages.
std::string heal_config_key(bool from_env) {
  return from_env ? "zeroshard.healing.peer_copy (\"auto\", on because ZS_HEAL=1)"
                  : "zeroshard.healing.peer_copy (true)";
}

// What the peer copy cannot keep yet, refused by name before any socket
// opens (docs/healing.md, section 1: the holder recomputes a step from the
// gradient alone, so every per-rank input of the update must travel with it
// or be equal on every rank).
void check_healing(const Config& c, bool from_env, int world) {
  if (c.heal_peer_copy != 1) return;
  const std::string key = heal_config_key(from_env);
  const char* off = "; set zeroshard.healing.peer_copy false (or unset ZS_HEAL) to run without it";
  if (world == 1)
    fail(Code::InvalidConfig, key, " in a world of ", world, " rank: the copy lives in another rank's memory, "
         "and there is none", off);
  if (c.offload_optimizer.device == "nvme")
    fail(Code::InvalidConfig, key, " with zero_optimization.offload_optimizer.device \"nvme\": the state "
         "on NVMe is stepped sub-group by sub-group from the swap file, which the holder's replica in memory "
         "does not follow yet", off);
  if (c.zeropp_loco)
    fail(Code::InvalidConfig, key, " with zero_optimization.zeropp_loco_param (qgZ's LoCo error feedback): "
         "its error buffers are per-rank state the holder cannot recompute from the gradient shard", off);
  if (c.mics_shard_size != -1)
    fail(Code::InvalidConfig, key, " with zero_optimization.mics_shard_size (", c.mics_shard_size,
         "): MiCS sums the gradient norm over shard groups apart, whose result the holder of another "
         "group's rank does not share; not checked yet", off);
}

Config parse_config(const std::string& json_text, int world_size) {
  const Json doc = parse_json(json_text);
  if (!doc.is_object()) {
    fail(Code::InvalidConfig, "config: got ", show(doc), ", expected a JSON object");
  }
  Config c;
  std::set<std::string> unused;
  Section top(doc, "", "", unused, c.written);
  parse_top(top, c);
  apply_stage(c);
  check_precision(c);
  check_partial_offload(c);
  check_topology(c, world_size);
  check_healing(c, false, world_size);  // peer_copy true; "auto" is resolved (and checked) at create
  collect_in_order(doc, "", unused, c.unused_keys);
  return c;
}

Config parse_config_file(const std::string& path, int world_size) {
  // A regular file only (not a FIFO, a device or a directory), and no more
  // than kMaxConfigBytes of it: /dev/zero must not be read forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    fail(Code::InvalidConfig, "cannot read config file '", path, "': ", std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    fail(Code::InvalidConfig, "cannot read config file '", path, "': ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    fail(Code::InvalidConfig, "config file '", path, "' is ",
         S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO"
         : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device" : "not a regular file",
         ", expected a regular file");
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigBytes)
    fail(Code::InvalidConfig, "config file '", path, "' is ", st.st_size,
         " bytes, expected at most ", kMaxConfigBytes);
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      fail(Code::InvalidConfig, "cannot read config file '", path, "': ", std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxConfigBytes)  // it grew while we read it
      fail(Code::InvalidConfig, "config file '", path, "' is more than ", kMaxConfigBytes,
           " bytes, expected at most ", kMaxConfigBytes);
  }
  return parse_config(text, world_size);
}

bool Config::given(const std::string& canonical) const {
  for (const auto& w : written)
    if (w.canonical == canonical) return true;
  return false;
}

std::string config_to_json(const Config& c) {
  Json j;
  j["zero_optimization"] = zero_to_json(c);
  j["aio"] = aio_to_json(c.aio);
  j["bf16"] = Json{{"enabled", c.bf16},
                   {"bf16_master_weights_and_grads", c.bf16_master_weights_and_grads},
                   {"bf16_optimizer_states", c.bf16_optimizer_states}};
  j["fp16"] = fp16_to_json(c);
  j["gradient_clipping"] = c.gradient_clipping;
  j["zero_allow_untested_optimizer"] = c.zero_allow_untested_optimizer;
  j["zero_force_ds_cpu_optimizer"] = c.zero_force_ds_cpu_optimizer;
  j["communication_data_type"] = c.communication_data_type.empty()
                                     ? Json(nullptr)
                                     : Json(c.communication_data_type);
  j["prescale_gradients"] = c.prescale_gradients;
  if (!c.device.empty()) j["device"] = c.device;
  j["gradient_predivide_factor"] = c.gradient_predivide_factor;
  Json healing{{"peer_copy", c.heal_peer_copy < 0 ? Json("auto") : Json(c.heal_peer_copy == 1)}};
  if (c.heal_min_ranks > 0) healing["min_ranks"] = c.heal_min_ranks;
  if (c.heal_replacement_wait_s > 0) healing["replacement_wait_s"] = c.heal_replacement_wait_s;
  j["zeroshard"] = Json{{"healing", healing}};
  return j.dump(2);
}

}  // namespace zs
