// The one thing a transport must give the collective algorithms
// (collectives.h): messages between members of a group, posted in a batch
// and waited for together. A message is matched by (peer, index) within the
// collective in progress; the transport keys it further by the collective's
// identity, so messages of different collectives never match.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zs {

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // False when the member is connected only to its mesh_peers beyond the
  // full mesh (mesh_peers.h): the collectives then run the algorithms of
  // sparse_collectives.h, which message no other member.
  virtual bool full_mesh() const { return true; }
  // Post a message; the memory must stay valid until wait() returns.
  virtual void send(int peer, uint32_t index, const void* data, size_t bytes) = 0;
  virtual void recv(int peer, uint32_t index, void* data, size_t bytes) = 0;
  // Wait for every message posted since the last wait. Throws zs::Error.
  virtual void wait() = 0;
};

}  // namespace zs
