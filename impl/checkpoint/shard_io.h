// Moving chunk bytes between engine memory and checkpoint files, with the
// checksums computed on the way out and verified on the way in.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "impl/checkpoint/direct_io.h"
#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/format.h"
#include "impl/device/device.h"

namespace zs::ckpt {

// Bytes done, bytes in all; called between pieces.
using Progress = std::function<void(uint64_t done, uint64_t total)>;

// One tensor of a rank file: numel elements at data (memory of device).
struct ShardSource {
  std::string key;
  DType dtype = DType::F32;
  uint64_t numel = 0;
  const void* data = nullptr;
  Chunk* out = nullptr;  // receives begin, xxh3, blocks
  // Instead of data: called when the source is written, its result kept
  // alive until then (a param shard offloaded to NVMe is read back only for
  // its turn, so a save never holds every shard in memory at once).
  std::function<std::shared_ptr<const void>()> open;
};

// Writes a safetensors file of the sources (copying device memory into the
// writer's buffers, hashing on the way; O_DIRECT where the filesystem
// allows) and fsyncs it. Returns its size and
// whole-file checksum.
FileEntry write_shard_file(const std::string& path, std::vector<ShardSource>& sources,
                           Device& device, const std::map<std::string, std::string>& metadata,
                           const Progress& progress);

// Reads element ranges of a checkpoint's chunks, verifying every block it
// touches; files are opened once and kept. Where dst lies at the same
// offset within a 4 KiB page as the bytes within the file (see
// direct_offset), the bulk is read with O_DIRECT: no kernel copy, no page
// cache; otherwise, or where the filesystem refuses, buffered.
class ChunkReader {
 public:
  ChunkReader(std::string dir, const Manifest& m) : dir_(std::move(dir)), m_(m) {}
  // Elements [first, first + n) of the chunk (relative to the flat param)
  // into dst, in the chunk's dtype. `what` names param and state.
  void read(const Chunk& c, uint64_t first, uint64_t n, void* dst, const std::string& what);
  // Where element `first` of the chunk lies within a kIoAlign page of
  // its file: a dst at that offset from an aligned address reads direct.
  static uint64_t direct_offset(const Chunk& c, uint64_t first) {
    return (c.begin + (first - c.offset) * dtype_size(c.dtype)) % kIoAlign;
  }
  // Every file exists and has the size the manifest says (a truncated one
  // is named with the first tensor it cuts).
  void check_sizes();
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t direct_bytes_read() const { return direct_bytes_read_; }  // of bytes_read()

 private:
  File& file(int index);
  DirectReadFile& direct_file(int index);
  // Bytes [lo, hi) of the chunk into dst, direct where alignment allows.
  void read_bytes(const Chunk& c, uint64_t lo, uint64_t hi, char* dst, const std::string& what);
  const std::string dir_;
  const Manifest& m_;
  std::map<int, File> files_;
  std::map<int, DirectReadFile> direct_;
  std::vector<char> scratch_;
  uint64_t bytes_read_ = 0, direct_bytes_read_ = 0;
};

}  // namespace zs::ckpt
