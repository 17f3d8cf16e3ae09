// Past ZS_FULL_MESH_MAX members a group connects each member only to the
// members 2^k ahead of and behind it, and runs log N-round collectives
// (sparse_collectives.h). These tests hold the peer set to its promise
// (symmetric, at most 2 ceil(log2 N), nothing more read from the store) and
// run every collective, odd sizes and roots included, on a sparse group
// and on a full mesh of the same size side by side: the results must be
// bitwise equal, and right. Threads stand in for ranks (each with its own
// transport device, over one in-memory store); the pairs are real loopback
// sockets, and the transport refuses a message to a member it has no pair
// with, so an algorithm that strays fails here.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/algo/mesh_peers.h"
#include "impl/comm/store/store.h"
#include "impl/comm/transport/gloo_communicator.h"
#include "kernels/convert.h"
#include "tests/support/bench_util.h"
#include "tests/support/counting_store.h"
#include "tests/support/multirank.h"

namespace {

using namespace std::chrono_literals;

int ceil_log2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

TEST(MeshPeers, SymmetricLogarithmicAndFullUpToTheLimit) {
  for (const int limit : {1, 2, 8, 64}) {
    for (int n = 1; n <= 140; ++n) {
      std::vector<std::vector<int>> peers;
      for (int r = 0; r < n; ++r) peers.push_back(zs::mesh_peers(r, n, limit));
      for (int a = 0; a < n; ++a) {
        const auto& pa = peers[static_cast<size_t>(a)];
        if (n <= limit) {
          EXPECT_EQ(pa.size(), static_cast<size_t>(n - 1)) << a << " of " << n;
        } else {
          EXPECT_LE(pa.size(), static_cast<size_t>(2 * ceil_log2(n))) << a << " of " << n;
        }
        for (const int b : pa) {
          EXPECT_NE(a, b);
          const auto& pb = peers[static_cast<size_t>(b)];
          EXPECT_TRUE(std::find(pb.begin(), pb.end(), a) != pb.end())
              << a << " -> " << b << " of " << n << " but not back";
        }
      }
    }
  }
  // 1,024 ranks past the limit: 19 pairs a rank (2 x 10 less the one at
  // distance 512 both ways), not 1,023.
  EXPECT_EQ(zs::mesh_peers(5, 1024, 64).size(), 19u);
}

// What one member computed, byte for byte, in the order it ran.
using Outputs = std::vector<std::vector<uint8_t>>;

float value(int rank, size_t i) {
  // Not exactly summable in every order: a change of order would show.
  return 0.1f * static_cast<float>((rank * 31 + static_cast<int>(i) * 7) % 97) + 1e-3f * static_cast<float>(rank);
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Every collective the engine runs, on one member.
Outputs run_everything(zs::Communicator& c) {
  const int n = c.size(), me = c.rank();
  const auto members = static_cast<size_t>(n);
  Outputs out;
  // all-gather: empty, odd, and past kDirectSegmentBytes.
  for (const size_t bytes : {size_t{0}, size_t{7}, size_t{300001}}) {
    std::vector<uint8_t> send(bytes), recv(bytes * members, 0xEE);
    for (size_t i = 0; i < bytes; ++i) send[i] = static_cast<uint8_t>(me * 13 + i);
    c.allgather(send.data(), recv.data(), bytes);
    out.push_back(recv);
  }
  // Coalesced: small and large segments, one of them empty.
  {
    const size_t sizes[] = {5, 0, 262144, 33};
    std::vector<std::vector<uint8_t>> sends, recvs;
    std::vector<zs::GatherSegment> segments;
    for (const size_t s : sizes) {
      sends.emplace_back(s);
      for (size_t i = 0; i < s; ++i) sends.back()[i] = static_cast<uint8_t>(me + 3 * i + s);
      recvs.emplace_back(s * members, 0xEE);
    }
    for (size_t k = 0; k < sends.size(); ++k)
      segments.push_back({sends[k].data(), recvs[k].data(), sends[k].size()});
    c.allgather_coalesced(segments);
    for (const auto& r : recvs) out.push_back(r);
  }
  // reduce-scatter and all-reduce: fp32 and bf16, odd counts; 300,001
  // fp32 elements on a sparse group of 13 pass kSparseGatherReduceBytes
  // (the ring, then the blocks gathered).
  for (const zs::DType t : {zs::DType::F32, zs::DType::BF16}) {
    for (const size_t count : {size_t{1}, size_t{1003}, size_t{300001}}) {
      std::vector<float> f(count * members);
      for (size_t i = 0; i < f.size(); ++i) f[i] = value(me, i);
      std::vector<uint8_t> send(f.size() * zs::dtype_size(t));
      if (t == zs::DType::F32) {
        std::memcpy(send.data(), f.data(), send.size());
      } else {
        for (size_t i = 0; i < f.size(); ++i) {
          const uint16_t h = zs::kernels::float_to_bf16(f[i]);
          std::memcpy(&send[i * 2], &h, 2);
        }
      }
      std::vector<uint8_t> recv(count * zs::dtype_size(t));
      if (count < 300001) {
        c.reduce_scatter(send.data(), recv.data(), count, t, zs::ReduceOp::Sum);
        out.push_back(recv);
      }
      for (const zs::ReduceOp op : {zs::ReduceOp::Sum, zs::ReduceOp::Avg, zs::ReduceOp::Max}) {
        c.allreduce(send.data(), recv.data(), count, t, op);
        out.push_back(recv);
      }
    }
  }
  // all-to-all (qgZ): odd block sizes.
  for (const size_t bytes : {size_t{1}, size_t{4097}}) {
    std::vector<uint8_t> send(bytes * members), recv(bytes * members, 0xEE);
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(me * 7 + i / bytes * 3 + i);
    c.alltoall(send.data(), recv.data(), bytes);
    out.push_back(recv);
  }
  // broadcast and scatter from the first, the last and a middle root.
  for (const int root : {0, n - 1, n / 2}) {
    for (const size_t bytes : {size_t{1}, size_t{100003}}) {
      std::vector<uint8_t> buf(bytes, 0);
      if (me == root)
        for (size_t i = 0; i < bytes; ++i) buf[i] = static_cast<uint8_t>(root + i * 5);
      c.broadcast(buf.data(), bytes, root);
      out.push_back(buf);
      std::vector<std::vector<uint8_t>> inputs;
      std::vector<const void*> pointers;
      if (me == root) {
        for (int r = 0; r < n; ++r) {
          inputs.emplace_back(bytes);
          for (size_t i = 0; i < bytes; ++i) inputs.back()[i] = static_cast<uint8_t>(r * 11 + i);
        }
        for (const auto& in : inputs) pointers.push_back(in.data());
      }
      std::vector<uint8_t> mine(bytes, 0xEE);
      c.scatter(pointers, mine.data(), bytes, root);
      out.push_back(mine);
    }
  }
  c.barrier();
  return out;
}

// Runs run_everything on n threads over a group with the given limit and
// returns each member's outputs; fails the test on any member's error.
std::vector<Outputs> run_group(int n, int full_mesh_max, std::vector<uint64_t>* store_bytes = nullptr,
                               std::vector<uint64_t>* store_calls = nullptr) {
  auto shared = zs::make_memory_store(60s);
  std::vector<std::unique_ptr<zs::test::CountingStore>> views;
  for (int r = 0; r < n; ++r) views.push_back(std::make_unique<zs::test::CountingStore>(*shared));
  std::vector<Outputs> outputs(static_cast<size_t>(n));
  std::vector<uint64_t> connect_bytes(static_cast<size_t>(n)), connect_calls(static_cast<size_t>(n));
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      const auto i = static_cast<size_t>(r);
      try {
        auto device = zs::make_gloo_device("127.0.0.1");
        auto comm = zs::make_gloo_communicator("world", r, n, *views[i], device, 60s, nullptr,
                                               nullptr, {}, full_mesh_max);
        connect_bytes[i] = views[i]->bytes_read;
        connect_calls[i] = views[i]->calls;
        outputs[i] = run_everything(*comm);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r << " of " << n;
  if (store_bytes) *store_bytes = connect_bytes;
  if (store_calls) *store_calls = connect_calls;
  return outputs;
}

TEST(SparseMesh, EveryCollectiveGivesTheFullMeshsBitsOnOddSizes) {
  // 3 and 5 past a limit of 2 still reach every member at distances 2^k
  // (and run the full mesh's algorithms); 8 and 13 do not.
  EXPECT_LT(zs::mesh_peers(0, 8, 2).size(), 7u);
  EXPECT_LT(zs::mesh_peers(0, 13, 2).size(), 12u);
  for (const int n : {3, 5, 8, 13}) {
    std::vector<uint64_t> sparse_bytes, sparse_calls;
    const auto sparse = run_group(n, 2, &sparse_bytes, &sparse_calls);
    const auto full = run_group(n, 64);
    if (HasFailure()) return;
    for (int r = 0; r < n; ++r) {
      const auto i = static_cast<size_t>(r);
      // Only the pairs' addresses meant for it, in two store calls.
      EXPECT_EQ(sparse_calls[i], 2u) << "rank " << r << " of " << n;
      EXPECT_LE(sparse_bytes[i], zs::mesh_peers(r, n, 2).size() * 256) << "rank " << r << " of " << n;
      ASSERT_EQ(sparse[i].size(), full[i].size());
      for (size_t k = 0; k < full[i].size(); ++k)
        EXPECT_EQ(sparse[i][k], full[i][k]) << "output " << k << " of rank " << r << " of " << n;
    }
  }
}

// And the sparse results are right: the gathers, the all-to-all,
// broadcast and scatter move bytes exactly, and a sum is the sum in rank
// order on every member. (Indices into run_everything's outputs: 3
// all-gathers, 4 coalesced segments, 11 reductions per dtype, 2
// all-to-alls, then a broadcast and a scatter per root and size.)
TEST(SparseMesh, ResultsAreRightOnEveryMember) {
  // 12 members past a limit of 1: 6 pairs each of 11 (up to 7 members
  // the 2^k distances reach everyone, and the full mesh's algorithms run).
  const int n = 12;
  ASSERT_EQ(zs::mesh_peers(0, n, 1).size(), 6u);
  const auto outputs = run_group(n, 1);
  if (HasFailure()) return;
  const auto members = static_cast<size_t>(n);
  float sum = value(0, 0);
  for (int m = 1; m < n; ++m) sum += value(m, 0);
  for (int r = 0; r < n; ++r) {
    const Outputs& o = outputs[static_cast<size_t>(r)];
    ASSERT_EQ(o.size(), 43u);
    const auto me = static_cast<size_t>(r);
    for (size_t m = 0; m < members; ++m)
      for (size_t i = 0; i < 7; ++i)
        ASSERT_EQ(o[1][m * 7 + i], static_cast<uint8_t>(m * 13 + i)) << "all-gather, rank " << r;
    float got = 0;
    std::memcpy(&got, o[8].data(), 4);
    EXPECT_EQ(got, sum) << "fp32 sum of one element, rank " << r;
    for (size_t m = 0; m < members; ++m)
      EXPECT_EQ(o[29][m], static_cast<uint8_t>(m * 7 + me * 3 + me)) << "all-to-all, rank " << r;
    EXPECT_EQ(o[31][0], 0) << "broadcast from 0, rank " << r;
    for (size_t i = 0; i < 100003; ++i) {
      ASSERT_EQ(o[33][i], static_cast<uint8_t>(i * 5)) << "broadcast from 0, rank " << r;
      ASSERT_EQ(o[34][i], static_cast<uint8_t>(me * 11 + i)) << "scatter from 0, rank " << r;
    }
  }
}

// 8 processes through the C ABI: the world group gathers, reduces (past
// the gather-reduce size too) and broadcasts right under the ZS_FULL_MESH_MAX
// a rank is started with; writes how many sockets its context opened.
void eight_ranks(const zs::test::RankEnv& env, const std::string& sockets_file) {
  const int before = zs::bench::sockets_open();
  zs_context ctx = zs::test::make_context(env);
  ASSERT_NE(ctx, nullptr);
  zs_group world = nullptr;
  ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
  const int opened = zs::bench::sockets_open() - before;
  const auto w = static_cast<size_t>(env.world);
  const auto wait = [](zs_work work) {
    ZS_ASSERT_OK(zs_work_wait(work, 30000));
    ZS_ASSERT_OK(zs_work_destroy(work));
  };
  for (const size_t count : {size_t{1}, size_t{4099}, size_t{600001}}) {
    // Small integers: every order of summation gives the same sum.
    std::vector<float> mine(count), gathered(count * w), sum(count);
    for (size_t i = 0; i < count; ++i) mine[i] = static_cast<float>((env.rank * 5 + i) % 17);
    zs_work work = nullptr;
    ZS_ASSERT_OK(zs_allgather(&work, world, mine.data(), gathered.data(), count, ZS_FLOAT32));
    wait(work);
    ZS_ASSERT_OK(zs_allreduce(&work, world, mine.data(), sum.data(), count, ZS_FLOAT32, ZS_SUM));
    wait(work);
    for (size_t i = 0; i < count; ++i) {
      float expect = 0;
      for (size_t r = 0; r < w; ++r) {
        ASSERT_EQ(gathered[r * count + i], static_cast<float>((r * 5 + i) % 17)) << "all-gather, count " << count;
        expect += static_cast<float>((r * 5 + i) % 17);
      }
      ASSERT_EQ(sum[i], expect) << "all-reduce, count " << count << ", element " << i;
    }
    std::vector<float> b = mine;
    ZS_ASSERT_OK(zs_broadcast(&work, world, b.data(), count, ZS_FLOAT32, 5));
    wait(work);
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], static_cast<float>((25 + i) % 17)) << "broadcast";
  }
  zs_work barrier = nullptr;
  ZS_ASSERT_OK(zs_barrier(&barrier, world));
  wait(barrier);
  if (env.rank == 1) std::ofstream(sockets_file) << opened;
  ZS_EXPECT_OK(zs_group_destroy(world));
  ZS_EXPECT_OK(zs_context_destroy(ctx));
}

int sockets_of_rank_1(const char* full_mesh_max) {
  char path[] = "/tmp/zs_sparse_socketsXXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return -1;
  close(fd);
  {
    const zs::test::ScopedEnv mesh("ZS_FULL_MESH_MAX", full_mesh_max);
    zs::test::run_ranks(8, [&](const zs::test::RankEnv& env) { eight_ranks(env, path); }, 120);
  }
  int n = -1;
  std::ifstream(path) >> n;
  std::remove(path);
  return n;
}

// Past ZS_FULL_MESH_MAX=4 a rank of 8 connects 5 pairs (distances 1, 2
// and 4 both ways) instead of 7: two sockets fewer, the same results.
TEST(SparseMesh, EightProcessesPastTheLimitOpenTwoPairsFewer) {
  const int full = sockets_of_rank_1("64");
  const int sparse = sockets_of_rank_1("4");
  if (HasFailure()) return;
  EXPECT_EQ(full - sparse, 2) << "sockets a context opened: " << full << " on a full mesh, " << sparse
                              << " past the limit";
}

// Ranks started with different limits would connect different pairs:
// groups connect by rank 0's, and every rank's creation fails in the ready
// round, naming the variable and both values, as differing configs do.
TEST(SparseMesh, RanksThatDisagreeOnTheLimitAreRefused) {
  zs::test::run_ranks(3, [](const zs::test::RankEnv& env) {
    if (env.rank == 2) setenv("ZS_FULL_MESH_MAX", "1", 1);
    zs_context_options o = zs::test::rank_options(env);
    zs_context ctx = nullptr;
    EXPECT_EQ(zs_context_create(&ctx, &o), ZS_ERR_INVALID_CONFIG);
    const std::string expected = "rank 2 has environment ZS_FULL_MESH_MAX=1 (rank 0: " +
                                 std::to_string(zs::kDefaultFullMeshMax) + ")";
    EXPECT_NE(std::string(zs_last_error()).find(expected), std::string::npos)
        << zs_last_error();
  });
}

}  // namespace
