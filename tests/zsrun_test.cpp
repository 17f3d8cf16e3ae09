// Tests for the zsrun launcher (tools/zsrun.cpp). They run the real binary,
// found through the compile definition ZS_ZSRUN_PATH, on small `sh -c`
// programs and check its environment, output relaying, exit statuses and
// signal handling.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/multirank.h"

#ifndef ZS_ZSRUN_PATH
#error "compile with -DZS_ZSRUN_PATH='\"/path/to/zsrun\"'"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  int status = -1;  // exit code, or 128+signal if zsrun itself died by one
  std::string out, err;
  double seconds = 0;
};

// A running zsrun with its stdout and stderr captured.
class Zsrun {
 public:
  // env: NAME=VALUE to set, or NAME alone to unset, in zsrun's environment.
  explicit Zsrun(const std::vector<std::string>& args,
                 const std::vector<std::string>& env = {}) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) abort();
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ < 0) abort();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      close(out[0]);
      close(out[1]);
      close(err[0]);
      close(err[1]);
      for (const std::string& kv : env) {
        auto eq = kv.find('=');
        if (eq == std::string::npos) unsetenv(kv.c_str());
        else setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
      }
      std::vector<char*> argv{const_cast<char*>(ZS_ZSRUN_PATH)};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(ZS_ZSRUN_PATH, argv.data());
      _exit(99);
    }
    close(out[1]);
    close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }

  pid_t pid() const { return pid_; }

  // Collects all output and the exit status; kills zsrun after limit_s so a
  // broken launcher fails the test instead of hanging it.
  Result wait(double limit_s = 60) {
    Result r;
    auto deadline = start_ + std::chrono::duration<double>(limit_s);
    bool killed = false;
    while (out_fd_ >= 0 || err_fd_ >= 0) {
      std::vector<pollfd> fds;
      if (out_fd_ >= 0) fds.push_back({out_fd_, POLLIN, 0});
      if (err_fd_ >= 0) fds.push_back({err_fd_, POLLIN, 0});
      int n = poll(fds.data(), fds.size(), 100);
      if (n < 0 && errno != EINTR) break;
      for (const pollfd& p : fds) {
        if (p.revents == 0) continue;
        char buf[65536];
        ssize_t got = read(p.fd, buf, sizeof buf);
        std::string& dst = p.fd == out_fd_ ? r.out : r.err;
        if (got > 0) {
          dst.append(buf, static_cast<size_t>(got));
        } else if (got == 0 || errno != EINTR) {
          close(p.fd);
          (p.fd == out_fd_ ? out_fd_ : err_fd_) = -1;
        }
      }
      if (!killed && Clock::now() > deadline) {
        ADD_FAILURE() << "zsrun still running after " << limit_s << " s; killing it";
        kill(pid_, SIGKILL);
        killed = true;
      }
    }
    int st = 0;
    while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return r;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  Clock::time_point start_;
};

Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
           double limit_s = 60) {
  return Zsrun(args, env).wait(limit_s);
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

// Splits "[rank K] rest" into K and rest; false if the line is not prefixed.
bool split_prefix(const std::string& line, int* rank, std::string* rest) {
  if (line.rfind("[rank ", 0) != 0) return false;
  size_t close = line.find("] ");
  if (close == std::string::npos || close == 6) return false;
  std::string num = line.substr(6, close - 6);
  if (num.find_first_not_of("0123456789") != std::string::npos) return false;
  *rank = std::stoi(num);
  *rest = line.substr(close + 2);
  return true;
}

// A fresh directory for marker files, removed afterwards.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/zsrun_test.XXXXXX";
    if (!mkdtemp(tmpl)) abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::string cmd = "rm -rf '" + path_ + "'";
    int rc = system(cmd.c_str());
    (void)rc;
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool wait_for_files(const std::vector<std::string>& paths, double limit_s) {
  auto deadline = Clock::now() + std::chrono::duration<double>(limit_s);
  while (Clock::now() < deadline) {
    bool all = true;
    for (const auto& p : paths) all = all && exists(p);
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// True when no process is left in process group `pgid`.
bool group_gone(pid_t pgid) { return kill(-pgid, 0) < 0 && errno == ESRCH; }

TEST(Zsrun, SetsTorchrunEnvironmentPerRank) {
  Result r = run({"-n", "4", "--", "sh", "-c",
                  "echo \"R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE "
                  "G=$GROUP_RANK RR=$ROLE_RANK RW=$ROLE_WORLD_SIZE A=$MASTER_ADDR "
                  "P=$MASTER_PORT ID=$TORCHELASTIC_RUN_ID OMP=$OMP_NUM_THREADS "
                  "ZL=$ZS_LAUNCHER\""},
                 {"OMP_NUM_THREADS", "RANK=77", "MASTER_PORT=1"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::map<int, std::map<std::string, std::string>> seen;
  for (const std::string& line : lines(r.out)) {
    int rank = -1;
    std::string rest;
    ASSERT_TRUE(split_prefix(line, &rank, &rest)) << line;
    std::istringstream words(rest);
    for (std::string w; words >> w;) {
      auto eq = w.find('=');
      ASSERT_NE(eq, std::string::npos) << line;
      seen[rank][w.substr(0, eq)] = w.substr(eq + 1);
    }
  }
  ASSERT_EQ(seen.size(), 4u) << r.out;
  std::set<std::string> ports, ids;
  for (int k = 0; k < 4; ++k) {
    auto& v = seen[k];
    SCOPED_TRACE("rank " + std::to_string(k));
    EXPECT_EQ(v["R"], std::to_string(k));  // the inherited RANK=77 is replaced
    EXPECT_EQ(v["L"], std::to_string(k));
    EXPECT_EQ(v["RR"], std::to_string(k));
    EXPECT_EQ(v["W"], "4");
    EXPECT_EQ(v["LW"], "4");
    EXPECT_EQ(v["RW"], "4");
    EXPECT_EQ(v["G"], "0");
    EXPECT_EQ(v["A"], "127.0.0.1");
    EXPECT_EQ(v["OMP"], "1");
    EXPECT_EQ(v["ZL"], "zsrun");
    EXPECT_FALSE(v["ID"].empty());
    int port = std::atoi(v["P"].c_str());
    EXPECT_GT(port, 1);  // picked, not the inherited MASTER_PORT=1
    EXPECT_LE(port, 65535);
    ports.insert(v["P"]);
    ids.insert(v["ID"]);
  }
  EXPECT_EQ(ports.size(), 1u) << "all ranks must share MASTER_PORT";
  EXPECT_EQ(ids.size(), 1u) << "all ranks must share TORCHELASTIC_RUN_ID";
}

TEST(Zsrun, MasterOptionsAndExistingOmpNumThreads) {
  Result r = run({"-n", "2", "--master-addr", "10.1.2.3", "--master-port=29511", "--", "sh",
                  "-c", "echo \"$MASTER_ADDR:$MASTER_PORT:$OMP_NUM_THREADS\""},
                 {"OMP_NUM_THREADS=7"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::multiset<std::string> got;
  for (const auto& l : lines(r.out)) got.insert(l);
  EXPECT_EQ(got, (std::multiset<std::string>{"[rank 0] 10.1.2.3:29511:7",
                                             "[rank 1] 10.1.2.3:29511:7"}));
}

// The ranks' heap on transparent huge pages through glibc's tunable (read
// at process start, so the launcher sets it): added to the user's tunables,
// the user's own hugetlb setting kept, ZS_MALLOC_HUGE_PAGES=0 leaves it
// out, another value is a usage error. Then a rank's 64 MiB of malloc'd,
// touched memory is on huge pages where THP is in "madvise" mode, and not
// without the tunable.
TEST(Zsrun, RanksHeapIsOnHugePagesThroughGlibcTunables) {
  auto tunables = [](const std::vector<std::string>& env) {
    Result r = run({"-n", "2", "--no-prefix", "--", "sh", "-c", "echo \"[$GLIBC_TUNABLES]\""}, env);
    EXPECT_EQ(r.status, 0) << r.err;
    std::vector<std::string> got = lines(r.out);
    EXPECT_EQ(got.size(), 2u) << r.out;
    EXPECT_EQ(got.front(), got.back());
    return got.empty() ? std::string() : got.front();
  };
  EXPECT_EQ(tunables({"GLIBC_TUNABLES"}), "[glibc.malloc.hugetlb=1]");
  EXPECT_EQ(tunables({"GLIBC_TUNABLES=glibc.malloc.arena_max=2"}),
            "[glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1]");
  EXPECT_EQ(tunables({"GLIBC_TUNABLES=glibc.malloc.hugetlb=0"}), "[glibc.malloc.hugetlb=0]");
  EXPECT_EQ(tunables({"GLIBC_TUNABLES", "ZS_MALLOC_HUGE_PAGES=0"}), "[]");
  EXPECT_EQ(tunables({"GLIBC_TUNABLES=glibc.malloc.arena_max=2", "ZS_MALLOC_HUGE_PAGES=0"}),
            "[glibc.malloc.arena_max=2]");
  Result bad = run({"-n", "1", "--", "true"}, {"ZS_MALLOC_HUGE_PAGES=yes"});
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("ZS_MALLOC_HUGE_PAGES expects 1"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("'yes'"), std::string::npos) << bad.err;

  std::ifstream mode_file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(mode_file, mode);
  if (mode.find("[madvise]") == std::string::npos || system("python3 -c '' 2>/dev/null") != 0) {
    GTEST_SKIP() << "the heap's huge pages not checked: THP mode '" << mode
                 << "' is not 'madvise', or no python3";
  }
  auto huge_kib = [](const std::vector<std::string>& env) {
    Result r = run({"-n", "1", "--no-prefix", "--", "python3", "-c",
                    "b = bytearray(64 << 20)\n"
                    "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') "
                    "if l.startswith('AnonHugePages')))"},
                   env);
    EXPECT_EQ(r.status, 0) << r.err;
    return std::atol(r.out.c_str());
  };
  EXPECT_GT(huge_kib({"GLIBC_TUNABLES"}), 0);  // 62 MiB here; fewer where memory is fragmented
  EXPECT_EQ(huge_kib({"GLIBC_TUNABLES", "ZS_MALLOC_HUGE_PAGES=0"}), 0);
}

// The engine's store gets its own port, so torch.distributed can take
// MASTER_PORT before or after the engine's context comes up.
TEST(Zsrun, StorePortIsApartFromMasterPort) {
  Result r = run({"-n", "3", "--", "sh", "-c", "echo \"$MASTER_PORT $ZS_STORE_PORT\""},
                 {"ZS_STORE_PORT=1"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::set<std::string> seen;
  for (const auto& l : lines(r.out)) seen.insert(l.substr(l.find("] ") + 2));
  ASSERT_EQ(seen.size(), 1u) << "all ranks must share both ports: " << r.out;
  std::istringstream words(*seen.begin());
  int master = 0, store = 0;
  words >> master >> store;
  EXPECT_GT(master, 1);
  EXPECT_GT(store, 1);  // picked, not the inherited ZS_STORE_PORT=1
  EXPECT_LE(store, 65535);
  EXPECT_NE(master, store);
}

TEST(Zsrun, StorePortOption) {
  Result r = run({"-n", "2", "--master-port", "29511", "--store-port=29512", "--", "sh", "-c",
                  "echo \"$MASTER_PORT:$ZS_STORE_PORT\""});
  ASSERT_EQ(r.status, 0) << r.err;
  std::multiset<std::string> got;
  for (const auto& l : lines(r.out)) got.insert(l);
  EXPECT_EQ(got, (std::multiset<std::string>{"[rank 0] 29511:29512", "[rank 1] 29511:29512"}));
}

TEST(Zsrun, OutputIsPrefixedAndNeverInterleaved) {
  // Each rank writes 200 long lines to stdout and 200 to stderr, all at once.
  const int kRanks = 4, kLines = 200;
  std::string payload(300, 'x');
  std::string script =
      "i=0; while [ $i -lt " + std::to_string(kLines) + " ]; do "
      "echo \"out rank=$RANK i=$i " + payload + "\"; "
      "echo \"err rank=$RANK i=$i " + payload + "\" >&2; "
      "i=$((i+1)); done";
  Result r = run({"-n", std::to_string(kRanks), "--", "sh", "-c", script});
  ASSERT_EQ(r.status, 0) << r.err.substr(0, 2000);
  for (const char* stream : {"out", "err"}) {
    SCOPED_TRACE(stream);
    const std::string& text = std::string(stream) == "out" ? r.out : r.err;
    ASSERT_FALSE(text.empty());
    ASSERT_EQ(text.back(), '\n');
    std::vector<int> next(kRanks, 0);
    for (const std::string& line : lines(text)) {
      int rank = -1;
      std::string rest;
      ASSERT_TRUE(split_prefix(line, &rank, &rest)) << line;
      ASSERT_GE(rank, 0);
      ASSERT_LT(rank, kRanks);
      // Lines of one rank arrive complete and in order.
      std::string want = std::string(stream) + " rank=" + std::to_string(rank) +
                         " i=" + std::to_string(next[rank]) + " " + payload;
      ASSERT_EQ(rest, want);
      ++next[rank];
    }
    for (int k = 0; k < kRanks; ++k) EXPECT_EQ(next[k], kLines) << "rank " << k;
  }
}

TEST(Zsrun, PartialLastLineIsFlushedWithPrefix) {
  Result r = run({"-n", "1", "--", "sh", "-c", "printf 'a\\nno newline'; printf 'e' >&2"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "[rank 0] a\n[rank 0] no newline\n");
  EXPECT_EQ(r.err, "[rank 0] e\n");
}

TEST(Zsrun, NoPrefixPassesOutputThrough) {
  Result r = run({"--no-prefix", "-n", "2", "--", "sh", "-c",
                  "printf 'raw%s' $RANK; printf 'E%s\\n' $RANK >&2"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(r.out == "raw0raw1" || r.out == "raw1raw0") << r.out;
  EXPECT_EQ(r.err.find("[rank"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("E0\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("E1\n"), std::string::npos) << r.err;
}

TEST(Zsrun, AllRanksSucceedExitsZero) {
  Result r = run({"-n", "3", "--", "true"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
}

TEST(Zsrun, CommandWithoutDoubleDash) {
  Result r = run({"-n", "1", "echo", "hello"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "[rank 0] hello\n");
}

TEST(Zsrun, FailingRankStopsTheJobQuickly) {
  TempDir dir;
  // Every rank records its pid (= its process group); rank 1 fails after
  // the others are up, the others would sleep for 30 s.
  std::string script = "echo $$ > " + dir.path() + "/pid.$RANK; "
                       "if [ \"$RANK\" = 1 ]; then sleep 0.3; echo boom >&2; exit 3; fi; "
                       "sleep 30; echo survived";
  Result r = run({"-n", "3", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("[rank 1] boom\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("zsrun: rank 1 exited with status 3"), std::string::npos) << r.err;
  // The rank's own output comes before zsrun's verdict on it.
  EXPECT_LT(r.err.find("boom"), r.err.find("exited with status"));
  EXPECT_EQ(r.out.find("survived"), std::string::npos) << r.out;
  for (int k = 0; k < 3; ++k) {
    pid_t pid = std::atoi(slurp(dir.file("pid." + std::to_string(k))).c_str());
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(group_gone(pid)) << "rank " << k << " left processes behind";
  }
}

TEST(Zsrun, ExitStatusIsThatOfTheFirstFailingRank) {
  Result r = run({"-n", "3", "--", "sh", "-c",
                  "if [ \"$RANK\" = 2 ]; then exit 5; fi; "
                  "if [ \"$RANK\" = 0 ]; then sleep 30; exit 9; fi"});
  EXPECT_EQ(r.status, 5) << r.err;
  EXPECT_NE(r.err.find("zsrun: rank 2 exited with status 5"), std::string::npos) << r.err;
  // Rank 0 dies from our SIGTERM; that is not reported as a failure.
  EXPECT_EQ(r.err.find("rank 0"), std::string::npos) << r.err;
}

TEST(Zsrun, SignalDeathMapsTo128PlusSignal) {
  Result r = run({"-n", "2", "--", "sh", "-c",
                  "if [ \"$RANK\" = 0 ]; then kill -KILL $$; fi; sleep 30"});
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("zsrun: rank 0 killed by signal SIGKILL"), std::string::npos) << r.err;
}

// --restarts: a failed job starts again with TORCHELASTIC_RESTART_COUNT
// counting the attempts and TORCHELASTIC_MAX_RESTARTS the limit; it ends
// at the first attempt that succeeds, or with the last failure's status.
TEST(Zsrun, RestartsBringAFailedJobBack) {
  const std::string script =
      "echo \"attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS world $WORLD_SIZE\"; "
      "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then exit 7; fi; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ]; then sleep 30; fi";
  Result r = run({"-n", "2", "--restarts", "3", "--no-prefix", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_LT(r.seconds, 20.0);
  for (const char* a : {"attempt 0 of 3 world 2", "attempt 1 of 3 world 2", "attempt 2 of 3 world 2"})
    EXPECT_NE(r.out.find(a), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("attempt 3"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("zsrun: restart 1 of 3: starting the job again with 2 ranks"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("zsrun: restart 2 of 3"), std::string::npos) << r.err;

  Result spent = run({"-n", "2", "--restarts", "1", "--", "sh", "-c", "exit 4"});
  EXPECT_EQ(spent.status, 4) << spent.err;
  EXPECT_NE(spent.err.find("restart 1 of 1"), std::string::npos) << spent.err;
  EXPECT_EQ(spent.err.find("restart 2"), std::string::npos) << spent.err;
}

// With --min-nproc, a rank killed by a SIGKILL zsrun did not send is lost:
// the next attempt runs without it. A timeout is never restarted.
TEST(Zsrun, MinNprocShrinksAfterALostRankAndTimeoutsAreNotRestarted) {
  const std::string script =
      "echo \"attempt $TORCHELASTIC_RESTART_COUNT world $WORLD_SIZE\"; "
      "if [ \"$RANK\" = 2 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then kill -KILL $$; fi; "
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 30; fi";
  Result r = run({"-n", "3", "--restarts", "2", "--min-nproc", "2", "--no-prefix", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("attempt 1 world 2"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("restart 1 of 2: starting the job again with 2 ranks (a rank killed by SIGKILL is lost)"),
            std::string::npos) << r.err;

  Result t = run({"-n", "1", "--restarts", "2", "--timeout-s", "0.3", "--", "sleep", "30"});
  EXPECT_EQ(t.status, 124) << t.err;
  EXPECT_EQ(t.err.find("restart"), std::string::npos) << t.err;
}

// Healing mode: --restarts exports ZS_HEAL=auto, and a rank other than 0
// killed by a signal is started again alone, with its RANK and
// ZS_HEAL_REPLACEMENT=1, while the others keep running (one process each:
// they print their pid once); the job ends with status 0 and no restart.
// Without --restarts, with --no-heal or with ZS_HEAL=0 set, nothing is
// exported and a killed rank restarts the whole job as before.
TEST(Zsrun, HealingStartsAKilledRankAgainAloneWithItsRank) {
  const std::string script =
      "echo \"rank $RANK heal ${ZS_HEAL:-unset} replacement ${ZS_HEAL_REPLACEMENT:-0} attempt "
      "$TORCHELASTIC_RESTART_COUNT pid $$\"; "
      "if [ \"$RANK\" = 1 ] && [ -z \"$ZS_HEAL_REPLACEMENT\" ]; then kill -KILL $$; fi; sleep 1";
  Result r = run({"-n", "3", "--restarts", "1", "--no-prefix", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* line : {"rank 0 heal auto replacement 0 attempt 0", "rank 1 heal auto replacement 0 attempt 0",
                           "rank 2 heal auto replacement 0 attempt 0", "rank 1 heal auto replacement 1 attempt 0"})
    EXPECT_NE(r.out.find(line), std::string::npos) << r.out;
  for (const char* once : {"rank 0 ", "rank 2 "}) {
    const size_t first = r.out.find(once);
    EXPECT_EQ(r.out.find(once, first + 1), std::string::npos) << once << "started twice: " << r.out;
  }
  EXPECT_NE(r.err.find("zsrun: rank 1 killed by signal SIGKILL"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("zsrun: healing: starting a replacement of rank 1 (ZS_HEAL_REPLACEMENT=1; restart 1 of 1)"),
            std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("starting the job again"), std::string::npos) << r.err;

  for (const auto& [args, env] : std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>>{
           {{"-n", "3", "--restarts", "1", "--no-heal"}, {}},
           {{"-n", "3", "--restarts", "1"}, {"ZS_HEAL=0"}}}) {
    std::vector<std::string> argv = args;
    for (const char* a : {"--no-prefix", "--", "sh", "-c"}) argv.push_back(a);
    argv.push_back(script);
    Result off = Zsrun(argv, env).wait();
    EXPECT_EQ(off.status, 137) << off.err;  // the second attempt's rank 1 is killed again: no replacement
    EXPECT_EQ(off.out.find("replacement 1"), std::string::npos) << off.out;
    EXPECT_NE(off.err.find("restart 1 of 1: starting the job again with 3 ranks"), std::string::npos) << off.err;
    EXPECT_EQ(off.err.find("healing"), std::string::npos) << off.err;
  }
  Result none = run({"-n", "2", "--no-prefix", "--", "sh", "-c", "echo \"heal ${ZS_HEAL:-unset}\""});
  EXPECT_EQ(none.status, 0) << none.err;
  EXPECT_NE(none.out.find("heal unset"), std::string::npos) << none.out;
}

// A survivor whose heal was impossible exits with ZS_EXIT_STATE_LOST (75):
// the other survivors, which reach the same verdict, get a grace to say so
// and exit by themselves (their message is not cut short by a SIGTERM);
// the replacement still joining reaches none and is torn down; the job
// restarts whole once, saying so once.
TEST(Zsrun, SurvivorsThatFindTheStateLostAllNameItBeforeTheRestart) {
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ]; then echo \"rank $RANK restarted\"; exit 0; fi; "
      "if [ -n \"$ZS_HEAL_REPLACEMENT\" ]; then sleep 30; exit 0; fi; "
      "if [ \"$RANK\" = 1 ]; then sleep 0.1; kill -KILL $$; fi; "
      "if [ \"$RANK\" = 0 ]; then sleep 0.4; echo \"rank 0 names the lost state\"; exit 75; fi; "
      "sleep 0.8; echo \"rank 2 names the lost state\"; exit 75";
  Result r = run({"-n", "3", "--restarts", "2", "--no-prefix", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_LT(r.seconds, 10.0) << "the joining replacement was not torn down";
  for (const char* line : {"rank 0 names the lost state", "rank 2 names the lost state", "rank 0 restarted",
                           "rank 1 restarted", "rank 2 restarted"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " missing: " << r.out;
  EXPECT_NE(r.err.find("zsrun: rank 2 exited with status 75"), std::string::npos) << r.err;
  const std::string verdict = "healing impossible: rank 0 exited with status 75 (ZS_ERR_STATE_LOST)";
  const size_t at = r.err.find(verdict);
  EXPECT_NE(at, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("healing impossible", at + 1), std::string::npos) << "said twice: " << r.err;
  EXPECT_NE(r.err.find("restart 1 of 2: starting the job again with 3 ranks"), std::string::npos) << r.err;
}

// Healing serves the store from zsstore (beside zsrun): the ranks get
// ZS_STORE_SERVER=external and the store's port, which zsstore holds, and
// rank 0 killed is replaced like any rank. Without a zsstore
// (ZSRUN_ZSSTORE names none) rank 0 serves the store, and its loss
// restarts the whole job as without healing, saying why.
TEST(Zsrun, HealingServesTheStoreSoThatRankZeroIsReplacedToo) {
  const std::string script =
      "echo \"rank $RANK replacement ${ZS_HEAL_REPLACEMENT:-0} attempt $TORCHELASTIC_RESTART_COUNT store "
      "${ZS_STORE_SERVER:-rank0}\"; "
      "if [ \"$RANK\" = 0 ] && [ -z \"$ZS_HEAL_REPLACEMENT\" ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then "
      "  for i in 1 2 3 4 5 6 7 8 9 10; do (exec 3<>/dev/tcp/127.0.0.1/$ZS_STORE_PORT) 2>/dev/null && "
      "  { echo \"store listening\"; break; }; sleep 0.1; done; kill -KILL $$; fi; "
      "if [ -z \"$ZS_HEAL_REPLACEMENT\" ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 1; fi";
  Result r = run({"-n", "2", "--restarts", "1", "--no-prefix", "--", "bash", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("rank 0 replacement 0 attempt 0 store external"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("store listening"), std::string::npos) << "zsstore holds the store port: " << r.out;
  EXPECT_NE(r.out.find("rank 0 replacement 1 attempt 0 store external"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("healing: starting a replacement of rank 0"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("starting the job again"), std::string::npos) << r.err;

  Result without = run({"-n", "2", "--restarts", "1", "--no-prefix", "--", "bash", "-c", script},
                       {"ZSRUN_ZSSTORE=/nonexistent/zsstore"});
  EXPECT_EQ(without.status, 0) << without.err;
  EXPECT_NE(without.err.find("healing: no zsstore at '/nonexistent/zsstore'"), std::string::npos) << without.err;
  EXPECT_NE(without.out.find("store rank0"), std::string::npos) << without.out;
  EXPECT_EQ(without.out.find("replacement 1"), std::string::npos) << without.out;
  EXPECT_NE(without.err.find("restart 1 of 1: starting the job again with 2 ranks"), std::string::npos)
      << without.err;
  EXPECT_LT(without.seconds, 20.0);
}

TEST(Zsrun, BadUsageExitsTwoNamingTheValue) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--", "true"}, "-n"},
      {{}, "-n"},
      {{"-n", "0", "--", "true"}, "'0'"},
      {{"-n", "-3", "--", "true"}, "'-3'"},
      {{"-n", "abc", "--", "true"}, "'abc'"},
      {{"-n", "2x", "--", "true"}, "'2x'"},
      {{"-n"}, "-n"},
      {{"-n", "2"}, "no command"},
      {{"-n", "2", "--"}, "no command"},
      {{"-n", "2", "--bogus", "--", "true"}, "'--bogus'"},
      {{"-n", "2", "--master-port", "70000", "--", "true"}, "'70000'"},
      {{"-n", "2", "--master-port", "http", "--", "true"}, "'http'"},
      {{"-n", "2", "--store-port", "0", "--", "true"}, "'0'"},
      {{"-n", "2", "--master-port=29511", "--store-port=29511", "--", "true"},
       "both 29511"},
      {{"-n", "2", "--timeout-s", "-1", "--", "true"}, "'-1'"},
      {{"-n", "2", "--timeout-s", "soon", "--", "true"}, "'soon'"},
      {{"-n", "2", "--restarts", "-1", "--", "true"}, "'-1'"},
      {{"-n", "2", "--restarts", "many", "--", "true"}, "'many'"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "3", "--", "true"}, "--min-nproc 3 is more than -n 2"},
      {{"-n", "2", "--min-nproc", "1", "--", "true"}, "needs --restarts"},
      {{"-n", "2", "--restarts", "1", "--shrink", "--", "true"}, "--shrink heals by going on without a lost rank"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "1", "--shrink", "--no-heal", "--", "true"}, "without --no-heal"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "1", "--replacement-wait", "5", "--", "true"},
       "--replacement-wait 5 is how long the others wait for a replacement before they shrink: it needs --shrink"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "1", "--shrink", "--replacement-wait", "0", "--", "true"},
       "--replacement-wait expects a positive number of seconds, got '0'"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "1", "--regrow-after", "3", "--", "true"},
       "--regrow-after 3 starts a rank the others went on without again: it needs --shrink"},
      {{"-n", "2", "--restarts", "1", "--min-nproc", "1", "--shrink", "--regrow-after", "-1", "--", "true"},
       "--regrow-after expects a number of seconds >= 0, got '-1'"},
      {{"-n", "2", "--spare", "--", "python3", "train.py"}, "--spare takes a lost rank's place"},
      {{"-n", "2", "--restarts", "1", "--no-heal", "--spare", "--", "python3", "train.py"}, "without --no-heal"},
      {{"-n", "2", "--restarts", "1", "--spare", "--", "true"}, "'true' is not a Python interpreter"},
      {{"-n", "2", "--warm-start", "--", "true", "x.py"}, "it needs the command `python SCRIPT [ARGS...]`"},
      {{"-n", "2", "--warm-start", "--", "python3", "-u", "x.py"}, "(no interpreter options), got 'python3 -u'"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += " " + a;
    SCOPED_TRACE("zsrun" + joined);
    Result r = run(c.args);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("Usage:"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

TEST(Zsrun, BadKillGraceEnvironmentIsAUsageError) {
  Result r = run({"-n", "1", "--", "true"}, {"ZSRUN_KILL_GRACE_S=later"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("'later'"), std::string::npos) << r.err;
}

TEST(Zsrun, HelpGoesToStdoutAndExitsZero) {
  Result r = run({"--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("Usage:"), std::string::npos);
}

TEST(Zsrun, MissingCommandExits127) {
  for (const char* cmd : {"zsrun-test-no-such-command", "/nonexistent/dir/cmd"}) {
    SCOPED_TRACE(cmd);
    Result r = run({"-n", "2", "--", cmd, "arg"});
    EXPECT_EQ(r.status, 127) << r.err;
    EXPECT_NE(r.err.find("zsrun: cannot execute '" + std::string(cmd) + "': "),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("exited with status 127"), std::string::npos) << r.err;
  }
}

// zsrun forwards the signals it receives to every rank; ranks that trap
// them exit cleanly and zsrun still reports the interruption as 128+sig.
TEST(Zsrun, ForwardsSignalsToRanks) {
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    const char* name = sig == SIGTERM ? "TERM" : sig == SIGINT ? "INT" : "HUP";
    SCOPED_TRACE(name);
    TempDir dir;
    std::string script = std::string("trap 'echo got > ") + dir.path() + "/got.$RANK; exit 0' " +
                         name + "; touch " + dir.path() +
                         "/ready.$RANK; while :; do sleep 0.05; done";
    Zsrun z({"-n", "3", "--", "sh", "-c", script});
    ASSERT_TRUE(wait_for_files({dir.file("ready.0"), dir.file("ready.1"), dir.file("ready.2")},
                               20))
        << "ranks did not start";
    ASSERT_EQ(kill(z.pid(), sig), 0);
    Result r = z.wait();
    EXPECT_EQ(r.status, 128 + sig) << r.err;
    EXPECT_LT(r.seconds, 15.0);
    for (int k = 0; k < 3; ++k)
      EXPECT_TRUE(exists(dir.file("got." + std::to_string(k)))) << "rank " << k;
  }
}

TEST(Zsrun, TimeoutTerminatesRanksAndExits124) {
  Result r = run({"--timeout-s", "0.5", "-n", "2", "--", "sleep", "30"});
  EXPECT_EQ(r.status, 124) << r.err;
  EXPECT_GE(r.seconds, 0.4);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("timed out"), std::string::npos) << r.err;
}

TEST(Zsrun, RanksIgnoringSigtermAreKilledAfterTheGrace) {
  TempDir dir;
  std::string script = "trap '' TERM; echo $$ > " + dir.path() + "/pid.$RANK; sleep 30";
  Result r = run({"--timeout-s", "0.3", "-n", "2", "--", "sh", "-c", script},
                 {"ZSRUN_KILL_GRACE_S=0.5"});
  EXPECT_EQ(r.status, 124) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_NE(r.err.find("SIGKILL"), std::string::npos) << r.err;
  for (int k = 0; k < 2; ++k) {
    pid_t pid = std::atoi(slurp(dir.file("pid." + std::to_string(k))).c_str());
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(group_gone(pid)) << "rank " << k;
  }
}

// kill -9 of zsrun: its ranks, each in its own process group, end with it
// (parent-death signal) instead of running on as orphans.
TEST(Zsrun, RanksDieWhenZsrunIsKilled) {
  TempDir dir;
  Zsrun z({"-n", "2", "--", "sh", "-c", "echo $$ > " + dir.path() + "/pid.$RANK; exec sleep 60"});
  std::vector<pid_t> pids;
  for (int k = 0; k < 2; ++k) {
    const std::string f = dir.file("pid." + std::to_string(k));
    for (int i = 0; i < 200 && slurp(f).empty(); ++i) usleep(20000);
    pids.push_back(std::atoi(slurp(f).c_str()));
    ASSERT_GT(pids.back(), 0) << "rank " << k << " did not start";
  }
  ASSERT_EQ(kill(z.pid(), SIGKILL), 0);
  z.wait();
  for (int k = 0; k < 2; ++k) {
    bool ended = false;
    for (int i = 0; i < 150 && !ended; ++i) {
      ended = zs::test::process_gone(pids[static_cast<size_t>(k)]);
      if (!ended) usleep(20000);
    }
    EXPECT_TRUE(ended) << "rank " << k << " (pid " << pids[static_cast<size_t>(k)] << ") outlived zsrun";
    if (!ended) kill(pids[static_cast<size_t>(k)], SIGKILL);
  }
}

TEST(Zsrun, BackgroundProcessesOfFinishedRanksAreCleanedUp) {
  TempDir dir;
  std::string script = "sleep 30 & echo $! > " + dir.path() + "/bg.$RANK; echo done";
  Result r = run({"-n", "2", "--", "sh", "-c", script});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_LT(r.seconds, 10.0);
  for (int k = 0; k < 2; ++k) {
    pid_t pid = std::atoi(slurp(dir.file("bg." + std::to_string(k))).c_str());
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(kill(pid, 0) < 0 && errno == ESRCH) << "background job of rank " << k;
  }
}

}  // namespace
