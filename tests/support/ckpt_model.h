// A small model for checkpoint tests: params of awkward sizes (padded
// shards at 2, 3 and 4 ranks), a data-parallel loss over a fixed global
// batch of 12 samples split across ranks, and helpers that gather full
// values and write them where the test's parent process reads them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "tests/support/multirank.h"

namespace zs::test {

struct CkptModel {
  zs_context ctx = nullptr;
  std::vector<zs_param> params;
  zs_optimizer opt = nullptr;
  zs_dtype dtype = ZS_FLOAT32;
  int rank = 0, world = 1;
};

// Names, shapes: w1 [7, 5], b1 [5], w2 [3, 11], s [], z [0, 3], big [n_big]
// (0: absent).
// Seeded init, so values are the same at every world size.
CkptModel make_ckpt_model(const RankEnv& env, zs_dtype dtype, zs_optimizer_kind kind,
                          int64_t n_big = 0, int timeout_ms = 30000, const char* config_json = nullptr);
void destroy_ckpt_model(CkptModel& m);
// steps optimizer steps; gradients depend on the full params and on the
// global step number, so runs agree for any world size.
void train_ckpt_model(CkptModel& m, int steps);
// One micro-step's gradients of every param (train_ckpt_model's, times
// 1 + micro / 4), pushed; no step.
void push_ckpt_grads(CkptModel& m, int micro);
// Full values of every param, as fp32, concatenated in param order.
std::vector<float> full_values(CkptModel& m);
// Every optimizer state slot the optimizer has for each param (through
// zs_optimizer_state_data), concatenated in param and slot order.
std::vector<float> optimizer_values(CkptModel& m);

// Raw floats to and from a file.
void write_floats(const std::string& path, const std::vector<float>& v);
std::vector<float> read_floats(const std::string& path);
// read_floats of <prefix>.<rank> for ranks 0 .. world-1.
std::vector<std::vector<float>> read_per_rank(const std::string& prefix, int world);
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b);
// A fresh directory under $TMPDIR (or /tmp).
std::string make_temp_dir(const char* what);

// make_temp_dir's directory, removed with what it holds when the scope that
// made it ends (a failed assertion's included). Rank processes leave through
// _exit (run_ranks) and never remove it.
class TempDir {
 public:
  explicit TempDir(const char* what) : path_(make_temp_dir(what)) {}
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace zs::test
