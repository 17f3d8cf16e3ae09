// Collectives over Gloo's TCP transport: the CPU backend PyTorch uses.
// A group's members connect through the rendezvous store, every pair up to
// full_mesh_max members and 2 log N pairs each beyond (mesh_peers.h); all
// groups of a process share one transport device.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "impl/comm/algo/communicator.h"
#include "impl/comm/algo/mesh_peers.h"
#include "impl/comm/store/store.h"

namespace gloo::transport {
class Device;
}

namespace zs {

class Heartbeat;

// The process's transport device, bound to host (an address or a name).
std::shared_ptr<gloo::transport::Device> make_gloo_device(const std::string& host);

// Connect rank/size through store (keys should be prefixed per group).
// Throws Code::Timeout or Code::Comm naming the group. watch_store (the same
// group store, kept for the communicator's life) is where ranks compare
// collective identities when one waits too long; null turns that off.
// heartbeat (null: off) cuts a wait short once a member, whose world rank
// is world_ranks[group rank], has been silent too long.
std::unique_ptr<Communicator> make_gloo_communicator(
    const std::string& group_name, int rank, int size, Store& store,
    const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
    std::shared_ptr<Store> watch_store = nullptr, std::shared_ptr<Heartbeat> heartbeat = nullptr,
    std::vector<int> world_ranks = {}, int full_mesh_max = kDefaultFullMeshMax);

}  // namespace zs
