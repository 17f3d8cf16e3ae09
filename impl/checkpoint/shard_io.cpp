#include "impl/checkpoint/shard_io.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "impl/checkpoint/direct_io.h"
#include "impl/checkpoint/safetensors.h"
#include "impl/common/error.h"

namespace zs::ckpt {
namespace {

// Pieces of this many bytes go through the staging buffer and into write();
// a multiple of the checksum block.
constexpr uint64_t kPieceBytes = 8 * kBlockBytes;

struct Xxh3 {
  XXH3_state_t* s = XXH3_createState();
  Xxh3() {
    if (s == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(s);
  }
  ~Xxh3() { XXH3_freeState(s); }
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void reset() { XXH3_64bits_reset(s); }
  void update(const void* p, size_t n) { XXH3_64bits_update(s, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};

}  // namespace

FileEntry write_shard_file(const std::string& path, std::vector<ShardSource>& sources,
                           Device& device, const std::map<std::string, std::string>& metadata,
                           const Progress& progress) {
  std::vector<StTensor> layout;
  uint64_t total = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& s = sources[i];
    layout.push_back({std::to_string(i), s.dtype, {static_cast<int64_t>(s.numel)},
                      s.numel * dtype_size(s.dtype), 0});
    total += s.numel * dtype_size(s.dtype);
  }
  // Keys are indices while laying out, so the order st_header picks maps
  // back to the sources.
  std::vector<StTensor> named = layout;
  for (auto& t : named) t.key = sources[std::stoul(t.key)].key;
  const std::string header = st_header(named, metadata);
  std::stable_sort(layout.begin(), layout.end(), [](const StTensor& a, const StTensor& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);
  });

  StreamWriter w(path);
  Xxh3 file_hash;
  w.append(header.data(), header.size());
  file_hash.update(header.data(), header.size());
  uint64_t done = 0, reported = 0;
  for (size_t k = 0; k < layout.size(); ++k) {
    ShardSource& s = sources[std::stoul(layout[k].key)];
    Chunk& c = *s.out;
    c.key = s.key;
    c.dtype = s.dtype;
    c.numel = s.numel;
    c.begin = named[k].begin;
    c.blocks.clear();
    Xxh3 tensor_hash, block_hash;
    const uint64_t bytes = s.numel * dtype_size(s.dtype);
    const std::shared_ptr<const void> opened = s.open ? s.open() : nullptr;
    const void* data = opened ? opened.get() : s.data;
    // Copied into the writer's buffer and hashed there, while the bytes
    // are in cache; a block may straddle two buffers.
    for (uint64_t at = 0; at < bytes;) {
      const uint64_t block_end = std::min((at / kBlockBytes + 1) * kBlockBytes, bytes);
      size_t n = 0;
      char* dst = w.reserve(static_cast<size_t>(block_end - at), &n);
      device.copy(dst, static_cast<const char*>(data) + at, n);
      if (device.is_cuda()) device.synchronize();
      block_hash.update(dst, n);
      tensor_hash.update(dst, n);
      file_hash.update(dst, n);
      w.commit(n);
      at += n;
      if (at == block_end) {
        c.blocks.push_back(block_hash.digest());
        block_hash.reset();
      }
      done += n;
      if (progress && (done - reported >= kPieceBytes || done == total)) {
        progress(done, total);
        reported = done;
      }
    }
    c.xxh3 = tensor_hash.digest();
  }
  w.finish();
  FileEntry e;
  e.bytes = header.size() + total;
  e.xxh3 = file_hash.digest();
  return e;
}

File& ChunkReader::file(int index) {
  auto it = files_.find(index);
  if (it != files_.end()) return it->second;
  const auto& fe = m_.files.at(static_cast<size_t>(index));
  return files_.emplace(index, File::open_read(join(dir_, fe.name))).first->second;
}

DirectReadFile& ChunkReader::direct_file(int index) {
  auto it = direct_.find(index);
  if (it != direct_.end()) return it->second;
  return direct_.emplace(index, DirectReadFile(file(index).path())).first->second;
}

void ChunkReader::read_bytes(const Chunk& c, uint64_t lo, uint64_t hi, char* dst, const std::string& what) {
  File& f = file(c.file);
  const uint64_t from = c.begin + lo, to = c.begin + hi;
  const std::string label = "tensor '" + c.key + "' (" + what + ")";
  DirectReadFile& d = direct_file(c.file);
  const uint64_t a_lo = align_up(from);
  const uint64_t a_hi = align_down(to);
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) - from) % kIoAlign == 0;
  if (d.ok() && aligned && a_lo < a_hi) {
    char* mid = dst + (a_lo - from);
    if (d.pread_all(mid, a_hi - a_lo, a_lo, label)) {
      if (from < a_lo) f.pread_all(dst, a_lo - from, from, label);
      if (a_hi < to) f.pread_all(dst + (a_hi - from), to - a_hi, a_hi, label);
      direct_bytes_read_ += a_hi - a_lo;
      return;
    }
  }
  f.pread_all(dst, hi - lo, from, label);
}

void ChunkReader::check_sizes() {
  for (size_t i = 0; i < m_.files.size(); ++i) {
    File& f = file(static_cast<int>(i));
    const uint64_t size = f.size();
    if (size == m_.files[i].bytes) continue;
    if (size > m_.files[i].bytes)
      fail(Code::Io, "checkpoint file '", f.path(), "' is ", size, " bytes, the manifest says ",
           m_.files[i].bytes);
    for (const auto& p : m_.params)
      for (const auto& [state, chunks] : p.states)
        for (const auto& c : chunks)
          if (c.file == static_cast<int>(i) && c.begin + c.bytes() > size)
            fail(Code::Io, "checkpoint file '", f.path(), "' is truncated: tensor '", c.key,
                 "' (param '", p.name, "', ", state, ") needs bytes up to ", c.begin + c.bytes(),
                 ", the file has ", size);
    fail(Code::Io, "checkpoint file '", f.path(), "' is truncated: ", size, " of ",
         m_.files[i].bytes, " bytes");
  }
}

void ChunkReader::read(const Chunk& c, uint64_t first, uint64_t n, void* dst, const std::string& what) {
  if (n == 0) return;
  const uint64_t esz = dtype_size(c.dtype);
  const uint64_t B = m_.block_bytes;
  const uint64_t want_lo = (first - c.offset) * esz, want_hi = want_lo + n * esz;
  File& f = file(c.file);
  char* out = static_cast<char*>(dst);
  // Verifies the blocks of bytes [lo, hi) of the chunk, held at p.
  auto verify = [&](const char* p, uint64_t lo, uint64_t hi) {
    for (uint64_t b = lo; b < hi; b += B) {
      const uint64_t bn = std::min(B, hi - b);
      const uint64_t got = XXH3_64bits(p + (b - lo), bn);
      const uint64_t want = c.blocks[b / B];
      if (got != want)
        fail(Code::Io, "checkpoint file '", f.path(), "': tensor '", c.key, "' (", what,
             ") fails its checksum in bytes [", c.begin + b, ", ", c.begin + b + bn,
             ") of the file: xxh3 ", hex64(got), ", the manifest says ", hex64(want));
    }
  };
  // Whole blocks inside the wanted range go straight into dst; the partial
  // blocks at either end go through scratch, read whole to be verified.
  const uint64_t inner_lo = std::min(((want_lo + B - 1) / B) * B, want_hi);
  const uint64_t inner_hi = std::max(inner_lo, want_hi == c.bytes() ? want_hi : (want_hi / B) * B);
  auto edge = [&](uint64_t lo, uint64_t hi) {  // [lo, hi) within one block, partly wanted
    const uint64_t blo = (lo / B) * B, bhi = std::min(blo + B, c.bytes());
    if (scratch_.size() < bhi - blo) scratch_.resize(bhi - blo);
    f.pread_all(scratch_.data(), bhi - blo, c.begin + blo, "tensor '" + c.key + "' (" + what + ")");
    bytes_read_ += bhi - blo;
    verify(scratch_.data(), blo, bhi);
    std::memcpy(out + (lo - want_lo), scratch_.data() + (lo - blo), hi - lo);
  };
  if (want_lo < inner_lo) edge(want_lo, inner_lo);
  for (uint64_t lo = inner_lo; lo < inner_hi; lo += kPieceBytes) {
    const uint64_t hi = std::min(lo + kPieceBytes, inner_hi);
    read_bytes(c, lo, hi, out + (lo - want_lo), what);
    bytes_read_ += hi - lo;
    verify(out + (lo - want_lo), lo, hi);
  }
  if (inner_hi < want_hi) edge(inner_hi, want_hi);
}

}  // namespace zs::ckpt
