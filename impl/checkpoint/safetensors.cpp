#include "impl/checkpoint/safetensors.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/format.h"
#include "impl/common/error.h"

namespace zs::ckpt {

using nlohmann::json;

std::string st_header(std::vector<StTensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const StTensor& a, const StTensor& b) {
    return dtype_size(a.dtype) > dtype_size(b.dtype);
  });
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t at = 0;
  for (auto& t : tensors) {
    h[t.key] = {{"dtype", st_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes}}};
    t.begin = at;
    at += t.bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  for (auto& t : tensors) t.begin += out.size();
  return out;
}

StHeader read_st_header(const File& f) {
  const uint64_t size = f.size();
  unsigned char len[8];
  f.pread_all(len, 8, 0, "the safetensors header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > size - 8 || n > (100u << 20))
    fail(Code::Io, "file '", f.path(), "': safetensors header length ", n, " does not fit the file (",
         size, " bytes)");
  std::string text(n, '\0');
  f.pread_all(text.data(), n, 8, "the safetensors header");
  StHeader h;
  h.data_begin = 8 + n;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(Code::Io, "file '", f.path(), "': safetensors header is not JSON: ", e.what());
  }
  try {
    for (const auto& [key, v] : j.items()) {
      if (key == "__metadata__") {
        h.metadata = v.get<std::map<std::string, std::string>>();
        continue;
      }
      StTensor t;
      t.key = key;
      t.dtype = parse_st_dtype(v.at("dtype").get<std::string>(), "file '" + f.path() + "' tensor '" + key + "'");
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[1] < off[0])
        fail(Code::Io, "file '", f.path(), "' tensor '", key, "': bad data_offsets");
      uint64_t numel = 1;
      for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
      t.bytes = off[1] - off[0];
      if (numel * dtype_size(t.dtype) != t.bytes)
        fail(Code::Io, "file '", f.path(), "' tensor '", key, "': ", t.bytes, " bytes for ", numel,
             " elements of ", st_dtype(t.dtype));
      t.begin = h.data_begin + off[0];
      h.tensors.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    fail(Code::Io, "file '", f.path(), "': safetensors header: ", e.what());
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const StTensor& a, const StTensor& b) { return a.begin < b.begin; });
  uint64_t at = h.data_begin;
  for (const auto& t : h.tensors) {
    if (t.begin != at)
      fail(Code::Io, "file '", f.path(), "' tensor '", t.key, "' starts at byte ", t.begin,
           ", expected ", at, " (safetensors data has no gaps)");
    at += t.bytes;
  }
  for (const auto& t : h.tensors)
    if (t.begin + t.bytes > size)
      fail(Code::Io, "file '", f.path(), "' is truncated: tensor '", t.key, "' needs bytes up to ",
           t.begin + t.bytes, ", the file has ", size);
  if (at != size)
    fail(Code::Io, "file '", f.path(), "' is ", size, " bytes, its tensors end at ", at, " (trailing bytes)");
  return h;
}

}  // namespace zs::ckpt
