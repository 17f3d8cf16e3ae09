// What collective identities cost (issue 13: at most 2%). Every rank holds
// two contexts at once, one created with identities on (the default) and
// one with them off (ZS_COLLECTIVE_CHECK_MS=0, read when a context or group
// is created: a benchmarking switch, see the README), and runs the same
// workloads on both in the same run. Each rep runs a workload ABBA (a
// quarter of its ops per quarter), A alternating rep by rep, so drift and
// other load hit both sides alike. Per workload it prints each side's
// median time per op, the median (and quartiles) of the per-rep on/off
// ratios, and the CPU time per op (this process, every thread); then what
// the identity work itself costs on one thread (build, hash, record) next
// to the fastest collective, a bound that does not depend on the machine's
// noise. The last line is one JSON object.
//
//   build/bin/bench_collective_identity [--ranks 2] [--reps 60] [--ops 20] [--only small|big]
//                                       [--fresh 10] (reps per pair of fresh contexts)
//                                       [--same 1]   (both sides off: the harness's own bias)
//                                       [--switch shared-memory] (the sides differ in
//                                        ZS_SHARED_MEMORY instead, identities on in both:
//                                        shared-memory rings against Gloo's loopback TCP)
//
// Workloads: small collectives, where a per-call cost shows most (fetch +
// release of one 1 KiB param, of a bucket of 64 such params, an all-reduce
// of one float), `--ops` per side per rep; and big ones (fetch + release of
// an 8 MiB param, an all-reduce of 16 MiB), ops/10 (at least 2). Forks its
// own ranks over loopback. Benchmarks never pass or fail on time.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/engine_check.h"
#include "impl/comm/transport/collective_label.h"
#include "impl/comm/transport/collective_watch.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

struct Args {
  int ranks = 2;
  int reps = 60;
  int ops = 20;
  int fresh = 10;  // reps per pair of contexts
  bool same = false;  // --same 1: both sides off (an A/A run: the harness's own bias)
  bool rings = false;  // --switch shared-memory: the sides differ in ZS_SHARED_MEMORY
  int first = 0, last = 5;  // workloads [first, last): --only small (0..2) or big (3, 4)
};

using Clock = std::chrono::steady_clock;
using zs::bench::median;

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// One side: a context, its params and a world group.
struct Side {
  zs_context ctx = nullptr;
  zs_group world = nullptr;
  std::vector<zs_param> small;  // 64 params of 16x16 fp32 (1 KiB)
  zs_param big = nullptr;       // 2048x1024 fp32 (8 MiB)
  std::vector<float> big_buf;   // 16 MiB all-reduce buffer
};

Side make_side(const Args& a, int rank, int port, bool identities) {
  // Read where each communicator is made: this context's groups keep it.
  // `identities` names the side that is on, whichever switch it is.
  setenv("ZS_COLLECTIVE_CHECK_MS", identities || a.rings ? "500" : "0", 1);
  setenv("ZS_SHARED_MEMORY", identities || !a.rings ? "1" : "0", 1);
  Side s;
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  CHECK(zs_context_create(&s.ctx, &o));
  for (int i = 0; i < 64; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".weight";
    const int64_t shape[2] = {16, 16};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = name.c_str();
    po.ndim = 2;
    po.shape = shape;
    zs_param p;
    CHECK(zs_param_register(&p, s.ctx, &po));
    s.small.push_back(p);
  }
  const int64_t big_shape[2] = {2048, 1024};
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.name = "embed.weight";
  po.ndim = 2;
  po.shape = big_shape;
  CHECK(zs_param_register(&s.big, s.ctx, &po));
  CHECK(zs_context_group(&s.world, s.ctx, ZS_GROUP_WORLD));
  s.big_buf.assign(4u << 20, 1.0f);
  return s;
}

void destroy_side(Side& s) {
  CHECK(zs_group_destroy(s.world));
  for (auto p : s.small) CHECK(zs_param_destroy(p));
  CHECK(zs_param_destroy(s.big));
  CHECK(zs_context_destroy(s.ctx));
}

void fetch_release(zs_context ctx, const zs_param* params, size_t n, int ops) {
  for (int i = 0; i < ops; ++i) {
    zs_gather g;
    CHECK(zs_fetch(&g, ctx, params, n));
    CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, params, n));
  }
}

void allreduce(zs_group group, float* x, size_t count, int ops) {
  for (int i = 0; i < ops; ++i) {
    zs_work w;
    CHECK(zs_allreduce(&w, group, x, x, count, ZS_FLOAT32, ZS_SUM));
    CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
    CHECK(zs_work_destroy(w));
  }
}

constexpr int kWorkloads = 5;
const char* const kNames[kWorkloads] = {
    "fetch+release 1 x 1 KiB param", "fetch+release 64 x 1 KiB params",
    "all-reduce of 1 float", "fetch+release 1 x 8 MiB param", "all-reduce of 16 MiB"};
const char* const kKeys[kWorkloads] = {"fetch1_small", "fetch64_small", "allreduce_small",
                                       "fetch_big", "allreduce_big"};

int ops_of(const Args& a, int w) { return w >= 3 ? std::max(2, a.ops / 10) : a.ops; }

void run_workload(Side& s, int w, int ops) {
  float one = 1.0f;
  switch (w) {
    case 0: fetch_release(s.ctx, s.small.data(), 1, ops); break;
    case 1: fetch_release(s.ctx, s.small.data(), s.small.size(), ops); break;
    case 2: allreduce(s.world, &one, 1, ops); break;
    case 3: fetch_release(s.ctx, &s.big, 1, ops); break;
    default:
      // Sums of ones stay finite over any number of reps at 2^k ranks.
      allreduce(s.world, s.big_buf.data(), s.big_buf.size(), ops);
      s.big_buf.assign(s.big_buf.size(), 1.0f);
  }
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

struct Series {
  std::vector<double> on_us, off_us, ratio, on_cpu, off_cpu;
};

// The identity work of one collective on one thread, without any transport:
// what make_identity builds and hashes, and what the watch records, for a
// coalesced gather of `segments` segments under a label as long as the
// engine writes for it. Nanoseconds per collective.
double identity_ns(size_t segments, size_t label_bytes, int iters) {
  zs::CollectiveWatch watch("world", 0, 2, nullptr, std::chrono::milliseconds(500));
  const std::string label(label_bytes, 'x');
  const zs::CollectiveLabelScope scope(label);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    uint64_t sizes = 0xcbf29ce484222325ull;
    for (size_t k = 0; k < segments; ++k) sizes = (sizes ^ 1024) * 0x100000001b3ull;
    std::string detail = std::to_string(segments) + " segments, " +
                         std::to_string(segments * 1024) + " bytes per rank";
    zs::CollectiveIdentity id =
        zs::make_identity(static_cast<uint64_t>(i) + 1, "coalesced all-gather", std::move(detail), sizes);
    watch.begin(std::move(id));
    watch.end(true);
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / iters;
}

// Both sides' contexts are made afresh every `--fresh` reps, in alternating
// order: a context instance can run a few percent slower than another for
// reasons of its own (an A/A run, --same 1, shows it), which this spreads
// over both sides.
void make_pair(const Args& a, int rank, const std::vector<int>& ports, int pair, Side* on,
               Side* off) {
  const int p_on = ports[static_cast<size_t>(2 * pair)], p_off = ports[static_cast<size_t>(2 * pair + 1)];
  if (pair % 2 == 0) {
    *on = make_side(a, rank, p_on, !a.same);
    *off = make_side(a, rank, p_off, false);
  } else {
    *off = make_side(a, rank, p_off, false);
    *on = make_side(a, rank, p_on, !a.same);
  }
  for (int w = a.first; w < a.last; ++w) {  // warm-up: first-use allocations, connections
    run_workload(*on, w, 3);
    run_workload(*off, w, 3);
  }
}

int pairs_needed(const Args& a) { return (a.reps + a.fresh - 1) / a.fresh; }

void run_rank(const Args& a, int rank, const std::vector<int>& ports) {
  Side on, off;
  Series series[kWorkloads];
  for (int rep = 0; rep < a.reps; ++rep) {
    if (rep % a.fresh == 0) {
      if (rep > 0) {
        destroy_side(on);
        destroy_side(off);
      }
      make_pair(a, rank, ports, rep / a.fresh, &on, &off);
    }
    for (int w = a.first; w < a.last; ++w) {
      // ABBA within the rep (each quarter ops/2), A alternating rep by rep:
      // drift within a rep cancels, and neither side always goes first.
      const int half = std::max(1, ops_of(a, w) / 2);
      double us[2] = {0, 0}, cpu[2] = {0, 0};
      for (int k = 0; k < 4; ++k) {
        const bool is_on = ((rep + w) % 2 == 0) == (k == 0 || k == 3);
        const double c0 = cpu_seconds();
        const auto t0 = Clock::now();
        run_workload(is_on ? on : off, w, half);
        us[is_on ? 0 : 1] += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        cpu[is_on ? 0 : 1] += (cpu_seconds() - c0) * 1e6;
      }
      Series& s = series[w];
      const double n = 2.0 * half;
      s.on_us.push_back(us[0] / n);
      s.off_us.push_back(us[1] / n);
      s.ratio.push_back(us[0] / us[1]);
      s.on_cpu.push_back(cpu[0] / n);
      s.off_cpu.push_back(cpu[1] / n);
    }
  }
  destroy_side(on);
  destroy_side(off);
  if (rank != 0) return;

  std::printf("%s %s, %d ranks, %d reps (sides alternate rep by rep; fresh contexts every %d reps)\n",
              a.rings ? "shared-memory rings (ZS_SHARED_MEMORY)" : "collective identities",
              a.same ? "off vs off (--same 1: an A/A run; 'on' names the side that is otherwise on)"
                     : "on vs off",
              a.ranks, a.reps, a.fresh);
  std::printf("  %-34s %6s %11s %11s %14s %12s %12s %9s\n", "workload", "ops", "on us/op",
              "off us/op", "median ratio", "on CPU us", "off CPU us", "CPU ratio");
  std::string json = "{\"bench\":\"collective_identity\",\"switch\":\"" +
                     std::string(a.rings ? "shared-memory" : "identities") + "\",\"same\":" +
                     std::string(a.same ? "true" : "false") + ",\"ranks\":" + std::to_string(a.ranks) +
                     ",\"reps\":" + std::to_string(a.reps);
  char buf[512];
  for (int w = a.first; w < a.last; ++w) {
    const Series& s = series[w];
    const double on_us = median(s.on_us), off_us = median(s.off_us), ratio = median(s.ratio);
    const double on_cpu = median(s.on_cpu), off_cpu = median(s.off_cpu);
    std::printf("  %-34s %6d %11.1f %11.1f %14.4f %12.1f %12.1f %9.4f\n", kNames[w],
                2 * std::max(1, ops_of(a, w) / 2),
                on_us, off_us, ratio, on_cpu, off_cpu, on_cpu / off_cpu);
    std::printf("    per-rep on/off: quartiles %.3f %.3f %.3f; each:", quantile(s.ratio, 0.25),
                ratio, quantile(s.ratio, 0.75));
    for (double r : s.ratio) std::printf(" %.2f", r);
    std::printf("\n");
    std::snprintf(buf, sizeof buf,
                  ",\"%s\":{\"ops\":%d,\"on_us\":%.3f,\"off_us\":%.3f,\"ratio\":%.4f,"
                  "\"ratio_q1\":%.4f,\"ratio_q3\":%.4f,"
                  "\"on_cpu_us\":%.3f,\"off_cpu_us\":%.3f,\"cpu_ratio\":%.4f}",
                  kKeys[w], 2 * std::max(1, ops_of(a, w) / 2), on_us, off_us, ratio,
                  quantile(s.ratio, 0.25), quantile(s.ratio, 0.75), on_cpu, off_cpu,
                  on_cpu / off_cpu);
    json += buf;
  }
  // The identity work alone, against the fastest small collective's time.
  const double id1 = identity_ns(1, 40, 200000);
  const double id64 = identity_ns(64, 64 * 36, 50000);
  double fastest_off_us = 1e300;
  for (int w = a.first; w < a.last; ++w)
    fastest_off_us = std::min(fastest_off_us, median(series[w].off_us));
  std::printf("  identity work on one thread: %.0f ns per collective (1 segment, 40-byte label), "
              "%.0f ns (64 segments, 2.3 KB label)\n",
              id1, id64);
  std::printf("  = %.3f%% / %.3f%% of the fastest workload here (%.1f us per op, %s off)\n",
              100.0 * id1 / 1000.0 / fastest_off_us, 100.0 * id64 / 1000.0 / fastest_off_us,
              fastest_off_us, a.rings ? "rings" : "identities");
  std::snprintf(buf, sizeof buf,
                ",\"identity_ns_1seg\":%.1f,\"identity_ns_64seg\":%.1f,\"fastest_off_us\":%.3f,"
                "\"target_ratio\":1.02}",
                id1, id64, fastest_off_us);
  json += buf;
  std::printf("%s\n", json.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--only") {
      const std::string which = argv[i + 1];
      if (which != "small" && which != "big") {
        std::fprintf(stderr, "bench_collective_identity: --only small or --only big\n");
        return 2;
      }
      a.first = which == "small" ? 0 : 3;
      a.last = which == "small" ? 3 : 5;
    } else if (k == "--switch") {
      const std::string which = argv[i + 1];
      if (which != "identities" && which != "shared-memory") {
        std::fprintf(stderr, "bench_collective_identity: --switch identities or --switch shared-memory\n");
        return 2;
      }
      a.rings = which == "shared-memory";
    } else if (k == "--same") a.same = v != 0;
    else if (k == "--fresh") a.fresh = v;
    else if (k == "--ranks") a.ranks = v;
    else if (k == "--reps") a.reps = v;
    else if (k == "--ops") a.ops = v;
    else {
      std::fprintf(stderr,
                   "unknown option %s\nusage: bench_collective_identity [--ranks N] [--reps R] "
                   "[--ops K] [--only small|big] [--fresh F] [--same 1] [--switch identities|shared-memory]\n",
                   k.c_str());
      return 2;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "bench_collective_identity: option %s has no value\n", argv[argc - 1]);
    return 2;
  }
  if (a.ranks < 2 || a.reps < 1 || a.ops < 2 || a.fresh < 1) {
    std::fprintf(stderr, "bench_collective_identity: --ranks >= 2, --reps >= 1, --ops >= 2, --fresh >= 1\n");
    return 2;
  }
  std::vector<int> ports;
  for (int i = 0; i < 2 * pairs_needed(a); ++i) ports.push_back(zs::bench::free_port());
  return zs::bench::fork_ranks(a.ranks, [&](int r) { run_rank(a, r, ports); }) ? 0 : 1;
}
