// The checkpoint format (README, "Checkpoints"): a directory holding
// manifest.json and one safetensors file per saving rank. The manifest
// names every param (global shape, dtype) and, for each of its states
// (param, master, exp_avg, exp_avg_sq, momentum), the chunks that hold it:
// which file, which element range of the flat param, where the bytes lie,
// and their xxHash (XXH3-64) checksums, whole and per block_bytes block, so
// a reader of any sub-range verifies just the blocks it reads.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/reshard_plan.h"
#include "impl/common/dtype.h"

namespace zs::ckpt {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kFormatName = "zeroshard-checkpoint";
inline constexpr const char* kManifest = "manifest.json";
inline constexpr const char* kLatest = "latest";
// Checksum block: a reader verifies whole blocks, so it reads at most two
// partial blocks more than it needs per chunk.
inline constexpr uint64_t kBlockBytes = 1u << 20;
// What a manifest may say instead (a power of two up to this).
inline constexpr uint64_t kMaxBlockBytes = 8u << 20;
// topology, optimizer and user are copied and dumped recursively.
inline constexpr int kMaxManifestDepth = 64;

// Safetensors dtype names ("F32", "BF16", "F16").
const char* st_dtype(DType t);
DType parse_st_dtype(const std::string& s, const std::string& where);

std::string hex64(uint64_t v);
uint64_t parse_hex64(const std::string& s, const std::string& where);

// One rank's piece of one state of one param.
struct Chunk {
  int file = 0;          // index into Manifest::files
  std::string key;       // tensor name inside that file
  DType dtype = DType::F32;
  uint64_t offset = 0;   // first element within the flat param
  uint64_t numel = 0;
  uint64_t begin = 0;    // absolute byte offset in the file
  uint64_t xxh3 = 0;     // of all numel * dtype bytes
  std::vector<uint64_t> blocks;  // of each kBlockBytes piece from begin
  uint64_t bytes() const { return numel * dtype_size(dtype); }
};

// The elements each chunk of a state holds (reshard_plan.h's overlaps).
std::vector<Span> spans_of(const std::vector<Chunk>& chunks);

struct ParamEntry {
  std::string name;
  DType dtype = DType::F32;  // the working dtype when saved
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  // state name -> chunks in offset order, covering [0, numel) exactly.
  std::map<std::string, std::vector<Chunk>> states;
};

struct FileEntry {
  std::string name;  // relative to the checkpoint directory
  int rank = 0;
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;  // of the whole file
};

struct Manifest {
  int format_version = kFormatVersion;
  std::string engine_version;
  std::string tag;
  int world_size = 0;
  nlohmann::json topology = nlohmann::json::object();
  int64_t step = 0;
  // null when saved without an optimizer; else {kind, steps, groups:
  // [{hparams, params: [names]}], loss_scaler: {...}}.
  nlohmann::json optimizer;
  std::vector<ParamEntry> params;
  std::vector<FileEntry> files;
  uint64_t block_bytes = kBlockBytes;
  nlohmann::json user = nlohmann::json::object();
  // The save was to move dir/latest to it (SaveOptions::update_latest):
  // one committed after dir/latest was last written is the resume point
  // (resolve_checkpoint_dir). Absent (false) in older manifests.
  bool moves_latest = false;

  nlohmann::json to_json() const;
  // Checks every field and the consistency of chunks (Code::Io naming the
  // manifest's path and the field).
  static Manifest from_json(const nlohmann::json& j, const std::string& where);
  // The text of a manifest.json (where names it in messages): JSON with no
  // duplicate keys, nested at most kMaxManifestDepth, then from_json.
  static Manifest parse(const std::string& text, const std::string& where);
  // dir/manifest.json through parse.
  static Manifest read(const std::string& dir);
  const ParamEntry* find(const std::string& name) const;
};

// Which checkpoint directory `path` names: itself when it holds a
// manifest, else path/tag, else path/<contents of path/latest>, unless a
// checkpoint whose save was to move `latest` was committed after `latest`
// was last written (the save was cut off between its commit and `latest`):
// then the newest such one, said on stderr. So "load latest, train, save
// every step" resumes from the last committed step, and its next save's
// tag is new, whenever the job was killed.
std::string resolve_checkpoint_dir(const std::string& path, const std::string& tag);

// "rank-00001-of-00004.safetensors"
std::string rank_file_name(int rank, int world);

}  // namespace zs::ckpt
