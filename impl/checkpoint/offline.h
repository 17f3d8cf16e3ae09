// What needs no ranks and no engine: checking every checksum of a
// checkpoint, and streaming it out as one consolidated safetensors file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "impl/checkpoint/shard_io.h"

namespace zs::ckpt {

struct VerifyReport {
  std::string dir;
  uint64_t files = 0, tensors = 0, bytes = 0;
  std::vector<std::string> problems;  // each names the file and tensor
};

// Reads every byte of every file: whole-file, per-tensor and per-block
// checksums, and each file's safetensors header against the manifest.
VerifyReport verify(const std::string& path, const std::string& tag, const Progress& progress);

struct ExportOptions {
  bool fp32 = false;  // false: each param's working dtype
  Progress progress;
};

struct ExportReport {
  uint64_t tensors = 0, bytes = 0;
};

// One safetensors file of full tensors under their registration names
// (metadata format "pt", as Hugging Face expects), written to out + ".tmp",
// fsynced and renamed. Streams chunk pieces: memory is bounded by a buffer,
// not by the model or its largest tensor.
ExportReport export_consolidated(const std::string& path, const std::string& tag,
                                 const std::string& out, const ExportOptions& options);

// The checkpoint rewritten for another world size (one file per new rank,
// each holding that rank's shards as a run of that size would lay them
// out), as a new checkpoint directory out_dir, which must not exist yet.
// Memory: one new rank's shards at a time.
void reshard(const std::string& path, const std::string& tag, const std::string& out_dir,
             int world_size, const Progress& progress);

}  // namespace zs::ckpt
