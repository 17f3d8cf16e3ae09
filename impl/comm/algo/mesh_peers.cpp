#include "impl/comm/algo/mesh_peers.h"

#include <algorithm>

#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs {

int full_mesh_max_from_env() {
  const int v = env_int("ZS_FULL_MESH_MAX", kDefaultFullMeshMax);
  if (v < 1)
    fail(Code::Bootstrap, "environment variable ZS_FULL_MESH_MAX=", v,
         ": expected the largest group that connects every pair (1 or more)");
  return v;
}

std::vector<int> mesh_peers(int rank, int size, int full_mesh_max) {
  std::vector<int> peers;
  if (size <= full_mesh_max) {
    for (int p = 0; p < size; ++p)
      if (p != rank) peers.push_back(p);
    return peers;
  }
  for (int dist = 1; dist < size; dist <<= 1) {
    peers.push_back((rank + dist) % size);
    peers.push_back((rank - dist + size) % size);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

}  // namespace zs
