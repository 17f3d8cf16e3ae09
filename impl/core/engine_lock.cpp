#include "impl/core/engine_lock.h"

#include "impl/common/error.h"

namespace zs {

void EngineLock::refuse_reentry(const char* who) const {
  // holder_ is read only by the thread that holds mu_, which wrote it.
  if (held_by_this_thread())
    fail(Code::InvalidState, who, " needs the engine lock, which this thread holds already for ",
         holder_, ": the engine is not re-entrant (a callback may not call back into it)");
}

EngineLock::Guard EngineLock::take(const char* who) {
  refuse_reentry(who);
  mu_.lock();
  owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  holder_ = who;
  return Guard(this);
}

void EngineLock::expect_held(const char* who) const {
  if (!held_by_this_thread())
    fail(Code::Internal, who, " runs under the engine lock, and the calling thread does not hold it");
}

void EngineLock::release() noexcept {
  holder_ = "";
  owner_.store(std::thread::id(), std::memory_order_relaxed);
  mu_.unlock();
}

}  // namespace zs
