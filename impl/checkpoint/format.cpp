#include "impl/checkpoint/format.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/json_text.h"
#include "impl/common/error.h"

namespace zs::ckpt {

using nlohmann::json;

const char* st_dtype(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::U8: return "U8";
  }
  return "?";
}

DType parse_st_dtype(const std::string& s, const std::string& where) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  fail(Code::Io, where, ": dtype '", s, "': expected F32, BF16 or F16");
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t parse_hex64(const std::string& s, const std::string& where) {
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    fail(Code::Io, where, ": '", s, "' is not a 16-digit hex checksum");
  return std::stoull(s, nullptr, 16);
}

std::string rank_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "rank-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

json Manifest::to_json() const {
  json params_j = json::array();
  for (const auto& p : params) {
    json states = json::object();
    for (const auto& [state, chunks] : p.states) {
      json cj = json::array();
      for (const auto& c : chunks) {
        json blocks = json::array();
        for (uint64_t b : c.blocks) blocks.push_back(hex64(b));
        cj.push_back({{"file", c.file}, {"key", c.key}, {"dtype", st_dtype(c.dtype)},
                      {"offset", c.offset}, {"numel", c.numel}, {"begin", c.begin},
                      {"xxh3", hex64(c.xxh3)}, {"blocks", blocks}});
      }
      states[state] = cj;
    }
    params_j.push_back({{"name", p.name}, {"dtype", st_dtype(p.dtype)}, {"shape", p.shape},
                        {"numel", p.numel}, {"states", states}});
  }
  json files_j = json::array();
  for (const auto& f : files)
    files_j.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"xxh3", hex64(f.xxh3)}});
  return {{"format", kFormatName},   {"format_version", format_version},
          {"engine_version", engine_version}, {"tag", tag},
          {"world_size", world_size}, {"topology", topology},
          {"step", step},             {"block_bytes", block_bytes},
          {"optimizer", optimizer},   {"files", files_j},
          {"params", params_j},       {"user", user},
          {"moves_latest", moves_latest}};
}

namespace {

// a * b, or Code::Io naming what when it does not fit 64 bits.
uint64_t mul_checked(uint64_t a, uint64_t b, const std::string& what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail(Code::Io, what, ": ", a, " * ", b, " overflows 64 bits");
  return r;
}

uint64_t add_checked(uint64_t a, uint64_t b, const std::string& what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail(Code::Io, what, ": ", a, " + ", b, " overflows 64 bits");
  return r;
}

// Where a chunk's bytes lie, to find two that overlap in one file.
struct Extent {
  uint64_t begin, end;
  std::string what;
};

}  // namespace

Manifest Manifest::from_json(const json& j, const std::string& where) {
  Manifest m;
  std::string at = "";  // the field being read, for messages
  // The field at `at`.key, for messages of the strict number readers.
  auto field = [&](const std::string& key) { return where + ": " + (at.empty() ? "" : at + ".") + key; };
  try {
    if (!j.is_object()) fail(Code::Io, where, ": expected a JSON object, not ", j.type_name());
    at = "format";
    if (j.at("format").get<std::string>() != kFormatName)
      fail(Code::Io, where, ": format '", j.at("format").get<std::string>(), "': expected '",
           kFormatName, "'");
    at = "";
    m.format_version = static_cast<int>(json_int(j.at("format_version"), field("format_version"), INT32_MIN, INT32_MAX));
    if (m.format_version != kFormatVersion)
      fail(Code::Io, where, ": format_version ", m.format_version, ": this engine reads ", kFormatVersion);
    at = "engine_version";
    m.engine_version = j.at("engine_version").get<std::string>();
    at = "tag";
    m.tag = j.at("tag").get<std::string>();
    at = "";
    m.world_size = static_cast<int>(json_int(j.at("world_size"), field("world_size"), 1, INT32_MAX));
    at = "topology";
    m.topology = j.at("topology");
    at = "";
    m.step = json_int(j.at("step"), field("step"), INT64_MIN, INT64_MAX);
    m.block_bytes = json_uint(j.at("block_bytes"), field("block_bytes"));
    // Readers verify whole blocks held in memory, and verify() hashes
    // blocks within its 8 MiB pieces, so a block must divide a piece.
    if (m.block_bytes == 0 || (m.block_bytes & (m.block_bytes - 1)) != 0 || m.block_bytes > kMaxBlockBytes)
      fail(Code::Io, where, ": block_bytes ", m.block_bytes, ": expected a power of two up to ", kMaxBlockBytes);
    at = "optimizer";
    m.optimizer = j.at("optimizer");
    at = "user";
    m.user = j.at("user");
    at = "moves_latest";
    m.moves_latest = j.contains("moves_latest") && j.at("moves_latest").get<bool>();
    at = "files";
    const auto& files = j.at("files");
    if (!files.is_array()) fail(Code::Io, where, ": files is a JSON ", files.type_name(), ", not an array");
    std::map<std::string, size_t> file_names;
    for (size_t i = 0; i < files.size(); ++i) {
      at = "files[" + std::to_string(i) + "]";
      const auto& f = files.at(i);
      FileEntry e;
      e.name = f.at("name").get<std::string>();
      if (e.name.empty() || e.name.find('/') != std::string::npos || e.name[0] == '.')
        fail(Code::Io, where, ": ", at, ".name '", e.name, "' is not a plain file name");
      if (!file_names.emplace(e.name, i).second)
        fail(Code::Io, where, ": ", at, ".name '", e.name, "' is also files[", file_names.at(e.name), "]");
      e.rank = static_cast<int>(json_int(f.at("rank"), field("rank"), 0, m.world_size - 1));
      e.bytes = json_uint(f.at("bytes"), field("bytes"));
      e.xxh3 = parse_hex64(f.at("xxh3").get<std::string>(), where + ": " + at + ".xxh3");
      m.files.push_back(std::move(e));
    }
    std::vector<std::vector<Extent>> extents(m.files.size());
    std::map<std::string, size_t> param_names;
    at = "params";
    const auto& params = j.at("params");
    if (!params.is_array()) fail(Code::Io, where, ": params is a JSON ", params.type_name(), ", not an array");
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& pj = params.at(i);
      at = "params[" + std::to_string(i) + "]";
      ParamEntry p;
      p.name = pj.at("name").get<std::string>();
      if (!param_names.emplace(p.name, i).second)
        fail(Code::Io, where, ": ", at, ": name '", p.name, "' is also params[", param_names.at(p.name), "]");
      at += " ('" + p.name + "')";
      p.dtype = parse_st_dtype(pj.at("dtype").get<std::string>(), where + ": " + at);
      const auto& shape = pj.at("shape");
      if (!shape.is_array()) fail(Code::Io, field("shape"), ": expected an array, not ", shape.dump());
      uint64_t n = 1;
      for (size_t d = 0; d < shape.size(); ++d) {
        const std::string dat = field("shape[" + std::to_string(d) + "]");
        p.shape.push_back(json_int(shape[d], dat, 0, INT64_MAX));
        n = mul_checked(n, static_cast<uint64_t>(p.shape.back()), dat);
      }
      p.numel = json_uint(pj.at("numel"), field("numel"));
      if (n != p.numel) fail(Code::Io, where, ": ", at, ": numel ", p.numel, " does not match its shape (", n, ")");
      (void)mul_checked(p.numel, dtype_size(DType::F32), field("numel"));  // its bytes in any dtype
      const auto& states = pj.at("states");
      if (!states.is_object()) fail(Code::Io, field("states"), ": expected an object, not ", states.dump());
      for (const auto& [state, cj] : states.items()) {
        const std::string sat = where + ": " + at + ".states." + state;
        if (!cj.is_array() || cj.empty())
          fail(Code::Io, sat, ": expected a non-empty array of chunks, not ", cj.dump().substr(0, 60));
        std::vector<Chunk> chunks;
        uint64_t next = 0;
        for (size_t k = 0; k < cj.size(); ++k) {
          const auto& c = cj.at(k);
          const std::string kat = sat + "[" + std::to_string(k) + "]";
          Chunk ch;
          ch.file = static_cast<int>(json_int(c.at("file"), kat + ".file", INT32_MIN, INT32_MAX));
          ch.key = c.at("key").get<std::string>();
          ch.dtype = parse_st_dtype(c.at("dtype").get<std::string>(), kat);
          // One dtype per state: readers size a state's buffers by its
          // first chunk.
          if (k > 0 && ch.dtype != chunks.front().dtype)
            fail(Code::Io, kat, ": dtype ", st_dtype(ch.dtype), ", the state's first chunk is ",
                 st_dtype(chunks.front().dtype));
          ch.offset = json_uint(c.at("offset"), kat + ".offset");
          ch.numel = json_uint(c.at("numel"), kat + ".numel");
          ch.begin = json_uint(c.at("begin"), kat + ".begin");
          ch.xxh3 = parse_hex64(c.at("xxh3").get<std::string>(), kat + ".xxh3");
          const auto& blocks = c.at("blocks");
          if (!blocks.is_array()) fail(Code::Io, kat, ".blocks: expected an array, not ", blocks.dump().substr(0, 60));
          for (const auto& b : blocks) ch.blocks.push_back(parse_hex64(b.get<std::string>(), kat + ".blocks"));
          if (ch.file < 0 || ch.file >= static_cast<int>(m.files.size()))
            fail(Code::Io, kat, ": file index ", ch.file, " out of range (", m.files.size(), " files)");
          if (ch.offset != next || ch.numel == 0 || ch.numel > p.numel - next)
            fail(Code::Io, kat, ": elements [", ch.offset, ", ", ch.offset, " + ", ch.numel,
                 ") do not continue the previous chunk at ", next, " within the param's ", p.numel);
          const uint64_t bytes = ch.bytes();  // cannot overflow: numel <= p.numel, checked above
          if (bytes / m.block_bytes + (bytes % m.block_bytes != 0) != ch.blocks.size())
            fail(Code::Io, kat, ": ", ch.blocks.size(), " block checksums for ", bytes, " bytes (blocks of ",
                 m.block_bytes, ")");
          const FileEntry& fe = m.files[static_cast<size_t>(ch.file)];
          const uint64_t end = add_checked(ch.begin, bytes, kat + ": begin + bytes");
          if (end > fe.bytes)
            fail(Code::Io, kat, ": bytes [", ch.begin, ", ", end, ") lie past the end of '", fe.name, "' (",
                 fe.bytes, " bytes)");
          extents[static_cast<size_t>(ch.file)].push_back({ch.begin, end, kat});
          next += ch.numel;
          chunks.push_back(std::move(ch));
        }
        if (next != p.numel) fail(Code::Io, sat, ": chunks cover ", next, " of ", p.numel, " elements");
        p.states[state] = std::move(chunks);
      }
      if (p.numel > 0 && !p.states.count("param")) fail(Code::Io, where, ": ", at, " has no 'param' state");
      m.params.push_back(std::move(p));
    }
    // Two chunks over the same bytes would be two states sharing storage.
    for (size_t i = 0; i < extents.size(); ++i) {
      auto& e = extents[i];
      std::sort(e.begin(), e.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
      for (size_t k = 1; k < e.size(); ++k)
        if (e[k].begin < e[k - 1].end)
          fail(Code::Io, e[k].what, ": bytes [", e[k].begin, ", ", e[k].end, ") of '", m.files[i].name,
               "' overlap those of ", e[k - 1].what, " [", e[k - 1].begin, ", ", e[k - 1].end, ")");
    }
  } catch (const json::exception& e) {
    fail(Code::Io, where, ": field ", at, ": ", e.what());
  }
  return m;
}

Manifest Manifest::parse(const std::string& text, const std::string& where) {
  return from_json(parse_json_text(text, where, kMaxManifestDepth), where);
}

Manifest Manifest::read(const std::string& dir) {
  const std::string path = join(dir, kManifest);
  return parse(read_text(path), "checkpoint manifest '" + path + "'");
}

const ParamEntry* Manifest::find(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

namespace {

// The newest checkpoint in dir (not `current`) whose save was to move
// `latest` and whose manifest was written after `latest` was: "" if none.
// Partial saves (".<tag>.partial") and unreadable manifests do not count.
std::string committed_after_latest(const std::string& dir, const std::string& current) {
  const int64_t latest_time = mtime_ns(join(dir, kLatest));
  std::string best;
  int64_t best_time = latest_time;
  for (const std::string& name : list_dir(dir)) {
    if (name.empty() || name[0] == '.' || name == current || name == kLatest) continue;
    const std::string manifest = join(join(dir, name), kManifest);
    if (!exists(manifest)) continue;
    const int64_t t = mtime_ns(manifest);
    if (t <= best_time) continue;
    try {
      if (!Manifest::read(join(dir, name)).moves_latest) continue;
    } catch (const Error&) {
      continue;
    }
    best = name;
    best_time = t;
  }
  return best;
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& path, const std::string& tag) {
  if (path.empty()) fail(Code::InvalidArgument, "checkpoint path is empty");
  if (!tag.empty()) {
    const std::string d = join(path, tag);
    if (!exists(join(d, kManifest)))
      fail(Code::Io, "no checkpoint '", tag, "' in '", path, "' (", join(d, kManifest), " is missing)");
    return d;
  }
  if (exists(join(path, kManifest))) return path;
  const std::string latest = join(path, kLatest);
  if (!exists(latest))
    fail(Code::Io, "'", path, "' holds no checkpoint: neither ", kManifest, " nor ", kLatest, " is there");
  std::string t = read_text(latest);
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ' || t.back() == '\r')) t.pop_back();
  if (t.empty() || t.find('/') != std::string::npos)
    fail(Code::Io, "'", latest, "' names '", t, "', not a checkpoint tag");
  const std::string d = join(path, t);
  if (!exists(join(d, kManifest)))
    fail(Code::Io, "'", latest, "' names '", t, "', but ", join(d, kManifest), " is missing");
  const std::string newer = committed_after_latest(path, t);
  if (newer.empty()) return d;
  std::fprintf(stderr,
               "zeroshard: checkpoint '%s' in '%s' was committed after '%s' (naming '%s') was last "
               "written: its save was cut off before moving it; loading '%s'\n",
               newer.c_str(), path.c_str(), kLatest, t.c_str(), newer.c_str());
  return join(path, newer);
}

std::vector<Span> spans_of(const std::vector<Chunk>& chunks) {
  std::vector<Span> spans;
  spans.reserve(chunks.size());
  for (const Chunk& c : chunks) spans.push_back({c.offset, c.numel});
  return spans;
}

}  // namespace zs::ckpt
