// ZeRO++ qgZ benchmark: bytes each rank receives per gradient reduction,
// quantized (int8, int4; all-to-all of codes and scales) against the fp32
// ring reduce-scatter, and the time of push + sync of the same ~32 MiB of
// fp32 gradients on 2 and 4 loopback ranks (same run, same gradients).
// Prints figures and ratios, never pass/fail on time.
//
//   build/bin/bench_qgz [--ranks N (default: 2 then 4)] [--mib 32] [--iters 5]
//                       [--local L (ranks per "node", default: all; L < N
//                        takes qgZ's two hops where N is whole nodes)]
//
// Forks its own ranks over loopback. All gradients go into one bucket (the
// config's reduce_bucket_size is set to hold them), so the wire bytes are
// exact from the layout: the ring receives G - 1 blocks of fp32, the
// all-to-all G - 1 packets (two hops: (L - 1) * nodes within the node,
// then nodes - 1). With nodes of L ranks, also the bytes that enter each
// node from the others: the ring's one link into the node carries G - 1
// blocks; the single all-to-all L * (G - L) packets; the two hops
// L * (nodes - 1). The last line is one JSON object.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/engine_check.h"
#include "impl/comm/algo/quantized_reduce.h"
#include "kernels/quant.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

struct Args {
  std::vector<int> worlds = {2, 4};
  int mib = 32;
  int iters = 5;
  int local = 0;  // 0: every rank on one node
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using zs::bench::median;

const int kBits[] = {0, 8, 4};  // 0: the fp32 reduce-scatter
constexpr int kNumModes = 3;

struct Result {
  double seconds = 0;     // median push + sync
  double recv_bytes = 0;  // per rank per reduction, on the wire
  double cross_bytes = 0;  // into each node from the others
  double grad_bytes = 0;  // the full fp32 gradients
};

Result run_mode(int rank, int world, int port, int bits, const Args& a) {
  const size_t want = static_cast<size_t>(a.mib) << 20;
  const std::string cfg = R"({"zero_optimization": {"reduce_bucket_size": )" +
                          std::to_string(want / 4 * 2) + R"(, "zero_quantized_gradients": )" +
                          (bits ? "true" : "false") + R"(, "zero_quantized_gradients_bits": )" +
                          std::to_string(bits ? bits : 4) + "}}";
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  const int local = a.local > 0 ? a.local : world;
  o.local_rank = rank % local;
  o.local_world_size = local;
  o.config_json = cfg.c_str();
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  std::vector<zs_param> ps;
  std::vector<std::vector<float>> grads;
  Result r;
  uint64_t used = 0;  // elements per block of the one bucket
  for (int i = 0; r.grad_bytes < static_cast<double>(want); ++i) {
    const int64_t shape[2] = {(i % 4 == 0) ? 1 : 1024 + (i % 3), 1024};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(i);
    po.name = name.c_str();
    po.dtype = ZS_FLOAT32;
    po.ndim = 2;
    po.shape = shape;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    ps.push_back(p);
    zs_param_info info = ZS_PARAM_INFO_INIT;
    CHECK(zs_param_get_info(p, &info));
    used += info.shard_numel;
    r.grad_bytes += static_cast<double>(info.numel * 4);
    std::vector<float> g(static_cast<size_t>(info.numel));
    for (size_t k = 0; k < g.size(); ++k)
      g[k] = static_cast<float>((k * 2654435761u + static_cast<size_t>(rank) * 97) % 2001) * 1e-5f - 0.01f;
    grads.push_back(std::move(g));
  }
  const double unit =
      bits ? static_cast<double>(zs::quantized_block_bytes(used, {bits, zs::kernels::kQuantDefaultBlock}))
           : static_cast<double>(used * 4);
  const int nodes = world / local;
  const bool two_hops = bits && local > 1 && local < world && world % local == 0;
  if (two_hops) {
    r.recv_bytes = unit * ((local - 1) * nodes + (nodes - 1));
    r.cross_bytes = unit * local * (nodes - 1);
  } else {
    r.recv_bytes = unit * (world - 1);
    r.cross_bytes = local >= world ? 0 : bits ? unit * local * (world - local) : unit * (world - 1);
  }
  auto once = [&] {
    const double t0 = now_s();
    for (size_t i = 0; i < ps.size(); ++i)
      CHECK(zs_grad_push(ps[i], grads[i].data(), ZS_FLOAT32, grads[i].size() * 4));
    CHECK(zs_grad_sync(ctx));
    return now_s() - t0;
  };
  once();  // warm-up: first touch of the buffers
  std::vector<double> t;
  for (int it = 0; it < a.iters; ++it) t.push_back(once());
  r.seconds = median(t);
  for (auto p : ps) CHECK(zs_param_destroy(p));
  CHECK(zs_context_destroy(ctx));
  return r;
}

// Every mode on `world` forked ranks; rank 0's results come back by pipe.
bool run_world(int world, const Args& a, Result (&out)[kNumModes]) {
  int ports[kNumModes];
  for (int& p : ports) p = zs::bench::free_port();
  struct All {
    Result res[kNumModes];
  } all;
  const bool ok = zs::bench::fork_ranks_collect(world, &all, [&](int r, All* mine) {
    for (int k = 0; k < kNumModes; ++k) mine->res[k] = run_mode(r, world, ports[k], kBits[k], a);
  });
  std::copy(std::begin(all.res), std::end(all.res), out);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--ranks") a.worlds = {v};
    else if (k == "--mib") a.mib = v;
    else if (k == "--iters") a.iters = v;
    else if (k == "--local") a.local = v;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_qgz [--ranks N] [--mib M] [--iters I] [--local L]\n",
                   k.c_str());
      return 2;
    }
  }
  if (a.worlds[0] < 2 || a.mib < 1 || a.iters < 1) {
    std::fprintf(stderr, "bench_qgz: --ranks must be >= 2, the other options >= 1\n");
    return 2;
  }
  // Its ranks share this host, where the engine quantizes nothing
  // (Context::quantizes): this bench measures the quantized path itself.
  setenv("ZS_QUANTIZE_WITHIN_HOST", "1", 1);
  std::printf("%s: ZS_QUANTIZE_WITHIN_HOST=1 (the ranks share one host, where the engine would not "
              "quantize)\n", "bench_qgz");
  std::string json = "{\"bench\":\"qgz\",\"block\":256,\"mib\":" + std::to_string(a.mib) + ",\"reductions\":[";
  char buf[512];
  bool first = true;
  for (int world : a.worlds) {
    Result res[kNumModes];
    if (!run_world(world, a, res)) {
      std::fprintf(stderr, "bench_qgz: a rank failed on %d ranks\n", world);
      return 1;
    }
    const int local = a.local > 0 && a.local < world ? a.local : world;
    std::printf("push + sync of %.1f MiB of fp32 gradients, %d loopback ranks, %d per node (median of %d):\n",
                res[0].grad_bytes / (1 << 20), world, local, a.iters);
    for (int k = 0; k < kNumModes; ++k) {
      const Result& base = res[0];
      std::printf("  %-22s  recv/rank %8.2f MiB (%5.2fx fewer)", 
                  kBits[k] == 0 ? "fp32 reduce-scatter" : kBits[k] == 8 ? "qgZ int8 all-to-all" : "qgZ int4 all-to-all",
                  res[k].recv_bytes / (1 << 20), base.recv_bytes / res[k].recv_bytes);
      if (local < world)
        std::printf("  into a node %8.2f MiB (%5.2fx fewer)", res[k].cross_bytes / (1 << 20),
                    base.cross_bytes / res[k].cross_bytes);
      std::printf("  %8.2f ms (%5.2fx faster)\n", res[k].seconds * 1e3, base.seconds / res[k].seconds);
      std::snprintf(buf, sizeof buf,
                    "%s{\"ranks\":%d,\"local\":%d,\"bits\":%d,\"recv_bytes_per_rank\":%.0f,\"bytes_ratio\":%.4f,"
                    "\"into_node_bytes\":%.0f,\"ms\":%.3f,\"speedup\":%.4f}",
                    first ? "" : ",", world, local, kBits[k], res[k].recv_bytes, base.recv_bytes / res[k].recv_bytes,
                    res[k].cross_bytes,
                    res[k].seconds * 1e3, base.seconds / res[k].seconds);
      json += buf;
      first = false;
    }
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
