#include "impl/comm/bootstrap.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs {
namespace {

bool has_env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// Slurm's per-node task counts look like "4" or "2(x3),1".
int slurm_tasks_on_first_node(const char* spec) {
  char* end = nullptr;
  const long v = std::strtol(spec, &end, 10);
  return (end != spec && v > 0) ? static_cast<int>(v) : -1;
}

}  // namespace

RankInfo resolve_ranks(int rank, int world_size, int local_rank, int local_world_size) {
  RankInfo info;
  info.source = "default";
  int env_rank = -1, env_world = -1, env_local = -1, env_local_world = -1;
  if (has_env("RANK") || has_env("WORLD_SIZE")) {
    info.source = "torchrun";
    env_rank = env_int("RANK", -1);
    env_world = env_int("WORLD_SIZE", -1);
    env_local = env_int("LOCAL_RANK", -1);
    env_local_world = env_int("LOCAL_WORLD_SIZE", -1);
  } else if (has_env("OMPI_COMM_WORLD_RANK")) {
    info.source = "openmpi";
    env_rank = env_int("OMPI_COMM_WORLD_RANK", -1);
    env_world = env_int("OMPI_COMM_WORLD_SIZE", -1);
    env_local = env_int("OMPI_COMM_WORLD_LOCAL_RANK", -1);
    env_local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", -1);
  } else if (has_env("SLURM_PROCID")) {
    info.source = "slurm";
    env_rank = env_int("SLURM_PROCID", -1);
    env_world = env_int("SLURM_NTASKS", -1);
    env_local = env_int("SLURM_LOCALID", -1);
    if (has_env("SLURM_NTASKS_PER_NODE")) {
      env_local_world = env_int("SLURM_NTASKS_PER_NODE", -1);
    } else if (has_env("SLURM_TASKS_PER_NODE")) {
      env_local_world = slurm_tasks_on_first_node(std::getenv("SLURM_TASKS_PER_NODE"));
    }
  }
  if (rank >= 0 || world_size >= 0) info.source = "options";
  info.rank = rank >= 0 ? rank : env_rank;
  info.world_size = world_size >= 0 ? world_size : env_world;
  if (info.rank < 0 && info.world_size < 0) {
    info.rank = 0;
    info.world_size = 1;
  }
  if (info.world_size < 1)
    fail(Code::Bootstrap, "world size is ", info.world_size, " (from ", info.source,
         "): set WORLD_SIZE or options.world_size to at least 1");
  if (info.rank < 0)
    fail(Code::Bootstrap, "rank is unknown (from ", info.source,
         "): set RANK or options.rank alongside the world size ", info.world_size);
  if (info.rank >= info.world_size)
    fail(Code::Bootstrap, "rank ", info.rank, " is out of range for world size ",
         info.world_size, " (from ", info.source, ")");
  info.local_rank = local_rank >= 0 ? local_rank : (env_local >= 0 ? env_local : info.rank);
  info.local_world_size = local_world_size >= 0
                              ? local_world_size
                              : (env_local_world >= 1 ? env_local_world : info.world_size);
  if (info.local_rank >= info.local_world_size)
    fail(Code::Bootstrap, "local rank ", info.local_rank, " is out of range for local world size ",
         info.local_world_size, " (from ", info.source, ")");
  return info;
}

StoreAddress resolve_store_address(const char* host, int port) {
  StoreAddress a;
  if (host != nullptr && *host != '\0') {
    a.host = host;
  } else if (has_env("MASTER_ADDR")) {
    a.host = std::getenv("MASTER_ADDR");
  } else {
    a.host = "127.0.0.1";
  }
  // ZS_STORE_PORT first: a launcher that hands MASTER_PORT to torch's own
  // store (zsrun, zeroshard.torch under Slurm) gives the engine another one.
  const char* from = "options.store_port";
  if (port >= 0) {
    a.port = port;
  } else if (has_env("ZS_STORE_PORT")) {
    a.port = env_int("ZS_STORE_PORT", 0);
    from = "ZS_STORE_PORT";
  } else {
    a.port = env_int("MASTER_PORT", 29500);
    from = has_env("MASTER_PORT") ? "MASTER_PORT" : "the default";
  }
  if (a.port < 1 || a.port > 65535)
    fail(Code::Bootstrap, "store port ", a.port, " (from ", from, "): expected 1..65535");
  return a;
}

std::string resolve_transport_host(const char* explicit_host, const std::string& store_host) {
  if (explicit_host != nullptr && *explicit_host != '\0') return explicit_host;
  if (has_env("ZS_SOCKET_HOST")) return std::getenv("ZS_SOCKET_HOST");
  if (is_loopback(store_host)) return "127.0.0.1";
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0)
    fail(Code::Bootstrap, "gethostname failed: ", std::strerror(errno),
         " (set ZS_SOCKET_HOST to this machine's address)");
  return name;
}

}  // namespace zs
