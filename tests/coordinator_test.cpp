// The fetch coordinator on real ranks: the trace makes later steps gather
// ahead, persistence / max-live / reuse distance show in its counters, a
// changed order re-records without a hang, and leaf groups keep ranks that
// route to different experts in step.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "impl/fetch/coordinator.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

constexpr int kLayers = 8;
constexpr int64_t kRows = 64, kCols = 65;  // weight 4160 elements, bias 64

struct Model {
  std::vector<zs_param> weights, biases;
  zs_param layer(int l, int k) const { return k == 0 ? weights[l] : biases[l]; }
};

float expected(int l, int k, uint64_t i) { return static_cast<float>(l * 1000 + k * 100) + static_cast<float>(i % 97); }

Model build(zs_context ctx) {
  Model m;
  for (int l = 0; l < kLayers; ++l) {
    for (int k = 0; k < 2; ++k) {
      const int64_t shape[2] = {kRows, kCols};
      const uint64_t n = k == 0 ? kRows * kCols : kRows;
      std::vector<float> data(n);
      for (uint64_t i = 0; i < n; ++i) data[i] = expected(l, k, i);
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      const std::string name = "layer" + std::to_string(l) + (k == 0 ? ".w" : ".b");
      o.name = name.c_str();
      o.ndim = k == 0 ? 2 : 1;
      o.shape = shape;
      o.init = ZS_INIT_FROM_ALL;
      o.data = data.data();
      o.data_bytes = n * 4;
      zs_param p = nullptr;
      EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
      (k == 0 ? m.weights : m.biases).push_back(p);
    }
  }
  return m;
}

// Fetch layer l, check its values, push its gradients when asked (a
// backward's use), release it.
void use_layer(zs_context ctx, const Model& m, int l, bool push_grads = false) {
  zs_param unit[2] = {m.weights[l], m.biases[l]};
  ZS_ASSERT_OK(zs_coord_fetch(ctx, unit, 2));
  for (int k = 0; k < 2; ++k) {
    void* d = nullptr;
    ZS_ASSERT_OK(zs_param_data(unit[k], &d));
    const uint64_t n = k == 0 ? kRows * kCols : kRows;
    for (uint64_t i = 0; i < n; i += 13) ASSERT_EQ(static_cast<float*>(d)[i], expected(l, k, i));
    if (push_grads) {
      const std::vector<float> grad(n, 0.5f);
      ZS_ASSERT_OK(zs_grad_push(unit[k], grad.data(), ZS_FLOAT32, n * 4));
    }
  }
  ZS_ASSERT_OK(zs_coord_release(ctx, unit, 2));
}

// Forward through the layers, backward in reverse; push_grads: the
// backward pushes gradients (a step that pushed none keeps params across
// its end).
void train_step(zs_context ctx, const Model& m, bool push_grads = false) {
  ZS_ASSERT_OK(zs_step_begin(ctx));
  for (int l = 0; l < kLayers; ++l) use_layer(ctx, m, l);
  for (int l = kLayers - 1; l >= 0; --l) use_layer(ctx, m, l, push_grads);
  ZS_ASSERT_OK(zs_step_end(ctx));
}

zs_coord_stats stats(zs_context ctx) {
  zs_coord_stats s = ZS_COORD_STATS_INIT;
  EXPECT_EQ(zs_coord_get_stats(ctx, &s), ZS_OK) << zs_last_error();
  return s;
}

// Bytes this rank sent in all-reduces: the step end's agreement among them.
uint64_t allreduce_bytes(zs_context ctx) {
  zs_fetch_stats f = ZS_FETCH_STATS_INIT;
  EXPECT_EQ(zs_context_fetch_stats(ctx, &f), ZS_OK) << zs_last_error();
  return f.allreduce_bytes_sent;
}

std::string config(int64_t prefetch, int64_t max_live, int64_t persistence, int64_t reuse) {
  return "{\"zero_optimization\": {\"stage3_prefetch_bucket_size\": " + std::to_string(prefetch) +
         ", \"stage3_max_live_parameters\": " + std::to_string(max_live) +
         ", \"stage3_param_persistence_threshold\": " + std::to_string(persistence) +
         ", \"stage3_max_reuse_distance\": " + std::to_string(reuse) + "}}";
}

TEST(Coordinator, AfterTheFirstStepEverythingIsPrefetched) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 0, 0);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    const zs_coord_stats first = stats(ctx);
    EXPECT_EQ(first.trace_length, 2u * kLayers);
    EXPECT_EQ(first.demand_fetches, 2u * kLayers);
    EXPECT_EQ(first.prefetches, 0u);
    for (int s = 0; s < 3; ++s) train_step(ctx, m);
    const zs_coord_stats later = stats(ctx);
    EXPECT_EQ(later.demand_fetches, first.demand_fetches) << "a later step had to gather on demand";
    EXPECT_GT(later.prefetches, first.prefetches);
    // Units whose params were still gathered from the step before need no
    // gather at all (the turning point between forward and backward); the
    // others were gathered ahead, a window of units (prefetch_bucket_size:
    // about four layers here) in one coalesced gather.
    const uint64_t units = 3u * 2u * kLayers;
    const uint64_t reused = later.reuse_hits - first.reuse_hits;
    EXPECT_GT(reused, 0u);
    EXPECT_LE((later.prefetches - first.prefetches) * 2, units - reused)
        << "fewer than two units per gather: prefetch windows are not coalesced";
    EXPECT_EQ(later.trace_invalidations, 0u);
    EXPECT_EQ(later.live_elements, 0u) << "the step end leaves nothing gathered";
    zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
    EXPECT_EQ(mem.gathered_bytes, 0u);
    zs_context_destroy(ctx);
  });
}

TEST(Coordinator, SmallParamsPersistForTheStep) {
  run_ranks(2, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 100, 0);  // biases (64) persist
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    train_step(ctx, m);
    const zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.persistent_params, static_cast<uint64_t>(kLayers));
    for (int l = 0; l < kLayers; ++l) {
      zs_param_status st;
      ZS_ASSERT_OK(zs_param_get_status(m.biases[l], &st));
      EXPECT_EQ(st, ZS_PARAM_AVAILABLE) << "bias " << l;
      ZS_ASSERT_OK(zs_param_get_status(m.weights[l], &st));
      EXPECT_EQ(st, ZS_PARAM_NOT_AVAILABLE) << "weight " << l;
    }
    // An optimizer step makes the gathered copies stale: they are dropped
    // and gathered again in one coalesced gather, so they stay gathered
    // across steps (the weights do not).
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    void* bias_before = nullptr;
    ZS_ASSERT_OK(zs_param_data(m.biases[0], &bias_before));
    const uint64_t before = stats(ctx).prefetches;
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    EXPECT_EQ(stats(ctx).prefetches, before + 1);
    EXPECT_EQ(stats(ctx).persistent_params, static_cast<uint64_t>(kLayers));
    train_step(ctx, m);  // checks every value it reads
    // Gathered again into the buffer it had: views of it stay valid.
    void* bias_after = nullptr;
    ZS_ASSERT_OK(zs_param_data(m.biases[0], &bias_after));
    EXPECT_EQ(bias_after, bias_before);
    EXPECT_EQ(stats(ctx).demand_fetches, 2u * kLayers) << "only the first step gathered on demand";
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

TEST(Coordinator, ModelPersistenceThresholdBoundsWhatStaysGatheredAcrossSteps) {
  run_ranks(2, [](const RankEnv& env) {
    // Biases (64 elements) persist within a step; across the optimizer step
    // only as many as 3 * 64 elements allow, the first three in trace order.
    const std::string cfg =
        "{\"zero_optimization\": {\"stage3_param_persistence_threshold\": 100, "
        "\"stage3_model_persistence_threshold\": 192}}";
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    train_step(ctx, m);
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    for (int l = 0; l < kLayers; ++l) {
      zs_param_status st;
      ZS_ASSERT_OK(zs_param_get_status(m.biases[l], &st));
      EXPECT_EQ(st != ZS_PARAM_NOT_AVAILABLE, l < 3) << "bias " << l;
    }
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

// stage3_prefetch_bucket_size 0 turns prefetching off (DeepSpeed's
// meaning, which users set to save memory): every unit is gathered when
// asked for, never ahead, and at most one unit is live at a time.
TEST(Coordinator, PrefetchBucketSizeZeroGathersOnlyOnDemand) {
  run_ranks(2, [](const RankEnv& env) {
    const std::string cfg = config(0, 1000000000, 0, 0);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    for (int s = 0; s < 3; ++s) train_step(ctx, m);
    const zs_coord_stats st = stats(ctx);
    EXPECT_EQ(st.prefetches, 0u);
    EXPECT_EQ(st.demand_fetches + st.reuse_hits, 3u * 2u * kLayers);
    EXPECT_LE(st.peak_live_elements, kRows * kCols + kRows) << "more than one layer was gathered at once";
    zs_context_destroy(ctx);
  });
}

TEST(Coordinator, MaxLiveParametersBoundsWhatIsGathered) {
  run_ranks(2, [](const RankEnv& env) {
    const int64_t max_live = 9000;  // about two layers
    const std::string cfg = config(1000000, max_live, 0, 0);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    for (int s = 0; s < 3; ++s) train_step(ctx, m);
    const zs_coord_stats st = stats(ctx);
    EXPECT_LE(st.peak_live_elements, static_cast<uint64_t>(max_live) + kRows * kCols + kRows);
    EXPECT_GT(st.prefetches, 0u);
    zs_context_destroy(ctx);
  });
}

// A model of `count` units of `per_unit` params of `numel` elements each
// (random values), and one training step of it with an optimizer: the
// forward gathers and releases each unit in turn, the backward in reverse,
// pushing each param's gradient before its unit's release.
using Units = std::vector<std::vector<zs_param>>;

Units build_units(zs_context ctx, int count, int per_unit, int64_t numel) {
  Units units(static_cast<size_t>(count));
  for (int u = 0; u < count; ++u)
    for (int k = 0; k < per_unit; ++k) {
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      const std::string name = "unit" + std::to_string(u) + ".p" + std::to_string(k);
      o.name = name.c_str();
      o.ndim = 1;
      o.shape = &numel;
      o.init = ZS_INIT_NORMAL;
      zs_param p = nullptr;
      EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
      units[static_cast<size_t>(u)].push_back(p);
    }
  return units;
}

zs_optimizer adamw_over(zs_context ctx, const Units& units) {
  std::vector<zs_param> all;
  for (const auto& u : units) all.insert(all.end(), u.begin(), u.end());
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  EXPECT_EQ(zs_optimizer_add_group(opt, all.data(), all.size(), &hp, nullptr), ZS_OK) << zs_last_error();
  return opt;
}

void units_step(zs_context ctx, zs_optimizer opt, const Units& units, int64_t numel) {
  const std::vector<float> grad(static_cast<size_t>(numel), 0.5f);
  ZS_ASSERT_OK(zs_step_begin(ctx));
  for (const auto& u : units) {
    ZS_ASSERT_OK(zs_coord_fetch(ctx, u.data(), u.size()));
    ZS_ASSERT_OK(zs_coord_release(ctx, u.data(), u.size()));
  }
  for (auto u = units.rbegin(); u != units.rend(); ++u) {
    ZS_ASSERT_OK(zs_coord_fetch(ctx, u->data(), u->size()));
    for (zs_param p : *u) ZS_ASSERT_OK(zs_grad_push(p, grad.data(), ZS_FLOAT32, grad.size() * sizeof(float)));
    ZS_ASSERT_OK(zs_coord_release(ctx, u->data(), u->size()));
  }
  ZS_ASSERT_OK(zs_step_end(ctx));
  zs_step_result r = ZS_STEP_RESULT_INIT;
  ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
}

zs_step_stats step_stats(zs_context ctx) {
  zs_step_stats s = ZS_STEP_STATS_INIT;
  EXPECT_EQ(zs_context_step_stats(ctx, &s), ZS_OK) << zs_last_error();
  return s;
}

// Windows left out of the config fit the model: prefetch two typical
// units ahead, keep one across the turn, live at most the largest unit and
// two typical ones, and reduce two units' gradients a bucket (units of 10
// params of 60000 elements here, 2.3 MiB: two of them pass the windows'
// floor); DeepSpeed's values given in the config gather the whole model at
// once.
TEST(Coordinator, WindowsLeftOutFitTheModelsUnits) {
  constexpr int kUnits = 8, kPerUnit = 10;
  constexpr int64_t kNumel = 60000;
  constexpr uint64_t unit = kPerUnit * kNumel;
  const std::string given = config(50000000, 1000000000, 0, 50000000);
  for (const std::string& cfg :
       {std::string(R"({"zero_optimization": {"stage3_param_persistence_threshold": 0}})"), given}) {
    run_ranks(2, [&cfg, &given](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env, cfg.c_str());
      ASSERT_NE(ctx, nullptr);
      const Units m = build_units(ctx, kUnits, kPerUnit, kNumel);
      zs_optimizer opt = adamw_over(ctx, m);
      for (int s = 0; s < 4; ++s) units_step(ctx, opt, m, kNumel);
      const zs_coord_stats st = stats(ctx);
      EXPECT_GT(st.prefetches, 0u);
      EXPECT_EQ(st.trace_invalidations, 0u);
      if (cfg == given) {
        EXPECT_GE(st.peak_live_elements, kUnits * unit) << "the given windows hold every unit";
      } else {
        // The unit in use, and prefetching that stops at 3 units live.
        EXPECT_LE(st.peak_live_elements, 4 * unit);
        // Two units' gradients a bucket (the config's 2e7 elements would
        // take the whole model in one): 8 units, 4 reduce-scatters a step.
        EXPECT_EQ(step_stats(ctx).reduce_scatters, static_cast<uint64_t>(kUnits / 2));
      }
      ZS_ASSERT_OK(zs_optimizer_destroy(opt));
      zs_context_destroy(ctx);
    });
  }
}

// Units far below the windows' floor (Context::kFittedWindowFloorBytes):
// 200 units of an 8x8 weight and its bias, as 200 nn.Linear(8, 8). Two
// units made a bucket of 144 elements and a prefetch window of as many,
// so each weight was reduce-scattered on its own (the direct route takes a
// quarter of the bucket) and each unit gathered on its own: 212
// reduce-scatters a step, and with persistence off 200 gathers, each a
// latency-bound round trip (issue 62: 4.4x DDP's step). At the floor the
// whole model is one bucket and one prefetch. Persistent (the default
// threshold) or not.
TEST(Coordinator, TinyUnitsReduceInOneBucketAndGatherInOneWindow) {
  constexpr int kUnits = 200;
  for (const char* cfg : {R"({"zero_optimization": {"stage3_param_persistence_threshold": 0}})", "{}"}) {
    run_ranks(2, [cfg](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env, cfg);
      ASSERT_NE(ctx, nullptr);
      Units m(kUnits);
      const Units weights = build_units(ctx, kUnits, 1, 64), biases = build_units(ctx, kUnits, 1, 8);
      for (int u = 0; u < kUnits; ++u) m[static_cast<size_t>(u)] = {weights[u][0], biases[u][0]};
      zs_optimizer opt = adamw_over(ctx, m);
      for (int s = 0; s < 4; ++s) {
        // units_step pushes one size of gradient: these are two.
        ZS_ASSERT_OK(zs_step_begin(ctx));
        for (const auto& u : m) {
          ZS_ASSERT_OK(zs_coord_fetch(ctx, u.data(), u.size()));
          ZS_ASSERT_OK(zs_coord_release(ctx, u.data(), u.size()));
        }
        const std::vector<float> grad(64, 0.5f);
        for (auto u = m.rbegin(); u != m.rend(); ++u) {
          ZS_ASSERT_OK(zs_coord_fetch(ctx, u->data(), u->size()));
          ZS_ASSERT_OK(zs_grad_push((*u)[0], grad.data(), ZS_FLOAT32, 64 * sizeof(float)));
          ZS_ASSERT_OK(zs_grad_push((*u)[1], grad.data(), ZS_FLOAT32, 8 * sizeof(float)));
          ZS_ASSERT_OK(zs_coord_release(ctx, u->data(), u->size()));
        }
        ZS_ASSERT_OK(zs_step_end(ctx));
        zs_step_result r = ZS_STEP_RESULT_INIT;
        ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
        if (s == 0) continue;  // the first step gathers on demand, before an order is kept
        const zs_step_stats st = step_stats(ctx);
        EXPECT_EQ(st.reduce_scatters, 1u) << "step " << s << ", config " << cfg;
        EXPECT_LE(st.gathers, 2u) << "step " << s << ", config " << cfg;
      }
      ZS_ASSERT_OK(zs_optimizer_destroy(opt));
      zs_context_destroy(ctx);
    });
  }
}

// Tied weights: layer 0 is used again two units later. Within the reuse
// distance it stays gathered in between; with distance 0 it is released.
TEST(Coordinator, ReuseDistanceKeepsATiedLayer) {
  for (int64_t reuse : {0, 5000}) {
    run_ranks(2, [reuse](const RankEnv& env) {
      const std::string cfg = config(1, 1000000000, 0, reuse);  // prefetch one unit ahead
      zs_context ctx = zs::test::make_context(env, cfg.c_str());
      ASSERT_NE(ctx, nullptr);
      const Model m = build(ctx);
      for (int s = 0; s < 3; ++s) {
        ZS_ASSERT_OK(zs_step_begin(ctx));
        use_layer(ctx, m, 0);
        use_layer(ctx, m, 1);
        use_layer(ctx, m, 0);
        ZS_ASSERT_OK(zs_step_end(ctx));
      }
      const zs_coord_stats st = stats(ctx);
      if (reuse == 0) {
        EXPECT_EQ(st.kept_for_reuse, 0u);
        EXPECT_EQ(st.live_elements, 0u);
      } else {
        // Weight and bias, between their two uses and from the step's end
        // into the next step (no gradient was pushed: nothing rewrites
        // them), in each step that follows the trace.
        EXPECT_EQ(st.kept_for_reuse, 8u);
        EXPECT_GE(st.reuse_hits, 3u);
        EXPECT_EQ(st.live_elements, static_cast<uint64_t>(kRows * kCols + kRows)) << "layer 0, for the next step";
      }
      zs_context_destroy(ctx);
    });
  }
}

// Forward only, a step each (inference: an evaluation loop, generate()):
// nothing rewrites the params between steps, so those the next step uses
// within max_reuse_distance stay gathered across the step end, up to
// max_live_parameters; a step that pushed a gradient keeps nothing past
// its end, and a param written between steps is read with its new values.
void forward_step(zs_context ctx, const Model& m) {
  ZS_ASSERT_OK(zs_step_begin(ctx));
  for (int l = 0; l < kLayers; ++l) use_layer(ctx, m, l);
  ZS_ASSERT_OK(zs_step_end(ctx));
}

TEST(Coordinator, ForwardStepsKeepWhatTheNextStepReusesWithinTheReuseDistance) {
  constexpr uint64_t kLayerElements = kRows * kCols + kRows;
  constexpr uint64_t kModel = kLayers * kLayerElements;
  struct Case {
    int64_t reuse, max_live;
    uint64_t kept;  // elements gathered across a step end
  };
  // The model within the distance; half of it (every param's next use is
  // the rest of the model away); within it but max_live of 3 layers.
  for (const Case c : {Case{kModel, 1000000000, kModel}, Case{kModel / 2, 1000000000, 0},
                       Case{kModel, 3 * kLayerElements, 3 * kLayerElements}}) {
    run_ranks(3, [c](const RankEnv& env) {
      const std::string cfg = config(2 * kLayerElements, c.max_live, 0, c.reuse);
      zs_context ctx = zs::test::make_context(env, cfg.c_str());
      ASSERT_NE(ctx, nullptr);
      const Model m = build(ctx);
      zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
      for (int s = 0; s < 2; ++s) forward_step(ctx, m);  // records, then follows
      const zs_coord_stats before = stats(ctx);
      EXPECT_EQ(before.live_elements, c.kept);
      const uint64_t reduced = allreduce_bytes(ctx);
      for (int s = 0; s < 4; ++s) forward_step(ctx, m);
      const zs_coord_stats after = stats(ctx);
      // A step that ran on what the last one kept changed nothing: its end
      // compares nothing (a step that gathered compares).
      EXPECT_EQ(allreduce_bytes(ctx) == reduced, c.kept == kModel) << "reuse " << c.reuse << " max_live " << c.max_live;
      EXPECT_EQ(after.live_elements, c.kept) << "what stays gathered between steps";
      ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
      EXPECT_GE(mem.gathered_bytes, 4 * c.kept);  // buffers hold the padding to 3 shards: 3 elements a layer
      EXPECT_LE(mem.gathered_bytes, 4 * (c.kept + 3 * kLayers));
      const uint64_t gathers = after.demand_fetches + after.prefetches - before.demand_fetches - before.prefetches;
      if (c.kept == kModel) {
        EXPECT_EQ(gathers, 0u) << "a step found the model gathered: no gather";
        EXPECT_EQ(after.reuse_hits - before.reuse_hits, 4u * kLayers);
      } else {
        EXPECT_GT(gathers, 0u);
        // The window, or the kept params (at most max_live), and the unit
        // in use and the next, which are gathered whatever max_live says.
        EXPECT_LE(after.peak_live_elements, std::max<uint64_t>(c.kept, 2 * kLayerElements) + 2 * kLayerElements)
            << "reuse " << c.reuse << " max_live " << c.max_live;
      }
      EXPECT_EQ(after.trace_invalidations, 0u);
      if (c.kept == kModel) {
        // Rank 1 stops half-way (a generate() that reached its end token
        // first): no rank changed anything, none compares, and the next
        // step still gathers nothing.
        ZS_ASSERT_OK(zs_step_begin(ctx));
        for (int l = 0; l < (env.rank == 1 ? kLayers / 2 : kLayers); ++l) use_layer(ctx, m, l);
        int same = 7;
        ZS_ASSERT_OK(zs_step_end_agree(ctx, 0, &same));
        EXPECT_EQ(same, -1);
        forward_step(ctx, m);
        const zs_coord_stats later = stats(ctx);
        EXPECT_EQ(later.demand_fetches + later.prefetches, after.demand_fetches + after.prefetches);
        EXPECT_EQ(later.live_elements, uint64_t{kModel});
        EXPECT_EQ(allreduce_bytes(ctx), reduced);
      }

      // Layer 3's weight written between steps (the same values on every
      // rank, as torch's `param.data = t`): the next step reads them.
      std::vector<float> fresh(kRows * kCols);
      for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = -static_cast<float>(i);
      ZS_ASSERT_OK(zs_param_write(m.weights[3], fresh.data(), fresh.size() * 4));
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kLayers; ++l) {
        if (l != 3) {
          use_layer(ctx, m, l);
          continue;
        }
        ZS_ASSERT_OK(zs_coord_fetch(ctx, &m.weights[3], 1));
        void* d = nullptr;
        ZS_ASSERT_OK(zs_param_data(m.weights[3], &d));
        for (size_t i = 0; i < fresh.size(); i += 7) ASSERT_EQ(static_cast<float*>(d)[i], fresh[i]);
        ZS_ASSERT_OK(zs_coord_release(ctx, &m.weights[3], 1));
      }
      ZS_ASSERT_OK(zs_step_end(ctx));  // a new order (layer 3 fetched without its bias)
      for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = expected(3, 0, i);
      ZS_ASSERT_OK(zs_param_write(m.weights[3], fresh.data(), fresh.size() * 4));

      // A step that pushes a gradient ends in an optimizer step: nothing
      // stays gathered past its end.
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kLayers; ++l) use_layer(ctx, m, l);
      std::vector<float> grad(kRows, 1.0f);
      ZS_ASSERT_OK(zs_grad_push(m.biases[kLayers - 1], grad.data(), ZS_FLOAT32, grad.size() * 4));
      ZS_ASSERT_OK(zs_step_end(ctx));
      EXPECT_EQ(stats(ctx).live_elements, 0u);
      ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
      EXPECT_EQ(mem.gathered_bytes, 0u);
      zs_context_destroy(ctx);
    });
  }
}

// A training step's first layer that its backward does not read (an
// embedding's table: its gradient comes from the indices) is released after
// the forward, although the next step uses it within the reuse distance:
// before the step's first gradient only the order's last step tells a
// training step from a generate() loop's forward, which keeps it.
TEST(Coordinator, ATrainingStepKeepsNothingForTheNextStepBeforeItsFirstGradient) {
  constexpr uint64_t kLayerElements = kRows * kCols + kRows;
  run_ranks(2, [](const RankEnv& env) {
    const std::string cfg = config(2 * kLayerElements, 1000000000, 0, 1000000000);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    const auto step = [&](bool check) {
      ZS_ASSERT_OK(zs_step_begin(ctx));
      const uint64_t kept = stats(ctx).kept_for_reuse;
      use_layer(ctx, m, 0);
      if (check) {
        EXPECT_EQ(stats(ctx).kept_for_reuse, kept) << "layer 0 kept for the next step";
        EXPECT_LE(stats(ctx).live_elements, 2 * kLayerElements) << "the window ahead, without layer 0";
      }
      for (int l = 1; l < kLayers; ++l) use_layer(ctx, m, l);
      for (int l = kLayers - 1; l >= 1; --l) use_layer(ctx, m, l, /*push_grads=*/true);
      ZS_ASSERT_OK(zs_step_end(ctx));
      EXPECT_EQ(stats(ctx).live_elements, 0u);
    };
    for (int s = 0; s < 4; ++s) step(s >= 1);  // records, then follows
    EXPECT_EQ(stats(ctx).trace_invalidations, 0u);
    zs_context_destroy(ctx);
  });
}

// A training step along its order gives the host pool's idle blocks back
// once its last gathered param goes: nothing is fetched again before the
// next step's forward, while the gradients and the optimizer step peak.
// Not before its last gather, nor in the step that records the order (it
// does not know it is the last).
TEST(Coordinator, ATrainingStepGivesTheIdleHostBlocksBackAfterItsLastGather) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, "{\"zero_optimization\": {\"stage\": 3}}");
    ASSERT_NE(ctx, nullptr);
    constexpr int kBig = 4;
    constexpr uint64_t kElems = uint64_t{1} << 18;  // gathered: 1 MiB blocks, which the pool caches
    std::vector<zs_param> layers(kBig);
    const std::vector<float> zeros(kElems, 0.0f), grad(kElems, 0.25f);
    for (int l = 0; l < kBig; ++l) {
      const int64_t shape[1] = {static_cast<int64_t>(kElems)};
      zs_param_options o = ZS_PARAM_OPTIONS_INIT;
      const std::string name = "big" + std::to_string(l);
      o.name = name.c_str();
      o.ndim = 1;
      o.shape = shape;
      o.init = ZS_INIT_FROM_ALL;
      o.data = zeros.data();
      o.data_bytes = kElems * 4;
      ZS_ASSERT_OK(zs_param_register(&layers[l], ctx, &o));
    }
    const auto idle = [&] {
      zs_memory_stats m = ZS_MEMORY_STATS_INIT;
      EXPECT_EQ(zs_context_memory(ctx, &m), ZS_OK) << zs_last_error();
      return m.host_cache_bytes;
    };
    const auto use = [&](int l, bool push) {
      ZS_ASSERT_OK(zs_coord_fetch(ctx, &layers[l], 1));
      if (push) {
        ZS_ASSERT_OK(zs_grad_push(layers[l], grad.data(), ZS_FLOAT32, kElems * 4));
      }
      ZS_ASSERT_OK(zs_coord_release(ctx, &layers[l], 1));
    };
    for (int s = 0; s < 4; ++s) {
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kBig; ++l) use(l, false);
      for (int l = kBig - 1; l >= 1; --l) use(l, true);
      if (s >= 2) {
        EXPECT_GT(idle(), 0u) << "step " << s << ": given back before its last gather";
      }
      use(0, true);
      // Recorded (step 0), then followed: from the first step that follows
      // a trained order on, given back.
      if (s == 0) {
        EXPECT_GT(idle(), 0u) << "the recording step gave its idle blocks back";
      } else {
        EXPECT_EQ(idle(), 0u) << "step " << s << ": idle host blocks after the last gather";
      }
      ZS_ASSERT_OK(zs_step_end(ctx));
    }
    EXPECT_EQ(stats(ctx).trace_invalidations, 0u);
    zs_context_destroy(ctx);
  });
}

TEST(Coordinator, ChangedOrderReRecordsWithoutAHang) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 0, 0);
    zs_context ctx = zs::test::make_context(env, cfg.c_str(), 20000);
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    train_step(ctx, m);
    // Same on every rank, but a different order: odd layers only.
    ZS_ASSERT_OK(zs_step_begin(ctx));
    for (int l = 1; l < kLayers; l += 2) use_layer(ctx, m, l);
    ZS_ASSERT_OK(zs_step_end(ctx));
    zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.trace_invalidations, 1u);
    EXPECT_EQ(s.trace_length, static_cast<uint64_t>(kLayers / 2));
    const uint64_t demand = s.demand_fetches;
    // The new order is followed from the next step on.
    ZS_ASSERT_OK(zs_step_begin(ctx));
    for (int l = 1; l < kLayers; l += 2) use_layer(ctx, m, l);
    ZS_ASSERT_OK(zs_step_end(ctx));
    s = stats(ctx);
    EXPECT_EQ(s.demand_fetches, demand);
    EXPECT_EQ(s.trace_invalidations, 1u);
    zs_context_destroy(ctx);
  });
}

// A trainer whose steps take turns between kinds: a reference model's
// inference forward (its own step), the policy's training step, and an
// inference forward of the policy, which is where the training step's
// order begins. Each kind is recorded once and then gathered ahead of the
// trainer, none on demand, once the turns have been seen.
TEST(Coordinator, StepsThatTakeTurnsBetweenKindsEachGatherAhead) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 0, 0);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model reference = build(ctx), policy = build(ctx);
    const auto round = [&] {
      forward_step(ctx, reference);
      EXPECT_EQ(stats(ctx).trace_length, static_cast<uint64_t>(kLayers));
      train_step(ctx, policy);
      EXPECT_EQ(stats(ctx).trace_length, 2u * kLayers);
      forward_step(ctx, policy);
      EXPECT_EQ(stats(ctx).trace_length, static_cast<uint64_t>(kLayers));
    };
    round();
    zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.trace_invalidations, 2u) << "the two kinds after the first are new orders";
    round();  // learns which kind follows which
    const zs_coord_stats learned = stats(ctx);
    EXPECT_EQ(learned.trace_invalidations, 2u) << "a kind seen before was recorded again";
    for (int r = 0; r < 3; ++r) round();
    s = stats(ctx);
    EXPECT_EQ(s.demand_fetches, learned.demand_fetches) << "a step gathered on demand after the turns were learned";
    EXPECT_GT(s.prefetches, learned.prefetches);
    EXPECT_EQ(s.trace_invalidations, 2u);
    EXPECT_EQ(s.live_elements, 0u) << "the step end leaves nothing gathered";
    // A kind never seen: recorded in place of the least recently used once
    // four are kept; the others stay followed.
    ZS_ASSERT_OK(zs_step_begin(ctx));
    for (int l = kLayers - 1; l >= 0; --l) use_layer(ctx, reference, l);
    ZS_ASSERT_OK(zs_step_end(ctx));
    const zs_coord_stats fourth = stats(ctx);
    EXPECT_EQ(fourth.trace_invalidations, 3u);
    train_step(ctx, policy);
    forward_step(ctx, policy);
    forward_step(ctx, reference);
    s = stats(ctx);
    EXPECT_EQ(s.trace_invalidations, 3u) << "a fourth order pushed out one of three";
    EXPECT_LE(s.demand_fetches - fourth.demand_fetches, 3u) << "more than one unit per step gathered on demand";
    zs_context_destroy(ctx);
  });
}

// A step that never ends (forwards with gradients on and no optimizer
// step) is not recorded past Coordinator::kMaxStepUnits units: it gathers
// on demand from there, and the orders kept before stay followed.
TEST(Coordinator, AStepTooLongToRecordGathersOnDemandAndKeepsTheOrders) {
  run_ranks(1, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config(20000, 1000000000, 0, 0).c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    const zs_coord_stats before = stats(ctx);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    zs_param unit[1] = {m.biases[0]};
    for (size_t i = 0; i <= zs::Coordinator::kMaxStepUnits; ++i) {
      ASSERT_EQ(zs_coord_fetch(ctx, unit, 1), ZS_OK) << zs_last_error();
      ASSERT_EQ(zs_coord_release(ctx, unit, 1), ZS_OK) << zs_last_error();
    }
    ZS_ASSERT_OK(zs_step_end(ctx));
    zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.trace_length, 0u) << "a step past the bound was recorded";
    EXPECT_EQ(s.trace_invalidations, before.trace_invalidations);
    train_step(ctx, m);
    const uint64_t demand = stats(ctx).demand_fetches;
    train_step(ctx, m);
    s = stats(ctx);
    EXPECT_EQ(s.demand_fetches, demand) << "the order kept before the long step is no longer followed";
    EXPECT_EQ(s.trace_length, 2u * kLayers);
    zs_context_destroy(ctx);
  });
}

TEST(Coordinator, RanksThatDisagreeInvalidateEverywhere) {
  run_ranks(2, [](const RankEnv& env) {
    // Biases persist, weights do not: a unit of both is an event of the
    // trace even while both are gathered.
    const std::string cfg = config(20000, 1000000000, 100, 1000000000);
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    // One collective gather of everything, in the same order everywhere...
    std::vector<zs_param> all(m.weights);
    all.insert(all.end(), m.biases.begin(), m.biases.end());
    ZS_ASSERT_OK(zs_coord_fetch(ctx, all.data(), all.size()));
    // ...then rank-specific orders, which need no traffic (the reuse
    // distance keeps the weights gathered).
    for (int i = 0; i < kLayers; ++i) {
      const int l = env.rank == 0 ? i : kLayers - 1 - i;
      use_layer(ctx, m, l);
    }
    ZS_ASSERT_OK(zs_step_end(ctx));
    const zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.trace_length, 0u) << "ranks disagreed: no trace may be kept";
    zs_context_destroy(ctx);
  });
}

// A unit of persistent params alone (a norm's weight) is gathered on
// demand in the first step and kept from then on, so later steps skip it:
// the order the first step leaves is the one they take, and the second
// step already gathers everything ahead (it gathered the whole step on
// demand). Training steps (gradients pushed, an optimizer step after each)
// and forward-only ones (inference: nothing pushed, no optimizer step).
TEST(Coordinator, UnitsOfPersistentParamsAloneLeaveTheOrderTheNextStepTakes) {
  // A world (and store) per kind: a second context on the first's store
  // port may find it still held.
  for (const bool trained : {true, false}) {
    run_ranks(2, [trained](const RankEnv& env) {
      const std::string cfg = config(20000, 1000000000, 100, 0);  // biases (64) persist
      zs_context ctx = zs::test::make_context(env, cfg.c_str());
      ASSERT_NE(ctx, nullptr);
      const Model m = build(ctx);
      zs_optimizer opt = nullptr;
      ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
      // Weight and bias each a unit of its own.
      const auto use = [&](int l, int k, bool backward) {
        zs_param p = m.layer(l, k);
        ZS_ASSERT_OK(zs_coord_fetch(ctx, &p, 1));
        if (backward) {
          const uint64_t n = k == 0 ? kRows * kCols : kRows;
          const std::vector<float> grad(n, 0.5f);
          ZS_ASSERT_OK(zs_grad_push(p, grad.data(), ZS_FLOAT32, n * 4));
        }
        ZS_ASSERT_OK(zs_coord_release(ctx, &p, 1));
      };
      const auto step = [&] {
        ZS_ASSERT_OK(zs_step_begin(ctx));
        for (int l = 0; l < kLayers; ++l)
          for (int k = 0; k < 2; ++k) use(l, k, false);
        if (trained)
          for (int l = kLayers - 1; l >= 0; --l)
            for (int k = 1; k >= 0; --k) use(l, k, true);
        ZS_ASSERT_OK(zs_step_end(ctx));
        if (trained) ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
      };
      step();
      const zs_coord_stats first = stats(ctx);
      EXPECT_GT(first.demand_fetches, 0u);
      EXPECT_EQ(first.trace_length, trained ? 2u * kLayers : static_cast<uint64_t>(kLayers))
          << "the order holds the weights' units alone";
      for (int s = 0; s < 3; ++s) step();
      const zs_coord_stats later = stats(ctx);
      EXPECT_EQ(later.demand_fetches, first.demand_fetches) << "a later step gathered on demand (trained "
                                                            << trained << ")";
      if (trained) {
        EXPECT_GT(later.prefetches, first.prefetches);
      }
      EXPECT_EQ(later.trace_invalidations, 0u) << "trained " << trained;
      EXPECT_EQ(later.persistent_params, static_cast<uint64_t>(kLayers));
      zs_optimizer_destroy(opt);
      zs_context_destroy(ctx);
    });
  }
}

// Units whose params are all persistent and gathered are no events: the
// trainer may skip them (zeroshard.torch drops such modules' hooks), on one
// rank and not another, without changing the trace or hanging; the kept
// params stay gathered across optimizer steps in the buffers they had.
TEST(Coordinator, KeptUnitsAreNoEventsAndStayGatheredAcrossSteps) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 100000, 0);  // everything persists
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);  // the forward gathers on demand; the backward reuses
    zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.demand_fetches, static_cast<uint64_t>(kLayers));
    // Every unit stays kept: from the next step on none is an event, so the
    // step leaves no order.
    EXPECT_EQ(s.trace_length, 0u);
    EXPECT_EQ(s.persistent_params, 2u * kLayers);
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    void* w0 = nullptr;
    ZS_ASSERT_OK(zs_param_data(m.weights[0], &w0));
    for (int step = 0; step < 3; ++step) {
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kLayers; ++l)
        if (env.rank != 1 || l % 3 != 0) use_layer(ctx, m, l);  // rank 1 skips some
      ZS_ASSERT_OK(zs_step_end(ctx));
      ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));  // no gradients: values stay
      s = stats(ctx);
      EXPECT_EQ(s.trace_length, 0u);
      EXPECT_EQ(s.persistent_params, 2u * kLayers) << "step " << step;
    }
    EXPECT_EQ(s.demand_fetches, static_cast<uint64_t>(kLayers)) << "a kept param was gathered again on demand";
    void* w0_after = nullptr;
    ZS_ASSERT_OK(zs_param_data(m.weights[0], &w0_after));
    EXPECT_EQ(w0_after, w0) << "gathered again into another buffer: views of it would go stale";
    train_step(ctx, m);  // checks every value it reads
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

// A quiet step (every unit kept: no fetch recorded, nothing gathered) runs
// no collective at its end: in a model of small params, whose units are all
// kept, that would be the only collective of an inference forward. Every
// 64th quiet step in a row still compares the trainer's token; the others
// say they compared nothing (-1), alike on every rank, whatever the tokens.
TEST(Coordinator, QuietStepsEndWithoutACollectiveButEverySixtyFourth) {
  run_ranks(3, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 100000, 0);  // everything persists
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);  // gathers: compared
    constexpr uint64_t kEvery = zs::Coordinator::kCompareQuietSteps;
    for (uint64_t step = 1; step <= 2 * kEvery; ++step) {
      const uint64_t before = allreduce_bytes(ctx);
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kLayers; ++l) use_layer(ctx, m, l);  // kept: no event
      // One rank's token differs on the compared steps of the second round.
      const uint64_t token = step > kEvery && env.rank == 1 ? 9 : 5;
      int same = 7;
      ZS_ASSERT_OK(zs_step_end_agree(ctx, token, &same));
      const bool compared = step % kEvery == 0;
      ASSERT_EQ(same, compared ? (step > kEvery ? 0 : 1) : -1) << "quiet step " << step;
      ASSERT_EQ(allreduce_bytes(ctx) > before, compared) << "quiet step " << step;
    }
    // A step that gathers (a model not gathered yet) is compared at once.
    const Model fresh = build(ctx);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    use_layer(ctx, m, 0);
    use_layer(ctx, fresh, 0);
    int same = 7;
    ZS_ASSERT_OK(zs_step_end_agree(ctx, 5, &same));
    EXPECT_EQ(same, 1);
    zs_context_destroy(ctx);
  });
}

// zs_step_end_agree: the step's one agreement collective also compares
// the trainer's token; every rank learns the same answer, and the trace
// is as zs_step_end leaves it.
TEST(Coordinator, StepEndAgreeTellsEveryRankWhetherAllPassedTheSameToken) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config(20000, 1000000000, 0, 0).c_str());
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    train_step(ctx, m);
    const struct {
      uint64_t token;
      int same;
    } cases[] = {
        {42, 1},
        {static_cast<uint64_t>(env.rank), 0},                 // all differ
        {env.rank == 2 ? 7u : 0u, 0},                         // one differs
        {env.rank == 1 ? 0x8000000000000000ull : 0u, 0},      // only the top bit
        {0, 1},
    };
    for (const auto& c : cases) {
      ZS_ASSERT_OK(zs_step_begin(ctx));
      for (int l = 0; l < kLayers; ++l) use_layer(ctx, m, l);
      for (int l = kLayers - 1; l >= 0; --l) use_layer(ctx, m, l);
      int same = -1;
      ZS_ASSERT_OK(zs_step_end_agree(ctx, c.token, &same));
      EXPECT_EQ(same, c.same) << "token " << c.token;
    }
    const zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.trace_invalidations, 0u) << "a token that differs touched the trace";
    EXPECT_EQ(s.demand_fetches, 2u * kLayers) << "only the first step gathered on demand";
    int same = -1;
    EXPECT_EQ(zs_step_end_agree(ctx, 1, &same), ZS_ERR_INVALID_STATE) << "no step has begun";
    EXPECT_EQ(same, -1);
    ZS_ASSERT_OK(zs_step_begin(ctx));
    EXPECT_EQ(zs_step_end_agree(ctx, 1, nullptr), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("same"), std::string::npos) << zs_last_error();
    ZS_ASSERT_OK(zs_step_end(ctx));
    zs_context_destroy(ctx);
  });
}

// A model dropped between steps (every rank destroys its params at the
// same point): they leave the trace, the kept params gathered across the
// optimizer step, the live list and their leaf group, so nothing of them
// stays gathered, and the next model trains from a clean trace with no
// hang and no gather of a param that is gone.
TEST(Coordinator, DestroyedParamsLeaveTheTraceKeptAndLeafListsOnEveryRank) {
  run_ranks(2, [](const RankEnv& env) {
    const std::string cfg = config(20000, 1000000000, 100, 0);  // biases (64) persist
    zs_context ctx = zs::test::make_context(env, cfg.c_str());
    ASSERT_NE(ctx, nullptr);
    zs_memory_stats empty = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &empty));
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD));
    for (int round = 0; round < 3; ++round) {
      const Model m = build(ctx);
      zs_param pair[2] = {m.weights[kLayers - 1], m.biases[kLayers - 1]};
      ZS_ASSERT_OK(zs_leaf_group(ctx, pair, 2));
      for (int s = 0; s < 3; ++s) {
        train_step(ctx, m);  // checks every value it reads
        ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));  // no gradients: values stay
      }
      zs_coord_stats s = stats(ctx);
      ASSERT_EQ(s.persistent_params, static_cast<uint64_t>(kLayers)) << "round " << round;
      ASSERT_GT(s.trace_length, 0u);
      EXPECT_EQ(s.demand_fetches, (round + 1) * 2u * kLayers) << "only each model's first step gathered on demand";
      for (int l = 0; l < kLayers; ++l) {
        ZS_ASSERT_OK(zs_param_destroy(m.weights[l]));
        ZS_ASSERT_OK(zs_param_destroy(m.biases[l]));
      }
      s = stats(ctx);
      EXPECT_EQ(s.trace_length, 0u) << "a trace of destroyed params would be prefetched";
      EXPECT_EQ(s.persistent_params, 0u);
      EXPECT_EQ(s.live_elements, 0u);
      zs_memory_stats mem = ZS_MEMORY_STATS_INIT;
      ZS_ASSERT_OK(zs_context_memory(ctx, &mem));
      EXPECT_EQ(mem.num_params, 0u);
      EXPECT_EQ(mem.gathered_bytes, 0u) << "a kept copy outlived its param";
      EXPECT_EQ(mem.shard_bytes, empty.shard_bytes);
      ZS_ASSERT_OK(zs_step_begin(ctx));  // a step with no model left: nothing to prefetch
      ZS_ASSERT_OK(zs_step_end(ctx));
      ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));  // nothing kept to gather again
    }
    zs_optimizer_destroy(opt);
    zs_context_destroy(ctx);
  });
}

// MoE: each rank routes to a different expert, and on ranks 2+ one expert
// is unused; with the experts in one leaf group every rank gathers them
// all at once, so the collectives match and nothing hangs.
TEST(Coordinator, LeafGroupKeepsMoeRanksInStep) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, config(20000, 1000000000, 0, 0).c_str(), 20000);
    ASSERT_NE(ctx, nullptr);
    const Model m = build(ctx);
    std::vector<zs_param> experts(m.weights.begin(), m.weights.begin() + 4);
    ZS_ASSERT_OK(zs_leaf_group(ctx, experts.data(), experts.size()));
    for (int s = 0; s < 3; ++s) {
      ZS_ASSERT_OK(zs_step_begin(ctx));
      const int routed = (env.rank + s) % 4;
      ZS_ASSERT_OK(zs_coord_fetch(ctx, &experts[static_cast<size_t>(routed)], 1));
      for (int e = 0; e < 4; ++e) {  // the whole leaf came
        zs_param_status st;
        ZS_ASSERT_OK(zs_param_get_status(experts[static_cast<size_t>(e)], &st));
        EXPECT_EQ(st, ZS_PARAM_AVAILABLE);
      }
      void* d = nullptr;
      ZS_ASSERT_OK(zs_param_data(experts[static_cast<size_t>(routed)], &d));
      EXPECT_EQ(static_cast<float*>(d)[5], expected(routed, 0, 5));
      ZS_ASSERT_OK(zs_coord_release(ctx, &experts[static_cast<size_t>(routed)], 1));
      ZS_ASSERT_OK(zs_step_end(ctx));
    }
    const zs_coord_stats s = stats(ctx);
    EXPECT_EQ(s.live_elements, 0u);
    zs_context_destroy(ctx);
  });
}

}  // namespace
