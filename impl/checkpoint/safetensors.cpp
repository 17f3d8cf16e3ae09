#include "impl/checkpoint/safetensors.h"

#include <algorithm>
#include <tuple>

#include <nlohmann/json.hpp>

#include "impl/checkpoint/format.h"
#include "impl/checkpoint/json_text.h"
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
  const std::string in = "file '" + f.path() + "'";
  unsigned char len[8];
  f.pread_all(len, 8, 0, "the safetensors header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > size - 8 || n > (100u << 20))
    fail(Code::Io, in, ": safetensors header length ", n, " does not fit the file (", size, " bytes)");
  std::string text(n, '\0');
  f.pread_all(text.data(), n, 8, "the safetensors header");
  StHeader h;
  h.data_begin = 8 + n;
  const uint64_t data_bytes = size - h.data_begin;
  // The header is {name: {dtype, shape, data_offsets}, __metadata__: {...}}.
  const json j = parse_json_text(text, in + ": safetensors header", 4);
  if (!j.is_object()) fail(Code::Io, in, ": safetensors header is a JSON ", j.type_name(), ", not an object");
  try {
    for (const auto& [key, v] : j.items()) {
      if (key == "__metadata__") {
        h.metadata = v.get<std::map<std::string, std::string>>();
        continue;
      }
      const std::string at = in + " tensor '" + key + "'";
      if (!v.is_object()) fail(Code::Io, at, ": expected an object, not a JSON ", v.type_name());
      StTensor t;
      t.key = key;
      t.dtype = parse_st_dtype(v.at("dtype").get<std::string>(), at);
      const auto& shape = v.at("shape");
      if (!shape.is_array()) fail(Code::Io, at, ": shape is a JSON ", shape.type_name(), ", not an array");
      uint64_t numel = 1;
      for (size_t d = 0; d < shape.size(); ++d) {
        t.shape.push_back(json_int(shape[d], at + " shape[" + std::to_string(d) + "]", 0, INT64_MAX));
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(t.shape.back()), &numel))
          fail(Code::Io, at, ": its shape has more than 2^64 elements");
      }
      const auto& off = v.at("data_offsets");
      if (!off.is_array() || off.size() != 2)
        fail(Code::Io, at, ": data_offsets ", off.dump().substr(0, 60), ": expected [begin, end]");
      const uint64_t lo = json_uint(off[0], at + " data_offsets[0]");
      const uint64_t hi = json_uint(off[1], at + " data_offsets[1]");
      if (hi < lo) fail(Code::Io, at, ": data_offsets [", lo, ", ", hi, ") end before they begin");
      if (hi > data_bytes) {
        if (hi <= UINT64_MAX - h.data_begin)
          fail(Code::Io, in, " is truncated: tensor '", key, "' needs bytes up to ", h.data_begin + hi,
               ", the file has ", size);
        fail(Code::Io, at, ": data_offsets [", lo, ", ", hi, ") lie past any file");
      }
      t.bytes = hi - lo;
      uint64_t want = 0;
      if (__builtin_mul_overflow(numel, dtype_size(t.dtype), &want) || want != t.bytes)
        fail(Code::Io, at, ": ", t.bytes, " bytes for ", numel, " elements of ", st_dtype(t.dtype));
      t.begin = h.data_begin + lo;  // within the file: hi <= data_bytes
      h.tensors.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    fail(Code::Io, in, ": safetensors header: ", e.what());
  }
  // By start, and at one start an empty tensor before the one that fills
  // it (both lie there in a file without gaps; ordered by start alone the
  // order of a tie followed the header's keys, and a valid file whose empty
  // tensor came second was refused), then by key so the order is the file's.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const StTensor& a, const StTensor& b) {
    return std::tie(a.begin, a.bytes, a.key) < std::tie(b.begin, b.bytes, b.key);
  });
  uint64_t at = h.data_begin;
  for (const auto& t : h.tensors) {
    if (t.begin != at)
      fail(Code::Io, in, " tensor '", t.key, "' starts at byte ", t.begin, ", expected ", at,
           " (safetensors data has no gaps)");
    at += t.bytes;
  }
  if (at != size)
    fail(Code::Io, in, " is ", size, " bytes, its tensors end at ", at, " (trailing bytes)");
  return h;
}

void read_st_elements(const File& f, const StTensor& t, uint64_t first, uint64_t n, void* dst,
                      const std::string& name) {
  if (n == 0) return;  // a rank whose shard holds none of the tensor: its offset may lie past it
  const uint64_t esz = dtype_size(t.dtype);
  const uint64_t numel = t.bytes / esz;
  if (first > numel || n > numel - first)
    fail(Code::Io, "file '", f.path(), "' tensor '", name, "': elements [", first, ", ", first, " + ", n,
         ") lie past its ", numel);
  f.pread_all(dst, n * esz, t.begin + first * esz, "tensor '" + name + "'");
}

}  // namespace zs::ckpt
