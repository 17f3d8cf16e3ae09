// Healing's peer copy (docs/healing.md, landing step 1): what keeping a
// replica of each rank's optimizer state in its holder's memory costs, per
// step and in memory. N loopback ranks train a stack of fp32 params with
// AdamW (push every gradient, zs_optimizer_step), with
// zeroshard.healing.peer_copy off and on in alternating runs (off, on,
// off, on, ...), and print the median step time of each, their ratio, the
// time of the step call alone, what zs_step_stats says the copy took on the
// step's path and its replay on the copy's own thread (medians, on), and
// ZS_MEM_PEER_COPIES against this rank's own state (shards + moments, S) and
// gradient shards (G). Figures and ratios, never pass/fail. The last line is
// one JSON object.
//
//   build/bin/bench_heal_copy [--ranks 3] [--melems 8] [--steps 8] [--runs 2] [--blob-kb 0]
//
// blob-kb: with the copies on, each step first sets a per-rank blob of that
// many KiB (zs_heal_set_rank_state, as zeroshard.torch sets its RNG states
// and TRL's GRPO its buffered completions), which rides in the step's copy
// to the holder; the time of the set call alone is printed too.
//
// melems: the model's params, in millions of fp32 elements (in params of
// about 1M, odd sizes). Each run is a fresh world (its first step, which
// seeds the holders, is timed apart and left out of the median).
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
  int ranks = 3;
  int melems = 8;
  int steps = 8;
  int runs = 2;
  int blob_kb = 0;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Result {
  double step_s = 0;       // median push + step
  double opt_s = 0;        // median zs_optimizer_step alone
  double first_s = 0;      // the first step (seeds the holder when on)
  double blob_s = 0;       // median zs_heal_set_rank_state alone (--blob-kb)
  double peer_bytes = 0;   // ZS_MEM_PEER_COPIES
  double state_bytes = 0;  // this rank's shards + optimizer state
  double grad_bytes = 0;   // its gradient shards
  // zs_step_stats, on: the copy on the step's path, the bytes received into
  // the replica, the replay on the copy's thread (medians after the first)
  double copy_s = 0, copy_bytes = 0, replay_s = 0;
};

Result run(int rank, const Args& a, bool heal, int port) {
  const std::string cfg = std::string(R"({"zeroshard": {"healing": {"peer_copy": )") + (heal ? "true" : "false") +
                          "}}}";
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = a.ranks;
  o.local_rank = rank;
  o.local_world_size = a.ranks;
  o.store_host = "127.0.0.1";
  o.store_port = port;
  o.config_json = cfg.c_str();
  zs_context ctx;
  CHECK(zs_context_create(&ctx, &o));
  std::vector<zs_param> ps;
  std::vector<std::vector<float>> grads;
  Result r;
  const uint64_t total = static_cast<uint64_t>(a.melems) * 1000000;
  uint64_t have = 0;
  for (int i = 0; have < total; ++i) {
    const int64_t numel = 1000003 + 2 * i;  // odd: padded shards
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(i);
    po.name = name.c_str();
    po.dtype = ZS_FLOAT32;
    po.ndim = 1;
    po.shape = &numel;
    zs_param p;
    CHECK(zs_param_register(&p, ctx, &po));
    ps.push_back(p);
    std::vector<float> g(static_cast<size_t>(numel));
    for (size_t k = 0; k < g.size(); ++k)
      g[k] = static_cast<float>((k * 2654435761u + static_cast<size_t>(rank) * 97 + static_cast<size_t>(i)) % 2001) *
                 1e-5f - 0.01f;
    grads.push_back(std::move(g));
    have += static_cast<uint64_t>(numel);
  }
  zs_optimizer opt;
  CHECK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  CHECK(zs_optimizer_add_group(opt, ps.data(), ps.size(), &hp, nullptr));
  std::vector<double> steps, opts, blobs, copies, copy_bytes, replays;
  std::vector<char> blob(static_cast<size_t>(a.blob_kb) * 1024);
  for (int s = 0; s <= a.steps; ++s) {
    const double t0 = now_s();
    if (heal && !blob.empty()) {
      blob[static_cast<size_t>(s) % blob.size()] = static_cast<char>(s);  // a new blob each step
      CHECK(zs_heal_set_rank_state(opt, blob.data(), blob.size()));
      if (s > 0) blobs.push_back(now_s() - t0);
    }
    for (size_t i = 0; i < ps.size(); ++i)
      CHECK(zs_grad_push(ps[i], grads[i].data(), ZS_FLOAT32, grads[i].size() * 4));
    const double t1 = now_s();
    CHECK(zs_optimizer_step(opt, nullptr));
    const double t2 = now_s();
    if (s == 0) {
      r.first_s = t2 - t0;
    } else {
      steps.push_back(t2 - t0);
      opts.push_back(t2 - t1);
      zs_step_stats st = ZS_STEP_STATS_INIT;
      CHECK(zs_context_step_stats(ctx, &st));
      copies.push_back(st.peer_copy_seconds);
      copy_bytes.push_back(static_cast<double>(st.peer_copy_bytes));
      if (s > 1) replays.push_back(st.replay_seconds);  // the first step's replay ends in the second's copy
    }
  }
  r.copy_s = zs::bench::median(copies);
  r.copy_bytes = zs::bench::median(copy_bytes);
  r.replay_s = replays.empty() ? 0.0 : zs::bench::median(replays);
  r.step_s = zs::bench::median(steps);
  r.opt_s = zs::bench::median(opts);
  r.blob_s = blobs.empty() ? 0.0 : zs::bench::median(blobs);
  uint64_t kinds[ZS_MEM_KIND_COUNT] = {};
  CHECK(zs_memory_by_kind(ctx, ZS_PHASE_NOW, kinds, ZS_MEM_KIND_COUNT, nullptr, nullptr));
  r.peer_bytes = static_cast<double>(kinds[ZS_MEM_PEER_COPIES]);
  r.state_bytes = static_cast<double>(kinds[ZS_MEM_SHARDS] + kinds[ZS_MEM_MASTERS] + kinds[ZS_MEM_OPTIMIZER_STATE]);
  // The gradient shards are freed by the step: their size from the layout.
  for (auto p : ps) {
    zs_param_info info = ZS_PARAM_INFO_INIT;
    CHECK(zs_param_get_info(p, &info));
    r.grad_bytes += static_cast<double>(info.shard_numel * 4);
  }
  CHECK(zs_optimizer_destroy(opt));
  for (auto p : ps) CHECK(zs_param_destroy(p));
  CHECK(zs_context_destroy(ctx));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--ranks") a.ranks = v;
    else if (k == "--melems") a.melems = v;
    else if (k == "--steps") a.steps = v;
    else if (k == "--runs") a.runs = v;
    else if (k == "--blob-kb") a.blob_kb = v;
    else {
      std::fprintf(stderr, "unknown option %s\nusage: bench_heal_copy [--ranks N] [--melems M] [--steps S] [--runs R] "
                   "[--blob-kb K]\n",
                   k.c_str());
      return 2;
    }
  }
  if (a.ranks < 2 || a.melems < 1 || a.steps < 1 || a.runs < 1 || a.blob_kb < 0) {
    std::fprintf(stderr, "bench_heal_copy: --ranks must be >= 2, --blob-kb >= 0, the other options >= 1\n");
    return 2;
  }
  std::vector<double> off_step, on_step, off_opt, on_opt, off_first, on_first, on_blob, on_copy, on_replay;
  Result last_on;
  for (int run_i = 0; run_i < 2 * a.runs; ++run_i) {
    const bool heal = run_i % 2 == 1;
    const int port = zs::bench::free_port();
    Result res;
    if (!zs::bench::fork_ranks_collect(a.ranks, &res, [&](int r, Result* mine) { *mine = run(r, a, heal, port); })) {
      std::fprintf(stderr, "bench_heal_copy: a rank failed (peer_copy %s)\n", heal ? "on" : "off");
      return 1;
    }
    (heal ? on_step : off_step).push_back(res.step_s);
    (heal ? on_opt : off_opt).push_back(res.opt_s);
    (heal ? on_first : off_first).push_back(res.first_s);
    if (heal) {
      on_blob.push_back(res.blob_s);
      on_copy.push_back(res.copy_s);
      on_replay.push_back(res.replay_s);
      last_on = res;
    }
  }
  const double off = zs::bench::median(off_step), on = zs::bench::median(on_step);
  const double off_o = zs::bench::median(off_opt), on_o = zs::bench::median(on_opt);
  const double off_f = zs::bench::median(off_first), on_f = zs::bench::median(on_first);
  const double blob_set = zs::bench::median(on_blob);
  const double copy = zs::bench::median(on_copy), replay = zs::bench::median(on_replay);
  const double mib = 1 << 20;
  std::printf("AdamW on %d fp32 params of ~1M (%d M elements), %d loopback ranks, %d runs each way alternating, "
              "median of %d steps after the first (rank 0):\n",
              static_cast<int>((static_cast<uint64_t>(a.melems) * 1000000 + 1000002) / 1000003), a.melems, a.ranks,
              a.runs, a.steps);
  if (a.blob_kb > 0)
    std::printf("  on: each step sets a %d KiB per-rank blob first (zs_heal_set_rank_state: %.3f ms), in the step\n",
                a.blob_kb, blob_set * 1e3);
  std::printf("  step (push + zs_optimizer_step)  off %8.2f ms  on %8.2f ms  (on/off %.3f, +%.1f%%)\n", off * 1e3,
              on * 1e3, on / off, (on / off - 1) * 100);
  std::printf("  zs_optimizer_step alone          off %8.2f ms  on %8.2f ms  (on/off %.3f)\n", off_o * 1e3,
              on_o * 1e3, on_o / off_o);
  std::printf("  first step (on: seeds the holder) off %7.2f ms  on %8.2f ms  (on/off %.3f)\n", off_f * 1e3,
              on_f * 1e3, on_f / off_f);
  std::printf("  on, from zs_step_stats: the copy on the step's path %.2f ms (%.1f MiB received), the replay on its "
              "own thread %.2f ms\n", copy * 1e3, last_on.copy_bytes / mib, replay * 1e3);
  std::printf("  peer_copies %.1f MiB = %.3f x (own state S %.1f MiB + gradient shards G %.1f MiB)\n",
              last_on.peer_bytes / mib, last_on.peer_bytes / (last_on.state_bytes + last_on.grad_bytes),
              last_on.state_bytes / mib, last_on.grad_bytes / mib);
  std::printf("{\"bench\":\"heal_copy\",\"ranks\":%d,\"melems\":%d,\"steps\":%d,\"runs\":%d,\"blob_kb\":%d,"
              "\"blob_set_ms\":%.4f,\"step_ms_off\":%.3f,"
              "\"step_ms_on\":%.3f,\"step_ratio\":%.4f,\"optimizer_ms_off\":%.3f,\"optimizer_ms_on\":%.3f,"
              "\"first_step_ms_off\":%.3f,\"first_step_ms_on\":%.3f,\"peer_copies_bytes\":%.0f,\"state_bytes\":%.0f,"
              "\"grad_bytes\":%.0f,\"peer_copies_over_s_plus_g\":%.4f,\"copy_ms\":%.3f,\"copy_bytes\":%.0f,"
              "\"replay_ms\":%.3f}\n",
              a.ranks, a.melems, a.steps, a.runs, a.blob_kb, blob_set * 1e3, off * 1e3, on * 1e3, on / off, off_o * 1e3, on_o * 1e3, off_f * 1e3,
              on_f * 1e3, last_on.peer_bytes, last_on.state_bytes, last_on.grad_bytes,
              last_on.peer_bytes / (last_on.state_bytes + last_on.grad_bytes), copy * 1e3, last_on.copy_bytes,
              replay * 1e3);
  return 0;
}
