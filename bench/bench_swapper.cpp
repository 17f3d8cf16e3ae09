// NVMe swapper benchmark: sequential write and read bandwidth of the
// swapper (impl/offload/) against fio with the io_uring engine, O_DIRECT,
// the same block size and queue depth, on the same directory in the same
// run; then an AdamW step over bf16 params with the optimizer state on NVMe
// against the same step in memory, and against the disk bound (the bytes
// the step moves at fio's bandwidths); then the same with the param's shard
// on NVMe too (offload_param, no cache): the step, and a fetch that reads
// the shard back, each against its disk bound.
//
//   build/bin/bench_swapper [--dir DIR] [--mib 1024] [--block-size 1048576]
//                           [--queue-depth 8] [--threads 1] [--reps 3]
//                           [--params 16M] [--sub-group 4M] [--steps 5]
//
// Each swapper request is 64 MiB (two in flight), cut into block-size
// pieces at most queue-depth deep, as the optimizer moves its sub-groups.
// Best of --reps for each side, the sides alternating, and the median of
// the per-rep ratios (the development machine's disk is shared and swings
// by 3x between reps). Without fio on the PATH its side is left
// out. Prints figures and ratios; the last line is one JSON object. Never
// fails on time.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/engine_check.h"
#include "impl/common/error.h"
#include "impl/offload/space.h"
#include "impl/offload/swapper.h"
#include "zeroshard/zeroshard.h"

namespace fs = std::filesystem;

namespace {

struct Args {
  std::string dir;
  uint64_t mib = 1024;
  int64_t block = 1048576;
  int64_t depth = 8;
  int64_t threads = 1;
  int reps = 3;
  int64_t params = 16 << 20;
  int64_t sub_group = 4 << 20;
  int steps = 5;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t parse_count(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return static_cast<int64_t>(v);
}

struct Bandwidth {
  double write = 0.0, read = 0.0;  // bytes per second
};

// The swapper over a file of `bytes`: sequential requests of 64 MiB, two in
// flight, through registered aligned buffers.
Bandwidth swapper_bandwidth(const Args& a, uint64_t bytes) {
  zs::SwapperOptions o;
  o.dir = a.dir;
  o.file_name = "bench_swapper.swap";
  o.aio.block_size = a.block;
  o.aio.queue_depth = a.depth;
  o.aio.thread_count = a.threads;
  zs::Swapper s(o);
  s.grow(bytes);
  const uint64_t req = std::min<uint64_t>(uint64_t{64} << 20, bytes);
  zs::AlignedBuffer bufs[2] = {zs::AlignedBuffer(req), zs::AlignedBuffer(req)};
  // Random bytes, as fio writes: a disk or a virtual one may store
  // repeated bytes faster than data.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& b : bufs)
    for (uint64_t i = 0; i + 8 <= b.bytes(); i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(b.data() + i, &x, 8);
    }
  s.register_buffers({&bufs[0], &bufs[1]});
  auto pass = [&](bool write) {
    const double t0 = now();
    zs::Swapper::Ticket inflight[2] = {0, 0};
    int k = 0;
    for (uint64_t at = 0; at < bytes; at += req, ++k) {
      const int b = k % 2;
      if (inflight[b] != 0) s.wait(inflight[b]);
      const uint64_t n = std::min(req, bytes - at);
      inflight[b] = write ? s.write_async(at, bufs[b].data(), n) : s.read_async(at, bufs[b].data(), n);
    }
    for (auto t : inflight)
      if (t != 0) s.wait(t);
    return static_cast<double>(bytes) / (now() - t0);
  };
  Bandwidth b;
  b.write = pass(true);
  b.read = pass(false);
  return b;
}

// fio, same file size, block size, queue depth, O_DIRECT, io_uring; its
// own file in the same directory. 0 where fio is missing or fails.
Bandwidth fio_bandwidth(const Args& a, uint64_t bytes) {
  if (std::system("command -v fio >/dev/null 2>&1") != 0) return {};
  const std::string file = a.dir + "/bench_swapper.fio";
  const std::string out = a.dir + "/bench_swapper.fio.json";
  auto run = [&](const char* rw) -> double {
    const std::string cmd = "fio --name=zs --filename=" + file + " --size=" + std::to_string(bytes) +
                            " --rw=" + rw + " --bs=" + std::to_string(a.block) +
                            " --iodepth=" + std::to_string(a.depth) +
                            " --numjobs=" + std::to_string(a.threads) +
                            " --ioengine=io_uring --direct=1 --group_reporting --output-format=json --output=" + out +
                            " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) return 0.0;
    try {
      std::FILE* f = std::fopen(out.c_str(), "r");
      if (f == nullptr) return 0.0;
      std::string text;
      char buf[65536];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
      std::fclose(f);
      // fio may print notes before the JSON object.
      const auto j = nlohmann::json::parse(text.substr(text.find('{')));
      return j.at("jobs").at(0).at(rw[0] == 'w' ? "write" : "read").at("bw_bytes").get<double>();
    } catch (const std::exception&) {
      return 0.0;
    }
  };
  Bandwidth b;
  b.write = run("write");
  b.read = run("read");
  fs::remove(file);
  fs::remove(out);
  return b;
}

struct StepTimes {
  double median = 0.0;
  double fetch_median = 0.0;  // zs_fetch + wait + release
  uint64_t swap_bytes = 0;  // the swap files
};

// AdamW over one bf16 param of a.params elements in a world of one:
// median of a.steps steps (after one warm-up), gradients pushed untimed.
StepTimes step_time(const Args& a, bool nvme, bool params_nvme = false) {
  std::string config = "{}";
  const std::string params_section =
      params_nvme ? R"("offload_param": {"device": "nvme", "max_in_cpu": 0, "nvme_path": ")" + a.dir + R"("}, )" : "";
  if (nvme)
    config = R"({"zero_optimization": {)" + params_section + R"("sub_group_size": )" + std::to_string(a.sub_group) +
             R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + a.dir +
             R"(", "buffer_count": 3, "pipeline_read": true, "pipeline_write": true}},
             "aio": {"block_size": )" + std::to_string(a.block) + R"(, "queue_depth": )" +
             std::to_string(a.depth) + R"(, "intra_op_parallelism": )" + std::to_string(a.threads) + "}}";
  zs_context_options co = ZS_CONTEXT_OPTIONS_INIT;
  co.rank = 0;
  co.world_size = 1;
  co.config_json = config.c_str();
  co.device = "cpu";
  zs_context ctx = nullptr;
  CHECK(zs_context_create(&ctx, &co));
  zs_param p = nullptr;
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  const int64_t shape[1] = {a.params};
  po.name = "w";
  po.dtype = ZS_BFLOAT16;
  po.ndim = 1;
  po.shape = shape;
  po.init = ZS_INIT_NORMAL;
  po.seed = 1;
  po.b = 0.02;
  CHECK(zs_param_register(&p, ctx, &po));
  zs_optimizer opt = nullptr;
  CHECK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  CHECK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
  std::vector<float> grad(static_cast<size_t>(a.params));
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = std::sin(static_cast<float>(i)) * 1e-3f;
  std::vector<double> times, fetches;
  for (int k = 0; k <= a.steps; ++k) {
    CHECK(zs_grad_push(p, grad.data(), ZS_FLOAT32, grad.size() * sizeof(float)));
    zs_step_result r = ZS_STEP_RESULT_INIT;
    const double t0 = now();
    CHECK(zs_optimizer_step(opt, &r));
    if (k > 0) times.push_back(now() - t0);
    zs_gather g = nullptr;
    const double t1 = now();
    CHECK(zs_fetch(&g, ctx, &p, 1));
    CHECK(zs_gather_wait(g, -1));
    CHECK(zs_gather_destroy(g));
    CHECK(zs_release(ctx, &p, 1));
    if (k > 0) fetches.push_back(now() - t1);
  }
  StepTimes st;
  if (nvme)
    for (const auto& e : fs::directory_iterator(a.dir))
      if (e.path().filename().string().rfind("zeroshard-", 0) == 0) st.swap_bytes += e.file_size();
  std::sort(times.begin(), times.end());
  std::sort(fetches.begin(), fetches.end());
  st.median = times[times.size() / 2];
  st.fetch_median = fetches[fetches.size() / 2];
  zs_optimizer_destroy(opt);
  zs_param_destroy(p);
  zs_context_destroy(ctx);
  return st;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--dir") a.dir = v;
    else if (k == "--mib") a.mib = static_cast<uint64_t>(parse_count(v));
    else if (k == "--block-size") a.block = parse_count(v);
    else if (k == "--queue-depth") a.depth = parse_count(v);
    else if (k == "--threads") a.threads = parse_count(v);
    else if (k == "--reps") a.reps = static_cast<int>(parse_count(v));
    else if (k == "--params") a.params = parse_count(v);
    else if (k == "--sub-group") a.sub_group = parse_count(v);
    else if (k == "--steps") a.steps = static_cast<int>(parse_count(v));
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (a.dir.empty()) {
    const char* t = std::getenv("TMPDIR");
    a.dir = std::string(t && *t ? t : "/tmp") + "/zs_bench_swapper_" + std::to_string(getpid());
  }
  fs::create_directories(a.dir);
  const uint64_t bytes = a.mib << 20;
  // File and fio's file, the optimizer's swap file (12 bytes/param) and
  // the params' (2 bytes/param).
  const uint64_t need = 2 * bytes + 14 * static_cast<uint64_t>(a.params) + (64 << 20);
  const uint64_t free = zs::free_bytes(a.dir);
  if (need > free) {
    std::printf("skipped: '%s' has %llu bytes free, the benchmark needs %llu (try --mib, --params, --dir)\n",
                a.dir.c_str(), static_cast<unsigned long long>(free), static_cast<unsigned long long>(need));
    std::printf("{\"skipped\": true}\n");
    return 0;
  }
  std::printf("dir %s, file %llu MiB, block %lld, queue depth %lld, %lld ring(s), best of %d\n", a.dir.c_str(),
              static_cast<unsigned long long>(a.mib), static_cast<long long>(a.block),
              static_cast<long long>(a.depth), static_cast<long long>(a.threads), a.reps);
  // Alternating, so both sides meet the disk's moods alike (it is shared).
  Bandwidth mine, fio;
  std::vector<double> ratio_w, ratio_r;  // per rep, swapper / fio
  for (int r = 0; r < a.reps; ++r) {
    Bandwidth m;
    try {
      m = swapper_bandwidth(a, bytes);
      mine.write = std::max(mine.write, m.write);
      mine.read = std::max(mine.read, m.read);
    } catch (const zs::Error& e) {
      std::fprintf(stderr, "swapper: %s\n", e.what());
      return 1;
    }
    const Bandwidth f = fio_bandwidth(a, bytes);
    fio.write = std::max(fio.write, f.write);
    fio.read = std::max(fio.read, f.read);
    if (f.write > 0) ratio_w.push_back(m.write / f.write);
    if (f.read > 0) ratio_r.push_back(m.read / f.read);
    std::printf("  rep %d: write swapper %.2f fio %.2f GB/s, read swapper %.2f fio %.2f GB/s\n", r + 1,
                m.write / 1e9, f.write / 1e9, m.read / 1e9, f.read / 1e9);
  }
  const double GB = 1e9;
  std::printf("write: swapper %.2f GB/s, fio %.2f GB/s, ratio %.2f\n", mine.write / GB, fio.write / GB,
              fio.write > 0 ? mine.write / fio.write : 0.0);
  std::printf("read:  swapper %.2f GB/s, fio %.2f GB/s, ratio %.2f\n", mine.read / GB, fio.read / GB,
              fio.read > 0 ? mine.read / fio.read : 0.0);
  if (fio.write == 0.0) std::printf("(fio not found or failed: no baseline)\n");
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("median of the per-rep ratios: write %.2f, read %.2f\n", median(ratio_w), median(ratio_r));

  const StepTimes mem = step_time(a, false);
  const StepTimes nvme = step_time(a, true);
  const StepTimes both = step_time(a, true, true);
  // A step reads and writes the whole state: masters and two moments.
  const double moved = 12.0 * static_cast<double>(a.params);
  const double bound = fio.read > 0 && fio.write > 0 ? moved / fio.read + moved / fio.write : 0.0;
  std::printf("AdamW step, %lld bf16 params, sub-groups of %lld: in memory %.3f s, NVMe %.3f s (%.1fx); "
              "disk bound %.3f s (%.0f MB each way at fio's bandwidths), ratio bound/step %.2f\n",
              static_cast<long long>(a.params), static_cast<long long>(a.sub_group), mem.median, nvme.median,
              nvme.median / mem.median, bound, moved / 1e6, bound > 0 ? bound / nvme.median : 0.0);
  // With the shard offloaded too, the step also reads and writes it (2 bytes
  // each way) and a fetch reads it back (2 bytes; the gather of a world of
  // one is a copy).
  const double moved_both = moved + 2.0 * static_cast<double>(a.params);
  const double bound_both = bound > 0 ? moved_both / fio.read + moved_both / fio.write : 0.0;
  const double fetch_bound = fio.read > 0 ? 2.0 * static_cast<double>(a.params) / fio.read : 0.0;
  std::printf("with the param on NVMe too: step %.3f s, disk bound %.3f s, ratio bound/step %.2f; "
              "fetch %.3f s (in memory %.3f s), disk bound %.3f s, ratio bound/fetch %.2f\n",
              both.median, bound_both, bound_both > 0 ? bound_both / both.median : 0.0, both.fetch_median,
              mem.fetch_median, fetch_bound, fetch_bound > 0 ? fetch_bound / both.fetch_median : 0.0);
  nlohmann::json j;
  j["dir"] = a.dir;
  j["file_mib"] = a.mib;
  j["block_size"] = a.block;
  j["queue_depth"] = a.depth;
  j["threads"] = a.threads;
  j["swapper_write_gbps"] = mine.write / GB;
  j["swapper_read_gbps"] = mine.read / GB;
  j["fio_write_gbps"] = fio.write / GB;
  j["fio_read_gbps"] = fio.read / GB;
  j["write_ratio"] = fio.write > 0 ? mine.write / fio.write : 0.0;
  j["read_ratio"] = fio.read > 0 ? mine.read / fio.read : 0.0;
  j["median_rep_write_ratio"] = median(ratio_w);
  j["median_rep_read_ratio"] = median(ratio_r);
  j["params"] = a.params;
  j["sub_group_size"] = a.sub_group;
  j["step_memory_s"] = mem.median;
  j["step_nvme_s"] = nvme.median;
  j["step_nvme_over_memory"] = nvme.median / mem.median;
  j["swap_file_bytes"] = nvme.swap_bytes;
  j["disk_bound_s"] = bound;
  j["disk_bound_over_step"] = bound > 0 ? bound / nvme.median : 0.0;
  j["step_params_nvme_s"] = both.median;
  j["disk_bound_params_nvme_over_step"] = bound_both > 0 ? bound_both / both.median : 0.0;
  j["fetch_memory_s"] = mem.fetch_median;
  j["fetch_params_nvme_s"] = both.fetch_median;
  j["disk_bound_over_fetch"] = fetch_bound > 0 ? fetch_bound / both.fetch_median : 0.0;
  std::printf("%s\n", j.dump().c_str());
  if (a.dir.find("/zs_bench_swapper_") != std::string::npos) fs::remove_all(a.dir);
  return 0;
}
