// Params of every float dtype with values that stress block quantization,
// and what a quantized gather of them must give: shared by the qwZ and the
// frozen-weight tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "tests/support/multirank.h"
#include "zeroshard/zeroshard.h"

namespace zs::test::quant {

namespace k = zs::kernels;

inline size_t esize(zs_dtype t) { return t == ZS_FLOAT32 ? 4 : 2; }
inline k::WorkDtype wd(zs_dtype t) {
  return t == ZS_FLOAT32 ? k::WorkDtype::F32 : t == ZS_BFLOAT16 ? k::WorkDtype::BF16 : k::WorkDtype::F16;
}
inline const char* dname(zs_dtype t) { return t == ZS_FLOAT32 ? "f32" : t == ZS_BFLOAT16 ? "bf16" : "f16"; }

struct P {
  std::string name;
  zs_dtype dtype;
  int64_t numel;
  std::vector<uint8_t> values;  // the registered values, in dtype
  zs_param handle = nullptr;
};

// Normal values whose magnitude changes every 300 elements (blocks see
// different scales); a seed makes them the same on every rank.
inline std::vector<uint8_t> make_values(zs_dtype t, int64_t numel, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<uint8_t> out(static_cast<size_t>(numel) * esize(t));
  float mag = 1.0f;
  for (int64_t i = 0; i < numel; ++i) {
    if (i % 300 == 0) mag = std::ldexp(1.0f, static_cast<int>(rng() % 12) - 6);
    k::store_work1(out.data(), wd(t), static_cast<size_t>(i), g(rng) * mag);
  }
  return out;
}

// Registers p (1-D, its values on every rank) into p.handle.
inline void register_values(zs_context ctx, P& p) {
  zs_param_options o = ZS_PARAM_OPTIONS_INIT;
  o.name = p.name.c_str();
  o.dtype = p.dtype;
  o.ndim = 1;
  o.shape = &p.numel;
  o.init = ZS_INIT_FROM_ALL;
  o.data = p.values.data();
  o.data_bytes = p.values.size();
  EXPECT_EQ(zs_param_register(&p.handle, ctx, &o), ZS_OK) << p.name << ": " << zs_last_error();
}

inline std::vector<P> register_all(zs_context ctx, const std::vector<int64_t>& numels, unsigned seed) {
  std::vector<P> ps;
  for (zs_dtype t : {ZS_FLOAT32, ZS_BFLOAT16, ZS_FLOAT16})
    for (int64_t n : numels) {
      P p{std::string(dname(t)) + "_" + std::to_string(n), t, n,
          make_values(t, n, seed + static_cast<unsigned>(n) * 3 + static_cast<unsigned>(t)), nullptr};
      register_values(ctx, p);
      ps.push_back(std::move(p));
    }
  return ps;
}

// What qwZ must give: each of `world` shards (padded with zeros) quantized
// and dequantized on its own.
inline std::vector<uint8_t> expected_qwz(const P& p, int world, k::QuantSpec s) {
  const size_t es = esize(p.dtype), n = static_cast<size_t>(p.numel);
  const size_t shard = (n + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
  std::vector<uint8_t> out(shard * static_cast<size_t>(world) * es);
  std::vector<uint8_t> in(shard * es), codes(k::quant_code_bytes(shard, s));
  std::vector<float> scales(k::quant_blocks(shard, s));
  for (int r = 0; r < world; ++r) {
    const size_t first = static_cast<size_t>(r) * shard;
    std::fill(in.begin(), in.end(), 0);
    if (first < n) std::memcpy(in.data(), p.values.data() + first * es, std::min(shard, n - first) * es);
    k::quantize(in.data(), wd(p.dtype), shard, s, codes.data(), scales.data());
    k::dequantize(codes.data(), scales.data(), shard, s, out.data() + first * es, wd(p.dtype));
  }
  out.resize(n * es);
  return out;
}

// Elements of each of `members` shards of p (the last one padded).
inline uint64_t shard_numel(const P& p, int members) {
  return (static_cast<uint64_t>(p.numel) + static_cast<uint64_t>(members) - 1) /
         static_cast<uint64_t>(members);
}

// Bytes of the packet of a shard of `shard` elements: scales, codes
// (whole blocks) rounded up to 4 bytes.
inline uint64_t packet_bytes(uint64_t shard, k::QuantSpec s) {
  const size_t n = static_cast<size_t>(shard);
  return k::quant_blocks(n, s) * 4 + (k::quant_code_bytes(n, s) + 3) / 4 * 4;
}

// Whether p's shards are quantized at all, by qwZ or by freezing: only
// where the packet is smaller than the shard; the others stay exact.
inline bool packs_smaller(const P& p, int members, k::QuantSpec s) {
  const uint64_t shard = shard_numel(p, members);
  return packet_bytes(shard, s) < shard * esize(p.dtype);
}

// What a quantized gather (qwZ, or of frozen packed params) over
// `members` ranks gives: each shard quantized on its own, or the exact
// values where the shards are too small to gain from a packet.
inline std::vector<uint8_t> expected_gather(const P& p, int members, k::QuantSpec s) {
  return packs_smaller(p, members, s) ? expected_qwz(p, members, s) : p.values;
}

// max |x - y| over the param, and the largest |x| (for a loose bound check
// on top of the bitwise one: every block's scale is <= max|x| / qmax).
inline void expect_within_bound(const P& p, const std::vector<uint8_t>& got, int bits) {
  double worst = 0, absmax = 0;
  for (int64_t i = 0; i < p.numel; ++i) {
    const double x = k::load_work1(p.values.data(), wd(p.dtype), static_cast<size_t>(i));
    const double y = k::load_work1(got.data(), wd(p.dtype), static_cast<size_t>(i));
    worst = std::max(worst, std::fabs(x - y));
    absmax = std::max(absmax, std::fabs(x));
  }
  const double u = p.dtype == ZS_FLOAT32 ? 0x1p-24 : p.dtype == ZS_BFLOAT16 ? 0x1p-8 : 0x1p-11;
  const double bound = absmax / k::quant_qmax(bits) * (0.5 + 0x1p-16) * (1 + 1e-6) + absmax * u * 1.01 + 0x1p-25;
  EXPECT_LE(worst, bound) << p.name;
}

inline std::vector<uint8_t> gathered(const P& p) {
  std::vector<uint8_t> out(p.values.size());
  EXPECT_EQ(zs_param_copy_to(p.handle, out.data(), out.size()), ZS_OK) << zs_last_error();
  return out;
}

inline void fetch_all(zs_context ctx, const std::vector<P>& ps) {
  std::vector<zs_param> hs;
  for (const auto& p : ps) hs.push_back(p.handle);
  zs_gather g = nullptr;
  ZS_ASSERT_OK(zs_fetch(&g, ctx, hs.data(), hs.size()));
  ZS_ASSERT_OK(zs_gather_wait(g, 60000));
  ZS_ASSERT_OK(zs_gather_destroy(g));
}

inline void release_all(zs_context ctx, const std::vector<P>& ps) {
  std::vector<zs_param> hs;
  for (const auto& p : ps) hs.push_back(p.handle);
  ZS_ASSERT_OK(zs_release(ctx, hs.data(), hs.size()));
}

// On one host the engine quantizes nothing and lists the quantization key
// (`key`, e.g. "zero_quantized_weights") among the inactive ones, saying why.
inline void expect_listed_as_one_host(zs_context ctx, const std::string& key) {
  const char* keys = nullptr;
  ZS_ASSERT_OK(zs_context_inactive_config_keys(ctx, &keys));
  const std::string json(keys);
  EXPECT_NE(json.find("\"key\":\"zero_optimization." + key + "\""), std::string::npos) << json;
  EXPECT_NE(json.find("every rank of this job is on one host"), std::string::npos) << json;
}

// Registers params of these sizes, gathers them, and expects the registered
// values back bitwise, with no quantized byte sent (`why` says why exact).
inline void expect_exact_gathers(zs_context ctx, const std::vector<int64_t>& numels, const char* why) {
  auto ps = register_all(ctx, numels, 17);
  fetch_all(ctx, ps);
  for (const auto& p : ps) EXPECT_EQ(gathered(p), p.values) << p.name << ": not exact (" << why << ")";
  zs_fetch_stats st = ZS_FETCH_STATS_INIT;
  ZS_ASSERT_OK(zs_context_fetch_stats(ctx, &st));
  EXPECT_EQ(st.quantized_gather_bytes_sent, 0u) << why;
  release_all(ctx, ps);
  for (auto& p : ps) zs_param_destroy(p.handle);
}

}  // namespace zs::test::quant
