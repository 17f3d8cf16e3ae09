// Deliberate bugs in a forked rank, disabled in every ordinary run.
// scripts/sanitize.sh runs them alone in its sanitizer builds and requires
// that they FAIL with the sanitizer's report: proof that a report in a rank
// that run_ranks forks (which leaves with _exit) fails the test, so that a
// clean sanitizer run means something.
#include <chrono>
#include <cstdio>
#include <thread>

#include <gtest/gtest.h>

#include "tests/support/multirank.h"

namespace {

// Keeps the compiler from proving the bug away.
template <typename T>
T launder(T v) {
  asm volatile("" : "+r"(v));
  return v;
}

TEST(SanitizerCanary, DISABLED_HeapUseAfterFreeInAForkedRank) {
  zs::test::run_ranks(2, [](const zs::test::RankEnv& env) {
    if (env.rank != 1) return;
    int* p = launder(new int[4]{1, 2, 3, 4});
    delete[] p;
    std::printf("rank 1 read %d after free\n", launder(p)[2]);
  });
}

int g_racy = 0;  // written by two threads without a lock: the race

TEST(SanitizerCanary, DISABLED_DataRaceInAForkedRank) {
  zs::test::run_ranks(2, [](const zs::test::RankEnv& env) {
    if (env.rank != 1) return;
    // Both threads write with no order between them; the sleep lets the
    // first write land before the second, in either order.
    std::thread t([] { g_racy = launder(g_racy) + 1; });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g_racy = launder(g_racy) + 1;
    t.join();
    std::printf("rank 1 counted %d\n", g_racy);
  });
}

}  // namespace
