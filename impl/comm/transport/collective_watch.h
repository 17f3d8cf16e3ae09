// The identity of every collective a rank runs on a group, the last few of
// them (a flight recorder), and a watcher that tells when ranks parted.
//
// A collective's identity (sequence number, op, sizes, dtype, and the label
// of what the engine is doing: which params it fetches or reduces) is hashed
// into the transport's message slots, so ranks that disagree never exchange
// a byte: no size check fires inside Gloo, no numbers are silently mixed.
// They simply wait. When a wait passes `check_after`, the rank publishes its
// recent identities in the group's store and reads its peers'; a peer that
// ran a different collective at the same sequence number is a mismatch,
// reported in both ranks' words and the wait is cut short. Ranks that agree
// never touch the store, so the check costs a hash and a ring-buffer slot per
// collective.
//
// A wait that passes `warn_after` is a straggler's: the waiting rank names,
// on stderr, the peers whose notes do not show them at this collective yet
// (each waiting peer publishes its notes after `check_after`, so the silent
// ones are those still computing, stuck, or dead), with the collective and
// how long it has waited; again at twice that wait, four times, ... so a
// hang is attributed long before the collective's timeout ends it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/store/store.h"

namespace zs {

struct CollectiveIdentity {
  uint64_t seq = 0;
  const char* op = "";
  std::string detail;  // sizes and dtype, e.g. "1000 x float32, sum"
  std::string label;   // what the engine does (CollectiveLabelScope)
  uint64_t hash = 0;   // of all the above and `extra`

  // "#12 all-gather of 4096 bytes per rank for 'fetch of layer3.weight'"
  std::string describe() const;
};

// Builds an identity; `extra` folds in sizes the detail only summarises
// (each segment of a coalesced gather).
CollectiveIdentity make_identity(uint64_t seq, const char* op, std::string detail,
                                 uint64_t extra = 0);

class CollectiveWatch {
 public:
  static constexpr size_t kHistory = 16;

  // store: the group's own (prefixed) store; null disables the watcher
  // (the history is still kept). check_after: how long a collective may
  // wait before its rank compares notes with its peers.
  // warn_after: when a wait is reported as a straggler's (0: never).
  // world_ranks: each group rank's world rank, for the warning's words
  // (empty: the group is the world).
  // neighbours: the members whose notes it reads on every check (empty:
  // all). A group past the full mesh gives its pair peers (mesh_peers.h),
  // so that a check costs each rank 2 log N notes, not N: a disagreement
  // shows between some two neighbours on the ring, and a verdict passes
  // on to everyone in log N checks. Straggler warnings and a timeout's
  // whereabouts still read every member's, at their rarer times.
  CollectiveWatch(std::string group, int rank, int size, std::shared_ptr<Store> store,
                  std::chrono::milliseconds check_after,
                  std::chrono::milliseconds warn_after = std::chrono::milliseconds(0),
                  std::vector<int> world_ranks = {}, std::vector<int> neighbours = {});
  ~CollectiveWatch();
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  void begin(CollectiveIdentity id);
  // completed: false when the collective failed (the recorder says so).
  void end(bool completed);
  // How to cut the current wait short; cleared with nullptr. Called with
  // the watch's lock held, so it must only signal.
  void set_abort(std::function<void()> abort);
  // The mismatch found for the current collective, or "".
  std::string verdict() const;
  // Cuts the wait armed now short for a reason found outside the group (a
  // peer that sent no heartbeat); ignored when no wait is armed. Each new
  // wait starts without one, so a peer heard again is waited for again.
  void interrupt(const std::string& why);
  // The reason the last armed wait was interrupted, or "".
  std::string interruption() const;
  // What each peer last published, for a timeout's message (store I/O).
  std::string whereabouts();
  // The store key of a member's notes. The group's connect publishes every
  // member's as empty with its pair addresses (gloo_communicator.cpp), so
  // once any member has connected, every member's notes key exists and the
  // watch reads them all in one request (get_many).
  static std::string notes_key(int rank);
  // This rank's last collectives, oldest first, one per line.
  std::string history() const;

 private:
  struct Entry {
    CollectiveIdentity id;
    bool done = false;
  };
  void loop();
  // Publishes this rank's notes (unless empty) and compares `mine`, the
  // collective waiting now, with what the peers ran at its sequence number;
  // returns a verdict or "".
  // `absent` (unless null) gets the peers whose notes do not show them at
  // `mine`, each with where it last reported.
  std::string compare_notes(const CollectiveIdentity& mine, const std::string& notes,
                            std::vector<std::string>* absent);
  // "rank 2" or "rank 2 (world rank 5)".
  std::string who(int rank) const;
  // The notes of `members` (all of them when empty), in that order, in one
  // store request; empty for a member that never waited long enough to
  // publish. Returns the members read.
  std::vector<std::vector<char>> notes_of(std::vector<int>& members);
  void warn_straggler(const CollectiveIdentity& mine, std::chrono::milliseconds waited,
                      const std::vector<std::string>& absent) const;
  std::string notes_locked() const;

  const std::string group_;
  const int rank_, size_;
  const std::shared_ptr<Store> store_;
  const std::chrono::milliseconds check_after_;
  const std::chrono::milliseconds warn_after_;
  const std::vector<int> world_ranks_;
  const std::vector<int> neighbours_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // The last kHistory collectives, oldest first: ring_[(first_ + i) %
  // kHistory] for i < count_. Slots are reused, so recording one allocates
  // nothing here.
  std::array<Entry, kHistory> ring_;
  size_t first_ = 0, count_ = 0;
  Entry& newest_locked() { return ring_[(first_ + count_ - 1) % kHistory]; }
  const Entry& at_locked(size_t i) const { return ring_[(first_ + i) % kHistory]; }
  bool running_ = false;  // a collective is in progress
  std::chrono::steady_clock::time_point began_;
  uint64_t published_seq_ = UINT64_MAX;
  std::chrono::milliseconds next_warn_{0};   // of the current wait
  std::chrono::milliseconds next_check_{0};  // of the current wait
  std::function<void()> abort_;
  std::string verdict_;
  std::string interruption_;
  bool stop_ = false;
  std::thread thread_;
};

// How long a collective waits before the ranks compare identities:
// ZS_COLLECTIVE_CHECK_MS, 500 by default; 0 turns identities off.
std::chrono::milliseconds collective_check_after();
// When a waiting collective names its stragglers: ZS_STRAGGLER_WARN_MS, by
// default a third of the collective timeout, at most 30 s; 0 turns it off.
std::chrono::milliseconds straggler_warn_after(std::chrono::milliseconds timeout);

}  // namespace zs
