// MiCS's hierarchical all-gather in two hops, over two groups of the same
// ranks: `inter` joins the ranks with the same local rank across nodes,
// `intra` the ranks of one node. Hop 1 gathers every unit across nodes
// (on inter's thread), hop 2 gathers those within the node (on intra's
// thread, after hop 1), and the units are put back in the order of the
// shard group, whose member node * local + l is local rank l of node n.
// Only the transports' all-gather is used; which groups and units a fetch
// uses (and what a unit is: a shard, or a qwZ packet) is the caller's.
//
// Hop 2 takes its place in intra's queue when it is submitted, not when
// hop 1 ends: every rank must run intra's collectives in one order, and a
// hop 2 queued on completion would race whatever the caller queues on
// intra meanwhile. So intra's thread waits for hop 1 at hop 2's turn;
// nothing queued behind it could run earlier anyway, and the wait is
// bounded by hop 1's own failure (transport error, heartbeat, timeout),
// which hop 2 then reports.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "impl/comm/algo/communicator.h"
#include "impl/comm/group.h"
#include "impl/comm/work.h"
#include "impl/device/buffer.h"

namespace zs {

struct TwoHopGather {
  // Each unit: this rank's `bytes` at send; recv holds bytes * nodes *
  // local, shard-group member k's unit at k * bytes. `quantized` marks a
  // qwZ packet (counted apart in the stats); quantized units travel in
  // hop 2 after the exact ones.
  std::vector<GatherSegment> units;
  // Run on inter's thread before hop 1 (qwZ packs its packets), and on
  // intra's thread after the units are in place, before the device is
  // synchronized (qwZ unpacks them). Either may be empty.
  std::function<void()> before;
  std::function<void()> after;
  // Held until both hops are done (the memory units point into).
  std::vector<BufferPtr> keep;
};

// Queues both hops; the returned work (hop 2's) completes when the units
// are in recv, or fails with hop 1's or hop 2's error. `what` names the
// gather in the groups' work (" (MiCS hop 1: across nodes)" and
// " (MiCS hop 2: within the node)" are appended).
std::shared_ptr<Work> submit_two_hop_gather(Group& inter, Group& intra,
                                            const std::shared_ptr<Device>& dev,
                                            TwoHopGather gather, const std::string& what);

}  // namespace zs
