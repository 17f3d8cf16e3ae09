// The device layer on any machine: the caching pool, device and backend
// choice and their errors, and the staging path that carries GPU memory
// through Gloo, run here over host memory (ZS_STAGE_ALL=1) on real ranks.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "impl/common/error.h"
#include "impl/device/device.h"
#include "impl/device/pool.h"
#include "tests/support/multirank.h"

namespace {

using zs::CachingPool;
using zs::test::RankEnv;
using zs::test::run_ranks;

void expect_error(zs_status got, zs_status want, const std::string& fragment) {
  EXPECT_EQ(got, want) << "got " << zs_status_string(got) << ": " << zs_last_error();
  EXPECT_NE(std::string(zs_last_error()).find(fragment), std::string::npos)
      << "message '" << zs_last_error() << "' lacks '" << fragment << "'";
}

// A backend over malloc that counts, and can be told to fail.
struct CountingBackend {
  int allocs = 0, releases = 0;
  bool fail = false;
  CachingPool::Backend make() {
    return {"test", [this](size_t n) -> void* {
              if (fail) return nullptr;
              ++allocs;
              return std::malloc(n);
            },
            [this](void* p, size_t) {
              ++releases;
              std::free(p);
            },
            256};
  }
};

TEST(CachingPool, SteadyCyclesReuseBlocks) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX);
  const std::vector<size_t> sizes = {1, 300, 4096, 3 << 20, 5'000'001};
  for (int cycle = 0; cycle < 5; ++cycle) {
    std::vector<void*> held;
    for (size_t s : sizes) held.push_back(pool.alloc(s));
    for (size_t i = 0; i < sizes.size(); ++i) pool.free(held[i], sizes[i]);
  }
  EXPECT_EQ(b.allocs, static_cast<int>(sizes.size()));
  const auto st = pool.stats();
  EXPECT_EQ(st.system_allocs, sizes.size());
  EXPECT_EQ(st.reuses, 4 * sizes.size());
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_GT(st.idle_bytes, 0u);
  pool.trim();
  EXPECT_EQ(pool.stats().idle_bytes, 0u);
  EXPECT_EQ(b.releases, static_cast<int>(sizes.size()));
}

TEST(CachingPool, SizeClassesWasteAtMostAnEighth) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX);
  for (size_t s : {size_t{1}, size_t{255}, size_t{256}, size_t{1} << 20, (size_t{1} << 20) + 1,
                   size_t{3'000'000}, size_t{1} << 30, (size_t{1} << 30) + 12345}) {
    const size_t c = pool.size_class(s);
    EXPECT_GE(c, s);
    EXPECT_EQ(c % 256, 0u) << s;
    if (s > (size_t{1} << 20)) {
      EXPECT_LE(c - s, s / 8) << s;
    }
  }
  // Sizes a little apart share a class (and so a cached block).
  EXPECT_EQ(pool.size_class(3'000'000), pool.size_class(3'000'100));
}

TEST(CachingPool, IdleLimitAndSmallBlocksBypass) {
  CountingBackend b;
  CachingPool pool(b.make(), 1024, 4096);
  void* small = pool.alloc(100);  // under min_cached: straight back to the system
  pool.free(small, 100);
  EXPECT_EQ(b.releases, 1);
  void* x = pool.alloc(4096);
  void* y = pool.alloc(4096);
  pool.free(x, 4096);
  pool.free(y, 4096);  // over the idle limit: released
  EXPECT_EQ(b.releases, 2);
  EXPECT_EQ(pool.stats().idle_bytes, 4096u);
}

// Bound by its peak: a step that asks for one size in its first half and
// another in its second keeps the pool's footprint (used + idle) within the
// most it ever had in use, instead of caching both sizes on top of each other.
TEST(CachingPool, BoundByPeakKeepsFootprintWithinTheMostUsed) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX, /*bound_by_peak=*/true);
  const size_t a = 4 << 20, c = 6 << 20;  // two size classes
  for (int step = 0; step < 4; ++step) {
    // Forward: three blocks of size a at once; backward: two of size c.
    std::vector<void*> fwd;
    for (int i = 0; i < 3; ++i) fwd.push_back(pool.alloc(a));
    for (void* p : fwd) pool.free(p, a);
    std::vector<void*> bwd;
    for (int i = 0; i < 2; ++i) bwd.push_back(pool.alloc(c));
    const auto st = pool.stats();
    EXPECT_EQ(st.peak_used_bytes, 3 * a);  // the forward's three blocks
    EXPECT_LE(st.used_bytes + st.idle_bytes, st.peak_used_bytes) << "step " << step;
    for (void* p : bwd) pool.free(p, c);
  }
  EXPECT_GT(pool.stats().evictions, 0u);
  pool.trim();
  EXPECT_EQ(b.allocs, b.releases);
}

TEST(CachingPool, BoundByPeakStillReusesASteadyWorkload) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX, /*bound_by_peak=*/true);
  const std::vector<size_t> sizes = {3 << 20, 5'000'001, 1 << 20};
  for (int cycle = 0; cycle < 5; ++cycle) {
    std::vector<void*> held;
    for (size_t s : sizes) held.push_back(pool.alloc(s));
    for (size_t i = 0; i < sizes.size(); ++i) pool.free(held[i], sizes[i]);
  }
  // The same sizes each cycle: every block after the first cycle is reused.
  EXPECT_EQ(b.allocs, static_cast<int>(sizes.size()));
  EXPECT_EQ(pool.stats().evictions, 0u);
  EXPECT_EQ(pool.stats().reuses, 4 * sizes.size());
}

// Without the bound (the CUDA pools) idle blocks of every size are kept up
// to the idle limit, whatever the peak.
TEST(CachingPool, UnboundPoolCachesEverySize) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX);
  void* x = pool.alloc(4 << 20);
  pool.free(x, 4 << 20);
  void* y = pool.alloc(6 << 20);
  const auto st = pool.stats();
  EXPECT_EQ(st.idle_bytes, pool.size_class(4 << 20));
  EXPECT_EQ(st.peak_used_bytes, pool.size_class(6 << 20));
  EXPECT_EQ(st.evictions, 0u);
  pool.free(y, 6 << 20);
}

TEST(CachingPool, OutOfMemoryTrimsThenNamesTheSize) {
  CountingBackend b;
  CachingPool pool(b.make(), 0, UINT64_MAX);
  pool.free(pool.alloc(1 << 20), 1 << 20);
  b.fail = true;
  try {
    pool.alloc(12345);
    FAIL() << "expected OutOfMemory";
  } catch (const zs::Error& e) {
    EXPECT_EQ(e.code(), zs::Code::OutOfMemory);
    EXPECT_NE(std::string(e.what()).find("12345 bytes of test memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.stats().idle_bytes, 0u) << "idle blocks are returned before giving up";
}

TEST(Device, ParsesDeviceNames) {
  EXPECT_FALSE(zs::parse_device("cpu", "d").is_cuda());
  EXPECT_EQ(zs::parse_device("cuda", "d").ordinal, 0);
  EXPECT_EQ(zs::parse_device("cuda:3", "d").ordinal, 3);
  EXPECT_EQ(zs::parse_device("cuda:3", "d").str(), "cuda:3");
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "", "cuda:1234567890"}) {
    try {
      zs::parse_device(bad, "the setting");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const zs::Error& e) {
      EXPECT_EQ(e.code(), zs::Code::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(std::string("the setting: \"") + bad + "\""),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Device, CudaCountComesWithAReasonWhenZero) {
  int count = -1;
  const char* reason = nullptr;
  ZS_ASSERT_OK(zs_cuda_device_count(&count, &reason));
  ASSERT_NE(reason, nullptr);
  if (count == 0) {
    EXPECT_STRNE(reason, "");
  } else {
    EXPECT_STREQ(reason, "");
  }
  expect_error(zs_cuda_device_count(nullptr, nullptr), ZS_ERR_INVALID_ARGUMENT, "count");
}

zs_status create_single(zs_context* ctx, const char* device, const char* backend,
                        const char* config = nullptr) {
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.device = device;
  o.backend = backend;
  o.config_json = config;
  return zs_context_create(ctx, &o);
}

TEST(Device, CpuContextReportsCpuAndGloo) {
  zs_context ctx = nullptr;
  ZS_ASSERT_OK(create_single(&ctx, "cpu", nullptr));
  zs_device_type type = ZS_DEVICE_CUDA;
  int id = -1;
  const char* backend = nullptr;
  ZS_EXPECT_OK(zs_context_device(ctx, &type, &id, &backend));
  EXPECT_EQ(type, ZS_DEVICE_CPU);
  EXPECT_EQ(id, 0);
  EXPECT_STREQ(backend, "gloo");
  ZS_EXPECT_OK(zs_context_device(ctx, nullptr, nullptr, nullptr));
  zs_context_destroy(ctx);
}

TEST(Device, CudaContextWithoutAGpuSaysWhy) {
  int count = 0;
  ZS_ASSERT_OK(zs_cuda_device_count(&count, nullptr));
  if (count > 0) GTEST_SKIP() << "a CUDA device is present; this checks the machine without one";
  zs_context ctx = nullptr;
  expect_error(create_single(&ctx, "cuda:0", nullptr), ZS_ERR_NOT_SUPPORTED, "device cuda:0: ");
  EXPECT_EQ(ctx, nullptr);
  // The config key and ZS_DEVICE say the same, each naming itself when wrong.
  expect_error(create_single(&ctx, nullptr, nullptr, R"({"device": "cuda:1"})"),
               ZS_ERR_NOT_SUPPORTED, "device cuda:1: ");
  setenv("ZS_DEVICE", "cuda", 1);
  expect_error(create_single(&ctx, nullptr, nullptr), ZS_ERR_NOT_SUPPORTED, "device cuda:0");
  setenv("ZS_DEVICE", "tpu", 1);
  expect_error(create_single(&ctx, nullptr, nullptr), ZS_ERR_INVALID_ARGUMENT, "ZS_DEVICE: \"tpu\"");
  setenv("ZS_DEVICE", "cpu", 1);
}

TEST(Device, BadDeviceAndBackendNameTheValue) {
  zs_context ctx = nullptr;
  expect_error(create_single(&ctx, "gpu", nullptr), ZS_ERR_INVALID_ARGUMENT,
               "context option device: \"gpu\"");
  expect_error(create_single(&ctx, nullptr, nullptr, R"({"device": 7})"), ZS_ERR_INVALID_CONFIG,
               "device: got 7");
  expect_error(create_single(&ctx, "cpu", "mpi"), ZS_ERR_INVALID_ARGUMENT,
               "context option backend \"mpi\": expected \"gloo\" or \"nccl\"");
  expect_error(create_single(&ctx, "cpu", "nccl"), ZS_ERR_INVALID_ARGUMENT,
               "\"nccl\" needs a CUDA device, but the device is cpu");
  EXPECT_EQ(ctx, nullptr);
}

// Params of 64 KiB and more come from the host pool: after the first
// fetch/release cycle, later cycles reuse its blocks. On the host by name:
// where a GPU is visible, a context without a device takes it.
TEST(Device, FetchReleaseCyclesReuseThePool) {
  run_ranks(2, [](const RankEnv& env) {
    zs_context ctx = zs::test::make_context(env, R"({"device": "cpu"})");
    const int64_t shape[1] = {100003};
    zs_param p;
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = "big";
    po.ndim = 1;
    po.shape = shape;
    po.init = ZS_INIT_UNIFORM;
    ZS_ASSERT_OK(zs_param_register(&p, ctx, &po));
    uint64_t after_first = 0;
    for (int cycle = 0; cycle < 5; ++cycle) {
      zs_gather g;
      ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
      ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
      ZS_ASSERT_OK(zs_gather_destroy(g));
      ZS_ASSERT_OK(zs_release(ctx, &p, 1));
      zs_memory_stats m = ZS_MEMORY_STATS_INIT;
      ZS_ASSERT_OK(zs_context_memory(ctx, &m));
      if (cycle == 0) after_first = m.device_system_allocs;
      EXPECT_EQ(m.device_system_allocs, after_first) << "cycle " << cycle;
      if (cycle > 0) {
        EXPECT_GE(m.device_reuses, static_cast<uint64_t>(cycle));
      }
    }
    zs_context_destroy(ctx);
  });
}

// Every collective through the staging wrapper (what GPU memory over Gloo
// takes), on host memory, against the values the plain path gives; on the
// host by name, where ZS_STAGE_ALL (a test switch) means something.
TEST(Device, StagedCollectivesOnRealRanks) {
  // Scoped: left set, it staged every later test's collectives in this
  // process (copied-bytes counts saw the staging).
  const zs::test::ScopedEnv stage_all("ZS_STAGE_ALL", "1");
  for (int world : {2, 3}) {
    run_ranks(world, [](const RankEnv& env) {
      zs_context ctx = zs::test::make_context(env, R"({"device": "cpu"})");
      zs_group g;
      ZS_ASSERT_OK(zs_context_group(&g, ctx, ZS_GROUP_WORLD));
      const int n = env.world;
      auto wait = [](zs_work w) {
        ZS_ASSERT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
        ZS_ASSERT_OK(zs_work_destroy(w));
      };
      zs_work w;
      // All-gather of an odd byte count.
      std::vector<uint8_t> mine(7, static_cast<uint8_t>(env.rank + 1)), all(7 * n, 0);
      ZS_ASSERT_OK(zs_allgather(&w, g, mine.data(), all.data(), 7, ZS_UINT8));
      wait(w);
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i < 7; ++i) EXPECT_EQ(all[r * 7 + i], r + 1);
      }
      // Reduce-scatter (avg) and in-place all-reduce (sum).
      std::vector<float> rs_in(5 * n), rs_out(5, -1);
      for (int i = 0; i < 5 * n; ++i) rs_in[i] = static_cast<float>(i + env.rank);
      ZS_ASSERT_OK(zs_reduce_scatter(&w, g, rs_in.data(), rs_out.data(), 5, ZS_FLOAT32, ZS_AVG));
      wait(w);
      for (int i = 0; i < 5; ++i)
        EXPECT_FLOAT_EQ(rs_out[i], static_cast<float>(env.rank * 5 + i) + (n - 1) / 2.0f);
      float x[3] = {1.0f * env.rank, 2.0f, -1.0f};
      ZS_ASSERT_OK(zs_allreduce(&w, g, x, x, 3, ZS_FLOAT32, ZS_SUM));
      wait(w);
      EXPECT_FLOAT_EQ(x[0], n * (n - 1) / 2.0f);
      EXPECT_FLOAT_EQ(x[1], 2.0f * n);
      // Broadcast from the last rank.
      int32_t b[2] = {env.rank, env.rank * 10};
      ZS_ASSERT_OK(zs_broadcast(&w, g, b, 2 * sizeof(int32_t), ZS_UINT8, n - 1));
      wait(w);
      EXPECT_EQ(b[0], n - 1);
      EXPECT_EQ(b[1], (n - 1) * 10);
      // A coalesced param fetch of odd sizes through the staged path.
      std::vector<zs_param> ps;
      for (int64_t numel : {int64_t{1}, int64_t{37}, int64_t{70001}}) {
        zs_param p;
        zs_param_options po = ZS_PARAM_OPTIONS_INIT;
        po.name = "p";
        po.ndim = 1;
        po.shape = &numel;
        po.init = ZS_INIT_NORMAL;
        po.seed = static_cast<uint64_t>(numel);
        po.b = 1.0;
        ZS_ASSERT_OK(zs_param_register(&p, ctx, &po));
        ps.push_back(p);
      }
      zs_gather gather;
      ZS_ASSERT_OK(zs_fetch(&gather, ctx, ps.data(), ps.size()));
      ZS_ASSERT_OK(zs_gather_wait(gather, ZS_WAIT_FOREVER));
      ZS_ASSERT_OK(zs_gather_destroy(gather));
      // Seeded init is world-size independent: the full data is checkable
      // against a world of one computing the same seeds.
      for (size_t k = 0; k < ps.size(); ++k) {
        zs_param_info info = ZS_PARAM_INFO_INIT;
        ZS_ASSERT_OK(zs_param_get_info(ps[k], &info));
        std::vector<float> got(info.numel), want(info.numel);
        ZS_ASSERT_OK(zs_param_copy_to(ps[k], got.data(), got.size() * 4));
        zs_context solo;
        zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
        o.rank = 0;
        o.world_size = 1;
        o.device = "cpu";  // its shard is read with memcpy below
        ZS_ASSERT_OK(zs_context_create(&solo, &o));
        zs_param q;
        zs_param_options po = ZS_PARAM_OPTIONS_INIT;
        po.name = "q";
        po.ndim = 1;
        const auto numel = static_cast<int64_t>(info.numel);
        po.shape = &numel;
        po.init = ZS_INIT_NORMAL;
        po.seed = info.numel;
        po.b = 1.0;
        ZS_ASSERT_OK(zs_param_register(&q, solo, &po));
        void* d;
        ZS_ASSERT_OK(zs_param_shard_data(q, &d, nullptr));
        std::memcpy(want.data(), d, want.size() * 4);
        EXPECT_EQ(got, want) << "param of " << info.numel;
        zs_context_destroy(solo);
      }
      ZS_ASSERT_OK(zs_release(ctx, ps.data(), ps.size()));
      zs_context_destroy(ctx);
    });
  }
}

}  // namespace
