// Hostile manifest.json texts and safetensors headers (issue 13, part 6):
// each case is something the parsers let through before fuzz_ckpt_manifest
// and fuzz_safetensors were written (undefined behaviour, a wrapped size,
// or a manifest that sent a reader out of bounds), and must now be a
// Code::Io naming the field and the value.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "impl/checkpoint/file_io.h"
#include "impl/checkpoint/format.h"
#include "impl/checkpoint/safetensors.h"
#include "impl/common/error.h"

namespace zs::ckpt {
namespace {

using nlohmann::json;

// Two ranks, one F32 param of 6 elements split 3 + 3.
json good_manifest() {
  auto chunk = [](int file, uint64_t offset) {
    return json{{"file", file},   {"key", "param/w"}, {"dtype", "F32"}, {"offset", offset}, {"numel", 3},
                {"begin", 64},    {"xxh3", "0000000000000001"},         {"blocks", {"0000000000000001"}}};
  };
  return {{"format", kFormatName}, {"format_version", kFormatVersion}, {"engine_version", "test"},
          {"tag", "t"}, {"world_size", 2}, {"topology", json::object()}, {"step", 1},
          {"block_bytes", kBlockBytes}, {"optimizer", nullptr}, {"user", json::object()},
          {"files", {{{"name", "a.safetensors"}, {"rank", 0}, {"bytes", 76}, {"xxh3", "0000000000000002"}},
                     {{"name", "b.safetensors"}, {"rank", 1}, {"bytes", 76}, {"xxh3", "0000000000000003"}}}},
          {"params", {{{"name", "w"}, {"dtype", "F32"}, {"shape", {2, 3}}, {"numel", 6},
                       {"states", {{"param", {chunk(0, 0), chunk(1, 3)}}}}}}}};
}

// The Code::Io message parsing text gives; fails the test if it parses.
std::string manifest_error(const std::string& text) {
  try {
    Manifest::parse(text, "m");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::Io) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "parsed: " << text;
  return "";
}

std::string manifest_error(const json& j) { return manifest_error(j.dump()); }

TEST(CheckpointParse, TheGoodManifestParses) {
  const Manifest m = Manifest::parse(good_manifest().dump(), "m");
  ASSERT_EQ(m.params.size(), 1u);
  EXPECT_EQ(m.params[0].states.at("param").size(), 2u);
}

// nlohmann's get<int> of 1e300 is an out-of-range float-to-int conversion.
TEST(CheckpointParse, AFloatWhereAnIntegerBelongs) {
  json j = good_manifest();
  j["world_size"] = 1e300;
  EXPECT_NE(manifest_error(j).find("world_size: 1e+300 is not an integer"), std::string::npos);
  j = good_manifest();
  j["params"][0]["states"]["param"][0]["numel"] = 3.5;
  const std::string msg = manifest_error(j);
  EXPECT_NE(msg.find("states.param[0].numel: 3.5 is not a non-negative integer"), std::string::npos) << msg;
}

// Found by fuzz_ckpt_manifest in the strict reader itself: a non-negative
// literal is held unsigned, and its lower bound went unchecked.
TEST(CheckpointParse, AnUnsignedValueBelowItsLowerBound) {
  json j = good_manifest();
  j["world_size"] = 0;
  EXPECT_NE(manifest_error(j).find("m: world_size: 0 is below 1"), std::string::npos);
}

// get<uint64_t> of -1 wrapped to 2^64 - 1, a file as large as any chunk.
TEST(CheckpointParse, ANegativeSize) {
  json j = good_manifest();
  j["files"][0]["bytes"] = -1;
  EXPECT_NE(manifest_error(j).find("files[0].bytes: -1 is not a non-negative integer"), std::string::npos);
}

// 2^32 * 2^32 wrapped to 0, which matched numel 0.
TEST(CheckpointParse, AShapeWhoseProductOverflows) {
  json j = good_manifest();
  j["params"][0]["shape"] = {4294967296ull, 4294967296ull};
  j["params"][0]["numel"] = 0;
  j["params"][0]["states"] = json::object();
  EXPECT_NE(manifest_error(j).find("shape[1]: 4294967296 * 4294967296 overflows 64 bits"), std::string::npos);
  j["params"][0]["shape"] = {-2, -3};
  j["params"][0]["numel"] = 6;
  EXPECT_NE(manifest_error(j).find("shape[0]: -2 is below 0"), std::string::npos);
}

// block_bytes 2^64 - 1 made (bytes + block_bytes - 1) wrap, so an empty
// block list passed for a chunk with bytes, and readers indexed blocks[0].
TEST(CheckpointParse, BlockBytesThatWrapTheBlockCount) {
  json j = good_manifest();
  j["block_bytes"] = UINT64_MAX;
  for (auto& c : j["params"][0]["states"]["param"]) c["blocks"] = json::array();
  EXPECT_NE(manifest_error(j).find("block_bytes 18446744073709551615: expected a power of two"),
            std::string::npos);
  j["block_bytes"] = 48;  // not a power of two: verify() would hash blocks across its pieces
  EXPECT_NE(manifest_error(j).find("block_bytes 48"), std::string::npos);
  j = good_manifest();
  j["params"][0]["states"]["param"][1]["blocks"] = {"0000000000000001", "0000000000000002"};
  EXPECT_NE(manifest_error(j).find("states.param[1]: 2 block checksums for 12 bytes"), std::string::npos);
}

// begin + bytes wrapped below the file's size.
TEST(CheckpointParse, AChunkEndThatOverflows) {
  json j = good_manifest();
  j["params"][0]["states"]["param"][0]["begin"] = UINT64_MAX - 3;
  EXPECT_NE(manifest_error(j).find("states.param[0]: begin + bytes: 18446744073709551612 + 12 overflows"),
            std::string::npos);
  j = good_manifest();
  j["params"][0]["states"]["param"][1]["begin"] = 70;
  EXPECT_NE(manifest_error(j).find("bytes [70, 82) lie past the end of 'b.safetensors' (76 bytes)"),
            std::string::npos);
}

// load and reshard take a state's first chunk: an empty list was UB.
TEST(CheckpointParse, AStateWithoutChunks) {
  json j = good_manifest();
  j["params"][0]["shape"] = {0};
  j["params"][0]["numel"] = 0;
  j["params"][0]["states"] = {{"param", json::array()}};
  EXPECT_NE(manifest_error(j).find("states.param: expected a non-empty array of chunks"), std::string::npos);
}

// reshard sizes a state's buffer by its first chunk's dtype: a wider second
// chunk wrote past it.
TEST(CheckpointParse, ChunksOfOneStateInTwoDtypes) {
  json j = good_manifest();
  j["params"][0]["states"]["param"][1]["dtype"] = "F16";
  j["params"][0]["states"]["param"][1]["blocks"] = {"0000000000000001"};
  EXPECT_NE(manifest_error(j).find("states.param[1]: dtype F16, the state's first chunk is F32"),
            std::string::npos);
}

TEST(CheckpointParse, TwoChunksOverTheSameBytes) {
  json j = good_manifest();
  j["params"][0]["states"]["param"][1]["file"] = 0;
  j["params"][0]["states"]["param"][1]["begin"] = 60;
  EXPECT_NE(manifest_error(j).find("states.param[0]: bytes [64, 76) of 'a.safetensors' overlap those of "
                                   "m: params[0] ('w').states.param[1] [60, 72)"),
            std::string::npos);
}

// nlohmann keeps the last of two equal keys; export named two tensors alike.
TEST(CheckpointParse, DuplicateKeysAndNames) {
  std::string text = good_manifest().dump();
  text.insert(1, "\"step\":7,");
  EXPECT_NE(manifest_error(text).find("key 'step' appears twice"), std::string::npos);
  json j = good_manifest();
  j["params"].push_back(j["params"][0]);
  EXPECT_NE(manifest_error(j).find("params[1]: name 'w' is also params[0]"), std::string::npos);
  j = good_manifest();
  j["files"][1]["name"] = "a.safetensors";
  EXPECT_NE(manifest_error(j).find("files[1].name 'a.safetensors' is also files[0]"), std::string::npos);
  j = good_manifest();
  j["files"][1]["rank"] = 2;
  EXPECT_NE(manifest_error(j).find("files[1].rank: 2 is above 1"), std::string::npos);
}

// topology and user are copied and dumped recursively.
TEST(CheckpointParse, NestingTooDeep) {
  json j = good_manifest();
  std::string text = j.dump();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  text.replace(text.find("\"user\":{}") + 7, 2, deep);
  EXPECT_NE(manifest_error(text).find("nested deeper than 64 levels"), std::string::npos);
}

class SafetensorsParse : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/zs-st-parse-XXXXXX";
    ASSERT_NE(mkdtemp(t), nullptr);
    dir_ = t;
  }
  void TearDown() override { remove_tree(dir_); }
  // A file of the header text (padded) and data_bytes of zeros.
  std::string write(std::string header, size_t data_bytes) {
    header.append((8 - header.size() % 8) % 8, ' ');
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    bytes += header;
    bytes.append(data_bytes, '\0');
    const std::string path = join(dir_, "f.safetensors");
    File f = File::create(path);
    f.write_all(bytes.data(), bytes.size());
    f.close();
    return path;
  }
  std::string error(std::string header, size_t data_bytes) {
    const std::string path = write(std::move(header), data_bytes);
    try {
      read_st_header(File::open_read(path));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::Io) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "parsed";
    return "";
  }
  std::string dir_;
};

TEST_F(SafetensorsParse, AGoodFileParsesAndReadsItsElements) {
  const File f = File::open_read(write(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8));
  const StHeader h = read_st_header(f);
  ASSERT_EQ(h.tensors.size(), 1u);
  float v[2] = {1, 1};
  read_st_elements(f, h.tensors[0], 0, 2, v, "a");
  EXPECT_EQ(v[0], 0.0f);
  // A rank whose shard holds none of a tensor reads nothing from past it.
  read_st_elements(f, h.tensors[0], 5, 0, v, "a");
  try {
    read_st_elements(f, h.tensors[0], 1, 2, v, "a");
    FAIL() << "read past the tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'a': elements [1, 1 + 2) lie past its 2"), std::string::npos);
  }
}

// An empty tensor lies where the next one starts. Ordered by start alone,
// the tie kept the header's key order, and an empty tensor whose key came
// after the one filling that start was refused as a gap (a fuzz finding).
TEST_F(SafetensorsParse, AnEmptyTensorAtAnotherTensorsStartParsesWhateverItsKey) {
  for (const char* empty : {"0", "z"}) {
    const std::string header = std::string(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},")") + empty +
                               R"(":{"dtype":"F16","shape":[0,3],"data_offsets":[0,0]}})";
    const StHeader h = read_st_header(File::open_read(write(header, 8)));
    ASSERT_EQ(h.tensors.size(), 2u) << empty;
    EXPECT_EQ(h.tensors[0].key, empty);  // the empty one first at their common start
    EXPECT_EQ(h.tensors[0].bytes, 0u);
    EXPECT_EQ(h.tensors[1].key, "a");
  }
}

// [-1, -1] wrapped to 1 element and [2^62, 4] to 0: both "matched" their
// bytes.
TEST_F(SafetensorsParse, ShapesThatWrap) {
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}})", 4).find("shape[0]: -1 is below 0"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0)
                .find("tensor 'a': its shape has more than 2^64 elements"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0)
                .find("0 bytes for 4611686018427387904 elements of F32"),
            std::string::npos);
}

// get<uint64_t> of a float beyond 2^64 is undefined.
TEST_F(SafetensorsParse, FloatOffsets) {
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,1e30]}})", 4)
                .find("data_offsets[1]: 1e+30 is not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", 4)
                .find("is truncated: tensor 'a' needs bytes up to 72, the file has 68"),
            std::string::npos);
}

// A header array was read as tensors named "0", "1", ...; a repeated key
// kept only its last entry.
TEST_F(SafetensorsParse, NotAnObjectOrAKeyTwice) {
  EXPECT_NE(error(R"([{"dtype":"F32","shape":[1],"data_offsets":[0,4]}])", 4).find("is a JSON array, not an object"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                  4)
                .find("key 'a' appears twice"),
            std::string::npos);
  EXPECT_NE(error(R"({"a":{"dtype":"F32","shape":[[[[1]]]],"data_offsets":[0,4]}})", 4).find("nested deeper"),
            std::string::npos);
}

}  // namespace
}  // namespace zs::ckpt
