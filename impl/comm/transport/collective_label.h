// What the engine is doing when it calls a collective ("fetch of
// layer3.weight (float32, 4096x4096)"), as a thread-local set around each
// group task. The communicator folds it into the collective's identity, so
// ranks that call the same kind of collective for different params never
// match each other's messages, and a mismatch can be reported in the words
// of the layer that caused it. Labels must be the same text on every rank
// for the same collective: no rank numbers, no local sizes.
#pragma once

#include <string>

namespace zs {

class CollectiveLabelScope {
 public:
  explicit CollectiveLabelScope(const std::string& label) : saved_(current_) {
    current_ = &label;
  }
  ~CollectiveLabelScope() { current_ = saved_; }
  CollectiveLabelScope(const CollectiveLabelScope&) = delete;
  CollectiveLabelScope& operator=(const CollectiveLabelScope&) = delete;

  // The innermost label on this thread, or "" outside any group task.
  static const std::string& current() {
    static const std::string kNone;
    return current_ ? *current_ : kNone;
  }

 private:
  const std::string* saved_;
  static inline thread_local const std::string* current_ = nullptr;
};

}  // namespace zs
