// The NCCL backend. Without a GPU (or without NCCL) the factory must refuse
// cleanly; with one, a world of one rank runs every collective on device
// memory and checks the results, and a world of two whose second rank never
// comes shows that init is bounded by the timeout, or ended sooner by a
// member that the heartbeat finds silent.
#ifdef ZS_WITH_CUDA

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/expect_error.h"
#include "impl/comm/transport/cuda/nccl_communicator.h"
#include "impl/comm/transport/nccl_library.h"
#include "impl/comm/store/store.h"
#include "impl/common/error.h"

namespace zs {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "zs_nccl_comm_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

using zs::test::error_of;

// Empty when device 0 is usable; otherwise why not.
std::string device_problem() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " +
           cudaGetErrorString(e);
  }
  if (n == 0) return "cudaGetDeviceCount reports 0 devices";
  return "";
}

#define CUDA_OK(expr)                                                                  \
  do {                                                                                 \
    const cudaError_t zs_e = (expr);                                                   \
    ASSERT_EQ(zs_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(zs_e);         \
  } while (0)

// --- no GPU needed ---------------------------------------------------------

TEST(NcclCommunicator, NoDeviceIsNotSupported) {
  const std::string why = device_problem();
  if (why.empty()) GTEST_SKIP() << "a CUDA device is present (the GPU cases cover it)";
  TempDir dir;
  auto store = make_file_store(dir.path, 2000ms);
  const std::string msg = error_of(Code::NotSupported, [&] {
    make_nccl_communicator("world", 0, 1, *store, 0, nullptr, 5000ms);
  });
  EXPECT_NE(msg.find("group 'world': CUDA device 0 is not available"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no CUDA device"), std::string::npos) << msg;
  // Nothing was published: the device check comes before the rendezvous.
  EXPECT_FALSE(store->check("nccl_unique_id"));
}

TEST(NcclCommunicator, OrdinalPastTheDevicesIsNotSupported) {
  TempDir dir;
  auto store = make_file_store(dir.path, 2000ms);
  const std::string msg = error_of(Code::NotSupported, [&] {
    make_nccl_communicator("shard", 0, 1, *store, 4096, nullptr, 5000ms);
  });
  EXPECT_NE(msg.find("group 'shard': CUDA device 4096 is not available"), std::string::npos)
      << msg;
}

TEST(NcclCommunicator, BadArgumentsAreInvalid) {
  TempDir dir;
  auto store = make_file_store(dir.path, 2000ms);
  EXPECT_NE(error_of(Code::InvalidArgument,
                     [&] { make_nccl_communicator("g", 1, 1, *store, 0, nullptr, 5000ms); })
                .find("rank 1 of 1"),
            std::string::npos);
  EXPECT_NE(error_of(Code::InvalidArgument,
                     [&] { make_nccl_communicator("g", 0, 0, *store, 0, nullptr, 5000ms); })
                .find("group 'g'"),
            std::string::npos);
  error_of(Code::InvalidArgument,
           [&] { make_nccl_communicator("g", 0, 1, *store, -1, nullptr, 5000ms); });
  error_of(Code::InvalidArgument,
           [&] { make_nccl_communicator("g", 0, 1, *store, 0, nullptr, 0ms); });
}

// --- with a GPU ------------------------------------------------------------

// A device buffer that frees itself.
struct DeviceBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t n) : bytes(n) {
    if (cudaMalloc(&p, n == 0 ? 1 : n) != cudaSuccess) std::abort();
  }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

class NcclWorldOfOne : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = device_problem();
    if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
    if (!nccl_available(&why)) GTEST_SKIP() << "NCCL cannot be loaded: " << why;
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&engine_, cudaStreamNonBlocking));
    store_ = make_file_store(dir_.path, 30000ms);
    comm_ = make_nccl_communicator("world", 0, 1, *store_, 0, engine_, 60000ms);
    ASSERT_EQ(comm_->rank(), 0);
    ASSERT_EQ(comm_->size(), 1);
  }
  void TearDown() override {
    comm_.reset();
    if (engine_ != nullptr) cudaStreamDestroy(engine_);
  }

  // Host data to the device on the engine stream, not waited for: the
  // communicator must order itself after it.
  void upload(const DeviceBuf& dst, const void* src, size_t bytes) {
    ASSERT_EQ(cudaMemcpyAsync(dst.p, src, bytes, cudaMemcpyHostToDevice, engine_), cudaSuccess);
  }
  template <typename T>
  std::vector<T> download(const DeviceBuf& src, size_t count) {
    std::vector<T> out(count);
    EXPECT_EQ(cudaMemcpy(out.data(), src.p, count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  TempDir dir_;
  cudaStream_t engine_ = nullptr;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Communicator> comm_;
};

std::vector<uint8_t> pattern(size_t n, unsigned seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 131u + seed * 17u) ^ (i >> 8));
  return v;
}

uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact for the values used here
}
float float_of_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST_F(NcclWorldOfOne, AllGather) {
  const auto host = pattern(1000, 1);
  DeviceBuf send(1000), recv(1000);
  upload(send, host.data(), host.size());
  comm_->allgather(send.p, recv.p, 1000);
  EXPECT_EQ(download<uint8_t>(recv, 1000), host);
  // In place: this rank's piece already sits in the output.
  comm_->allgather(recv.p, recv.p, 1000);
  EXPECT_EQ(download<uint8_t>(recv, 1000), host);
  comm_->allgather(send.p, recv.p, 0);
}

TEST_F(NcclWorldOfOne, AllGatherWaitsForTheEngineStream) {
  const size_t n = 64u << 20;
  DeviceBuf send(n), recv(n);
  CUDA_OK(cudaMemset(recv.p, 0, n));
  // Not synchronised: the gather must run after the fill.
  CUDA_OK(cudaMemsetAsync(send.p, 0x5a, n, engine_));
  comm_->allgather(send.p, recv.p, n);
  const auto out = download<uint8_t>(recv, n);
  EXPECT_EQ(out.front(), 0x5a);
  EXPECT_EQ(out[n / 2], 0x5a);
  EXPECT_EQ(out.back(), 0x5a);
}

TEST_F(NcclWorldOfOne, CoalescedAllGatherOfOddSizes) {
  const std::vector<size_t> sizes{1, 3, 0, 1000003};
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<DeviceBuf>> sends, recvs;
  std::vector<GatherSegment> segs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    host.push_back(pattern(sizes[i], static_cast<unsigned>(i) + 3));
    sends.push_back(std::make_unique<DeviceBuf>(sizes[i]));
    recvs.push_back(std::make_unique<DeviceBuf>(sizes[i]));
    if (sizes[i] > 0) upload(*sends[i], host[i].data(), sizes[i]);
    segs.push_back({sends[i]->p, recvs[i]->p, sizes[i]});
  }
  comm_->allgather_coalesced(segs);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 0) {
      EXPECT_EQ(download<uint8_t>(*recvs[i], sizes[i]), host[i]) << "segment " << i;
    }
  }
  comm_->allgather_coalesced({});
}

TEST_F(NcclWorldOfOne, CoalescedAllGatherOfManySegments) {
  // More segments than one NCCL group takes.
  const size_t n = 3000;
  DeviceBuf send(n * 5), recv(n * 5);
  const auto host = pattern(n * 5, 9);
  upload(send, host.data(), host.size());
  std::vector<GatherSegment> segs;
  for (size_t i = 0; i < n; ++i)
    segs.push_back({send.as<uint8_t>() + i * 5, recv.as<uint8_t>() + i * 5, 5});
  comm_->allgather_coalesced(segs);
  EXPECT_EQ(download<uint8_t>(recv, n * 5), host);
}

TEST_F(NcclWorldOfOne, ReduceScatterF32) {
  const size_t count = 257;
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i) * 0.5f - 7.0f;
  DeviceBuf send(count * 4), recv(count * 4);
  upload(send, host.data(), count * 4);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    CUDA_OK(cudaMemset(recv.p, 0, count * 4));
    comm_->reduce_scatter(send.p, recv.p, count, DType::F32, op);
    EXPECT_EQ(download<float>(recv, count), host) << "op " << static_cast<int>(op);
  }
}

TEST_F(NcclWorldOfOne, ReduceScatterBf16) {
  const size_t count = 100;
  std::vector<uint16_t> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = bf16_of(static_cast<float>(i) * 0.25f - 3.0f);
  DeviceBuf send(count * 2), recv(count * 2);
  upload(send, host.data(), count * 2);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    CUDA_OK(cudaMemset(recv.p, 0xff, count * 2));
    comm_->reduce_scatter(send.p, recv.p, count, DType::BF16, op);
    const auto out = download<uint16_t>(recv, count);
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(float_of_bf16(out[i]), float_of_bf16(host[i])) << "element " << i;
  }
}

TEST_F(NcclWorldOfOne, Uint8AverageIsRefusedAndTheGroupStaysUsable) {
  DeviceBuf send(16), recv(16);
  const std::string msg = error_of(Code::NotSupported, [&] {  // as on Gloo
    comm_->reduce_scatter(send.p, recv.p, 16, DType::U8, ReduceOp::Avg);
  });
  EXPECT_NE(msg.find("ZS_UINT8"), std::string::npos) << msg;
  const std::vector<uint8_t> host(16, 7);
  upload(send, host.data(), 16);
  comm_->reduce_scatter(send.p, recv.p, 16, DType::U8, ReduceOp::Sum);
  EXPECT_EQ(download<uint8_t>(recv, 16), host);
}

TEST_F(NcclWorldOfOne, AllReduce) {
  const std::vector<float> host{1.0f, -2.5f, 3.25f, 1e6f};
  DeviceBuf buf(16), out(16);
  upload(buf, host.data(), 16);
  comm_->allreduce(buf.p, out.p, 4, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(download<float>(out, 4), host);
  comm_->allreduce(buf.p, buf.p, 4, DType::F32, ReduceOp::Max);  // in place
  EXPECT_EQ(download<float>(buf, 4), host);
  const std::vector<uint16_t> half{0x3c00, 0xc000, 0x3800};  // 1, -2, 0.5
  DeviceBuf h(6);
  upload(h, half.data(), 6);
  comm_->allreduce(h.p, h.p, 3, DType::F16, ReduceOp::Avg);
  EXPECT_EQ(download<uint16_t>(h, 3), half);
}

TEST_F(NcclWorldOfOne, BroadcastScatterBarrier) {
  const auto host = pattern(777, 5);
  DeviceBuf buf(777);
  upload(buf, host.data(), 777);
  comm_->broadcast(buf.p, 777, 0);
  EXPECT_EQ(download<uint8_t>(buf, 777), host);
  error_of(Code::InvalidArgument, [&] { comm_->broadcast(buf.p, 777, 1); });

  DeviceBuf recv(777);
  comm_->scatter({buf.p}, recv.p, 777, 0);
  EXPECT_EQ(download<uint8_t>(recv, 777), host);
  error_of(Code::InvalidArgument, [&] { comm_->scatter({buf.p, buf.p}, recv.p, 777, 0); });

  for (int i = 0; i < 3; ++i) comm_->barrier();
}

TEST(NcclCommunicator, MissingUniqueIdTimesOutNamingTheGroup) {
  std::string why = device_problem();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  if (!nccl_available(&why)) GTEST_SKIP() << "NCCL cannot be loaded: " << why;
  TempDir dir;
  auto store = make_file_store(dir.path, 500ms);
  // Rank 1 of 2 waits for an id that rank 0 never publishes.
  const std::string msg = error_of(Code::Timeout, [&] {
    make_nccl_communicator("replica", 1, 2, *store, 0, nullptr, 30000ms);
  });
  EXPECT_NE(msg.find("group 'replica' (rank 1 of 2)"), std::string::npos) << msg;
}

TEST(NcclCommunicator, InitWithAMissingPeerTimesOut) {
  std::string why = device_problem();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  if (!nccl_available(&why)) GTEST_SKIP() << "NCCL cannot be loaded: " << why;
  TempDir dir;
  auto store = make_file_store(dir.path, 30000ms);
  const auto start = Clock::now();
  // Rank 0 of 2: publishes the id, then waits for a rank 1 that never comes.
  const std::string msg = error_of(Code::Timeout, [&] {
    make_nccl_communicator("lonely", 0, 2, *store, 0, nullptr, 3000ms);
  });
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  EXPECT_NE(msg.find("NCCL init of group 'lonely' (rank 0 of 2) did not finish in 3000 ms"),
            std::string::npos)
      << msg;
  EXPECT_GE(waited.count(), 2900);
  EXPECT_LT(waited.count(), 60000);
  EXPECT_TRUE(store->check("nccl_unique_id"));
}

// The context passes its heartbeat's verdict on the group's members: one
// that falls silent while NCCL's init waits for it ends the init within a
// liveness check (50 ms), long before the timeout, with Code::Comm naming
// it, and the id stays published as before.
TEST(NcclCommunicator, InitWithASilentPeerFailsNamingIt) {
  std::string why = device_problem();
  if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  if (!nccl_available(&why)) GTEST_SKIP() << "NCCL cannot be loaded: " << why;
  TempDir dir;
  auto store = make_file_store(dir.path, 30000ms);
  // Timed from the first question (the init's poll), so that CUDA's own
  // start in this process does not count.
  Clock::time_point first{};
  int asked = 0;
  const std::string silent =
      "rank 1 (host 127.0.0.1) has sent no heartbeat for 2.1 s: it is stopped or hung (alive but "
      "not running), or it died";
  auto silent_peer = [&]() -> std::string {
    if (asked++ == 0) first = Clock::now();
    return Clock::now() - first < 500ms ? "" : silent;
  };
  const std::string msg = error_of(Code::Comm, [&] {
    make_nccl_communicator("lonely", 0, 2, *store, 0, nullptr, 30000ms, silent_peer);
  });
  ASSERT_GT(asked, 0) << msg;
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - first);
  EXPECT_NE(msg.find(silent + "; NCCL init of group 'lonely' (rank 0 of 2) cannot complete"),
            std::string::npos)
      << msg;
  EXPECT_GE(waited.count(), 500);
  EXPECT_LT(waited.count(), 2000) << msg;
  // Asked about every 50 ms, not on every poll of NCCL's state.
  EXPECT_GE(asked, 2);
  EXPECT_LT(asked, 100);
  EXPECT_TRUE(store->check("nccl_unique_id"));
}

}  // namespace
}  // namespace zs

#endif  // ZS_WITH_CUDA
