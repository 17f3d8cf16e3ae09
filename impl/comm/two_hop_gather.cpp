#include "impl/comm/two_hop_gather.h"

#include <utility>

#include "impl/device/ops.h"

namespace zs {
namespace {

// Hop 2 leaves the units rank-major within the node: [local l][node n];
// the shard group wants [n * local + l].
void reorder(const uint8_t* src, uint8_t* dst, int nodes, int local, size_t unit,
             std::vector<ops::Copy>& copies) {
  for (int l = 0; l < local; ++l)
    for (int n = 0; n < nodes; ++n)
      copies.push_back({dst + static_cast<size_t>(n * local + l) * unit,
                        src + static_cast<size_t>(l * nodes + n) * unit, unit});
}

}  // namespace

std::shared_ptr<Work> submit_two_hop_gather(Group& inter, Group& intra,
                                            const std::shared_ptr<Device>& dev,
                                            TwoHopGather gather, const std::string& what) {
  const int nodes = inter.size(), local = intra.size();
  std::vector<GatherSegment> hop1, hop2, quantized_hop2;
  // Hop 2's output per unit and where it goes, in hop 2's order.
  struct Place {
    const uint8_t* from;
    uint8_t* to;
    size_t bytes;
  };
  std::vector<Place> places, quantized_places;
  auto keep = std::move(gather.keep);
  for (const auto& u : gather.units) {
    auto t1 = std::make_shared<Buffer>(dev, u.bytes * static_cast<size_t>(nodes), MemKind::CommStaging);
    auto t2 = std::make_shared<Buffer>(dev, u.bytes * static_cast<size_t>(nodes * local), MemKind::CommStaging);
    keep.push_back(t1);
    keep.push_back(t2);
    hop1.push_back({u.send, t1->data(), u.bytes, u.quantized});
    const GatherSegment second{t1->data(), t2->data(), u.bytes * static_cast<size_t>(nodes),
                               u.quantized};
    const Place place{static_cast<const uint8_t*>(t2->data()), static_cast<uint8_t*>(u.recv),
                      u.bytes};
    (u.quantized ? quantized_hop2 : hop2).push_back(second);
    (u.quantized ? quantized_places : places).push_back(place);
  }
  // Quantized units join the same hop-2 operation, after the exact ones.
  hop2.insert(hop2.end(), quantized_hop2.begin(), quantized_hop2.end());
  places.insert(places.end(), quantized_places.begin(), quantized_places.end());

  auto first = inter.submit(what + " (MiCS hop 1: across nodes)",
                            [hop1, keep, before = std::move(gather.before)](Communicator& c) {
                              if (before) before();
                              c.allgather_coalesced(hop1);
                            });
  return intra.submit(what + " (MiCS hop 2: within the node)",
                      [first, hop2, places, nodes, local, keep, dev,
                       after = std::move(gather.after)](Communicator& c) {
                        first->wait(-1);
                        c.allgather_coalesced(hop2);
                        std::vector<ops::Copy> copies;
                        for (const auto& p : places)
                          reorder(p.from, p.to, nodes, local, p.bytes, copies);
                        ops::copy_many(*dev, copies, CopyKind::GatherStaging);
                        if (after) after();
                        dev->synchronize();
                      });
}

}  // namespace zs
