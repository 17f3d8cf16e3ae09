// Sized structs with today's header: zs_xxx_init equals the _INIT macros
// byte for byte, and a struct larger than the library knows (a caller built
// against a newer header) or smaller than the first release is refused,
// naming both sizes. Older callers are tests/abi/old_caller.c.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/support/multirank.h"

namespace {

void expect_error(zs_status got, const std::string& fragment) {
  EXPECT_EQ(got, ZS_ERR_INVALID_ARGUMENT) << zs_status_string(got) << ": " << zs_last_error();
  EXPECT_NE(std::string(zs_last_error()).find(fragment), std::string::npos)
      << "message '" << zs_last_error() << "' lacks '" << fragment << "'";
}

TEST(AbiSizes, InitFunctionsEqualTheMacros) {
  zs_context_options co = ZS_CONTEXT_OPTIONS_INIT;
  zs_context_options ci;
  ASSERT_EQ(zs_context_options_init(&ci, sizeof ci), ZS_OK) << zs_last_error();
  EXPECT_EQ(ci.size, co.size);
  EXPECT_EQ(ci.rank, co.rank);
  EXPECT_EQ(ci.world_size, co.world_size);
  EXPECT_EQ(ci.local_rank, co.local_rank);
  EXPECT_EQ(ci.local_world_size, co.local_world_size);
  EXPECT_EQ(ci.store_host, co.store_host);
  EXPECT_EQ(ci.store_port, co.store_port);
  EXPECT_EQ(ci.timeout_ms, co.timeout_ms);
  EXPECT_EQ(ci.backend, co.backend);

  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  zs_param_options pi;
  ASSERT_EQ(zs_param_options_init(&pi, sizeof pi), ZS_OK) << zs_last_error();
  EXPECT_EQ(pi.size, po.size);
  EXPECT_EQ(pi.dtype, po.dtype);
  EXPECT_EQ(pi.init, po.init);
  EXPECT_EQ(pi.a, po.a);
  EXPECT_EQ(pi.b, po.b);
  EXPECT_EQ(pi.group, po.group);

  zs_optim_hparams ho = ZS_OPTIM_HPARAMS_INIT;
  zs_optim_hparams hi;
  ASSERT_EQ(zs_optim_hparams_init(&hi, sizeof hi), ZS_OK) << zs_last_error();
  EXPECT_EQ(hi.size, ho.size);
  EXPECT_EQ(hi.lr, ho.lr);
  EXPECT_EQ(hi.beta1, ho.beta1);
  EXPECT_EQ(hi.beta2, ho.beta2);
  EXPECT_EQ(hi.eps, ho.eps);
  EXPECT_EQ(hi.weight_decay, ho.weight_decay);
  EXPECT_EQ(hi.nesterov, ho.nesterov);
  EXPECT_EQ(hi.bias_correction, ho.bias_correction);

  zs_step_result ro = ZS_STEP_RESULT_INIT;
  zs_step_result ri;
  ASSERT_EQ(zs_step_result_init(&ri, sizeof ri), ZS_OK) << zs_last_error();
  EXPECT_EQ(ri.size, ro.size);
  EXPECT_EQ(ri.loss_scale, ro.loss_scale);

  zs_param_info io = ZS_PARAM_INFO_INIT;
  zs_param_info ii;
  ASSERT_EQ(zs_param_info_init(&ii, sizeof ii), ZS_OK) << zs_last_error();
  EXPECT_EQ(ii.size, io.size);
  EXPECT_EQ(ii.device_type, io.device_type);
  EXPECT_EQ(ii.status, io.status);

  // All-integer structs without padding: the bytes themselves.
  zs_memory_stats ms = ZS_MEMORY_STATS_INIT;
  zs_memory_stats mi;
  std::memset(&mi, 0xCD, sizeof mi);
  ASSERT_EQ(zs_memory_stats_init(&mi, sizeof mi), ZS_OK);
  EXPECT_EQ(std::memcmp(&mi, &ms, sizeof ms), 0);
  zs_fetch_stats fs = ZS_FETCH_STATS_INIT;
  zs_fetch_stats fi;
  std::memset(&fi, 0xCD, sizeof fi);
  ASSERT_EQ(zs_fetch_stats_init(&fi, sizeof fi), ZS_OK);
  EXPECT_EQ(std::memcmp(&fi, &fs, sizeof fs), 0);
  zs_coord_stats cs = ZS_COORD_STATS_INIT;
  zs_coord_stats ci2;
  std::memset(&ci2, 0xCD, sizeof ci2);
  ASSERT_EQ(zs_coord_stats_init(&ci2, sizeof ci2), ZS_OK);
  EXPECT_EQ(std::memcmp(&ci2, &cs, sizeof cs), 0);
}

TEST(AbiSizes, InitRefusesWrongSizesAndNull) {
  zs_context_options o;
  expect_error(zs_context_options_init(nullptr, sizeof o), "options is NULL");
  expect_error(zs_context_options_init(&o, 4), "size is 4, below " + std::to_string(sizeof o) +
                                                   ", the size of zs_context_options");
  // Nothing is written on refusal.
  zs_coord_stats cs;
  std::memset(&cs, 0x5A, sizeof cs);
  const std::string want = "size is " + std::to_string(sizeof cs + 8) + ", but this zeroshard";
  expect_error(zs_coord_stats_init(&cs, sizeof cs + 8), want);
  EXPECT_NE(std::string(zs_last_error()).find("of at most " + std::to_string(sizeof cs) + " bytes"),
            std::string::npos)
      << zs_last_error();
  for (size_t i = 0; i < sizeof cs; ++i)
    ASSERT_EQ(reinterpret_cast<unsigned char*>(&cs)[i], 0x5A) << "byte " << i << " written";
}

// A caller built against a newer header passes a larger struct.
TEST(AbiSizes, LargerStructsThanTheLibraryKnowsAreRefused) {
  struct Newer {
    zs_context_options known;
    int64_t added_later;
  } n{};
  n.known = ZS_CONTEXT_OPTIONS_INIT;
  n.known.size = sizeof n;
  n.known.rank = 0;
  n.known.world_size = 1;
  zs_context ctx = nullptr;
  expect_error(zs_context_create(&ctx, &n.known),
               "options->size is " + std::to_string(sizeof n) + ", but this zeroshard (0.1.0) knows "
               "zs_context_options of at most " + std::to_string(sizeof(zs_context_options)));
  EXPECT_EQ(ctx, nullptr);

  n.known.size = sizeof n.known;
  ASSERT_EQ(zs_context_create(&ctx, &n.known), ZS_OK) << zs_last_error();
  struct NewerStats {
    zs_memory_stats known;
    uint64_t added_later;
  } s{};
  s.known = ZS_MEMORY_STATS_INIT;
  s.known.size = sizeof s;
  s.known.num_params = 77;
  expect_error(zs_context_memory(ctx, &s.known),
               "stats->size is " + std::to_string(sizeof s) + ", but this zeroshard");
  EXPECT_EQ(s.known.num_params, 77u) << "a refused call wrote its output";

  struct NewerHparams {
    zs_optim_hparams known;
    double added_later;
  } h{};
  h.known = ZS_OPTIM_HPARAMS_INIT;
  h.known.size = sizeof h;
  zs_optimizer opt = nullptr;
  ASSERT_EQ(zs_optimizer_create(&opt, ctx, ZS_OPTIM_ADAMW), ZS_OK) << zs_last_error();
  expect_error(zs_optimizer_set_hparams(opt, -1, &h.known),
               "hparams->size is " + std::to_string(sizeof h) + ", but");
  zs_optimizer_destroy(opt);
  zs_context_destroy(ctx);
}

// Output structs of today's size are written in full; a failed call leaves
// the caller's struct untouched.
TEST(AbiSizes, FailedCallsLeaveOutputsUntouched) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  zs_context ctx = nullptr;
  ASSERT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
  zs_param_info info = ZS_PARAM_INFO_INIT;
  info.numel = 1234;
  EXPECT_EQ(zs_param_get_info(reinterpret_cast<zs_param>(ctx), &info), ZS_ERR_INVALID_HANDLE);
  EXPECT_EQ(info.numel, 1234u);
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  m.num_params = 99;
  ASSERT_EQ(zs_context_memory(ctx, &m), ZS_OK) << zs_last_error();
  EXPECT_EQ(m.num_params, 0u);
  EXPECT_EQ(m.size, sizeof m);
  zs_context_destroy(ctx);
}

}  // namespace
