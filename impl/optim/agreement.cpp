#include "impl/optim/agreement.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "impl/common/error.h"

namespace zs {
namespace {

constexpr size_t kRecordBytes = 2048;  // one rank's description, in the error path only
constexpr int kRanksShown = 4;

uint64_t fnv1a(const std::vector<std::string>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& t : tokens) {
    for (const char c : t) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // token boundary
  }
  return h;
}

std::string joined(const std::vector<std::string>& tokens) {
  std::string s;
  for (const auto& t : tokens) s += t + "\n";
  return s;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t from = 0;
  for (size_t at; (at = s.find('\n', from)) != std::string::npos; from = at + 1)
    out.push_back(s.substr(from, at - from));
  return out;
}

// "g0.lr=0.002 where rank 0 has g0.lr=0.001", key by key.
std::string describe(const std::vector<std::string>& theirs, const std::vector<std::string>& ref) {
  std::string out;
  const auto key = [](const std::string& t) { return t.substr(0, t.find('=')); };
  for (const auto& t : theirs) {
    if (std::find(ref.begin(), ref.end(), t) != ref.end()) continue;
    std::string where = "none";
    for (const auto& r : ref)
      if (key(r) == key(t)) where = r;
    out += (out.empty() ? "" : ", ") + t + " where rank 0 has " + where;
  }
  for (const auto& r : ref) {
    bool has_key = false;
    for (const auto& t : theirs) has_key = has_key || key(t) == key(r);
    if (!has_key) out += (out.empty() ? "" : ", ") + std::string("no ") + key(r) + " where rank 0 has " + r;
  }
  return out;
}

}  // namespace

void check_agreement(Group& world, const std::vector<std::string>& tokens) {
  if (world.size() == 1) return;
  // The digest and its complement, reduced with Max byte by byte, come back
  // unchanged only when every rank's digest equals this one (a byte's max
  // and its complement's max meet only if every rank has that byte).
  const uint64_t h = fnv1a(tokens);
  std::array<uint8_t, 16> mine{}, reduced{};
  for (int i = 0; i < 8; ++i) {
    mine[static_cast<size_t>(i)] = static_cast<uint8_t>(h >> (8 * i));
    mine[static_cast<size_t>(i) + 8] = static_cast<uint8_t>(~(h >> (8 * i)));
  }
  world.run("optimizer agreement", [&](Communicator& c) {
    c.allreduce(mine.data(), reduced.data(), mine.size(), DType::U8, ReduceOp::Max);
  });
  if (reduced == mine) return;
  fail_disagreement(world, tokens);
}

bool agreement_fusable(int world_size) {
  // Sums of nibbles' squares (at most 225 each) stay exact in fp32 below 2^24.
  return world_size > 1 && static_cast<int64_t>(world_size) * 225 < (int64_t{1} << 24);
}

void agreement_floats(const std::vector<std::string>& tokens, float* out) {
  const uint64_t h = fnv1a(tokens);
  for (size_t i = 0; i < 16; ++i) {
    const auto nibble = static_cast<float>((h >> (4 * i)) & 0xfu);
    out[i] = nibble;
    out[16 + i] = nibble * nibble;
  }
}

bool agreement_holds(const float* sums, const float* mine, int world_size) {
  // Sum c_r = n * c and sum c_r^2 = n * c^2 hold together only when every
  // c_r equals c (their variance is then 0), so every rank gets the same
  // verdict.
  const auto n = static_cast<float>(world_size);
  for (size_t i = 0; i < kAgreementFloats; ++i)
    if (sums[i] != n * mine[i]) return false;
  return true;
}

void fail_disagreement(Group& world, const std::vector<std::string>& tokens) {
  // Every rank gets here: exchange the descriptions and name what differs.
  std::string text = joined(tokens);
  if (text.size() >= kRecordBytes) text.resize(kRecordBytes - 1);
  std::vector<char> send(kRecordBytes, '\0'), all(kRecordBytes * static_cast<size_t>(world.size()));
  std::memcpy(send.data(), text.data(), text.size());
  world.run("optimizer agreement details", [&](Communicator& c) {
    c.allgather(send.data(), all.data(), kRecordBytes);
  });
  const auto record = [&](int r) {
    return split(std::string(all.data() + kRecordBytes * static_cast<size_t>(r)));
  };
  const auto ref = record(0);
  std::string message;
  int shown = 0, differing = 0;
  for (int r = 1; r < world.size(); ++r) {
    const auto theirs = record(r);
    if (theirs == ref) continue;
    ++differing;
    if (shown++ < kRanksShown)
      message += (message.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " has " +
                 describe(theirs, ref);
  }
  if (differing > kRanksShown) message += "; and " + std::to_string(differing - kRanksShown) + " more ranks";
  fail(Code::InvalidArgument,
       "the ranks' optimizers differ (every rank must create the same groups and set the same "
       "hyper-parameters; nothing was updated): ",
       message);
}

}  // namespace zs
