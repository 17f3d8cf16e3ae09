// libFuzzer target: the TCP store server's handling of the bytes a peer
// sends (impl/comm/store/store_protocol.h), as Server::process and Server::handle
// use it: the input is a byte stream cut into frames by next_frame, each
// body decoded by decode_request, and what decodes applied to a key-value
// map as the server does (ADD parses the stored counter; SETS writes every
// pair; GETS, like WAIT, only reads).
//
// A finding is a crash, a sanitizer report, or a broken property: a body
// that decodes must be re-encoded by the client's encoder to exactly the
// same bytes (so server and client agree on the format), a decoded request
// respects the limits the server relies on, and the framing never reads past
// what arrived.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>

#include "impl/comm/store/store.h"
#include "impl/comm/store/store_protocol.h"

namespace {

namespace sp = zs::store_protocol;

[[noreturn]] void finding(const char* what, size_t offset) {
  std::fprintf(stderr, "store fuzz finding: %s (frame at byte %zu)\n", what, offset);
  std::abort();
}

void apply_request(const sp::Request& r, std::unordered_map<std::string, std::string>& data) {
  switch (r.cmd) {
    case sp::Cmd::Set:
      data.insert_or_assign(r.keys[0], r.value);
      break;
    case sp::Cmd::SetMany:
      for (size_t i = 0; i < r.keys.size(); ++i) data.insert_or_assign(r.keys[i], r.values[i]);
      break;
    case sp::Cmd::Add:
    case sp::Cmd::AddOnce: {  // (the server's once-record aside)
      int64_t value = 0;
      const auto it = data.find(r.keys[0]);
      if (it != data.end() && !zs::store_detail::parse_int64(it->second, &value)) break;
      if (__builtin_add_overflow(value, r.delta, &value)) break;
      data.insert_or_assign(r.keys[0], std::to_string(value));
      break;
    }
    case sp::Cmd::Get:
    case sp::Cmd::Wait:
    case sp::Cmd::GetMany:
    case sp::Cmd::Check:
      for (const std::string& k : r.keys) (void)data.count(k);
      break;
    case sp::Cmd::Hello:  // names the connection; no data
    case sp::Cmd::Auth:   // proves the job secret; no data
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  // A copy of exactly the input, so ASan sees any read past what arrived.
  std::unique_ptr<char[]> in(new char[size ? size : 1]);
  if (size) std::memcpy(in.get(), bytes, size);
  std::unordered_map<std::string, std::string> data;
  size_t pos = 0;
  sp::Request req;
  while (pos < size) {
    size_t len = 0;
    const sp::Frame frame = sp::next_frame(in.get() + pos, size - pos, &len);
    if (frame != sp::Frame::Ready) break;  // Bad: the server drops the client
    if (len == 0 || len > sp::kMaxRequestBytes || len > size - pos - 4) {
      finding("next_frame returned a body outside what arrived", pos);
    }
    const char* body = in.get() + pos + 4;
    if (sp::decode_request(body, len, &req)) {
      const size_t keys = req.keys.size();
      const bool keys_ok = req.cmd == sp::Cmd::Hello  ? keys == 0 && req.who.size() <= sp::kMaxClientName
                           : req.cmd == sp::Cmd::Auth ? keys == 0 && req.value.size() == sp::kAuthProofBytes
                           : req.cmd == sp::Cmd::Wait || req.cmd == sp::Cmd::GetMany ? keys <= sp::kMaxWaitKeys
                           : req.cmd == sp::Cmd::SetMany ? keys <= sp::kMaxWaitKeys && req.values.size() == keys
                                                         : keys == 1;
      if (!keys_ok) finding("decoded request has a wrong number of keys", pos);
      for (const std::string& k : req.keys) {
        if (k.size() > zs::Store::kMaxKeyBytes) finding("decoded key over the limit", pos);
      }
      if (req.value.size() > zs::Store::kMaxValueBytes) finding("decoded value over the limit", pos);
      for (const std::string& v : req.values) {
        if (v.size() > zs::Store::kMaxValueBytes) finding("decoded value over the limit", pos);
      }
      if (req.cmd != sp::Cmd::SetMany && !req.values.empty())
        finding("values on a request other than SETS", pos);
      if (req.cmd != sp::Cmd::Set && req.cmd != sp::Cmd::Auth && !req.value.empty())
        finding("value on a request other than SET and AUTH", pos);
      const std::string again = sp::encode_request(req);
      if (again.size() != len || std::memcmp(again.data(), body, len) != 0) {
        finding("decoded request does not re-encode to the same bytes", pos);
      }
      apply_request(req, data);
    }
    pos += 4 + len;
  }
  return 0;
}
