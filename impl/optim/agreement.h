// Whether every rank's optimizer has the same kind, groups and
// hyper-parameters (an lr or a weight decay set on one rank only would
// otherwise train on with silently different numbers). Checked at every
// step with one 16-byte all-reduce; a mismatch is an error on every rank
// naming each differing value of each rank against rank 0's.
#pragma once

#include <string>
#include <vector>

#include "impl/comm/group.h"

namespace zs {

// `tokens` describe this rank's optimizer ("kind=adamw", "g0.lr=0.001",
// "g0.params=12", ...), in the same order on every rank. Collective over
// `world`; throws InvalidArgument on a mismatch.
void check_agreement(Group& world, const std::vector<std::string>& tokens);

}  // namespace zs
