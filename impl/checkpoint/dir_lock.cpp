#include "impl/checkpoint/dir_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/file_io.h"
#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs::ckpt {
namespace {

using nlohmann::json;
constexpr auto kRefresh = std::chrono::seconds(5);

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

// A process's start time in clock ticks since boot (/proc/<pid>/stat field
// 22), which tells a live pid from a reused one; "" when there is none.
std::string start_ticks(pid_t pid) {
  const std::string stat = first_line("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return "";
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  for (int i = 3; i <= 22 && (fields >> f); ++i)
    if (i == 22) return f;
  return "";
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

json my_identity(int world) {
  return {{"host", host_name()},
          {"boot_id", first_line("/proc/sys/kernel/random/boot_id")},
          {"pid", static_cast<int64_t>(getpid())},
          {"start", start_ticks(getpid())},
          {"world_size", world},
          {"since", now_text()}};
}

bool same_process(const json& a, const json& b) {
  return a.value("boot_id", "") == b.value("boot_id", "") && a.value("pid", -1) == b.value("pid", -1) &&
         a.value("start", "") == b.value("start", "");
}

std::string describe(const json& h) {
  return "pid " + std::to_string(h.value("pid", -1)) + " on host '" + h.value("host", "?") +
         "' (a job of " + std::to_string(h.value("world_size", 0)) + " ranks, holding it since " +
         h.value("since", "?") + ")";
}

// How long another host's lock may go unrefreshed before it counts as stale.
int stale_after_s() { return env_int("ZS_CHECKPOINT_LOCK_STALE_S", 120); }

// Why the holder is gone, or "" while it may be alive.
std::string gone_because(const json& holder, const json& me, double age_s) {
  if (holder.value("boot_id", "") == me.value("boot_id", "")) {
    const pid_t pid = static_cast<pid_t>(holder.value("pid", -1));
    if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH)) return "its process has exited";
    if (start_ticks(pid) != holder.value("start", "")) return "its process has exited (the pid is reused)";
    return "";
  }
  if (holder.value("host", "") == me.value("host", "")) return "its host has rebooted since";
  const int stale_s = stale_after_s();
  if (age_s > stale_s)
    return "it has not refreshed the lock for " + std::to_string(static_cast<int>(age_s)) +
           " s (ZS_CHECKPOINT_LOCK_STALE_S=" + std::to_string(stale_s) + ")";
  return "";
}

// Writes `text` to a fresh temp file beside `path` and returns its name.
std::string write_temp(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  File f = File::create(tmp);
  f.write_all(text.data(), text.size());
  f.sync();
  f.close();
  return tmp;
}

// The locks this context holds: refreshed while it lives, removed after.
struct HeldLocks : Context::Attachment {
  explicit HeldLocks(Context&) {}
  ~HeldLocks() override {
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    cv.notify_all();
    if (refresher.joinable()) refresher.join();
    for (const auto& h : held) unlink_if_ours(h);
  }
  void add(const std::string& path, const std::string& text) {
    std::lock_guard<std::mutex> g(mu);
    held.emplace_back(path, text);
    if (!refresher.joinable()) refresher = std::thread([this] { refresh_loop(); });
  }
  void remove(const std::string& path) {
    std::lock_guard<std::mutex> g(mu);
    for (auto it = held.begin(); it != held.end(); ++it) {
      if (it->first != path) continue;
      unlink_if_ours(*it);
      held.erase(it);
      return;
    }
  }
  // A lock file whose line is no longer ours (taken over as stale) is
  // another job's now: left alone.
  static void unlink_if_ours(const std::pair<std::string, std::string>& h) {
    if (first_line(h.first) == h.second) ::unlink(h.first.c_str());
  }
  bool holds(const std::string& path) {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& h : held)
      if (h.first == path) return true;
    return false;
  }
  void refresh_loop() {
    std::unique_lock<std::mutex> g(mu);
    while (!cv.wait_for(g, kRefresh, [this] { return stop; }))
      for (const auto& h : held) ::utimensat(AT_FDCWD, h.first.c_str(), nullptr, 0);
  }
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::vector<std::pair<std::string, std::string>> held;  // path, its one line
  std::thread refresher;
};

}  // namespace

void hold_checkpoint_dir(Context& ctx, const std::string& dir) {
  const std::string path = join(dir, kLockFile);
  HeldLocks& locks = ctx.attachment<HeldLocks>();
  if (locks.holds(path) && exists(path)) return;
  const json me = my_identity(ctx.members().world_size);
  const std::string text = me.dump();  // one line
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string tmp = write_temp(path, text + "\n");
    // link() creates the name only if it is absent: two jobs cannot both win.
    int linked = ::link(tmp.c_str(), path.c_str());
    int err = errno;
    ::unlink(tmp.c_str());
    if (linked != 0 && (err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS)) {
      // A filesystem without hard links: O_EXCL creates it only if absent
      // too (a reader may see it empty for a moment: judged by its age).
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      err = errno;
      linked = fd >= 0 ? 0 : -1;
      if (fd >= 0) {
        const std::string line = text + "\n";
        const bool wrote = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
        ::fsync(fd);
        ::close(fd);
        if (!wrote) {
          ::unlink(path.c_str());
          fail(Code::Io, "cannot write the checkpoint lock '", path, "'");
        }
      }
    }
    if (linked == 0) {
      sync_dir(dir);
      locks.add(path, text);
      return;
    }
    if (err != EEXIST) fail(Code::Io, "cannot create the checkpoint lock '", path, "': ", std::strerror(err));
    json holder;
    try {
      holder = json::parse(first_line(path));
    } catch (const json::exception&) {
      holder = json::object();  // torn or foreign: judged by its age below
    }
    if (same_process(holder, me)) {  // an earlier context of this process
      ::unlink(path.c_str());
      continue;
    }
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) continue;  // removed meanwhile: try again
    const double age_s = std::difftime(std::time(nullptr), st.st_mtime);
    const std::string why = holder.empty() ? (age_s > stale_after_s()
                                                  ? std::string("it is unreadable and old")
                                                  : std::string())
                                           : gone_because(holder, me, age_s);
    if (why.empty())
      fail(Code::InvalidArgument, "checkpoint directory '", dir, "' is in use by another live job: ",
           holder.empty() ? std::string("its lock is unreadable") : describe(holder),
           " holds '", path, "'. Two jobs saving into one directory would overwrite each other's "
           "tags and 'latest': stop that job, or save into another directory; if it is in fact "
           "gone, remove the lock file");
    // Replace it by rename (atomic), then read back: of two jobs taking over
    // at once, the one whose lock stays is the holder.
    const std::string mine = write_temp(path, text + "\n");
    rename_path(mine, path);
    sync_dir(dir);
    if (first_line(path) != text) continue;
    std::fprintf(stderr,
                 "zeroshard: took over the checkpoint lock of '%s' from %s: %s\n", dir.c_str(),
                 holder.empty() ? "an unreadable lock" : describe(holder).c_str(), why.c_str());
    std::fflush(stderr);
    locks.add(path, text);
    return;
  }
  fail(Code::Io, "cannot take the checkpoint lock '", path, "': it keeps changing (another job is taking it)");
}

void release_checkpoint_dir(Context& ctx, const std::string& dir) {
  ctx.attachment<HeldLocks>().remove(join(dir, kLockFile));
}

}  // namespace zs::ckpt
