// The CUDA kernels of the training step (kernels/cuda/kernels.h) against
// the device's memory bandwidth: each kernel's median time over --iters
// runs (cudaEvents, after warm-up runs), the bytes it must read and write
// per run, the bandwidth that gives, and its ratio to a device-to-device
// cudaMemcpyAsync moving as many bytes (reading and writing half each),
// measured in the same run. A memory-bound kernel near 1.0 is as fast as the
// memory allows.
//
//   bench_gpu_kernels [--elements N] [--iters N] [--tensors N]
//
// The optimizer steps also over the same elements cut into --tensors
// tensors: one launch per tensor (adam_step, sgd_step) against the
// multi-tensor launchers (adam_step_many, sgd_step_many).
//
// Prints a table, then, as the last line, one JSON object:
//   {"device": "...", "elements": N, "iters": N,
//    "kernels": {"adamw": {"bytes": .., "ms": .., "gbps": .., "d2d_gbps": ..,
//                          "ratio_to_d2d": ..}, ...}}
// Without a CUDA device it says so and prints {"skipped": "no CUDA device: ..."}
// (exit 0). Figures, never pass/fail.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kernels.h"
#include "kernels/optim.h"

namespace {

namespace cu = zs::kernels::cuda;
using zs::kernels::AdamHyper;
using zs::kernels::SgdHyper;
using zs::kernels::WorkDtype;

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", static_cast<unsigned>(c));
      o += b;
    } else {
      o += c;
    }
  }
  return o;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_gpu_kernels: %s\n", what.c_str());
  std::printf("{\"error\": \"%s\"}\n", json_escape(what).c_str());
  std::exit(1);
}

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

void launched(int e, const char* kernel) {
  if (e != 0) die(std::string(kernel) + ": " + cu::error_string(e));
}

bool parse_count(const char* s, unsigned long long* out) {
  if (s == nullptr || *s == '\0' || *s == '-') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (errno != 0 || *end != '\0' || v == 0) return false;
  *out = v;
  return true;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_gpu_kernels: %s\n"
               "usage: bench_gpu_kernels [--elements N] [--iters N] [--tensors N]\n"
               "  --elements N  elements per kernel (default 67108864)\n"
               "  --tensors N   tensors the elements are cut into for the multi-tensor rows (default 1024)\n"
               "  --iters N     timed runs per kernel, the median is reported (default 20)\n",
               why);
  std::exit(2);
}

struct Result {
  std::string name, what;
  double bytes, ms, gbps, d2d_gbps;
};

class Bench {
 public:
  Bench(int iters, cudaStream_t s) : iters_(iters), s_(s) {
    ck(cudaEventCreate(&start_), "cudaEventCreate");
    ck(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~Bench() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }

  // Median milliseconds of one run of `body`, after warm-up runs.
  double time_ms(const std::function<void()>& body) {
    for (int i = 0; i < kWarmup; ++i) body();
    ck(cudaStreamSynchronize(s_), "warm-up");
    std::vector<float> ms(static_cast<size_t>(iters_));
    for (auto& m : ms) {
      ck(cudaEventRecord(start_, s_), "cudaEventRecord");
      body();
      ck(cudaEventRecord(stop_, s_), "cudaEventRecord");
      ck(cudaEventSynchronize(stop_), "cudaEventSynchronize");
      ck(cudaEventElapsedTime(&m, start_, stop_), "cudaEventElapsedTime");
    }
    std::sort(ms.begin(), ms.end());
    const size_t k = ms.size();
    return k % 2 ? ms[k / 2] : 0.5 * (static_cast<double>(ms[k / 2 - 1]) + ms[k / 2]);
  }

  // A device-to-device copy moving `bytes` in all (bytes / 2 read, bytes / 2
  // written): the bandwidth a kernel moving `bytes` is measured against.
  double d2d_gbps(double bytes, void* dst, const void* src) {
    const size_t half = static_cast<size_t>(bytes / 2);
    const double ms = time_ms([&] {
      ck(cudaMemcpyAsync(dst, src, half, cudaMemcpyDeviceToDevice, s_), "cudaMemcpyAsync");
    });
    return 2.0 * static_cast<double>(half) / (ms * 1e-3) / 1e9;
  }

 private:
  static constexpr int kWarmup = 3;
  int iters_;
  cudaStream_t s_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

void* dalloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess)
    die(std::string("cudaMalloc of ") + std::to_string(bytes) + " bytes for " + what + ": " +
        cudaGetErrorString(e) + " (try a smaller --elements)");
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  unsigned long long elements = 64ull << 20, iters = 20, tensors = 1024;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string val;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      val = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (a == "--elements" || a == "--iters" || a == "--tensors") {
      if (i + 1 >= argc) usage((a + ": expected a value").c_str());
      val = argv[++i];
    }
    if (a == "--elements") {
      if (!parse_count(val.c_str(), &elements))
        usage(("--elements " + val + ": expected a positive integer").c_str());
    } else if (a == "--iters") {
      if (!parse_count(val.c_str(), &iters) || iters > 100000)
        usage(("--iters " + val + ": expected an integer in 1..100000").c_str());
    } else if (a == "--tensors") {
      if (!parse_count(val.c_str(), &tensors))
        usage(("--tensors " + val + ": expected a positive integer").c_str());
    } else if (a == "-h" || a == "--help") {
      usage("GPU kernels against memory bandwidth");
    } else {
      usage(("unknown argument " + std::string(argv[i])).c_str());
    }
  }

  int count = 0;
  const cudaError_t de = cudaGetDeviceCount(&count);
  if (de != cudaSuccess || count == 0) {
    const std::string why = std::string("no CUDA device: ") +
                            (de != cudaSuccess ? cudaGetErrorString(de)
                                               : "cudaGetDeviceCount reports 0 devices");
    std::printf("bench_gpu_kernels: %s; nothing to measure\n", why.c_str());
    std::printf("{\"skipped\": \"%s\"}\n", json_escape(why).c_str());
    return 0;
  }

  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");

  const size_t n = static_cast<size_t>(elements);
  const size_t f32 = n * sizeof(float), h16 = n * 2;
  // State of the optimizer and the gradient path, filled with 0x3c bytes:
  // every float 0.0115 (0x3c3c3c3c), every bf16 0.0115 (0x3c3c), finite.
  auto* p = static_cast<float*>(dalloc(f32, "master"));
  auto* m = static_cast<float*>(dalloc(f32, "exp_avg"));
  auto* v = static_cast<float*>(dalloc(f32, "exp_avg_sq"));
  auto* g = static_cast<float*>(dalloc(f32, "grad"));
  void* w16 = dalloc(h16, "bf16 working copy");
  for (void* b : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v),
                  static_cast<void*>(g)})
    ck(cudaMemsetAsync(b, 0x3c, f32, s), "cudaMemsetAsync");
  ck(cudaMemsetAsync(w16, 0x3c, h16, s), "cudaMemsetAsync");
  double* dsum = static_cast<double*>(dalloc(sizeof(double), "sum"));
  int* dflag = static_cast<int*>(dalloc(sizeof(int), "flag"));

  // batched_copy: 200 segments of random sizes (multiples of 16 bytes, about
  // f32 / 200 each) packing p into m at the same offsets.
  std::vector<cu::CopySegment> segs;
  {
    constexpr size_t kSegs = 200;
    std::mt19937_64 rng(7);
    std::vector<double> wts(kSegs);
    double total = 0.0;
    for (auto& x : wts) total += (x = 0.5 + static_cast<double>(rng() % 1000) / 1000.0);
    size_t at = 0;
    for (size_t k = 0; k < kSegs; ++k) {
      size_t bytes = static_cast<size_t>(static_cast<double>(f32) * wts[k] / total) / 16 * 16;
      if (k + 1 == kSegs || at + bytes > f32) bytes = f32 - at;
      segs.push_back({reinterpret_cast<char*>(m) + at, reinterpret_cast<const char*>(p) + at, bytes});
      at += bytes;
    }
  }
  double copy_bytes = 0.0;
  for (const auto& sg : segs) copy_bytes += 2.0 * static_cast<double>(sg.bytes);

  // The reference copies move up to 30 bytes per element (AdamW): two
  // buffers of 15 bytes per element.
  const size_t ref_half = n * 15;
  void* ref_src = dalloc(ref_half, "reference copy source");
  void* ref_dst = dalloc(ref_half, "reference copy destination");
  ck(cudaMemsetAsync(ref_src, 0, ref_half, s), "cudaMemsetAsync");
  ck(cudaStreamSynchronize(s), "setup");

  Bench bench(static_cast<int>(iters), s);
  std::vector<Result> results;
  auto measure = [&](const char* name, const char* what, double bytes_per_run,
                     const std::function<void()>& run) {
    const double ms = bench.time_ms(run);
    const double gbps = bytes_per_run / (ms * 1e-3) / 1e9;
    const double d2d = bench.d2d_gbps(bytes_per_run, ref_dst, ref_src);
    results.push_back({name, what, bytes_per_run, ms, gbps, d2d});
  };
  const double N = static_cast<double>(n);

  int64_t step = 0;
  measure("adamw", "AdamW, fp32 master + bf16 write-back (r p,m,v,g; w p,m,v,bf16)", 30.0 * N,
          [&] {
            const AdamHyper h{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, ++step};
            launched(cu::adam_step(p, m, v, g, n, h, 1.0f, w16, WorkDtype::BF16, s), "adam_step");
          });
  measure("sgd_momentum", "SGD momentum 0.9, fp32 (r p,buf,g; w p,buf)", 20.0 * N, [&] {
    const SgdHyper h{1e-4f, 0.9f, 0.0f, 0.0f, false, false};
    launched(cu::sgd_step(p, m, g, n, h, 1.0f, nullptr, WorkDtype::F32, s), "sgd_step");
  });
  // The same elements as a rank's many shards (--tensors of n / tensors
  // each, fp32 params, no write-back): adam_step / sgd_step launched once
  // per tensor against adam_step_many / sgd_step_many (one launch per
  // working dtype, kernels::cuda::kStepTensorsPerLaunch tensors a launch);
  // and the whole n as one tensor through adam_step_many, next to "adamw".
  const size_t per = std::max<size_t>(1, n / static_cast<size_t>(tensors));
  std::vector<zs::kernels::AdamTensor> adam_list;
  std::vector<zs::kernels::SgdTensor> sgd_list;
  for (size_t at = 0; at < n; at += per) {
    const size_t len = std::min(per, n - at);
    adam_list.push_back({p + at, m + at, v + at, g + at, len, AdamHyper{}, nullptr, WorkDtype::F32});
    sgd_list.push_back({p + at, m + at, g + at, len, SgdHyper{}, nullptr, WorkDtype::F32});
  }
  const std::string each_name = "adamw_each_" + std::to_string(adam_list.size());
  const std::string many_name = "adamw_many_" + std::to_string(adam_list.size());
  const std::string sgd_each_name = "sgd_each_" + std::to_string(sgd_list.size());
  const std::string sgd_many_name = "sgd_many_" + std::to_string(sgd_list.size());
  measure(each_name.c_str(), "AdamW fp32, one adam_step launch per tensor (28 B/element)", 28.0 * N, [&] {
    const AdamHyper h{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, ++step};
    for (const auto& t : adam_list)
      launched(cu::adam_step(t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.n, h, 1.0f, nullptr, WorkDtype::F32, s),
               "adam_step");
  });
  measure(many_name.c_str(), "AdamW fp32, adam_step_many over the same tensors (28 B/element)", 28.0 * N, [&] {
    const AdamHyper h{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, ++step};
    for (auto& t : adam_list) t.h = h;
    launched(cu::adam_step_many(adam_list.data(), adam_list.size(), 1.0f, s), "adam_step_many");
  });
  measure("adamw_many_1", "AdamW + bf16 write-back as one tensor through adam_step_many", 30.0 * N, [&] {
    const zs::kernels::AdamTensor one{p, m, v, g, n, AdamHyper{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, true, true, ++step},
                                      w16, WorkDtype::BF16};
    launched(cu::adam_step_many(&one, 1, 1.0f, s), "adam_step_many");
  });
  const SgdHyper sgd_h{1e-4f, 0.9f, 0.0f, 0.0f, false, false};
  for (auto& t : sgd_list) t.h = sgd_h;
  measure(sgd_each_name.c_str(), "SGD momentum fp32, one sgd_step launch per tensor (20 B/element)", 20.0 * N, [&] {
    for (const auto& t : sgd_list)
      launched(cu::sgd_step(t.master, t.momentum_buf, t.grad, t.n, sgd_h, 1.0f, nullptr, WorkDtype::F32, s),
               "sgd_step");
  });
  measure(sgd_many_name.c_str(), "SGD momentum fp32, sgd_step_many over the same tensors", 20.0 * N, [&] {
    launched(cu::sgd_step_many(sgd_list.data(), sgd_list.size(), 1.0f, s), "sgd_step_many");
  });
  measure("cast_f32_to_bf16", "cast_from_f32 to bf16 (r 4, w 2 bytes)", 6.0 * N, [&] {
    launched(cu::cast_from_f32(p, w16, WorkDtype::BF16, n, s), "cast_from_f32");
  });
  measure("cast_bf16_to_f32", "cast_to_f32 from bf16 (r 2, w 4 bytes)", 6.0 * N, [&] {
    launched(cu::cast_to_f32(w16, WorkDtype::BF16, v, n, s), "cast_to_f32");
  });
  measure("add_to_f32", "add_to_f32 of bf16 into fp32 (r 2+4, w 4 bytes)", 10.0 * N, [&] {
    launched(cu::add_to_f32(w16, WorkDtype::BF16, g, n, s), "add_to_f32");
  });
  measure("sum_squares", "sum_squares in double (r 4 bytes)", 4.0 * N, [&] {
    launched(cu::sum_squares(p, n, dsum, s), "sum_squares");
  });
  measure("all_finite", "all_finite, all finite (r 4 bytes)", 4.0 * N, [&] {
    launched(cu::all_finite(p, n, dflag, s), "all_finite");
  });
  measure("batched_copy", "batched_copy of 200 segments (r+w 4 bytes)", copy_bytes, [&] {
    launched(cu::batched_copy(segs.data(), segs.size(), s), "batched_copy");
  });
  ck(cudaStreamSynchronize(s), "the runs");

  std::printf("device: %s (%d SMs, sm_%d%d), %llu elements, median of %llu runs\n", prop.name,
              prop.multiProcessorCount, prop.major, prop.minor, elements, iters);
  std::printf("%-17s %12s %10s %10s %10s %7s  %s\n", "kernel", "MB/run", "ms", "GB/s",
              "d2d GB/s", "ratio", "");
  for (const auto& r : results)
    std::printf("%-17s %12.1f %10.4f %10.1f %10.1f %7.3f  %s\n", r.name.c_str(), r.bytes / 1e6,
                r.ms, r.gbps, r.d2d_gbps, r.gbps / r.d2d_gbps, r.what.c_str());

  std::string json = "{\"device\": \"" + json_escape(prop.name) + "\", \"elements\": " +
                     std::to_string(elements) + ", \"iters\": " + std::to_string(iters) +
                     ", \"kernels\": {";
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    char b[512];
    std::snprintf(b, sizeof b,
                  "%s\"%s\": {\"bytes\": %.0f, \"ms\": %.6f, \"gbps\": %.2f, \"d2d_gbps\": %.2f, "
                  "\"ratio_to_d2d\": %.4f}",
                  i ? ", " : "", r.name.c_str(), r.bytes, r.ms, r.gbps, r.d2d_gbps,
                  r.gbps / r.d2d_gbps);
    json += b;
  }
  json += "}}";

  for (void* b : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v),
                  static_cast<void*>(g), w16, static_cast<void*>(dsum),
                  static_cast<void*>(dflag), ref_src, ref_dst})
    cudaFree(b);
  cudaStreamDestroy(s);
  std::printf("%s\n", json.c_str());
  return 0;
}
