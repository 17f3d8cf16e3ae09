// Checkpoint benchmark: collective save and load of a model's params and
// AdamW state against a plain sequential write (+ fsync) and read of the
// same bytes per rank (read into memory of its own; buffered, as cat or
// numpy read, and O_DIRECT, as the engine reads), on the same disk in the
// same run; and the peak RSS of a consolidated export against its largest
// tensor.
//
//   build/bin/bench_checkpoint [--ranks 2] [--gib 2] [--params 8] [--reps 3] [--dir DIR]
//
// Forks its own ranks over loopback. Each rep times all of them, in
// alternating order; ratios are per rep, and the median is reported.
// Before every read, the files' pages are dropped from the page cache
// (posix_fadvise DONTNEED after fsync), so every read comes from the disk
// alike. Prints figures and ratios; the last line is one JSON object.
// Never fails on time.
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
  int reps = 3;
  std::string dir;
  int port = 0;
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
// `direct`: O_DIRECT into aligned memory, the way the engine's load reads
// (falls back to buffered where the filesystem refuses).
void plain_read(const std::string& path, uint64_t bytes, bool direct) {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, bytes + 4096) != 0) std::exit(1);
  char* buf = static_cast<char*>(mem);
  int fd = direct ? open(path.c_str(), O_RDONLY | O_DIRECT) : -1;
  if (fd < 0) fd = open(path.c_str(), O_RDONLY);
  for (uint64_t at = 0; at < bytes;) {
    const ssize_t n = read(fd, buf + at, static_cast<size_t>(std::min<uint64_t>(8u << 20, bytes - at)));
    if (n <= 0) break;
    at += static_cast<uint64_t>(n);
  }
  close(fd);
  std::free(mem);
}

constexpr int kMaxReps = 16;

// Rank 0's timings, one per rep; sent back to the parent as plain bytes.
struct Times {
  int reps = 0;
  double plain_write[kMaxReps], save[kMaxReps], plain_read[kMaxReps], direct_read[kMaxReps], load[kMaxReps];
  uint64_t rank_bytes = 0, total_bytes = 0, largest_tensor = 0;
};

// Times fn on every rank, between barriers.
template <typename Fn>
double timed(zs_context ctx, Fn&& fn) {
  barrier(ctx);
  const double t0 = now();
  fn();
  barrier(ctx);
  return now() - t0;
}

void rank_main(const Args& a, int rank, Times* t) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.local_rank = rank;
  o.local_world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = a.port;
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

  for (zs_param p : params) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    CHECK(zs_param_get_info(p, &info));
    t->rank_bytes += info.shard_valid * 12;
    t->largest_tensor = std::max<uint64_t>(t->largest_tensor, info.numel * 4);
    t->total_bytes += info.numel * 12;
  }
  const std::string plain = a.dir + "/plain-" + std::to_string(rank);
  const std::string ckpt = a.dir + "/ckpt";
  auto drop_all = [&] {
    drop_cache(plain);
    if (rank == 0) drop_cache_tree(ckpt);
  };
  t->reps = a.reps;
  for (int r = 0; r < a.reps; ++r) {
    if (rank == 0) fs::remove_all(ckpt);  // one checkpoint on the disk at a time
    // Alternate which goes first, so a drift of the shared disk or CPU
    // over a rep does not favour either.
    const bool plain_first = r % 2 == 0;
    auto write_plain = [&] { t->plain_write[r] = timed(ctx, [&] { plain_write(plain, t->rank_bytes); }); };
    auto save = [&] {
      t->save[r] = timed(ctx, [&] {
        zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
        so.tag = "bench";
        CHECK(zs_checkpoint_save(ctx, params.data(), params.size(), opt, ckpt.c_str(), &so));
      });
    };
    auto read_plain = [&] {
      drop_all();
      t->plain_read[r] = timed(ctx, [&] { plain_read(plain, t->rank_bytes, false); });
      drop_all();
      t->direct_read[r] = timed(ctx, [&] { plain_read(plain, t->rank_bytes, true); });
    };
    auto load = [&] {
      drop_all();
      t->load[r] = timed(ctx, [&] {
        zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
        CHECK(zs_checkpoint_load(ctx, params.data(), params.size(), opt, ckpt.c_str(), &lo, nullptr));
      });
    };
    if (plain_first) write_plain(), save(), read_plain(), load();
    else save(), write_plain(), load(), read_plain();
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
    else if (k == "--reps" && v) a.reps = std::atoi(argv[++i]);
    else if (k == "--dir" && v) a.dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_checkpoint [--ranks N] [--gib G] [--params P] [--reps R] [--dir DIR]\n");
      return 2;
    }
  }
  if (a.reps < 1 || a.reps > kMaxReps) {
    std::fprintf(stderr, "bench_checkpoint: --reps must be 1..%d, not %d\n", kMaxReps, a.reps);
    return 2;
  }
  bool own_dir = false;
  if (a.dir.empty()) {
    char tmpl[] = "/tmp/zs_bench_ckpt_XXXXXX";
    a.dir = mkdtemp(tmpl);
    own_dir = true;
  }
  a.port = zs::bench::free_port();
  Times t;
  if (!zs::bench::fork_ranks_collect(a.ranks, &t, [&](int rank, Times* mine) { rank_main(a, rank, mine); })) {
    std::fprintf(stderr, "bench_checkpoint: a rank failed\n");
    return 1;
  }

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
  std::vector<double> save_r, load_r, load_direct_r, pw, sv, pr, dr, ld;
  std::printf("state: %.2f GiB (params + exp_avg + exp_avg_sq, fp32) over %d ranks, %d params, %d reps\n", gib,
              a.ranks, a.params, t.reps);
  for (int r = 0; r < t.reps; ++r) {
    save_r.push_back(t.plain_write[r] / t.save[r]);
    load_r.push_back(t.plain_read[r] / t.load[r]);
    load_direct_r.push_back(t.direct_read[r] / t.load[r]);
    pw.push_back(t.plain_write[r]), sv.push_back(t.save[r]), pr.push_back(t.plain_read[r]);
    dr.push_back(t.direct_read[r]), ld.push_back(t.load[r]);
    std::printf("rep %d: save %.2f s, plain write+fsync %.2f s (ratio %.2f); load %.2f s, plain read %.2f s "
                "(ratio %.2f), plain O_DIRECT read %.2f s (ratio %.2f)\n",
                r, t.save[r], t.plain_write[r], save_r.back(), t.load[r], t.plain_read[r], load_r.back(),
                t.direct_read[r], load_direct_r.back());
  }
  using zs::bench::median;
  std::printf("median save : %7.2f s  %8.1f MiB/s   plain write+fsync: %7.2f s  %8.1f MiB/s   ratio %.2f\n",
              median(sv), rate(median(sv)), median(pw), rate(median(pw)), median(save_r));
  std::printf("median load : %7.2f s  %8.1f MiB/s   plain read (cold): %7.2f s  %8.1f MiB/s   ratio %.2f\n",
              median(ld), rate(median(ld)), median(pr), rate(median(pr)), median(load_r));
  std::printf("               plain O_DIRECT read (cold): %7.2f s  %8.1f MiB/s   ratio %.2f\n", median(dr),
              rate(median(dr)), median(load_direct_r));
  std::printf("export: %.2f s, %.1f MiB written, peak RSS %.1f MiB = %.2f x the largest tensor (%.1f MiB)\n",
              export_s, export_bytes / (1 << 20), export_rss_kib / 1024.0, rss_ratio,
              static_cast<double>(t.largest_tensor) / (1 << 20));
  std::printf(
      "{\"bench\": \"checkpoint\", \"ranks\": %d, \"state_gib\": %.3f, \"reps\": %d, \"save_s\": %.3f, "
      "\"plain_write_s\": %.3f, \"save_ratio\": %.3f, \"load_s\": %.3f, \"plain_read_s\": %.3f, "
      "\"load_ratio\": %.3f, \"plain_direct_read_s\": %.3f, \"load_direct_ratio\": %.3f, \"export_s\": %.3f, "
      "\"export_peak_rss_mib\": %.1f, \"largest_tensor_mib\": %.1f, \"export_rss_ratio\": %.3f}\n",
      a.ranks, gib, t.reps, median(sv), median(pw), median(save_r), median(ld), median(pr), median(load_r),
      median(dr), median(load_direct_r), export_s, export_rss_kib / 1024.0,
      static_cast<double>(t.largest_tensor) / (1 << 20), rss_ratio);
  if (own_dir) fs::remove_all(a.dir);
  return 0;
}
