// LoCo error feedback for qgZ (zeropp_loco_param): the fused kernel is
// bitwise the scalar loop over kernels/quant.h's formulas (odd sizes, int4
// and int8, several block sizes and betas, non-finite blocks, any thread
// count); feeding the error back makes the sum of what was sent track the
// sum of the true gradients; and on real ranks (2, 3, two nodes of two)
// the gradient shards are, bitwise, the algorithm run with every sender's
// error carried from step to step and zeroed every reset_T steps. With
// MiCS and hpZ (one node and two), SGD on every rank ends with the same
// params, nearer the unquantized run's than without LoCo.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/quant.h"
#include "tests/support/multirank.h"

namespace k = zs::kernels;
using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// The scalar loop: each block's max |g + e|, then code, dequantized value
// and new error element by element.
void reference(const float* g, float* err, float beta, size_t n, k::QuantSpec s, uint8_t* codes,
               float* scales) {
  const int qmax = k::quant_qmax(s.bits);
  const float keep = 1.0f - beta;
  for (size_t b = 0; b < k::quant_blocks(n, s); ++b) {
    const size_t first = b * s.block, len = std::min(s.block, n - first);
    uint32_t maxbits = 0;
    for (size_t j = 0; j < len; ++j)
      maxbits = std::max(maxbits, k::abs_bits(g[first + j] + err[first + j]));
    const bool finite = k::is_finite_bits(maxbits);
    const float scale = k::quant_scale(k::bits_float(maxbits), finite, qmax);
    scales[b] = scale;
    for (size_t j = 0; j < s.block; ++j) {
      int q = 0;
      if (j < len) {
        const float x = g[first + j] + err[first + j];
        q = k::quant_code(x, scale, qmax);
        err[first + j] = k::loco_error(err[first + j], x, k::quant_value(q, scale), beta, keep, finite);
      }
      const size_t at = first + j;
      if (s.bits == 8) {
        codes[at] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else if (at % 2 == 0) {
        codes[at / 2] = k::nibble_of(q);
      } else {
        codes[at / 2] = static_cast<uint8_t>(codes[at / 2] | (k::nibble_of(q) << 4));
      }
    }
  }
}

std::vector<float> normal(size_t n, unsigned seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(LocoKernel, BitIdenticalToTheScalarLoop) {
  for (int bits : {4, 8})
    for (size_t block : {size_t{2}, size_t{256}, size_t{2048}})
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{255}, size_t{257}, size_t{1001},
                       size_t{3 * 65536 + 5}})
        for (float beta : {0.0f, 0.8f, 1.0f})
          for (int threads : {1, 3}) {
            k::set_num_threads(threads);
            const k::QuantSpec s{bits, block};
            const std::string what = "int" + std::to_string(bits) + " block " + std::to_string(block) +
                                     " n=" + std::to_string(n) + " beta " + std::to_string(beta) +
                                     " threads " + std::to_string(threads);
            std::vector<float> e1 = normal(n, 3, 0.05f), e2 = e1;
            std::vector<uint8_t> c1(k::quant_code_bytes(n, s), 0xAB), c2(c1.size(), 0xCD);
            std::vector<float> s1(k::quant_blocks(n, s), -1.0f), s2(s1.size(), -2.0f);
            for (int step = 0; step < 3; ++step) {  // the error carries over
              std::vector<float> g = normal(n, 10 + static_cast<unsigned>(step), 1.0f);
              if (n == 1001 && step == 1) g[600] = INFINITY;  // poisons one block
              if (n == 257 && step == 2) g[3] = NAN;
              k::quantize_with_error(g.data(), e1.data(), beta, n, s, c1.data(), s1.data());
              reference(g.data(), e2.data(), beta, n, s, c2.data(), s2.data());
              ASSERT_EQ(c1, c2) << what << " step " << step << ": codes";
              ASSERT_EQ(0, n ? std::memcmp(s1.data(), s2.data(), s1.size() * 4) : 0) << what << ": scales";
              ASSERT_EQ(0, n ? std::memcmp(e1.data(), e2.data(), n * 4) : 0) << what << ": errors";
            }
          }
  k::set_num_threads(0);
}

// A block holding an inf sends NaN (as qgZ does) and keeps no error, so
// the next step is clean again; the other blocks keep theirs.
TEST(LocoKernel, NonFiniteBlockKeepsNoError) {
  const k::QuantSpec s{4, 256};
  std::vector<float> g = normal(512, 1, 1.0f), e(512, 0.01f);
  g[10] = INFINITY;
  std::vector<uint8_t> codes(k::quant_code_bytes(512, s));
  std::vector<float> scales(2);
  k::quantize_with_error(g.data(), e.data(), 0.8f, 512, s, codes.data(), scales.data());
  EXPECT_TRUE(std::isnan(scales[0]));
  EXPECT_TRUE(std::isfinite(scales[1]));
  for (size_t i = 0; i < 256; ++i) ASSERT_EQ(e[i], 0.0f) << i;
  size_t kept = 0;
  for (size_t i = 256; i < 512; ++i) kept += std::isfinite(e[i]) && e[i] != 0.0f;
  EXPECT_GT(kept, 200u);
}

// What error feedback is for: a gradient with a steady part loses the same
// rounding every step without it, so the sum of what was sent drifts from
// the sum of the true gradients linearly; with it the lost part is resent.
TEST(LocoKernel, SentSumTracksTheTrueSumBetterThanWithoutFeedback) {
  const size_t n = 4096;
  const int steps = 64;
  const k::QuantSpec s{4, 256};
  const std::vector<float> steady = normal(n, 7, 1.0f);
  auto drift = [&](bool loco, float beta) {
    std::vector<float> e(n, 0.0f), deq(n), scales(k::quant_blocks(n, s));
    std::vector<uint8_t> codes(k::quant_code_bytes(n, s));
    std::vector<double> sent(n, 0.0), truth(n, 0.0);
    for (int t = 0; t < steps; ++t) {
      std::vector<float> g = normal(n, 100 + static_cast<unsigned>(t), 0.1f);
      for (size_t i = 0; i < n; ++i) g[i] += steady[i];
      if (loco)
        k::quantize_with_error(g.data(), e.data(), beta, n, s, codes.data(), scales.data());
      else
        k::quantize(g.data(), k::WorkDtype::F32, n, s, codes.data(), scales.data());
      k::dequantize(codes.data(), scales.data(), n, s, deq.data(), k::WorkDtype::F32);
      for (size_t i = 0; i < n; ++i) {
        sent[i] += deq[i];
        truth[i] += g[i];
      }
    }
    double sq = 0, ref = 0;
    for (size_t i = 0; i < n; ++i) {
      sq += (sent[i] - truth[i]) * (sent[i] - truth[i]);
      ref += truth[i] * truth[i];
    }
    return std::sqrt(sq / ref);  // relative RMS drift of the sum
  };
  const double plain = drift(false, 0), loco = drift(true, 0.8f), full = drift(true, 0.0f);
  std::printf("relative drift of the sent sum over %d int4 steps: without LoCo %.5f, LoCo beta 0.8 "
              "%.5f, beta 0 %.5f\n", steps, plain, loco, full);
  EXPECT_LT(loco, 0.5 * plain);
  EXPECT_LT(full, 0.5 * plain);
}

// ---- on real ranks

const std::vector<int64_t> kNumels = {1, 7, 257, 1001, 3001};

size_t shard_of(int64_t numel, int world) {
  return (static_cast<size_t>(numel) + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
}

// Rank r's gradient of param p at step t, different on every rank and step.
std::vector<float> grad_of(int rank, int step, size_t p, int64_t numel) {
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + 100 * step + 17 * p + 5));
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> out(static_cast<size_t>(numel));
  for (size_t i = 0; i < out.size(); ++i) out[i] = g(rng) * (1.0f + 0.25f * static_cast<float>(i % 5));
  return out;
}

// Rank r's bucket block j at step t: each param's shard j, zero-padded.
std::vector<float> block_of(int rank, int step, int j, int world) {
  std::vector<float> out;
  for (size_t p = 0; p < kNumels.size(); ++p) {
    const auto g = grad_of(rank, step, p, kNumels[p]);
    const size_t shard = shard_of(kNumels[p], world);
    for (size_t i = 0; i < shard; ++i) {
      const size_t at = static_cast<size_t>(j) * shard + i;
      out.push_back(at < g.size() ? g[at] : 0.0f);
    }
  }
  return out;
}

// One sender's quantization of a block with its own error, dequantized.
std::vector<float> send(const std::vector<float>& x, std::vector<float>& err, float beta, k::QuantSpec s) {
  if (err.empty()) err.assign(x.size(), 0.0f);
  std::vector<uint8_t> codes(k::quant_code_bytes(x.size(), s));
  std::vector<float> scales(k::quant_blocks(x.size(), s)), deq(x.size());
  k::quantize_with_error(x.data(), err.data(), beta, x.size(), s, codes.data(), scales.data());
  k::dequantize(codes.data(), scales.data(), x.size(), s, deq.data(), k::WorkDtype::F32);
  return deq;
}

std::string loco_config(int bits, double beta, int reset) {
  return R"({"zero_optimization": {"zero_quantized_gradients": true, "zero_quantized_gradients_bits": )" +
         std::to_string(bits) + R"(, "zeropp_loco_param": {"err_beta": )" + std::to_string(beta) +
         R"(, "reset_T": )" + std::to_string(reset) + "}}}";
}

// `steps` pushes and syncs on this rank with LoCo; after each, this rank's
// gradient shards (accumulated, as the engine keeps them until zeroed)
// must be bitwise what the algorithm gives: per step, every sender's
// block for me quantized with its carried error (hop 1 and, across whole
// nodes, the node's partial sum with its hop-2 error), dequantized, summed
// in order, divided by the world, added to the running shard.
// With ckpt_dir, a checkpoint is saved and loaded after step 0: the errors
// are not saved, so step 1 starts from zero, as after a reset.
void run_loco(const RankEnv& env, int local, int bits, double beta, int reset, int steps,
              const std::string& ckpt_dir = "") {
  const std::string cfg = loco_config(bits, beta, reset);
  zs_context_options o = zs::test::rank_options(env, cfg.c_str());
  o.local_rank = env.rank % local;
  o.local_world_size = local;
  zs_context ctx = nullptr;
  ZS_ASSERT_OK(zs_context_create(&ctx, &o));
  std::vector<zs_param> hs;
  std::vector<int64_t> shapes(kNumels);
  for (size_t p = 0; p < kNumels.size(); ++p) {
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(p);
    po.name = name.c_str();
    po.ndim = 1;
    po.shape = &shapes[p];
    zs_param h = nullptr;
    ZS_ASSERT_OK(zs_param_register(&h, ctx, &po));
    hs.push_back(h);
  }
  const int world = env.world, me = env.rank;
  const bool two_hops = local > 1 && local < world && world % local == 0;
  const int nodes = two_hops ? world / local : 1;
  const k::QuantSpec s{bits, 256};
  const auto fb = static_cast<float>(beta);
  std::vector<std::vector<float>> err1(static_cast<size_t>(world)), err2(static_cast<size_t>(nodes));
  std::vector<float> expect;
  for (int t = 0; t < steps; ++t) {
    if ((t > 0 && t % reset == 0) || (t == 1 && !ckpt_dir.empty())) {  // from zero again
      for (auto& e : err1) std::fill(e.begin(), e.end(), 0.0f);
      for (auto& e : err2) std::fill(e.begin(), e.end(), 0.0f);
    }
    std::vector<float> acc;
    if (!two_hops) {
      for (int r = 0; r < world; ++r) {
        const auto d = send(block_of(r, t, me, world), err1[static_cast<size_t>(r)], fb, s);
        if (acc.empty()) acc = d;
        else for (size_t i = 0; i < d.size(); ++i) acc[i] += d[i];
      }
    } else {
      for (int node = 0; node < nodes; ++node) {
        std::vector<float> partial;
        for (int l = 0; l < local; ++l) {
          const int r = node * local + l;
          const auto d = send(block_of(r, t, me, world), err1[static_cast<size_t>(r)], fb, s);
          if (partial.empty()) partial = d;
          else for (size_t i = 0; i < d.size(); ++i) partial[i] += d[i];
        }
        const auto d = send(partial, err2[static_cast<size_t>(node)], fb, s);
        if (acc.empty()) acc = d;
        else for (size_t i = 0; i < d.size(); ++i) acc[i] += d[i];
      }
    }
    if (expect.empty()) expect.assign(acc.size(), 0.0f);
    for (size_t i = 0; i < acc.size(); ++i) expect[i] = expect[i] + acc[i] / static_cast<float>(world);

    for (size_t p = 0; p < kNumels.size(); ++p) {
      const auto g = grad_of(me, t, p, kNumels[p]);
      ZS_ASSERT_OK(zs_grad_push(hs[p], g.data(), ZS_FLOAT32, g.size() * 4));
    }
    ZS_ASSERT_OK(zs_grad_sync(ctx));
    std::vector<float> got;
    for (zs_param h : hs) {
      float* data = nullptr;
      uint64_t n = 0;
      ZS_ASSERT_OK(zs_grad_shard_data(h, &data, &n));
      got.insert(got.end(), data, data + n);
    }
    ASSERT_EQ(got.size(), expect.size());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &expect[i], 4) != 0 && bad++ < 5)
        ADD_FAILURE() << "rank " << me << " step " << t << " element " << i << ": " << got[i]
                      << ", expected " << expect[i];
    ASSERT_EQ(bad, 0u) << "step " << t;
    if (t == 0 && !ckpt_dir.empty()) {
      zs_checkpoint_save_options so = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
      zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
      ZS_ASSERT_OK(zs_checkpoint_save(ctx, hs.data(), hs.size(), nullptr, ckpt_dir.c_str(), &so));
      ZS_ASSERT_OK(zs_checkpoint_load(ctx, hs.data(), hs.size(), nullptr, ckpt_dir.c_str(), &lo, nullptr));
    }
  }
  // The errors are counted on their own: world blocks of this rank's
  // bucket (hop 1), and more with two hops.
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  ZS_ASSERT_OK(zs_context_memory(ctx, &m));
  EXPECT_GE(m.loco_error_bytes, expect.size() * 4 * static_cast<uint64_t>(world)) << "LoCo errors uncounted";
  for (zs_param h : hs) zs_param_destroy(h);
  zs_context_destroy(ctx);
}

TEST(LocoQgz, TwoRanksInt4) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(2, [](const RankEnv& env) { run_loco(env, 2, 4, 0.8, 1024, 4); });
}
TEST(LocoQgz, ThreeRanksInt8) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(3, [](const RankEnv& env) { run_loco(env, 3, 8, 0.8, 1024, 4); });
}
TEST(LocoQgz, TwoNodesOfTwoKeepAnErrorPerHop) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(4, [](const RankEnv& env) { run_loco(env, 2, 4, 0.8, 1024, 3); });
}
// reset_T 2: the errors are zero again before steps 2, 4, ...
TEST(LocoQgz, ResetTZeroesTheErrors) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  run_ranks(2, [](const RankEnv& env) { run_loco(env, 2, 4, 0.5, 2, 5); });
}

// The errors are not checkpointed: a load zeroes them (README, ZeRO++ LoCo).
TEST(LocoQgz, CheckpointLoadZeroesTheErrors) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  char tmpl[] = "/tmp/zs_loco_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  run_ranks(2, [&](const RankEnv& env) { run_loco(env, 2, 4, 0.8, 1024, 3, dir); });
  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
}

// ---- with MiCS and hpZ

// `steps` SGD steps (lr 0.05, no decay) of the kNumels params, every rank
// pushing its own gradients, under `topology` ("mics_shard_size": 2 or
// "zero_hpz_partition_size": 2) with int4 qgZ (with LoCo when beta >= 0)
// or without qgZ (bits 0). Returns the full params at the end, after
// checking that every rank holds bitwise the same ones; with LoCo, that
// its errors were in use.
std::vector<float> sgd_params(const RankEnv& env, int port, int local, const std::string& topology,
                              int bits, double beta, int steps) {
  std::string cfg = R"({"zero_optimization": {)" + topology;
  if (bits > 0)
    cfg += R"(, "zero_quantized_gradients": true, "zero_quantized_gradients_bits": )" +
           std::to_string(bits);
  if (beta >= 0)
    cfg += R"(, "zeropp_loco_param": {"err_beta": )" + std::to_string(beta) + R"(, "reset_T": 1024})";
  cfg += "}}";
  zs_context_options o = zs::test::rank_options(env, cfg.c_str());
  o.store_port = port;  // a store of its own: the last one's port may still be held
  o.local_rank = env.rank % local;
  o.local_world_size = local;
  zs_context ctx = nullptr;
  EXPECT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
  if (ctx == nullptr) return {};
  std::vector<zs_param> hs;
  std::vector<int64_t> shapes(kNumels);
  for (size_t p = 0; p < kNumels.size(); ++p) {
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    const std::string name = "p" + std::to_string(p);
    po.name = name.c_str();
    po.ndim = 1;
    po.shape = &shapes[p];
    po.init = ZS_INIT_NORMAL;
    po.seed = 40 + p;
    zs_param h = nullptr;
    EXPECT_EQ(zs_param_register(&h, ctx, &po), ZS_OK) << zs_last_error();
    hs.push_back(h);
  }
  zs_optimizer opt = nullptr;
  EXPECT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_SGD), ZS_OK) << zs_last_error();
  zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
  hp.lr = 0.05;
  hp.weight_decay = 0.0;
  EXPECT_EQ(zs_optimizer_add_group(opt, hs.data(), hs.size(), &hp, nullptr), ZS_OK) << zs_last_error();
  for (int t = 0; t < steps; ++t) {
    for (size_t p = 0; p < kNumels.size(); ++p) {
      const auto g = grad_of(env.rank, t, p, kNumels[p]);
      EXPECT_EQ(zs_grad_push(hs[p], g.data(), ZS_FLOAT32, g.size() * 4), ZS_OK) << zs_last_error();
    }
    EXPECT_EQ(zs_grad_sync(ctx), ZS_OK) << zs_last_error();
    zs_step_result r = ZS_STEP_RESULT_INIT;
    EXPECT_EQ(zs_optimizer_step(opt, &r), ZS_OK) << zs_last_error();
    EXPECT_EQ(r.skipped, 0) << "step " << t;
  }
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  EXPECT_EQ(zs_context_memory(ctx, &m), ZS_OK);
  if (beta >= 0) {
    EXPECT_GT(m.loco_error_bytes, 0u) << "LoCo kept no errors";
  }
  std::vector<float> full;
  for (size_t p = 0; p < hs.size(); ++p) {
    zs_param h = hs[p];
    zs_gather gh = nullptr;
    EXPECT_EQ(zs_fetch(&gh, ctx, &h, 1), ZS_OK) << zs_last_error();
    EXPECT_EQ(zs_gather_wait(gh, ZS_WAIT_FOREVER), ZS_OK) << zs_last_error();
    std::vector<float> v(static_cast<size_t>(kNumels[p]));
    EXPECT_EQ(zs_param_copy_to(h, v.data(), v.size() * 4), ZS_OK) << zs_last_error();
    full.insert(full.end(), v.begin(), v.end());
    EXPECT_EQ(zs_release(ctx, &h, 1), ZS_OK);
    zs_gather_destroy(gh);
  }
  // Every rank's params against every other's, bitwise.
  zs_group world = nullptr;
  EXPECT_EQ(zs_context_group(&world, ctx, ZS_GROUP_WORLD), ZS_OK);
  std::vector<float> all(full.size() * static_cast<size_t>(env.world));
  zs_work w = nullptr;
  EXPECT_EQ(zs_allgather(&w, world, full.data(), all.data(), full.size(), ZS_FLOAT32), ZS_OK)
      << zs_last_error();
  EXPECT_EQ(zs_work_wait(w, ZS_WAIT_FOREVER), ZS_OK) << zs_last_error();
  zs_work_destroy(w);
  for (int r = 0; r < env.world; ++r)
    EXPECT_EQ(std::memcmp(all.data() + static_cast<size_t>(r) * full.size(), full.data(),
                          full.size() * 4),
              0)
        << "rank " << env.rank << "'s params differ from rank " << r << "'s (" << topology << ")";
  zs_group_destroy(world);
  zs_optimizer_destroy(opt);
  for (zs_param h : hs) zs_param_destroy(h);
  zs_context_destroy(ctx);
  return full;
}

// LoCo with MiCS (shard groups of 2, replicas averaged in fp32) and with
// hpZ (secondary shards of 2; one node of four ranks, qgZ in one hop, and
// two nodes of two, qgZ in two hops with an error per hop): every rank
// ends with the same params, and after 16 SGD steps (the params sum the
// averaged gradients) they are at most half as far off the unquantized
// run's as int4 qgZ's without LoCo (measured: about 0.36 to 0.38 times;
// without LoCo 14% to 18% of how far the params moved).
void loco_tracks_unquantized(int local, const std::string& topology) {
  std::vector<int> ports;
  for (int k = 0; k < 4; ++k) ports.push_back(zs::test::free_port());
  run_ranks(4, [&](const RankEnv& env) {
    const int steps = 16;
    const auto exact = sgd_params(env, ports[0], local, topology, 0, -1, steps);
    const auto plain = sgd_params(env, ports[1], local, topology, 4, -1, steps);
    const auto loco = sgd_params(env, ports[2], local, topology, 4, 0.8, steps);
    ASSERT_EQ(plain.size(), exact.size());
    ASSERT_EQ(loco.size(), exact.size());
    double d_plain = 0, d_loco = 0, moved = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      d_plain += (plain[i] - exact[i]) * (plain[i] - exact[i]);
      d_loco += (loco[i] - exact[i]) * (loco[i] - exact[i]);
    }
    const auto init = sgd_params(env, ports[3], local, topology, 0, -1, 0);
    for (size_t i = 0; i < exact.size(); ++i) moved += (exact[i] - init[i]) * (exact[i] - init[i]);
    d_plain = std::sqrt(d_plain / moved);
    d_loco = std::sqrt(d_loco / moved);
    if (env.rank == 0)
      std::printf("%s, local %d: params off the unquantized run by %.4f without LoCo, %.4f with "
                  "(relative to how far they moved)\n",
                  topology.c_str(), local, d_plain, d_loco);
    EXPECT_LT(d_loco, 0.5 * d_plain) << topology;

  });
}

TEST(LocoTopology, MicsTracksTheUnquantizedRunOnEveryRank) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  loco_tracks_unquantized(4, R"("mics_shard_size": 2)");
}
TEST(LocoTopology, HpzTracksTheUnquantizedRunOnEveryRank) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  loco_tracks_unquantized(4, R"("zero_hpz_partition_size": 2)");
}
TEST(LocoTopology, HpzOverTwoNodesTracksTheUnquantizedRunOnEveryRank) {
  const zs::test::QuantizeWithinHost quantize_within_host;
  loco_tracks_unquantized(2, R"("zero_hpz_partition_size": 2)");
}

}  // namespace
