// A Chrome-trace timeline of what the engine does (ZS_TRACE=path): every
// collective on every group and every optimizer step, one file per rank
// ("%r" in the path is the rank; otherwise ".rank<N>.json" is appended).
// Events are written as they end, in the JSON array format that Chrome's
// trace viewer and Perfetto read even without the closing bracket, so a
// run that crashes still leaves its timeline up to the crash.
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

namespace zs {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  // The trace ZS_TRACE asks for, or null when it is unset or empty.
  // Throws InvalidArgument naming the path when the file cannot be made.
  static std::shared_ptr<Trace> from_env(int rank);
  ~Trace();
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // A complete event: `name` in `category` on lane `lane` (a group's name,
  // "optimizer"), from begin to end, with an optional JSON object of args.
  void event(const char* category, const std::string& name, const std::string& lane,
             Clock::time_point begin, Clock::time_point end, const std::string& args_json = "");

  const std::string& path() const { return path_; }

 private:
  Trace(std::FILE* f, std::string path, int rank);
  int lane_id(const std::string& lane);

  std::mutex mu_;
  std::FILE* file_;
  const std::string path_;
  const int rank_;
  const Clock::time_point origin_;
  std::string lanes_[64];
  int num_lanes_ = 0;
};

}  // namespace zs
