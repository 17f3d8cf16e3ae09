// Frozen params (zs_param_freeze) on real processes. Under ZeRO++'s
// zero_quantized_nontrainable_weights a frozen param's shard is quantized
// once and kept only as its packet: every rank's gather is bitwise
// dequantize(quantize(shard)) of each shard, within the bound of
// kernels/quant.h, on 1, 2, 3, 5 and 8 ranks, odd sizes, fp32, bf16 and
// fp16, int8 and int4, with and without qwZ, under hpZ, MiCS's two-hop
// gather and parameter offload; gathering again never requantizes; the
// shard memory falls to the packet's. Frozen or not quantized, a frozen
// param refuses gradients, the optimizer keeps no state for it and never
// moves it. Checkpoints hold the dequantized values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "tests/support/multirank.h"
#include "tests/support/quant_params.h"

using zs::test::RankEnv;
using zs::test::run_ranks;
using namespace zs::test::quant;
namespace k = zs::kernels;

namespace {

std::string frozen_config(const std::string& extra = "") {
  return R"({"zero_optimization": {"zero_quantized_nontrainable_weights": true)" + extra + "}}";
}

void freeze_all(const std::vector<P>& ps) {
  for (const auto& p : ps) ZS_ASSERT_OK(zs_param_freeze(p.handle));
}

uint64_t shard_bytes(zs_context ctx) {
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  EXPECT_EQ(zs_context_memory(ctx, &m), ZS_OK) << zs_last_error();
  return m.shard_bytes;
}

// Registers params of every dtype, freezes them, and checks that every
// gather (two in a row: nothing is requantized) is each shard quantized on
// its own, and that the shards' memory is now the packets' (and the exact
// shards', unless they are offloaded with no cache).
void frozen_roundtrip(const RankEnv& env, const std::string& cfg, k::QuantSpec s,
                      const std::vector<int64_t>& numels, int members,
                      zs_context_options* options = nullptr, bool exact_in_memory = true) {
  zs_context ctx = nullptr;
  if (options != nullptr) {
    ZS_ASSERT_OK(zs_context_create(&ctx, options));
  } else {
    ctx = zs::test::make_context(env, cfg.c_str(), 60000);
  }
  ASSERT_NE(ctx, nullptr);
  auto ps = register_all(ctx, numels, 23);
  freeze_all(ps);
  uint64_t packets = 0, quantized = 0;
  for (const auto& p : ps) {
    const uint64_t shard = shard_numel(p, members);
    packets += packs_smaller(p, members, s) ? packet_bytes(shard, s)
               : exact_in_memory   ? shard * esize(p.dtype)
                                   : 0;
    quantized += packs_smaller(p, members, s) ? 1 : 0;
  }
  EXPECT_GT(quantized, 0u);
  EXPECT_EQ(shard_bytes(ctx), packets) << "the shards are not kept as their packets alone";
  for (int round = 0; round < 2; ++round) {
    fetch_all(ctx, ps);
    for (const auto& p : ps) {
      const auto got = gathered(p);
      EXPECT_EQ(got, expected_gather(p, members, s))
          << p.name << " on " << env.world << " ranks, gather " << round;
      expect_within_bound(p, got, s.bits);
    }
    release_all(ctx, ps);
  }
  for (auto& p : ps) zs_param_destroy(p.handle);
  EXPECT_EQ(shard_bytes(ctx), 0u);
  ZS_EXPECT_OK(zs_context_destroy(ctx));
}

class FrozenWorld : public ::testing::TestWithParam<int> {};

// One rank too: a packed param has no exact shard to alias.
TEST_P(FrozenWorld, Int8KeptAsCodesAndGatheredWithoutRequantizing) {
  run_ranks(GetParam(), [](const RankEnv& env) {
    frozen_roundtrip(env, frozen_config(), {8, 256}, {1, 7, 255, 257, 100003}, env.world);
  }, 180);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FrozenWorld, ::testing::Values(1, 2, 3, 5, 8));

TEST(Frozen, Int4AndOtherBlockSizes) {
  run_ranks(3, [](const RankEnv& env) {
    frozen_roundtrip(env,
                     frozen_config(R"(, "zero_quantized_weights_bits": 4, "zero_quantized_weights_block_size": 2048)"),
                     {4, 2048}, {0, 7, 4099}, 3);
  });
  run_ranks(2, [](const RankEnv& env) {
    frozen_roundtrip(env, frozen_config(R"(, "zero_quantized_weights_block_size": 2)"), {8, 2},
                     {7, 1001}, 2);
  });
}

// qwZ on as well: a frozen param's packet travels as it is, a trainable
// one's shard is quantized at each gather; both come out alike.
TEST(Frozen, WithQwzFrozenAndTrainableParamsGatherAlike) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, frozen_config(R"(, "zero_quantized_weights": true)").c_str());
    ASSERT_NE(ctx, nullptr);
    auto frozen = register_all(ctx, {10007, 30011}, 31);  // every shard packed
    auto trainable = register_all(ctx, {10007, 30011}, 31);
    freeze_all(frozen);
    std::vector<P> all;
    for (auto* list : {&frozen, &trainable})
      for (const auto& p : *list) all.push_back(p);
    fetch_all(ctx, all);
    for (size_t i = 0; i < frozen.size(); ++i) {
      EXPECT_EQ(gathered(frozen[i]), expected_qwz(frozen[i], 3, {8, 256})) << frozen[i].name;
      EXPECT_EQ(gathered(frozen[i]), gathered(trainable[i])) << frozen[i].name;
    }
    release_all(ctx, all);
    for (auto& p : all) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// hpZ: the forward gather is of the packets; the later ones come from the
// secondary shards, copies of what it left.
TEST(Frozen, HpzSecondaryGathersReturnTheDequantizedValues) {
  run_ranks(4, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, frozen_config(R"(, "zero_hpz_partition_size": 2)").c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {1, 7, 257, 10007}, 5);
    freeze_all(ps);
    for (int round = 0; round < 2; ++round) {
      fetch_all(ctx, ps);
      for (const auto& p : ps) EXPECT_EQ(gathered(p), expected_gather(p, 4, {8, 256})) << p.name;
      release_all(ctx, ps);
    }
    zs_fetch_stats s = ZS_FETCH_STATS_INIT;
    ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &s));
    EXPECT_EQ(s.hpz_gathers, 1u);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// MiCS's two-hop gather over two and three "nodes" of two moves the
// packets too.
void frozen_hierarchical(int shard) {
  run_ranks(shard, [shard](const RankEnv& env) {
    const std::string cfg = frozen_config(R"(, "zero_quantized_weights_bits": 4, "mics_shard_size": )" +
                                          std::to_string(shard) +
                                          R"(, "mics_hierarchical_params_gather": true)");
    zs_context_options o = zs::test::rank_options(env, cfg.c_str());
    o.local_world_size = 2;
    o.local_rank = env.rank % 2;
    frozen_roundtrip(env, cfg, {4, 256}, {1, 7, 257, 10007}, shard, &o);
  });
}

TEST(Frozen, MicsHierarchicalTwoHops) { frozen_hierarchical(4); }
TEST(Frozen, MicsHierarchicalOverThreeNodes) { frozen_hierarchical(6); }

// Param shards on NVMe: freezing reads the shard back once and keeps the
// packet in memory; the swap file lets go of it.
TEST(Frozen, OffloadedShardsArePackedFromTheSwapFile) {
  const std::string dir = "/tmp/zs_frozen_nvme_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  run_ranks(2, [&](const RankEnv& env) {
    const std::string cfg = frozen_config(R"(, "offload_param": {"device": "nvme", "nvme_path": ")" + dir +
                                          R"(", "max_in_cpu": 0})");
    frozen_roundtrip(env, cfg, {8, 256}, {7, 3001}, 2, nullptr, false);
  });
  std::filesystem::remove_all(dir);
}

// Without zero_quantized_nontrainable_weights a frozen param keeps its
// exact shard.
TEST(Frozen, WithoutTheKeyValuesStayExact) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, "{}");
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {7, 1001}, 3);
    const uint64_t before = shard_bytes(ctx);
    freeze_all(ps);
    EXPECT_EQ(shard_bytes(ctx), before);
    fetch_all(ctx, ps);
    for (const auto& p : ps) EXPECT_EQ(gathered(p), p.values) << p.name;
    release_all(ctx, ps);
    void* shard = nullptr;
    ZS_EXPECT_OK(zs_param_shard_data(ps[0].handle, &shard, nullptr));
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// A frozen param takes no gradient and no optimizer state, and the steps
// leave it as it was, while the trainable param beside it trains.
TEST(Frozen, OptimizerKeepsNoStateAndNeverMovesIt) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, frozen_config().c_str());
    ASSERT_NE(ctx, nullptr);
    const int64_t n = 1001;
    P w{"w", ZS_FLOAT32, n, make_values(ZS_FLOAT32, n, 7), nullptr};
    P f{"f", ZS_BFLOAT16, n, make_values(ZS_BFLOAT16, n, 8), nullptr};
    register_values(ctx, w);
    register_values(ctx, f);
    ZS_ASSERT_OK(zs_param_freeze(f.handle));
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    const zs_param both[] = {w.handle, f.handle};
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, both, 2, &hp, nullptr));
    zs_memory_stats m = ZS_MEMORY_STATS_INIT;
    ZS_ASSERT_OK(zs_context_memory(ctx, &m));
    EXPECT_EQ(m.optimizer_bytes, 2 * shard_numel(w, 2) * sizeof(float))
        << "state beyond w's two moments (f is frozen; w's master is its shard)";
    float* state = nullptr;
    EXPECT_EQ(zs_optimizer_state_data(opt, f.handle, 1, &state, nullptr), ZS_ERR_INVALID_STATE);
    EXPECT_NE(std::string(zs_last_error()).find("frozen when it joined the optimizer"), std::string::npos)
        << zs_last_error();

    const std::vector<float> grad(static_cast<size_t>(n), 0.5f);
    EXPECT_EQ(zs_grad_push(f.handle, grad.data(), ZS_FLOAT32, grad.size() * 4), ZS_ERR_INVALID_STATE);
    const std::string why = zs_last_error();
    EXPECT_NE(why.find("'f'"), std::string::npos) << why;
    EXPECT_NE(why.find("frozen"), std::string::npos) << why;

    // A gradient pushed since the last step: freezing now would drop it.
    ZS_ASSERT_OK(zs_grad_push(w.handle, grad.data(), ZS_FLOAT32, grad.size() * 4));
    EXPECT_EQ(zs_param_freeze(w.handle), ZS_ERR_INVALID_STATE);
    EXPECT_NE(std::string(zs_last_error()).find("between steps"), std::string::npos) << zs_last_error();
    const auto f_before = expected_qwz(f, 2, {8, 256});
    for (int step = 0; step < 3; ++step) {
      if (step > 0) ZS_ASSERT_OK(zs_grad_push(w.handle, grad.data(), ZS_FLOAT32, grad.size() * 4));
      ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    }
    fetch_all(ctx, {w, f});
    EXPECT_EQ(gathered(f), f_before) << "the steps moved a frozen param";
    EXPECT_NE(gathered(w), w.values) << "the trainable param did not train";
    release_all(ctx, {w, f});
    ZS_EXPECT_OK(zs_param_freeze(w.handle));  // between steps: fine
    ZS_EXPECT_OK(zs_param_freeze(w.handle));  // and again
    zs_optimizer_destroy(opt);
    zs_param_destroy(w.handle);
    zs_param_destroy(f.handle);
    zs_context_destroy(ctx);
  });
}

// Writes to a packed param are quantized into its codes; writing back the
// values it gathers changes nothing (no drift from requantizing); its
// shard has no fixed address to hand out.
TEST(Frozen, WritesAreQuantizedAndRewritingTheSameValuesChangesNothing) {
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, frozen_config().c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {7, 5003}, 41);
    freeze_all(ps);
    void* shard = nullptr;
    EXPECT_EQ(zs_param_shard_data(ps[1].handle, &shard, nullptr), ZS_ERR_INVALID_STATE);
    EXPECT_NE(std::string(zs_last_error()).find("kept as int8 codes"), std::string::npos) << zs_last_error();
    for (auto& p : ps) {
      p.values = make_values(p.dtype, p.numel, 99 + static_cast<unsigned>(p.numel));
      ZS_ASSERT_OK(zs_param_write(p.handle, p.values.data(), p.values.size()));
    }
    fetch_all(ctx, ps);
    std::vector<std::vector<uint8_t>> first;
    for (const auto& p : ps) {
      first.push_back(gathered(p));
      EXPECT_EQ(first.back(), expected_gather(p, 3, {8, 256})) << p.name;
    }
    release_all(ctx, ps);
    for (size_t i = 0; i < ps.size(); ++i)
      ZS_ASSERT_OK(zs_param_write(ps[i].handle, first[i].data(), first[i].size()));
    fetch_all(ctx, ps);
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(gathered(ps[i]), first[i]) << ps[i].name;
    release_all(ctx, ps);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
}

// A checkpoint holds a packed param's dequantized values: saved from 3
// ranks and loaded on 2 into params that are not frozen, the gathers give
// exactly what the frozen ones gave; loaded into frozen params again, the
// packets are rebuilt from those values and gather the same bits.
TEST(Frozen, CheckpointHoldsTheDequantizedValues) {
  const std::string dir = "/tmp/zs_frozen_ckpt_" + std::to_string(getpid());
  std::vector<std::vector<uint8_t>> saved;
  const std::string saved_file = dir + ".values";
  run_ranks(3, [&](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, frozen_config().c_str());
    ASSERT_NE(ctx, nullptr);
    auto ps = register_all(ctx, {7, 5003}, 51);
    freeze_all(ps);
    std::vector<zs_param> hs;
    for (const auto& p : ps) hs.push_back(p.handle);
    zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    ZS_ASSERT_OK(zs_checkpoint_save(ctx, hs.data(), hs.size(), nullptr, dir.c_str(), &o));
    fetch_all(ctx, ps);
    if (env.rank == 0) {  // what the frozen params gather, for the loads below
      std::FILE* f = std::fopen(saved_file.c_str(), "wb");
      for (const auto& p : ps) {
        const auto g = gathered(p);
        std::fwrite(g.data(), 1, g.size(), f);
      }
      std::fclose(f);
    }
    release_all(ctx, ps);
    for (auto& p : ps) zs_param_destroy(p.handle);
    zs_context_destroy(ctx);
  });
  for (bool freeze : {false, true}) {
    run_ranks(2, [&](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env, frozen_config().c_str());
      ASSERT_NE(ctx, nullptr);
      auto ps = register_all(ctx, {7, 5003}, 52);  // other values, overwritten by the load
      if (freeze) freeze_all(ps);
      std::vector<zs_param> hs;
      for (const auto& p : ps) hs.push_back(p.handle);
      zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
      ZS_ASSERT_OK(zs_checkpoint_load(ctx, hs.data(), hs.size(), nullptr, dir.c_str(), &lo, nullptr));
      fetch_all(ctx, ps);
      std::FILE* f = std::fopen(saved_file.c_str(), "rb");
      ASSERT_NE(f, nullptr);
      for (auto& p : ps) {
        std::vector<uint8_t> want(p.values.size());
        ASSERT_EQ(std::fread(want.data(), 1, want.size(), f), want.size());
        const auto got = gathered(p);
        if (!freeze || !packs_smaller(p, 2, {8, 256})) {
          EXPECT_EQ(got, want) << p.name << (freeze ? " (frozen)" : "");
        } else {
          // Quantized again over 2 ranks' shards: the saved (dequantized)
          // values within the bound.
          p.values = want;
          EXPECT_EQ(got, expected_qwz(p, 2, {8, 256})) << p.name;
          expect_within_bound(p, got, 8);
        }
      }
      std::fclose(f);
      release_all(ctx, ps);
      for (auto& p : ps) zs_param_destroy(p.handle);
      zs_context_destroy(ctx);
    });
  }
  std::filesystem::remove_all(dir);
  std::remove(saved_file.c_str());
}

}  // namespace
