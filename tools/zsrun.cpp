// zsrun — launch N local ranks of a command with a torchrun-compatible
// environment, prefix their output per rank, forward signals, and tear the
// whole job down when one rank fails.
//
//   zsrun -n N [--master-addr A] [--master-port P] [--timeout-s T]
//         [--restarts R [--min-nproc M] [--no-heal]] [--no-prefix] -- CMD ARGS...
//
// Standalone on purpose: POSIX only, no dependency on the engine library, so
// it can launch any program (a C trainer, python, a test binary).
//
// Process model
//   * Each rank is fork+execvp'd into its own process group (setpgid(0,0)),
//     and dies with zsrun (PR_SET_PDEATHSIG): no rank outlives a killed zsrun.
//     A terminal's Ctrl-C is delivered to the foreground group only, i.e. to
//     zsrun, which forwards it once; without this every rank would get the
//     signal twice (once from the tty, once from zsrun).
//   * Signals are sent to the rank's whole process group, not only its pid:
//     a rank is often a shell or a python wrapper whose children hold the
//     output pipes open, and they must go down with it.
//   * Signals reach the poll() loop through a self-pipe; SIGCHLD goes the
//     same way, so the loop wakes up when a rank exits.
//   * Every rank is reaped. After the last rank is reaped, processes still
//     left in the ranks' groups (background jobs, daemons) are terminated
//     too, so zsrun leaves no orphans behind. On Linux zsrun is also a child
//     subreaper, so those orphans are reparented to, and reaped by, zsrun
//     rather than an init that may never reap them (containers).
//
// Restarts (--restarts R, torchrun's --max-restarts): when a rank fails, the
// whole job is torn down and started again, up to R times, with
// TORCHELASTIC_RESTART_COUNT counting the attempts; the trainer resumes from
// its latest checkpoint. A rank killed by SIGKILL that zsrun did not send
// (the OOM killer, a lost device, an operator) is a rank that cannot come
// back: with --min-nproc M the next attempt runs that many ranks fewer, never
// fewer than M (torchrun's elastic --nnodes=MIN:MAX, per rank on one host).
// Not restarted: a timeout, a signal to zsrun, an internal error.
//
// Healing (docs/healing.md, section 3): with --restarts R (R >= 1) and
// without --min-nproc (unless --shrink) or --no-heal, zsrun exports ZS_HEAL=auto (unless the
// environment sets ZS_HEAL), which turns the engine's peer copies on where
// they can act (and off with a note where not), and a
// rank other than 0 that dies by a signal is started again alone, with the
// same RANK and ZS_HEAL_REPLACEMENT=<n> (its n-th replacement), using one of
// the R restarts of the attempt: the survivors keep running and take it in
// (zs_heal_join). Rank 0 serves the engine's store, so its loss is a full
// restart, unless zsrun serves the store itself: with tools/zsstore beside
// zsrun (or named by ZSRUN_ZSSTORE), each healing attempt starts one on the
// store port and exports ZS_STORE_SERVER=external, so rank 0 is a client
// like the others and is replaced like them. If the attempt fails anyway (a survivor exits non-zero: its
// program does not heal, or the state was lost), the job is restarted as
// above, the replacements not counted against that; a survivor that exits
// with ZS_EXIT_STATE_LOST (75: a shard and every copy of it lost together)
// is named as healing made impossible. With --spare (a Python command)
// one more process, `python -m zeroshard.spare CMD-ARGS`, imports the
// script's modules and waits on its stdin; a lost rank's variables written
// there make it that rank's replacement, and another spare starts.
//
// Shrinking (docs/healing.md, section 4): with --restarts R --min-nproc M
// --shrink the ranks heal as above, but a rank killed by a SIGKILL zsrun did
// not send is not started again while at least M others run: they go on
// without it (zsrun exports ZS_HEAL_MIN_RANKS=M, by which zs_heal_join
// shrinks the engine over the live ranks), and its death is no failure of
// the job. Fewer than M left: a replacement joins as above. With
// --replacement-wait S a replacement is started first (while a restart is
// left) and the others wait up to S seconds for it (zsrun exports
// ZS_HEAL_REPLACEMENT_WAIT_S=S); if it came later they go on without it,
// and it exits with ZS_EXIT_NOT_TAKEN (76), which is no failure either.
// With --regrow-after S, S seconds after the others went on without a rank
// it is started again with ZS_HEAL_JOIN=grow (using one of the restarts):
// the others take it back at a step boundary and the job grows back by it;
// if they finished first it exits with ZS_EXIT_NOT_TAKEN, no failure.
//
// Warm start (--warm-start, a command `python SCRIPT ARGS`): each attempt
// starts one `python -m zeroshard.warm_start SCRIPT ARGS`, which imports the
// script's modules once, and every rank and replacement of the attempt is
// forked from it instead of executed (tools/warm_start.h): seconds of
// imports per process (torch, transformers) paid once. The fork is handed
// to zsrun (a child subreaper), which reaps it, signals its group and
// relays its output as a rank it executed. Should the interpreter refuse
// or die, zsrun says so once and executes the ranks from then on.
//
// Exit status: that of the first rank that failed (128+signal for a signal
// death), 124 on --timeout-s, 128+signal when zsrun itself was signalled and
// every rank still exited 0, 2 on bad usage, 1 on an internal error.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "free_port.h"
#include "warm_start.h"
#include "zeroshard/zeroshard.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitUsage = 2;
constexpr int kExitInternal = 1;
constexpr int kExitTimeout = 124;
constexpr double kDefaultKillGraceS = 5.0;
// After the last rank is reaped, how long leftover processes in the ranks'
// groups get to finish writing before they are terminated.
constexpr double kLeftoverDrainS = 1.0;
// After SIGKILL, how long to wait for pipes to reach EOF before giving up on
// them (a descendant that escaped into another session still holds them).
constexpr double kAfterKillS = 1.0;
// After a survivor exits with ZS_EXIT_STATE_LOST, how long the other
// survivors get to reach the same verdict and name the lost state
// themselves before the job is torn down for its restart.
constexpr double kStateLostGraceS = 1.0;
// A line longer than this is split so memory stays bounded; each piece is
// still emitted as a complete, prefixed line.
constexpr size_t kMaxLine = 1 << 20;

const int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// ---------------------------------------------------------------------------
// Small I/O helpers. Everything zsrun prints goes through write(2) so its own
// messages and the ranks' relayed lines never mix with stdio buffering.

bool g_broken[3] = {false, false, false};  // fd 1/2 hit EPIPE: drop output

void write_all(int fd, const char* data, size_t size) {
  if (fd < 0 || fd > 2 || g_broken[fd]) return;
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // Our stdout may be a non-blocking file description shared with the
      // caller; wait until it drains rather than dropping lines.
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 1000);
    } else {
      // EPIPE (reader went away, e.g. `zsrun ... | head`) or another error:
      // keep running the job, discard further output to this stream.
      g_broken[fd] = true;
      return;
    }
  }
}

void write_all(int fd, const std::string& s) { write_all(fd, s.data(), s.size()); }

__attribute__((format(printf, 1, 2))) void errorf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  std::string line = "zsrun: ";
  line.append(buf, std::min(static_cast<size_t>(n), sizeof buf - 1));
  line += '\n';
  write_all(STDERR_FILENO, line);
}

bool set_flags(int fd, bool cloexec, bool nonblock) {
  if (cloexec && fcntl(fd, F_SETFD, fcntl(fd, F_GETFD) | FD_CLOEXEC) < 0) return false;
  if (nonblock && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) return false;
  return true;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT: return "SIGCONT";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    case SIGURG: return "SIGURG";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGVTALRM: return "SIGVTALRM";
    case SIGPROF: return "SIGPROF";
    case SIGSYS: return "SIGSYS";
    default: return nullptr;
  }
}

std::string describe_signal(int sig) {
  const char* name = signal_name(sig);
  return name ? std::string(name) : "signal " + std::to_string(sig);
}

// ---------------------------------------------------------------------------
// Command line.

struct Options {
  long nranks = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free one
  int store_port = 0;   // 0: pick a free one, other than master_port
  double timeout_s = 0;  // 0: none, else per attempt
  long restarts = 0;     // attempts after the first
  long min_nproc = 0;    // 0: every attempt has nranks; else shrink to >= it
  bool shrink = false;   // --shrink: with --min-nproc, heal by going on without the lost rank
  double replacement_wait_s = 0;  // --replacement-wait: with --shrink, a replacement first, this long
  double regrow_after_s = -1;     // --regrow-after: with --shrink, start a lost rank again this long after
  bool no_heal = false;  // --no-heal
  bool spare = false;    // --spare
  bool warm_start = false;  // --warm-start
  bool prefix = true;
  std::vector<char*> command;  // argv of the ranks, null-terminated
};

const char kUsage[] =
    "Usage: zsrun -n N [options] -- CMD [ARGS...]\n"
    "\n"
    "Runs N local ranks of CMD with a torchrun-compatible environment\n"
    "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), plus\n"
    "ZS_STORE_PORT: the zeroshard engine's rendezvous port, so MASTER_PORT\n"
    "stays free for torch.distributed whichever starts first, and\n"
    "ZS_JOB_SECRET (random, unless already set): only these ranks may join.\n"
    "\n"
    "Options:\n"
    "  -n, --nproc-per-node N   number of ranks (>= 1), required\n"
    "  --master-addr A          MASTER_ADDR for the ranks (default 127.0.0.1)\n"
    "  --master-port P          MASTER_PORT (default: a free TCP port)\n"
    "  --store-port P           ZS_STORE_PORT (default: another free TCP port)\n"
    "  --timeout-s T            terminate the job after T seconds, exit 124\n"
    "  --restarts R             start the job again, up to R times, when a rank\n"
    "                           fails (TORCHELASTIC_RESTART_COUNT says which\n"
    "                           attempt; the trainer resumes from its checkpoint)\n"
    "  --min-nproc M            with --restarts: a rank killed by a SIGKILL that\n"
    "                           zsrun did not send is lost, and the next attempt\n"
    "                           runs without it, with at least M ranks\n"
    "  --shrink                 with --min-nproc M: heal in memory instead; a\n"
    "                           rank killed by a SIGKILL zsrun did not send is\n"
    "                           not started again while at least M others run,\n"
    "                           and they go on without it (ZS_HEAL_MIN_RANKS=M:\n"
    "                           zs_heal_join shrinks); below M a replacement\n"
    "                           joins as under plain --restarts\n"
    "  --replacement-wait S     with --shrink: start a replacement of the lost\n"
    "                           rank first; the others wait up to S seconds for\n"
    "                           it and go on without it only if it came later\n"
    "                           (ZS_HEAL_REPLACEMENT_WAIT_S=S; the late one\n"
    "                           exits with ZS_EXIT_NOT_TAKEN, no failure)\n"
    "  --regrow-after S         with --shrink: S seconds after the others went on\n"
    "                           without a rank, start it again to grow the job\n"
    "                           back (ZS_HEAL_JOIN=grow; the others take it in\n"
    "                           at a step), using one of the restarts\n"
    "  --no-heal                with --restarts: no healing (ZS_HEAL is not\n"
    "                           exported; a failed rank restarts the whole job)\n"
    "  --spare                  healing a Python command: keep one process warm,\n"
    "                           its modules imported (python -m zeroshard.spare),\n"
    "                           to take a lost rank's place\n"
    "  --warm-start             a command `python SCRIPT ARGS`: import SCRIPT's\n"
    "                           modules once (python -m zeroshard.warm_start)\n"
    "                           and fork every rank and replacement from that\n"
    "                           process instead of starting each afresh\n"
    "  --no-prefix              pass output through without '[rank K] '\n"
    "  -h, --help               show this help\n"
    "\n"
    "With --restarts (and neither --min-nproc nor --no-heal) the ranks heal:\n"
    "ZS_HEAL=auto is exported, and a rank other than 0 killed by a signal is\n"
    "started again alone with its RANK and ZS_HEAL_REPLACEMENT=<n>, using one\n"
    "of the restarts, while the others keep running. With --min-nproc M\n"
    "--shrink they heal too, going on without a lost rank while M remain.\n"
    "\n"
    "Environment: ZSRUN_KILL_GRACE_S (default 5) is how long ranks get\n"
    "between SIGTERM and SIGKILL when the job is torn down. The ranks get\n"
    "GLIBC_TUNABLES with glibc.malloc.hugetlb=1 added (their heap on huge\n"
    "pages) unless it names that tunable or ZS_MALLOC_HUGE_PAGES=0.\n";

[[noreturn]] void usage_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void usage_error(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  errorf("%s", buf);
  write_all(STDERR_FILENO, std::string("\n") + kUsage);
  exit(kExitUsage);
}

bool parse_long(const char* s, long* out) {
  if (*s == '\0') return false;
  char* end = nullptr;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_seconds(const char* s, double* out) {
  if (*s == '\0') return false;
  char* end = nullptr;
  errno = 0;
  double v = strtod(s, &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  bool have_n = false;
  int i = 1;
  // Returns the value of an option given as "--opt V", "--opt=V" or "-nV".
  auto value = [&](const std::string& arg, const std::string& name) -> const char* {
    if (arg.size() > name.size()) return argv[i] + name.size() + (arg[name.size()] == '=' ? 1 : 0);
    if (i + 1 >= argc) usage_error("option %s needs a value", name.c_str());
    return argv[++i];
  };
  auto is = [](const std::string& arg, const std::string& name) {
    return arg == name || arg.rfind(name + "=", 0) == 0;
  };
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      write_all(STDOUT_FILENO, kUsage);
      exit(0);
    }
    if (arg == "-n" || (arg.rfind("-n", 0) == 0 && arg.rfind("--", 0) != 0) ||
        is(arg, "--nproc-per-node")) {
      const char* v = value(arg, arg.rfind("--", 0) == 0 ? "--nproc-per-node" : "-n");
      if (!parse_long(v, &opt.nranks) || opt.nranks < 1)
        usage_error("-n expects a positive integer, got '%s'", v);
      have_n = true;
    } else if (is(arg, "--master-addr")) {
      const char* v = value(arg, "--master-addr");
      if (*v == '\0') usage_error("--master-addr expects an address, got ''");
      opt.master_addr = v;
    } else if (is(arg, "--master-port")) {
      const char* v = value(arg, "--master-port");
      long port = 0;
      if (!parse_long(v, &port) || port < 1 || port > 65535)
        usage_error("--master-port expects a port in 1..65535, got '%s'", v);
      opt.master_port = static_cast<int>(port);
    } else if (is(arg, "--store-port")) {
      const char* v = value(arg, "--store-port");
      long port = 0;
      if (!parse_long(v, &port) || port < 1 || port > 65535)
        usage_error("--store-port expects a port in 1..65535, got '%s'", v);
      opt.store_port = static_cast<int>(port);
    } else if (is(arg, "--timeout-s")) {
      const char* v = value(arg, "--timeout-s");
      if (!parse_seconds(v, &opt.timeout_s) || opt.timeout_s <= 0)
        usage_error("--timeout-s expects a positive number of seconds, got '%s'", v);
    } else if (is(arg, "--restarts") || is(arg, "--max-restarts")) {
      const char* v = value(arg, is(arg, "--restarts") ? "--restarts" : "--max-restarts");
      if (!parse_long(v, &opt.restarts) || opt.restarts < 0)
        usage_error("--restarts expects an integer >= 0, got '%s'", v);
    } else if (is(arg, "--min-nproc")) {
      const char* v = value(arg, "--min-nproc");
      if (!parse_long(v, &opt.min_nproc) || opt.min_nproc < 1)
        usage_error("--min-nproc expects a positive integer, got '%s'", v);
    } else if (arg == "--shrink") {
      opt.shrink = true;
    } else if (is(arg, "--replacement-wait")) {
      const char* v = value(arg, "--replacement-wait");
      if (!parse_seconds(v, &opt.replacement_wait_s) || opt.replacement_wait_s <= 0)
        usage_error("--replacement-wait expects a positive number of seconds, got '%s'", v);
    } else if (is(arg, "--regrow-after")) {
      const char* v = value(arg, "--regrow-after");
      if (!parse_seconds(v, &opt.regrow_after_s) || opt.regrow_after_s < 0)
        usage_error("--regrow-after expects a number of seconds >= 0, got '%s'", v);
    } else if (arg == "--no-heal") {
      opt.no_heal = true;
    } else if (arg == "--spare") {
      opt.spare = true;
    } else if (arg == "--warm-start") {
      opt.warm_start = true;
    } else if (arg == "--no-prefix") {
      opt.prefix = false;
    } else if (arg.size() > 1 && arg[0] == '-') {
      usage_error("unknown option '%s'", arg.c_str());
    } else {
      // Like mpirun, the first non-option word starts the command even
      // without "--".
      break;
    }
  }
  if (!have_n) usage_error("missing required option -n N");
  if (opt.min_nproc > opt.nranks)
    usage_error("--min-nproc %ld is more than -n %ld", opt.min_nproc, opt.nranks);
  if (opt.min_nproc > 0 && opt.restarts == 0)
    usage_error("--min-nproc %ld needs --restarts R: it says how small a restarted job may be",
                opt.min_nproc);
  if (opt.shrink && (opt.min_nproc == 0 || opt.no_heal))
    usage_error("--shrink heals by going on without a lost rank, down to --min-nproc M ranks: it needs "
                "--restarts R and --min-nproc M, without --no-heal");
  if (opt.replacement_wait_s > 0 && !opt.shrink)
    usage_error("--replacement-wait %g is how long the others wait for a replacement before they shrink: it "
                "needs --shrink (with --restarts R and --min-nproc M)", opt.replacement_wait_s);
  if (opt.regrow_after_s >= 0 && !opt.shrink)
    usage_error("--regrow-after %g starts a rank the others went on without again: it needs --shrink (with "
                "--restarts R and --min-nproc M)", opt.regrow_after_s);
  if (opt.master_port != 0 && opt.store_port == opt.master_port)
    usage_error("--store-port and --master-port are both %d: the engine's store and torch's "
                "need a port each", opt.master_port);
  if (i >= argc) usage_error("no command given after '--'");
  for (; i < argc; ++i) opt.command.push_back(argv[i]);
  opt.command.push_back(nullptr);
  if (opt.spare && (opt.restarts < 1 || opt.no_heal || opt.min_nproc > 0))
    usage_error("--spare takes a lost rank's place while the others heal: it needs --restarts R, without "
                "--no-heal or --min-nproc");
  if (opt.spare) {
    const std::string exe = opt.command[0];
    const std::string base = exe.substr(exe.find_last_of('/') + 1);
    if (base.rfind("python", 0) != 0)
      usage_error("--spare warms a Python command (python -m zeroshard.spare SCRIPT ...): '%s' is not a "
                  "Python interpreter", exe.c_str());
  }
  if (opt.warm_start) {
#ifndef PR_SET_CHILD_SUBREAPER
    usage_error("--warm-start needs Linux (a child subreaper adopts the forked ranks)");
#endif
    const std::string exe = opt.command[0];
    const std::string base = exe.substr(exe.find_last_of('/') + 1);
    if (base.rfind("python", 0) != 0 || opt.command.size() < 3 || opt.command[1][0] == '-')
      usage_error("--warm-start forks the ranks from one Python that imported SCRIPT's modules: it needs the "
                  "command `python SCRIPT [ARGS...]` (no interpreter options), got '%s%s%s'", exe.c_str(),
                  opt.command.size() > 2 ? " " : "", opt.command.size() > 2 ? opt.command[1] : "");
  }
  return opt;
}

// A free port other than `other` (a second pick may land on the first);
// -1 when none is found.
int pick_free_port_other_than(int other) {
  for (int tries = 0; tries < 16; ++tries) {
    const int port = zs::net::free_loopback_port();
    if (port < 0) return -1;
    if (port != other) return port;
  }
  errno = EADDRINUSE;
  return -1;
}

// ---------------------------------------------------------------------------
// Signals: the handler only writes the signal number into a pipe that the
// poll loop reads, so all real work happens outside signal context.

int g_sigpipe[2] = {-1, -1};
// The first signal zsrun received other than SIGCHLD: no restart after it.
volatile sig_atomic_t g_signalled = 0;

extern "C" void on_signal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD && g_signalled == 0) g_signalled = sig;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t r = write(g_sigpipe[1], &b, 1);  // full pipe: a wakeup is pending anyway
  (void)r;
  errno = saved;
}

// ---------------------------------------------------------------------------
// Ranks and their output.

struct Stream {
  int fd = -1;    // read end of the rank's pipe, -1 when closed
  int dest = -1;  // STDOUT_FILENO or STDERR_FILENO
  std::string pending;  // bytes after the last newline
};

struct Rank {
  int index = 0;
  int replacements = 0;  // times started again alone (healing)
  long replaces_loss = 0;  // healing: which replacement of this attempt (from 1) it is
  // --regrow-after: started again at regrow_at (when due) as the process
  // for its incarnation-th loss; growing: the process running is that one.
  bool regrow_due = false, growing = false;
  Clock::time_point regrow_at;
  int regrow_incarnation = 0;
  pid_t pid = -1;
  bool reaped = false;
  bool group_gone = false;  // its process group has no members left
  std::string prefix;
  Stream out, err;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

class Launcher {
 public:
  // nranks: this attempt's world size; attempt: 0 for the first launch.
  Launcher(const Options& opt, long nranks, long attempt)
      : opt_(opt), nranks_(nranks), attempt_(attempt) {}

  int run();
  // Whether the job ended because a rank failed (not a timeout, a signal to
  // zsrun or an internal error): what --restarts brings back.
  bool rank_failed() const { return rank_failed_; }
  // Ranks killed by a SIGKILL zsrun did not send.
  long lost() const { return lost_; }

 private:
  bool spawn_all();
  // Healing: the rank alone, again, as its next replacement.
  bool respawn(Rank& r);
  // --regrow-after: r, dropped by a shrink as the loss numbered
  // `incarnation`, is started again once its time comes (a restart spent).
  void schedule_regrow(Rank& r, int incarnation);
  void start_due_regrows(double* wait_s);
  bool heals() const;
  // Healing: zsstore serving this attempt's store (ZS_STORE_SERVER=external).
  bool find_store();  // sets store_path_; false, saying so, when there is none
  void start_store(const std::vector<std::string>& env);
  void reset_child(pid_t launcher) const;
  void stop_store();
  // argv: the command's own unless given (then forked from the warm
  // start's interpreter while there is one); stdin_write: a pipe for the
  // child's stdin, whose write end is left there; pass_fd: a descriptor the
  // child keeps across exec.
  bool spawn(Rank& r, const std::vector<std::string>& env, const std::vector<char*>* argv = nullptr,
             int* stdin_write = nullptr, int pass_fd = -1);
  // --warm-start: the interpreter the ranks fork from (tools/warm_start.h).
  void start_warm();
  // The rank r forked with env and these descriptors: its pid, or -1 after
  // warm_off (the caller executes it instead).
  pid_t fork_warm(Rank& r, const std::vector<std::string>& env, const int fds[3]);
  void warm_off(const std::string& why);  // says why, once; ranks are executed from then on
  void end_warm();
  // The spare and the warm start's interpreter: processes beside the ranks,
  // their output relayed under `prefix`.
  static Rank helper_process(int index, const char* prefix);
  void end_helper(Rank& helper, int* fd);
  // --spare: a process of the command, its modules imported, blocked until
  // it is told which lost rank it replaces (docs/healing.md, step 7).
  void start_spare();
  bool adopt_spare(Rank& r);  // false when there is no live spare to take r's place
  void end_spare();
  // The spare and the warm start's interpreter (pid -1 when not started).
  std::array<Rank*, 2> helpers() { return {&spare_, &warm_}; }
  // The ranks and the helpers: whose output is relayed.
  std::vector<Rank*> all_processes() {
    std::vector<Rank*> all;
    for (Rank& r : ranks_) all.push_back(&r);
    for (Rank* helper : helpers()) all.push_back(helper);
    return all;
  }
  std::vector<std::string> base_environment();
  void reap();
  void on_exit(Rank& r, int status);
  void pump(Stream& s, const std::string& prefix, int max_reads);
  void emit(Stream& s, const std::string& prefix, const char* data, size_t n, bool eof);
  void close_stream(Stream& s, const std::string& prefix);
  void signal_groups(int sig);
  void start_termination();
  bool all_reaped() const;
  bool survivors_reaped() const;
  bool leftovers();

  const Options& opt_;
  const long nranks_;
  const long attempt_;
  bool rank_failed_ = false;
  long lost_ = 0;
  std::vector<Rank> ranks_;
  std::vector<std::string> base_env_;
  long respawned_ = 0;  // replacements started in this attempt
  long dropped_ = 0;    // --shrink: ranks lost and not started again
  Rank spare_;          // --spare: pid -1 when there is none
  int spare_in_ = -1;   // write end of the spare's stdin, where its assignment goes
  Rank warm_;           // --warm-start: its interpreter, pid -1 when there is none
  int warm_sock_ = -1;  // zsrun's end of the socket to it; -1 once ranks are executed
  pid_t store_pid_ = -1;  // zsstore, when this attempt runs one
  std::string store_path_;
  // The file where zsstore keeps its keys (ZS_STORE_JOURNAL), so that a
  // zsstore started again after it died serves the same keys on the same
  // port; the ranks resend the calls it cut short. At most kStoreRestarts
  // restarts an attempt.
  std::string store_journal_;
  long store_restarts_ = 0;
  static constexpr long kStoreRestarts = 3;
  bool external_store_ = false;
  int master_port_ = 0;
  int store_port_ = 0;
  double kill_grace_s_ = kDefaultKillGraceS;
  bool huge_page_heap_ = true;  // ZS_MALLOC_HUGE_PAGES (glibc_tunables)
  sigset_t orig_mask_{};

  Clock::time_point start_;
  int first_failure_code_ = -1;  // exit code of the first failed rank
  bool timed_out_ = false;
  int received_signal_ = 0;  // first signal forwarded to the ranks
  bool terminating_ = false;
  Clock::time_point term_started_;
  bool killed_ = false;
  Clock::time_point killed_at_;
  bool all_reaped_seen_ = false;
  Clock::time_point all_reaped_at_;
  bool state_lost_ = false;  // a survivor exited with ZS_EXIT_STATE_LOST
  Clock::time_point state_lost_at_;
};

// n random bytes from the kernel, as hex.
std::string random_hex(size_t n) {
  std::vector<unsigned char> bytes(n);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(bytes.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      std::fprintf(stderr, "zsrun: cannot read random bytes for the job secret: %s\n",
                   std::strerror(errno));
      std::exit(1);
    }
    got += static_cast<size_t>(r);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

// The ranks' GLIBC_TUNABLES: the user's, plus glibc.malloc.hugetlb=1 unless
// it names that tunable or ZS_MALLOC_HUGE_PAGES=0. A trainer's heap grows
// and shrinks by its activations every step, and zeroshard.torch gives the
// pages a backward freed back to the system while the gradients grow
// (bindings/python/zeroshard/torch/_malloc.py); each later forward faults
// them in again. On transparent huge pages (glibc 2.35+ madvises its heap
// and mapped blocks; THP's "madvise" mode, Debian's default) that costs
// 1/512 of the faults: the HF Trainer's GPT-2 124M step took 2.65-2.84 CPU
// s a rank with the trims against 2.88-3.31 s without huge pages (2.50-2.96
// s on huge pages without trims, 120-230 MiB more at the peak;
// docs/memory.md). It is read at process start only, so the launcher sets
// it.
std::string glibc_tunables(const char* user, bool huge_page_heap) {
  std::string t = user ? user : "";
  if (!huge_page_heap || t.find("glibc.malloc.hugetlb=") != std::string::npos) return t;
  return t + (t.empty() ? "" : ":") + "glibc.malloc.hugetlb=1";
}

std::vector<std::string> Launcher::base_environment() {
  // Variables we set are removed from the inherited environment first so a
  // zsrun started inside another launcher does not pass stale values on.
  static const char* const kOwned[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
      "MASTER_ADDR", "MASTER_PORT", "ZS_STORE_PORT", "TORCHELASTIC_RUN_ID",
      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "ZS_LAUNCHER",
      "ZS_HEAL_REPLACEMENT"};
  std::vector<std::string> env;
  bool have_omp = false, have_secret = false, have_heal = false;
  const char* tunables = nullptr;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    bool owned = key == "GLIBC_TUNABLES";  // rewritten below
    for (const char* k : kOwned) owned = owned || key == k;
    if (key == "OMP_NUM_THREADS") have_omp = true;
    if (key == "ZS_HEAL") have_heal = true;
    if (key == "ZS_JOB_SECRET" && kv.size() > key.size() + 1) have_secret = true;
    if (key == "GLIBC_TUNABLES") tunables = *e + key.size() + 1;
    if (!owned) env.push_back(kv);
  }
  if (std::string t = glibc_tunables(tunables, huge_page_heap_); !t.empty())
    env.push_back("GLIBC_TUNABLES=" + t);
  // A job secret per launch: only these ranks can join the store and pair
  // with each other (a user's own ZS_JOB_SECRET is kept).
  if (!have_secret) env.push_back("ZS_JOB_SECRET=" + random_hex(32));
  auto n = std::to_string(nranks_);
  // A single node, one role: the static torchrun layout.
  env.push_back("WORLD_SIZE=" + n);
  env.push_back("LOCAL_WORLD_SIZE=" + n);
  env.push_back("ROLE_WORLD_SIZE=" + n);
  env.push_back("GROUP_RANK=0");
  env.push_back("GROUP_WORLD_SIZE=1");
  env.push_back("ROLE_NAME=default");
  env.push_back("MASTER_ADDR=" + opt_.master_addr);
  env.push_back("MASTER_PORT=" + std::to_string(master_port_));
  env.push_back("ZS_STORE_PORT=" + std::to_string(store_port_));
  env.push_back("TORCHELASTIC_RUN_ID=zsrun-" + std::to_string(getpid()));
  env.push_back("TORCHELASTIC_RESTART_COUNT=" + std::to_string(attempt_));
  env.push_back("TORCHELASTIC_MAX_RESTARTS=" + std::to_string(opt_.restarts));
  env.push_back("ZS_LAUNCHER=zsrun");
  // N ranks each spawning one OpenMP thread per core would oversubscribe the
  // machine N-fold; torchrun makes the same default.
  if (!have_omp) env.push_back("OMP_NUM_THREADS=1");
  // Healing on with no config change (the config's "auto"); the user's
  // ZS_HEAL, 0 included, is kept.
  if (heals() && !have_heal) env.push_back("ZS_HEAL=auto");
  // --shrink: the engine's survivors go on without a lost rank while at
  // least M run, as zsrun starts no replacement then (on_exit).
  if (heals() && opt_.shrink) env.push_back("ZS_HEAL_MIN_RANKS=" + std::to_string(opt_.min_nproc));
  // --replacement-wait: the engine's survivors wait that long for the
  // replacement zsrun starts, then shrink (docs/healing.md, section 4).
  if (heals() && opt_.replacement_wait_s > 0) {
    char wait[32];
    std::snprintf(wait, sizeof wait, "%g", opt_.replacement_wait_s);
    env.push_back(std::string("ZS_HEAL_REPLACEMENT_WAIT_S=") + wait);
  }
  if (external_store_) env.push_back("ZS_STORE_SERVER=external");
  return env;
}

// zsstore beside this zsrun (or ZSRUN_ZSSTORE), on the store port, in a
// process group of its own that dies with zsrun; its stdout (one line
// saying where it serves) is dropped, its stderr is zsrun's.
bool Launcher::find_store() {
  std::string path;
  if (const char* named = getenv("ZSRUN_ZSSTORE"); named && *named) {
    path = named;
  } else {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      self[n] = '\0';
      std::string dir(self);
      dir = dir.substr(0, dir.rfind('/'));
      path = dir + "/zsstore";
    }
  }
  if (path.empty() || access(path.c_str(), X_OK) != 0) {
    errorf("healing: no zsstore at '%s' (ZSRUN_ZSSTORE names one): rank 0 serves the store, and its loss "
           "restarts the job", path.c_str());
    return false;
  }
  store_path_ = path;
  return true;
}

// In a child of zsrun's (a rank, zsstore), between fork and exec: its own
// process group, gone with zsrun, zsrun's signal handling undone.
void Launcher::reset_child(pid_t launcher) const {
  setpgid(0, 0);
#ifdef PR_SET_PDEATHSIG
  // zsrun gone (kill -9 included), the child goes too: in its own process
  // group nothing else tells it, and an orphan rank trains on into the
  // checkpoint directory the next job uses. zsrun may have died already.
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  if (getppid() != launcher) _exit(kExitInternal);
#endif
  // exec keeps ignored dispositions (we ignore SIGPIPE), so reset them.
  for (int sig : kForwardedSignals) signal(sig, SIG_DFL);
  signal(SIGCHLD, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  sigprocmask(SIG_SETMASK, &orig_mask_, nullptr);
}

// With the ranks' environment (their job secret) and its journal; a test's
// store fault (ZS_FAULT_STORE) is one failure: a restarted store runs clean.
void Launcher::start_store(const std::vector<std::string>& env) {
  const std::string& path = store_path_;
  const std::string port = std::to_string(store_port_);
  if (store_journal_.empty()) {
    const char* dir = getenv("TMPDIR");
    std::string name = std::string(dir && *dir ? dir : "/tmp") + "/zsrun-store-XXXXXX";
    const int fd = mkstemp(name.data());
    if (fd < 0) {
      errorf("healing: cannot create the store's journal '%s': %s; a zsstore that dies is not started again",
             name.c_str(), strerror(errno));
    } else {
      close(fd);
      store_journal_ = name;
    }
  }
  std::vector<std::string> store_env;
  for (const std::string& kv : env)
    if (store_restarts_ == 0 || kv.compare(0, 15, "ZS_FAULT_STORE=") != 0) store_env.push_back(kv);
  if (!store_journal_.empty()) store_env.push_back("ZS_STORE_JOURNAL=" + store_journal_);
  std::vector<char*> envp;
  for (const std::string& kv : store_env) envp.push_back(const_cast<char*>(kv.c_str()));
  envp.push_back(nullptr);
  const char* argv[] = {path.c_str(), "--host", opt_.master_addr.c_str(), "--port", port.c_str(), nullptr};
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    errorf("healing: cannot fork zsstore: %s; rank 0 serves the store", strerror(errno));
    external_store_ = false;
    return;
  }
  if (pid == 0) {
    reset_child(launcher);
    const int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
      dup2(null, STDIN_FILENO);
      dup2(null, STDOUT_FILENO);
    }
    environ = envp.data();
    execv(path.c_str(), const_cast<char* const*>(argv));
    _exit(127);
  }
  setpgid(pid, pid);
  store_pid_ = pid;
}

void Launcher::stop_store() {
  if (store_pid_ > 0) {
    kill(store_pid_, SIGTERM);
    int st = 0;
    waitpid(store_pid_, &st, 0);
    store_pid_ = -1;
  }
  if (!store_journal_.empty()) {  // also when the store died first
    unlink(store_journal_.c_str());
    unlink((store_journal_ + ".tmp").c_str());
    store_journal_.clear();
  }
}

bool Launcher::heals() const {
  if (opt_.restarts < 1 || (opt_.min_nproc > 0 && !opt_.shrink) || opt_.no_heal) return false;
  const char* h = getenv("ZS_HEAL");
  return h == nullptr || std::string(h) != "0";
}

bool Launcher::spawn_all() {
  external_store_ = heals() && nranks_ > 1 && find_store();
  base_env_ = base_environment();
  if (external_store_) start_store(base_env_);
  if (opt_.warm_start) start_warm();
  // The spare first: its imports overlap the warm start's, which the first
  // rank's fork waits for.
  if (opt_.spare && heals()) start_spare();
  const std::vector<std::string>& base = base_env_;
  ranks_.resize(static_cast<size_t>(nranks_));
  for (size_t k = 0; k < ranks_.size(); ++k) {
    Rank& r = ranks_[k];
    r.index = static_cast<int>(k);
    r.prefix = "[rank " + std::to_string(k) + "] ";
    r.out.dest = STDOUT_FILENO;
    r.err.dest = STDERR_FILENO;
    std::vector<std::string> env = base;
    for (const char* key : {"RANK", "LOCAL_RANK", "ROLE_RANK"})
      env.push_back(std::string(key) + "=" + std::to_string(k));
    if (!spawn(r, env)) return false;
  }
  return true;
}

void Launcher::start_warm() {
  warm_ = helper_process(-2, "[warm start] ");
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
    warm_off(std::string("cannot create its socket: ") + strerror(errno));
    return;
  }
  std::vector<std::string> env = base_env_;  // no RANK: each fork gets its own environment
  env.push_back("ZS_WARM_START_FD=" + std::to_string(sv[1]));
  std::vector<char*> argv = {opt_.command[0], const_cast<char*>("-m"), const_cast<char*>("zeroshard.warm_start")};
  argv.insert(argv.end(), opt_.command.begin() + 1, opt_.command.end());  // the null included
  const bool ok = spawn(warm_, env, &argv, nullptr, sv[1]);
  close(sv[1]);
  warm_sock_ = sv[0];
  if (!ok) warm_off("its interpreter did not start");  // its pid stays -1: nothing to reap or signal
}

pid_t Launcher::fork_warm(Rank& r, const std::vector<std::string>& env, const int fds[3]) {
  std::string why;
  if (!zs::warm::send_request(warm_sock_, env, fds, &why)) {
    warm_off(why);
    return -1;
  }
  // The first answer waits for the imports: relay the interpreter's output
  // meanwhile, or a full pipe would stall it. Signals are blocked while
  // spawning: one that is pending, or --timeout-s passing, ends the wait
  // (the ranks are executed, and the loop then acts on it).
  for (;;) {
    pollfd fds_[3] = {{warm_sock_, POLLIN, 0}, {warm_.out.fd, POLLIN, 0}, {warm_.err.fd, POLLIN, 0}};
    const int ready = poll(fds_, 3, 200);
    if (ready < 0 && errno != EINTR) {
      warm_off(std::string("poll: ") + strerror(errno));
      return -1;
    }
    sigset_t pending;
    sigpending(&pending);
    for (int sig : kForwardedSignals) {
      if (sigismember(&pending, sig)) {
        warm_off("zsrun got " + describe_signal(sig) + " while it imported");
        return -1;
      }
    }
    if (opt_.timeout_s > 0 && seconds_since(start_) >= opt_.timeout_s) {
      warm_off("--timeout-s passed while it imported");
      return -1;
    }
    if (ready <= 0) continue;
    if (fds_[1].revents) pump(warm_.out, warm_.prefix, 1);
    if (fds_[2].revents) pump(warm_.err, warm_.prefix, 1);
    if (fds_[0].revents == 0) continue;
    char answer[512];
    ssize_t n;
    do {
      n = recv(warm_sock_, answer, sizeof answer - 1, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      const bool gone = n == 0 || errno == ECONNRESET;
      warm_off(gone ? "its interpreter exited before it forked rank " + std::to_string(r.index) +
                          " (its output above says why)"
                    : std::string("cannot read its answer: ") + strerror(errno));
      return -1;
    }
    answer[n] = '\0';
    const pid_t pid = zs::warm::parse_answer(answer, &why);
    if (pid < 0) warm_off("it could not fork rank " + std::to_string(r.index) + ": " + why);
    return pid;
  }
}

void Launcher::warm_off(const std::string& why) {
  errorf("--warm-start is off for this attempt (%s): the ranks are started afresh", why.c_str());
  end_warm();
}

void Launcher::end_warm() { end_helper(warm_, &warm_sock_); }

Rank Launcher::helper_process(int index, const char* prefix) {
  Rank helper;
  helper.index = index;
  helper.prefix = prefix;
  helper.out.dest = STDOUT_FILENO;
  helper.err.dest = STDERR_FILENO;
  return helper;
}

// Its end of zsrun's pipe or socket closed, the helper reads EOF and exits;
// its group is signalled too, in case it is still importing.
void Launcher::end_helper(Rank& helper, int* fd) {
  if (*fd >= 0) {
    close(*fd);
    *fd = -1;
  }
  if (helper.pid > 0 && !helper.group_gone && kill(-helper.pid, SIGKILL) < 0 && errno == ESRCH)
    helper.group_gone = true;
}

void Launcher::start_spare() {
  spare_ = helper_process(-1, "[spare] ");
  std::vector<std::string> env = base_env_;  // no RANK: it learns it when adopted
  env.push_back("ZS_HEAL_SPARE=1");
  std::vector<char*> argv = {opt_.command[0], const_cast<char*>("-m"), const_cast<char*>("zeroshard.spare")};
  argv.insert(argv.end(), opt_.command.begin() + 1, opt_.command.end());  // the null included
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kForwardedSignals) sigaddset(&block, sig);
  sigaddset(&block, SIGCHLD);
  sigprocmask(SIG_BLOCK, &block, &old);
  const bool ok = spawn(spare_, env, &argv, &spare_in_);
  sigprocmask(SIG_SETMASK, &old, nullptr);
  if (!ok) {
    spare_.pid = -1;
    spare_.reaped = spare_.group_gone = true;
  }
}

bool Launcher::adopt_spare(Rank& r) {
  if (spare_.pid <= 0 || spare_.reaped || spare_in_ < 0) return false;
  const int n = r.replacements + 1;
  const std::string i = std::to_string(r.index);
  const std::string assignment = "RANK=" + i + "\nLOCAL_RANK=" + i + "\nROLE_RANK=" + i +
                                 "\nZS_HEAL_REPLACEMENT=" + std::to_string(n) + "\n\n";
  // Small enough for the pipe's buffer: one write, or the spare is gone.
  const bool told = write(spare_in_, assignment.data(), assignment.size()) ==
                    static_cast<ssize_t>(assignment.size());
  close(spare_in_);
  spare_in_ = -1;
  if (!told) return false;
  if (!r.group_gone && kill(-r.pid, SIGKILL) < 0 && errno == ESRCH) r.group_gone = true;
  close_stream(r.out, r.prefix);
  close_stream(r.err, r.prefix);
  r.replacements = n;
  ++respawned_;
  errorf("healing: the spare (pid %d) takes rank %d's place (ZS_HEAL_REPLACEMENT=%d; restart %ld of %ld); the "
         "other ranks keep running", static_cast<int>(spare_.pid), r.index, n, attempt_ + respawned_,
         opt_.restarts);
  r.pid = spare_.pid;
  r.reaped = r.group_gone = false;
  r.out.fd = spare_.out.fd;
  r.out.pending = std::move(spare_.out.pending);
  r.err.fd = spare_.err.fd;
  r.err.pending = std::move(spare_.err.pending);
  start_spare();  // for the next loss
  return true;
}

// The job is over (or torn down): nothing left for the spare to replace.
void Launcher::end_spare() { end_helper(spare_, &spare_in_); }

void Launcher::schedule_regrow(Rank& r, int incarnation) {
  if (opt_.regrow_after_s < 0) return;
  if (attempt_ + respawned_ >= opt_.restarts) {
    errorf("healing: rank %d is not started again to grow the job back (--regrow-after): no restart is left "
           "(--restarts %ld)", r.index, opt_.restarts);
    return;
  }
  r.regrow_due = true;
  r.regrow_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(opt_.regrow_after_s));
  r.regrow_incarnation = incarnation;
}

void Launcher::start_due_regrows(double* wait_s) {
  for (Rank& r : ranks_) {
    if (!r.regrow_due) continue;
    if (terminating_ || state_lost_) {
      r.regrow_due = false;
      continue;
    }
    const double left = std::chrono::duration<double>(r.regrow_at - Clock::now()).count();
    if (left > 0) {
      if (*wait_s < 0 || left < *wait_s) *wait_s = left;
      continue;
    }
    r.regrow_due = false;
    if (attempt_ + respawned_ >= opt_.restarts) {  // spent meanwhile, by another rank's replacement
      errorf("healing: rank %d is not started again to grow the job back (--regrow-after): no restart is left "
             "(--restarts %ld)", r.index, opt_.restarts);
      continue;
    }
    r.growing = true;
    --dropped_;
    errorf("healing: starting rank %d again to grow the job back to %ld ranks (--regrow-after %g s; "
           "ZS_HEAL_JOIN=grow ZS_HEAL_REPLACEMENT=%d; restart %ld of %ld); the others take it in at a step",
           r.index, nranks_ - dropped_, opt_.regrow_after_s, r.regrow_incarnation, attempt_ + respawned_ + 1,
           opt_.restarts);
    if (!respawn(r)) {
      ++dropped_;
      errorf("cannot start rank %d again: the job is torn down", r.index);
    }
  }
}

bool Launcher::respawn(Rank& r) {
  // What the dead rank left in its process group (its children) goes first.
  if (!r.group_gone && kill(-r.pid, SIGKILL) < 0 && errno == ESRCH) r.group_gone = true;
  close_stream(r.out, r.prefix);
  close_stream(r.err, r.prefix);
  r.replacements = r.growing ? r.regrow_incarnation : r.replacements + 1;
  ++respawned_;
  std::vector<std::string> env = base_env_;
  for (const char* key : {"RANK", "LOCAL_RANK", "ROLE_RANK"})
    env.push_back(std::string(key) + "=" + std::to_string(r.index));
  env.push_back("ZS_HEAL_REPLACEMENT=" + std::to_string(r.replacements));
  if (r.growing) env.push_back("ZS_HEAL_JOIN=grow");
  r.pid = -1;
  r.reaped = false;
  r.group_gone = false;
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kForwardedSignals) sigaddset(&block, sig);
  sigaddset(&block, SIGCHLD);
  sigprocmask(SIG_BLOCK, &block, &old);
  const bool ok = spawn(r, env);
  sigprocmask(SIG_SETMASK, &old, nullptr);
  if (!ok) r.reaped = r.group_gone = true;
  return ok;
}

bool Launcher::spawn(Rank& r, const std::vector<std::string>& env, const std::vector<char*>* argv,
                     int* stdin_write, int pass_fd) {
  char* const* args = argv ? argv->data() : opt_.command.data();
  int in[2] = {-1, -1};
  if (stdin_write && (pipe(in) < 0 || !set_flags(in[0], true, false) || !set_flags(in[1], true, false))) {
    errorf("cannot create the spare's stdin pipe: %s", strerror(errno));
    for (int fd : in)
      if (fd >= 0) close(fd);
    return false;
  }
  std::vector<char*> envp;
  for (const std::string& kv : env) envp.push_back(const_cast<char*>(kv.c_str()));
  envp.push_back(nullptr);

  int out[2] = {-1, -1}, err[2] = {-1, -1};
  if (opt_.prefix) {
    // Read ends are non-blocking (drained in loops) and, like the write
    // ends, close-on-exec: a rank must not inherit another rank's pipe, or
    // that pipe would never reach EOF while it lives.
    if (pipe(out) < 0 || pipe(err) < 0 || !set_flags(out[0], true, true) ||
        !set_flags(out[1], true, false) || !set_flags(err[0], true, true) ||
        !set_flags(err[1], true, false)) {
      errorf("cannot create pipes for rank %d: %s", r.index, strerror(errno));
      for (int fd : {out[0], out[1], err[0], err[1]})
        if (fd >= 0) close(fd);
      return false;
    }
  }
  // A rank reading a terminal from its own (background) process group would
  // be stopped by SIGTTIN forever; give it /dev/null instead. Non-tty stdin
  // (a file, a pipe) is passed through.
  bool null_stdin = isatty(STDIN_FILENO);
  // The child started: zsrun keeps the read ends of its pipes.
  const auto keep_read_ends = [&] {
    if (!opt_.prefix) return;
    close(out[1]);
    close(err[1]);
    r.out.fd = out[0];
    r.err.fd = err[0];
  };

  if (!argv && warm_sock_ >= 0) {
    const int devnull = null_stdin ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
    const int fds[3] = {devnull >= 0 ? devnull : STDIN_FILENO, opt_.prefix ? out[1] : STDOUT_FILENO,
                        opt_.prefix ? err[1] : STDERR_FILENO};
    const pid_t pid = fork_warm(r, env, fds);
    if (devnull >= 0) close(devnull);
    if (pid > 0) {
      r.pid = pid;  // zsrun's child now, in a process group of its own
      keep_read_ends();
      return true;
    }
    // warm_off said why: executed below.
  }

  // Signals stay blocked across fork so the child cannot run our handler
  // (which writes into zsrun's self-pipe) before it resets the dispositions.
  const pid_t launcher = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    errorf("cannot fork %s: %s", r.index < 0 ? "the spare" : ("rank " + std::to_string(r.index)).c_str(),
           strerror(errno));
    for (int fd : {out[0], out[1], err[0], err[1], in[0], in[1]})
      if (fd >= 0) close(fd);
    return false;
  }
  if (pid == 0) {
    reset_child(launcher);
    if (pass_fd >= 0) fcntl(pass_fd, F_SETFD, 0);  // its close-on-exec cleared in the child only
    if (opt_.prefix) {
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
    }
    if (in[0] >= 0) {
      dup2(in[0], STDIN_FILENO);
    } else if (null_stdin) {
      int fd = open("/dev/null", O_RDONLY);
      if (fd >= 0 && fd != STDIN_FILENO) {
        dup2(fd, STDIN_FILENO);
        close(fd);
      }
    }
    environ = envp.data();
    execvp(args[0], args);
    // Reported on the rank's own stderr, so it shows up prefixed with it.
    int e = errno;
    char msg[512];
    int n = snprintf(msg, sizeof msg, "zsrun: cannot execute '%s': %s\n", opt_.command[0],
                     strerror(e));
    if (n > 0) {
      ssize_t w = write(STDERR_FILENO, msg, std::min(static_cast<size_t>(n), sizeof msg - 1));
      (void)w;
    }
    // Shell convention: 127 for "not found", 126 for found but not runnable.
    _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
  }
  // Also set the group from the parent, so it exists before we might signal
  // it, whichever of parent and child runs first.
  setpgid(pid, pid);
  r.pid = pid;
  if (in[0] >= 0) {
    close(in[0]);
    *stdin_write = in[1];
  }
  keep_read_ends();
  return true;
}

// Appends data to the stream and writes every complete line, prefixed, in a
// single write: lines from different ranks never interleave mid-line because
// zsrun is the only writer and only ever writes whole lines.
void Launcher::emit(Stream& s, const std::string& prefix, const char* data, size_t n,
                    bool eof) {
  s.pending.append(data, n);
  std::string text;
  size_t start = 0;
  for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1) {
    text += prefix;
    text.append(s.pending, start, nl + 1 - start);
  }
  s.pending.erase(0, start);
  if ((eof && !s.pending.empty()) || s.pending.size() >= kMaxLine) {
    text += prefix;
    text += s.pending;
    text += '\n';
    s.pending.clear();
  }
  write_all(s.dest, text);
}

void Launcher::close_stream(Stream& s, const std::string& prefix) {
  if (s.fd < 0) return;
  emit(s, prefix, nullptr, 0, true);
  close(s.fd);
  s.fd = -1;
}

// Reads what is available (up to max_reads chunks); closes the stream at EOF.
void Launcher::pump(Stream& s, const std::string& prefix, int max_reads) {
  char buf[65536];
  for (int i = 0; i < max_reads && s.fd >= 0; ++i) {
    ssize_t n = read(s.fd, buf, sizeof buf);
    if (n > 0) {
      emit(s, prefix, buf, static_cast<size_t>(n), false);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      close_stream(s, prefix);  // EOF or a read error
    }
  }
}

void Launcher::reap() {
  int status = 0;
  pid_t pid;
  // waitpid(-1) also reaps the ranks' orphaned descendants that the
  // subreaper setting hands to us; they match no rank and are dropped.
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (pid == store_pid_) {
      store_pid_ = -1;
      const std::string how = WIFSIGNALED(status) ? "was killed by signal " + describe_signal(WTERMSIG(status))
                                                  : "exited with status " + std::to_string(WEXITSTATUS(status));
      // No journal (it could not be written: the store said so) or too
      // many restarts: the job is torn down, as without a journal.
      const bool journal_kept = !store_journal_.empty() && access(store_journal_.c_str(), F_OK) == 0;
      if (!terminating_ && journal_kept && store_restarts_ < kStoreRestarts) {
        // The ranks train on (collectives need no store) and resend what
        // it cut short to the next one, which starts from the journal.
        ++store_restarts_;
        errorf("healing: the store (zsstore) %s; starting it again on port %d from its journal (restart %ld of %ld)",
               how.c_str(), store_port_, store_restarts_, kStoreRestarts);
        start_store(base_env_);
        continue;
      }
      if (!terminating_) {
        errorf("the store (zsstore) %s%s; the job is torn down", how.c_str(),
               store_restarts_ >= kStoreRestarts
                   ? (" after " + std::to_string(kStoreRestarts) + " restarts").c_str()
                   : (store_journal_.empty() || journal_kept ? "" : " and its journal was not kept (see its message)"));
        if (first_failure_code_ < 0) first_failure_code_ = kExitInternal;
        start_termination();
      }
      continue;
    }
    if (pid == warm_.pid && !warm_.reaped) {
      warm_.reaped = true;
      pump(warm_.out, warm_.prefix, 64);
      pump(warm_.err, warm_.prefix, 64);
      if (warm_sock_ >= 0 && !terminating_)
        warm_off(std::string("its interpreter exited (") + (WIFSIGNALED(status) ? "signal " : "status ") +
                 std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status)) + ")");
      continue;
    }
    if (pid == spare_.pid && !spare_.reaped) {
      spare_.reaped = true;
      pump(spare_.out, spare_.prefix, 64);
      pump(spare_.err, spare_.prefix, 64);
      if (!terminating_ && !all_reaped())
        errorf("the spare exited (%s %d) while the ranks run; the next lost rank is started afresh instead",
               WIFSIGNALED(status) ? "signal" : "status",
               WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
      if (spare_in_ >= 0) {
        close(spare_in_);
        spare_in_ = -1;
      }
      continue;
    }
    for (Rank& r : ranks_)
      if (r.pid == pid && !r.reaped) on_exit(r, status);
  }
}

void Launcher::on_exit(Rank& r, int status) {
  r.reaped = true;
  const bool was_growing = r.growing;  // the process was started by --regrow-after
  r.growing = false;
  // Everything the rank wrote is in its pipes by now: relay it before our
  // verdict so a traceback precedes "rank K exited ...".
  pump(r.out, r.prefix, 64);
  pump(r.err, r.prefix, 64);
  int code = 0;
  std::string how;
  if (WIFEXITED(status)) {
    code = WEXITSTATUS(status);
    how = "exited with status " + std::to_string(code);
  } else if (WIFSIGNALED(status)) {
    code = 128 + WTERMSIG(status);
    how = "killed by signal " + describe_signal(WTERMSIG(status));
  }
  // Deaths after we started tearing the job down are our doing, not news.
  if (code == 0 || terminating_) return;
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++lost_;
  errorf("rank %d %s", r.index, how.c_str());
  // --shrink: a rank killed by a SIGKILL zsrun did not send leaves the
  // job, which goes on while at least --min-nproc ranks run (the engine
  // shrinks by the same count: ZS_HEAL_MIN_RANKS); the rank's exit is no
  // failure. Rank 0 only where zsstore serves the store.
  // With --replacement-wait a replacement is started first (below), if a
  // restart is left; the engine's survivors shrink only if it comes late.
  const long running = nranks_ - dropped_ - 1;
  const bool restart_left = attempt_ + respawned_ < opt_.restarts;
  const bool replaces_first = opt_.replacement_wait_s > 0 && restart_left;
  if (heals() && opt_.shrink && !replaces_first && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL &&
      (r.index != 0 || external_store_) && running >= opt_.min_nproc) {
    ++dropped_;
    errorf("healing: rank %d is lost and not started again (--min-nproc %ld --shrink): the %ld other%s go on "
           "without it", r.index, opt_.min_nproc, running, running == 1 ? "" : "s");
    schedule_regrow(r, r.replacements + 1);  // the process for this loss
    return;
  }
  // Healing: a rank that died (a signal: it did not fail by itself) is
  // replaced alone while the others heal around it; rank 0 too where
  // zsstore serves the store (else the store died with it). Not once a
  // survivor found the state lost: the job restarts whole.
  if (heals() && !state_lost_ && WIFSIGNALED(status) && (r.index != 0 || external_store_) && restart_left) {
    r.replaces_loss = respawned_ + 1;  // adopt_spare or respawn counts it
    if (adopt_spare(r)) return;
    char waits[96] = "";
    if (opt_.shrink && opt_.replacement_wait_s > 0)
      std::snprintf(waits, sizeof waits, ", and wait up to %g s for it (--replacement-wait)", opt_.replacement_wait_s);
    errorf("healing: starting a replacement of rank %d (ZS_HEAL_REPLACEMENT=%d; restart %ld of %ld); the other "
           "ranks keep running%s", r.index, r.replacements + 1, attempt_ + respawned_ + 1, opt_.restarts, waits);
    if (respawn(r)) return;
    errorf("cannot start a replacement of rank %d: the job is torn down", r.index);
  }
  // A replacement that came after --replacement-wait: the survivors went on
  // without its rank, and its program says so by its exit; no failure.
  if (heals() && opt_.shrink && WIFEXITED(status) && code == ZS_EXIT_NOT_TAKEN && r.replacements > 0) {
    ++dropped_;
    if (was_growing) {
      errorf("healing: rank %d, started again to grow the job back (--regrow-after), was not taken (its message "
             "says why: the others finished first, or refused it): the %ld other%s go on without it", r.index, running,
             running == 1 ? "" : "s");
      return;
    }
    errorf("healing: rank %d's replacement came after --replacement-wait %g s: the %ld other%s went on without it",
           r.index, opt_.replacement_wait_s, running, running == 1 ? "" : "s");
    schedule_regrow(r, r.replacements);  // that replacement's loss is still the last one
    return;
  }
  // A survivor whose heal was impossible (its program exits with
  // ZS_EXIT_STATE_LOST): the job is restarted whole, if a restart is left.
  // The other survivors reach the same verdict in the same agreement: they
  // get kStateLostGraceS to say so and exit before the teardown, so each
  // names what was lost (a SIGTERM would cut their message short).
  if (heals() && WIFEXITED(status) && code == ZS_EXIT_STATE_LOST) {
    if (first_failure_code_ < 0) first_failure_code_ = code;
    if (state_lost_) return;
    errorf("healing impossible: rank %d exited with status %d (ZS_ERR_STATE_LOST): a shard's state was lost "
           "with every copy of it, or before its first copy (its message above names the ranks); %s", r.index, code,
           attempt_ < opt_.restarts ? "restarting every rank from the last checkpoint"
                                     : "no restart is left (--restarts)");
    state_lost_ = true;
    state_lost_at_ = Clock::now();
    return;
  }
  if (first_failure_code_ < 0) first_failure_code_ = code;
  start_termination();
}

// Signals the process group of every rank whose group may still have
// members; skipping empty groups avoids hitting a recycled process id.
void Launcher::signal_groups(int sig) {
  for (Rank* helper : helpers())
    if (helper->pid > 0 && !helper->group_gone && kill(-helper->pid, sig) < 0 && errno == ESRCH && helper->reaped)
      helper->group_gone = true;
  for (Rank& r : ranks_) {
    if (r.pid <= 0 || r.group_gone) continue;
    if (kill(-r.pid, sig) < 0 && errno == ESRCH) {
      if (r.reaped) r.group_gone = true;
      else kill(r.pid, sig);  // its setpgid has not happened yet
    }
  }
}

void Launcher::start_termination() {
  if (terminating_) return;
  terminating_ = true;
  term_started_ = Clock::now();
  signal_groups(SIGTERM);
}

// Whether every rank that outlived the latest loss has exited: its
// replacement, still joining, reaches no verdict of its own.
bool Launcher::survivors_reaped() const {
  for (const Rank& r : ranks_)
    if (!r.reaped && (respawned_ == 0 || r.replaces_loss < respawned_)) return false;
  return true;
}

bool Launcher::all_reaped() const {
  for (const Rank& r : ranks_)
    if (!r.reaped) return false;
  return true;
}

// True while processes other than the (reaped) ranks themselves linger in the
// ranks' groups or hold their pipes open.
bool Launcher::leftovers() {
  bool any = false;
  for (Rank* helper : helpers()) {
    if (helper->pid <= 0) continue;
    if (helper->out.fd >= 0 || helper->err.fd >= 0 || !helper->reaped) any = true;
    if (!helper->group_gone) {
      if (kill(-helper->pid, 0) < 0 && errno == ESRCH) helper->group_gone = true;
      else any = true;
    }
  }
  for (Rank& r : ranks_) {
    if (r.out.fd >= 0 || r.err.fd >= 0) any = true;
    if (!r.group_gone && r.pid > 0) {
      if (kill(-r.pid, 0) < 0 && errno == ESRCH) r.group_gone = true;
      else any = true;
    }
  }
  return any;
}

int Launcher::run() {
  start_ = Clock::now();
  if (const char* g = getenv("ZSRUN_KILL_GRACE_S")) {
    if (!parse_seconds(g, &kill_grace_s_) || kill_grace_s_ < 0)
      usage_error("ZSRUN_KILL_GRACE_S expects a number of seconds >= 0, got '%s'", g);
  }
  if (const char* h = getenv("ZS_MALLOC_HUGE_PAGES")) {
    if (std::strcmp(h, "0") != 0 && std::strcmp(h, "1") != 0)
      usage_error("ZS_MALLOC_HUGE_PAGES expects 1 (the ranks' heap on huge pages, the default) or 0, got '%s'",
                  h);
    huge_page_heap_ = *h == '1';
  }
  // Two ports: MASTER_PORT for torch.distributed, ZS_STORE_PORT for the
  // engine's store; each given one is kept, the others are picked apart.
  master_port_ = opt_.master_port;
  store_port_ = opt_.store_port;
  if ((master_port_ == 0 && (master_port_ = pick_free_port_other_than(store_port_)) < 0) ||
      (store_port_ == 0 && (store_port_ = pick_free_port_other_than(master_port_)) < 0)) {
    errorf("cannot find two free TCP ports on 127.0.0.1: %s", strerror(errno));
    return kExitInternal;
  }

  if (pipe(g_sigpipe) < 0 || !set_flags(g_sigpipe[0], true, true) ||
      !set_flags(g_sigpipe[1], true, true)) {
    errorf("cannot create the signal pipe: %s", strerror(errno));
    return kExitInternal;
  }
  // Handlers go in before any fork so no SIGCHLD or Ctrl-C can be lost;
  // signals are blocked while spawning (see spawn()) and unblocked after.
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigset_t block;
  sigemptyset(&block);
  for (int sig : kForwardedSignals) {
    sigaction(sig, &sa, nullptr);
    sigaddset(&block, sig);
  }
  sa.sa_flags |= SA_NOCLDSTOP;
  sigaction(SIGCHLD, &sa, nullptr);
  sigaddset(&block, SIGCHLD);
  signal(SIGPIPE, SIG_IGN);  // a closed stdout is an EPIPE, not our death

#ifdef PR_SET_CHILD_SUBREAPER
  // Best effort: without it orphans go to init, which is only slower.
  prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
#endif

  sigprocmask(SIG_BLOCK, &block, &orig_mask_);
  bool spawned = spawn_all();
  sigprocmask(SIG_SETMASK, &orig_mask_, nullptr);
  int internal_error = 0;
  if (!spawned) {
    // Take down the ranks that did start; the loop below reaps them.
    internal_error = kExitInternal;
    for (Rank& r : ranks_)
      if (r.pid < 0) r.reaped = r.group_gone = true;
    start_termination();
  }

  std::vector<pollfd> fds;
  std::vector<Stream*> streams;
  for (;;) {
    reap();
    auto now = Clock::now();
    if (opt_.timeout_s > 0 && !terminating_ && seconds_since(start_) >= opt_.timeout_s) {
      errorf("timed out after %g s; terminating %ld ranks", opt_.timeout_s, nranks_);
      timed_out_ = true;
      start_termination();
    }
    if (state_lost_ && !terminating_ &&
        (survivors_reaped() || seconds_since(state_lost_at_) >= kStateLostGraceS))
      start_termination();
    if (terminating_ && !killed_ && seconds_since(term_started_) >= kill_grace_s_) {
      for (const Rank& r : ranks_)
        if (!r.reaped)
          errorf("rank %d still running %g s after SIGTERM; sending SIGKILL", r.index,
                 kill_grace_s_);
      signal_groups(SIGKILL);
      killed_ = true;
      killed_at_ = now;
    }
    if (all_reaped()) {
      if (!all_reaped_seen_) {
        all_reaped_seen_ = true;
        all_reaped_at_ = now;
        end_spare();  // nothing left for it to replace
        end_warm();   // nor to fork
      }
      if (!leftovers()) break;
      // Background processes of finished ranks: let them flush, then end them.
      if (!terminating_ && seconds_since(all_reaped_at_) >= kLeftoverDrainS) {
        errorf("all ranks exited; terminating processes they left behind");
        start_termination();
      }
      if (killed_ && seconds_since(killed_at_) >= kAfterKillS) {
        for (Rank& r : ranks_) {
          close_stream(r.out, r.prefix);
          close_stream(r.err, r.prefix);
        }
        for (Rank* helper : helpers()) {
          close_stream(helper->out, helper->prefix);
          close_stream(helper->err, helper->prefix);
        }
        break;
      }
    }

    // Sleep until output, a signal, or the next deadline.
    double wait_s = -1;
    auto consider = [&](double remaining) {
      remaining = std::max(remaining, 0.0);
      if (wait_s < 0 || remaining < wait_s) wait_s = remaining;
    };
    if (opt_.timeout_s > 0 && !terminating_) consider(opt_.timeout_s - seconds_since(start_));
    if (state_lost_ && !terminating_) consider(kStateLostGraceS - seconds_since(state_lost_at_));
    if (terminating_ && !killed_) consider(kill_grace_s_ - seconds_since(term_started_));
    if (killed_) consider(kAfterKillS - seconds_since(killed_at_));
    if (!all_reaped_seen_) start_due_regrows(&wait_s);
    // Nothing announces that a process group became empty: poll for it.
    if (all_reaped_seen_) consider(0.05);

    fds.clear();
    streams.clear();
    fds.push_back({g_sigpipe[0], POLLIN, 0});
    for (Rank* r : all_processes()) {
      for (Stream* s : {&r->out, &r->err}) {
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        streams.push_back(s);
      }
    }
    int timeout_ms = wait_s < 0 ? -1 : static_cast<int>(std::ceil(wait_s * 1000));
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      errorf("poll: %s", strerror(errno));
      internal_error = kExitInternal;
      start_termination();
      continue;
    }

    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t got;
      while ((got = read(g_sigpipe[0], sigs, sizeof sigs)) > 0) {
        for (ssize_t k = 0; k < got; ++k) {
          int sig = sigs[k];
          if (sig == SIGCHLD) continue;  // reaped at the top of the loop
          if (received_signal_ == 0) received_signal_ = sig;
          signal_groups(sig);
        }
      }
    }
    for (size_t k = 1; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      Stream* s = streams[k - 1];
      // Find the owning rank for the prefix (streams are members of ranks).
      for (Rank* r : all_processes())
        if (s == &r->out || s == &r->err) pump(*s, r->prefix, 1);
    }
  }

  reap();
  stop_store();
  close(g_sigpipe[0]);
  close(g_sigpipe[1]);
  g_sigpipe[0] = g_sigpipe[1] = -1;  // a signal between attempts writes nowhere
  if (internal_error) return internal_error;
  rank_failed_ = first_failure_code_ >= 0 && !timed_out_ && received_signal_ == 0;
  if (first_failure_code_ >= 0) return first_failure_code_;
  if (timed_out_) return kExitTimeout;
  if (received_signal_) return 128 + received_signal_;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // If zsrun was started with fd 0, 1 or 2 closed, a pipe() could land on
  // them and be clobbered by the dup2s in the child; occupy them first.
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      int nfd = open("/dev/null", O_RDWR);
      if (nfd >= 0 && nfd != fd) close(nfd);  // unreachable unless racing
    }
  }
  const Options opt = parse_args(argc, argv);
  long nranks = opt.nranks;
  for (long attempt = 0;; ++attempt) {
    Launcher launcher(opt, nranks, attempt);
    const int code = launcher.run();
    if (code == 0 || !launcher.rank_failed() || attempt >= opt.restarts || g_signalled != 0)
      return code;
    long next = nranks;
    if (opt.min_nproc > 0 && launcher.lost() > 0)
      next = std::max(opt.min_nproc, nranks - launcher.lost());
    errorf("restart %ld of %ld: starting the job again with %ld rank%s%s", attempt + 1,
           opt.restarts, next, next == 1 ? "" : "s",
           next < nranks ? " (a rank killed by SIGKILL is lost)" : "");
    nranks = next;
  }
}
