// What collective identities cost: fetch + release of one small param, of a
// bucket of 8 params, and a 4-byte all-reduce, with identities on (the
// default) and off (ZS_COLLECTIVE_CHECK_MS=0), in the same run. Modes
// alternate over rounds, each with a fresh context, so drift hits both.
//
//   build/bin/bench_collective_identity [--ranks 2] [--rounds 6] [--ops 2000]
//
// Forks its own ranks over loopback. The last line is one JSON object.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/engine_check.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

struct Args {
  int ranks = 2;
  int rounds = 6;
  int ops = 2000;
};

using Clock = std::chrono::steady_clock;

// CPU seconds this process used (every thread): on a shared machine, wall
// time per small collective is mostly waiting for a core; CPU time is what
// the identities themselves add.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

using zs::bench::median;

// Microseconds per fetch + release of `params`.
double time_fetches(zs_context ctx, const std::vector<zs_param>& params, int ops) {
  const auto t0 = Clock::now();
  for (int i = 0; i < ops; ++i) {
    zs_gather g;
    CHECK(zs_fetch(&g, ctx, params.data(), params.size()));
    CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, params.data(), params.size()));
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / ops;
}

double time_allreduces(zs_group group, int ops) {
  float x = 1.0f;
  const auto t0 = Clock::now();
  for (int i = 0; i < ops; ++i) {
    zs_work w;
    CHECK(zs_allreduce(&w, group, &x, &x, 1, ZS_FLOAT32, ZS_SUM));
    CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
    CHECK(zs_work_destroy(w));
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / ops;
}

struct Round {
  double one, eight, allreduce, cpu_us;  // cpu_us: per op over all three
};

Round run_round(const Args& a, int rank, int port, bool identities) {
  setenv("ZS_COLLECTIVE_CHECK_MS", identities ? "500" : "0", 1);
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  std::vector<zs_param> params;
  for (int i = 0; i < 8; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".weight";
    const int64_t shape[2] = {16, 16};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = name.c_str();
    po.ndim = 2;
    po.shape = shape;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    params.push_back(p);
  }
  std::vector<int> ranks;
  for (int r = 0; r < a.ranks; ++r) ranks.push_back(r);
  zs_group group;
  CHECK(zs_group_create(&group, ctx, ranks.data(), a.ranks));
  const std::vector<zs_param> one(params.begin(), params.begin() + 1);
  time_fetches(ctx, one, a.ops / 10);  // warm-up
  Round r{};
  const double cpu0 = cpu_seconds();
  r.one = time_fetches(ctx, one, a.ops);
  r.eight = time_fetches(ctx, params, a.ops);
  r.allreduce = time_allreduces(group, a.ops);
  r.cpu_us = (cpu_seconds() - cpu0) * 1e6 / (3.0 * a.ops);
  CHECK(zs_group_destroy(group));
  for (auto p : params) CHECK(zs_param_destroy(p));
  CHECK(zs_context_destroy(ctx));
  return r;
}

void run_rank(const Args& a, int rank, const std::vector<int>& ports) {
  std::vector<double> on_one, on_eight, on_ar, off_one, off_eight, off_ar, on_cpu, off_cpu;
  for (int round = 0; round < a.rounds; ++round) {
    for (int mode = 0; mode < 2; ++mode) {
      const bool on = (round + mode) % 2 == 0;  // ABBA: neither mode always goes first
      const Round r = run_round(a, rank, ports[static_cast<size_t>(round * 2 + mode)], on);
      (on ? on_one : off_one).push_back(r.one);
      (on ? on_eight : off_eight).push_back(r.eight);
      (on ? on_ar : off_ar).push_back(r.allreduce);
      (on ? on_cpu : off_cpu).push_back(r.cpu_us);
    }
  }
  if (rank != 0) return;
  const double a1 = median(on_one), b1 = median(off_one);
  const double a8 = median(on_eight), b8 = median(off_eight);
  const double ar = median(on_ar), br = median(off_ar);
  const double ac = median(on_cpu), bc = median(off_cpu);
  std::printf("collective identities, %d ranks, %d rounds x %d ops, medians\n", a.ranks, a.rounds,
              a.ops);
  std::printf("  fetch+release of 1 param:   on %7.2f us  off %7.2f us  on/off %.3f\n", a1, b1,
              a1 / b1);
  std::printf("  fetch+release of 8 params:  on %7.2f us  off %7.2f us  on/off %.3f\n", a8, b8,
              a8 / b8);
  std::printf("  all-reduce of 1 float:      on %7.2f us  off %7.2f us  on/off %.3f\n", ar, br,
              ar / br);
  std::printf("  CPU time per op (rank 0):   on %7.2f us  off %7.2f us  on/off %.3f\n", ac, bc,
              ac / bc);
  std::printf(
      "{\"bench\":\"collective_identity\",\"ranks\":%d,\"fetch1_on_us\":%.3f,\"fetch1_off_us\":%.3f,"
      "\"fetch1_ratio\":%.4f,\"fetch8_on_us\":%.3f,\"fetch8_off_us\":%.3f,\"fetch8_ratio\":%.4f,"
      "\"allreduce_on_us\":%.3f,\"allreduce_off_us\":%.3f,\"allreduce_ratio\":%.4f,"
      "\"cpu_on_us\":%.3f,\"cpu_off_us\":%.3f,\"cpu_ratio\":%.4f,\"target_ratio\":1.02}\n",
      a.ranks, a1, b1, a1 / b1, a8, b8, a8 / b8, ar, br, ar / br, ac, bc, ac / bc);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--ranks") a.ranks = v;
    else if (k == "--rounds") a.rounds = v;
    else if (k == "--ops") a.ops = v;
    else {
      std::fprintf(stderr,
                   "unknown option %s\nusage: bench_collective_identity [--ranks N] [--rounds R] "
                   "[--ops K]\n",
                   k.c_str());
      return 2;
    }
  }
  if (a.ranks < 2 || a.rounds < 1 || a.ops < 10) {
    std::fprintf(stderr, "bench_collective_identity: --ranks >= 2, --rounds >= 1, --ops >= 10\n");
    return 2;
  }
  std::vector<int> ports;
  for (int i = 0; i < a.rounds * 2; ++i) ports.push_back(zs::bench::free_port());
  return zs::bench::fork_ranks(a.ranks, [&](int r) { run_rank(a, r, ports); }) ? 0 : 1;
}
