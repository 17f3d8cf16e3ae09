// The TCP store's wire protocol (impl/comm/store/tcp_store.cpp): framing, request
// encoding for the client and decoding for the server. Separate from the
// sockets so that the server's parsing of untrusted bytes can be fuzzed
// (tests/fuzz/store_request_fuzz.cpp).
//
//   request: u32 body_length, body = u8 command, then
//     HELLO kStoreMagic, u32 name_length, name  (a connection's first request;
//           answered with kStoreMagic, followed by a kChallengeBytes
//           challenge when the server checks a job secret)
//     AUTH  u32 32, proof  (the second request where a challenge came: the
//           HMAC of the challenge under the job secret; answered empty, or
//           the connection is dropped)
//     SET   u32 key_length, key, u64 value_length, value
//     GET   u32 key_length, key          (answered once the key exists)
//     WAIT  u32 count, count x (u32 key_length, key)   (answered once all exist)
//     SETS  u32 count, count x (u32 key_length, key, u64 value_length, value)
//     GETS  u32 count, count x (u32 key_length, key)   (answered once all
//           exist: count x (u64 value_length, value), in the order asked)
//     ADD   u32 key_length, key, i64 delta           (reply: i64 new value)
//     ADD1  u32 key_length, key, i64 delta, u64 client, u64 seq   (ADD that a
//           client may resend after the server restarted: a seq the server
//           already applied for that client answers the value it gave then)
//     CHECK u32 key_length, key                      (reply: u8 0 or 1)
//   reply: u8 status (0 ok, 1 error), u64 payload_length, payload
//
// All integers are little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "impl/comm/store/store.h"

namespace zs::store_protocol {

enum class Cmd : uint8_t {
  Set = 1, Get = 2, Wait = 3, Add = 4, Check = 5, Hello = 6, Auth = 7, SetMany = 8, GetMany = 9,
  AddOnce = 10
};

constexpr size_t kAuthProofBytes = 32;  // HMAC-SHA-256 (job_secret.h)

// A client's first request, answered with the same bytes: a port held by
// another program (or anything but this protocol) is named as such at
// connect, instead of every later request timing out. The server drops a
// connection whose first request is anything else.
constexpr char kStoreMagic[] = "zeroshard-store/1";
constexpr size_t kStoreMagicBytes = sizeof kStoreMagic - 1;
// A client may name itself in its Hello ("rank 2"); when its connection
// closes, the server appends the name to kGoneKey (store.h), so peers can
// tell which ranks went away.
constexpr size_t kMaxClientName = 64;

// Keys of one WAIT, GETS or SETS (a SETS is also bounded by
// kMaxRequestBytes in all; clients split longer lists).
constexpr size_t kMaxWaitKeys = 1024;
// Largest request body: SET with the largest key and value.
constexpr size_t kMaxRequestBytes = 1 + 4 + Store::kMaxKeyBytes + 8 + Store::kMaxValueBytes;
static_assert(1 + 4 + kMaxWaitKeys * (4 + Store::kMaxKeyBytes) <= kMaxRequestBytes,
              "a full WAIT must fit in a request");
static_assert(kMaxRequestBytes <= UINT32_MAX, "request length is a u32");

void put_u32(std::string& b, uint32_t v);
void put_u64(std::string& b, uint64_t v);
uint64_t load_le(const char* p, int n);

// One decoded request. keys: one key for SET, GET, ADD and CHECK; WAIT's,
// GETS' and SETS' keys in the order sent (repeats kept); values: SETS'.
struct Request {
  Cmd cmd = Cmd::Check;
  std::vector<std::string> keys;  // HELLO: none
  std::string who;    // HELLO: the client's name (may be empty)
  std::string value;  // SET; AUTH: the proof
  std::vector<std::string> values;  // SETS, one per key
  int64_t delta = 0;  // ADD, ADD1
  uint64_t client = 0, seq = 0;  // ADD1
};

// Decodes one request body (the bytes after the u32 length). False when it
// does not parse exactly: empty, an unknown command, a key over
// Store::kMaxKeyBytes, a value over Store::kMaxValueBytes, more than
// kMaxWaitKeys keys, a length past the end, or bytes left over.
bool decode_request(const char* body, size_t n, Request* out);

// Request bodies, without the u32 length (the client frames them).
std::string encode_hello(const std::string& who);
std::string encode_auth(const std::string& proof);
std::string encode_set(const std::string& key, const char* value, size_t n);
std::string encode_get(const std::string& key);
std::string encode_wait(const std::string* keys, size_t count);
std::string encode_get_many(const std::string* keys, size_t count);
std::string encode_set_many(const std::string* keys, const std::vector<char>* values, size_t count);
// Bytes one key and value add to a SETS body.
size_t set_many_entry_bytes(const std::string& key, size_t value_bytes);
std::string encode_add(const std::string& key, int64_t delta);
std::string encode_add_once(const std::string& key, int64_t delta, uint64_t client, uint64_t seq);
// Where the server keeps a client's last ADD1 ("seq value", decimal).
std::string add_once_key(uint64_t client);
std::string encode_check(const std::string& key);
std::string encode_request(const Request& r);

// The next frame of a byte stream of requests: Incomplete while fewer than
// 4 + body_length bytes are there, Bad when the length is 0 or over
// kMaxRequestBytes (the server then drops the client), else Ready with
// *body_length set.
enum class Frame { Incomplete, Ready, Bad };
Frame next_frame(const char* p, size_t avail, size_t* body_length);

}  // namespace zs::store_protocol
