#include "impl/heal/placement.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "impl/common/error.h"

namespace zs::heal {

std::vector<int> holders(int world_size, const std::vector<int>& host) {
  if (world_size < 2)
    fail(Code::InvalidArgument, "peer copy placement over ", world_size, " rank: needs 2 or more");
  if (!host.empty() && host.size() != static_cast<size_t>(world_size))
    fail(Code::InvalidArgument, "peer copy placement: ", host.size(), " hosts listed for ", world_size, " ranks");
  // (index within the host, host, rank), sorted: the interleaved order.
  std::map<int, int> seen;  // host -> ranks met so far
  std::vector<std::tuple<int, int, int>> order;
  for (int r = 0; r < world_size; ++r) {
    const int h = host.empty() ? 0 : host[static_cast<size_t>(r)];
    order.emplace_back(seen[h]++, h, r);
  }
  std::sort(order.begin(), order.end());
  std::vector<int> out(static_cast<size_t>(world_size));
  for (size_t i = 0; i < order.size(); ++i)
    out[static_cast<size_t>(std::get<2>(order[i]))] = std::get<2>(order[(i + 1) % order.size()]);
  return out;
}

std::vector<int> sources(const std::vector<int>& holders) {
  std::vector<int> out(holders.size(), -1);
  for (size_t r = 0; r < holders.size(); ++r) out.at(static_cast<size_t>(holders[r])) = static_cast<int>(r);
  return out;
}

std::vector<int> member_holders(const std::vector<int>& members, const std::vector<int>& host_of) {
  std::vector<int> host;
  if (!host_of.empty())
    for (const int r : members) host.push_back(host_of.at(static_cast<size_t>(r)));
  const std::vector<int> at = holders(static_cast<int>(members.size()), host);
  const int top = members.empty() ? 0 : *std::max_element(members.begin(), members.end());
  std::vector<int> out(static_cast<size_t>(std::max(top + 1, static_cast<int>(host_of.size()))), -1);
  for (size_t i = 0; i < members.size(); ++i)
    out[static_cast<size_t>(members[i])] = members[static_cast<size_t>(at[i])];
  return out;
}

std::string placement_note(const std::vector<int>& holders, const std::vector<int>& host) {
  if (host.empty()) return "";
  const bool several = std::any_of(host.begin(), host.end(), [&](int h) { return h != host[0]; });
  if (!several) return "";
  std::string same;
  for (size_t r = 0; r < holders.size(); ++r)
    if (host[r] == host[static_cast<size_t>(holders[r])])
      same += (same.empty() ? "" : ", ") + std::to_string(r) + " (held by " + std::to_string(holders[r]) + ")";
  if (same.empty()) return "";
  return "the hosts have unequal numbers of ranks, so the copies of ranks " + same +
         " are on their own host: losing that host loses them";
}

}  // namespace zs::heal
