// Collectives for groups past the full mesh (mesh_peers.h): each member
// messages only the members 2^k ahead of it and behind it, and each
// collective takes ceil(log2 N) rounds (the direct algorithms of
// collectives.h post N - 1 messages a member at once). collectives.cpp
// picks these when PointToPoint::full_mesh() is false; reduce-scatter's ring
// (neighbours only) serves both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "impl/comm/algo/point_to_point.h"

namespace zs::collectives::sparse {

// Bruck's all-gather: buf holds size() blocks of block_bytes, this
// member's in block 0. On return block i holds member (rank() + i) %
// size()'s. Round k sends the blocks gathered so far to rank() - 2^k, as
// message first_index + k.
void rotated_all_gather(PointToPoint& p2p, void* buf, size_t block_bytes,
                        uint32_t first_index = 0);

// Bruck's all-to-all: round k forwards to rank() + 2^k every block whose
// distance to its destination has bit k set. Each block crosses about
// log2(N) / 2 links instead of one: the price of log N peers.
void all_to_all(PointToPoint& p2p, const void* send, void* recv, size_t bytes_per_rank);

// Binomial trees rooted at root: a member receives from the member 2^k
// behind it (k: its distance from the root's lowest set bit) and forwards
// to the members 2^j ahead of it, j < k.
void broadcast(PointToPoint& p2p, void* buf, size_t bytes, int root);
void scatter(PointToPoint& p2p, const std::vector<const void*>& inputs, void* recv, size_t bytes,
             int root);

// Dissemination: round k, one byte to rank() + 2^k and from rank() - 2^k.
void barrier(PointToPoint& p2p);

}  // namespace zs::collectives::sparse
