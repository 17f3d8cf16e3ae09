// Whether every rank's optimizer has the same kind, groups and
// hyper-parameters (an lr or a weight decay set on one rank only would
// otherwise train on with silently different numbers). Checked at every
// step, inside the gradient norm's all-reduce; a mismatch is an error on
// every rank naming each differing value of each rank against rank 0's.
#pragma once

#include <string>
#include <vector>

#include "impl/comm/group.h"

namespace zs {

// `tokens` describe this rank's optimizer ("kind=adamw", "g0.lr=0.001",
// "g0.params=12", ...), in the same order on every rank. Collective over
// `world`; throws InvalidArgument on a mismatch.
void check_agreement(Group& world, const std::vector<std::string>& tokens);

// The same check folded into another Sum all-reduce over `world` (the
// optimizer step's gradient norm), so a step pays one small collective, not
// two. agreement_floats writes kAgreementFloats floats from this rank's
// tokens (the digest's nibbles and their squares); after the Sum,
// agreement_holds is true on every rank or on none, and where it is false
// every rank calls fail_disagreement. Exact while agreement_fusable.
constexpr size_t kAgreementFloats = 32;
bool agreement_fusable(int world_size);
void agreement_floats(const std::vector<std::string>& tokens, float* out);
bool agreement_holds(const float* sums, const float* mine, int world_size);
// Collective over `world`: exchanges the ranks' descriptions and throws
// InvalidArgument naming each value that differs from rank 0's.
[[noreturn]] void fail_disagreement(Group& world, const std::vector<std::string>& tokens);

}  // namespace zs
