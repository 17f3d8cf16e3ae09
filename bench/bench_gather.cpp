// Gather benchmark: coalesced param fetch against a raw Gloo all-gather of
// the same bytes, measured in the same run on the same ranks, plus the
// engine's bookkeeping cost per param for fetch + release.
//
//   build/bin/bench_gather [--ranks 2] [--mib 64] [--iters 20]
//
// Forks its own ranks over loopback. The last line is one JSON object.
#include <gloo/allgather.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
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
  int ranks = 2;
  int mib = 64;
  int iters = 20;
  int tiny_params = 20000;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Params of a transformer-like mix: big matrices and small vectors.
std::vector<zs_param> register_model(zs_context ctx, size_t total_bytes, size_t* gathered) {
  std::vector<zs_param> ps;
  *gathered = 0;
  int i = 0;
  while (*gathered < total_bytes) {
    const int64_t rows = (i % 4 == 0) ? 1 : 1024 + (i % 3);
    const int64_t shape[2] = {rows, 1024};
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(i++);
    o.name = name.c_str();
    o.ndim = 2;
    o.shape = shape;
    o.init = ZS_INIT_UNIFORM;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &o));
    ps.push_back(p);
    *gathered += static_cast<size_t>(rows) * 1024 * 4;
  }
  return ps;
}

double time_fetch_release(zs_context ctx, const std::vector<zs_param>& ps) {
  const double t0 = now_s();
  zs_gather g;
  CHECK(zs_fetch(&g, ctx, ps.data(), ps.size()));
  CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
  CHECK(zs_gather_destroy(g));
  CHECK(zs_release(ctx, ps.data(), ps.size()));
  return now_s() - t0;
}

// Gloo on its own: its own file-store rendezvous, its own context.
struct RawGloo {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  RawGloo(int rank, int world, const std::string& dir) {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(dir);
    ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
    ctx->connectFullMesh(store, dev);
  }
  double time_allgather(std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
    const double t0 = now_s();
    gloo::AllgatherOptions opts(ctx);
    opts.setInput(in.data(), in.size());
    opts.setOutput(out.data(), out.size());
    gloo::allgather(opts);
    return now_s() - t0;
  }
};

using zs::bench::median;

void run_rank(const Args& a, int rank, int port, const std::string& gloo_dir) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  RawGloo raw(rank, a.ranks, gloo_dir);

  size_t gathered = 0;
  auto model = register_model(ctx, static_cast<size_t>(a.mib) << 20, &gathered);
  // Same output bytes for the raw all-gather.
  std::vector<uint8_t> in(gathered / static_cast<size_t>(a.ranks)), out(in.size() * static_cast<size_t>(a.ranks));
  time_fetch_release(ctx, model);  // warm-up: first-touch of buffers
  raw.time_allgather(in, out);
  std::vector<double> t_engine, t_raw;
  for (int it = 0; it < a.iters; ++it) {  // interleaved, so drift hits both
    t_engine.push_back(time_fetch_release(ctx, model));
    t_raw.push_back(raw.time_allgather(in, out));
  }

  // Bookkeeping: many tiny params, engine time minus the raw all-gather of
  // their bytes, per param.
  std::vector<zs_param> tiny;
  for (int i = 0; i < a.tiny_params; ++i) {
    const int64_t shape[1] = {4};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.ndim = 1;
    po.shape = shape;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    tiny.push_back(p);
  }
  std::vector<uint8_t> tin(tiny.size() * 4 * 4 / static_cast<size_t>(a.ranks) + 16),
      tout(tin.size() * static_cast<size_t>(a.ranks));
  std::vector<double> t_tiny, t_tiny_raw;
  time_fetch_release(ctx, tiny);
  for (int it = 0; it < a.iters; ++it) {
    t_tiny.push_back(time_fetch_release(ctx, tiny));
    t_tiny_raw.push_back(raw.time_allgather(tin, tout));
  }

  if (rank == 0) {
    const double e = median(t_engine), r = median(t_raw);
    const double gb = static_cast<double>(gathered) / 1e9;
    const double per_param_us =
        std::max(0.0, median(t_tiny) - median(t_tiny_raw)) / static_cast<double>(a.tiny_params) * 1e6;
    std::printf("coalesced fetch of %zu params, %.1f MiB gathered per rank, %d ranks\n",
                model.size(), static_cast<double>(gathered) / (1 << 20), a.ranks);
    std::printf("  engine fetch+release: %8.3f ms  %6.2f GB/s\n", e * 1e3, gb / e);
    std::printf("  raw gloo all-gather:  %8.3f ms  %6.2f GB/s\n", r * 1e3, gb / r);
    std::printf("  ratio engine/raw:     %8.3f (target >= 0.9)\n", r / e);
    std::printf("bookkeeping: %d tiny params, engine %.3f ms, raw %.3f ms -> %.3f us/param (target <= 1)\n",
                a.tiny_params, median(t_tiny) * 1e3, median(t_tiny_raw) * 1e3, per_param_us);
    std::printf(
        "{\"bench\":\"gather\",\"ranks\":%d,\"params\":%zu,\"gathered_bytes\":%zu,"
        "\"engine_gbps\":%.4f,\"raw_gloo_gbps\":%.4f,\"throughput_ratio\":%.4f,"
        "\"target_ratio\":0.9,\"bookkeeping_us_per_param\":%.4f,\"target_us\":1.0}\n",
        a.ranks, model.size(), gathered, gb / e, gb / r, r / e, per_param_us);
    std::fflush(stdout);
  }
  for (auto p : tiny) CHECK(zs_param_destroy(p));
  for (auto p : model) CHECK(zs_param_destroy(p));
  CHECK(zs_context_destroy(ctx));
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--ranks") a.ranks = v;
    else if (k == "--mib") a.mib = v;
    else if (k == "--iters") a.iters = v;
    else if (k == "--tiny-params") a.tiny_params = v;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_gather [--ranks N] [--mib M] [--iters I] [--tiny-params P]\n", k.c_str());
      return 2;
    }
  }
  if (a.ranks < 1 || a.mib < 1 || a.iters < 1 || a.tiny_params < 1) {
    std::fprintf(stderr, "bench_gather: every option must be >= 1\n");
    return 2;
  }
  const int port = zs::bench::free_port();
  char dir[] = "/tmp/zs_bench_gloo_XXXXXX";
  if (!mkdtemp(dir)) return 1;
  int rc = zs::bench::fork_ranks(a.ranks, [&](int r) { run_rank(a, r, port, dir); }) ? 0 : 1;
  std::string cleanup = std::string("rm -rf ") + dir;
  if (std::system(cleanup.c_str()) != 0) rc = 1;
  return rc;
}
