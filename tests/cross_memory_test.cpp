// Cross-memory reads (impl/comm/transport/cross_memory.h) between real processes: a
// peer's nonce and message read out of it, what is refused, and the
// collectives giving the same bits over cross memory, over TCP, and with
// one rank that turned cross memory off (its pairs fall back, the rest
// keep it).
#include "impl/comm/transport/cross_memory.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tests/support/multirank.h"

using zs::test::RankEnv;
using zs::test::run_ranks;

namespace {

// A child process that holds `data` and a nonce, tells us where they are,
// and waits until we close the pipe.
struct Holder {
  pid_t pid = -1;
  zs::CrossMemoryHello hello{};
  uint64_t data_at = 0;
  int release_fd = -1;
  int reply_fd = -1;
};

// Has the holder abandon a collective (cross_memory_abandon) and waits.
void abandon_in(Holder& h) {
  char c = 'a';
  ASSERT_EQ(write(h.release_fd, &c, 1), 1);
  ASSERT_EQ(read(h.reply_fd, &c, 1), 1);
}

Holder spawn_holder(size_t bytes) {
  int to_parent[2], to_child[2];
  EXPECT_EQ(pipe(to_parent), 0);
  EXPECT_EQ(pipe(to_child), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    static uint64_t nonce = 0x5eed5eed12345678ull;
    std::vector<uint8_t> data(bytes);
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
    const zs::CrossMemoryHello hello = zs::cross_memory_hello(&nonce);
    const uint64_t at = reinterpret_cast<uint64_t>(data.data());
    if (write(to_parent[1], &hello, sizeof(hello)) != sizeof(hello)) _exit(2);
    if (write(to_parent[1], &at, sizeof(at)) != sizeof(at)) _exit(2);
    char c;
    while (read(to_child[0], &c, 1) > 0) {
      if (c == 'a') zs::cross_memory_abandon();
      if (write(to_parent[1], &c, 1) != 1) _exit(2);  // done
    }
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  Holder h;
  h.pid = pid;
  EXPECT_EQ(read(to_parent[0], &h.hello, sizeof(h.hello)), static_cast<ssize_t>(sizeof(h.hello)));
  EXPECT_EQ(read(to_parent[0], &h.data_at, sizeof(h.data_at)),
            static_cast<ssize_t>(sizeof(h.data_at)));
  h.reply_fd = to_parent[0];
  h.release_fd = to_child[1];
  return h;
}

void finish(Holder& h) {
  close(h.release_fd);
  close(h.reply_fd);
  int status = 0;
  waitpid(h.pid, &status, 0);
}

zs::CrossMemoryHello my_hello() {
  static uint64_t nonce = 42;
  return zs::cross_memory_hello(&nonce);
}

}  // namespace

TEST(CrossMemory, APeersNonceAndMessageAreReadOutOfIt) {
  const size_t bytes = 3 * 1024 * 1024 + 17;
  Holder h = spawn_holder(bytes);
  const zs::CrossMemoryHello mine = my_hello();
  ASSERT_TRUE(mine.allowed) << "cross memory is off here (ZS_CROSS_MEMORY=0 or no boot id)";
  EXPECT_TRUE(zs::cross_memory_reaches(mine, h.hello));
  std::vector<uint8_t> got(bytes);
  const uint64_t before = zs::cross_memory_bytes_read();
  ASSERT_TRUE(zs::cross_memory_read(h.pid, got.data(), h.data_at, bytes)) << std::strerror(errno);
  EXPECT_GE(zs::cross_memory_bytes_read() - before, bytes);
  for (size_t i = 0; i < bytes; ++i)
    ASSERT_EQ(got[i], static_cast<uint8_t>(i * 131 + 7)) << "byte " << i;
  finish(h);
}

// What a reader checks after reading: the holder's abandon count, at the
// address its hello gave, moves when it gives a collective up.
TEST(CrossMemory, TheAbandonCountIsReadFromThePeer) {
  Holder h = spawn_holder(64);
  uint64_t before = 0, after = 0;
  ASSERT_TRUE(zs::cross_memory_read(h.pid, &before, h.hello.epoch_at, sizeof(before)));
  abandon_in(h);
  ASSERT_TRUE(zs::cross_memory_read(h.pid, &after, h.hello.epoch_at, sizeof(after)));
  EXPECT_EQ(after, before + 1);
  finish(h);
}

TEST(CrossMemory, AWrongNonceAnotherHostOrAPeerThatOptedOutIsNotReached) {
  Holder h = spawn_holder(64);
  const zs::CrossMemoryHello mine = my_hello();
  zs::CrossMemoryHello wrong = h.hello;
  wrong.nonce ^= 1;  // another process at that pid, or another address space
  EXPECT_FALSE(zs::cross_memory_reaches(mine, wrong));
  zs::CrossMemoryHello elsewhere = h.hello;
  elsewhere.host[0] = elsewhere.host[0] == 'x' ? 'y' : 'x';
  EXPECT_FALSE(zs::cross_memory_reaches(mine, elsewhere));
  zs::CrossMemoryHello off = h.hello;
  off.allowed = 0;
  EXPECT_FALSE(zs::cross_memory_reaches(mine, off));
  EXPECT_TRUE(zs::cross_memory_reaches(mine, h.hello));
  finish(h);
}

TEST(CrossMemory, AGoneProcessIsAFailureNotGarbage) {
  Holder h = spawn_holder(4096);
  const pid_t pid = h.pid;
  const uint64_t at = h.data_at;
  finish(h);  // exited and reaped
  std::vector<uint8_t> got(4096, 0xAB);
  EXPECT_FALSE(zs::cross_memory_read(pid, got.data(), at, got.size()));
  EXPECT_EQ(errno, ESRCH);
}

TEST(CrossMemory, OffInTheEnvironmentMeansNotAllowed) {
  setenv("ZS_CROSS_MEMORY", "0", 1);
  EXPECT_FALSE(my_hello().allowed);
  EXPECT_FALSE(zs::cross_memory_allowed());
  unsetenv("ZS_CROSS_MEMORY");
  EXPECT_TRUE(zs::cross_memory_allowed());
}

namespace {

// A 1 MiB fp32 all-gather and reduce-scatter on every rank; rank `tcp_rank`
// (if any) turns cross memory off before its context exists. Checks the
// bits, and that cross memory carried bytes exactly when some pair has it.
void gather_and_reduce(const RankEnv& env, int tcp_rank, bool expect_cross_memory) {
  if (env.rank == tcp_rank) setenv("ZS_CROSS_MEMORY", "0", 1);
  zs_context ctx = zs::test::make_context(env);
  ASSERT_NE(ctx, nullptr);
  zs_group world = nullptr;
  ZS_ASSERT_OK(zs_context_group(&world, ctx, ZS_GROUP_WORLD));
  const size_t count = 262147;  // > 1 MiB of fp32, odd
  const auto n = static_cast<size_t>(env.world);
  auto value = [](int rank, size_t i) {
    return static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13) % 1001) -
                              500);
  };
  const uint64_t before = zs::cross_memory_bytes_read();
  std::vector<float> mine(count), all(count * n);
  for (size_t i = 0; i < count; ++i) mine[i] = value(env.rank, i);
  zs_work w = nullptr;
  ZS_ASSERT_OK(zs_allgather(&w, world, mine.data(), all.data(), count, ZS_FLOAT32));
  ZS_ASSERT_OK(zs_work_wait(w, 30000));
  ZS_ASSERT_OK(zs_work_destroy(w));
  for (int r = 0; r < env.world; ++r)
    for (size_t i = 0; i < count; ++i)
      ASSERT_EQ(all[static_cast<size_t>(r) * count + i], value(r, i)) << "rank " << r << " i " << i;
  std::vector<float> full(count * n), out(count);
  for (size_t i = 0; i < full.size(); ++i) full[i] = value(env.rank, i);
  ZS_ASSERT_OK(zs_reduce_scatter(&w, world, full.data(), out.data(), count, ZS_FLOAT32, ZS_SUM));
  ZS_ASSERT_OK(zs_work_wait(w, 30000));
  ZS_ASSERT_OK(zs_work_destroy(w));
  for (size_t i = 0; i < count; ++i) {
    float want = 0;
    for (int r = 0; r < env.world; ++r) want += value(r, static_cast<size_t>(env.rank) * count + i);
    ASSERT_EQ(out[i], want) << "i " << i;  // small integers: exact in any order
  }
  const uint64_t read = zs::cross_memory_bytes_read() - before;
  if (expect_cross_memory && env.rank != tcp_rank) {
    EXPECT_GE(read, count * sizeof(float))
        << "rank " << env.rank << " read nothing by cross memory";
  } else {
    EXPECT_EQ(read, 0u) << "rank " << env.rank
                        << " read by cross memory where its pairs are on TCP";
  }
  zs_group_destroy(world);
  zs_context_destroy(ctx);
}

}  // namespace

TEST(CrossMemory, CollectivesOverCrossMemoryOn3Ranks) {
  run_ranks(3, [](const RankEnv& env) { gather_and_reduce(env, -1, true); });
}

TEST(CrossMemory, CollectivesOverTcpWhenOff) {
  setenv("ZS_CROSS_MEMORY", "0", 1);
  run_ranks(2, [](const RankEnv& env) { gather_and_reduce(env, -1, false); });
  unsetenv("ZS_CROSS_MEMORY");
}

// Rank 1 opted out: its pairs go over TCP on both ends, ranks 0 and 2 read
// each other by cross memory, and nobody waits for a message the other end
// sent another way.
TEST(CrossMemory, OneRankOptingOutKeepsItsPairsOnTcp) {
  run_ranks(3, [](const RankEnv& env) { gather_and_reduce(env, 1, true); });
}
