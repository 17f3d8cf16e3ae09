// The engine on a GPU: params, gradients and optimizer state in device
// memory, a training run on CUDA giving the CPU's losses (a world of one,
// also over NCCL by name; two ranks sharing one GPU over staged Gloo), and
// a warm caching pool that stops calling cudaMalloc. Every test skips,
// saying why, where no CUDA device is visible.
#include <gtest/gtest.h>

#include <dlpack/dlpack.h>

#include <cmath>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "tests/support/multirank.h"
#include "tests/support/train_mlp_run.h"

#ifdef ZS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

#define REQUIRE_GPU()                                                          \
  do {                                                                         \
    int count_ = 0;                                                            \
    const char* reason_ = "";                                                  \
    ZS_ASSERT_OK(zs_cuda_device_count(&count_, &reason_));                      \
    if (count_ == 0) GTEST_SKIP() << "needs a CUDA device: " << reason_;        \
  } while (0)

// In-process checks need the CUDA runtime's own calls; the example runs
// below need only the library.
#ifdef ZS_WITH_CUDA

zs_context cuda_context(const char* backend = nullptr) {
  zs_context ctx = nullptr;
  zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.device = "cuda:0";
  o.backend = backend;
  EXPECT_EQ(zs_context_create(&ctx, &o), ZS_OK) << zs_last_error();
  return ctx;
}

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  return cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice;
}

zs_param register_from(zs_context ctx, const char* name, zs_dtype dtype, int64_t numel,
                       const void* data) {
  zs_param p = nullptr;
  zs_param_options po = ZS_PARAM_OPTIONS_INIT;
  po.name = name;
  po.dtype = dtype;
  po.ndim = 1;
  po.shape = &numel;
  po.init = ZS_INIT_FROM_ALL;
  po.data = data;
  po.data_bytes = static_cast<size_t>(numel) * (dtype == ZS_FLOAT32 ? 4 : 2);
  EXPECT_EQ(zs_param_register(&p, ctx, &po), ZS_OK) << zs_last_error();
  return p;
}

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 1.0f);
  return v;
}

TEST(CudaEngine, ParamsAndGathersLiveOnTheDevice) {
  REQUIRE_GPU();
  zs_context ctx = cuda_context();
  const auto values = ramp(100003, 1.0f);
  zs_param p = register_from(ctx, "w", ZS_FLOAT32, 100003, values.data());
  zs_param_info info = ZS_PARAM_INFO_INIT;
  ZS_ASSERT_OK(zs_param_get_info(p, &info));
  EXPECT_EQ(info.device_type, ZS_DEVICE_CUDA);
  EXPECT_EQ(info.device_id, 0);
  void* shard = nullptr;
  ZS_ASSERT_OK(zs_param_shard_data(p, &shard, nullptr));
  EXPECT_TRUE(is_device_pointer(shard));

  zs_gather g;
  ZS_ASSERT_OK(zs_fetch(&g, ctx, &p, 1));
  ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
  ZS_ASSERT_OK(zs_gather_destroy(g));
  void* full = nullptr;
  ZS_ASSERT_OK(zs_param_data(p, &full));
  EXPECT_TRUE(is_device_pointer(full));
  std::vector<float> back(values.size());
  ZS_ASSERT_OK(zs_param_copy_to(p, back.data(), back.size() * 4));
  EXPECT_EQ(back, values);
  // copy_to a device buffer works the same.
  void* dbuf = nullptr;
  ASSERT_EQ(cudaMalloc(&dbuf, values.size() * 4), cudaSuccess);
  ZS_ASSERT_OK(zs_param_copy_to(p, dbuf, values.size() * 4));
  std::vector<float> via(values.size());
  ASSERT_EQ(cudaMemcpy(via.data(), dbuf, via.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(via, values);
  cudaFree(dbuf);
  // DLPack carries the device, without a copy.
  DLManagedTensor* t = nullptr;
  ZS_ASSERT_OK(zs_param_to_dlpack(p, &t));
  EXPECT_EQ(t->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(t->dl_tensor.device.device_id, 0);
  EXPECT_EQ(t->dl_tensor.data, full);
  t->deleter(t);
  ZS_ASSERT_OK(zs_release(ctx, &p, 1));
  zs_context_destroy(ctx);
}

// The same AdamW steps on a CPU context and a CUDA context (gradients
// pushed from host memory on one, from device memory on the other) leave
// the same shards: the kernels share their per-element formulas.
TEST(CudaEngine, OptimizerStepsEqualTheCpu) {
  REQUIRE_GPU();
  for (zs_dtype dtype : {ZS_FLOAT32, ZS_BFLOAT16}) {
    zs_context ctxs[2];
    zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
    o.rank = 0;
    o.world_size = 1;
    o.device = "cpu";
    ZS_ASSERT_OK(zs_context_create(&ctxs[0], &o));
    ctxs[1] = cuda_context();
    std::vector<std::vector<float>> shards(2);
    const int64_t n = 4099;
    for (int d = 0; d < 2; ++d) {
      zs_param p;
      zs_param_options po = ZS_PARAM_OPTIONS_INIT;
      po.name = "w";
      po.dtype = dtype;
      po.ndim = 1;
      po.shape = &n;
      po.init = ZS_INIT_NORMAL;
      po.seed = 7;
      po.b = 0.5;
      ZS_ASSERT_OK(zs_param_register(&p, ctxs[d], &po));
      zs_optimizer opt;
      ZS_ASSERT_OK(zs_optimizer_create(&opt, ctxs[d], ZS_OPTIM_ADAMW));
      zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
      hp.lr = 1e-2;
      hp.weight_decay = 0.1;
      ZS_ASSERT_OK(zs_optimizer_add_group(opt, &p, 1, &hp, nullptr));
      void* dgrad = nullptr;
      ASSERT_EQ(cudaMalloc(&dgrad, static_cast<size_t>(n) * 4), cudaSuccess);
      for (int step = 0; step < 3; ++step) {
        auto grad = ramp(static_cast<size_t>(n), 0.1f * static_cast<float>(step + 1));
        const void* src = grad.data();
        if (d == 1 && dtype == ZS_FLOAT32) {
          ASSERT_EQ(cudaMemcpy(dgrad, grad.data(), grad.size() * 4, cudaMemcpyHostToDevice),
                    cudaSuccess);
          src = dgrad;
        }
        if (dtype == ZS_BFLOAT16) {  // bf16 gradients: the upper halves
          static std::vector<uint16_t> g16;
          g16.resize(grad.size());
          for (size_t i = 0; i < grad.size(); ++i) {
            uint32_t u;
            std::memcpy(&u, &grad[i], 4);
            g16[i] = static_cast<uint16_t>(u >> 16);
          }
          src = g16.data();
        }
        ZS_ASSERT_OK(zs_grad_push(p, src, dtype, static_cast<size_t>(n) * (dtype == ZS_FLOAT32 ? 4 : 2)));
        zs_step_result r = ZS_STEP_RESULT_INIT;
        ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
      }
      cudaFree(dgrad);
      float* master = nullptr;
      uint64_t numel = 0;
      ZS_ASSERT_OK(zs_optimizer_state_data(opt, p, 0, &master, &numel));
      shards[d].resize(numel);
      ASSERT_EQ(cudaMemcpy(shards[d].data(), master, numel * 4, cudaMemcpyDefault), cudaSuccess);
      zs_optimizer_destroy(opt);
      zs_context_destroy(ctxs[d]);
    }
    ASSERT_EQ(shards[0].size(), shards[1].size());
    double worst = 0;
    for (size_t i = 0; i < shards[0].size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(shards[0][i]) - shards[1][i]));
    EXPECT_LE(worst, 1e-6) << "dtype " << dtype;
  }
}

// Muon on a CUDA context (Newton-Schulz through cuBLAS, momentum and the
// auxiliary AdamW in the device kernels) leaves the shards the CPU context
// leaves through the host BLAS, for both Newton-Schulz methods; a 2-D
// matrix of odd sides steps Muon, a 1-D bias steps AdamW.
TEST(CudaEngine, MuonStepsEqualTheCpu) {
  REQUIRE_GPU();
  for (int method : {0, 1}) {
    std::vector<std::vector<float>> masters(2);
    for (int d = 0; d < 2; ++d) {
      zs_context ctx = nullptr;
      if (d == 0) {
        zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
        o.rank = 0;
        o.world_size = 1;
        o.device = "cpu";
        ZS_ASSERT_OK(zs_context_create(&ctx, &o));
      } else {
        ctx = cuda_context();
      }
      const int64_t shapes[2][2] = {{37, 53}, {53, 1}};
      zs_param ps[2];
      for (int k = 0; k < 2; ++k) {
        zs_param_options po = ZS_PARAM_OPTIONS_INIT;
        po.name = k == 0 ? "w" : "bias";
        po.dtype = ZS_FLOAT32;
        po.ndim = k == 0 ? 2 : 1;
        po.shape = shapes[k];
        po.init = ZS_INIT_NORMAL;
        po.seed = 11 + k;
        po.b = 0.5;
        ZS_ASSERT_OK(zs_param_register(&ps[k], ctx, &po));
      }
      zs_optimizer opt;
      ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, ZS_OPTIM_MUON));
      zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
      hp.lr = 2e-2;
      hp.weight_decay = 0.1;
      hp.ns_method = method;
      ZS_ASSERT_OK(zs_optimizer_add_group(opt, ps, 2, &hp, nullptr));
      for (int step = 0; step < 3; ++step) {
        for (int k = 0; k < 2; ++k) {
          const size_t n = k == 0 ? 37 * 53 : 53;
          const auto grad = ramp(n, 0.1f * static_cast<float>(step + 1 + k));
          ZS_ASSERT_OK(zs_grad_push(ps[k], grad.data(), ZS_FLOAT32, n * 4));
        }
        zs_step_result r = ZS_STEP_RESULT_INIT;
        ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
      }
      for (int k = 0; k < 2; ++k) {
        float* master = nullptr;
        uint64_t numel = 0;
        ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 0, &master, &numel));
        const size_t at = masters[d].size();
        masters[d].resize(at + numel);
        ASSERT_EQ(cudaMemcpy(masters[d].data() + at, master, numel * 4, cudaMemcpyDefault), cudaSuccess);
      }
      zs_optimizer_destroy(opt);
      zs_context_destroy(ctx);
    }
    ASSERT_EQ(masters[0].size(), masters[1].size());
    double worst = 0, moved = 0;
    for (size_t i = 0; i < masters[0].size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(masters[0][i]) - masters[1][i]));
    for (float v : masters[0]) moved += std::fabs(v);
    EXPECT_GT(moved, 0.0);
    EXPECT_LE(worst, 1e-5) << "ns_method " << method;
  }
}

// The multi-tensor step on a CUDA context (Optimizer::step: one launch per
// working dtype over every param, kernels::cuda::adam_step_many /
// sgd_step_many) leaves every param's working shard and state as a CPU
// context does, bit for bit: many params of odd sizes, fp32 and bf16, one
// of which misses the first step's gradient (its step count lags the
// others'), under AdamW and under SGD with Nesterov momentum; and under
// bf16_master_weights_and_grads (with fp32 and with bf16 moments), whose
// bf16 params step in place (adam_step_mixed_many / sgd_step_mixed_many).
TEST(CudaEngine, MultiTensorStepsEqualTheCpuBitForBit) {
  REQUIRE_GPU();
  zs::test::ScopedEnv multi("ZS_CUDA_MULTI_TENSOR", "1");  // off by default on CUDA until checked
  const int64_t sizes[] = {1, 7, 4099, 70001, 300007, 65, 16384};
  constexpr size_t kParams = sizeof(sizes) / sizeof(sizes[0]);
  // bf16 masters: the bf16 params' shards are their masters (the
  // _mixed_many launches), with fp32 moments or bf16 ones.
  const char* const configs[] = {
      nullptr, R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}})",
      R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}})"};
  for (const char* config : configs) {
    for (zs_optimizer_kind kind : {ZS_OPTIM_ADAMW, ZS_OPTIM_SGD}) {
      SCOPED_TRACE(config ? config : "no config");
      std::vector<std::vector<uint8_t>> out(2);  // per context: every param's working bytes, then its fp32 slot 1
      for (int d = 0; d < 2; ++d) {
        zs_context ctx = nullptr;
        zs_context_options o = ZS_CONTEXT_OPTIONS_INIT;
        o.rank = 0;
        o.world_size = 1;
        o.device = d == 0 ? "cpu" : "cuda:0";
        o.config_json = config;
        ZS_ASSERT_OK(zs_context_create(&ctx, &o));
        zs_param ps[kParams];
        for (size_t k = 0; k < kParams; ++k) {
          const std::string name = "p" + std::to_string(k);
          zs_param_options po = ZS_PARAM_OPTIONS_INIT;
          po.name = name.c_str();
          po.dtype = k % 2 ? ZS_BFLOAT16 : ZS_FLOAT32;
          po.ndim = 1;
          po.shape = &sizes[k];
          po.init = ZS_INIT_NORMAL;
          po.seed = 20 + k;
          po.b = 0.5;
          ZS_ASSERT_OK(zs_param_register(&ps[k], ctx, &po));
        }
        zs_optimizer opt;
        ZS_ASSERT_OK(zs_optimizer_create(&opt, ctx, kind));
        zs_optim_hparams hp = ZS_OPTIM_HPARAMS_INIT;
        hp.lr = 1e-2;
        hp.weight_decay = 0.1;
        if (kind == ZS_OPTIM_SGD) {
          hp.momentum = 0.9;
          hp.nesterov = 1;
        }
        ZS_ASSERT_OK(zs_optimizer_add_group(opt, ps, kParams, &hp, nullptr));
        for (int step = 0; step < 3; ++step) {
          for (size_t k = 0; k < kParams; ++k) {
            if (k == 2 && step == 0) continue;
            const auto n = static_cast<size_t>(sizes[k]);
            const auto grad = ramp(n, 0.1f * static_cast<float>(step + 1) + 0.01f * static_cast<float>(k));
            ZS_ASSERT_OK(zs_grad_push(ps[k], grad.data(), ZS_FLOAT32, n * 4));
          }
          zs_step_result r = ZS_STEP_RESULT_INIT;
          ZS_ASSERT_OK(zs_optimizer_step(opt, &r));
        }
        for (size_t k = 0; k < kParams; ++k) {
          const size_t bytes = static_cast<size_t>(sizes[k]) * (k % 2 ? 2 : 4);
          zs_gather g;
          ZS_ASSERT_OK(zs_fetch(&g, ctx, &ps[k], 1));
          ZS_ASSERT_OK(zs_gather_wait(g, ZS_WAIT_FOREVER));
          ZS_ASSERT_OK(zs_gather_destroy(g));
          const size_t at = out[d].size();
          out[d].resize(at + bytes);
          ZS_ASSERT_OK(zs_param_copy_to(ps[k], out[d].data() + at, bytes));
          ZS_ASSERT_OK(zs_release(ctx, &ps[k], 1));
          // A bf16 param's moments under a bf16 config: checked through its
          // steps (bf16 moments have no fp32 slot to read).
          if (config && k % 2) continue;
          float* state = nullptr;
          uint64_t numel = 0;
          ZS_ASSERT_OK(zs_optimizer_state_data(opt, ps[k], 1, &state, &numel));
          const size_t st = out[d].size();
          out[d].resize(st + numel * 4);
          ASSERT_EQ(cudaMemcpy(out[d].data() + st, state, numel * 4, cudaMemcpyDefault), cudaSuccess);
        }
        zs_optimizer_destroy(opt);
        zs_context_destroy(ctx);
      }
      ASSERT_EQ(out[0].size(), out[1].size());
      size_t first = out[0].size();
      for (size_t i = 0; i < out[0].size() && first == out[0].size(); ++i)
        if (out[0][i] != out[1][i]) first = i;
      EXPECT_EQ(first, out[0].size()) << "kind " << kind << ": CUDA and CPU differ first at byte " << first << " of "
                                      << out[0].size();
    }
  }
}

#endif  // ZS_WITH_CUDA

void expect_same_losses(const zs::test::ExampleRun& cpu, const zs::test::ExampleRun& gpu) {
  ASSERT_EQ(cpu.rc, 0) << cpu.out;
  ASSERT_EQ(gpu.rc, 0) << gpu.out;
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size()) << gpu.out;
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-5 * std::fabs(cpu.losses[i])) << "step " << i;
}

uint64_t json_u64(const std::string& json, const std::string& key) {
  std::smatch m;
  const std::regex re("\"" + key + "\":(\\d+)");
  if (!std::regex_search(json, m, re)) return UINT64_MAX;
  return std::stoull(m[1]);
}

TEST(CudaEngine, TrainMlpOnCudaEqualsCpu) {
  REQUIRE_GPU();
  const auto cpu = zs::test::run_train_mlp(1, "--steps 30 --device cpu");
  const auto gpu = zs::test::run_train_mlp(1, "--steps 30 --device cuda");
  expect_same_losses(cpu, gpu);
  EXPECT_NE(gpu.json.find("\"device\":\"cuda:0\""), std::string::npos) << gpu.json;
  // After the first step the pool holds every block a step needs.
  EXPECT_EQ(json_u64(gpu.json, "device_system_allocs_after_step0"),
            json_u64(gpu.json, "device_system_allocs_at_end"))
      << gpu.json;
}

TEST(CudaEngine, TrainMlpWorldOfOneOverNccl) {
  REQUIRE_GPU();
  const auto cpu = zs::test::run_train_mlp(1, "--steps 30 --device cpu");
  const auto gpu = zs::test::run_train_mlp(1, "--steps 30 --device cuda", "ZS_BACKEND=nccl");
  expect_same_losses(cpu, gpu);
  EXPECT_NE(gpu.json.find("\"backend\":\"nccl\""), std::string::npos) << gpu.json;
}

TEST(CudaEngine, TwoRanksShareOneGpuOverStagedGloo) {
  REQUIRE_GPU();
  const auto cpu = zs::test::run_train_mlp(2, "--steps 30 --device cpu");
  const auto gpu = zs::test::run_train_mlp(2, "--steps 30 --device cuda:0", "ZS_BACKEND=gloo");
  expect_same_losses(cpu, gpu);
  EXPECT_NE(gpu.json.find("\"backend\":\"gloo\""), std::string::npos) << gpu.json;
}

// Ranks handed one GPU with no backend named run Gloo (NCCL would refuse
// them: "Duplicate GPU detected") and train as the CPU does; NCCL named for
// them is refused up front, naming the ranks that share. Ranks are started
// as processes (zsrun): a rank forked after this process touched CUDA
// could not use it.
TEST(CudaEngine, RanksSharingOneGpuWithNoBackendNamedRunGloo) {
  REQUIRE_GPU();
  const auto cpu = zs::test::run_train_mlp(3, "--steps 20 --device cpu");
  const auto gpu = zs::test::run_train_mlp(3, "--steps 20 --device cuda:0", "ZS_BACKEND=");
  expect_same_losses(cpu, gpu);
  EXPECT_NE(gpu.json.find("\"backend\":\"gloo\""), std::string::npos) << gpu.json;
  const auto nccl = zs::test::run_train_mlp(2, "--steps 2 --device cuda:0", "ZS_BACKEND=nccl");
  EXPECT_NE(nccl.rc, 0) << nccl.out;
  EXPECT_NE(nccl.out.find("NCCL cannot run two ranks on one GPU, and ranks 0 and 1 share GPU"),
            std::string::npos)
      << nccl.out;
}

}  // namespace
