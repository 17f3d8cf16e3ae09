// The checkpoint's O_DIRECT streams (impl/checkpoint/direct_io.h): files
// written through the double-buffered writer hold exactly the bytes given
// at any length, direct or buffered (tmpfs refuses O_DIRECT, and
// ZS_CHECKPOINT_DIRECT_IO=0 turns it off); a refused write is an error
// naming the path; ChunkReader reads the same verified bytes whether its
// destination allows the direct path or not, and names a flipped byte in
// either.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "impl/checkpoint/direct_io.h"
#include "impl/checkpoint/shard_io.h"
#include "impl/common/error.h"
#include "impl/device/device.h"
#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

namespace fs = std::filesystem;
using zs::AlignedBuffer;
using zs::ckpt::ChunkReader;
using zs::ckpt::StreamWriter;

namespace {

std::vector<char> pattern(size_t n, unsigned seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 2654435761u + seed) >> 13);
  return v;
}

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

// Whether the filesystem of dir takes O_DIRECT at all.
bool takes_direct(const std::string& dir) {
  const std::string probe = dir + "/probe";
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd >= 0) close(fd);
  unlink(probe.c_str());
  return fd >= 0;
}

// Writes `bytes` through a writer with `buffer` bytes per buffer, mixing
// append and reserve/commit in pieces of awkward sizes.
void write_through(const std::string& path, const std::vector<char>& bytes, size_t buffer, bool* direct) {
  StreamWriter w(path, buffer);
  size_t at = 0, step = 1;
  while (at < bytes.size()) {
    const size_t n = std::min(step, bytes.size() - at);
    if (step % 2) {
      w.append(bytes.data() + at, n);
      at += n;
    } else {
      for (size_t left = n; left > 0;) {
        size_t got = 0;
        char* dst = w.reserve(left, &got);
        ASSERT_GE(got, 1u);
        std::memcpy(dst, bytes.data() + at, got);
        w.commit(got);
        at += got, left -= got;
      }
    }
    step = step * 3 + 7;
  }
  EXPECT_EQ(w.size(), bytes.size());
  w.finish();
  *direct = w.direct();
}

class DirectIoDirs : public ::testing::TestWithParam<const char*> {
 protected:
  std::string dir() {
    const std::string base = GetParam();
    if (base == "tmp") return zs::test::make_temp_dir("direct_io");
    if (!fs::is_directory("/dev/shm")) return "";
    char tmpl[] = "/dev/shm/zs_direct_io_XXXXXX";
    return mkdtemp(tmpl) ? std::string(tmpl) : "";
  }
};

TEST_P(DirectIoDirs, WriterKeepsEveryByteAtAnyLength) {
  const std::string d = dir();
  if (d.empty()) GTEST_SKIP() << "no /dev/shm (tmpfs) here";
  const bool can = takes_direct(d);
  std::printf("%s: O_DIRECT %s\n", d.c_str(), can ? "taken" : "refused");
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{3 * 8192 + 5},
                   size_t{(1u << 20) + 12345}}) {
    const auto bytes = pattern(n, static_cast<unsigned>(n));
    const std::string path = d + "/f" + std::to_string(n);
    bool direct = false;
    write_through(path, bytes, 8192, &direct);
    EXPECT_EQ(direct, can) << "the writer used O_DIRECT where the filesystem " << (can ? "takes" : "refuses") << " it";
    EXPECT_EQ(fs::file_size(path), n);
    EXPECT_TRUE(slurp(path) == bytes) << "bytes differ in a file of " << n;
  }
  fs::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(CheckpointDirectIo, DirectIoDirs, ::testing::Values("tmp", "shm"));

TEST(CheckpointDirectIo, TurnedOffByTheEnvironment) {
  const std::string d = zs::test::make_temp_dir("direct_io_off");
  setenv("ZS_CHECKPOINT_DIRECT_IO", "0", 1);
  const auto bytes = pattern(70000, 3);
  bool direct = true;
  write_through(d + "/f", bytes, 8192, &direct);
  unsetenv("ZS_CHECKPOINT_DIRECT_IO");
  EXPECT_FALSE(direct);
  EXPECT_TRUE(slurp(d + "/f") == bytes);
  fs::remove_all(d);
}

TEST(CheckpointDirectIo, ARefusedWriteNamesThePath) {
  const std::string d = zs::test::make_temp_dir("direct_io_full");
  // RLIMIT_FSIZE makes the kernel refuse writes past it (EFBIG), as a full
  // disk refuses them (ENOSPC); in a child, so the limit stays there.
  zs::test::run_ranks(1, [&](const zs::test::RankEnv&) {
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{1 << 20, 1 << 20};
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
    const std::string path = d + "/f";
    try {
      StreamWriter w(path, 256 << 10);
      const auto chunk = pattern(100000, 1);
      for (int i = 0; i < 40; ++i) w.append(chunk.data(), chunk.size());
      w.finish();
      FAIL() << "4 MB written past a 1 MiB RLIMIT_FSIZE";
    } catch (const zs::Error& e) {
      EXPECT_EQ(e.code(), zs::Code::Io);
      EXPECT_NE(std::string(e.what()).find("cannot write '" + path + "': File too large"), std::string::npos)
          << e.what();
    }
  });
  fs::remove_all(d);
}

// A one-tensor checkpoint file of n floats at an awkward header length.
struct OneChunk {
  std::string dir;
  zs::ckpt::Manifest m;
  zs::ckpt::Chunk chunk;
  std::vector<float> values;
};

OneChunk one_chunk(size_t n) {
  OneChunk o;
  o.dir = zs::test::make_temp_dir("direct_io_read");
  o.values.resize(n);
  for (size_t i = 0; i < n; ++i) o.values[i] = static_cast<float>(i) * 0.5f - 3.0f;
  std::vector<zs::ckpt::ShardSource> src{{"param/w", zs::DType::F32, n, o.values.data(), &o.chunk, {}}};
  zs::ckpt::FileEntry fe =
      zs::ckpt::write_shard_file(o.dir + "/rank-0.safetensors", src, *zs::host_device(), {{"pad", "xyz"}}, {});
  fe.name = "rank-0.safetensors";
  o.chunk.file = 0;
  o.chunk.offset = 0;
  o.m.files.push_back(fe);
  return o;
}

TEST(CheckpointDirectIo, ReaderGivesTheSameBytesDirectOrNotAndNamesAFlippedByte) {
  const size_t n = (3u << 20) / 4 + 1001;  // 3 MiB and change: several blocks, a partial last one
  OneChunk o = one_chunk(n);
  EXPECT_NE(o.chunk.begin % zs::kIoAlign, 0u) << "the test wants a tensor off the 4 KiB grid";
  const bool can = takes_direct(o.dir);
  // From element `first`: at the direct offset (O_DIRECT bulk) and one
  // byte past it (buffered throughout).
  for (uint64_t first : {uint64_t{0}, uint64_t{262144}, uint64_t{262144 + 17}}) {
    const uint64_t count = n - first;
    for (uint64_t shift : {uint64_t{0}, uint64_t{1}}) {
      ChunkReader reader(o.dir, o.m);
      reader.check_sizes();
      AlignedBuffer buf(count * 4 + 2 * zs::kIoAlign);
      char* dst = buf.data() + ChunkReader::direct_offset(o.chunk, first) + shift;
      reader.read(o.chunk, first, count, dst, "w, param");
      EXPECT_EQ(std::memcmp(dst, o.values.data() + first, count * 4), 0)
          << "from element " << first << ", destination shifted by " << shift;
      if (shift == 1 || !can) EXPECT_EQ(reader.direct_bytes_read(), 0u);
      else  // all but the partial first block (read whole, through scratch) and two part-pages
        EXPECT_GE(reader.direct_bytes_read(), n * 4 - (first * 4 + (1u << 20) - 1) / (1u << 20) * (1u << 20) - 8192)
            << "from element " << first;
    }
  }
  // One flipped byte in the middle of the second block.
  const uint64_t at = o.chunk.begin + (1u << 20) + 4096 * 3 + 5;
  {
    std::fstream f(o.dir + "/rank-0.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&c, 1);
  }
  for (uint64_t shift : {uint64_t{0}, uint64_t{1}}) {
    ChunkReader fresh(o.dir, o.m);
    AlignedBuffer buf(n * 4 + 2 * zs::kIoAlign);
    try {
      fresh.read(o.chunk, 0, n, buf.data() + ChunkReader::direct_offset(o.chunk, 0) + shift, "w, param");
      FAIL() << "a flipped byte was read without an error";
    } catch (const zs::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tensor 'param/w' (w, param) fails its checksum in bytes [" +
                         std::to_string(o.chunk.begin + (1u << 20)) + ", " +
                         std::to_string(o.chunk.begin + (2u << 20)) + ")"),
                std::string::npos)
          << msg;
    }
  }
  fs::remove_all(o.dir);
}

}  // namespace
