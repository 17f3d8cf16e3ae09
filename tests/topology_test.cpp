// How a context's groups are cut from the world (comm/topology.h), on every
// rank of worlds of up to 16, without processes: each rank joins the groups
// the config asks for, and every rank numbers every group alike.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "impl/comm/topology.h"
#include "impl/common/error.h"

namespace zs {
namespace {

struct Made {
  std::map<std::string, int> ids;  // name -> id, for the groups this rank joined
  std::map<std::string, std::vector<int>> ranks;
};

// Builds rank `rank`'s topology with groups that are records, not sockets.
std::pair<std::unique_ptr<Topology>, Made> cut(TopologyShape shape, int rank) {
  shape.rank = rank;
  auto made = std::make_shared<Made>();
  auto t = std::make_unique<Topology>(shape, [made](const std::string& name, int id, const std::vector<int>& r) {
    made->ids[name] = id;
    made->ranks[name] = r;
    return std::make_shared<Group>(name, r, -1, nullptr, nullptr);  // a record: no thread
  });
  t->make_world();
  t->build();
  return {std::move(t), *made};
}

// Every rank that joins a group gives it the same id, and no two groups
// share one.
void expect_ids_agree(const TopologyShape& shape) {
  std::map<std::string, int> id_of;
  std::map<int, std::string> name_of;
  for (const int r : Topology::live_ranks(shape)) {
    const Made m = cut(shape, r).second;
    for (const auto& [name, id] : m.ids) {
      if (id_of.count(name)) {
        EXPECT_EQ(id_of[name], id) << name << " on rank " << r;
      }
      id_of[name] = id;
      if (name_of.count(id)) {
        EXPECT_EQ(name_of[id], name) << "id " << id;
      }
      name_of[id] = name;
    }
  }
}

// Hosts: counted in order of first appearance, an unknown one ("") as a
// host of its own; a group spans hosts when two members differ.
TEST(Topology, HostsDecideWhichGroupsSpanHosts) {
  TopologyShape s;
  s.world_size = 6;
  s.local_world_size = 6;
  auto [t, m] = cut(s, 0);
  EXPECT_EQ(t->host_count(), 1);
  EXPECT_FALSE(t->spans_hosts(*t->world())) << "before set_hosts";
  t->set_hosts({"a", "a", "b", "b", "", ""});
  EXPECT_EQ(t->host_count(), 4);
  EXPECT_TRUE(t->spans_hosts(*t->world()));
  const auto group = [](std::vector<int> ranks) { return Group("g", std::move(ranks), -1, nullptr, nullptr); };
  EXPECT_FALSE(t->spans_hosts(group({0, 1})));
  EXPECT_FALSE(t->spans_hosts(group({3, 2})));
  EXPECT_TRUE(t->spans_hosts(group({1, 2})));
  EXPECT_TRUE(t->spans_hosts(group({4, 5}))) << "two unknown hosts are not one";
  EXPECT_FALSE(t->spans_hosts(group({4})));
  t->set_hosts(std::vector<std::string>(6, "same"));
  EXPECT_EQ(t->host_count(), 1);
  EXPECT_FALSE(t->spans_hosts(*t->world()));
  EXPECT_THROW(t->set_hosts({"a"}), Error);
}

TEST(Topology, WorldOnlyByDefault) {
  TopologyShape s;
  s.world_size = 5;
  s.local_world_size = 5;
  auto [t, m] = cut(s, 3);
  EXPECT_EQ(t->world()->world_ranks(), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(t->partition(), t->world());
  EXPECT_EQ(t->mics_shard(), nullptr);
  EXPECT_EQ(t->hpz(), nullptr);
  EXPECT_EQ(t->qgz_intra(), nullptr);
  EXPECT_EQ(m.ids.at("world"), 0);
}

TEST(Topology, MicsShardsAndReplicas) {
  TopologyShape s;
  s.world_size = 8;
  s.local_world_size = 4;
  s.mics_shard_size = 4;
  auto [t, m] = cut(s, 5);
  EXPECT_EQ(t->mics_shard()->world_ranks(), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(t->mics_replica()->world_ranks(), (std::vector<int>{1, 5}));
  EXPECT_EQ(t->partition(), t->mics_shard());
  EXPECT_EQ(t->mics_inter(), nullptr);  // not hierarchical
  expect_ids_agree(s);
}

TEST(Topology, MicsHierarchyAcrossNodes) {
  TopologyShape s;
  s.world_size = 16;
  s.local_world_size = 4;
  s.mics_shard_size = 8;
  s.mics_hierarchical = true;
  auto [t, m] = cut(s, 13);
  EXPECT_EQ(t->mics_shard()->world_ranks(), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(t->mics_inter()->world_ranks(), (std::vector<int>{9, 13}));
  EXPECT_EQ(t->mics_intra()->world_ranks(), (std::vector<int>{12, 13, 14, 15}));
  expect_ids_agree(s);
  // A shard group inside one node gathers flat.
  s.mics_shard_size = 4;
  EXPECT_EQ(cut(s, 13).first->mics_inter(), nullptr);
}

TEST(Topology, HpzSecondaryGroups) {
  TopologyShape s;
  s.world_size = 6;
  s.local_world_size = 6;
  s.hpz_partition_size = 2;
  EXPECT_EQ(cut(s, 3).first->hpz()->world_ranks(), (std::vector<int>{2, 3}));
  expect_ids_agree(s);
}

TEST(Topology, QgzHopsOnlyOverWholeNodesWithoutMics) {
  TopologyShape s;
  s.world_size = 8;
  s.local_world_size = 4;
  s.quantized_gradients = true;
  auto [t, m] = cut(s, 6);
  EXPECT_EQ(t->qgz_intra()->world_ranks(), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(t->qgz_inter()->world_ranks(), (std::vector<int>{2, 6}));
  expect_ids_agree(s);
  s.local_world_size = 8;  // one node: the single all-to-all
  EXPECT_EQ(cut(s, 6).first->qgz_intra(), nullptr);
  s.local_world_size = 3;  // not whole nodes
  EXPECT_EQ(cut(s, 6).first->qgz_intra(), nullptr);
  s.local_world_size = 4;
  s.mics_shard_size = 4;  // MiCS reduces over replicas instead
  EXPECT_EQ(cut(s, 6).first->qgz_intra(), nullptr);
}

TEST(Topology, BadShapesAndListsAreNamed) {
  TopologyShape s;
  s.world_size = 8;
  s.local_world_size = 4;
  s.mics_shard_size = 6;
  s.mics_hierarchical = true;
  try {
    Topology::check(s);
    ADD_FAILURE() << "a shard group of 6 over nodes of 4 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::InvalidConfig);
    EXPECT_NE(std::string(e.what()).find("mics_shard_size 6 must be a multiple of the local world size 4"),
              std::string::npos) << e.what();
  }
  TopologyShape w;
  w.world_size = 4;
  auto [t, m] = cut(w, 0);
  for (const auto& [list, words] : std::vector<std::pair<std::vector<int>, std::string>>{
           {{}, "at least one rank"}, {{1, 1}, "rank 1 appears twice"}, {{0, 4}, "rank 4 is out of range"}}) {
    try {
      t->validate_group(list);
      ADD_FAILURE() << words;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(t->create_group({2, 0})->name(), "group1[2,0]");
}

// After a shrink (docs/healing.md, section 4) ranks keep their ids: the
// world and heal groups are cut over the live ones, on every live rank
// with the same ids; a group naming a lost rank, a live list without this
// rank or out of order, and the node-cut families over a partial world are
// refused by name. A full live list cuts what no list does.
TEST(Topology, ALiveListCutsTheWorldAndHealGroupsOverTheLiveIds) {
  TopologyShape s;
  s.world_size = 5;
  s.live = {0, 1, 3, 4};
  for (const int r : s.live) {
    auto [t, m] = cut(s, r);
    t->make_heal();
    EXPECT_EQ(t->world()->world_ranks(), s.live) << "rank " << r;
    EXPECT_EQ(t->heal()->world_ranks(), s.live) << "rank " << r;
    EXPECT_EQ(t->partition(), t->world());
    EXPECT_EQ(t->world()->size(), 4);
    EXPECT_EQ(t->create_group({4, 0})->world_ranks(), (std::vector<int>{4, 0}));
    try {
      t->validate_group({0, 2});
      ADD_FAILURE() << "a group with lost rank 2 was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("rank 2 is not among the live ranks [0,1,3,4]"), std::string::npos)
          << e.what();
    }
  }
  expect_ids_agree(s);
  TopologyShape full;
  full.world_size = 3;
  full.live = {0, 1, 2};
  TopologyShape none;
  none.world_size = 3;
  EXPECT_EQ(cut(full, 1).second.ranks, cut(none, 1).second.ranks);

  const auto refused = [](TopologyShape bad, Code code, const std::string& words) {
    try {
      Topology::check(bad);
      ADD_FAILURE() << words;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  TopologyShape bad = s;
  bad.rank = 2;
  refused(bad, Code::InvalidArgument, "this rank, 2, is not among them");
  bad = s;
  bad.live = {0, 3, 1};
  refused(bad, Code::InvalidArgument, "live ranks [0,3,1]: expected distinct ranks below the world size 5");
  bad.live = {0, 5};
  refused(bad, Code::InvalidArgument, "live ranks [0,5]");
  bad = s;
  bad.world_size = 6;
  bad.live = {0, 1, 2, 4, 5};
  bad.mics_shard_size = 3;
  refused(bad, Code::InvalidConfig, "zero_optimization.mics_shard_size cuts the world into whole nodes");
  bad.mics_shard_size = 0;
  bad.hpz_partition_size = 2;
  refused(bad, Code::InvalidConfig, "zero_optimization.zero_hpz_partition_size");
  bad.hpz_partition_size = 0;
  bad.quantized_gradients = true;
  bad.local_world_size = 3;
  refused(bad, Code::InvalidConfig, "zero_optimization.zero_quantized_gradients");
  bad.local_world_size = 1;  // one rank a node: qgZ's single all-to-all works over any world
  Topology::check(bad);
}

}  // namespace
}  // namespace zs
