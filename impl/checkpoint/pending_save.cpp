#include "impl/checkpoint/pending_save.h"

#include <cstdio>

#include "impl/common/error.h"

namespace zs::ckpt {

PendingSave::~PendingSave() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroshard: %s (the context ended before anyone waited for it)\n", e.what());
  }
}

void PendingSave::start(std::string what, std::function<void()> work) {
  std::lock_guard<std::mutex> held(mu_);
  if (thread_.joinable()) fail(Code::Internal, "checkpoint save: an asynchronous save is already in flight");
  what_ = std::move(what);
  error_ = nullptr;
  thread_ = std::thread([this, work = std::move(work)] {
    try {
      work();
    } catch (...) {
      error_ = std::current_exception();  // read after join
    }
  });
}

void PendingSave::wait() {
  std::lock_guard<std::mutex> held(mu_);
  if (!thread_.joinable()) return;
  thread_.join();
  std::exception_ptr error = std::exchange(error_, nullptr);
  if (!error) return;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    fail(e.code(), "asynchronous checkpoint save of '", what_, "' failed: ", e.what());
  } catch (const std::exception& e) {
    fail(Code::Internal, "asynchronous checkpoint save of '", what_, "' failed: ", e.what());
  }
}

void wait_for_pending_save(Context& ctx) {
  if (auto* pending = ctx.find_attachment<PendingSave>()) pending->wait();
}

}  // namespace zs::ckpt
