// ZeRO++ on a slow link: the time of one training step (the forward's
// gather of every param, the backward's, push + sync of every gradient, and
// an SGD step) on 2 ranks joined by a rate-limited link, unquantized against
// qwZ, qgZ, both, and both with LoCo. Prints figures and ratios, never pass/fail on time:
// each mode's fastest of --iters steps (other processes on a shared
// machine only add time; the median is printed beside it) and, first, the
// link's rate as measured by 32 MiB of plain TCP.
//
//   build/bin/bench_quant [--mib 256 (model size in its dtype)] [--iters 3]
//                         [--dtype bf16|fp32] [--rate 1gbit] [--link auto|veth|lo|loopback]
//                         [--topology 1x2|2x2]
//
// Each "node" is a network namespace, which the engine takes for a host of
// its own (comm/transport/host_id.h): ranks of one node read each other's
// memory (ZS_CROSS_MEMORY) and do not quantize what they send each other;
// ranks of different nodes talk over the link and quantize. On the lo link,
// where both ranks share one namespace, each rank is told it is a host of
// its own (ZS_HOST_ID), so the same holds. The link's own byte counters (IF's rx/tx
// bytes in /proc/net/dev, read in rank 0's namespace: /sys/class/net shows
// the host's namespace) around the timed iterations are printed next to the
// engine's (zs_context_fetch_stats, rank 0), with a WARNING where the link
// carried far less than the engine sent (the link was bypassed).
//
// --topology 2x2: 2 nodes (network namespaces joined by the rate-limited
// veth) x 2 ranks each (local_world_size 2; ranks of a node reach each other
// through memory, or their namespace's unlimited loopback). Modes: none,
// qwZ, qgZ (two hops: within the node, then across), qwZ+qgZ, +LoCo, and
// hpZ (zero_hpz_partition_size 2: secondary shards within a node, so the
// backward's gathers stay on the node) alone and with qwZ+qgZ. Each
// quantized mode runs twice: as the engine chooses (quantize only what
// crosses hosts: qgZ's hop within the node goes fp32) and with
// ZS_QUANTIZE_WITHIN_HOST=1 (quantize every pair).
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
  std::string topology = "1x2";
};

struct Mode {
  const char* name;
  int qwz, qgz;  // bits, 0: off
  bool loco;
  int hpz;  // zero_hpz_partition_size (2x2 only)
  bool everywhere;  // ZS_QUANTIZE_WITHIN_HOST=1: quantize every pair (2x2 only)
};
const Mode kModes[] = {
    {"unquantized", 0, 0, false, 1, false},
    {"qwZ int8", 8, 0, false, 1, false},
    {"qgZ int4", 0, 4, false, 1, false},
    {"qwZ int8 + qgZ int4", 8, 4, false, 1, false},
    {"qwZ int8 + qgZ int4 + LoCo", 8, 4, true, 1, false},
    // 2x2 only: on 1x2 every pair crosses hosts, so "everywhere" is the same.
    {"qgZ int4, every pair", 0, 4, false, 1, true},
    {"qwZ int8 + qgZ int4, every pair", 8, 4, false, 1, true},
    {"hpZ 2", 0, 0, false, 2, false},
    {"hpZ 2 + qwZ int8 + qgZ int4", 8, 4, false, 2, false},
    {"hpZ 2 + qwZ + qgZ, every pair", 8, 4, false, 2, true},
};
constexpr int kNumModes = sizeof(kModes) / sizeof(kModes[0]);
constexpr int kModesOn1x2 = 5;

struct Result {
  double link_gbit = 0;  // measured by probe_link (0: not measured)
  double step_s[kNumModes] = {};  // the fastest of the iterations (run_mode)
  double gather_s[kNumModes] = {};
  double reduce_s[kNumModes] = {};
  double median_s[kNumModes] = {};
  double model_bytes = 0;
  int num_modes = kModesOn1x2;
  // Over the timed iterations, rank 0: its link interface's counters (its
  // namespace's) and the engine's bytes sent / received (all kinds).
  double link_tx[kNumModes] = {}, link_rx[kNumModes] = {};
  double eng_sent[kNumModes] = {}, eng_recv[kNumModes] = {};
};

// Where rank r listens and how to reach rank 0 (the store).
struct Net {
  std::string addr[4] = {"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1"};
  int port_base = 0;  // mode k's store listens on port_base + k
  int world = 2, local = 1;  // ranks, ranks per node
  bool host_per_node = false;  // nodes share a namespace: ZS_HOST_ID tells them apart
  std::string ifname;  // rank's link interface whose counters are read ("": none)
};

// The interface's counter in this process's network namespace: from
// /proc/net/dev, which follows the reader's namespace (/sys/class/net
// shows the namespace /sys was mounted in, the host's, so
// its statistics read nothing for zsq0 inside ours).
double read_counter(const std::string& ifname, const char* which) {
  if (ifname.empty()) return 0;
  FILE* f = std::fopen("/proc/net/dev", "r");
  if (!f) return 0;
  char line[512];
  double v = 0;
  while (std::fgets(line, sizeof line, f)) {
    char* colon = std::strchr(line, ':');
    if (!colon) continue;
    *colon = 0;
    const char* name = line;
    while (*name == ' ') ++name;
    if (ifname != name) continue;
    unsigned long long c[16] = {};
    if (std::sscanf(colon + 1, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &c[0], &c[1], &c[2], &c[3], &c[4],
                    &c[5], &c[6], &c[7], &c[8]) == 9)
      v = static_cast<double>(std::strcmp(which, "rx_bytes") == 0 ? c[0] : c[8]);  // rx bytes, tx bytes
  }
  std::fclose(f);
  return v;
}

void engine_bytes(zs_context ctx, double* sent, double* recv) {
  zs_fetch_stats st = ZS_FETCH_STATS_INIT;
  CHECK(zs_context_fetch_stats(ctx, &st));
  *sent = static_cast<double>(st.gather_bytes_sent + st.quantized_gather_bytes_sent + st.reduce_scatter_bytes_sent +
                              st.quantized_reduce_bytes_sent + st.allreduce_bytes_sent + st.other_bytes_sent);
  *recv = static_cast<double>(st.gather_bytes_received + st.quantized_gather_bytes_received +
                              st.reduce_scatter_bytes_received + st.quantized_reduce_bytes_received +
                              st.allreduce_bytes_received + st.other_bytes_received);
}

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
      R"(, "zeropp_loco_param": )" + loco + R"(, "zero_hpz_partition_size": )" + std::to_string(m.hpz) + "}}";
  setenv("ZS_SOCKET_HOST", net.addr[rank].c_str(), 1);
  if (m.everywhere)
    setenv("ZS_QUANTIZE_WITHIN_HOST", "1", 1);
  else
    unsetenv("ZS_QUANTIZE_WITHIN_HOST");
  if (net.host_per_node) setenv("ZS_HOST_ID", ("bench-node-" + std::to_string(rank / net.local)).c_str(), 1);
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = net.world;
  o.store_host = net.addr[0].c_str();
  o.store_port = net.port_base + k;
  o.local_rank = rank % net.local;  // 1x2: a node each, the link is what joins them
  o.local_world_size = net.local;
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
  // SGD: the step is cheap, and it changes the shards, so the next step's
  // forward gathers from the primary shards again (under hpZ too).
  zs_optimizer opt;
  CHECK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 1e-3;
  CHECK(zs_optimizer_add_group(opt, ps.data(), ps.size(), &hp, nullptr));
  double tg = 0, tr = 0;
  auto gather_all = [&] {
    zs_gather g;
    CHECK(zs_fetch(&g, ctx, ps.data(), ps.size()));
    CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, ps.data(), ps.size()));
  };
  auto once = [&] {
    const double t0 = now_s();
    gather_all();  // forward
    gather_all();  // backward (hpZ: from the secondary shards)
    const double t1 = now_s();
    for (size_t i = 0; i < ps.size(); ++i)
      CHECK(zs_grad_push(ps[i], grads[i].data(), dtype, grads[i].size()));
    CHECK(zs_grad_sync(ctx));
    const double t2 = now_s();
    CHECK(zs_optimizer_step(opt, nullptr));
    tg = t1 - t0;
    tr = t2 - t1;
    return now_s() - t0;
  };
  once();  // warm-up: first touch of the buffers
  std::vector<double> t, g, r;
  double s0, r0, s1, r1;
  engine_bytes(ctx, &s0, &r0);
  const double tx0 = read_counter(net.ifname, "tx_bytes"), rx0 = read_counter(net.ifname, "rx_bytes");
  for (int it = 0; it < a.iters; ++it) {
    t.push_back(once());
    g.push_back(tg);
    r.push_back(tr);
  }
  // The fastest iteration and its halves: on a shared machine other
  // processes only ever add time. The median is kept for the record.
  out->link_tx[k] = read_counter(net.ifname, "tx_bytes") - tx0;
  out->link_rx[k] = read_counter(net.ifname, "rx_bytes") - rx0;
  engine_bytes(ctx, &s1, &r1);
  out->eng_sent[k] = s1 - s0;
  out->eng_recv[k] = r1 - r0;
  const size_t best = static_cast<size_t>(std::min_element(t.begin(), t.end()) - t.begin());
  out->step_s[k] = t[best];
  out->gather_s[k] = g[best];
  out->reduce_s[k] = r[best];
  out->median_s[k] = median(t);
  CHECK(zs_optimizer_destroy(opt));
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

// The probe runs between rank 0 and the first rank of the other node.
void run_all_modes(int rank, const Net& net, const Args& a, Result* out) {
  if (rank == 0 || rank == net.world - net.local) out->link_gbit = probe_link(rank == 0 ? 0 : 1, net);
  out->num_modes = net.world == 4 ? kNumModes : kModesOn1x2;
  for (int k = 0; k < out->num_modes; ++k) run_mode(rank, net, k, a, out);
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
  const bool two_nodes = a.topology == "2x2";
  const bool veth = allow_veth && sh("ip link add name zsq0 type veth peer name zsq1");
  std::string link;
  Net net;
  net.port_base = 29400;
  if (two_nodes) net.world = 4, net.local = 2;
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
    if (veth && two_nodes)
      n.addr[0] = n.addr[1] = "10.77.0.1", n.addr[2] = n.addr[3] = "10.77.0.2";
    else if (veth)
      n.addr[0] = "10.77.0.1", n.addr[1] = "10.77.0.2";
    n.ifname = veth ? "zsq1" : "lo";
    int me = 1;
    pid_t sib = -1;
    if (two_nodes) {  // ranks 2 (here) and 3 (a child) on this node
      me = 2;
      sib = fork();
      if (sib == 0) me = 3;
    }
    Result r;
    run_all_modes(me, n, a, &r);
    if (me == 3) _exit(0);
    int sst = 0;
    if (sib > 0 && (waitpid(sib, &sst, 0) != sib || !WIFEXITED(sst) || WEXITSTATUS(sst) != 0)) _exit(1);
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
    if (two_nodes)
      net.addr[0] = net.addr[1] = "10.77.0.1", net.addr[2] = net.addr[3] = "10.77.0.2";
    else
      net.addr[0] = "10.77.0.1", net.addr[1] = "10.77.0.2";
    net.ifname = "zsq0";
    link = "veth";
  } else {
    ok = allow_lo && !two_nodes && sh("ip link set lo up && ip link set lo mtu 1500 && " + tbf("lo", a));
    net.ifname = "lo";
    net.host_per_node = true;  // one namespace: each rank a host of its own
    link = "lo";
  }
  c = ok ? 'G' : 'X';
  if (write(go[1], &c, 1) != 1 || !ok) {
    waitpid(peer, nullptr, 0);
    return kNoNamespaces;
  }
  pid_t sib = -1;
  if (two_nodes) {  // rank 1: node 0's second rank, same namespace
    sib = fork();
    if (sib == 0) {
      Result r1;
      run_all_modes(1, net, a, &r1);
      _exit(0);
    }
  }
  Result r;
  run_all_modes(0, net, a, &r);
  int st = 0;
  waitpid(peer, &st, 0);
  if (sib > 0) {
    int sst = 0;
    if (waitpid(sib, &sst, 0) != sib || !WIFEXITED(sst) || WEXITSTATUS(sst) != 0) st = 1 << 8;
  }
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
    else if (k == "--topology") a.topology = v;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_quant [--mib M] [--iters I] [--dtype bf16|fp32] "
                   "[--rate 1gbit] [--link auto|veth|lo|loopback] [--topology 1x2|2x2]\n", k.c_str());
      return 2;
    }
  }
  if (a.mib < 1 || a.iters < 1 || (a.dtype != "bf16" && a.dtype != "fp32") ||
      (a.link != "auto" && a.link != "veth" && a.link != "lo" && a.link != "loopback")) {
    std::fprintf(stderr, "bench_quant: --mib and --iters >= 1, --dtype bf16 or fp32, --link auto, veth, lo or loopback\n");
    return 2;
  }
  if (a.topology != "1x2" && a.topology != "2x2") {
    std::fprintf(stderr, "bench_quant: --topology 1x2 or 2x2\n");
    return 2;
  }
  Result res;
  std::string link;
  bool done = false;
  if (a.topology == "2x2") {
    if (!run_in_namespaces(a, true, false, &link, &res)) {
      std::fprintf(stderr, "bench_quant: --topology 2x2 needs network namespaces and a veth pair (unshare, ip, tc)\n");
      return 1;
    }
    done = true;
  }
  if (a.link == "auto" || a.link == "veth") done = run_in_namespaces(a, true, a.link == "auto", &link, &res);
  if (!done && a.link == "lo") done = run_in_namespaces(a, false, true, &link, &res);
  if (!done) {
    if (a.link != "loopback")
      std::printf("bench_quant: network namespaces are not allowed here (unshare, ip or tc failed): "
                  "running on plain loopback, with no rate limit\n");
    link = "loopback";
    Net net;
    net.host_per_node = true;  // so that quantization acts between the two
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
      for (int k = 0; k < kModesOn1x2; ++k) {
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
  const bool two = a.topology == "2x2";
  const char* how = two ? "2 nodes (network namespaces) joined by a veth pair, tbf on each end, 2 ranks per node on "
                          "its loopback"
                    : link == "veth" ? "two network namespaces joined by a veth pair, tbf on each end"
                    : link == "lo"   ? "one network namespace, tbf on its loopback (both directions share it)"
                                     : "plain loopback, no rate limit";
  const bool counted = link != "loopback";
  const char* ifname = link == "veth" ? "zsq0" : link == "lo" ? "lo" : "";
  std::printf("one step (the forward's and the backward's gather of every param, push + sync of every gradient, "
              "an SGD step) of a "
              "%.0f MiB %s model on %d ranks (topology %s), %s link (%s%s; plain TCP measured %.2f Gbit/s), "
              "fastest of %d:\n",
              res.model_bytes / (1 << 20), a.dtype.c_str(), two ? 4 : 2, a.topology.c_str(), link.c_str(), how,
              link == "loopback" ? "" : (", rate " + a.rate).c_str(), res.link_gbit, a.iters);
  std::printf("hosts as the engine sees them: %s; ranks of one node read each other's memory, and do not "
              "quantize what they send each other unless the mode says every pair\n",
              link == "veth" ? "a node per network namespace (boot id + namespace)"
                             : "a host per rank (ZS_HOST_ID: the ranks share a namespace)");
  if (counted)
    std::printf("bytes over the %d timed iterations, rank 0: link %s tx/rx (its namespace's counters) against the "
                "engine's sent/received (zs_context_fetch_stats, all kinds)%s\n",
                a.iters, ifname,
                two ? "; on 2x2 the engine's figure counts both hops, zsq0 only node 0's inter-node bytes" : "");
  std::string json = "{\"bench\":\"quant\",\"link\":\"" + link + "\",\"rate\":\"" +
                     (link == "loopback" ? std::string("none") : a.rate) + "\",\"dtype\":\"" + a.dtype +
                     "\",\"model_mib\":" + std::to_string(static_cast<int>(res.model_bytes / (1 << 20))) +
                     ",\"tcp_gbit\":" + std::to_string(res.link_gbit) + ",\"topology\":\"" + a.topology +
                     "\",\"hosts\":\"" + (link == "veth" ? "namespaces" : "ZS_HOST_ID") + "\",\"link_if\":\"" + ifname +
                     "\",\"iters\":" + std::to_string(a.iters) + ",\"modes\":[";
  char buf[1024];
  int bypassed = 0;
  for (int k = 0; k < res.num_modes; ++k) {
    const double base = res.step_s[0];
    std::printf("  %-32s step %8.1f ms (gathers %8.1f, gradients %8.1f; median step %8.1f)  %5.2fx "
                "faster than unquantized\n",
                kModes[k].name, res.step_s[k] * 1e3, res.gather_s[k] * 1e3, res.reduce_s[k] * 1e3,
                res.median_s[k] * 1e3, base / res.step_s[k]);
    if (counted) {
      const double mib = 1 << 20;
      std::printf("  %-32s   link %s tx %9.1f MiB rx %9.1f MiB | engine sent %9.1f MiB received %9.1f MiB | "
                  "link tx / engine sent %.3f\n",
                  "", ifname, res.link_tx[k] / mib, res.link_rx[k] / mib, res.eng_sent[k] / mib,
                  res.eng_recv[k] / mib, res.eng_sent[k] > 0 ? res.link_tx[k] / res.eng_sent[k] : 0.0);
      // 1x2: every byte rank 0 sends crosses its link (>= 1 with headers).
      // 2x2: about half of them do (the inter-node hop), less under hpZ.
      const double floor = two ? 0.1 : 0.5;
      if (res.eng_sent[k] > (1 << 20) && res.link_tx[k] < floor * res.eng_sent[k]) {
        std::printf("  WARNING: %s: link %s carried %.1f MiB, far below the engine's %.1f MiB sent: the link "
                    "was bypassed\n",
                    kModes[k].name, ifname, res.link_tx[k] / mib, res.eng_sent[k] / mib);
        ++bypassed;
      }
    }
    std::snprintf(buf, sizeof buf,
                  "%s{\"mode\":\"%s\",\"qwz_bits\":%d,\"qgz_bits\":%d,\"loco\":%s,\"hpz\":%d,"
                  "\"every_pair\":%s,\"step_ms\":%.1f,"
                  "\"gather_ms\":%.1f,\"reduce_ms\":%.1f,\"median_step_ms\":%.1f,\"speedup\":%.3f,"
                  "\"link_tx_bytes\":%.0f,\"link_rx_bytes\":%.0f,\"engine_sent_bytes\":%.0f,"
                  "\"engine_received_bytes\":%.0f}",
                  k ? "," : "", kModes[k].name, kModes[k].qwz, kModes[k].qgz, kModes[k].loco ? "true" : "false",
                  kModes[k].hpz, kModes[k].everywhere ? "true" : "false", res.step_s[k] * 1e3, res.gather_s[k] * 1e3, res.reduce_s[k] * 1e3,
                  res.median_s[k] * 1e3, base / res.step_s[k], res.link_tx[k], res.link_rx[k], res.eng_sent[k],
                  res.eng_recv[k]);
    json += buf;
  }
  json += "],\"bypassed_modes\":" + std::to_string(bypassed);

  json += "}";
  std::printf("%s\n", json.c_str());
  return 0;
}
