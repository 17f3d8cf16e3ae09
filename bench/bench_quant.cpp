// ZeRO++ on a slow link: the time of one training step's communication (the
// forward's gathers of every param, then push + sync of its gradients) on 2
// ranks joined by a rate-limited link, unquantized against qwZ, qgZ, both,
// and both with LoCo. Prints figures and ratios, never pass/fail on time:
// each mode's fastest of --iters steps (other processes on a shared
// machine only add time; the median is printed beside it) and, first, the
// link's rate as measured by 32 MiB of plain TCP.
//
//   build/bin/bench_quant [--mib 256 (model size in its dtype)] [--iters 3]
//                         [--dtype bf16|fp32] [--rate 1gbit] [--link auto|veth|lo|loopback]
//
// The link (--link auto tries them in this order):
//   veth      rank 0 in a new user + network namespace, rank 1 in a second
//             network namespace made from it, joined by a veth pair whose
//             two ends each get `tc qdisc ... tbf rate RATE burst 64kb
//             latency 50ms` (each direction limited, as a full-duplex NIC).
//   lo        one namespace, both ranks on its loopback, tbf on lo (MTU
//             1500): both directions share the one limit.
//   loopback  no namespace, no limit (where namespaces are not allowed).
// The link taken is printed and goes into the JSON line (the last line).
// Needs `ip` and `tc` (iproute2) for veth and lo.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/engine_check.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

struct Args {
  int mib = 256;
  int iters = 3;
  std::string dtype = "bf16";
  std::string rate = "1gbit";
  std::string link = "auto";
};

struct Mode {
  const char* name;
  int qwz, qgz;  // bits, 0: off
  bool loco;
};
const Mode kModes[] = {
    {"unquantized", 0, 0, false},
    {"qwZ int8", 8, 0, false},
    {"qgZ int4", 0, 4, false},
    {"qwZ int8 + qgZ int4", 8, 4, false},
    {"qwZ int8 + qgZ int4 + LoCo", 8, 4, true},
};
constexpr int kNumModes = sizeof(kModes) / sizeof(kModes[0]);

struct Result {
  double link_gbit = 0;  // measured by probe_link (0: not measured)
  double step_s[kNumModes] = {};  // the fastest of the iterations (run_mode)
  double gather_s[kNumModes] = {};
  double reduce_s[kNumModes] = {};
  double median_s[kNumModes] = {};
  double model_bytes = 0;
};

// Where rank r listens and how to reach rank 0 (the store).
struct Net {
  std::string addr[2] = {"127.0.0.1", "127.0.0.1"};
  int port_base = 0;  // mode k's store listens on port_base + k
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using zs::bench::median;

// One mode on this rank: median step time (gather all, release, push all,
// sync) and its two halves.
void run_mode(int rank, const Net& net, int k, const Args& a, Result* out) {
  const Mode& m = kModes[k];
  const zs_dtype dtype = a.dtype == "fp32" ? ZS_FLOAT32 : ZS_BFLOAT16;
  const size_t es = dtype == ZS_FLOAT32 ? 4 : 2;
  std::string loco = m.loco ? R"({"err_beta": 0.8, "reset_T": 1024})" : "null";
  const std::string cfg =
      std::string(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 50000000,)") +
      R"( "zero_quantized_weights": )" + (m.qwz ? "true" : "false") +
      R"(, "zero_quantized_weights_bits": )" + std::to_string(m.qwz ? m.qwz : 8) +
      R"(, "zero_quantized_gradients": )" + (m.qgz ? "true" : "false") +
      R"(, "zero_quantized_gradients_bits": )" + std::to_string(m.qgz ? m.qgz : 4) +
      R"(, "zeropp_loco_param": )" + loco + "}}";
  setenv("ZS_SOCKET_HOST", net.addr[rank].c_str(), 1);
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = 2;
  o.store_host = net.addr[0].c_str();
  o.store_port = net.port_base + k;
  o.local_rank = 0;  // a node each: the link is what joins them
  o.local_world_size = 1;
  o.config_json = cfg.c_str();
  o.device = "cpu";
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  const size_t want = static_cast<size_t>(a.mib) << 20;
  std::vector<zs_param> ps;
  std::vector<std::vector<uint8_t>> grads;
  double bytes = 0;
  for (int i = 0; bytes < static_cast<double>(want); ++i) {
    const int64_t shape[2] = {2048, 2048};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "w" + std::to_string(i);
    po.name = name.c_str();
    po.dtype = dtype;
    po.ndim = 2;
    po.shape = shape;
    po.init = ZS_INIT_NORMAL;
    po.b = 0.02;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    ps.push_back(p);
    std::vector<uint8_t> g(2048 * 2048 * es);
    for (size_t e = 0; e < g.size() / es; ++e) {
      const float v = static_cast<float>((e * 2654435761u + static_cast<size_t>(rank) * 97 + i) % 2001) * 1e-5f - 0.01f;
      if (es == 4) {
        std::memcpy(g.data() + e * 4, &v, 4);
      } else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const auto h = static_cast<uint16_t>(u >> 16);
        std::memcpy(g.data() + e * 2, &h, 2);
      }
    }
    grads.push_back(std::move(g));
    bytes += static_cast<double>(2048 * 2048 * es);
  }
  out->model_bytes = bytes;
  double tg = 0, tr = 0;
  auto once = [&] {
    const double t0 = now_s();
    zs_gather g;
    CHECK(zs_fetch(&g, ctx, ps.data(), ps.size()));
    CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, ps.data(), ps.size()));
    const double t1 = now_s();
    for (size_t i = 0; i < ps.size(); ++i)
      CHECK(zs_grad_push(ps[i], grads[i].data(), dtype, grads[i].size()));
    CHECK(zs_grad_sync(ctx));
    const double t2 = now_s();
    tg = t1 - t0;
    tr = t2 - t1;
    return t2 - t0;
  };
  once();  // warm-up: first touch of the buffers
  std::vector<double> t, g, r;
  for (int it = 0; it < a.iters; ++it) {
    t.push_back(once());
    g.push_back(tg);
    r.push_back(tr);
  }
  // The fastest iteration and its halves: on a shared machine other
  // processes only ever add time. The median is kept for the record.
  const size_t best = static_cast<size_t>(std::min_element(t.begin(), t.end()) - t.begin());
  out->step_s[k] = t[best];
  out->gather_s[k] = g[best];
  out->reduce_s[k] = r[best];
  out->median_s[k] = median(t);
  for (auto p : ps) CHECK(zs_param_destroy(p));
  CHECK(zs_context_destroy(ctx));
}

// The link's rate as plain TCP sees it: rank 1 sends 32 MiB to rank 0,
// which times them from the first byte to the last.
double probe_link(int rank, const Net& net) {
  const size_t bytes = size_t{32} << 20;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(net.port_base - 1));
  inet_pton(AF_INET, net.addr[0].c_str(), &addr.sin_addr);
  std::vector<char> buf(size_t{1} << 20);
  if (rank == 0) {
    const int ls = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(ls, 1) != 0) return 0;
    const int c = accept(ls, nullptr, nullptr);
    size_t got = 0;
    double t0 = 0;
    while (got < bytes) {
      const ssize_t n = read(c, buf.data(), buf.size());
      if (n <= 0) break;
      if (got == 0) t0 = now_s();
      got += static_cast<size_t>(n);
    }
    const double t = now_s() - t0;
    close(c);
    close(ls);
    return got == bytes ? static_cast<double>(bytes) * 8 / t / 1e9 : 0;
  }
  int c = -1;
  for (int tries = 0; tries < 500; ++tries) {  // rank 0 may not listen yet
    c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    close(c);
    c = -1;
    usleep(10000);
  }
  if (c < 0) return 0;
  for (size_t sent = 0; sent < bytes;) {
    const ssize_t n = write(c, buf.data(), std::min(buf.size(), bytes - sent));
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  close(c);
  return 0;
}

void run_all_modes(int rank, const Net& net, const Args& a, Result* out) {
  out->link_gbit = probe_link(rank, net);
  for (int k = 0; k < kNumModes; ++k) run_mode(rank, net, k, a, out);
}

bool write_file(const char* path, const std::string& text) {
  const int fd = open(path, O_WRONLY);
  if (fd < 0) return false;
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

// A user namespace (so no root is needed) with a network namespace of its
// own; root inside it may run ip and tc on its own links.
bool enter_namespaces() {
  const uid_t uid = geteuid();
  const gid_t gid = getegid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0) return false;
  write_file("/proc/self/setgroups", "deny");  // absent on old kernels: no matter
  return write_file("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") &&
         write_file("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1");
}

bool sh(const std::string& cmd) {
  const std::string quiet = "(" + cmd + ") >/dev/null 2>&1";
  return std::system(quiet.c_str()) == 0;
}

std::string tbf(const std::string& dev, const Args& a) {
  return "tc qdisc add dev " + dev + " root tbf rate " + a.rate + " burst 64kb latency 50ms";
}

constexpr int kNoNamespaces = 3;

// Inside the namespace (a child of main): the veth pair, else tbf on lo;
// both ranks run from here, rank 0's results go to `out_fd`.
int host_ranks(const Args& a, int out_fd, bool allow_veth, bool allow_lo) {
  if (!enter_namespaces()) return kNoNamespaces;
  const bool veth = allow_veth && sh("ip link add name zsq0 type veth peer name zsq1");
  std::string link;
  Net net;
  net.port_base = 29400;
  int ready[2], go[2];
  if (pipe(ready) != 0 || pipe(go) != 0) return 1;
  const pid_t peer = fork();
  if (peer == 0) {  // rank 1: a network namespace of its own when on veth
    char c = 'R';
    if (veth && unshare(CLONE_NEWNET) != 0) c = 'F';
    if (write(ready[1], &c, 1) != 1 || c == 'F') _exit(1);
    if (read(go[0], &c, 1) != 1 || c != 'G') _exit(1);
    if (veth && !sh("ip link set lo up && ip addr add 10.77.0.2/24 dev zsq1 && ip link set zsq1 up && " +
                    tbf("zsq1", a)))
      _exit(1);
    Net n = net;
    if (veth) n.addr[0] = "10.77.0.1", n.addr[1] = "10.77.0.2";
    Result r;
    run_all_modes(1, n, a, &r);
    _exit(0);
  }
  char c = 0;
  if (read(ready[0], &c, 1) != 1 || c != 'R') {
    waitpid(peer, nullptr, 0);
    return kNoNamespaces;
  }
  bool ok;
  if (veth) {
    ok = sh("ip link set zsq1 netns " + std::to_string(peer) + " && ip link set lo up && " +
            "ip addr add 10.77.0.1/24 dev zsq0 && ip link set zsq0 up && " + tbf("zsq0", a));
    net.addr[0] = "10.77.0.1", net.addr[1] = "10.77.0.2";
    link = "veth";
  } else {
    ok = allow_lo && sh("ip link set lo up && ip link set lo mtu 1500 && " + tbf("lo", a));
    link = "lo";
  }
  c = ok ? 'G' : 'X';
  if (write(go[1], &c, 1) != 1 || !ok) {
    waitpid(peer, nullptr, 0);
    return kNoNamespaces;
  }
  Result r;
  run_all_modes(0, net, a, &r);
  int st = 0;
  waitpid(peer, &st, 0);
  char name[8] = {};
  std::snprintf(name, sizeof name, "%s", link.c_str());
  if (write(out_fd, name, sizeof name) != sizeof name || write(out_fd, &r, sizeof r) != sizeof r) return 1;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

// Runs host_ranks in a child; true with the results when it worked.
bool run_in_namespaces(const Args& a, bool veth, bool lo, std::string* link, Result* out) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    _exit(host_ranks(a, fds[1], veth, lo));
  }
  close(fds[1]);
  char name[8] = {};
  bool ok = read(fds[0], name, sizeof name) == sizeof name && read(fds[0], out, sizeof *out) == sizeof *out;
  close(fds[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    if (WIFEXITED(st) && WEXITSTATUS(st) == kNoNamespaces) return false;
    std::fprintf(stderr, "bench_quant: a rank failed on the %s link\n", name[0] ? name : "namespaced");
    std::exit(1);
  }
  *link = name;
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--mib") a.mib = std::atoi(v.c_str());
    else if (k == "--iters") a.iters = std::atoi(v.c_str());
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--rate") a.rate = v;
    else if (k == "--link") a.link = v;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_quant [--mib M] [--iters I] [--dtype bf16|fp32] "
                   "[--rate 1gbit] [--link auto|veth|lo|loopback]\n", k.c_str());
      return 2;
    }
  }
  if (a.mib < 1 || a.iters < 1 || (a.dtype != "bf16" && a.dtype != "fp32") ||
      (a.link != "auto" && a.link != "veth" && a.link != "lo" && a.link != "loopback")) {
    std::fprintf(stderr, "bench_quant: --mib and --iters >= 1, --dtype bf16 or fp32, --link auto, veth, lo or loopback\n");
    return 2;
  }
  Result res;
  std::string link;
  bool done = false;
  if (a.link == "auto" || a.link == "veth") done = run_in_namespaces(a, true, a.link == "auto", &link, &res);
  if (!done && a.link == "lo") done = run_in_namespaces(a, false, true, &link, &res);
  if (!done) {
    if (a.link != "loopback")
      std::printf("bench_quant: network namespaces are not allowed here (unshare, ip or tc failed): "
                  "running on plain loopback, with no rate limit\n");
    link = "loopback";
    Net net;
    struct One {
      Result r;
    } one;
    int ports[kNumModes];
    for (int& p : ports) p = zs::bench::free_port();
    Net probe = net;  // its port chosen here, before the ranks part
    probe.port_base = zs::bench::free_port() + 1;
    done = zs::bench::fork_ranks_collect(2, &one, [&](int r, One* mine) {
      mine->r.link_gbit = probe_link(r, probe);
      // A fresh port per mode (each context owns its store).
      for (int k = 0; k < kNumModes; ++k) {
        Net n = net;
        n.port_base = ports[k] - k;
        run_mode(r, n, k, a, &mine->r);
      }
    });
    res = one.r;
    if (!done) {
      std::fprintf(stderr, "bench_quant: a rank failed on loopback\n");
      return 1;
    }
  }
  const char* how = link == "veth"  ? "two network namespaces joined by a veth pair, tbf on each end"
                    : link == "lo" ? "one network namespace, tbf on its loopback (both directions share it)"
                                   : "plain loopback, no rate limit";
  std::printf("one step's communication (gather every param, release, push + sync every gradient) of a "
              "%.0f MiB %s model on 2 ranks, %s link (%s%s; plain TCP measured %.2f Gbit/s), "
              "fastest of %d:\n",
              res.model_bytes / (1 << 20), a.dtype.c_str(), link.c_str(), how,
              link == "loopback" ? "" : (", rate " + a.rate).c_str(), res.link_gbit, a.iters);
  std::string json = "{\"bench\":\"quant\",\"link\":\"" + link + "\",\"rate\":\"" +
                     (link == "loopback" ? std::string("none") : a.rate) + "\",\"dtype\":\"" + a.dtype +
                     "\",\"model_mib\":" + std::to_string(static_cast<int>(res.model_bytes / (1 << 20))) +
                     ",\"tcp_gbit\":" + std::to_string(res.link_gbit) + ",\"modes\":[";
  char buf[512];
  for (int k = 0; k < kNumModes; ++k) {
    const double base = res.step_s[0];
    std::printf("  %-28s step %8.1f ms (gathers %8.1f, gradients %8.1f; median step %8.1f)  %5.2fx "
                "faster than unquantized\n",
                kModes[k].name, res.step_s[k] * 1e3, res.gather_s[k] * 1e3, res.reduce_s[k] * 1e3,
                res.median_s[k] * 1e3, base / res.step_s[k]);
    std::snprintf(buf, sizeof buf,
                  "%s{\"mode\":\"%s\",\"qwz_bits\":%d,\"qgz_bits\":%d,\"loco\":%s,\"step_ms\":%.1f,"
                  "\"gather_ms\":%.1f,\"reduce_ms\":%.1f,\"median_step_ms\":%.1f,\"speedup\":%.3f}",
                  k ? "," : "", kModes[k].name, kModes[k].qwz, kModes[k].qgz, kModes[k].loco ? "true" : "false",
                  res.step_s[k] * 1e3, res.gather_s[k] * 1e3, res.reduce_s[k] * 1e3, res.median_s[k] * 1e3,
                  base / res.step_s[k]);
    json += buf;
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
