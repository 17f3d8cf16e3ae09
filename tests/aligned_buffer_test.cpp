// impl/common/aligned_buffer.h, the one O_DIRECT buffer of the swapper and
// the checkpoint streams: aligned, its size rounded up to kIoAlign, counted
// in IoStaging exactly while it holds memory, whatever moves it.
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "impl/common/aligned_buffer.h"
#include "impl/common/memory_tally.h"

using zs::AlignedBuffer;
using zs::kIoAlign;
using zs::MemKind;
namespace tally = zs::memory_tally;

TEST(AlignedBuffer, AlignedAndRoundedUp) {
  const uint64_t before = tally::current(MemKind::IoStaging);
  {
    AlignedBuffer b(300001);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kIoAlign, 0u);
    EXPECT_EQ(b.bytes(), zs::align_up(300001));
    EXPECT_EQ(b.bytes() % kIoAlign, 0u);
    EXPECT_EQ(tally::current(MemKind::IoStaging), before + b.bytes());
    AlignedBuffer exact(2 * kIoAlign);
    EXPECT_EQ(exact.bytes(), 2 * kIoAlign);
  }
  EXPECT_EQ(tally::current(MemKind::IoStaging), before);
}

TEST(AlignedBuffer, ZeroBytesHoldsNothing) {
  const uint64_t before = tally::current(MemKind::IoStaging);
  AlignedBuffer b(0), d;
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.bytes(), 0u);
  EXPECT_EQ(d.data(), nullptr);
  EXPECT_EQ(tally::current(MemKind::IoStaging), before);
}

TEST(AlignedBuffer, MovesHandOverAndAssignmentFreesAtOnce) {
  const uint64_t before = tally::current(MemKind::IoStaging);
  AlignedBuffer a(kIoAlign);
  char* p = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.bytes(), kIoAlign);

  // Assigning over a buffer frees its memory now, not when the source dies.
  AlignedBuffer c(3 * kIoAlign);
  b = std::move(c);
  EXPECT_EQ(c.data(), nullptr);
  EXPECT_EQ(b.bytes(), 3 * kIoAlign);
  EXPECT_EQ(tally::current(MemKind::IoStaging), before + 3 * kIoAlign);

  AlignedBuffer& self = b;
  b = std::move(self);
  EXPECT_EQ(b.bytes(), 3 * kIoAlign);

  b.release();
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.bytes(), 0u);
  EXPECT_EQ(tally::current(MemKind::IoStaging), before);

  std::vector<AlignedBuffer> v;
  for (int i = 0; i < 4; ++i) v.emplace_back(100);  // reallocation moves them
  EXPECT_EQ(tally::current(MemKind::IoStaging), before + 4 * kIoAlign);
  v.clear();
  EXPECT_EQ(tally::current(MemKind::IoStaging), before);
}
