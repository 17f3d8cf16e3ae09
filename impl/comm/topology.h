// The groups a context runs, and how they are cut from the world:
// - the world;
// - MiCS (mics_shard_size): shard groups that partition params, replica
//   groups that average gradients across them, and, with
//   mics_hierarchical_params_gather, the two hops of a shard group that spans
//   nodes (same local rank across nodes, then within the node);
// - hpZ (zero_hpz_partition_size): the groups that hold secondary shards;
// - qgZ across whole nodes: within each node, then the ranks at each local
//   position.
// Every rank cuts the same families in the same order and consumes a group
// id for each family member, joined or not, so ids agree without talking.
// How one group is connected (store, transport, heartbeat) is the caller's
// MakeGroup, so the cutting runs and is tested without processes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "impl/comm/group.h"

namespace zs {

// What the cutting depends on: the ranks and the topology keys of the config.
struct TopologyShape {
  int rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  int mics_shard_size = 0;  // 0: no MiCS
  bool mics_hierarchical = false;
  int hpz_partition_size = 0;  // <= 1: no hpZ
  bool quantized_gradients = false;
  // The world ranks alive, ascending; empty: all of 0 .. world_size - 1.
  // After a shrink (docs/healing.md, section 4) ranks keep their ids and
  // the world and heal groups are cut over the live ones; MiCS, hpZ and
  // qgZ's two hops are refused then (they cut whole nodes of ids).
  std::vector<int> live;
};

class Topology {
 public:
  // Connects one group: its name, id (the same on every rank) and world ranks.
  using MakeGroup =
      std::function<std::shared_ptr<Group>(const std::string& name, int id, const std::vector<int>& ranks)>;

  // Rules that need the local world size (whole nodes per hierarchical
  // shard group), checked before any socket opens: InvalidConfig.
  // InvalidArgument naming the list unless `live` is empty or ascending,
  // distinct ids below world_size holding `rank`; InvalidConfig naming the
  // key when a live list that is not the whole world meets MiCS, hpZ or
  // qgZ's hierarchy.
  static void check(const TopologyShape& shape);
  // The live world ranks, ascending (shape.live, or 0 .. world_size - 1).
  static std::vector<int> live_ranks(const TopologyShape& shape);

  Topology(TopologyShape shape, MakeGroup make);
  // The world group (id 0), first; then build() cuts the rest from it.
  void make_world();
  void build();
  // InvalidArgument naming the list unless it is distinct live world ranks.
  void validate_group(const std::vector<int>& ranks) const;
  // A sub-group of live world ranks (validated).
  std::shared_ptr<Group> create_group(const std::vector<int>& ranks);
  // Shuts every group made here down (the context is going).
  void shutdown(const std::string& why);
  // Group::abort on every group made so far (healing: a rank was lost).
  void abort(Code code, const std::string& why);

  // Healing: every group made so far that this rank is a member of, with
  // its id, in the order made (ids ascending): what a new generation
  // reconnects (Group::reconnect), on every rank in the same order.
  std::vector<std::pair<int, std::shared_ptr<Group>>> groups() const;
  // A shrink (docs/healing.md, section 4): the world ranks in `live`
  // (ascending, this rank among them; fewer than before) go on. Checked
  // first as check() does (MiCS, hpZ and qgZ's hierarchy refused by their
  // keys, nothing changed). Then, in id order, on every rank alike: the
  // world and heal groups are cut again over the live ranks and reconnected
  // in place by `rejoin(group, id, members)` (their holders keep them);
  // another group with a lost member stays as the loss left it (aborted:
  // its collectives fail naming the loss), one without is reconnected with
  // its members. Returns the lost members' world ranks.
  using Rejoin = std::function<void(Group& group, int id, const std::vector<int>& members)>;
  std::vector<int> shrink(const std::vector<int>& live, const Rejoin& rejoin);
  // A regrow (docs/healing.md, section 4): ranks a shrink left out are back,
  // `live` (ascending, more than live now, all of them among it). In id
  // order, on every rank alike: the world and heal groups are cut over
  // `live` and reconnected by `rejoin`; another group reconnects with its
  // members when none of them was left out (one the shrink cut stays as it
  // was).
  void regrow(const std::vector<int>& live, const Rejoin& rejoin);
  // A regrow's joiner, before make_world: the world ranks live in the
  // generation it joins (checked as check() does).
  void start_live(const std::vector<int>& live);
  // The live world ranks, ascending.
  std::vector<int> live() const { return live_ranks(shape_); }
  // check() of this topology's shape with `live` as its live list.
  void check_live(const std::vector<int>& live) const {
    TopologyShape s = shape_;
    s.live = live;
    check(s);
  }

  // Every world rank's host (transport/host_id.h), learned once the world
  // is connected. InvalidArgument unless there is one per world rank.
  void set_hosts(const std::vector<std::string>& hosts);
  // How many distinct hosts the world spans (1 before set_hosts).
  int host_count() const { return host_count_; }
  // Every world rank's host index (empty before set_hosts, or one host).
  const std::vector<int>& host_of() const { return host_of_; }
  // The heal layer's group over the world (impl/heal/): made once, after
  // the ready round, so its messages never queue behind the world's.
  void make_heal();
  const std::shared_ptr<Group>& heal() const { return heal_; }
  // Whether some two members of `group` are on different hosts: what
  // decides whether its traffic is worth quantizing. A rank whose host is
  // unknown ("") counts as a host of its own.
  bool spans_hosts(const Group& group) const;

  const std::shared_ptr<Group>& world() const { return world_; }
  // Where params are partitioned: the world, or this rank's MiCS shard group.
  const std::shared_ptr<Group>& partition() const { return partition_; }
  const std::shared_ptr<Group>& mics_shard() const { return mics_shard_; }
  const std::shared_ptr<Group>& mics_replica() const { return mics_replica_; }
  const std::shared_ptr<Group>& hpz() const { return hpz_; }
  const std::shared_ptr<Group>& mics_inter() const { return mics_inter_; }
  const std::shared_ptr<Group>& mics_intra() const { return mics_intra_; }
  const std::shared_ptr<Group>& qgz_intra() const { return qgz_intra_; }
  const std::shared_ptr<Group>& qgz_inter() const { return qgz_inter_; }

 private:
  // This rank's member of a partition of the world into rank lists (null
  // when it is in none); an id is consumed for every list.
  std::shared_ptr<Group> family(const std::string& kind, const std::vector<std::vector<int>>& lists);
  std::shared_ptr<Group> make(const std::string& name, const std::vector<int>& ranks);
  void build_mics_hierarchy();
  // A shrink's or regrow's reconnects, in id order: the world and heal
  // groups over `after`; another group with its members when every one is
  // live both before and after (one cut by a loss stays as it was).
  void rejoin_all(const std::vector<int>& before, const std::vector<int>& after, const Rejoin& rejoin);
  void build_qgz_hierarchy();

  TopologyShape shape_;  // its live list changes at a shrink
  const MakeGroup make_;
  int next_id_ = 0;
  std::shared_ptr<Group> world_, partition_, mics_shard_, mics_replica_, hpz_;
  std::shared_ptr<Group> mics_inter_, mics_intra_;
  std::shared_ptr<Group> qgz_intra_, qgz_inter_;
  std::shared_ptr<Group> heal_;
  std::vector<std::pair<int, std::weak_ptr<Group>>> all_;  // with their ids
  std::vector<int> host_of_;  // world rank -> index of its host; empty: one host
  int host_count_ = 1;
};

// "[0,1,2]", for group names and messages.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace zs
