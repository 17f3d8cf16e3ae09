// The C API under misuse: every wrong call returns the right status and a
// message naming what was wrong, and nothing crashes.
#include <gtest/gtest.h>

#include <dlpack/dlpack.h>

#include <string>
#include <vector>

#include "tests/support/multirank.h"

namespace {

void expect_error(zs_status got, zs_status want, const std::string& fragment) {
  EXPECT_EQ(got, want) << "got " << zs_status_string(got) << ": " << zs_last_error();
  EXPECT_NE(std::string(zs_last_error()).find(fragment), std::string::npos)
      << "message '" << zs_last_error() << "' lacks '" << fragment << "'";
}

class Misuse : public ::testing::Test {
 protected:
  void SetUp() override {
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    o.rank = 0;
    o.world_size = 1;
    ZS_ASSERT_OK(zs_context_create(&ctx_, &o));
    const int64_t shape[2] = {3, 5};
    zs_param_options po = ZS_PARAM_OPTIONS_INIT;
    po.name = "w";
    po.ndim = 2;
    po.shape = shape;
    po.init = ZS_INIT_UNIFORM;
    ZS_ASSERT_OK(zs_param_register(&param_, ctx_, &po));
  }
  void TearDown() override { zs_context_destroy(ctx_); }

  zs_gather fetch_wait() {
    zs_gather g = nullptr;
    EXPECT_EQ(zs_fetch(&g, ctx_, &param_, 1), ZS_OK) << zs_last_error();
    EXPECT_EQ(zs_gather_wait(g, 1000), ZS_OK) << zs_last_error();
    return g;
  }

  zs_context ctx_ = nullptr;
  zs_param param_ = nullptr;
};

TEST(Api, VersionAndStatusStrings) {
  int major = -1, minor = -1, patch = -1;
  EXPECT_STREQ(zs_version(&major, &minor, &patch), "0.1.0");
  EXPECT_EQ(major * 10000 + minor * 100 + patch, ZS_VERSION);
  EXPECT_STREQ(zs_version(nullptr, nullptr, nullptr), "0.1.0");
  EXPECT_STREQ(zs_status_string(ZS_ERR_TIMEOUT), "ZS_ERR_TIMEOUT");
  EXPECT_STREQ(zs_status_string(static_cast<zs_status>(999)), "ZS_UNKNOWN_STATUS");
}

TEST(Api, ConfigCheckWithoutContext) {
  EXPECT_EQ(zs_config_check(R"({"zero_optimization": {"stage": 3}})", 8), ZS_OK);
  expect_error(zs_config_check(R"({"zero_optimization": {"mics_shard_size": 3}})", 8),
               ZS_ERR_INVALID_CONFIG, "mics_shard_size");
  expect_error(zs_config_check(nullptr, 1), ZS_ERR_INVALID_ARGUMENT, "config_json is NULL");
  // Not ZS_ERR_INTERNAL (nlohmann's out_of_range escaping the parser).
  expect_error(zs_config_check(R"({"gradient_clipping": 1e400})", 8), ZS_ERR_INVALID_CONFIG,
               "number overflow parsing '1e400'");
}

TEST(Api, ContextCreateArguments) {
  zs_context ctx = nullptr;
  expect_error(zs_context_create(nullptr, nullptr), ZS_ERR_INVALID_ARGUMENT, "out is NULL");
  expect_error(zs_context_create(&ctx, nullptr), ZS_ERR_INVALID_ARGUMENT, "options is NULL");
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.size = 8;
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_INVALID_ARGUMENT, "options->size is 8");
  o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 3;
  o.world_size = 2;
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_BOOTSTRAP, "rank 3 is out of range for world size 2");
  o = ZS_CONTEXT_OPTIONS_INIT;
  o.world_size = 1;
  o.rank = 0;
  o.config_json = "{\"zero_optimization\": {\"stage\": \"three\"}}";
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG, "zero_optimization.stage");
  o.config_json = "{}";
  o.config_path = "/nonexistent.json";
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_INVALID_ARGUMENT, "both set");
  o.config_json = nullptr;
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG, "/nonexistent.json");
  EXPECT_EQ(ctx, nullptr);
  o.config_path = nullptr;
  o.timeout_ms = -5;
  expect_error(zs_context_create(&ctx, &o), ZS_ERR_INVALID_ARGUMENT, "timeout_ms -5");
}

TEST_F(Misuse, NullPointers) {
  int r;
  expect_error(zs_context_rank(nullptr, &r), ZS_ERR_INVALID_HANDLE, "NULL context handle");
  expect_error(zs_context_rank(ctx_, nullptr), ZS_ERR_INVALID_ARGUMENT, "rank is NULL");
  expect_error(zs_fetch(nullptr, ctx_, &param_, 1), ZS_ERR_INVALID_ARGUMENT, "out is NULL");
  zs_gather g = nullptr;
  expect_error(zs_fetch(&g, ctx_, nullptr, 1), ZS_ERR_INVALID_ARGUMENT, "params is NULL");
  expect_error(zs_fetch(&g, ctx_, &param_, 0), ZS_ERR_INVALID_ARGUMENT, "empty");
  expect_error(zs_param_data(param_, nullptr), ZS_ERR_INVALID_ARGUMENT, "data is NULL");
  expect_error(zs_param_get_info(param_, nullptr), ZS_ERR_INVALID_ARGUMENT, "info is NULL");
  expect_error(zs_context_memory(ctx_, nullptr), ZS_ERR_INVALID_ARGUMENT, "stats is NULL");
  zs_param p = nullptr;
  expect_error(zs_param_register(&p, ctx_, nullptr), ZS_ERR_INVALID_ARGUMENT, "options is NULL");
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.ndim = 2;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "shape is NULL");
  // Destroy accepts NULL.
  EXPECT_EQ(zs_context_destroy(nullptr), ZS_OK);
  EXPECT_EQ(zs_param_destroy(nullptr), ZS_OK);
  EXPECT_EQ(zs_gather_destroy(nullptr), ZS_OK);
  EXPECT_EQ(zs_work_destroy(nullptr), ZS_OK);
  EXPECT_EQ(zs_group_destroy(nullptr), ZS_OK);
}

TEST_F(Misuse, BadParamOptions) {
  zs_param p = nullptr;
  int64_t shape[9] = {2, -3, 1, 1, 1, 1, 1, 1, 1};
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.name = "bad";
  po.ndim = 2;
  po.shape = shape;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "shape[1] = -3");
  po.ndim = 9;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "ndim 9");
  shape[1] = 3;
  po.ndim = 2;
  po.dtype = ZS_UINT8;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "dtype 3");
  po.dtype = static_cast<zs_dtype>(42);
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "dtype 42");
  po.dtype = ZS_FLOAT32;
  po.init = static_cast<zs_init>(17);
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "init 17");
  po.init = ZS_INIT_FROM_ALL;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "data, got NULL");
  float data[6] = {0};
  po.data = data;
  po.data_bytes = 20;  // wrong buffer size
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_BUFFER_SIZE, "data_bytes is 20, expected 24");
  po.init = ZS_INIT_FROM_RANK;
  po.data_bytes = 24;
  po.src_rank = 1;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "src_rank 1");
  po.size = 4;
  expect_error(zs_param_register(&p, ctx_, &po), ZS_ERR_INVALID_ARGUMENT, "options->size is 4");
  EXPECT_EQ(p, nullptr);
  zs_memory_stats m = ZS_MEMORY_STATS_INIT;
  ZS_ASSERT_OK(zs_context_memory(ctx_, &m));
  EXPECT_EQ(m.num_params, 1u);  // failed registrations leave no trace
}

TEST_F(Misuse, DestroyedAndForeignHandles) {
  zs_param p = nullptr;
  const int64_t shape[1] = {4};
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.ndim = 1;
  po.shape = shape;
  ZS_ASSERT_OK(zs_param_register(&p, ctx_, &po));
  ZS_ASSERT_OK(zs_param_destroy(p));
  zs_param_status st;
  expect_error(zs_param_get_status(p, &st), ZS_ERR_INVALID_HANDLE, "not a live param handle");
  expect_error(zs_param_destroy(p), ZS_ERR_INVALID_HANDLE, "not a live param handle");  // twice
  // A param handle where a group is expected, and a context as a param.
  int size = 0;
  expect_error(zs_group_size(reinterpret_cast<zs_group>(param_), &size), ZS_ERR_INVALID_HANDLE,
               "is a param handle, expected a group handle");
  expect_error(zs_param_get_status(reinterpret_cast<zs_param>(ctx_), &st), ZS_ERR_INVALID_HANDLE,
               "is a context handle");
  // A made-up value and a pointer to random memory.
  int junk = 0;
  expect_error(zs_param_get_status(reinterpret_cast<zs_param>(&junk), &st), ZS_ERR_INVALID_HANDLE,
               "not a live param handle");
  zs_gather g = nullptr;
  zs_param mixed[2] = {param_, p};
  expect_error(zs_fetch(&g, ctx_, mixed, 2), ZS_ERR_INVALID_HANDLE, "params[1]");
}

TEST_F(Misuse, HandlesDieWithTheirContext) {
  zs_context other = nullptr;
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  ZS_ASSERT_OK(zs_context_create(&other, &o));
  zs_gather g = nullptr;
  // A param of one context fetched through another.
  expect_error(zs_fetch(&g, other, &param_, 1), ZS_ERR_INVALID_ARGUMENT, "belongs to another context");
  zs_group wg = nullptr;
  ZS_ASSERT_OK(zs_context_group(&wg, other, ZS_GROUP_WORLD));
  ZS_ASSERT_OK(zs_context_destroy(other));
  int size = 0;
  expect_error(zs_group_size(wg, &size), ZS_ERR_INVALID_HANDLE, "not a live group handle");
  expect_error(zs_context_destroy(other), ZS_ERR_INVALID_HANDLE, "not a live context handle");
}

TEST_F(Misuse, StatusMachineErrors) {
  void* data = nullptr;
  expect_error(zs_param_data(param_, &data), ZS_ERR_INVALID_STATE, "is NOT_AVAILABLE");
  expect_error(zs_release(ctx_, &param_, 1), ZS_ERR_INVALID_STATE, "never fetched or is already released");
  zs_gather g = fetch_wait();
  zs_gather again = nullptr;
  expect_error(zs_fetch(&again, ctx_, &param_, 1), ZS_ERR_INVALID_STATE, "is AVAILABLE, expected NOT_AVAILABLE");
  zs_param twice[2] = {param_, param_};
  expect_error(zs_release(ctx_, twice, 2), ZS_ERR_INVALID_ARGUMENT, "listed twice");
  ZS_ASSERT_OK(zs_release(ctx_, &param_, 1));
  expect_error(zs_release(ctx_, &param_, 1), ZS_ERR_INVALID_STATE, "already released");  // released twice
  expect_error(zs_param_data(param_, &data), ZS_ERR_INVALID_STATE, "NOT_AVAILABLE");  // read after release
  ZS_ASSERT_OK(zs_gather_destroy(g));
  expect_error(zs_gather_wait(g, 0), ZS_ERR_INVALID_HANDLE, "not a live gather handle");
}

TEST_F(Misuse, WrongBufferSize) {
  zs_gather g = fetch_wait();
  std::vector<float> out(15);
  expect_error(zs_param_copy_to(param_, out.data(), 14 * 4), ZS_ERR_BUFFER_SIZE,
               "dst_bytes is 56, expected 60");
  ZS_ASSERT_OK(zs_param_copy_to(param_, out.data(), 60));
  zs_gather_destroy(g);
}

TEST_F(Misuse, BadWaitAndCollectiveArguments) {
  zs_gather g = fetch_wait();
  expect_error(zs_gather_wait(g, -7), ZS_ERR_INVALID_ARGUMENT, "timeout_ms -7");
  zs_group world = nullptr;
  ZS_ASSERT_OK(zs_context_group(&world, ctx_, ZS_GROUP_WORLD));
  zs_work w = nullptr;
  float x = 1;
  expect_error(zs_allreduce(&w, world, &x, &x, 1, ZS_FLOAT32, static_cast<zs_reduce_op>(9)),
               ZS_ERR_INVALID_ARGUMENT, "reduce op 9");
  expect_error(zs_broadcast(&w, world, &x, 1, ZS_FLOAT32, 1), ZS_ERR_INVALID_ARGUMENT, "root 1");
  // ZS_AVG of bytes is refused at the call on every transport (a world of
  // one too), and the group goes on working.
  uint8_t u[2] = {3, 250};
  expect_error(zs_allreduce(&w, world, u, u, 2, ZS_UINT8, ZS_AVG), ZS_ERR_NOT_SUPPORTED,
               "all-reduce: ZS_AVG is not defined for ZS_UINT8");
  expect_error(zs_reduce_scatter(&w, world, u, u, 2, ZS_UINT8, ZS_AVG), ZS_ERR_NOT_SUPPORTED,
               "reduce-scatter: ZS_AVG is not defined for ZS_UINT8");
  ZS_ASSERT_OK(zs_allreduce(&w, world, u, u, 2, ZS_UINT8, ZS_MAX));
  ZS_ASSERT_OK(zs_work_wait(w, ZS_WAIT_FOREVER));
  zs_work_destroy(w);
  w = nullptr;
  EXPECT_EQ(u[1], 250);
  expect_error(zs_allgather(&w, world, nullptr, &x, 1, ZS_FLOAT32), ZS_ERR_INVALID_ARGUMENT, "send is NULL");
  expect_error(zs_context_group(&world, ctx_, static_cast<zs_group_kind>(12)), ZS_ERR_INVALID_ARGUMENT,
               "group kind 12");
  // Counts whose byte size would wrap are refused, naming the largest count.
  ZS_ASSERT_OK(zs_context_group(&world, ctx_, ZS_GROUP_WORLD));
  const size_t huge = SIZE_MAX / 2 + 3;
  expect_error(zs_allgather(&w, world, &x, &x, huge, ZS_FLOAT32), ZS_ERR_INVALID_ARGUMENT,
               "exceeds the largest accepted buffer of 70368744177664 bytes (largest count 17592186044416)");
  expect_error(zs_reduce_scatter(&w, world, &x, &x, huge, ZS_BFLOAT16, ZS_SUM), ZS_ERR_INVALID_ARGUMENT,
               "reduce-scatter: count");
  expect_error(zs_allreduce(&w, world, &x, &x, huge, ZS_FLOAT16, ZS_SUM), ZS_ERR_INVALID_ARGUMENT,
               "all-reduce: count");
  expect_error(zs_broadcast(&w, world, &x, huge, ZS_UINT8, 0), ZS_ERR_INVALID_ARGUMENT,
               "broadcast: count");
  EXPECT_EQ(w, nullptr);
  // A param count no handle table could back is refused before any list is sized.
  zs_gather g2 = nullptr;
  expect_error(zs_fetch(&g2, ctx_, &param_, size_t{1} << 60), ZS_ERR_INVALID_ARGUMENT,
               "params: n is 1152921504606846976, more than the");
  zs_gather_destroy(g);
}

// A world of one gathers without copying; DLPack keeps the data alive past
// release and describes it exactly.
TEST_F(Misuse, DlpackExport) {
  zs_gather g = fetch_wait();
  DLManagedTensor* t = nullptr;
  ZS_ASSERT_OK(zs_param_to_dlpack(param_, &t));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dl_tensor.ndim, 2);
  EXPECT_EQ(t->dl_tensor.shape[0], 3);
  EXPECT_EQ(t->dl_tensor.shape[1], 5);
  EXPECT_EQ(t->dl_tensor.dtype.code, kDLFloat);
  EXPECT_EQ(t->dl_tensor.dtype.bits, 32);
  EXPECT_EQ(t->dl_tensor.device.device_type, kDLCPU);
  std::vector<float> copy(15);
  ZS_ASSERT_OK(zs_param_copy_to(param_, copy.data(), 60));
  ZS_ASSERT_OK(zs_release(ctx_, &param_, 1));
  const float* d = static_cast<const float*>(t->dl_tensor.data);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(d[i], copy[static_cast<size_t>(i)]);
  t->deleter(t);
  zs_gather_destroy(g);
}

TEST_F(Misuse, ConfigQueries) {
  const char* json = nullptr;
  ZS_ASSERT_OK(zs_context_config_json(ctx_, &json));
  EXPECT_NE(std::string(json).find("zero_optimization"), std::string::npos);
  ZS_ASSERT_OK(zs_context_unused_config_keys(ctx_, &json));
  EXPECT_STREQ(json, "[]");
  EXPECT_EQ(zs_context_async_error(ctx_), ZS_OK);
}

}  // namespace
