// The memory report (zs_memory_by_kind): every byte the engine's pools hand
// out is in a kind, no allocation is untagged, each kind matches what the
// engine says it holds, and the phases the engine follows by itself (register,
// fetch, push, step, checkpoint) carry their peaks; on 1, 2 and 3 ranks with
// odd sizes, bf16 params (fp32 masters) and AdamW.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/convert.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

constexpr int64_t kSizes[] = {1001, 70000, 333333};  // under and over the pool's 64 KiB and 1 MiB steps

struct Report {
  std::vector<uint64_t> kinds;
  uint64_t total = 0;
};

Report report(zs_context ctx, zs_memory_phase phase) {
  Report r;
  r.kinds.assign(ZS_MEM_KIND_COUNT, 0);
  size_t n = 0;
  EXPECT_EQ(zs_memory_by_kind(ctx, phase, r.kinds.data(), r.kinds.size(), &n, &r.total), ZS_OK) << zs_last_error();
  EXPECT_EQ(n, static_cast<size_t>(ZS_MEM_KIND_COUNT));
  return r;
}

std::string describe(const Report& r) {
  std::string s;
  for (int k = 0; k < ZS_MEM_KIND_COUNT; ++k)
    s += std::string(zs_memory_kind_name(static_cast<zs_memory_kind>(k))) + "=" + std::to_string(r.kinds[k]) + " ";
  return s + "total=" + std::to_string(r.total);
}

// What the pools hand out is the kinds' sum (but aligned I/O buffers and
// the transport's inboxes, outside the pools), within 1%; nothing is untagged.
void expect_accounted(zs_context ctx, const std::string& when) {
  const Report now = report(ctx, ZS_PHASE_NOW);
  uint64_t pooled = 0;
  ASSERT_EQ(zs_memory_pools_in_use(ctx, &pooled), ZS_OK) << zs_last_error();
  const uint64_t kinds = now.total - now.kinds[ZS_MEM_IO_STAGING] - now.kinds[ZS_MEM_INBOXES];
  EXPECT_LE(std::llabs(static_cast<long long>(kinds) - static_cast<long long>(pooled)),
            static_cast<long long>(pooled / 100))
      << when << ": kinds " << describe(now) << " vs pools in use " << pooled;
  EXPECT_EQ(now.kinds[ZS_MEM_UNTAGGED], 0u) << when << ": " << describe(now);
}

zs_memory_phase phase_of(zs_context ctx) {
  zs_memory_phase p = ZS_PHASE_NOW;
  EXPECT_EQ(zs_memory_get_phase(ctx, &p), ZS_OK) << zs_last_error();
  return p;
}

// A size class as the host pool makes it (pool.cpp): 64-byte multiples, 8
// steps per power of two above 1 MiB.
uint64_t size_class(uint64_t bytes) {
  uint64_t size = (bytes + 63) / 64 * 64;
  const uint64_t mib = 1u << 20;
  if (size <= mib) return size;
  uint64_t top = mib;
  while (top <= size / 2) top *= 2;
  const uint64_t step = top / 8;
  return (size + step - 1) / step * step;
}

class MemoryReport : public ::testing::TestWithParam<int> {};

TEST_P(MemoryReport, EveryByteInAKindAndEachPhaseItsPeak) {
  const int world = GetParam();
  const zs::test::TempDir temp("memory_report");
  const std::string& dir = temp.path();
  run_ranks(world, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"bf16": {"enabled": true}})");
    ASSERT_NE(ctx, nullptr);
    ASSERT_EQ(zs_memory_reset_peaks(ctx), ZS_OK);
    const Report before = report(ctx, ZS_PHASE_NOW);
    std::vector<zs_param> ps;
    uint64_t shard_classes = 0, grad_classes = 0, master_classes = 0, gathered_bytes = 0, cached_grad_classes = 0;
    for (size_t k = 0; k < 3; ++k) {
      std::vector<uint16_t> init(static_cast<size_t>(kSizes[k]));
      for (size_t i = 0; i < init.size(); ++i)
        init[i] = zs::kernels::float_to_bf16(0.01f * std::sin(static_cast<float>(i)));
      const std::string name = "p" + std::to_string(k);
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      o.name = name.c_str();
      o.dtype = ZS_BFLOAT16;
      o.ndim = 1;
      o.shape = &kSizes[k];
      o.init = ZS_INIT_FROM_ALL;
      o.data = init.data();
      o.data_bytes = init.size() * 2;
      zs_param p = nullptr;
      ASSERT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
      ps.push_back(p);
      const uint64_t shard = (static_cast<uint64_t>(kSizes[k]) + world - 1) / world;
      shard_classes += size_class(shard * 2);
      gathered_bytes += static_cast<uint64_t>(kSizes[k]) * 2;
      grad_classes += size_class(shard * 4);
      if (shard * 4 >= (64u << 10)) cached_grad_classes += size_class(shard * 4);  // the pool's smallest cached block
      master_classes += size_class(shard * 4);
    }
    EXPECT_EQ(phase_of(ctx), ZS_PHASE_CONSTRUCTION);
    expect_accounted(ctx, "after registering");
    EXPECT_EQ(report(ctx, ZS_PHASE_NOW).kinds[ZS_MEM_SHARDS] - before.kinds[ZS_MEM_SHARDS], shard_classes);

    zs_optimizer opt = nullptr;
    ASSERT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    ASSERT_EQ(zs_optimizer_add_group(opt, ps.data(), ps.size(), &hp, nullptr), ZS_OK) << zs_last_error();
    const Report with_opt = report(ctx, ZS_PHASE_NOW);
    EXPECT_EQ(with_opt.kinds[ZS_MEM_MASTERS] - before.kinds[ZS_MEM_MASTERS], master_classes);
    EXPECT_EQ(with_opt.kinds[ZS_MEM_OPTIMIZER_STATE] - before.kinds[ZS_MEM_OPTIMIZER_STATE], 2 * master_classes);
    expect_accounted(ctx, "with the optimizer");

    for (int step = 0; step < 2; ++step) {
      zs_gather g = nullptr;
      ASSERT_EQ(zs_fetch(&g, ctx, ps.data(), ps.size()), ZS_OK) << zs_last_error();
      ASSERT_EQ(zs_gather_wait(g, 30000), ZS_OK) << zs_last_error();
      EXPECT_EQ(phase_of(ctx), ZS_PHASE_FORWARD);
      // A group of one reads the shard in place: nothing is gathered.
      if (world > 1) {
        EXPECT_GE(report(ctx, ZS_PHASE_NOW).kinds[ZS_MEM_GATHERED], gathered_bytes) << "gathered params counted";
      }
      expect_accounted(ctx, "gathered");
      ASSERT_EQ(zs_release(ctx, ps.data(), ps.size()), ZS_OK) << zs_last_error();
      zs_gather_destroy(g);
      for (size_t k = 0; k < ps.size(); ++k) {
        std::vector<float> grad(static_cast<size_t>(kSizes[k]), 0.001f * static_cast<float>(env.rank + 1));
        ASSERT_EQ(zs_grad_push(ps[k], grad.data(), ZS_FLOAT32, grad.size() * 4), ZS_OK) << zs_last_error();
      }
      EXPECT_EQ(phase_of(ctx), ZS_PHASE_BACKWARD);
      ASSERT_EQ(zs_grad_sync(ctx), ZS_OK) << zs_last_error();
      expect_accounted(ctx, "gradients pushed");
      EXPECT_EQ(report(ctx, ZS_PHASE_NOW).kinds[ZS_MEM_GRADS] - before.kinds[ZS_MEM_GRADS], grad_classes);
      zs_memory_stats before_step = ZS_MEMORY_STATS_INIT, after_step = ZS_MEMORY_STATS_INIT;
      ASSERT_EQ(zs_context_memory(ctx, &before_step), ZS_OK);
      ASSERT_EQ(zs_optimizer_step(opt, nullptr), ZS_OK) << zs_last_error();
      EXPECT_EQ(phase_of(ctx), ZS_PHASE_STEP);
      expect_accounted(ctx, "after the step");
      // The gradients the step freed went back to the system, not into the
      // pool's idle blocks (where they stayed resident through the forward).
      ASSERT_EQ(zs_context_memory(ctx, &after_step), ZS_OK);
      EXPECT_EQ(report(ctx, ZS_PHASE_NOW).kinds[ZS_MEM_GRADS], before.kinds[ZS_MEM_GRADS]);
      EXPECT_LT(after_step.host_cache_bytes, before_step.host_cache_bytes + cached_grad_classes)
          << "idle host blocks " << before_step.host_cache_bytes << " -> " << after_step.host_cache_bytes
          << " across the step: its freed gradients (" << cached_grad_classes << " bytes) kept";
    }
    zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    so.tag = "mem";
    ASSERT_EQ(zs_checkpoint_save(ctx, ps.data(), ps.size(), opt, dir.c_str(), &so), ZS_OK) << zs_last_error();
    EXPECT_EQ(phase_of(ctx), ZS_PHASE_STEP) << "a checkpoint's scope gives the phase back";
    expect_accounted(ctx, "after a save");
    EXPECT_EQ(report(ctx, ZS_PHASE_NOW).kinds[ZS_MEM_IO_STAGING], 0u) << "the save's I/O buffers are freed";

    // Peaks: each phase saw what it used.
    const Report fwd = report(ctx, ZS_PHASE_FORWARD), bwd = report(ctx, ZS_PHASE_BACKWARD),
                 stp = report(ctx, ZS_PHASE_STEP), ckpt = report(ctx, ZS_PHASE_CHECKPOINT);
    EXPECT_GE(fwd.kinds[ZS_MEM_GATHERED], world > 1 ? gathered_bytes : 0) << describe(fwd);
    EXPECT_GT(bwd.kinds[ZS_MEM_GRADS], 0u) << describe(bwd);
    if (world > 1) {
      EXPECT_GT(bwd.kinds[ZS_MEM_REDUCE_BUCKETS], 0u) << describe(bwd);
    }
    EXPECT_GE(stp.kinds[ZS_MEM_MASTERS], master_classes) << describe(stp);
    EXPECT_GT(ckpt.kinds[ZS_MEM_IO_STAGING], 0u) << describe(ckpt);
    for (const Report* r : {&fwd, &bwd, &stp, &ckpt}) {
      uint64_t max_kind = 0;
      for (uint64_t v : r->kinds) max_kind = std::max(max_kind, v);
      EXPECT_GE(r->total, max_kind) << "a phase's total peak is at least its largest kind's";
    }

    // Set by hand, and refused out of range.
    ASSERT_EQ(zs_memory_set_phase(ctx, ZS_PHASE_FORWARD), ZS_OK);
    EXPECT_EQ(phase_of(ctx), ZS_PHASE_FORWARD);
    EXPECT_EQ(zs_memory_set_phase(ctx, static_cast<zs_memory_phase>(9)), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("memory phase 9"), std::string::npos) << zs_last_error();
    uint64_t one = 0;
    EXPECT_EQ(zs_memory_by_kind(ctx, static_cast<zs_memory_phase>(5), &one, 1, nullptr, nullptr),
              ZS_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(zs_memory_by_kind(ctx, ZS_PHASE_NOW, nullptr, 3, nullptr, nullptr), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_STREQ(zs_memory_kind_name(ZS_MEM_REDUCE_BUCKETS), "reduce_buckets");
    EXPECT_STREQ(zs_memory_phase_name(ZS_PHASE_CHECKPOINT), "checkpoint");
    EXPECT_EQ(zs_memory_kind_name(ZS_MEM_KIND_COUNT), nullptr);

    zs_optimizer_destroy(opt);
    for (auto p : ps) zs_param_destroy(p);
    const Report after = report(ctx, ZS_PHASE_NOW);
    for (int k = 0; k < ZS_MEM_KIND_COUNT; ++k) {
      if (k == ZS_MEM_COMM_STAGING) continue;  // transports keep their staging while the context lives
      EXPECT_EQ(after.kinds[k], before.kinds[k]) << zs_memory_kind_name(static_cast<zs_memory_kind>(k))
                                                 << " not given back: " << describe(after);
    }
    zs_context_destroy(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, MemoryReport, ::testing::Values(1, 2, 3));

}  // namespace
