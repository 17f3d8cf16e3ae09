// Point-to-point messages between the ranks of one host through shared
// memory instead of loopback TCP. Each rank owns an inbox (a memfd its
// peers map through /proc/<pid>/fd): one ring per sender and a doorbell, a
// futex word that whoever gives the owner something to do bumps, waking it
// only when it sleeps. A small message is copied through the ring; a large
// one goes as its address, which the receiver reads out of the sender
// (cross_memory.h) and acknowledges through the sender's inbox.
//
// Why: with Gloo's TCP pairs every message is a notification, a write and
// a wake of the peer's event loop, which spins on the pair's lock while our
// thread holds it (docs/benchmarks.md: about 0.2 s of a core a DPO step on
// two ranks). Here a collective's messages cost no system call unless a
// rank has to sleep.
//
// A group uses its rings only when every pair of it reads by cross memory
// and every member mapped every peer's inbox (ZS_SHARED_MEMORY=0 on any
// member keeps the group on TCP); the group's pairs stay connected for the
// connection checks. Failure: a member whose collective fails marks its
// inbox closed and wakes its peers, whose waits then fail naming it, as a
// closed TCP pair would; a peer whose process exited is found within a
// sleep's slice (20 ms) through its pidfd (or, where pidfds are refused,
// once reaped); an interrupt (the collective watch, a silent member) ends
// the wait in flight. A member that completed and left is not a failure
// while what it sent is still to be taken: that is in our own inbox, as
// data a closed TCP pair delivered before its end of stream would be.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "impl/comm/transport/cross_memory.h"

namespace zs {

// ZS_SHARED_MEMORY (default 1).
bool shared_memory_allowed();

// Messages this process has received through rings so far, and how many of
// them came before their receive was posted (for tests and stats).
uint64_t shared_memory_messages();
uint64_t shared_memory_early_messages();

// The bytes of one inbox for a group of `size`: what each member holds for
// the group (memory kind Inboxes); the peers' inboxes it maps are theirs.
size_t shared_memory_inbox_bytes(int size);

class SharedMemoryRings {
 public:
  // What a member tells each peer so that the peer can map its inbox.
  struct Hello {
    int64_t pid = 0;
    int32_t fd = -1;
    uint32_t eligible = 0;  // 0: this member keeps the group on TCP
    uint64_t bytes = 0;     // the inbox's size
  };

  // This member's inbox for a group of `size`; null when the system
  // refuses one (then the group stays on TCP).
  static std::unique_ptr<SharedMemoryRings> create(int rank, int size);
  ~SharedMemoryRings();
  SharedMemoryRings(const SharedMemoryRings&) = delete;
  SharedMemoryRings& operator=(const SharedMemoryRings&) = delete;

  Hello hello() const;
  // Maps the peer's inbox; false when it cannot be opened or has another
  // size. epoch_at: where the peer's abandon count lives (cross_memory.h).
  bool attach(int peer, const Hello& theirs, uint64_t epoch_at);

  // Post a message keyed by slot; data stays valid until wait() returns.
  void send(int peer, uint64_t slot, const void* data, size_t bytes);
  void recv(int peer, uint64_t slot, void* data, size_t bytes);

  // Delivers everything posted since the last wait. False when interrupt()
  // cut it short. Throws zs::Error (Code::Comm) for a peer that closed its
  // inbox or exited, or a size mismatch, and a std::runtime_error whose
  // text says "Timed out" past timeout.
  bool wait(std::chrono::milliseconds timeout, const std::string& group, const char* op);

  // From any thread: the wait in flight (or the next) returns false.
  void interrupt();
  void clear_interrupt();
  // This member gives the group up: peers' waits fail naming it.
  void close();
  // Drops everything posted (after a failure).
  void forget();

 private:
  SharedMemoryRings(int rank, int size, int fd, void* base, size_t bytes);

  struct Out {
    uint32_t kind;
    uint64_t slot;
    const void* data;
    uint64_t bytes;
    CrossMemoryAddress where;
  };
  struct In {
    void* dst;
    uint64_t bytes;
  };
  struct Stashed {
    uint32_t kind;
    uint64_t bytes;
    std::vector<char> payload;  // inline bytes
    CrossMemoryAddress where;
  };
  using Key = std::pair<int, uint64_t>;  // (peer, slot)

  struct Peer {
    char* base = nullptr;  // its inbox, mapped
    int pidfd = -1;
    pid_t pid = 0;
    uint64_t epoch_at = 0;
    std::deque<Out> out;   // posted to it, not yet in its ring
  };

  In pop_posted(std::map<Key, std::deque<In>>::iterator it);
  void push(int peer);
  bool drain(int peer, const std::string& what);
  void take(int peer, const Key& key, In in, Stashed& msg, const std::string& what);
  bool drain_all(const std::string& what);
  std::string gone_peer() const;
  bool done() const;

  const int rank_, size_;
  int fd_ = -1;
  char* base_ = nullptr;  // our inbox
  size_t bytes_ = 0;
  std::vector<Peer> peers_;
  // Keys are erased once nothing is left under them: empty maps, nothing owed.
  std::map<Key, std::deque<In>> posted_;
  std::map<Key, std::deque<Stashed>> stash_;
  std::map<Key, size_t> acks_owed_;  // large sends the peer has not acknowledged
  std::atomic<bool> interrupted_{false};
};

}  // namespace zs
