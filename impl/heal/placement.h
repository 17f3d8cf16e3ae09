// Where each rank's peer copy lives (docs/healing.md, section 1): its
// holder, the next rank in an order that interleaves the hosts, so that a
// host's loss never takes a shard together with its copy.
//
// Ranks are ordered by (index within their host, host index), e.g. hosts
// A = {0, 1} and B = {2, 3} give 0, 2, 1, 3; a rank's holder is the next
// one in that order, the last's the first. On one host that is rank + 1
// mod N. The holders are a permutation: every rank holds exactly one
// replica. With equal ranks per host, every holder is on another host than
// its source; with unequal ones some cannot be (3 ranks on A and 1 on B:
// two of A's ranks follow each other), which placement_note names.
#pragma once

#include <string>
#include <vector>

namespace zs::heal {

// host[r]: rank r's host index (any distinct ints); empty means one host.
// Returns holder[r] for every rank. InvalidArgument for fewer than 2 ranks.
std::vector<int> holders(int world_size, const std::vector<int>& host);
// The inverse: source[h] is the rank whose replica h holds.
std::vector<int> sources(const std::vector<int>& holders);
// holders() over the world ranks `members` (ascending: the live ones after
// a shrink), host_of[r] world rank r's host (empty: one host). Returns, by
// world rank, each member's holder (a world rank), -1 for a non-member.
std::vector<int> member_holders(const std::vector<int>& members, const std::vector<int>& host_of);
// "" when every holder is on another host than its source (or there is one
// host); else a sentence naming the ranks whose copy shares their host.
std::string placement_note(const std::vector<int>& holders, const std::vector<int>& host);

}  // namespace zs::heal
