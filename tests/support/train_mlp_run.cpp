#include "tests/support/train_mlp_run.h"

#include <cstdio>
#include <cstdlib>
#include <regex>

namespace zs::test {

ExampleRun run_train_mlp(int ranks, const std::string& args, const std::string& env,
                         const std::string& zsrun_flags, double replacement_sleep_s,
                         const std::string& replacement_shell) {
  ExampleRun r;
  // ZS_TEST_BIN_DIR: the build's bin/ when the build was moved (the GPU
  // machine runs a build made elsewhere).
  const char* moved = std::getenv("ZS_TEST_BIN_DIR");
  const std::string bin = moved && *moved ? moved : ZS_BIN_DIR;
  std::string in_replacement = replacement_shell;
  if (replacement_sleep_s > 0) in_replacement = "sleep " + std::to_string(replacement_sleep_s) + "; " + in_replacement;
  const std::string late = in_replacement.empty()
                               ? ""
                               : "sh -c 'if [ -n \"$ZS_HEAL_REPLACEMENT\" ]; then " + in_replacement +
                                     " fi; exec \"$0\" \"$@\"' ";
  const std::string cmd = (env.empty() ? "" : "env " + env + " ") + bin + "/zsrun -n " +
                          std::to_string(ranks) + " " + zsrun_flags + " --no-prefix -- " + late + bin + "/train_mlp " +
                          args + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) r.out.append(buf, n);
  r.rc = pclose(f);
  const std::regex step_re(R"(^step (\d+) loss (\S+))");
  size_t start = 0;
  while (start < r.out.size()) {
    size_t end = r.out.find('\n', start);
    if (end == std::string::npos) end = r.out.size();
    const std::string line = r.out.substr(start, end - start);
    std::smatch m;
    if (std::regex_search(line, m, step_re)) r.losses.push_back(std::stod(m[2]));
    if (!line.empty() && line[0] == '{') r.json = line;
    start = end + 1;
  }
  return r;
}

}  // namespace zs::test
