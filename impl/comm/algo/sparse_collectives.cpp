#include "impl/comm/algo/sparse_collectives.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "impl/device/buffer.h"

namespace zs::collectives::sparse {
namespace {

// Rounds wait for each other, and each uses its own message index, so a
// member that is both 2^j ahead and 2^k behind (few members) never mixes
// them up.
int ahead(const PointToPoint& p2p, int dist) { return (p2p.rank() + dist) % p2p.size(); }
int behind(const PointToPoint& p2p, int dist) {
  return (p2p.rank() - dist % p2p.size() + p2p.size()) % p2p.size();
}

}  // namespace

void rotated_all_gather(PointToPoint& p2p, void* buf, size_t block_bytes, uint32_t first_index) {
  const int n = p2p.size();
  if (block_bytes == 0) return;
  auto* base = static_cast<uint8_t*>(buf);
  uint32_t round = first_index;
  for (int dist = 1; dist < n; dist <<= 1, ++round) {
    // Blocks [0, dist) are ours so far; the member dist ahead holds the
    // next dist (clipped at n).
    const auto blocks = static_cast<size_t>(std::min(dist, n - dist));
    p2p.recv(ahead(p2p, dist), round, base + static_cast<size_t>(dist) * block_bytes,
             blocks * block_bytes);
    p2p.send(behind(p2p, dist), round, base, blocks * block_bytes);
    p2p.wait();
  }
}

void all_to_all(PointToPoint& p2p, const void* send, void* recv, size_t bytes_per_rank) {
  if (bytes_per_rank == 0) return;
  const int n = p2p.size();
  const int me = p2p.rank();
  const auto members = static_cast<size_t>(n);
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  // Slot i: the block that still has i members to go (it starts here as
  // the block for member me + i, and arrives with slot i intact).
  Buffer slots(members * bytes_per_rank, MemKind::CommStaging);
  auto* slot = static_cast<uint8_t*>(slots.data());
  for (size_t i = 0; i < members; ++i)
    std::memcpy(slot + i * bytes_per_rank,
                in + static_cast<size_t>((me + static_cast<int>(i)) % n) * bytes_per_rank,
                bytes_per_rank);
  Buffer outgoing(members / 2 * bytes_per_rank + bytes_per_rank, MemKind::CommStaging);
  Buffer incoming(members / 2 * bytes_per_rank + bytes_per_rank, MemKind::CommStaging);
  auto* pack = static_cast<uint8_t*>(outgoing.data());
  auto* unpack = static_cast<uint8_t*>(incoming.data());
  uint32_t round = 0;
  for (int dist = 1; dist < n; dist <<= 1, ++round) {
    size_t moved = 0;
    for (size_t i = 0; i < members; ++i)
      if (i & static_cast<size_t>(dist))
        std::memcpy(pack + moved++ * bytes_per_rank, slot + i * bytes_per_rank, bytes_per_rank);
    // Every member moves the same slots (they depend on n alone).
    p2p.recv(behind(p2p, dist), round, unpack, moved * bytes_per_rank);
    p2p.send(ahead(p2p, dist), round, pack, moved * bytes_per_rank);
    p2p.wait();
    moved = 0;
    for (size_t i = 0; i < members; ++i)
      if (i & static_cast<size_t>(dist))
        std::memcpy(slot + i * bytes_per_rank, unpack + moved++ * bytes_per_rank, bytes_per_rank);
  }
  // Slot i came from member me - i.
  for (size_t i = 0; i < members; ++i)
    std::memcpy(out + static_cast<size_t>((me - static_cast<int>(i) + n) % n) * bytes_per_rank,
                slot + i * bytes_per_rank, bytes_per_rank);
}

namespace {

// A member's place in the binomial tree rooted at root: its distance from
// the root, and the span of the subtree below it (the lowest set bit of the
// distance; the root's covers every member).
struct TreePlace {
  int v = 0;
  int span = 1;
};
TreePlace tree_place(const PointToPoint& p2p, int root) {
  const int n = p2p.size();
  TreePlace t;
  t.v = (p2p.rank() - root + n) % n;
  if (t.v == 0) {
    while (t.span < n) t.span <<= 1;
  } else {
    t.span = t.v & -t.v;
  }
  return t;
}

}  // namespace

void broadcast(PointToPoint& p2p, void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  const int n = p2p.size();
  const TreePlace t = tree_place(p2p, root);
  if (t.v != 0) {
    p2p.recv(behind(p2p, t.span), 0, buf, bytes);
    p2p.wait();
  }
  for (int mask = t.span >> 1; mask > 0; mask >>= 1)
    if (t.v + mask < n) p2p.send(ahead(p2p, mask), 0, buf, bytes);
  p2p.wait();
}

void scatter(PointToPoint& p2p, const std::vector<const void*>& inputs, void* recv, size_t bytes,
             int root) {
  if (bytes == 0) return;
  const int n = p2p.size();
  const TreePlace t = tree_place(p2p, root);
  // The blocks of this member's subtree, in distance order from it.
  const auto held = static_cast<size_t>(std::min(t.span, n - t.v));
  Buffer blocks(held * bytes, MemKind::CommStaging);
  auto* base = static_cast<uint8_t*>(blocks.data());
  if (t.v == 0) {
    for (size_t j = 0; j < held; ++j)
      std::memcpy(base + j * bytes, inputs[(static_cast<size_t>(root) + j) % held], bytes);
  } else {
    p2p.recv(behind(p2p, t.span), 0, base, held * bytes);
    p2p.wait();
  }
  for (int mask = t.span >> 1; mask > 0; mask >>= 1) {
    if (t.v + mask >= n) continue;
    const auto child_blocks = static_cast<size_t>(std::min(mask, n - t.v - mask));
    p2p.send(ahead(p2p, mask), 0, base + static_cast<size_t>(mask) * bytes, child_blocks * bytes);
  }
  std::memcpy(recv, base, bytes);
  p2p.wait();
}

void barrier(PointToPoint& p2p) {
  const int n = p2p.size();
  uint32_t round = 0;
  for (int dist = 1; dist < n; dist <<= 1, ++round) {
    uint8_t in = 0;
    const uint8_t out = 1;
    p2p.recv(behind(p2p, dist), round, &in, 1);
    p2p.send(ahead(p2p, dist), round, &out, 1);
    p2p.wait();
  }
}

}  // namespace zs::collectives::sparse
