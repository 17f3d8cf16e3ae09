// ZeRO++ qwZ benchmark: bytes each rank receives per gather, quantized
// (int8, int4) against full precision, for bf16 and fp32 params; the gather
// time of each on 2 and 4 loopback ranks (same run, same params); and the
// CPU quantize / dequantize kernels' throughput against a memcpy of the
// same input bytes (fp32, bf16 and fp16; int8 and int4), and of LoCo's
// quantize_with_error (fp32 gradient and error). Frozen params under zero_quantized_nontrainable_weights
// (int8, qwZ off) are measured beside them: their shards' memory (the
// packets they are kept as) and their gathers, which send the packets as
// they are instead of quantizing at every gather. Prints figures and
// ratios, never pass/fail on time.
//
//   build/bin/bench_qwz [--ranks N (default: 2 then 4)] [--mib 32] [--iters 5]
//                       [--kernel-mib 256] [--gathers 1]
//
// --gathers 0 skips the gathers (kernels only; "gathers" is then empty).
// ZS_SIMD=scalar measures the scalar kernels. Forks its own ranks over
// loopback. The last line is one JSON object.
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
#include "kernels/parallel.h"
#include "kernels/quant.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace {

struct Args {
  std::vector<int> worlds = {2, 4};
  int mib = 32;
  int iters = 5;
  int kernel_mib = 256;
  bool gathers = true;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using zs::bench::median;

// One configuration of a gather: dtype, quantization (0: off), whether
// the params are frozen and kept quantized (zero_quantized_nontrainable_
// weights, qwZ off), and the index of its unquantized twin.
struct Mode {
  zs_dtype dtype;
  int bits;
  bool frozen;
  int base;
};
const Mode kModes[] = {{ZS_BFLOAT16, 0, false, 0}, {ZS_BFLOAT16, 8, false, 0},
                       {ZS_BFLOAT16, 4, false, 0}, {ZS_BFLOAT16, 8, true, 0},
                       {ZS_FLOAT32, 0, false, 4},  {ZS_FLOAT32, 8, false, 4},
                       {ZS_FLOAT32, 4, false, 4},  {ZS_FLOAT32, 8, true, 4}};
constexpr int kNumModes = 8;

struct Result {
  double seconds = 0;        // median fetch + release
  double recv_bytes = 0;     // per rank per gather, on the wire
  double gathered_bytes = 0; // the full params' bytes
  double shard_bytes = 0;    // this rank's shards in memory (zs_memory_stats)
};

// Transformer-like params (1024-wide matrices and vectors) of ~mib MiB in
// the mode's dtype; a gather's received bytes per rank as the stats count
// them: (G - 1) qwZ packets, or shards where a shard is no larger than its
// packet (a vector's, on 8 ranks and more) or quantization is off.
Result run_mode(int rank, int world, int port, const Mode& m, const Args& a) {
  std::string cfg = "{}";
  if (m.bits)
    cfg = std::string(R"({"zero_optimization": {")") +
          (m.frozen ? "zero_quantized_nontrainable_weights" : "zero_quantized_weights") +
          R"(": true, "zero_quantized_weights_bits": )" + std::to_string(m.bits) + "}}";
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  o.config_json = cfg.c_str();
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  const size_t es = m.dtype == ZS_FLOAT32 ? 4 : 2;
  const size_t want = static_cast<size_t>(a.mib) << 20;
  std::vector<zs_param> ps;
  Result r;
  for (int i = 0; r.gathered_bytes < static_cast<double>(want); ++i) {
    const int64_t shape[2] = {(i % 4 == 0) ? 1 : 1024 + (i % 3), 1024};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(i);
    po.name = name.c_str();
    po.dtype = m.dtype;
    po.ndim = 2;
    po.shape = shape;
    po.init = ZS_INIT_NORMAL;
    po.b = 0.02;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    if (m.frozen) CHECK(zs_param_freeze(p));
    ps.push_back(p);
    zs_param_info info = ZS_PARAM_INFO_INIT;
    CHECK(zs_param_get_info(p, &info));
    r.gathered_bytes += static_cast<double>(info.numel * es);
  }
  auto once = [&] {
    const double t0 = now_s();
    zs_gather g;
    CHECK(zs_fetch(&g, ctx, ps.data(), ps.size()));
    CHECK(zs_gather_wait(g, ZS_WAIT_FOREVER));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, ps.data(), ps.size()));
    return now_s() - t0;
  };
  zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
  CHECK(zs_context_memory(ctx, &mem));
  r.shard_bytes = static_cast<double>(mem.shard_bytes);
  auto received = [&] {
    zs_fetch_stats s = ZS_FETCH_STATS_INIT;
    CHECK(zs_context_fetch_stats(ctx, &s));
    return static_cast<double>(s.gather_bytes_received + s.quantized_gather_bytes_received);
  };
  const double before = received();
  once();  // warm-up: first touch of the buffers
  r.recv_bytes = received() - before;
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
    for (int k = 0; k < kNumModes; ++k) mine->res[k] = run_mode(r, world, ports[k], kModes[k], a);
  });
  std::copy(std::begin(all.res), std::end(all.res), out);
  return ok;
}

struct KernelRate {
  double quant_gbps, dequant_gbps, memcpy_gbps;
};

// GB/s of working-dtype bytes in (quantize) or out (dequantize), and a
// memcpy of the same bytes; best of 5.
KernelRate kernel_rate(zs::kernels::WorkDtype t, int bits, size_t bytes) {
  namespace k = zs::kernels;
  const size_t es = t == k::WorkDtype::F32 ? 4 : 2, n = bytes / es;
  const k::QuantSpec s{bits, 256};
  std::vector<uint8_t> src(n * es), dst(n * es), copy(n * es);
  for (size_t i = 0; i < n; ++i) k::store_work1(src.data(), t, i, static_cast<float>(i % 1000) * 1e-3f - 0.5f);
  std::vector<uint8_t> codes(k::quant_code_bytes(n, s));
  std::vector<float> scales(k::quant_blocks(n, s));
  double tq = 1e9, td = 1e9, tc = 1e9;
  for (int it = 0; it < 5; ++it) {
    double t0 = now_s();
    k::quantize(src.data(), t, n, s, codes.data(), scales.data());
    tq = std::min(tq, now_s() - t0);
    t0 = now_s();
    k::dequantize(codes.data(), scales.data(), n, s, dst.data(), t);
    td = std::min(td, now_s() - t0);
    t0 = now_s();
    std::memcpy(copy.data(), src.data(), copy.size());
    tc = std::min(tc, now_s() - t0);
  }
  const double gb = static_cast<double>(n * es) / 1e9;
  return {gb / tq, gb / td, gb / tc};
}

// LoCo: GB/s of fp32 gradient bytes in (the error is read and written
// besides), and a memcpy of the same bytes; best of 5.
KernelRate loco_rate(int bits, size_t bytes) {
  namespace k = zs::kernels;
  const size_t n = bytes / 4;
  const k::QuantSpec s{bits, 256};
  std::vector<float> g(n), err(n, 0.0f), copy(n);
  for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
  std::vector<uint8_t> codes(k::quant_code_bytes(n, s));
  std::vector<float> scales(k::quant_blocks(n, s));
  double tq = 1e9, tc = 1e9;
  for (int it = 0; it < 5; ++it) {
    double t0 = now_s();
    k::quantize_with_error(g.data(), err.data(), 0.9f, n, s, codes.data(), scales.data());
    tq = std::min(tq, now_s() - t0);
    t0 = now_s();
    std::memcpy(copy.data(), g.data(), n * 4);
    tc = std::min(tc, now_s() - t0);
  }
  const double gb = static_cast<double>(n * 4) / 1e9;
  return {gb / tq, 0, gb / tc};
}

const char* dname(zs_dtype t) { return t == ZS_FLOAT32 ? "fp32" : "bf16"; }
const char* dname(zs::kernels::WorkDtype t) {
  return t == zs::kernels::WorkDtype::F32 ? "fp32" : t == zs::kernels::WorkDtype::BF16 ? "bf16" : "fp16";
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
    else if (k == "--kernel-mib") a.kernel_mib = v;
    else if (k == "--gathers") a.gathers = v != 0;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_qwz [--ranks N] [--mib M] [--iters I] [--kernel-mib K] [--gathers 0|1]\n",
                   k.c_str());
      return 2;
    }
  }
  if (a.worlds[0] < 2 || a.mib < 1 || a.iters < 1 || a.kernel_mib < 1) {
    std::fprintf(stderr, "bench_qwz: --ranks must be >= 2, the other options >= 1\n");
    return 2;
  }
  // Its ranks share this host, where the engine quantizes nothing
  // (Context::quantizes): this bench measures the quantized path itself.
  setenv("ZS_QUANTIZE_WITHIN_HOST", "1", 1);
  std::printf("%s: ZS_QUANTIZE_WITHIN_HOST=1 (the ranks share one host, where the engine would not "
              "quantize)\n", "bench_qwz");
  std::string json = "{\"bench\":\"qwz\",\"block\":256,\"mib\":" + std::to_string(a.mib) + ",\"gathers\":[";
  char buf[512];
  bool first = true;
  for (int world : a.gathers ? a.worlds : std::vector<int>{}) {
    Result res[kNumModes];
    if (!run_world(world, a, res)) {
      std::fprintf(stderr, "bench_qwz: a rank failed on %d ranks\n", world);
      return 1;
    }
    std::printf("gather of %.1f MiB of params, %d loopback ranks (median of %d):\n",
                res[0].gathered_bytes / (1 << 20), world, a.iters);
    for (int k = 0; k < kNumModes; ++k) {
      const Mode& m = kModes[k];
      const Result& base = res[m.base];  // the same dtype, unquantized
      const char* what = !m.bits ? "full" : m.frozen ? "frozen" : m.bits == 8 ? "int8" : "int4";
      std::printf("  %s %-6s  recv/rank %8.2f MiB (%5.2fx fewer)  %8.2f ms (%5.2fx faster)"
                  "  shards %7.2f MiB (%4.2fx less)\n",
                  dname(m.dtype), what, res[k].recv_bytes / (1 << 20),
                  base.recv_bytes / res[k].recv_bytes, res[k].seconds * 1e3,
                  base.seconds / res[k].seconds, res[k].shard_bytes / (1 << 20),
                  base.shard_bytes / res[k].shard_bytes);
      std::snprintf(buf, sizeof buf,
                    "%s{\"ranks\":%d,\"dtype\":\"%s\",\"bits\":%d,\"frozen\":%s,"
                    "\"recv_bytes_per_rank\":%.0f,\"bytes_ratio\":%.4f,\"ms\":%.3f,"
                    "\"speedup\":%.4f,\"shard_bytes\":%.0f,\"shard_ratio\":%.4f}",
                    first ? "" : ",", world, dname(m.dtype), m.bits, m.frozen ? "true" : "false",
                    res[k].recv_bytes, base.recv_bytes / res[k].recv_bytes, res[k].seconds * 1e3,
                    base.seconds / res[k].seconds, res[k].shard_bytes,
                    base.shard_bytes / res[k].shard_bytes);
      json += buf;
      first = false;
    }
  }
  json += "],\"kernels\":[";
  const size_t kbytes = static_cast<size_t>(a.kernel_mib) << 20;
  std::printf("CPU kernels (%s) on %d MiB of input, %d threads (GB/s of working-dtype bytes):\n",
              zs::kernels::simd_path(), a.kernel_mib, zs::kernels::num_threads());
  first = true;
  for (auto t : {zs::kernels::WorkDtype::BF16, zs::kernels::WorkDtype::F32, zs::kernels::WorkDtype::F16})
    for (int bits : {8, 4}) {
      const KernelRate r = kernel_rate(t, bits, kbytes);
      const char* dn = dname(t);
      std::printf("  %s int%d  quantize %6.2f  dequantize %6.2f  memcpy %6.2f  (ratios %.2f, %.2f)\n", dn,
                  bits, r.quant_gbps, r.dequant_gbps, r.memcpy_gbps, r.quant_gbps / r.memcpy_gbps,
                  r.dequant_gbps / r.memcpy_gbps);
      std::snprintf(buf, sizeof buf,
                    "%s{\"dtype\":\"%s\",\"bits\":%d,\"quantize_gbps\":%.3f,\"dequantize_gbps\":%.3f,"
                    "\"memcpy_gbps\":%.3f}",
                    first ? "" : ",", dn, bits, r.quant_gbps, r.dequant_gbps, r.memcpy_gbps);
      json += buf;
      first = false;
    }
  json += "],\"loco\":[";
  first = true;
  for (int bits : {8, 4}) {
    const KernelRate r = loco_rate(bits, kbytes);
    std::printf("  LoCo fp32 int%d  quantize_with_error %6.2f  memcpy %6.2f  (ratio %.2f)\n", bits,
                r.quant_gbps, r.memcpy_gbps, r.quant_gbps / r.memcpy_gbps);
    std::snprintf(buf, sizeof buf, "%s{\"dtype\":\"fp32\",\"bits\":%d,\"quantize_gbps\":%.3f,\"memcpy_gbps\":%.3f}",
                  first ? "" : ",", bits, r.quant_gbps, r.memcpy_gbps);
    json += buf;
    first = false;
  }
  json += "],\"simd\":\"" + std::string(zs::kernels::simd_path()) + "\"}";
  std::printf("%s\n", json.c_str());
  return 0;
}
