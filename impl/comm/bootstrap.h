// Who am I and where is everyone: rank and world from explicit options or
// from the variables launchers set (torchrun, Open MPI, Slurm), and the
// address of the rendezvous store.
#pragma once

#include <string>

namespace zs {

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string source;  // "options", "torchrun", "openmpi", "slurm" or "default"
};

// Explicit values (>= 0) win; -1 takes the environment. Throws
// Code::Bootstrap naming the variable and value when they disagree or are
// malformed (e.g. RANK=4 with WORLD_SIZE=4).
RankInfo resolve_ranks(int rank, int world_size, int local_rank, int local_world_size);

struct StoreAddress {
  std::string host;
  int port = 29500;
};

// host from options, else MASTER_ADDR, else 127.0.0.1; port from options,
// else ZS_STORE_PORT, else MASTER_PORT, else 29500.
StoreAddress resolve_store_address(const char* host, int port);

// Address the collective transport binds to: explicit, ZS_SOCKET_HOST,
// 127.0.0.1 for a loopback store, else this machine's host name.
std::string resolve_transport_host(const char* explicit_host, const std::string& store_host);

}  // namespace zs
