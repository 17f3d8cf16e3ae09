// Landing step 1 of docs/healing.md: each rank's optimizer state has a
// replica in its holder's host memory, seeded at the first step and then
// stepped by the holder from the rank's gradient shards. After K steps
// every replica equals its source bit for bit (zs_heal_state_digest), on 2
// and 3 ranks of one host and 4 ranks on 2 fake hosts (ZS_HOST_ID), with
// AdamW, Adam and SGD with momentum side by side, odd sizes, an fp32 and a
// bf16 param (its fp32 master and working shard), clipping, a param without
// a gradient some steps, a step skipped for a NaN; a state written behind
// the step's back is seeded again; ZS_MEM_PEER_COPIES holds S + G; a step
// whose copy did not land fails on every rank and updates nothing. And the config: placement, what
// is refused and by which key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "impl/common/error.h"
#include "impl/config/config.h"
#include "impl/heal/placement.h"
#include "kernels/convert.h"
#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// ---- placement

TEST(HealPlacement, OneHostIsTheNextRank) {
  EXPECT_EQ(zs::heal::holders(3, {}), (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(zs::heal::holders(4, {0, 0, 0, 0}), (std::vector<int>{1, 2, 3, 0}));
  EXPECT_EQ(zs::heal::sources({1, 2, 0}), (std::vector<int>{2, 0, 1}));
  EXPECT_EQ(zs::heal::placement_note({1, 2, 0}, {}), "");
  EXPECT_THROW(zs::heal::holders(1, {}), zs::Error);
}

TEST(HealPlacement, InterleavesHostsSoNoCopySharesItsHost) {
  // Hosts A = {0, 1}, B = {2, 3}: the order 0, 2, 1, 3.
  const std::vector<int> host{0, 0, 1, 1};
  const auto h = zs::heal::holders(4, host);
  EXPECT_EQ(h, (std::vector<int>{2, 3, 1, 0}));
  for (size_t r = 0; r < h.size(); ++r) EXPECT_NE(host[r], host[static_cast<size_t>(h[r])]) << r;
  EXPECT_EQ(zs::heal::placement_note(h, host), "");
  // 3 hosts of 2, listed out of order.
  const std::vector<int> three{2, 0, 1, 2, 0, 1};
  const auto h3 = zs::heal::holders(6, three);
  std::vector<int> held(6, 0);
  for (size_t r = 0; r < 6; ++r) {
    EXPECT_NE(three[r], three[static_cast<size_t>(h3[r])]) << r;
    ++held[static_cast<size_t>(h3[r])];
  }
  EXPECT_EQ(held, std::vector<int>(6, 1));  // a permutation
  // Unequal hosts: some copy must share its host, and the note says which.
  const auto uneven = zs::heal::holders(4, {0, 0, 0, 1});
  const std::string note = zs::heal::placement_note(uneven, {0, 0, 0, 1});
  EXPECT_NE(note.find("unequal"), std::string::npos) << note;
}

// ---- config

std::string config_error(const std::string& json) {
  try {
    zs::parse_config(json, 4);
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::InvalidConfig) << e.what();
    return e.what();
  }
  return "";
}

TEST(HealConfig, PeerCopyParsesAndRoundTrips) {
  EXPECT_EQ(zs::parse_config("{}", 4).heal_peer_copy, -1);
  EXPECT_EQ(zs::parse_config(R"({"zeroshard": {"healing": {"peer_copy": "auto"}}})", 4).heal_peer_copy, -1);
  EXPECT_EQ(zs::parse_config(R"({"zeroshard": {"healing": {"peer_copy": true}}})", 4).heal_peer_copy, 1);
  const zs::Config off = zs::parse_config(R"({"zeroshard": {"healing": {"peer_copy": false}}})", 4);
  EXPECT_EQ(off.heal_peer_copy, 0);
  EXPECT_TRUE(off.unused_keys.empty());
  EXPECT_EQ(zs::parse_config(zs::config_to_json(off), 4).heal_peer_copy, 0);
  EXPECT_EQ(zs::parse_config(zs::config_to_json(zs::Config{}), 4).heal_peer_copy, -1);
  // min_ranks acts (a shrink when a loss leaves that many), round trips.
  const zs::Config shrinks = zs::parse_config(R"({"zeroshard": {"healing": {"peer_copy": true, "min_ranks": 2}}})", 4);
  EXPECT_EQ(shrinks.heal_min_ranks, 2);
  EXPECT_EQ(zs::parse_config(zs::config_to_json(shrinks), 4).heal_min_ranks, 2);
  EXPECT_EQ(zs::parse_config("{}", 4).heal_min_ranks, 0);
  // replacement_wait_s acts (impl/heal/replacement_wait.h), round trips.
  const zs::Config waits = zs::parse_config(
      R"({"zeroshard": {"healing": {"peer_copy": true, "min_ranks": 2, "replacement_wait_s": 2.5}}})", 4);
  EXPECT_EQ(waits.heal_replacement_wait_s, 2.5);
  EXPECT_EQ(zs::parse_config(zs::config_to_json(waits), 4).heal_replacement_wait_s, 2.5);
  EXPECT_EQ(zs::parse_config("{}", 4).heal_replacement_wait_s, 0);
}

TEST(HealConfig, RefusesBadValuesByName) {
  std::string e = config_error(R"({"zeroshard": {"healing": {"replacement_wait_s": -1}}})");
  EXPECT_NE(e.find("zeroshard.healing.replacement_wait_s: got -1, expected a number >= 0 and <= 86400"),
            std::string::npos) << e;
  e = config_error(R"({"zeroshard": {"healing": {"min_ranks": 0}}})");
  EXPECT_NE(e.find("zeroshard.healing.min_ranks"), std::string::npos) << e;
  e = config_error(R"({"zeroshard": {"healing": {"peer_copy": "yes"}}})");
  EXPECT_NE(e.find("zeroshard.healing.peer_copy: got \"yes\", expected true, false or \"auto\""), std::string::npos) << e;
  e = config_error(R"({"zeroshard": {"healing": {"peer_cpy": true}}})");
  EXPECT_NE(e.find("zeroshard.healing.peer_cpy: unknown key, did you mean \"peer_copy\"?"), std::string::npos) << e;
  e = config_error(R"({"zeroshard": {"healng": {}}})");
  EXPECT_NE(e.find("zeroshard.healng: unknown key"), std::string::npos) << e;
}

// Refused at zs_context_create before any socket opens: rank 0 of a world
// of 2 whose peer never comes fails at once.
std::string create_error(const char* config, zs_status want) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 2;
  o.store_host = "127.0.0.1";
  o.store_port = zs::test::free_port();
  o.config_json = config;
  o.timeout_ms = 300;
  zs_context ctx = nullptr;
  EXPECT_EQ(zs_context_create(&ctx, &o), want) << zs_last_error();
  zs_context_destroy(ctx);
  return zs_last_error();
}

TEST(HealConfig, RefusesWhatTheCopyCannotFollowByName) {
  std::string e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true}},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})",
                               ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(e.find("zeroshard.healing.peer_copy (true) with zero_optimization.offload_optimizer.device \"nvme\""),
            std::string::npos) << e;
  e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true}}, "zero_optimization": {
      "zero_quantized_gradients": true, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}})",
                   ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(e.find("zero_optimization.zeropp_loco_param"), std::string::npos) << e;
  e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true}}, "zero_optimization": {"mics_shard_size": 1}})",
                   ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(e.find("zero_optimization.mics_shard_size (1)"), std::string::npos) << e;
  // zs_config_check says the same without a context (peer_copy true; "auto"
  // depends on the environment of the ranks, resolved at create).
  EXPECT_EQ(zs_config_check(R"({"zeroshard": {"healing": {"peer_copy": true}},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})", 0),
            ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(std::string(zs_last_error()).find("offload_optimizer.device \"nvme\""), std::string::npos);
  EXPECT_EQ(zs_config_check(R"({"zeroshard": {"healing": {"peer_copy": true}}})", 1), ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(std::string(zs_last_error()).find("zeroshard.healing.peer_copy (true) in a world of 1 rank"),
            std::string::npos) << zs_last_error();
  EXPECT_EQ(zs_config_check(R"({"zeroshard": {"healing": {"peer_copy": true}}})", 0), ZS_OK);
  {
    zs::test::ScopedEnv heal("ZS_HEAL", "1");
    e = create_error(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})",
                     ZS_ERR_INVALID_CONFIG);
    EXPECT_NE(e.find("zeroshard.healing.peer_copy (\"auto\", on because ZS_HEAL=1)"), std::string::npos) << e;
    // peer_copy false wins over ZS_HEAL: nothing refused (the create then
    // waits for its peer, which never comes: a timeout, not the config).
    create_error(R"({"zeroshard": {"healing": {"peer_copy": false}}, "zero_optimization": {
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})", ZS_ERR_TIMEOUT);
  }
}

// A deadline for a replacement needs a shrink to fall back on, and must end
// before the other survivors stop waiting for the verdict.
TEST(HealConfig, AReplacementDeadlineWithoutMinRanksOrPastTheTimeoutIsRefusedAtCreate) {
  std::string e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true, "replacement_wait_s": 0.2}}})",
                               ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(e.find("replacement_wait_s = 0.2 s is how long the survivors wait"), std::string::npos) << e;
  EXPECT_NE(e.find("set zeroshard.healing.min_ranks"), std::string::npos) << e;
  e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true, "min_ranks": 1, "replacement_wait_s": 0.3}}})",
                   ZS_ERR_INVALID_CONFIG);
  EXPECT_NE(e.find("replacement_wait_s = 0.3 s is not below the store's timeout (300 ms"), std::string::npos) << e;
  zs::test::ScopedEnv wait("ZS_HEAL_REPLACEMENT_WAIT_S", "soon");
  e = create_error(R"({"zeroshard": {"healing": {"peer_copy": true, "min_ranks": 1}}})", ZS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(e.find("ZS_HEAL_REPLACEMENT_WAIT_S='soon': expected seconds"), std::string::npos) << e;
}

// ZS_HEAL_JOIN: only "grow", and only for a process that comes back for a
// rank (ZS_HEAL_REPLACEMENT), named before any socket opens.
TEST(HealConfig, AJoinOtherThanGrowOrWithoutAReplacementNumberIsRefusedAtCreate) {
  const char* on = R"({"zeroshard": {"healing": {"peer_copy": true}}})";
  {
    zs::test::ScopedEnv join("ZS_HEAL_JOIN", "later");
    const std::string e = create_error(on, ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(e.find("ZS_HEAL_JOIN='later': expected \"grow\""), std::string::npos) << e;
  }
  zs::test::ScopedEnv join("ZS_HEAL_JOIN", "grow");
  const std::string e = create_error(on, ZS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(e.find("ZS_HEAL_JOIN=grow for rank 0 needs ZS_HEAL_REPLACEMENT=<n> as well"), std::string::npos) << e;
}

// Ranks that disagree on whether the copy is on (ZS_HEAL on one rank only)
// fail at create, naming the key on every rank, before any makes the heal
// group.
TEST(HealConfig, RanksThatDisagreeOnPeerCopyFailAtCreate) {
  run_ranks(2, [](const RankEnv& env) {
    if (env.rank == 1) setenv("ZS_HEAL", "1", 1);
    zs_context_options o = zs::test::rank_options(env, nullptr);
    zs_context ctx = nullptr;
    ASSERT_EQ(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG) << zs_last_error();
    const std::string e = zs_last_error();
    EXPECT_NE(e.find("rank 1 has zeroshard.healing.peer_copy = true where rank 0 has false"), std::string::npos)
        << e;
  });
}

// ZS_HEAL=auto (what zsrun --restarts exports) turns the copy on where it
// can act and off, with no error, where it cannot: MiCS here leaves it off
// in the effective config; without MiCS it is on, and an External
// optimizer (its update is the caller's) keeps no copy.
TEST(HealConfig, AutoFromTheLauncherIsOffWhereTheCopyCannotAct) {
  zs::test::ScopedEnv heal("ZS_HEAL", "auto");
  run_ranks(2, [](const RankEnv& env) {
    zs_context mics = zs::test::make_context(env, R"({"zero_optimization": {"mics_shard_size": 1}})");
    ASSERT_NE(mics, nullptr);
    const char* json = nullptr;
    ZS_ASSERT_OK(zs_context_config_json(mics, &json));
    EXPECT_NE(std::string(json).find("\"peer_copy\": false"), std::string::npos) << json;
    zs_context_destroy(mics);
  });
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, nullptr);
    ASSERT_NE(ctx, nullptr);
    const char* json = nullptr;
    ZS_ASSERT_OK(zs_context_config_json(ctx, &json));
    EXPECT_NE(std::string(json).find("\"peer_copy\": true"), std::string::npos) << json;
    zs_optimizer ext = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&ext, ctx, ZS_OPTIM_EXTERNAL));
    uint64_t hash = 0;
    EXPECT_EQ(zs_heal_state_digest(&hash, nullptr, nullptr, ext, 0), ZS_ERR_INVALID_STATE);
    EXPECT_NE(std::string(zs_last_error()).find("keeps no peer copy"), std::string::npos) << zs_last_error();
    zs_optimizer_destroy(ext);
    zs_context_destroy(ctx);
  });
}

// ---- the copy, on real ranks

constexpr int kSteps = 4;

struct ParamSpec {
  const char* name;
  int64_t numel;
  zs_dtype dtype;
};

float init_value(int p, uint64_t i) { return std::sin(static_cast<float>(i * 3 + static_cast<uint64_t>(p))) * 0.5f; }
float grad_value(int rank, int step, int p, uint64_t i) {
  return std::cos(static_cast<float>(i * 7 + static_cast<uint64_t>(step * 13 + p * 5 + rank * 31))) * 0.1f;
}

zs_param register_param(zs_context ctx, const ParamSpec& spec, int index) {
  const size_t esize = spec.dtype == ZS_FLOAT32 ? 4 : 2;
  std::vector<float> init(static_cast<size_t>(spec.numel));
  for (size_t i = 0; i < init.size(); ++i) init[i] = init_value(index, i);
  std::vector<uint8_t> bytes(init.size() * esize);
  zs::kernels::cast_from_f32(init.data(), bytes.data(),
                             spec.dtype == ZS_FLOAT32 ? zs::kernels::WorkDtype::F32 : zs::kernels::WorkDtype::BF16,
                             init.size());
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = spec.name;
  o.dtype = spec.dtype;
  o.ndim = 1;
  o.shape = &spec.numel;
  o.init = ZS_INIT_FROM_ALL;
  o.data = bytes.data();
  o.data_bytes = bytes.size();
  zs_param p = nullptr;
  EXPECT_EQ(zs_param_register(&p, ctx, &o), ZS_OK) << zs_last_error();
  return p;
}

// The pool's size class of an allocation (memory_report_test.cpp).
uint64_t size_class(uint64_t bytes) {
  if (bytes == 0) return 0;
  uint64_t size = (bytes + 63) / 64 * 64;
  const uint64_t mib = 1u << 20;
  if (size <= mib) return size;
  uint64_t top = mib;
  while (top <= size / 2) top *= 2;
  const uint64_t step = top / 8;
  return (size + step - 1) / step * step;
}

struct Digests {
  uint64_t own = 0, replica = 0;
  int64_t own_step = -1, replica_step = -1;
  int64_t replica_source = -1;
};

Digests digests(zs_optimizer opt) {
  Digests d;
  int source = -1;
  EXPECT_EQ(zs_heal_state_digest(&d.own, &source, &d.own_step, opt, 0), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_heal_state_digest(&d.replica, &source, &d.replica_step, opt, 1), ZS_OK) << zs_last_error();
  d.replica_source = source;
  return d;
}

// Every rank's digests, in rank order.
std::vector<Digests> gather(zs_context ctx, const Digests& mine, int world) {
  zs_group g = nullptr;
  EXPECT_EQ(zs_context_group(&g, ctx, ZS_GROUP_WORLD), ZS_OK) << zs_last_error();
  const int64_t send[5] = {static_cast<int64_t>(mine.own), static_cast<int64_t>(mine.replica), mine.own_step,
                           mine.replica_step, mine.replica_source};
  std::vector<int64_t> all(static_cast<size_t>(5 * world));
  zs_work w = nullptr;
  EXPECT_EQ(zs_allgather(&w, g, send, all.data(), 5 * sizeof(int64_t), ZS_UINT8), ZS_OK) << zs_last_error();
  EXPECT_EQ(zs_work_wait(w, 30000), ZS_OK) << zs_last_error();
  zs_work_destroy(w);
  zs_group_destroy(g);
  std::vector<Digests> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int64_t* v = &all[static_cast<size_t>(5 * r)];
    out[static_cast<size_t>(r)] = {static_cast<uint64_t>(v[0]), static_cast<uint64_t>(v[1]), v[2], v[3], v[4]};
  }
  return out;
}

// Every replica equals its source's own state; returns whether all did.
bool replicas_equal(const std::vector<Digests>& all, const std::vector<int>& source_of, int64_t step,
                    const std::string& when) {
  bool ok = true;
  for (size_t h = 0; h < all.size(); ++h) {
    const int s = source_of[h];
    EXPECT_EQ(all[h].replica_source, s) << when;
    const Digests& src = all[static_cast<size_t>(s)];
    EXPECT_EQ(src.own_step, step) << when;
    EXPECT_EQ(all[h].replica_step, step) << when;
    if (all[h].replica != src.own) ok = false;
    EXPECT_EQ(all[h].replica, src.own) << when << ": rank " << h << "'s replica of rank " << s;
  }
  return ok;
}

// One world: three params under AdamW, two under SGD with momentum (a
// second optimizer, its own copy over the same heal group) and one under
// Adam, K steps, digests compared after each; then a master written behind
// the optimizer's back (the replica is stale until the next step seeds it).
void run_world(const RankEnv& env, const char* config, int hosts, const std::vector<int>& source_of) {
  if (hosts > 1) zs::test::play_host(env.rank * hosts / env.world);
  zs_context ctx = zs::test::make_context(env, config);
  ASSERT_NE(ctx, nullptr);
  const std::vector<ParamSpec> specs{{"w.adamw", 1003, ZS_FLOAT32}, {"e.adamw", 70001, ZS_BFLOAT16},
                                     {"b.adamw", 2, ZS_FLOAT32},    {"w.sgd", 333, ZS_FLOAT32},
                                     {"e.sgd", 4097, ZS_BFLOAT16},   {"w.adam", 129, ZS_FLOAT32},
                                     {"frozen.adamw", 515, ZS_BFLOAT16}};
  std::vector<zs_param> params;
  for (size_t i = 0; i < specs.size(); ++i) params.push_back(register_param(ctx, specs[i], static_cast<int>(i)));
  // A frozen param in AdamW's group: its shard is copied, it has no state
  // and never a gradient (no gradient buffer either).
  const size_t kFrozen = 6;
  ZS_ASSERT_OK(zs_param_freeze(params[kFrozen]));

  // Muon and an external optimizer are refused, by name.
  zs_optimizer refused = nullptr;
  EXPECT_EQ(zs_optimizer_create(&refused, ctx, ZS_OPTIM_MUON), ZS_ERR_NOT_SUPPORTED);
  EXPECT_NE(std::string(zs_last_error()).find("zeroshard.healing.peer_copy (on) with ZS_OPTIM_MUON"),
            std::string::npos) << zs_last_error();
  EXPECT_EQ(zs_optimizer_create(&refused, ctx, ZS_OPTIM_EXTERNAL), ZS_ERR_NOT_SUPPORTED);

  zs_optimizer adamw = nullptr, sgd = nullptr, adam = nullptr;
  ZS_ASSERT_OK(zs_optimizer_create(&adamw, ctx, ZS_OPTIM_ADAMW));
  ZS_ASSERT_OK(zs_optimizer_create(&sgd, ctx, ZS_OPTIM_SGD));
  ZS_ASSERT_OK(zs_optimizer_create(&adam, ctx, ZS_OPTIM_ADAM));
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.01;
  ZS_ASSERT_OK(zs_optimizer_add_group(adamw, params.data(), 3, &hp, nullptr));
  zs_optim_hparams hs = ZS_OPTIM_HPARAMS_INIT;
  hs.lr = 0.05;
  hs.momentum = 0.9;
  hs.weight_decay = 0.001;
  ZS_ASSERT_OK(zs_optimizer_add_group(sgd, params.data() + 3, 2, &hs, nullptr));
  ZS_ASSERT_OK(zs_optimizer_add_group(adam, params.data() + 5, 1, &hp, nullptr));
  int frozen_group = -1;
  ZS_ASSERT_OK(zs_optimizer_add_group(adamw, &params[kFrozen], 1, &hp, &frozen_group));
  EXPECT_EQ(frozen_group, 1);
  std::vector<zs_optimizer> opts{adamw, sgd, adam};

  // Before the first step there is no replica.
  uint64_t hash = 0;
  EXPECT_EQ(zs_heal_state_digest(&hash, nullptr, nullptr, adamw, 1), ZS_ERR_INVALID_STATE);

  std::vector<uint64_t> previous_own(opts.size(), 0);
  for (int step = 1; step <= kSteps; ++step) {
    for (size_t i = 0; i < specs.size(); ++i) {
      // "b.adamw" has no gradient at step 2: neither it nor its replica moves.
      if ((i == 2 && step == 2) || i == kFrozen) continue;
      std::vector<float> g(static_cast<size_t>(specs[i].numel));
      for (size_t k = 0; k < g.size(); ++k) g[k] = grad_value(env.rank, step, static_cast<int>(i), k);
      ZS_ASSERT_OK(zs_grad_push(params[i], g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
    }
    for (zs_optimizer o : opts) ZS_ASSERT_OK(zs_optimizer_step(o, nullptr));
    for (size_t k = 0; k < opts.size(); ++k) {
      const auto all = gather(ctx, digests(opts[k]), env.world);
      replicas_equal(all, source_of, step, "optimizer " + std::to_string(k) + " after step " + std::to_string(step));
      // The digests see every step, and the ranks' states differ.
      EXPECT_NE(all[static_cast<size_t>(env.rank)].own, previous_own[k]);
      previous_own[k] = all[static_cast<size_t>(env.rank)].own;
      for (int r = 1; r < env.world; ++r) EXPECT_NE(all[0].own, all[static_cast<size_t>(r)].own);
    }
  }

  // A step with a NaN gradient (one in each optimizer's params) is skipped
  // on every rank: the replicas do not move either.
  for (size_t i = 0; i < kFrozen; ++i) {
    std::vector<float> g(static_cast<size_t>(specs[i].numel), 0.02f);
    if (i == 0 || i == 3 || i == 5) g[g.size() / 2] = std::nanf("");  // one in each optimizer
    ZS_ASSERT_OK(zs_grad_push(params[i], g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
  }
  for (zs_optimizer o : opts) {
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step(o, &r));
    EXPECT_EQ(r.skipped, 1);
  }
  for (size_t k = 0; k < opts.size(); ++k) {
    const auto all = gather(ctx, digests(opts[k]), env.world);
    replicas_equal(all, source_of, kSteps, "optimizer " + std::to_string(k) + " after a skipped step");
    EXPECT_EQ(all[static_cast<size_t>(env.rank)].own, previous_own[k]);
  }

  // ZS_MEM_PEER_COPIES: the replica (S: shard, fp32 master of a bf16 param,
  // moments) and the gradient buffer (G) of every param, each a pool block.
  uint64_t want = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t n = static_cast<uint64_t>((specs[i].numel + env.world - 1) / env.world);
    const uint64_t esize = specs[i].dtype == ZS_FLOAT32 ? 4 : 2;
    want += size_class(n * esize);  // the shard
    if (i == kFrozen) continue;     // no state, no gradient
    const int moments = i == 3 || i == 4 ? 1 : 2;
    want += size_class(n * 4) * moments + size_class(n * 4);       // moments, grad
    if (specs[i].dtype != ZS_FLOAT32) want += size_class(n * 4);  // master
  }
  std::vector<uint64_t> kinds(ZS_MEM_KIND_COUNT, 0);
  ZS_ASSERT_OK(zs_memory_by_kind(ctx, ZS_PHASE_NOW, kinds.data(), kinds.size(), nullptr, nullptr));
  EXPECT_EQ(kinds[ZS_MEM_PEER_COPIES], want);
  EXPECT_EQ(kinds[ZS_MEM_UNTAGGED], 0u);
  EXPECT_STREQ(zs_memory_kind_name(ZS_MEM_PEER_COPIES), "peer_copies");

  // A master written behind the step (as a checkpoint load does): the
  // replica no longer equals it, until the next step seeds it again.
  float* master = nullptr;
  uint64_t numel = 0;
  ZS_ASSERT_OK(zs_optimizer_state_data(adamw, params[1], 0, &master, &numel));
  if (numel > 0) master[0] += 1.0f;
  {
    const auto all = gather(ctx, digests(adamw), env.world);
    // Every rank's shard of e.adamw is non-empty: each changed its master.
    for (size_t h = 0; h < all.size(); ++h)
      EXPECT_NE(all[h].replica, all[static_cast<size_t>(source_of[h])].own)
          << "rank " << h << " should hold a stale replica";
  }
  for (size_t i = 0; i < kFrozen; ++i) {
    std::vector<float> g(static_cast<size_t>(specs[i].numel), 0.01f);
    ZS_ASSERT_OK(zs_grad_push(params[i], g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
  }
  for (zs_optimizer o : opts) ZS_ASSERT_OK(zs_optimizer_step(o, nullptr));
  for (size_t k = 0; k < opts.size(); ++k)
    replicas_equal(gather(ctx, digests(opts[k]), env.world), source_of, kSteps + 1,
                   "optimizer " + std::to_string(k) + " after the reseed");

  for (zs_optimizer o : opts) zs_optimizer_destroy(o);
  for (zs_param p : params) zs_param_destroy(p);
  zs_context_destroy(ctx);
}

const char* kConfig = R"({"zeroshard": {"healing": {"peer_copy": true}}, "gradient_clipping": 0.5,
                          "bf16": {"enabled": true}})";

TEST(HealPeerCopy, ReplicasEqualTheirSourcesOnThreeRanks) {
  run_ranks(3, [](const RankEnv& env) { run_world(env, kConfig, 1, {2, 0, 1}); });
}

TEST(HealPeerCopy, ReplicasEqualTheirSourcesOnTwoRanks) {
  // Each rank is the other's holder and source: one pair both ways.
  run_ranks(2, [](const RankEnv& env) { run_world(env, kConfig, 1, {1, 0}); });
}

TEST(HealPeerCopy, ReplicasEqualTheirSourcesOnFourRanksOfTwoHosts) {
  // peer_copy "auto" under ZS_HEAL=1; hosts {0, 1} and {2, 3}: holders
  // 0 -> 2 -> 1 -> 3 -> 0, so rank h holds source_of[h].
  zs::test::ScopedEnv heal("ZS_HEAL", "1");
  run_ranks(4, [](const RankEnv& env) {
    run_world(env, R"({"gradient_clipping": 0.5, "bf16": {"enabled": true}})", 2, {3, 2, 0, 1});
  });
}

// The commit rule: one holder takes a copy as lost (ZS_HEAL_DROP_COPY), so
// its flag in the norm's all-reduce is 0; that step fails on every rank,
// naming it, before anything is updated; the next call seeds again and
// commits, and the replicas equal their sources.
TEST(HealPeerCopy, AStepWhoseCopyDidNotLandFailsOnEveryRankAndUpdatesNothing) {
  zs::test::ScopedEnv drop("ZS_HEAL_DROP_COPY", "1:2");
  run_ranks(3, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"zeroshard": {"healing": {"peer_copy": true}}})");
    ASSERT_NE(ctx, nullptr);
    zs_param p = register_param(ctx, {"w", 1001, ZS_FLOAT32}, 0);
    zs_optimizer opt = nullptr;
    ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW));
    zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
    ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
    const std::vector<int> source_of{2, 0, 1};
    auto push = [&](int step) {
      std::vector<float> g(1001);
      for (size_t k = 0; k < g.size(); ++k) g[k] = grad_value(env.rank, step, 0, k);
      ZS_ASSERT_OK(zs_grad_push(p, g.data(), ZS_FLOAT32, g.size() * sizeof(float)));
    };
    push(1);
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    const Digests before = digests(opt);
    push(2);
    EXPECT_EQ(zs_optimizer_step(opt, nullptr), ZS_ERR_INVALID_STATE);
    const std::string e = zs_last_error();
    EXPECT_NE(e.find("optimizer step 2 did not commit: 1 of 3 ranks' gradient copies did not land"), std::string::npos)
        << e;
    if (env.rank == 1) {
      EXPECT_NE(e.find("from rank 0 did not: dropped by ZS_HEAL_DROP_COPY"), std::string::npos) << e;
    }
    const Digests after = digests(opt);
    EXPECT_EQ(after.own, before.own);  // nothing was updated, the replicas neither
    EXPECT_EQ(after.own_step, 1);
    replicas_equal(gather(ctx, after, env.world), source_of, 1, "after the step that did not commit");
    // The gradients are still there: the same step again commits.
    ZS_ASSERT_OK(zs_optimizer_step(opt, nullptr));
    replicas_equal(gather(ctx, digests(opt), env.world), source_of, 2, "after the retried step");
    zs_optimizer_destroy(opt);
    zs_param_destroy(p);
    zs_context_destroy(ctx);
  });
}

}  // namespace
