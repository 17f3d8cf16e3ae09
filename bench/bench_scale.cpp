// How the engine's bootstrap and liveness grow with the world, measured on
// one machine with many light ranks (issue: past one rack), side by side
// with torch.distributed's Gloo group at the same sizes.
//
//   build/bin/bench_scale [--ranks 8,16,32,64] [--python .venv/bin/python] [--no-torch]
//   ZS_FULL_MESH_MAX=8 build/bin/bench_scale ...   (groups past 8 ranks: 2 log N pairs a rank)
//
// Ranks are processes (fork, one context each, over loopback): a context is
// one per process by design (its heartbeat, store client and transport are
// the process's), so several contexts per process would measure something
// no job runs. Per world size it prints, for zeroshard:
//   create_s       fork of the first rank to the last rank's world group ready
//   store_server   requests rank 0's store handled, and per rank, and the bytes
//                  its replies carried (ZS_STORE_STATS)
//   heartbeat      UDP datagrams per second, total and per rank, with every
//                  rank idle (the machine's UDP counter, /proc/net/snmp)
//   sockets        file descriptors that are sockets, per rank (mean)
//   rss_mib        resident memory per rank (mean)
//   name_dead_s    SIGKILL of the last rank to the moment every other rank's
//                  pending barrier failed naming it (slowest rank)
//   allreduce_us   one float's all-reduce, median over 50
// and for torch (init_process_group("gloo") over its TCPStore): create_s,
// sockets, rss_mib, allreduce_us. Each size runs alone (the others have
// exited). The last line is one JSON object with a list per metric over the
// world sizes. Benchmarks never pass or fail on time.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/engine_check.h"
#include "impl/comm/algo/mesh_peers.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

using Clock = std::chrono::steady_clock;

double mono_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// The machine's UDP datagrams sent so far (heartbeats, on an idle machine).
long long udp_out() {
  std::ifstream f("/proc/net/snmp");
  std::string line, header;
  while (std::getline(f, line)) {
    if (line.rfind("Udp:", 0) != 0) continue;
    if (header.empty()) {
      header = line;
      continue;
    }
    std::istringstream h(header), v(line);
    std::string name, value;
    while (h >> name && v >> value)
      if (name == "OutDatagrams") return std::atoll(value.c_str());
  }
  return -1;
}

void send_line(int fd, const std::string& s) {
  const std::string l = s + "\n";
  [[maybe_unused]] ssize_t n = write(fd, l.data(), l.size());  // < PIPE_BUF: atomic
}

std::map<std::string, std::string> parse_kv(const std::string& line) {
  std::map<std::string, std::string> m;
  std::istringstream in(line);
  std::string kv;
  while (in >> kv) {
    const auto eq = kv.find('=');
    if (eq != std::string::npos) m[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return m;
}

// One zeroshard rank: results on `out`, then waits for `go` on `in`; the
// last rank then idles until killed, the others wait in a barrier that its
// death must end.
[[noreturn]] void zs_rank(int rank, int world, int port, int out, int in, const std::string& err_path) {
  FILE* err = std::freopen(err_path.c_str(), "w", stderr);
  (void)err;
  setenv("ZS_STORE_STATS", "1", 1);
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.local_rank = rank;
  o.local_world_size = world;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  o.timeout_ms = 600000;
  zs_context ctx = nullptr;
  if (zs_context_create(&ctx, &o) != ZS_OK) {
    send_line(out, "rank=" + std::to_string(rank) + " error=create");
    std::fprintf(stderr, "create: %s\n", zs_last_error());
    std::fflush(stderr);
    _exit(1);
  }
  zs_group world_group = nullptr;
  CHECK(zs_context_group(&world_group, ctx, ZS_GROUP_WORLD));
  zs_work w = nullptr;
  CHECK(zs_barrier(&w, world_group));
  CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
  zs_work_destroy(w);
  const double ready = mono_s();
  std::vector<double> lat;
  float x = 1.0f;
  for (int i = 0; i < 50; ++i) {
    const auto t0 = Clock::now();
    CHECK(zs_allreduce(&w, world_group, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
    CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
    zs_work_destroy(w);
    lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    x = 1.0f;
  }
  char line[256];
  std::snprintf(line, sizeof line, "rank=%d ready=%.6f allreduce_us=%.1f sockets=%d rss_mib=%.1f", rank,
                ready, zs::bench::median(lat), zs::bench::sockets_open(), rss_mib());
  send_line(out, line);
  char go = 0;
  if (read(in, &go, 1) != 1) _exit(1);
  if (rank == world - 1) {
    for (;;) pause();  // the victim: alive, beating, never arriving
  }
  CHECK(zs_barrier(&w, world_group));
  const zs_status s = zs_work_wait(w, ZS_WAIT_FOREVER);  // fails: the last rank is killed
  const double failed = mono_s();
  const std::string why = s == ZS_OK ? "" : zs_last_error();
  const std::string dead = std::to_string(world - 1);
  const bool named = why.find("rank " + dead + " ") != std::string::npos ||
                     why.find("rank " + dead + ",") != std::string::npos;
  std::snprintf(line, sizeof line, "rank=%d failed=%.6f named=%d", rank, failed, named ? 1 : 0);
  send_line(out, line);
  std::fprintf(stderr, "barrier: %s\n", s == ZS_OK ? "ok" : zs_last_error());
  // Stay until every survivor has reported: one leaving early would be
  // named gone too, and end the others' waits before the dead rank does.
  if (read(in, &go, 1) != 1) _exit(1);
  zs_work_destroy(w);
  zs_group_destroy(world_group);
  zs_context_destroy(ctx);  // the store's stats are printed as it goes
  std::fflush(stderr);
  _exit(0);
}

struct Row {
  int world = 0;
  double create_s = 0, allreduce_us = 0, sockets = 0, rss = 0, name_dead_s = -1;
  double hb_total = 0, hb_per_rank = 0;
  long long store_server = -1;
  double store_per_rank = 0;
  double store_mib = -1;  // what rank 0's store replied
  bool all_named = false;
  std::string error;
};

Row run_zeroshard(int world) {
  Row row;
  row.world = world;
  const int port = zs::bench::free_port();
  int res[2];
  if (pipe(res) != 0) std::abort();
  std::vector<int> go(static_cast<size_t>(world));
  std::vector<pid_t> pids;
  const std::string errdir = "/tmp/zs_bench_scale_" + std::to_string(getpid());
  mkdir(errdir.c_str(), 0700);
  const double t0 = mono_s();
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (pipe(p) != 0) std::abort();
    const pid_t pid = fork();
    if (pid == 0) {
      close(res[0]);
      close(p[1]);
      zs_rank(r, world, port, res[1], p[0], errdir + "/rank" + std::to_string(r));
    }
    close(p[0]);
    go[static_cast<size_t>(r)] = p[1];
    pids.push_back(pid);
  }
  close(res[1]);
  FILE* in = fdopen(res[0], "r");
  std::vector<std::map<std::string, std::string>> first;
  char buf[512];
  while (static_cast<int>(first.size()) < world && std::fgets(buf, sizeof buf, in)) first.push_back(parse_kv(buf));
  double last_ready = 0, lat = 0, socks = 0, rss = 0;
  for (const auto& m : first) {
    if (m.count("error")) row.error = "rank " + m.at("rank") + " failed to create its context";
    if (!m.count("ready")) continue;
    last_ready = std::max(last_ready, std::atof(m.at("ready").c_str()));
    lat += std::atof(m.at("allreduce_us").c_str());
    socks += std::atof(m.at("sockets").c_str());
    rss += std::atof(m.at("rss_mib").c_str());
  }
  const double n = static_cast<double>(std::max<size_t>(1, first.size()));
  row.create_s = last_ready - t0;
  row.allreduce_us = lat / n;
  row.sockets = socks / n;
  row.rss = rss / n;
  // Every rank idle (waiting for go): what the heartbeats alone send.
  const long long u0 = udp_out();
  const auto s0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double span = std::chrono::duration<double>(Clock::now() - s0).count();
  row.hb_total = static_cast<double>(udp_out() - u0) / span;
  row.hb_per_rank = row.hb_total / world;
  for (int fd : go) {
    [[maybe_unused]] ssize_t w = write(fd, "g", 1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the barrier is entered
  const double killed = mono_s();
  kill(pids.back(), SIGKILL);
  int named = 0, reported = 0;
  double slowest = 0;
  while (reported < world - 1 && std::fgets(buf, sizeof buf, in)) {
    const auto m = parse_kv(buf);
    if (!m.count("failed")) continue;
    ++reported;
    named += std::atoi(m.at("named").c_str());
    slowest = std::max(slowest, std::atof(m.at("failed").c_str()) - killed);
  }
  for (int fd : go) {
    [[maybe_unused]] ssize_t w = write(fd, "x", 1);  // survivors may go now
    close(fd);
  }
  fclose(in);
  row.name_dead_s = slowest;
  row.all_named = named == world - 1;
  for (pid_t p : pids) waitpid(p, nullptr, 0);
  long long clients = 0, client_sum = 0;
  for (int r = 0; r < world; ++r) {
    std::ifstream f(errdir + "/rank" + std::to_string(r));
    std::string line;
    while (std::getline(f, line)) {
      unsigned long long v = 0;
      if (const char* at = std::strstr(line.c_str(), "handled "); at && std::sscanf(at, "handled %llu", &v) == 1)
        row.store_server = static_cast<long long>(v);
      if (const char* at = std::strstr(line.c_str(), "replied "); at && std::sscanf(at, "replied %llu", &v) == 1)
        row.store_mib = static_cast<double>(v) / (1 << 20);
      if (const char* at = std::strstr(line.c_str(), "' made "); at && std::sscanf(at, "' made %llu", &v) == 1) {
        client_sum += static_cast<long long>(v);
        ++clients;
      }
    }
    if (!std::getenv("ZS_BENCH_KEEP")) std::remove((errdir + "/rank" + std::to_string(r)).c_str());
  }
  if (!std::getenv("ZS_BENCH_KEEP")) rmdir(errdir.c_str());
  row.store_per_rank = clients ? static_cast<double>(client_sum) / static_cast<double>(clients) : 0;
  return row;
}

// torch.distributed at the same size: each rank a Python process.
const char* kTorchRank = R"PY(
import os, sys, time, statistics
t_import = time.monotonic()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
ready = time.monotonic()
x = torch.ones(1)
lat = []
for _ in range(50):
    t = time.perf_counter(); dist.all_reduce(x); lat.append((time.perf_counter() - t) * 1e6)
def is_socket(f):
    try:
        return os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
    except OSError:
        return False
socks = sum(map(is_socket, os.listdir("/proc/self/fd")))
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE") / 2**20
line = f"rank={os.environ['RANK']} ready={ready:.6f} import_done={t_import:.6f} allreduce_us={statistics.median(lat):.1f} sockets={socks} rss_mib={rss:.1f}\n"
os.write(1, line.encode())  # one write: lines of many ranks share the pipe
dist.barrier()
os._exit(0)
)PY";

Row run_torch(int world, const std::string& python) {
  Row row;
  row.world = world;
  const int port = zs::bench::free_port();
  int res[2];
  if (pipe(res) != 0) std::abort();
  std::vector<pid_t> pids;
  const double t0 = mono_s();
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(res[0]);
      dup2(res[1], 1);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("OMP_NUM_THREADS", "1", 1);
      execlp(python.c_str(), python.c_str(), "-c", kTorchRank, static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  close(res[1]);
  FILE* in = fdopen(res[0], "r");
  char buf[512];
  double last_ready = 0, lat = 0, socks = 0, rss = 0, last_import = 0;
  int got = 0;
  while (got < world && std::fgets(buf, sizeof buf, in)) {
    const auto m = parse_kv(buf);
    if (!m.count("ready")) continue;
    ++got;
    last_ready = std::max(last_ready, std::atof(m.at("ready").c_str()));
    last_import = std::max(last_import, std::atof(m.at("import_done").c_str()));
    lat += std::atof(m.at("allreduce_us").c_str());
    socks += std::atof(m.at("sockets").c_str());
    rss += std::atof(m.at("rss_mib").c_str());
  }
  fclose(in);
  for (pid_t p : pids) waitpid(p, nullptr, 0);
  if (got < world) row.error = std::to_string(world - got) + " ranks did not report";
  const double n = std::max(1, got);
  row.create_s = last_ready - t0;
  row.allreduce_us = lat / n;
  row.sockets = socks / n;
  row.rss = rss / n;
  return row;
}

std::string list(const std::vector<Row>& rows, double Row::*field, int digits) {
  std::string s = "[";
  for (size_t i = 0; i < rows.size(); ++i) {
    char b[32];
    std::snprintf(b, sizeof b, "%.*f", digits, rows[i].*field);
    s += (i ? ", " : "") + std::string(b);
  }
  return s + "]";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes = {8, 16, 32, 64};
  std::string python = ".venv/bin/python";
  bool torch = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc) {
      sizes.clear();
      std::stringstream ss(argv[++i]);
      std::string v;
      while (std::getline(ss, v, ',')) sizes.push_back(std::atoi(v.c_str()));
    } else if (a == "--python" && i + 1 < argc) {
      python = argv[++i];
    } else if (a == "--no-torch") {
      torch = false;
    } else {
      std::fprintf(stderr, "usage: bench_scale [--ranks 8,16,32,64] [--python PATH] [--no-torch]\n");
      return 2;
    }
  }
  signal(SIGPIPE, SIG_IGN);  // the killed rank's pipe is closed
  for (int w : sizes)
    if (w < 2) {
      std::fprintf(stderr, "bench_scale: --ranks needs sizes >= 2, got %d\n", w);
      return 2;
    }
  if (torch && access(python.c_str(), X_OK) != 0) {
    std::printf("torch side skipped: %s is not executable (--python)\n", python.c_str());
    torch = false;
  }
  // Groups past ZS_FULL_MESH_MAX members connect 2 log N pairs a rank
  // (mesh_peers.h); run with ZS_FULL_MESH_MAX=8 to see that at these sizes.
  const char* mesh_env = std::getenv("ZS_FULL_MESH_MAX");
  const std::string full_mesh_max = mesh_env && *mesh_env ? mesh_env : std::to_string(zs::kDefaultFullMeshMax);
  std::printf("bench_scale: processes over loopback on %ld cores; heartbeat period %s ms; full mesh up to %s "
              "ranks (ZS_FULL_MESH_MAX)\n",
              sysconf(_SC_NPROCESSORS_ONLN), std::getenv("ZS_HEARTBEAT_MS") ? std::getenv("ZS_HEARTBEAT_MS") : "250",
              full_mesh_max.c_str());
  std::vector<Row> zs_rows, torch_rows;
  for (int w : sizes) {
    const Row z = run_zeroshard(w);
    zs_rows.push_back(z);
    std::printf("zeroshard %5d ranks: create %.2f s, store %lld requests on rank 0 (%.1f per rank, %.2f MiB "
                "replied), "
                "heartbeats %.0f/s (%.1f per rank), %.1f sockets/rank, %.1f MiB/rank, dead rank named in "
                "%.2f s%s, all-reduce %.0f us%s\n",
                w, z.create_s, z.store_server, z.store_per_rank, z.store_mib, z.hb_total, z.hb_per_rank, z.sockets, z.rss,
                z.name_dead_s, z.all_named ? "" : " (NOT by every rank)", z.allreduce_us,
                z.error.empty() ? "" : ("  ERROR: " + z.error).c_str());
    // A torch rank holds ~0.5 GiB resident (libtorch): past what this
    // machine holds, the torch side is skipped, and said so.
    const double torch_gib = 0.5 * w, have_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                                                     static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 30);
    if (torch && torch_gib > 0.6 * have_gib) {
      std::printf("torch     %5d ranks: skipped (about %.0f GiB resident; this machine has %.0f GiB)\n", w,
                  torch_gib, have_gib);
      Row skipped;  // -1: not measured
      skipped.world = w;
      skipped.create_s = skipped.allreduce_us = skipped.sockets = skipped.rss = -1;
      torch_rows.push_back(skipped);
    } else if (torch) {
      const Row t = run_torch(w, python);
      torch_rows.push_back(t);
      std::printf("torch     %5d ranks: create %.2f s (python start and import included), %.1f sockets/rank, "
                  "%.1f MiB/rank, all-reduce %.0f us%s\n",
                  w, t.create_s, t.sockets, t.rss, t.allreduce_us,
                  t.error.empty() ? "" : ("  ERROR: " + t.error).c_str());
    }
    std::fflush(stdout);
  }
  std::string store = "[";
  for (size_t i = 0; i < zs_rows.size(); ++i) store += (i ? ", " : "") + std::to_string(zs_rows[i].store_server);
  store += "]";
  std::printf("{\"bench\": \"scale\", \"full_mesh_max\": %s, \"ranks\": [", full_mesh_max.c_str());
  for (size_t i = 0; i < sizes.size(); ++i) std::printf("%s%d", i ? ", " : "", sizes[i]);
  std::printf("], \"zeroshard\": {\"create_s\": %s, \"store_server_requests\": %s, \"store_requests_per_rank\": %s, "
              "\"store_server_replied_mib\": %s, "
              "\"heartbeat_per_s\": %s, \"heartbeat_per_s_per_rank\": %s, \"sockets_per_rank\": %s, "
              "\"rss_mib_per_rank\": %s, \"name_dead_s\": %s, \"allreduce_us\": %s}",
              list(zs_rows, &Row::create_s, 3).c_str(), store.c_str(), list(zs_rows, &Row::store_per_rank, 1).c_str(),
              list(zs_rows, &Row::store_mib, 2).c_str(),
              list(zs_rows, &Row::hb_total, 0).c_str(), list(zs_rows, &Row::hb_per_rank, 1).c_str(),
              list(zs_rows, &Row::sockets, 1).c_str(), list(zs_rows, &Row::rss, 1).c_str(),
              list(zs_rows, &Row::name_dead_s, 3).c_str(), list(zs_rows, &Row::allreduce_us, 0).c_str());
  if (!torch_rows.empty())
    std::printf(", \"torch\": {\"create_s\": %s, \"sockets_per_rank\": %s, \"rss_mib_per_rank\": %s, \"allreduce_us\": %s}",
                list(torch_rows, &Row::create_s, 3).c_str(), list(torch_rows, &Row::sockets, 1).c_str(),
                list(torch_rows, &Row::rss, 1).c_str(), list(torch_rows, &Row::allreduce_us, 0).c_str());
  std::printf("}\n");
  return 0;
}
