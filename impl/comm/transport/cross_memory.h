// Cross-memory attach: a rank reads a large message straight out of a peer
// process on the same host (process_vm_readv), one copy instead of loopback
// TCP's two, with no socket buffers in between. The Gloo communicator uses
// it per pair when both ends proved they can read each other (a nonce read
// back from the other's memory: same host, same pid namespace, ptrace
// allowed); otherwise, and with ZS_CROSS_MEMORY=0, the pair stays on TCP.
// Ranks of different hosts (host_id.h: another network namespace counts as
// another host) are not tried.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace zs {

// Messages of at least this many bytes go by cross-memory read on a pair
// that has it; smaller ones cost less as one TCP message.
constexpr size_t kCrossMemoryMinBytes = 256 * 1024;

// ZS_CROSS_MEMORY (default 1).
bool cross_memory_allowed();

// What a rank tells each peer so that the peer can try reading it.
struct CrossMemoryHello {
  char host[64];  // host_id.h: ranks on other hosts are not tried
  int64_t pid;
  uint64_t nonce_at;  // address of the nonce in the sender
  uint64_t nonce;
  uint64_t epoch_at;  // address of the sender's abandon count (below)
  uint8_t allowed;    // the sender's ZS_CROSS_MEMORY
};

// Ours, for a nonce that lives (at a fixed address) as long as the pair.
CrossMemoryHello cross_memory_hello(const uint64_t* nonce);

// Whether we can read the peer: allowed on both ends, same host, and its
// nonce read back from its memory.
bool cross_memory_reaches(const CrossMemoryHello& mine, const CrossMemoryHello& peer);

// Copies bytes at `from` in process pid into dst; false (errno set) when
// the kernel refuses or the peer is gone.
bool cross_memory_read(pid_t pid, void* dst, uint64_t from, size_t bytes);

// A large message sent as where it lies: the receiver reads it out of the
// sender (cross_memory_fetch) and acknowledges, and the sender keeps the
// memory until then. epoch is the sender's cross_memory_epoch() when it
// posted.
struct CrossMemoryAddress {
  uint64_t address = 0;
  uint64_t bytes = 0;
  uint64_t epoch = 0;
};
CrossMemoryAddress cross_memory_address(const void* data, size_t bytes);

// The size check of every receive: fails (Code::Comm, led by `what`) when
// rank `peer` sent `sent` bytes where rank `rank` expected `expected`.
void check_message_bytes(const std::string& what, int peer, uint64_t sent, int rank, uint64_t expected);

// Reads the message `where` names out of rank `peer` (process pid, whose
// abandon count lives at epoch_at) into dst (`bytes` expected) for rank
// `rank`. Throws zs::Error (Code::Comm), its text led by `what` (say
// "allgather on group 'g'"), for a size mismatch, a refused read, or a
// sender that abandoned the collective while being read.
void cross_memory_fetch(pid_t pid, uint64_t epoch_at, void* dst, size_t bytes,
                        const CrossMemoryAddress& where, int peer, int rank, const std::string& what);

// How many times this process has abandoned a collective whose memory peers
// may be reading. A sender bumps it before any memory of the failed
// collective can be freed; a reader compares it, after reading, with the
// count the sender's message carried: equal means the bytes were still the
// sender's when read. It lives as long as the process, at a fixed address.
void cross_memory_abandon();
uint64_t cross_memory_epoch();

// Bytes this process has read by cross memory so far (for tests and stats).
uint64_t cross_memory_bytes_read();

}  // namespace zs
