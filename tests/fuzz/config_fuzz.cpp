// libFuzzer target: the DeepSpeed config parser on arbitrary text.
//
// Whatever the input, parse_config returns or throws zs::Error with code
// InvalidConfig and a message (any other exception, a crash, a hang or a
// sanitizer report is a finding). What parses must give an effective config
// (config_to_json) that parses again to the same effective config, with no
// differences against itself, and inactive_keys must not throw.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "impl/common/error.h"
#include "impl/config/config.h"

namespace {

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "config fuzz finding: %s: %s\n", what, detail.c_str());
  std::abort();
}

// Parses text for world_size; true when it parsed.
bool parse(const std::string& text, int world_size, zs::Config* out) {
  try {
    *out = zs::parse_config(text, world_size);
    return true;
  } catch (const zs::Error& e) {
    if (e.code() != zs::Code::InvalidConfig) finding("error code other than InvalidConfig", e.what());
    if (std::string(e.what()).empty()) finding("error without a message", text.substr(0, 200));
    return false;
  }
}

void check_round_trip(const zs::Config& config, int world_size) {
  (void)zs::inactive_keys(config);
  const std::string effective = zs::config_to_json(config);
  zs::Config again;
  try {
    again = zs::parse_config(effective, world_size);
  } catch (const zs::Error& e) {
    finding("effective config does not parse again", std::string(e.what()) + "\n" + effective);
  }
  const std::string effective_again = zs::config_to_json(again);
  if (effective_again != effective) {
    finding("effective config changes on a second parse", effective + "\n---\n" + effective_again);
  }
  const auto diffs = zs::config_differences(effective, effective_again, "the re-parsed config");
  if (!diffs.empty()) finding("an effective config differs from itself", diffs.front());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // World size 0 skips the topology checks; 8 is divided by the usual
  // mics_shard_size / zero_hpz_partition_size values. One per input (by its
  // length), which halves the cost of an execution.
  const int world_size = size % 2 == 0 ? 0 : 8;
  zs::Config config;
  if (parse(text, world_size, &config)) check_round_trip(config, world_size);
  return 0;
}
