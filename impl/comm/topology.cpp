#include "impl/comm/topology.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "impl/common/error.h"

namespace zs {

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
  os << "]";
  return os.str();
}

std::vector<int> Topology::live_ranks(const TopologyShape& s) {
  if (!s.live.empty()) return s.live;
  std::vector<int> all(static_cast<size_t>(std::max(s.world_size, 0)));
  for (int i = 0; i < s.world_size; ++i) all[static_cast<size_t>(i)] = i;
  return all;
}

void Topology::check(const TopologyShape& s) {
  if (!s.live.empty()) {
    for (size_t i = 0; i < s.live.size(); ++i)
      if (s.live[i] < 0 || s.live[i] >= s.world_size || (i > 0 && s.live[i] <= s.live[i - 1]))
        fail(Code::InvalidArgument, "live ranks ", rank_list(s.live), ": expected distinct ranks below the world "
             "size ", s.world_size, ", ascending");
    if (!std::binary_search(s.live.begin(), s.live.end(), s.rank))
      fail(Code::InvalidArgument, "live ranks ", rank_list(s.live), ": this rank, ", s.rank, ", is not among them");
    if (static_cast<int>(s.live.size()) < s.world_size) {
      const char* key = s.mics_shard_size > 0          ? "zero_optimization.mics_shard_size"
                        : s.hpz_partition_size > 1     ? "zero_optimization.zero_hpz_partition_size"
                        : s.quantized_gradients && s.local_world_size > 1 ? "zero_optimization.zero_quantized_gradients"
                                                                           : nullptr;
      if (key != nullptr)
        fail(Code::InvalidConfig, key, " cuts the world into whole nodes of rank ids, which a world of the live ranks ",
             rank_list(s.live), " (", s.live.size(), " of ", s.world_size, ") is not; it cannot shrink in memory "
             "(resume from a checkpoint at the new world size instead)");
    }
  }
  if (!s.mics_hierarchical || s.mics_shard_size <= s.local_world_size) return;
  if (s.mics_shard_size % s.local_world_size != 0 || s.world_size % s.local_world_size != 0)
    fail(Code::InvalidConfig, "zero_optimization.mics_hierarchical_params_gather: mics_shard_size ",
         s.mics_shard_size, " must be a multiple of the local world size ", s.local_world_size,
         " (whole nodes per shard group)");
}

Topology::Topology(TopologyShape shape, MakeGroup make) : shape_(shape), make_(std::move(make)) {}

std::shared_ptr<Group> Topology::make(const std::string& name, const std::vector<int>& ranks) {
  const int id = next_id_++;
  auto group = make_(name, id, ranks);
  all_.emplace_back(id, group);
  return group;
}

void Topology::make_heal() {
  if (heal_) return;
  heal_ = make("heal", live_ranks(shape_));
}

void Topology::make_world() { world_ = make("world", live_ranks(shape_)); }

void Topology::validate_group(const std::vector<int>& ranks) const {
  if (ranks.empty()) fail(Code::InvalidArgument, "a group needs at least one rank");
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= shape_.world_size)
      fail(Code::InvalidArgument, "group rank list ", rank_list(ranks), ": rank ", sorted[i],
           " is out of range for world size ", shape_.world_size);
    if (i > 0 && sorted[i] == sorted[i - 1])
      fail(Code::InvalidArgument, "group rank list ", rank_list(ranks), ": rank ", sorted[i],
           " appears twice");
    if (!shape_.live.empty() && !std::binary_search(shape_.live.begin(), shape_.live.end(), sorted[i]))
      fail(Code::InvalidArgument, "group rank list ", rank_list(ranks), ": rank ", sorted[i],
           " is not among the live ranks ", rank_list(shape_.live));
  }
}

std::shared_ptr<Group> Topology::create_group(const std::vector<int>& ranks) {
  validate_group(ranks);
  return make("group" + std::to_string(next_id_) + rank_list(ranks), ranks);
}

void Topology::set_hosts(const std::vector<std::string>& hosts) {
  if (hosts.size() != static_cast<size_t>(shape_.world_size))
    fail(Code::InvalidArgument, "set_hosts: ", hosts.size(), " hosts for a world of ",
         shape_.world_size);
  // Indexes in order of first appearance; an unknown host ("") is one of its own.
  std::unordered_map<std::string, int> index;
  host_of_.assign(hosts.size(), 0);
  host_count_ = 0;
  for (size_t r = 0; r < hosts.size(); ++r) {
    if (hosts[r].empty()) {
      host_of_[r] = host_count_++;
      continue;
    }
    const auto [it, added] = index.emplace(hosts[r], host_count_);
    if (added) ++host_count_;
    host_of_[r] = it->second;
  }
}

bool Topology::spans_hosts(const Group& group) const {
  if (host_of_.empty()) return false;
  const auto& ranks = group.world_ranks();
  for (const int r : ranks)
    if (host_of_[static_cast<size_t>(r)] != host_of_[static_cast<size_t>(ranks.front())]) return true;
  return false;
}

std::shared_ptr<Group> Topology::family(const std::string& kind,
                                        const std::vector<std::vector<int>>& lists) {
  std::shared_ptr<Group> mine;
  for (size_t k = 0; k < lists.size(); ++k) {
    const auto& ranks = lists[k];
    if (std::find(ranks.begin(), ranks.end(), shape_.rank) == ranks.end()) {
      ++next_id_;  // consumed on every rank, so ids agree
      continue;
    }
    mine = make(kind + std::to_string(k) + rank_list(ranks), ranks);
  }
  return mine;
}

void Topology::build() {
  if (!shape_.live.empty()) check(shape_);  // no node-cut families over a partial world
  const int world = shape_.world_size;
  partition_ = world_;
  const int mics = shape_.mics_shard_size;
  if (mics > 0) {
    std::vector<std::vector<int>> shards(static_cast<size_t>(world / mics));
    std::vector<std::vector<int>> replicas(static_cast<size_t>(mics));
    for (int r = 0; r < world; ++r) {
      shards[static_cast<size_t>(r / mics)].push_back(r);
      replicas[static_cast<size_t>(r % mics)].push_back(r);
    }
    mics_shard_ = family("mics_shard", shards);
    mics_replica_ = family("mics_replica", replicas);
    partition_ = mics_shard_;
    build_mics_hierarchy();
  }
  const int hpz = shape_.hpz_partition_size;
  if (hpz > 1) {
    std::vector<std::vector<int>> nodes(static_cast<size_t>(world / hpz));
    for (int r = 0; r < world; ++r) nodes[static_cast<size_t>(r / hpz)].push_back(r);
    hpz_ = family("hpz", nodes);
  }
  build_qgz_hierarchy();
}

// qgZ's two hops (ZeRO++): within each node, then among the ranks at the
// same local position. Only where the world is whole nodes of more than
// one rank and the gradients are reduced over the world (not MiCS); any
// other topology uses the single all-to-all, which works everywhere.
void Topology::build_qgz_hierarchy() {
  const int world = shape_.world_size;
  const int local = shape_.local_world_size;
  if (!shape_.quantized_gradients || shape_.mics_shard_size > 0) return;
  if (local <= 1 || local >= world || world % local != 0) return;
  std::vector<std::vector<int>> intra(static_cast<size_t>(world / local)),
      inter(static_cast<size_t>(local));
  for (int r = 0; r < world; ++r) {
    intra[static_cast<size_t>(r / local)].push_back(r);
    inter[static_cast<size_t>(r % local)].push_back(r);
  }
  qgz_intra_ = family("qgz_intra", intra);
  qgz_inter_ = family("qgz_inter", inter);
}

// Two hops for a shard group that spans nodes: first among the ranks at
// the same local position on each node, then within the node. Needs whole
// nodes in every shard group; a shard group inside one node gathers flat.
void Topology::build_mics_hierarchy() {
  if (!shape_.mics_hierarchical) return;
  const int world = shape_.world_size;
  const int shard = shape_.mics_shard_size;
  const int local = shape_.local_world_size;
  if (shard <= local) return;
  std::vector<std::vector<int>> inter, intra;
  for (int base = 0; base < world; base += shard) {
    for (int l = 0; l < local; ++l) {
      inter.emplace_back();
      for (int r = base + l; r < base + shard; r += local) inter.back().push_back(r);
    }
    for (int node = base; node < base + shard; node += local) {
      intra.emplace_back();
      for (int l = 0; l < local; ++l) intra.back().push_back(node + l);
    }
  }
  mics_inter_ = family("mics_inter", inter);
  mics_intra_ = family("mics_intra", intra);
}

std::vector<std::pair<int, std::shared_ptr<Group>>> Topology::groups() const {
  std::vector<std::pair<int, std::shared_ptr<Group>>> out;
  for (const auto& [id, weak] : all_)
    if (auto g = weak.lock(); g && g->member()) out.emplace_back(id, std::move(g));
  return out;
}

std::vector<int> Topology::shrink(const std::vector<int>& live, const Rejoin& rejoin) {
  const std::vector<int> before = live_ranks(shape_);
  TopologyShape next = shape_;
  next.live = live;
  check(next);
  if (live.size() >= before.size() ||
      !std::includes(before.begin(), before.end(), live.begin(), live.end()))
    fail(Code::InvalidArgument, "shrink to the live ranks ", rank_list(live), ": expected fewer of the ranks ",
         rank_list(before), " live now");
  std::vector<int> lost;
  std::set_difference(before.begin(), before.end(), live.begin(), live.end(), std::back_inserter(lost));
  shape_ = next;
  rejoin_all(before, live, rejoin);
  return lost;
}

void Topology::regrow(const std::vector<int>& live, const Rejoin& rejoin) {
  const std::vector<int> before = live_ranks(shape_);
  TopologyShape next = shape_;
  next.live = static_cast<int>(live.size()) == shape_.world_size ? std::vector<int>() : live;
  check(next);
  if (live.size() <= before.size() || !std::includes(live.begin(), live.end(), before.begin(), before.end()))
    fail(Code::InvalidArgument, "regrow to the live ranks ", rank_list(live), ": expected more than, and all of, the "
         "ranks ", rank_list(before), " live now");
  shape_ = next;
  rejoin_all(before, live, rejoin);
}

void Topology::rejoin_all(const std::vector<int>& before, const std::vector<int>& after, const Rejoin& rejoin) {
  const auto in = [](const std::vector<int>& list, int r) { return std::binary_search(list.begin(), list.end(), r); };
  for (const auto& [id, group] : groups()) {
    if (group == world_ || group == heal_) {
      rejoin(*group, id, after);
      continue;
    }
    const auto& members = group->world_ranks();
    const bool cut = std::any_of(members.begin(), members.end(), [&](int r) { return !in(before, r) || !in(after, r); });
    if (!cut) rejoin(*group, id, members);
  }
}

void Topology::start_live(const std::vector<int>& live) {
  if (world_) fail(Code::Internal, "start_live after the world was made");
  TopologyShape next = shape_;
  next.live = static_cast<int>(live.size()) == shape_.world_size ? std::vector<int>() : live;
  check(next);
  shape_ = next;
}

void Topology::abort(Code code, const std::string& why) {
  for (auto& entry : all_)
    if (auto g = entry.second.lock()) g->abort(code, why);
}

void Topology::shutdown(const std::string& why) {
  for (auto& entry : all_)
    if (auto g = entry.second.lock()) g->shutdown(why);
}

}  // namespace zs
