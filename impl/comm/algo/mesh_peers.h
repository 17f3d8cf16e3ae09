// Which members of a group a member connects to. Up to full_mesh_max
// members, every pair: the direct algorithms (collectives.h) post every
// message at once, the fastest on few ranks. Beyond, a member connects only
// to the members 1, 2, 4, ... ahead of it and behind it in ring order (at
// most 2 ceil(log2 N)), and the collectives run algorithms that need no
// other (sparse_collectives.h): sockets, store bytes and connect time then
// grow as N log N instead of N^2, and a small collective takes log N hops
// instead of N messages per rank.
#pragma once

#include <vector>

namespace zs {

// ZS_FULL_MESH_MAX's default, 32 members (34 sockets a rank): where the
// two met in bench_scale's one-float all-reduce (18 ms full mesh, 17 ms
// sparse at 32 ranks; 8 and 12 ms at 16; 65 and 19 ms at 64).
constexpr int kDefaultFullMeshMax = 32;

// ZS_FULL_MESH_MAX (a whole number >= 1), else the default; a malformed
// value throws Code::Bootstrap naming it. Every rank must use the same.
int full_mesh_max_from_env();

// The members `rank` of `size` connects to, ascending, without itself:
// all of them when size <= full_mesh_max, else rank +- 2^k (mod size).
// The relation is symmetric: b is among a's peers exactly when a is among b's.
std::vector<int> mesh_peers(int rank, int size, int full_mesh_max);

}  // namespace zs
