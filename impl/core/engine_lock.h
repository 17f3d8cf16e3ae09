// The engine lock of one context: a plain mutex that knows its holder.
//
// An engine entry point (fetch_params, the optimizer's step, a checkpoint
// save ...) takes it once, with take(). What an entry point calls while it
// holds the lock never takes it again: a function reached both from the
// C ABI and from inside the engine has a `_locked` variant that checks the
// hold (expect_held) instead. So the lock is not recursive, and a second
// take() on the thread that holds it is refused with an error naming both
// callers (a progress callback calling back into the engine, say), where a
// plain mutex would deadlock.
#pragma once

#include <atomic>
#include <mutex>
#include <thread>

namespace zs {

class EngineLock {
 public:
  // Holds the lock while it lives.
  class Guard {
   public:
    explicit Guard(EngineLock* lock) noexcept : lock_(lock) {}
    Guard(Guard&& other) noexcept : lock_(other.lock_) { other.lock_ = nullptr; }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    Guard& operator=(Guard&&) = delete;
    ~Guard() {
      if (lock_ != nullptr) lock_->release();
    }

   private:
    EngineLock* lock_;
  };

  // Takes the lock for `who`; fails (Code::InvalidState) when this thread
  // holds it already, naming `who` and the holder.
  [[nodiscard]] Guard take(const char* who);
  // The check take() makes first, for a call that must refuse before it
  // changes anything (a destroy gives its handle up before it takes the
  // lock): fails (Code::InvalidState) when this thread holds the lock.
  void refuse_reentry(const char* who) const;
  // Fails (Code::Internal) unless this thread holds the lock: what runs
  // under an entry point's hold checks it instead of taking it again.
  void expect_held(const char* who) const;
  bool held_by_this_thread() const noexcept {
    return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id();
  }

 private:
  void release() noexcept;

  std::mutex mu_;
  // The holder, read without the mutex only to compare with this thread's
  // id: a thread sees its own writes, so "held by me" is never wrong.
  std::atomic<std::thread::id> owner_{};
  const char* holder_ = "";  // written and read under mu_
};

}  // namespace zs
