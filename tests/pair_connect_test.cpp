// Connecting a group's full mesh of Gloo pairs costs each rank two store
// calls (one set_many of the addresses it opened, one get_many of those
// meant for it; the TCP store sends one request per 1,024 keys) and reads
// only the N - 1 addresses meant for it (N^2 bytes for the job), where
// Gloo's own connectFullMesh makes 2 (N - 1) requests per rank and has
// every rank read every rank's whole list of N - 1 addresses (N^3 bytes:
// 37 MiB at 64 ranks, about 160 GB at 1,024). Threads stand in for ranks
// (each with its own transport device, over one in-memory store); the
// pairs are real loopback sockets, and a barrier over them proves they
// connected.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/store/store.h"
#include "impl/comm/transport/gloo_communicator.h"
#include "tests/support/counting_store.h"

namespace {

using namespace std::chrono_literals;

TEST(PairConnect, TwoStoreCallsPerRankReadingOnlyTheAddressesMeantForIt) {
  for (const int n : {2, 5, 12}) {
    auto shared = zs::make_memory_store(20s);
    std::vector<std::unique_ptr<zs::test::CountingStore>> views;
    for (int r = 0; r < n; ++r) views.push_back(std::make_unique<zs::test::CountingStore>(*shared));
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> ranks;
    for (int r = 0; r < n; ++r)
      ranks.emplace_back([&, r] {
        try {
          auto device = zs::make_gloo_device("127.0.0.1");
          auto comm = zs::make_gloo_communicator("world", r, n, *views[static_cast<size_t>(r)], device, 20s);
          comm->barrier();
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    for (auto& t : ranks) t.join();
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r << " of " << n;
      const zs::test::CountingStore& v = *views[static_cast<size_t>(r)];
      // Two calls whatever the world size, and one address per peer (a
      // socket address and a sequence number: well under 256 bytes).
      EXPECT_EQ(v.calls, 2u) << "rank " << r << " of " << n;
      EXPECT_LE(v.bytes_read, static_cast<uint64_t>(n - 1) * 256) << "rank " << r << " of " << n;
    }
  }
}

}  // namespace
