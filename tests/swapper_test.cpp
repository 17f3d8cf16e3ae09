// The NVMe swapper on real files in a temporary directory: round trips at
// odd sizes and offsets under every aio setting, many requests in flight
// from several threads, preallocation and the free-space check, errors that
// name the file, the offset and errno, the buffered fallback on tmpfs, and
// the file gone after destroy.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "impl/common/error.h"
#include "impl/offload/space.h"
#include "impl/offload/swapper.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/io_uring_probe.h"
#include "tests/support/multirank.h"

namespace fs = std::filesystem;

namespace {

std::vector<char> pattern(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

zs::SwapperOptions options(const std::string& dir, zs::AioConfig aio = {}) {
  zs::SwapperOptions o;
  o.dir = dir;
  o.file_name = "test.swap";
  o.aio = aio;
  return o;
}

struct TempDir {
  std::string path = zs::test::make_temp_dir("swap");
  ~TempDir() { fs::remove_all(path); }
};

struct AioCase {
  int64_t block_size, queue_depth, threads;
  bool single_submit, overlap_events;
};

class SwapperAio : public ::testing::TestWithParam<AioCase> {};

TEST_P(SwapperAio, RoundTripsAtOddSizesAndOffsets) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  const AioCase c = GetParam();
  zs::AioConfig aio;
  aio.block_size = c.block_size;
  aio.queue_depth = c.queue_depth;
  aio.thread_count = c.threads;
  aio.single_submit = c.single_submit;
  aio.overlap_events = c.overlap_events;
  zs::Swapper s(options(dir.path, aio));
  EXPECT_EQ(s.grow(3 << 20), 0u);
  EXPECT_EQ(s.size(), 3u << 20);
  EXPECT_EQ(fs::file_size(s.path()), 3u << 20);
  // Overlapping-free pieces at awkward places, written in one order and
  // read back in another; neighbours must survive each partial block.
  struct Piece {
    uint64_t offset, bytes;
  };
  const Piece pieces[] = {{0, 1}, {1, 4095}, {4096, 4097}, {8193, 100003},
                          {200000, 1048576 + 17}, {2 * 1048576 + 5, 777777}};
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < std::size(pieces); ++i) {
    data.push_back(pattern(pieces[i].bytes, static_cast<uint32_t>(i + 1)));
    s.write(pieces[i].offset, data[i].data(), pieces[i].bytes);
  }
  for (size_t i = std::size(pieces); i-- > 0;) {
    std::vector<char> back(pieces[i].bytes);
    s.read(pieces[i].offset, back.data(), back.size());
    EXPECT_TRUE(back == data[i]) << "piece " << i;
  }
  // The asynchronous path on aligned memory, an odd size rounded up.
  zs::AlignedBuffer a(300001), b(300001);
  const auto src = pattern(a.bytes(), 99);
  std::memcpy(a.data(), src.data(), src.size());
  s.register_buffers({&a, &b});
  s.wait(s.write_async(1 << 20, a.data(), 300001));
  s.wait(s.read_async(1 << 20, b.data(), 300001));
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 300001), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Settings, SwapperAio,
    ::testing::Values(AioCase{1048576, 8, 1, false, true},   // the defaults
                      AioCase{4096, 1, 1, true, false},      // one page at a time
                      AioCase{12345, 3, 3, false, false},    // odd block size, 3 rings, batches
                      AioCase{65536, 32, 2, true, true}),    // deep queue, per-piece submit
    [](const ::testing::TestParamInfo<AioCase>& i) {
      const AioCase& c = i.param;
      return "block" + std::to_string(c.block_size) + "_depth" + std::to_string(c.queue_depth) + "_threads" +
             std::to_string(c.threads) + (c.single_submit ? "_single" : "_batch") +
             (c.overlap_events ? "_overlap" : "_drain");
    });

TEST(Swapper, ManyRequestsInFlightFromSeveralThreads) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  zs::AioConfig aio;
  aio.block_size = 65536;
  aio.thread_count = 2;
  zs::Swapper s(options(dir.path, aio));
  constexpr int kThreads = 4, kPerThread = 6;
  constexpr uint64_t kBytes = 256 * 1024 + 4096;
  s.grow(kThreads * kPerThread * kBytes);
  std::vector<zs::AlignedBuffer> bufs;
  for (int i = 0; i < kThreads * kPerThread; ++i) bufs.emplace_back(kBytes);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<zs::Swapper::Ticket> tickets;
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t * kPerThread + k;
        const auto v = pattern(kBytes, static_cast<uint32_t>(i));
        std::memcpy(bufs[i].data(), v.data(), kBytes);
        tickets.push_back(s.write_async(static_cast<uint64_t>(i) * kBytes, bufs[i].data(), kBytes));
      }
      for (auto tk : tickets) s.wait(tk);
      for (int k = 0; k < kPerThread; ++k) {
        const int i = t * kPerThread + k;
        std::memset(bufs[i].data(), 0, kBytes);
        tickets.push_back(s.read_async(static_cast<uint64_t>(i) * kBytes, bufs[i].data(), kBytes));
      }
      for (size_t k = kPerThread; k < tickets.size(); ++k) s.wait(tickets[k]);
    });
  for (auto& th : threads) th.join();
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    const auto v = pattern(kBytes, static_cast<uint32_t>(i));
    EXPECT_EQ(std::memcmp(bufs[i].data(), v.data(), kBytes), 0) << "request " << i;
  }
}

TEST(Swapper, PreallocatesAndRemovesItsFile) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  std::string path;
  {
    zs::Swapper s(options(dir.path));
    path = s.path();
    EXPECT_EQ(path, dir.path + "/test.swap");
    EXPECT_EQ(s.grow(10), 0u);  // rounded up to a block
    EXPECT_EQ(s.grow(4096), 4096u);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 8192);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8192u);  // allocated, not sparse
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST(Swapper, NotEnoughSpaceNamesThePathTheBytesNeededAndFree) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  zs::Swapper s(options(dir.path));
  const uint64_t free = zs::free_bytes(dir.path);
  const uint64_t need = zs::align_up(free + (uint64_t{1} << 30));
  try {
    s.grow(need);
    FAIL() << "grow beyond the free space succeeded";
  } catch (const zs::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), zs::Code::Io);
    EXPECT_NE(msg.find("offload_optimizer.nvme_path '" + dir.path + "': needs " + std::to_string(need) +
                       " bytes, "),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(" bytes free"), std::string::npos) << msg;
  }
  EXPECT_EQ(s.size(), 0u);
}

TEST(Swapper, ADirectoryThatCannotHoldAFileIsNamedWithErrno) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  const std::string file = dir.path + "/not_a_dir";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  try {
    zs::Swapper s(options(file));
    FAIL() << "a swap file under a regular file";
  } catch (const zs::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), zs::Code::Io);
    EXPECT_NE(msg.find("cannot create the swap file '" + file + "/test.swap'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(errno 20)"), std::string::npos) << msg;  // ENOTDIR
  }
  try {
    zs::Swapper s(options("/proc/self"));
    FAIL() << "a swap file in /proc";
  } catch (const zs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("(errno "), std::string::npos) << e.what();
  }
}

TEST(Swapper, AnIoErrorNamesTheFileTheOffsetAndErrno) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  zs::AioConfig aio;
  aio.block_size = 4096;
  zs::Swapper s(options(dir.path, aio));
  s.grow(1 << 20);
  const auto v = pattern(20000, 5);
  s.write(8192, v.data(), v.size());
  std::vector<char> back(v.size());
  s.inject_error_for_test(EIO);
  try {
    s.read(8192, back.data(), back.size());
    FAIL() << "the injected EIO was lost";
  } catch (const zs::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), zs::Code::Io);
    EXPECT_NE(msg.find("NVMe swap: read of 4096 bytes at offset "), std::string::npos) << msg;
    EXPECT_NE(msg.find(" of '" + s.path() + "' failed: Input/output error (errno 5)"), std::string::npos)
        << msg;
  }
  // Nothing was lost: the next read has the data.
  s.read(8192, back.data(), back.size());
  EXPECT_TRUE(back == v);
}

TEST(Swapper, ATruncatedFileIsAnEndOfFileErrorAtItsOffset) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  zs::Swapper s(options(dir.path));
  s.grow(1 << 20);
  ASSERT_EQ(truncate(s.path().c_str(), 65536), 0);
  std::vector<char> back(4096);
  try {
    s.read(65536 + 100, back.data(), back.size());
    FAIL() << "read past a truncated end";
  } catch (const zs::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("at offset 65536 of '" + s.path() + "' failed: unexpected end of file"),
              std::string::npos)
        << msg;
  }
}

TEST(Swapper, ARefusedPreallocationNamesErrno) {
  ZS_SKIP_WITHOUT_IO_URING();
  // RLIMIT_FSIZE makes fallocate past it fail with EFBIG, a real refusal
  // from the kernel (in a child, so the limit stays there).
  TempDir dir;
  zs::test::run_ranks(1, [&](const zs::test::RankEnv&) {
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
    zs::Swapper s(options(dir.path));
    try {
      s.grow(2 << 20);
      FAIL() << "fallocate past RLIMIT_FSIZE succeeded";
    } catch (const zs::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("cannot allocate 2097152 bytes at offset 0 of the swap file '" + s.path() +
                         "': File too large (errno 27)"),
                std::string::npos)
          << msg;
    }
  });
}

TEST(Swapper, BufferedIoWorksWhereODirectIsRefused) {
  ZS_SKIP_WITHOUT_IO_URING();
  // tmpfs refused O_DIRECT before Linux 6.6 (the swapper then falls back by
  // itself); where it accepts it, buffered I/O is asked for directly.
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  std::string tmpl = "/dev/shm/zs_swap_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  for (bool try_direct : {true, false}) {
    auto o = options(tmpl);
    o.try_direct = try_direct;
    zs::Swapper s(o);
    if (!try_direct) {
      EXPECT_FALSE(s.direct());
    }
    s.grow(1 << 16);
    const auto v = pattern(5000, 3);
    s.write(17, v.data(), v.size());
    std::vector<char> back(v.size());
    s.read(17, back.data(), back.size());
    EXPECT_TRUE(back == v);
  }
  fs::remove_all(tmpl);
}

TEST(Swapper, RequestsOutsideTheFileOrUnalignedAreRefused) {
  ZS_SKIP_WITHOUT_IO_URING();
  TempDir dir;
  zs::Swapper s(options(dir.path));
  s.grow(8192);
  char c[16];
  EXPECT_THROW(s.read(8190, c, 3), zs::Error);
  zs::AlignedBuffer a(4096);
  EXPECT_THROW(s.read_async(100, a.data(), 4096), zs::Error);
  EXPECT_THROW(s.write_async(0, a.data() + 1, 4096), zs::Error);
  EXPECT_THROW(s.read_async(8192, a.data(), 4096), zs::Error);
}

}  // namespace
