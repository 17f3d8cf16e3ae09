#include "impl/comm/transport/shared_memory_rings.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <new>
#include <stdexcept>

#include "impl/common/env.h"
#include "impl/common/error.h"
#include "impl/common/memory_tally.h"

namespace zs {
namespace {

// A ring holds a few messages of the largest inline size, so a sender
// rarely waits for room; larger messages go as their address.
constexpr size_t kRingBytes = 512 * 1024;
constexpr size_t kInlineMax = 64 * 1024;
// A sleeping wait wakes this often to notice a peer's exit (its pidfd).
constexpr auto kSlice = std::chrono::milliseconds(20);

constexpr uint32_t kInline = 1;   // the bytes follow
constexpr uint32_t kAddress = 2;  // a CrossMemoryAddress follows
constexpr uint32_t kAck = 3;      // the receiver has read an address's bytes

// The inbox: its owner's doorbell, then a ring per sender.
struct alignas(64) Doorbell {
  std::atomic<uint32_t> bell;      // bumped by whoever gives the owner work
  std::atomic<uint32_t> sleeping;  // the owner is (about to be) in futex_wait
  std::atomic<uint32_t> closed;    // the owner gave the group up
};
struct alignas(64) RingHeader {
  std::atomic<uint64_t> head;  // bytes written, by the sender
  char pad[56];
  std::atomic<uint64_t> tail;  // bytes consumed, by the owner
};
struct MessageHeader {
  uint64_t slot;
  uint64_t bytes;  // the message's (an address's: the bytes it names)
  uint32_t kind;
  uint32_t payload;  // bytes following in the ring
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

constexpr size_t kRingStride = sizeof(RingHeader) + kRingBytes;
size_t inbox_bytes(int size) { return sizeof(Doorbell) + static_cast<size_t>(size) * kRingStride; }
Doorbell* doorbell(char* inbox) { return reinterpret_cast<Doorbell*>(inbox); }
RingHeader* ring(char* inbox, int sender) {
  return reinterpret_cast<RingHeader*>(inbox + sizeof(Doorbell) + static_cast<size_t>(sender) * kRingStride);
}
char* ring_data(char* inbox, int sender) { return reinterpret_cast<char*>(ring(inbox, sender) + 1); }
size_t round8(size_t n) { return (n + 7) & ~size_t{7}; }

void copy_in(char* data, uint64_t at, const void* src, size_t n) {
  if (n == 0) return;  // src may be null
  const size_t off = at % kRingBytes, first = std::min(n, kRingBytes - off);
  std::memcpy(data + off, src, first);
  std::memcpy(data, static_cast<const char*>(src) + first, n - first);
}
void copy_out(void* dst, const char* data, uint64_t at, size_t n) {
  if (n == 0) return;  // dst may be null
  const size_t off = at % kRingBytes, first = std::min(n, kRingBytes - off);
  std::memcpy(dst, data + off, first);
  std::memcpy(static_cast<char*>(dst) + first, data, n - first);
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Wakes an inbox's owner if it sleeps (the bump first: an owner about to
// sleep sees it and does not).
void ring_bell(char* inbox) {
  Doorbell* d = doorbell(inbox);
  d->bell.fetch_add(1, std::memory_order_seq_cst);
  if (d->sleeping.load(std::memory_order_seq_cst)) futex(&d->bell, FUTEX_WAKE, INT_MAX, nullptr);
}

std::atomic<uint64_t> messages{0}, early_messages{0};

}  // namespace

uint64_t shared_memory_messages() { return messages.load(std::memory_order_relaxed); }
uint64_t shared_memory_early_messages() { return early_messages.load(std::memory_order_relaxed); }

bool shared_memory_allowed() { return env_int("ZS_SHARED_MEMORY", 1) != 0; }

size_t shared_memory_inbox_bytes(int size) { return inbox_bytes(size); }

std::unique_ptr<SharedMemoryRings> SharedMemoryRings::create(int rank, int size) {
  const int fd = memfd_create("zeroshard-inbox", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  const size_t bytes = inbox_bytes(size);
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0)
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    ::close(fd);
    return nullptr;
  }
  new (base) Doorbell{};
  for (int s = 0; s < size; ++s) new (ring(static_cast<char*>(base), s)) RingHeader{};
  memory_tally::add(MemKind::Inboxes, bytes);  // the memory report's "inboxes"
  return std::unique_ptr<SharedMemoryRings>(new SharedMemoryRings(rank, size, fd, base, bytes));
}

SharedMemoryRings::SharedMemoryRings(int rank, int size, int fd, void* base, size_t bytes)
    : rank_(rank), size_(size), fd_(fd), base_(static_cast<char*>(base)), bytes_(bytes),
      peers_(static_cast<size_t>(size)) {}

SharedMemoryRings::~SharedMemoryRings() {
  close();  // a peer still waiting on us fails instead of waiting out its timeout
  for (auto& p : peers_) {
    if (p.base) munmap(p.base, bytes_);
    if (p.pidfd >= 0) ::close(p.pidfd);
  }
  munmap(base_, bytes_);
  ::close(fd_);
  memory_tally::sub(MemKind::Inboxes, bytes_);
}

SharedMemoryRings::Hello SharedMemoryRings::hello() const {
  return {static_cast<int64_t>(getpid()), fd_, 1, bytes_};
}

bool SharedMemoryRings::attach(int peer, const Hello& theirs, uint64_t epoch_at) {
  if (!theirs.eligible || theirs.bytes != bytes_) return false;
  const std::string path = "/proc/" + std::to_string(theirs.pid) + "/fd/" + std::to_string(theirs.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st{};
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes_)
    base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return false;
  Peer& p = peers_[static_cast<size_t>(peer)];
  p.base = static_cast<char*>(base);
  p.pid = static_cast<pid_t>(theirs.pid);
  p.epoch_at = epoch_at;
  // -1 where the kernel or a seccomp filter refuses: then an exit is seen
  // once the launcher has reaped the process (check_peers).
  p.pidfd = static_cast<int>(syscall(SYS_pidfd_open, p.pid, 0));
  return true;
}

void SharedMemoryRings::send(int peer, uint64_t slot, const void* data, size_t bytes) {
  Out o{kInline, slot, data, bytes, {}};
  if (bytes >= kInlineMax) {
    o.kind = kAddress;
    o.where = cross_memory_address(data, bytes);
    ++acks_owed_[{peer, slot}];
  }
  peers_[static_cast<size_t>(peer)].out.push_back(o);
  push(peer);  // now, so that the peer can start on it
}

void SharedMemoryRings::recv(int peer, uint64_t slot, void* data, size_t bytes) {
  posted_[{peer, slot}].push_back({data, bytes});
}

// The oldest receive posted under `it`, taken off (its key with it once
// none is left).
SharedMemoryRings::In SharedMemoryRings::pop_posted(std::map<Key, std::deque<In>>::iterator it) {
  const In in = it->second.front();
  it->second.pop_front();
  if (it->second.empty()) posted_.erase(it);
  return in;
}

// Writes what fits of the peer's queue into its ring.
void SharedMemoryRings::push(int peer) {
  Peer& p = peers_[static_cast<size_t>(peer)];
  if (p.out.empty()) return;
  RingHeader* r = ring(p.base, rank_);
  char* data = ring_data(p.base, rank_);
  uint64_t head = r->head.load(std::memory_order_relaxed);
  const uint64_t tail = r->tail.load(std::memory_order_acquire);
  bool wrote = false;
  while (!p.out.empty()) {
    const Out& o = p.out.front();
    const size_t payload = o.kind == kInline ? o.bytes : o.kind == kAddress ? sizeof(CrossMemoryAddress) : 0;
    const size_t need = sizeof(MessageHeader) + round8(payload);
    if (need > kRingBytes - (head - tail)) break;
    const MessageHeader h{o.slot, o.bytes, o.kind, static_cast<uint32_t>(payload)};
    copy_in(data, head, &h, sizeof(h));
    if (o.kind == kInline) copy_in(data, head + sizeof(h), o.data, o.bytes);
    if (o.kind == kAddress) copy_in(data, head + sizeof(h), &o.where, sizeof(o.where));
    head += need;
    p.out.pop_front();
    wrote = true;
  }
  if (!wrote) return;
  r->head.store(head, std::memory_order_release);
  ring_bell(p.base);
}

// Hands a message to the receive posted for it: copies it, or reads it out
// of the sender and acknowledges.
void SharedMemoryRings::take(int peer, const Key& key, In in, Stashed& msg, const std::string& what) {
  if (msg.kind == kInline) {
    check_message_bytes(what, peer, msg.bytes, rank_, in.bytes);
    if (in.bytes) std::memcpy(in.dst, msg.payload.data(), in.bytes);
    return;
  }
  Peer& p = peers_[static_cast<size_t>(peer)];
  cross_memory_fetch(p.pid, p.epoch_at, in.dst, in.bytes, msg.where, peer, rank_, what);
  p.out.push_back({kAck, key.second, nullptr, 0, {}});
}

// Consumes the peer's ring: each message to its posted receive, or aside
// until one is posted. True when there was anything.
bool SharedMemoryRings::drain(int peer, const std::string& what) {
  RingHeader* r = ring(base_, peer);
  const char* data = ring_data(base_, peer);
  uint64_t tail = r->tail.load(std::memory_order_relaxed);
  const uint64_t head = r->head.load(std::memory_order_acquire);
  if (tail == head) return false;
  while (tail < head) {
    MessageHeader h{};
    copy_out(&h, data, tail, sizeof(h));
    const uint64_t at = tail + sizeof(h);
    tail = at + round8(h.payload);
    const Key key{peer, h.slot};
    if (h.kind == kAck) {
      auto it = acks_owed_.find(key);
      if (it == acks_owed_.end()) continue;  // of a collective given up
      if (--it->second == 0) acks_owed_.erase(it);
      continue;
    }
    messages.fetch_add(1, std::memory_order_relaxed);
    auto posted = posted_.find(key);
    if (posted != posted_.end()) {
      const In in = pop_posted(posted);
      if (h.kind == kInline) {
        check_message_bytes(what, peer, h.bytes, rank_, in.bytes);
        copy_out(in.dst, data, at, h.bytes);
      } else {
        Stashed msg{kAddress, h.bytes, {}, {}};
        copy_out(&msg.where, data, at, sizeof(msg.where));
        take(peer, key, in, msg, what);
      }
      continue;
    }
    Stashed msg{h.kind, h.bytes, {}, {}};
    if (h.kind == kInline) {
      msg.payload.resize(h.bytes);
      copy_out(msg.payload.data(), data, at, h.bytes);
    } else {
      copy_out(&msg.where, data, at, sizeof(msg.where));
    }
    early_messages.fetch_add(1, std::memory_order_relaxed);
    stash_[key].push_back(std::move(msg));
  }
  r->tail.store(tail, std::memory_order_release);
  ring_bell(peers_[static_cast<size_t>(peer)].base);  // it may wait for room
  return true;
}

bool SharedMemoryRings::done() const {
  if (!posted_.empty() || !acks_owed_.empty()) return false;
  for (const auto& p : peers_)
    if (!p.out.empty()) return false;
  return true;
}

// Why a peer this wait still needs (a receive or an acknowledgement from
// it, or room in its ring) cannot give it: it closed its inbox or exited.
// Empty when none. Others may have left the group already, done with it.
std::string SharedMemoryRings::gone_peer() const {
  std::vector<char> needed(static_cast<size_t>(size_), 0);
  for (const auto& [key, ins] : posted_) needed[static_cast<size_t>(key.first)] = 1;
  for (const auto& [key, n] : acks_owed_) needed[static_cast<size_t>(key.first)] = 1;
  std::vector<pollfd> fds;
  std::vector<int> whose;
  for (int q = 0; q < size_; ++q) {
    const Peer& p = peers_[static_cast<size_t>(q)];
    if (!p.base || !(needed[static_cast<size_t>(q)] || !p.out.empty())) continue;
    if (doorbell(p.base)->closed.load(std::memory_order_acquire))
      return "rank " + std::to_string(q) + " closed its connections to the group (its collective failed or it left the group)";
    if (p.pidfd >= 0) {
      fds.push_back({p.pidfd, POLLIN, 0});
      whose.push_back(q);
    } else if (kill(p.pid, 0) != 0 && errno == ESRCH) {  // no pidfd here: reaped is gone
      return "rank " + std::to_string(q) + "'s process (pid " + std::to_string(p.pid) + ") exited";
    }
  }
  if (fds.empty() || poll(fds.data(), fds.size(), 0) <= 0) return {};
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents & POLLIN)
      return "rank " + std::to_string(whose[i]) + "'s process (pid " +
             std::to_string(peers_[static_cast<size_t>(whose[i])].pid) + ") exited";
  return {};
}

// Every peer's ring consumed, and what fits of every peer's queue written.
// True when anything came.
bool SharedMemoryRings::drain_all(const std::string& what) {
  bool progressed = false;
  for (int q = 0; q < size_; ++q) {
    if (!peers_[static_cast<size_t>(q)].base) continue;
    progressed |= drain(q, what);
    push(q);  // what did not fit when posted, and the acknowledgements drain queued
  }
  return progressed;
}

bool SharedMemoryRings::wait(std::chrono::milliseconds timeout, const std::string& group, const char* op) {
  const std::string what = std::string(op) + " on group '" + group + "'";
  // What came before its receive was posted.
  for (auto it = stash_.begin(); it != stash_.end();) {
    for (auto posted = posted_.find(it->first); posted != posted_.end() && !it->second.empty();
         posted = posted_.find(it->first)) {
      take(it->first.first, it->first, pop_posted(posted), it->second.front(), what);
      it->second.pop_front();
    }
    it = it->second.empty() ? stash_.erase(it) : std::next(it);
  }
  Doorbell* own = doorbell(base_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (interrupted_.load(std::memory_order_acquire)) return false;
    const uint32_t seen = own->bell.load(std::memory_order_seq_cst);
    const bool progressed = drain_all(what);
    if (done()) return true;
    if (progressed) continue;
    if (!gone_peer().empty()) {
      // A member that completed its collective may leave before we take the
      // last messages it sent us. Those are in our own inbox, written before
      // it closed or exited: drain once more after seeing it gone, and fail
      // only if it is still needed then.
      drain_all(what);
      if (done()) return true;
      if (const std::string gone = gone_peer(); !gone.empty()) fail(Code::Comm, what, ": ", gone);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      std::string missing;
      for (const auto& [key, ins] : posted_) missing += " " + std::to_string(key.first);
      throw std::runtime_error("Timed out after " + std::to_string(timeout.count()) +
                               " ms waiting in shared memory (receives outstanding from ranks" +
                               (missing.empty() ? std::string(" none") : missing) + ")");
    }
    const auto left = std::min<std::chrono::nanoseconds>(deadline - now, kSlice);
    const timespec ts{static_cast<time_t>(left.count() / 1000000000),
                      static_cast<long>(left.count() % 1000000000)};
    own->sleeping.store(1, std::memory_order_seq_cst);
    if (own->bell.load(std::memory_order_seq_cst) == seen && !interrupted_.load())
      futex(&own->bell, FUTEX_WAIT, seen, &ts);
    own->sleeping.store(0, std::memory_order_relaxed);
  }
}

void SharedMemoryRings::interrupt() {
  interrupted_.store(true, std::memory_order_release);
  Doorbell* own = doorbell(base_);
  own->bell.fetch_add(1, std::memory_order_seq_cst);
  futex(&own->bell, FUTEX_WAKE, INT_MAX, nullptr);
}

void SharedMemoryRings::clear_interrupt() { interrupted_.store(false, std::memory_order_release); }

void SharedMemoryRings::close() {
  if (doorbell(base_)->closed.exchange(1)) return;
  for (const auto& p : peers_)
    if (p.base) ring_bell(p.base);
}

void SharedMemoryRings::forget() {
  posted_.clear();
  stash_.clear();
  acks_owed_.clear();
  for (auto& p : peers_) p.out.clear();
}

}  // namespace zs
