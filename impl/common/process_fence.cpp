#include "impl/common/process_fence.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace zs {
namespace {

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

std::string pid_namespace() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return "";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

// Field 3 (the state) and field 22 (the start time) of /proc/<pid>/stat;
// false when the process is gone. The name (field 2) may hold spaces and
// parentheses: the fields after it follow the last ')'.
bool read_stat(long pid, char* state, unsigned long long* start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  rest >> *state;
  for (int i = 4; i <= 21 && rest >> field; ++i) {
  }
  return static_cast<bool>(rest >> *start);
}

}  // namespace

std::string process_identity() {
  char state = 0;
  unsigned long long start = 0;
  const long pid = static_cast<long>(getpid());
  if (!read_stat(pid, &state, &start)) return "";
  return boot_id() + " " + pid_namespace() + " " + std::to_string(pid) + " " + std::to_string(start);
}

std::string fence_process(const std::string& identity) {
  std::istringstream in(identity);
  std::string boot, ns;
  long pid = 0;
  unsigned long long start = 0;
  if (!(in >> boot >> ns >> pid >> start) || pid <= 0) return "";
  if (boot != boot_id() || ns != pid_namespace() || pid == static_cast<long>(getpid())) return "";
  // The pidfd pins the process: checked, then signalled, it cannot be
  // another that took the pid in between.
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (fd < 0) return "";  // it has exited
  char state = 0;
  unsigned long long now_start = 0;
  std::string done;
  if (!read_stat(pid, &state, &now_start) || now_start != start || state == 'Z' || state == 'X') {
    // It has exited (the pid may be another's now): nothing to do.
  } else if (syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0) == 0) {
    done = std::string("killed pid ") + std::to_string(pid) + " (it was " +
           (state == 'T' || state == 't' ? "stopped" : "running") + ")";
  } else {
    done = "could not kill pid " + std::to_string(pid) + ": " + std::strerror(errno);
  }
  close(fd);
  return done;
}

}  // namespace zs
