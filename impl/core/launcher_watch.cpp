#include "impl/core/launcher_watch.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace zs {
namespace {

bool wanted() {
  const char* flag = std::getenv("ZS_WATCH_LAUNCHER");
  if (flag != nullptr && *flag != '\0') return std::strcmp(flag, "0") != 0;
  for (const char* name : {"TORCHELASTIC_RUN_ID", "ZS_LAUNCHER"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return true;
  }
  return false;
}

[[noreturn]] void orphaned(pid_t launcher) {
  char msg[256];
  const int n = std::snprintf(msg, sizeof msg,
                              "zeroshard: rank process %d: its launcher (pid %d) has exited; ending this "
                              "rank (ZS_WATCH_LAUNCHER=0 keeps such a rank running)\n",
                              static_cast<int>(getpid()), static_cast<int>(launcher));
  if (n > 0) {
    const ssize_t w = write(STDERR_FILENO, msg, static_cast<size_t>(n) < sizeof msg ? static_cast<size_t>(n)
                                                                                     : sizeof msg - 1);
    (void)w;
  }
  kill(getpid(), SIGKILL);
  std::_Exit(137);
}

}  // namespace

void watch_launcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    const pid_t launcher = getppid();
    if (launcher <= 1 || !wanted()) return;
    std::thread([launcher] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (getppid() != launcher) orphaned(launcher);
      }
    }).detach();
  });
}

}  // namespace zs
