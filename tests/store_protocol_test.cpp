// The TCP store's request decoding (impl/comm/store/store_protocol.h), the part of
// the server that reads a peer's bytes; tests/fuzz/store_request_fuzz.cpp
// fuzzes the same functions.
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "impl/comm/store/store.h"
#include "impl/comm/store/store_protocol.h"

namespace zs::store_protocol {
namespace {

bool decodes(const std::string& body, Request* r) {
  return decode_request(body.data(), body.size(), r);
}

TEST(StoreProtocol, EveryCommandRoundTrips) {
  const std::vector<std::string> keys = {"a", "", std::string(Store::kMaxKeyBytes, 'k')};
  const std::vector<std::string> bodies = {
      encode_set("rank_0/addr", "127.0.0.1:1", 11), encode_get("k"),
      encode_wait(keys.data(), keys.size()),        encode_add("n", -5),
      encode_check(std::string("\0\xff", 2)),       encode_auth(std::string(kAuthProofBytes, '\x5a')),
      encode_hello("rank 3"),
  };
  for (const std::string& body : bodies) {
    Request r;
    ASSERT_TRUE(decodes(body, &r)) << "command " << int(body[0]);
    EXPECT_EQ(encode_request(r), body) << "command " << int(body[0]);
  }
  Request r;
  ASSERT_TRUE(decodes(encode_add("n", -5), &r));
  EXPECT_EQ(r.delta, -5);
  ASSERT_TRUE(decodes(encode_wait(keys.data(), keys.size()), &r));
  EXPECT_EQ(r.keys, keys);
}

TEST(StoreProtocol, MalformedBodiesAreRefused) {
  Request r;
  EXPECT_FALSE(decodes("", &r)) << "empty";
  EXPECT_FALSE(decodes(std::string(1, '\x09'), &r)) << "unknown command";
  EXPECT_FALSE(decodes(encode_get("k") + "x", &r)) << "trailing byte";
  std::string cut = encode_set("key", "value", 5);
  cut.pop_back();
  EXPECT_FALSE(decodes(cut, &r)) << "value cut short";
  EXPECT_FALSE(decodes(encode_get(std::string(Store::kMaxKeyBytes + 1, 'k')), &r)) << "long key";
  // A WAIT announcing more keys than the limit, with no keys behind it.
  std::string wait(1, static_cast<char>(Cmd::Wait));
  put_u32(wait, kMaxWaitKeys + 1);
  EXPECT_FALSE(decodes(wait, &r)) << "too many keys";
  // A SET announcing a value over the limit.
  std::string set(1, static_cast<char>(Cmd::Set));
  put_u32(set, 1);
  set += "k";
  put_u64(set, Store::kMaxValueBytes + 1);
  EXPECT_FALSE(decodes(set, &r)) << "value over the limit";
  // A job-secret proof is exactly 32 bytes.
  EXPECT_FALSE(decodes(encode_auth(std::string(31, 'p')), &r)) << "short proof";
  EXPECT_FALSE(decodes(encode_auth(std::string(33, 'p')), &r)) << "long proof";
}

TEST(StoreProtocol, FramesAreCutByTheirLength) {
  std::string stream;
  put_u32(stream, 3);
  stream += "abc";
  size_t len = 0;
  EXPECT_EQ(next_frame(stream.data(), 3, &len), Frame::Incomplete);
  EXPECT_EQ(next_frame(stream.data(), 6, &len), Frame::Incomplete);
  ASSERT_EQ(next_frame(stream.data(), 7, &len), Frame::Ready);
  EXPECT_EQ(len, 3u);
  std::string zero;
  put_u32(zero, 0);
  EXPECT_EQ(next_frame(zero.data(), zero.size(), &len), Frame::Bad);
  std::string huge;
  put_u32(huge, static_cast<uint32_t>(kMaxRequestBytes + 1));
  EXPECT_EQ(next_frame(huge.data(), huge.size(), &len), Frame::Bad);
}

}  // namespace
}  // namespace zs::store_protocol
