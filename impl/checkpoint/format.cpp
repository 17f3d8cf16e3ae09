#include "impl/checkpoint/format.h"

#include <cstdio>

#include "impl/checkpoint/file_io.h"
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
          {"params", params_j},       {"user", user}};
}

Manifest Manifest::from_json(const json& j, const std::string& where) {
  Manifest m;
  std::string at = "";  // the field being read, for messages
  try {
    at = "format";
    if (j.at("format").get<std::string>() != kFormatName)
      fail(Code::Io, where, ": format '", j.at("format").get<std::string>(), "': expected '",
           kFormatName, "'");
    at = "format_version";
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version != kFormatVersion)
      fail(Code::Io, where, ": format_version ", m.format_version, ": this engine reads ", kFormatVersion);
    at = "engine_version";
    m.engine_version = j.at("engine_version").get<std::string>();
    at = "tag";
    m.tag = j.at("tag").get<std::string>();
    at = "world_size";
    m.world_size = j.at("world_size").get<int>();
    if (m.world_size < 1) fail(Code::Io, where, ": world_size ", m.world_size, ": expected >= 1");
    at = "topology";
    m.topology = j.at("topology");
    at = "step";
    m.step = j.at("step").get<int64_t>();
    at = "block_bytes";
    m.block_bytes = j.at("block_bytes").get<uint64_t>();
    if (m.block_bytes == 0) fail(Code::Io, where, ": block_bytes is 0");
    at = "optimizer";
    m.optimizer = j.at("optimizer");
    at = "user";
    m.user = j.at("user");
    const auto& files = j.at("files");
    for (size_t i = 0; i < files.size(); ++i) {
      at = "files[" + std::to_string(i) + "]";
      const auto& f = files.at(i);
      FileEntry e;
      e.name = f.at("name").get<std::string>();
      if (e.name.empty() || e.name.find('/') != std::string::npos || e.name[0] == '.')
        fail(Code::Io, where, ": ", at, ".name '", e.name, "' is not a plain file name");
      e.rank = f.at("rank").get<int>();
      e.bytes = f.at("bytes").get<uint64_t>();
      e.xxh3 = parse_hex64(f.at("xxh3").get<std::string>(), where + ": " + at + ".xxh3");
      m.files.push_back(std::move(e));
    }
    const auto& params = j.at("params");
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& pj = params.at(i);
      at = "params[" + std::to_string(i) + "]";
      ParamEntry p;
      p.name = pj.at("name").get<std::string>();
      at += " ('" + p.name + "')";
      p.dtype = parse_st_dtype(pj.at("dtype").get<std::string>(), where + ": " + at);
      p.shape = pj.at("shape").get<std::vector<int64_t>>();
      p.numel = pj.at("numel").get<uint64_t>();
      uint64_t n = 1;
      for (int64_t d : p.shape) {
        if (d < 0) fail(Code::Io, where, ": ", at, ": negative dim ", d);
        n *= static_cast<uint64_t>(d);
      }
      if (n != p.numel) fail(Code::Io, where, ": ", at, ": numel ", p.numel, " does not match its shape");
      for (const auto& [state, cj] : pj.at("states").items()) {
        const std::string sat = where + ": " + at + ".states." + state;
        std::vector<Chunk> chunks;
        uint64_t next = 0;
        for (size_t k = 0; k < cj.size(); ++k) {
          const auto& c = cj.at(k);
          Chunk ch;
          ch.file = c.at("file").get<int>();
          ch.key = c.at("key").get<std::string>();
          ch.dtype = parse_st_dtype(c.at("dtype").get<std::string>(), sat);
          ch.offset = c.at("offset").get<uint64_t>();
          ch.numel = c.at("numel").get<uint64_t>();
          ch.begin = c.at("begin").get<uint64_t>();
          ch.xxh3 = parse_hex64(c.at("xxh3").get<std::string>(), sat);
          for (const auto& b : c.at("blocks")) ch.blocks.push_back(parse_hex64(b.get<std::string>(), sat));
          if (ch.file < 0 || ch.file >= static_cast<int>(m.files.size()))
            fail(Code::Io, sat, "[", k, "]: file index ", ch.file, " out of range (", m.files.size(), " files)");
          if (ch.offset != next || ch.numel == 0)
            fail(Code::Io, sat, "[", k, "]: elements [", ch.offset, ", ", ch.offset + ch.numel,
                 ") do not continue the previous chunk at ", next);
          if ((ch.bytes() + m.block_bytes - 1) / m.block_bytes != ch.blocks.size())
            fail(Code::Io, sat, "[", k, "]: ", ch.blocks.size(), " block checksums for ", ch.bytes(), " bytes");
          if (ch.begin + ch.bytes() > m.files[static_cast<size_t>(ch.file)].bytes)
            fail(Code::Io, sat, "[", k, "]: bytes [", ch.begin, ", ", ch.begin + ch.bytes(),
                 ") lie past the end of '", m.files[static_cast<size_t>(ch.file)].name, "'");
          next += ch.numel;
          chunks.push_back(std::move(ch));
        }
        if (next != p.numel) fail(Code::Io, sat, ": chunks cover ", next, " of ", p.numel, " elements");
        p.states[state] = std::move(chunks);
      }
      if (p.numel > 0 && !p.states.count("param")) fail(Code::Io, where, ": ", at, " has no 'param' state");
      m.params.push_back(std::move(p));
    }
  } catch (const json::exception& e) {
    fail(Code::Io, where, ": field ", at, ": ", e.what());
  }
  return m;
}

Manifest Manifest::read(const std::string& dir) {
  const std::string path = join(dir, kManifest);
  const std::string text = read_text(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(Code::Io, "checkpoint manifest '", path, "' is not valid JSON: ", e.what());
  }
  return from_json(j, "checkpoint manifest '" + path + "'");
}

const ParamEntry* Manifest::find(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

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
  return d;
}

}  // namespace zs::ckpt
