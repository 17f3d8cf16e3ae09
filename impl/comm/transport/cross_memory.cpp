#include "impl/comm/transport/cross_memory.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "impl/comm/transport/host_id.h"
#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs {
namespace {
std::atomic<uint64_t> bytes_read{0};
std::atomic<uint64_t> abandoned{0};
static_assert(sizeof(abandoned) == sizeof(uint64_t) && std::atomic<uint64_t>::is_always_lock_free);
}  // namespace

void cross_memory_abandon() { abandoned.fetch_add(1, std::memory_order_seq_cst); }
uint64_t cross_memory_epoch() { return abandoned.load(std::memory_order_seq_cst); }

uint64_t cross_memory_bytes_read() { return bytes_read.load(std::memory_order_relaxed); }

bool cross_memory_allowed() { return env_int("ZS_CROSS_MEMORY", 1) != 0; }

CrossMemoryHello cross_memory_hello(const uint64_t* nonce) {
  CrossMemoryHello h{};
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  std::strncpy(h.host, host_id().c_str(), sizeof(h.host) - 1);
  h.pid = static_cast<int64_t>(getpid());
  h.nonce_at = reinterpret_cast<uint64_t>(nonce);
  h.nonce = *nonce;
  h.epoch_at = reinterpret_cast<uint64_t>(&abandoned);
  h.allowed = cross_memory_allowed() && !boot.empty() ? 1 : 0;
  // Under Yama's ptrace_scope 1 only an ancestor may read us, and our
  // peers are siblings: let them (any process of our user, as MPI's
  // cross-memory transports do). Scopes 2 and 3 stay closed.
  int scope = 0;
  if (h.allowed && std::ifstream("/proc/sys/kernel/yama/ptrace_scope") >> scope && scope == 1)
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  return h;
}

bool cross_memory_reaches(const CrossMemoryHello& mine, const CrossMemoryHello& peer) {
  if (!mine.allowed || !peer.allowed) return false;
  if (std::strncmp(mine.host, peer.host, sizeof(mine.host)) != 0) return false;
  uint64_t seen = 0;
  return cross_memory_read(static_cast<pid_t>(peer.pid), &seen, peer.nonce_at, sizeof(seen)) &&
         seen == peer.nonce;
}

bool cross_memory_read(pid_t pid, void* dst, uint64_t from, size_t bytes) {
  auto* out = static_cast<char*>(dst);
  while (bytes > 0) {
    iovec local{out, bytes};
    iovec remote{reinterpret_cast<void*>(from), bytes};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      if (got == 0) errno = EFAULT;
      return false;
    }
    bytes_read.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
    out += got;
    from += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
  return true;
}

CrossMemoryAddress cross_memory_address(const void* data, size_t bytes) {
  return {reinterpret_cast<uint64_t>(data), bytes, cross_memory_epoch()};
}

void check_message_bytes(const std::string& what, int peer, uint64_t sent, int rank, uint64_t expected) {
  if (sent != expected)
    fail(Code::Comm, what, ": rank ", peer, " sent ", sent, " bytes where rank ", rank, " expected ", expected);
}

void cross_memory_fetch(pid_t pid, uint64_t epoch_at, void* dst, size_t bytes,
                        const CrossMemoryAddress& where, int peer, int rank, const std::string& what) {
  check_message_bytes(what, peer, where.bytes, rank, bytes);
  uint64_t epoch = 0;
  if (!cross_memory_read(pid, dst, where.address, bytes) ||
      !cross_memory_read(pid, &epoch, epoch_at, sizeof(epoch))) {
    const int err = errno;
    fail(Code::Comm, what, ": reading ", bytes, " bytes from rank ", peer,
         "'s memory failed: ", std::strerror(err), " (ZS_CROSS_MEMORY=0 sends everything over TCP)");
  }
  // Read after the bytes: unchanged, the sender had not given the
  // collective up (and freed its memory) before we were done.
  if (epoch != where.epoch)
    fail(Code::Comm, what, ": rank ", peer, " abandoned the collective while its memory was being read");
}

}  // namespace zs
