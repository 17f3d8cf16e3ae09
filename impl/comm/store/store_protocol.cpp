#include "impl/comm/store/store_protocol.h"

namespace zs::store_protocol {
namespace {

// Bounds-checked reader over one request body.
class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  bool u8(uint8_t* v) {
    if (end_ - p_ < 1) return false;
    *v = static_cast<uint8_t>(*p_++);
    return true;
  }
  bool u32(uint32_t* v) {
    if (end_ - p_ < 4) return false;
    *v = static_cast<uint32_t>(load_le(p_, 4));
    p_ += 4;
    return true;
  }
  bool u64(uint64_t* v) {
    if (end_ - p_ < 8) return false;
    *v = load_le(p_, 8);
    p_ += 8;
    return true;
  }
  bool bytes(uint64_t n, std::string* out) {
    if (static_cast<uint64_t>(end_ - p_) < n) return false;
    out->assign(p_, static_cast<size_t>(n));
    p_ += n;
    return true;
  }
  bool key(std::string* out) {
    uint32_t n = 0;
    return u32(&n) && n <= Store::kMaxKeyBytes && bytes(n, out);
  }
  bool done() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
};

void put_key(std::string& b, const std::string& key) {
  put_u32(b, static_cast<uint32_t>(key.size()));
  b += key;
}

}  // namespace

void put_u32(std::string& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u64(std::string& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t load_le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

bool decode_request(const char* body, size_t n, Request* out) {
  Reader r(body, n);
  uint8_t cmd = 0;
  if (!r.u8(&cmd)) return false;
  out->keys.clear();
  out->values.clear();
  out->value.clear();
  out->who.clear();
  out->delta = 0;
  out->client = out->seq = 0;
  switch (static_cast<Cmd>(cmd)) {
    case Cmd::Hello: {
      out->cmd = Cmd::Hello;
      std::string magic;
      uint32_t len = 0;
      return r.bytes(kStoreMagicBytes, &magic) && magic == kStoreMagic && r.u32(&len) &&
             len <= kMaxClientName && r.bytes(len, &out->who) && r.done();
    }
    case Cmd::Auth: {
      out->cmd = Cmd::Auth;
      uint32_t len = 0;
      return r.u32(&len) && len == kAuthProofBytes && r.bytes(len, &out->value) && r.done();
    }
    case Cmd::Set: {
      out->cmd = Cmd::Set;
      out->keys.emplace_back();
      uint64_t len = 0;
      return r.key(&out->keys[0]) && r.u64(&len) && len <= Store::kMaxValueBytes &&
             r.bytes(len, &out->value) && r.done();
    }
    case Cmd::Get:
    case Cmd::Check: {
      out->cmd = static_cast<Cmd>(cmd);
      out->keys.emplace_back();
      return r.key(&out->keys[0]) && r.done();
    }
    case Cmd::SetMany: {
      out->cmd = Cmd::SetMany;
      uint32_t count = 0;
      if (!r.u32(&count) || count > kMaxWaitKeys) return false;
      for (uint32_t i = 0; i < count; ++i) {
        out->keys.emplace_back();
        out->values.emplace_back();
        uint64_t len = 0;
        if (!r.key(&out->keys.back()) || !r.u64(&len) || len > Store::kMaxValueBytes ||
            !r.bytes(len, &out->values.back()))
          return false;
      }
      return r.done();
    }
    case Cmd::Wait:
    case Cmd::GetMany: {
      out->cmd = static_cast<Cmd>(cmd);
      uint32_t count = 0;
      if (!r.u32(&count) || count > kMaxWaitKeys) return false;
      out->keys.reserve(count);
      for (uint32_t i = 0; i < count; ++i) {
        out->keys.emplace_back();
        if (!r.key(&out->keys.back())) return false;
      }
      return r.done();
    }
    case Cmd::Add: {
      out->cmd = Cmd::Add;
      out->keys.emplace_back();
      uint64_t raw = 0;
      if (!r.key(&out->keys[0]) || !r.u64(&raw) || !r.done()) return false;
      out->delta = static_cast<int64_t>(raw);
      return true;
    }
    case Cmd::AddOnce: {
      out->cmd = Cmd::AddOnce;
      out->keys.emplace_back();
      uint64_t raw = 0;
      if (!r.key(&out->keys[0]) || !r.u64(&raw) || !r.u64(&out->client) || !r.u64(&out->seq) || !r.done())
        return false;
      out->delta = static_cast<int64_t>(raw);
      return true;
    }
  }
  return false;  // unknown command
}

std::string encode_hello(const std::string& who) {
  std::string body(1, static_cast<char>(Cmd::Hello));
  body.append(kStoreMagic, kStoreMagicBytes);
  put_key(body, who);
  return body;
}

std::string encode_auth(const std::string& proof) {
  std::string body(1, static_cast<char>(Cmd::Auth));
  put_key(body, proof);
  return body;
}

std::string encode_set(const std::string& key, const char* value, size_t n) {
  std::string body;
  body.reserve(1 + 4 + key.size() + 8 + n);
  body.push_back(static_cast<char>(Cmd::Set));
  put_key(body, key);
  put_u64(body, n);
  body.append(value, n);
  return body;
}

std::string encode_get(const std::string& key) {
  std::string body(1, static_cast<char>(Cmd::Get));
  put_key(body, key);
  return body;
}

std::string encode_wait(const std::string* keys, size_t count) {
  std::string body(1, static_cast<char>(Cmd::Wait));
  put_u32(body, static_cast<uint32_t>(count));
  for (size_t i = 0; i < count; ++i) put_key(body, keys[i]);
  return body;
}

std::string encode_get_many(const std::string* keys, size_t count) {
  std::string body = encode_wait(keys, count);
  body[0] = static_cast<char>(Cmd::GetMany);
  return body;
}

size_t set_many_entry_bytes(const std::string& key, size_t value_bytes) {
  return 4 + key.size() + 8 + value_bytes;
}

std::string encode_set_many(const std::string* keys, const std::vector<char>* values, size_t count) {
  std::string body(1, static_cast<char>(Cmd::SetMany));
  put_u32(body, static_cast<uint32_t>(count));
  for (size_t i = 0; i < count; ++i) {
    put_key(body, keys[i]);
    put_u64(body, values[i].size());
    body.append(values[i].data(), values[i].size());
  }
  return body;
}

std::string encode_add(const std::string& key, int64_t delta) {
  std::string body(1, static_cast<char>(Cmd::Add));
  put_key(body, key);
  put_u64(body, static_cast<uint64_t>(delta));
  return body;
}

std::string encode_add_once(const std::string& key, int64_t delta, uint64_t client, uint64_t seq) {
  std::string body = encode_add(key, delta);
  body[0] = static_cast<char>(Cmd::AddOnce);
  put_u64(body, client);
  put_u64(body, seq);
  return body;
}

std::string add_once_key(uint64_t client) {
  static const char kHex[] = "0123456789abcdef";
  std::string key = "zs/add-once/";
  for (int shift = 60; shift >= 0; shift -= 4) key += kHex[(client >> shift) & 15];
  return key;
}

std::string encode_check(const std::string& key) {
  std::string body(1, static_cast<char>(Cmd::Check));
  put_key(body, key);
  return body;
}

std::string encode_request(const Request& r) {
  switch (r.cmd) {
    case Cmd::Hello: return encode_hello(r.who);
    case Cmd::Auth: return encode_auth(r.value);
    case Cmd::Set: return encode_set(r.keys.at(0), r.value.data(), r.value.size());
    case Cmd::Get: return encode_get(r.keys.at(0));
    case Cmd::Wait: return encode_wait(r.keys.data(), r.keys.size());
    case Cmd::GetMany: return encode_get_many(r.keys.data(), r.keys.size());
    case Cmd::SetMany: {
      std::vector<std::vector<char>> values;
      for (const std::string& v : r.values) values.emplace_back(v.begin(), v.end());
      return encode_set_many(r.keys.data(), values.data(), r.keys.size());
    }
    case Cmd::Add: return encode_add(r.keys.at(0), r.delta);
    case Cmd::AddOnce: return encode_add_once(r.keys.at(0), r.delta, r.client, r.seq);
    case Cmd::Check: return encode_check(r.keys.at(0));
  }
  return {};
}

Frame next_frame(const char* p, size_t avail, size_t* body_length) {
  if (avail < 4) return Frame::Incomplete;
  const size_t len = static_cast<size_t>(load_le(p, 4));
  if (len == 0 || len > kMaxRequestBytes) return Frame::Bad;
  if (avail < 4 + len) return Frame::Incomplete;
  *body_length = len;
  return Frame::Ready;
}

}  // namespace zs::store_protocol
