// Which host a rank runs on. Two things pay only between ranks of one host
// and one only between ranks of different hosts: reading a peer's memory
// (cross_memory.h), and quantizing what a collective sends (ZeRO++ qwZ and
// qgZ: memory-speed traffic is not worth the precision it costs; traffic
// over a network is). A host is one kernel (boot id) and one network
// namespace: ranks in different network namespaces talk through a network
// device even on one machine (containers; bench_quant's "nodes").
// ZS_HOST_ID overrides it, for a launcher that knows better, or a test that
// plays several hosts on one machine.
#pragma once

#include <cstddef>
#include <string>

namespace zs {

// Longest host id (ZS_HOST_ID is refused past it).
constexpr size_t kHostIdMax = 63;

// ZS_HOST_ID, or "<boot id>/net:<namespace inode>"; "" when neither the
// variable is set nor /proc tells. Throws Code::Bootstrap for a ZS_HOST_ID
// that is longer than kHostIdMax or holds a character outside [A-Za-z0-9._:/-].
std::string host_id();

}  // namespace zs
