// What an optimizer step did, from zs_context_step_stats, and the ZS_TRACE
// timeline: on 2 real ranks the step's gathers and reductions moved exactly
// the bytes the params' shards account for, and every collective, wait and
// optimizer step is on each rank's Chrome trace. And the bytes by kind of
// zs_context_fetch_stats, quantized or not.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "impl/partition/quant_packet.h"
#include "kernels/quant.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// Params p0, p1, p2 of the given sizes; adds up this rank's shard bytes
// and what qwZ (the default int8, blocks of 256) would send of them: the
// packets, and the shards no larger than their packets, which travel exact.
void register_three(zs_context ctx, const int64_t sizes[3], zs_param p[3], uint64_t* shard_bytes,
                    uint64_t* packet_bytes = nullptr, uint64_t* qwz_exact_bytes = nullptr) {
  for (int k = 0; k < 3; ++k) {
    zs_param_options o = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(k);
    o.name = name.c_str();
    o.ndim = 1;
    o.shape = &sizes[k];
    o.init = ZS_INIT_NORMAL;
    ZS_ASSERT_OK(zs_param_register(&p[k], ctx, &o));
    zs_param_info info = ZS_PARAM_INFO_INIT;
    ZS_ASSERT_OK(zs_param_get_info(p[k], &info));
    const uint64_t shard = info.shard_numel * sizeof(float);
    const uint64_t packet = zs::quant_packet(info.shard_numel, zs::kernels::QuantSpec{}).bytes;
    *shard_bytes += shard;
    if (packet_bytes && packet < shard) *packet_bytes += packet;
    if (qwz_exact_bytes && packet >= shard) *qwz_exact_bytes += shard;
  }
}

// One training step of the three params: fetch and release them in one
// coordinated step, push a gradient to each, step the optimizer.
void one_step(zs_context ctx, zs_optimizer opt, const int64_t sizes[3], zs_param p[3]) {
  ZS_ASSERT_OK(zs_step_begin(ctx));
  ZS_ASSERT_OK(zs_coord_fetch(ctx, p, 3));
  ZS_ASSERT_OK(zs_coord_release(ctx, p, 3));
  ZS_ASSERT_OK(zs_step_end(ctx));
  for (int k = 0; k < 3; ++k) {
    std::vector<float> g(static_cast<size_t>(sizes[k]), 0.25f);
    ZS_ASSERT_OK(zs_grad_push(p[k], g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
  }
  zs_step_result r = ZS_STEP_RESULT_INIT;
  ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
}

// Three params of over 64 KiB of gradient in all (the step's reduce-scatter
// and the norm's all-reduce: a smaller step reduces in one exchange,
// GradFusionTiny) and an AdamW over them, defaults.
struct ThreeUnderAdamW {
  const int64_t sizes[3] = {20001, 64, 7};
  zs_param p[3] = {};
  uint64_t shard_bytes = 0;  // this rank's, of the three
  zs_optimizer opt = nullptr;

  explicit ThreeUnderAdamW(zs_context ctx) {
    register_three(ctx, sizes, p, &shard_bytes);
    EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    EXPECT_EQ(zs_optimizer_add_group(opt, p, 3, &hp, nullptr), ZS_OK) << zs_last_error();
  }
  void step(zs_context ctx) { one_step(ctx, opt, sizes, p); }
  void destroy() {
    ZS_ASSERT_OK(zs_optimizer_destroy(opt));
    for (auto& q : p) ZS_ASSERT_OK(zs_param_destroy(q));
  }
};

}  // namespace

TEST(StepStats, BytesOfTheStepAndTheTimeline) {
  const std::string trace = "/tmp/zs_trace_" + std::to_string(getpid()) + "_%r.json";
  run_ranks(2, [&](const RankEnv& env) {
    setenv("ZS_TRACE", trace.c_str(), 1);
    zs_context ctx = zs::test::make_context(
        env, R"({"zero_optimization": {"stage3_param_persistence_threshold": 0}})");
    ThreeUnderAdamW m(ctx);
    const uint64_t shard_bytes = m.shard_bytes;
    zs_step_stats st = ZS_STEP_STATS_INIT;
    ZS_ASSERT_OK(zs_context_step_stats(ctx, &st));
    EXPECT_EQ(st.step, 0) << "no step yet";
    for (int step = 0; step < 3; ++step) m.step(ctx);
    ZS_ASSERT_OK(zs_context_step_stats(ctx, &st));
    EXPECT_EQ(st.step, 3);
    // One coalesced gather of the three params, one bucket reduced: each
    // moved this rank's shard bytes from the other rank, and back.
    EXPECT_EQ(st.gathers, 1u);
    EXPECT_EQ(st.gather_bytes, shard_bytes);
    EXPECT_EQ(st.reduce_scatters, 1u);
    EXPECT_EQ(st.reduce_scatter_bytes, shard_bytes);
    // The coordinator's check at step_end (48 bytes: the trace's and the
    // kept list's hashes and the trainer's token, and their complements), and one
    // all-reduce of 34 floats for the optimizers' agreement check (32), the
    // gradient norm and the overflow count: a ring all-reduce moves
    // 2(n-1)/n of each.
    EXPECT_EQ(st.allreduce_bytes, 48u + 34u * 4u);
    EXPECT_GT(st.step_seconds, 0.0);
    EXPECT_GT(st.optimizer_seconds, 0.0);
    EXPECT_LT(st.optimizer_seconds, st.step_seconds);
    EXPECT_GE(st.wait_seconds, 0.0);
    // No peer copy: healing is off.
    EXPECT_EQ(st.peer_copy_seconds, 0.0);
    EXPECT_EQ(st.peer_copy_bytes, 0u);
    EXPECT_EQ(st.replay_seconds, 0.0);
    m.destroy();
    ZS_ASSERT_OK(zs_context_destroy(ctx));

    // The timeline, closed by the context's end, is valid JSON.
    std::string path = trace;
    path.replace(path.find("%r"), 2, std::to_string(env.rank));
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << path;
    std::stringstream text;
    text << in.rdbuf();
    const auto events = nlohmann::json::parse(text.str());
    std::set<std::string> names, lanes;
    for (const auto& e : events) {
      if (!e.contains("ph")) continue;
      if (e["ph"] == "X") names.insert(e["name"].get<std::string>());
      if (e["ph"] == "M" && e["name"] == "thread_name") lanes.insert(e["args"]["name"].get<std::string>());
      if (e["ph"] == "X") {
        EXPECT_EQ(e["pid"], env.rank);
      }
    }
    for (const char* n : {"coalesced all-gather of 3", "reduce-scatter", "all-reduce", "update",
                          "optimizer step"})
      EXPECT_TRUE(names.count(n)) << "no '" << n << "' event in " << path;
    EXPECT_TRUE(lanes.count("world")) << path;
    EXPECT_TRUE(lanes.count("optimizer")) << path;
    std::remove(path.c_str());
  });
}

// Healing's peer copy in the step's figures (2 ranks, each the other's
// holder): the first step's copy seeds the replica (params' shards and the
// AdamW state besides the gradients: more bytes), every later one brings
// the source's gradient shards, exactly this rank's shard bytes (shards are
// of one size on every rank); from the second step on, the replay of the
// source's last step has run (on the copy's thread) and is timed.
TEST(StepStats, ThePeerCopysTimeAndBytes) {
  run_ranks(2, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(
        env, R"({"zero_optimization": {"stage3_param_persistence_threshold": 0},
                 "zeroshard": {"healing": {"peer_copy": true}}})");
    ThreeUnderAdamW m(ctx);
    zs_step_stats st = ZS_STEP_STATS_INIT;
    m.step(ctx);
    ZS_ASSERT_OK(zs_context_step_stats(ctx, &st));
    EXPECT_GT(st.peer_copy_bytes, 3 * m.shard_bytes) << "the seed: shards, moments and gradients";
    EXPECT_GT(st.peer_copy_seconds, 0.0);
    EXPECT_EQ(st.replay_seconds, 0.0) << "nothing replayed before the first step";
    for (int step = 0; step < 2; ++step) m.step(ctx);
    ZS_ASSERT_OK(zs_context_step_stats(ctx, &st));
    EXPECT_EQ(st.step, 3);
    EXPECT_EQ(st.peer_copy_bytes, m.shard_bytes);
    EXPECT_GT(st.peer_copy_seconds, 0.0);
    EXPECT_LT(st.peer_copy_seconds, st.step_seconds);
    EXPECT_GT(st.replay_seconds, 0.0);
    m.destroy();
    ZS_ASSERT_OK(zs_context_destroy(ctx));
  });
}

// zs_context_fetch_stats: the bytes each kind of collective sent and
// received since the context was made, qwZ's packets and qgZ's all-to-all
// apart from the full-precision gathers and reduce-scatters they replace.
// One step of three params on 2 and 3 ranks, each way of moving them.
class FetchStatsBytes : public ::testing::TestWithParam<int> {};

TEST_P(FetchStatsBytes, ByKindQuantizedOrNot) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  const int world = GetParam();
  struct Case {
    const char* name;
    bool qwz, qgz;
  };
  for (const Case c : {Case{"plain", false, false}, Case{"qwZ", true, false}, Case{"qgZ", false, true},
                       Case{"qwZ+qgZ", true, true}}) {
    run_ranks(world, [&](const RankEnv& env) {
      const std::string config = std::string(R"({"zero_optimization": {"stage3_param_persistence_threshold": 0,
          "zero_quantized_weights": )") + (c.qwz ? "true" : "false") +
                                 R"(, "zero_quantized_gradients": )" + (c.qgz ? "true" : "false") + "}}";
      zs_context ctx = zs::test::make_context(env, config.c_str());
      // Under qwZ, 7 travels exact; over 64 KiB of gradient, so that the
      // step reduce-scatters (GradFusionTiny has the smaller steps).
      const int64_t sizes[3] = {20001, 640, 7};
      zs_param p[3];
      uint64_t shard_bytes = 0, packet_bytes = 0, qwz_exact_bytes = 0;
      register_three(ctx, sizes, p, &shard_bytes, &packet_bytes, &qwz_exact_bytes);
      ASSERT_GT(qwz_exact_bytes, 0u);
      ASSERT_GT(packet_bytes, 0u);
      zs_optimizer opt = nullptr;
      ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
      zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
      ZS_ASSERT_OK(zs_optimizer_add_group(opt, p, 3, &hp, nullptr));
      zs_fetch_stats before = ZS_FETCH_STATS_INIT;
      ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &before));
      one_step(ctx, opt, sizes, p);
      zs_fetch_stats s = ZS_FETCH_STATS_INIT;
      ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &s));
      const uint64_t peers = static_cast<uint64_t>(world - 1);
      const std::string why = std::string(c.name) + " on " + std::to_string(world) + " ranks";
      // Ring gathers: this rank's unit to each peer, each peer's to it.
      const uint64_t gather = (c.qwz ? qwz_exact_bytes : shard_bytes) * peers,
                     qgather = c.qwz ? packet_bytes * peers : 0;
      EXPECT_EQ(s.gather_bytes_sent - before.gather_bytes_sent, gather) << why;
      EXPECT_EQ(s.gather_bytes_received - before.gather_bytes_received, gather) << why;
      EXPECT_EQ(s.quantized_gather_bytes_sent - before.quantized_gather_bytes_sent, qgather) << why;
      EXPECT_EQ(s.quantized_gather_bytes_received - before.quantized_gather_bytes_received, qgather) << why;
      const uint64_t rs = s.reduce_scatter_bytes_sent - before.reduce_scatter_bytes_sent;
      const uint64_t qr = s.quantized_reduce_bytes_sent - before.quantized_reduce_bytes_sent;
      EXPECT_EQ(rs, c.qgz ? 0 : shard_bytes * peers) << why;
      EXPECT_EQ(s.reduce_scatter_bytes_received - before.reduce_scatter_bytes_received, rs) << why;
      EXPECT_EQ(s.quantized_reduce_bytes_received - before.quantized_reduce_bytes_received, qr) << why;
      if (c.qgz) {  // int4 codes and a scale per block: well under a quarter of fp32
        EXPECT_GT(qr, 0u) << why;
        EXPECT_LT(qr, shard_bytes * peers / 4) << why;
      } else {
        EXPECT_EQ(qr, 0u) << why;
      }
      EXPECT_GT(s.allreduce_bytes_sent, before.allreduce_bytes_sent) << why << ": the norm, the checks";
      EXPECT_EQ(s.allreduce_bytes_sent, s.allreduce_bytes_received) << why;
      ZS_ASSERT_OK(zs_optimizer_destroy(opt));
      for (auto& q : p) ZS_ASSERT_OK(zs_param_destroy(q));
      ZS_ASSERT_OK(zs_context_destroy(ctx));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FetchStatsBytes, ::testing::Values(2, 3));
