// Connecting a group's full mesh of Gloo pairs reads from the store only
// the addresses meant for the reading rank: N - 1 reads of one address each
// (N^2 bytes for the job), where Gloo's own connectFullMesh has every rank
// read every rank's whole list of N - 1 addresses (N^3 bytes: 37 MiB at 64
// ranks, about 160 GB at 1,024). Threads stand in for ranks (each with its
// own transport device, over one in-memory store); the pairs are real
// loopback sockets, and a barrier over them proves they connected.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/store/store.h"
#include "impl/comm/transport/gloo_communicator.h"

namespace {

using namespace std::chrono_literals;

// One rank's view of the shared store, counting what it reads.
class CountingStore final : public zs::Store {
 public:
  explicit CountingStore(zs::Store& inner) : inner_(inner) {}
  void set(const std::string& key, const std::vector<char>& value) override { inner_.set(key, value); }
  std::vector<char> get(const std::string& key) override {
    auto v = inner_.get(key);
    ++gets;
    bytes_read += v.size();
    return v;
  }
  void wait(const std::vector<std::string>& keys) override { inner_.wait(keys); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  bool check(const std::string& key) override { return inner_.check(key); }

  uint64_t gets = 0, bytes_read = 0;

 private:
  zs::Store& inner_;
};

TEST(PairConnect, ARankReadsOnlyTheAddressesMeantForIt) {
  for (const int n : {2, 5, 12}) {
    auto shared = zs::make_memory_store(20s);
    std::vector<std::unique_ptr<CountingStore>> views;
    for (int r = 0; r < n; ++r) views.push_back(std::make_unique<CountingStore>(*shared));
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
      const CountingStore& v = *views[static_cast<size_t>(r)];
      // One read per peer, of one address (a socket address and a sequence
      // number: well under 256 bytes), whatever the world size.
      EXPECT_EQ(v.gets, static_cast<uint64_t>(n - 1)) << "rank " << r << " of " << n;
      EXPECT_LE(v.bytes_read, static_cast<uint64_t>(n - 1) * 256) << "rank " << r << " of " << n;
    }
  }
}

}  // namespace
