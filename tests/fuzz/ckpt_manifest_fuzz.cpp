// libFuzzer target: a checkpoint's manifest.json (hostile text) through
// Manifest::parse, which Manifest::read uses.
//
// Whatever the input, parse returns or throws zs::Error with Code::Io and a
// message. What parses must be sane for every reader (load, verify, export,
// reshard): the oracle below re-checks each property in 128-bit arithmetic,
// it must survive to_json and parse again unchanged, and a ChunkReader over
// files of the declared sizes (sparse, zeros, so every checksum fails) must
// read each chunk or throw Code::Io, never touch memory it should not.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/format.h"
#include "impl/checkpoint/shard_io.h"
#include "impl/common/error.h"

namespace {

using zs::ckpt::Chunk;
using zs::ckpt::Manifest;
using u128 = unsigned __int128;

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "manifest fuzz finding: %s: %s\n", what, detail.c_str());
  std::abort();
}

void expect_io(const zs::Error& e, const char* during) {
  if (e.code() != zs::Code::Io) finding(during, std::string("error code other than Io: ") + e.what());
  if (std::string(e.what()).empty()) finding(during, "error without a message");
}

void check_sane(const Manifest& m) {
  if (m.world_size < 1) finding("world_size", std::to_string(m.world_size));
  const uint64_t B = m.block_bytes;
  if (B == 0 || (B & (B - 1)) != 0 || B > zs::ckpt::kMaxBlockBytes) finding("block_bytes", std::to_string(B));
  std::set<std::string> names;
  for (const auto& f : m.files) {
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.' || !names.insert(f.name).second)
      finding("file name", f.name);
    if (f.rank < 0 || f.rank >= m.world_size) finding("file rank", std::to_string(f.rank));
  }
  names.clear();
  std::vector<std::vector<std::pair<u128, u128>>> extents(m.files.size());
  for (const auto& p : m.params) {
    if (!names.insert(p.name).second) finding("param name twice", p.name);
    u128 n = 1;
    for (int64_t d : p.shape) {
      if (d < 0) finding("negative dim", p.name);
      n *= static_cast<uint64_t>(d);
      if (n > UINT64_MAX) finding("shape overflows", p.name);
    }
    if (n != p.numel) finding("numel against shape", p.name);
    if (p.numel > 0 && !p.states.count("param")) finding("no param state", p.name);
    for (const auto& [state, chunks] : p.states) {
      if (chunks.empty()) finding("state without chunks", p.name + "." + state);
      u128 next = 0;
      for (const Chunk& c : chunks) {
        if (c.dtype != chunks.front().dtype) finding("mixed dtypes", p.name + "." + state);
        if (c.file < 0 || static_cast<size_t>(c.file) >= m.files.size()) finding("file index", c.key);
        if (c.numel == 0 || c.offset != next) finding("chunk offsets", c.key);
        next += c.numel;
        const u128 bytes = static_cast<u128>(c.numel) * zs::dtype_size(c.dtype);
        if (bytes != c.bytes()) finding("chunk bytes overflow", c.key);
        if ((bytes + B - 1) / B != c.blocks.size()) finding("block count", c.key);
        const u128 end = c.begin + bytes;
        if (end > m.files[static_cast<size_t>(c.file)].bytes) finding("chunk past its file", c.key);
        extents[static_cast<size_t>(c.file)].push_back({c.begin, end});
      }
      if (next != p.numel) finding("chunks do not cover the param", p.name + "." + state);
    }
  }
  for (auto& e : extents) {
    std::sort(e.begin(), e.end());
    for (size_t k = 1; k < e.size(); ++k)
      if (e[k].first < e[k - 1].second) finding("overlapping chunks", "");
  }
}

// A directory for the files a manifest names, made once per process.
const std::string& scratch_dir() {
  static char path[] = "/tmp/zs-fuzz-manifest-XXXXXX";
  static const std::string dir = [] {
    if (mkdtemp(path) == nullptr) finding("mkdtemp", "");
    // Empty between inputs (their files are unlinked), so rmdir suffices;
    // path, unlike dir, outlives the atexit handlers.
    std::atexit([] { ::rmdir(path); });
    return std::string(path);
  }();
  return dir;
}

// Sparse files of the declared sizes (small ones only: the disk is real),
// then every chunk read whole and in part.
void read_chunks(const Manifest& m) {
  for (const auto& f : m.files)
    if (f.bytes > (64u << 10)) return;
  const std::string& dir = scratch_dir();
  std::vector<std::string> made;
  for (const auto& f : m.files) {
    const std::string path = zs::ckpt::join(dir, f.name);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) continue;  // a name the file system refuses: the reader says so
    made.push_back(path);
    if (::ftruncate(fd, static_cast<off_t>(f.bytes)) != 0) finding("ftruncate", path);
    ::close(fd);
  }
  try {
    zs::ckpt::ChunkReader reader(dir, m);
    reader.check_sizes();
    std::vector<char> buf;
    for (const auto& p : m.params)
      for (const auto& [state, chunks] : p.states)
        for (const Chunk& c : chunks) {
          buf.assign(c.bytes(), 0);
          const uint64_t mid = c.offset + c.numel / 2;
          for (auto [first, n] : {std::pair{c.offset, c.numel}, std::pair{mid, c.offset + c.numel - mid}}) {
            try {
              reader.read(c, first, n, buf.data(), p.name);
            } catch (const zs::Error& e) {
              expect_io(e, "ChunkReader::read");
            }
          }
        }
  } catch (const zs::Error& e) {
    expect_io(e, "ChunkReader");
  }
  for (const auto& path : made) ::unlink(path.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Manifest m;
  try {
    m = Manifest::parse(text, "fuzz manifest");
  } catch (const zs::Error& e) {
    expect_io(e, "Manifest::parse");
    if (std::getenv("ZS_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "refused: %s\n", e.what());
    return 0;
  }
  check_sane(m);
  // What a save writes from it must read back as the same manifest.
  const std::string again_text = m.to_json().dump(1);
  Manifest again;
  try {
    again = Manifest::parse(again_text, "the re-written manifest");
  } catch (const zs::Error& e) {
    finding("a parsed manifest does not parse again", e.what());
  }
  if (again.to_json().dump(1) != again_text) finding("a manifest changes on a second parse", again_text);
  read_chunks(m);
  return 0;
}
