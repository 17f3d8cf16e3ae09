// Checkpoint benchmark: collective save and load of a model's params and
// AdamW state against a plain sequential write (+ fsync) and read of the
// same bytes per rank (read into memory of its own), on the same disk in the
// same run; and the peak RSS of
// a consolidated export against its largest tensor.
//
//   build/bin/bench_checkpoint [--ranks 2] [--gib 2] [--params 8] [--dir DIR]
//
// Forks its own ranks over loopback. Before every read, the files' pages
// are dropped from the page cache (posix_fadvise DONTNEED after fsync), so
// both reads come from the disk alike. Prints figures and ratios; the last
// line is one JSON object. Never fails on time.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench/engine_check.h"
#include "tests/support/bench_util.h"
#include "zeroshard/zeroshard.h"

namespace fs = std::filesystem;

namespace {

struct Args {
  int ranks = 2;
  double gib = 2.0;  // params + exp_avg + exp_avg_sq, all ranks
  int params = 8;
  std::string dir;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void drop_cache(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

void drop_cache_tree(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) drop_cache(e.path());
}

void barrier(zs_context ctx) {
  zs_group g = nullptr;
  CHECK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
  zs_work w = nullptr;
  CHECK(zs_barrier(&w, g));
  CHECK(zs_work_wait(w, ZS_WAIT_FOREVER));
  zs_work_destroy(w);
  zs_group_destroy(g);
}

// This rank's plain sequential write of `bytes` (8 MiB writes, fsync), and
// read back after dropping the cache.
void plain_write(const std::string& path, uint64_t bytes) {
  std::vector<char> buf(8u << 20, 1);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (uint64_t at = 0; at < bytes; at += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), bytes - at));
    if (write(fd, buf.data(), n) != static_cast<ssize_t>(n)) std::perror("write"), std::exit(1);
  }
  fsync(fd);
  close(fd);
}

// Into memory of its own, as any loader must put the bytes somewhere (a
// reused small buffer would skip the page faults every real load pays).
void plain_read(const std::string& path, uint64_t bytes) {
  std::unique_ptr<char[]> buf(new char[bytes]);
  const int fd = open(path.c_str(), O_RDONLY);
  for (uint64_t at = 0; at < bytes;) {
    const ssize_t n = read(fd, buf.get() + at, static_cast<size_t>(std::min<uint64_t>(8u << 20, bytes - at)));
    if (n <= 0) break;
    at += static_cast<uint64_t>(n);
  }
  close(fd);
}

struct Times {
  double plain_write = 0, save = 0, plain_read = 0, load = 0;
  uint64_t rank_bytes = 0, total_bytes = 0, largest_tensor = 0;
};

void rank_main(const Args& a, int rank, int port, const std::string& out) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.local_rank = rank;
  o.local_world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  o.timeout_ms = 600000;
  o.device = "cpu";
  zs_context ctx = nullptr;
  CHECK(zs_context_create(&ctx, &o));
  const uint64_t total_elems = static_cast<uint64_t>(a.gib * (1ull << 30) / 12.0);
  const int64_t per = static_cast<int64_t>(total_elems / static_cast<uint64_t>(a.params));
  std::vector<zs_param> params;
  std::vector<std::string> names;
  for (int i = 0; i < a.params; ++i) names.push_back("layer" + std::to_string(i) + ".weight");
  for (int i = 0; i < a.params; ++i) {
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = names[static_cast<size_t>(i)].c_str();
    po.ndim = 1;
    po.shape = &per;
    po.init = ZS_INIT_UNIFORM;
    po.seed = static_cast<uint64_t>(i);
    zs_param p = nullptr;
    CHECK(zs_param_register(&p, ctx, &po));
    params.push_back(p);
  }
  zs_optimizer opt = nullptr;
  CHECK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  CHECK(zs_optimizer_add_group(opt, params.data(), params.size(), &hp, nullptr));
  // Moments with values (not zeros) to save.
  for (zs_param p : params)
    for (int slot = 1; slot <= 2; ++slot) {
      float* d = nullptr;
      uint64_t n = 0;
      CHECK(zs_optimizer_state_data(opt, p, slot, &d, &n));
      for (uint64_t j = 0; j < n; ++j) d[j] = static_cast<float>(j % 977) * 1e-3f;
    }

  Times t;
  t.rank_bytes = 0;
  for (zs_param p : params) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    CHECK(zs_param_get_info(p, &info));
    t.rank_bytes += info.shard_valid * 12;
    t.largest_tensor = std::max<uint64_t>(t.largest_tensor, info.numel * 4);
    t.total_bytes += info.numel * 12;
  }
  const std::string plain = a.dir + "/plain-" + std::to_string(rank);
  const std::string ckpt = a.dir + "/ckpt";

  barrier(ctx);
  double t0 = now();
  plain_write(plain, t.rank_bytes);
  barrier(ctx);
  t.plain_write = now() - t0;

  barrier(ctx);
  t0 = now();
  zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
  so.tag = "bench";
  CHECK(zs_checkpoint_save(ctx, params.data(), params.size(), opt, ckpt.c_str(), &so));
  barrier(ctx);
  t.save = now() - t0;

  drop_cache(plain);
  if (rank == 0) drop_cache_tree(ckpt);
  barrier(ctx);
  t0 = now();
  plain_read(plain, t.rank_bytes);
  barrier(ctx);
  t.plain_read = now() - t0;

  barrier(ctx);
  t0 = now();
  zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
  CHECK(zs_checkpoint_load(ctx, params.data(), params.size(), opt, ckpt.c_str(), &lo, nullptr));
  barrier(ctx);
  t.load = now() - t0;

  if (rank == 0) {
    std::ofstream f(out, std::ios::binary);
    f.write(reinterpret_cast<const char*>(&t), sizeof(t));
  }
  zs_optimizer_destroy(opt);
  for (zs_param p : params) zs_param_destroy(p);
  zs_context_destroy(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (k == "--ranks" && v) a.ranks = std::atoi(argv[++i]);
    else if (k == "--gib" && v) a.gib = std::atof(argv[++i]);
    else if (k == "--params" && v) a.params = std::atoi(argv[++i]);
    else if (k == "--dir" && v) a.dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_checkpoint [--ranks N] [--gib G] [--params P] [--dir DIR]\n");
      return 2;
    }
  }
  bool own_dir = false;
  if (a.dir.empty()) {
    char tmpl[] = "/tmp/zs_bench_ckpt_XXXXXX";
    a.dir = mkdtemp(tmpl);
    own_dir = true;
  }
  const std::string out = a.dir + "/times.bin";
  const int port = zs::bench::free_port();
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < a.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      rank_main(a, r, port, out);
      _exit(0);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    failed |= !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  if (failed) {
    std::fprintf(stderr, "bench_checkpoint: a rank failed\n");
    return 1;
  }
  Times t;
  std::ifstream(out, std::ios::binary).read(reinterpret_cast<char*>(&t), sizeof(t));

  // Export in a grandchild: its parent's RUSAGE_CHILDREN is then the
  // export's own peak RSS (ours counts the ranks too).
  const std::string exported = a.dir + "/model.safetensors";
  long export_rss_kib = 0;
  double export_s = 0.0;
  {
    const pid_t outer = fork();
    if (outer == 0) {
      const double e0 = now();
      const pid_t inner = fork();
      if (inner == 0) {
        zs_checkpoint_export_options eo = ZS_CHECKPOINT_EXPORT_OPTIONS_INIT;
        const std::string ck = a.dir + "/ckpt";
        CHECK(zs_checkpoint_export(ck.c_str(), exported.c_str(), &eo));
        _exit(0);
      }
      int s2 = 0;
      waitpid(inner, &s2, 0);
      const double secs = now() - e0;
      rusage r2{};
      getrusage(RUSAGE_CHILDREN, &r2);
      std::ofstream(a.dir + "/rss") << r2.ru_maxrss << " " << secs;
      _exit(WIFEXITED(s2) && WEXITSTATUS(s2) == 0 ? 0 : 1);
    }
    int st = 0;
    waitpid(outer, &st, 0);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
      std::fprintf(stderr, "bench_checkpoint: the export failed\n");
      return 1;
    }
    std::ifstream(a.dir + "/rss") >> export_rss_kib >> export_s;
  }
  const double gib = static_cast<double>(t.total_bytes) / (1ull << 30);
  auto rate = [&](double s) { return static_cast<double>(t.total_bytes) / s / (1 << 20); };
  const double export_bytes = static_cast<double>(fs::file_size(exported));
  const double rss_ratio = static_cast<double>(export_rss_kib) * 1024.0 / static_cast<double>(t.largest_tensor);
  std::printf("state: %.2f GiB (params + exp_avg + exp_avg_sq, fp32) over %d ranks, %d params\n", gib, a.ranks,
              a.params);
  std::printf("save : %7.2f s  %8.1f MiB/s   plain write+fsync: %7.2f s  %8.1f MiB/s   ratio %.2f\n", t.save,
              rate(t.save), t.plain_write, rate(t.plain_write), t.plain_write / t.save);
  std::printf("load : %7.2f s  %8.1f MiB/s   plain read (cold)  : %7.2f s  %8.1f MiB/s   ratio %.2f\n", t.load,
              rate(t.load), t.plain_read, rate(t.plain_read), t.plain_read / t.load);
  std::printf("export: %.2f s, %.1f MiB written, peak RSS %.1f MiB = %.2f x the largest tensor (%.1f MiB)\n",
              export_s, export_bytes / (1 << 20), export_rss_kib / 1024.0, rss_ratio,
              static_cast<double>(t.largest_tensor) / (1 << 20));
  std::printf(
      "{\"bench\": \"checkpoint\", \"ranks\": %d, \"state_gib\": %.3f, \"save_s\": %.3f, \"plain_write_s\": %.3f, "
      "\"save_ratio\": %.3f, \"load_s\": %.3f, \"plain_read_s\": %.3f, \"load_ratio\": %.3f, \"export_s\": %.3f, "
      "\"export_peak_rss_mib\": %.1f, \"largest_tensor_mib\": %.1f, \"export_rss_ratio\": %.3f}\n",
      a.ranks, gib, t.save, t.plain_write, t.plain_write / t.save, t.load, t.plain_read, t.plain_read / t.load,
      export_s, export_rss_kib / 1024.0, static_cast<double>(t.largest_tensor) / (1 << 20), rss_ratio);
  if (own_dir) fs::remove_all(a.dir);
  return 0;
}
