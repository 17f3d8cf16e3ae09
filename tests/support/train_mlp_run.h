// Runs the train_mlp example under zsrun and parses what it prints: the
// per-step losses and the final JSON line.
#pragma once

#include <string>
#include <vector>

namespace zs::test {

struct ExampleRun {
  int rc = -1;
  std::string out;
  std::vector<double> losses;
  std::string json;
};

// env: "NAME=value ..." put before the command (empty: none); zsrun_flags:
// zsrun's own options ("--restarts 1"); replacement_sleep_s > 0: a rank
// started as a replacement (ZS_HEAL_REPLACEMENT set) sleeps that long
// before train_mlp starts, as a slow host would; replacement_shell: shell
// commands such a rank runs first ("unset ZS_FAULT_POINT;").
ExampleRun run_train_mlp(int ranks, const std::string& args, const std::string& env = "",
                         const std::string& zsrun_flags = "", double replacement_sleep_s = 0,
                         const std::string& replacement_shell = "");

}  // namespace zs::test
