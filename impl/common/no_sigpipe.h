// Threads that write to sockets must not kill the process with SIGPIPE
// when a peer dies: the write should fail with EPIPE and become a
// ZS_ERR_COMM. Gloo writes without MSG_NOSIGNAL, so every thread the engine
// starts (group workers, Gloo's device loop) is created with SIGPIPE
// blocked; new threads inherit the creating thread's mask. The process's
// own signal handling stays untouched.
#pragma once

#include <signal.h>

namespace zs {

class SigpipeBlockedScope {
 public:
  SigpipeBlockedScope() {
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &saved_);
  }
  ~SigpipeBlockedScope() { pthread_sigmask(SIG_SETMASK, &saved_, nullptr); }
  // Takes a SIGPIPE that became pending while blocked, so that unblocking
  // does not deliver it (a thread that was not started blocked, running a
  // collective inline, restores a mask without SIGPIPE blocked).
  void drain() {
    sigset_t pending;
    if (sigpending(&pending) != 0 || !sigismember(&pending, SIGPIPE)) return;
    sigset_t only;
    sigemptyset(&only);
    sigaddset(&only, SIGPIPE);
    const timespec now{0, 0};
    while (sigtimedwait(&only, nullptr, &now) == SIGPIPE) {
    }
  }
  SigpipeBlockedScope(const SigpipeBlockedScope&) = delete;
  SigpipeBlockedScope& operator=(const SigpipeBlockedScope&) = delete;

 private:
  sigset_t saved_;
};

}  // namespace zs
