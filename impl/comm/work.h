// The completion state of one piece of background work: done or not, and
// how it ended. Shared by the worker that finishes it and any waiter.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "impl/common/error.h"

namespace zs {

class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)) {}

  void complete(Code code, std::string message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      code_ = code;
      message_ = std::move(message);
      done_ = true;
    }
    cv_.notify_all();
  }

  bool done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  // Waits up to timeout_ms (< 0: forever). Throws the work's own error, or
  // Code::Timeout if it is still running (the work itself goes on).
  void wait(int timeout_ms) const {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout_ms < 0) {
      cv_.wait(lock, [&] { return done_; });
    } else if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return done_; })) {
      fail(Code::Timeout, what_, " still running after ", timeout_ms, " ms");
    }
    if (code_ != Code::Ok) throw Error(code_, message_);
  }

  // Throws the work's error if it finished with one.
  void rethrow_if_failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ && code_ != Code::Ok) throw Error(code_, message_);
  }

  const std::string& what() const { return what_; }

 private:
  const std::string what_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Code code_ = Code::Ok;
  std::string message_;
};

}  // namespace zs
