// Liveness of the ranks that the transport cannot see die: a peer that is
// stopped (SIGSTOP) or wedged keeps its sockets open, so without this it is
// found only at the collective timeout.
//
// Each context runs one light thread. It owns a UDP socket bound on the
// address chosen for the transport, and every `period` sends each peer a
// datagram (rank, a random epoch per context, a sequence number, and an
// HMAC under the job secret when one is set); datagrams that fail any check
// are dropped. A peer counts as silent once it has not been heard for
// `limit` of this thread's own running time: a tick of this thread counts
// for at most two periods, so a rank that was itself not scheduled (load,
// its own stop) does not blame its peers for the gap, and it reads what
// they sent meanwhile before judging. A peer that is merely busy keeps
// beating, since its heartbeat thread runs beside its work.
//
// Past kFullMeshPeers peers, a rank beats only to the ranks 1, 2, 4, ...
// after it (ceil(log2 N) of them) and judges only the ranks that beat to
// it (its monitors' view of a rank: those 1, 2, 4, ... before it). A rank
// that finds one it monitors silent lists it in every beat it sends, with
// how long ago that was confirmed, and sends at once; every rank relays
// what it was told the same way, so a silence reaches every rank in
// O(log N) hops of network latency, and the messages a world sends grow
// as N log N instead of N^2. A report stands while fresh (its confirmation
// younger than three periods): a rank heard again by its monitors is no
// longer reported and, a few periods later, no longer named.
//
// Nothing here blocks a collective: waits ask silence() when they start and
// are cut short through watch() while they run.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "impl/comm/store/store.h"

namespace zs {

// ZS_HEARTBEAT_MS: the period (default 250; 0 turns heartbeats off).
std::chrono::milliseconds heartbeat_period();
// ZS_HEARTBEAT_TIMEOUT_MS: how long a peer may be silent (default 2000);
// must exceed twice the period.
std::chrono::milliseconds heartbeat_limit();

class Heartbeat {
 public:
  // Binds on host and publishes the address under
  // "<key_prefix>heartbeat/<rank>" in store ("zs/", or "zs/gen<g>/" for a
  // healing generation's replacement). Throws Code::Bootstrap when host
  // cannot be bound, naming it.
  Heartbeat(int rank, int world_size, const std::string& host, Store& store,
            std::chrono::milliseconds period, std::chrono::milliseconds limit,
            const std::string& key_prefix = "zs/");
  // Collective over the world: reads every peer's address (store timeout)
  // and starts beating. Until then no peer is silent. Called once the
  // world's transport is connected, so a rank that never came is named by
  // that connect, as without heartbeats.
  //
  // `absent`: world ranks not in the run (a regrow's joiner, where a shrink
  // left ranks out that did not come back): dropped from the start, their
  // addresses not read, the beats laid out over the others (reform).
  void start(Store& store, const std::vector<int>& absent = {});
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  std::chrono::milliseconds limit() const { return limit_; }

  // "" when every world rank in `ranks` (this one and departed ones are
  // skipped) was heard within the limit; else a sentence naming the first
  // silent one: "rank 1 (host 127.0.0.1) has sent no heartbeat for 2.1 s:
  // it is stopped or hung (alive but not running), or it died".
  std::string silence(const std::vector<int>& ranks) const;

  // fn(sentence) runs on the heartbeat thread after each check that finds
  // a rank of `ranks` silent, until the returned handle is destroyed (which
  // waits for a call in progress). fn must only signal: no heartbeat calls.
  class Subscription;
  std::unique_ptr<Subscription> watch(std::vector<int> ranks,
                                      std::function<void(const std::string&)> fn);

  // The world ranks silent past the limit now (judged here, or reported by
  // their monitors), ascending; never this one or a departed one.
  std::vector<int> lost() const;

  // The loss subscription (healing, docs/healing.md section 2): fn(lost,
  // sentence) runs on the heartbeat thread after each check that finds any
  // world rank silent, whether or not anyone waits on it, with lost() and
  // silence(lost), until the handle is destroyed. fn must only signal.
  using LossFn = std::function<void(const std::vector<int>&, const std::string&)>;
  std::unique_ptr<Subscription> on_loss(LossFn fn);

  // Healing (docs/healing.md, section 3): a new generation's keys. Posts
  // this rank's address (the same socket and epoch) under key_prefix, where
  // readmit and a replacement's start() read from now on.
  void republish(Store& store, const std::string& key_prefix);
  // A replacement took `rank`'s place: reads its address and epoch from the
  // current generation's key (waiting up to the store's timeout), beats to
  // it there, takes its beats (a new epoch, which was dropped before), and
  // judges it afresh, as heard now. A report of its silence is forgotten.
  void readmit(int rank, Store& store);
  // A shrink (docs/healing.md, section 4) went on without `rank`: it
  // counts as departed from now on (its silence is no loss), until a
  // readmit.
  void drop(int rank);
  // After drops, past the full mesh: whom this rank beats to and judges is
  // laid out again over the ranks not dropped (1, 2, 4, ... places after
  // and before it among them), reading the addresses it did not know from
  // the current generation's keys (store timeout), so that no live rank is
  // left with every monitor dropped. Every live rank calls it at the same
  // shrink; a rank newly judged here counts as heard now.
  void reform(Store& store);

  // This rank is going away: tells the peers (so its silence from now on
  // is no failure) and stops sending; it goes on listening until destroyed.
  void leave();

  // Up to this many peers, every rank beats to every other (all judged
  // directly, as before the sparse scheme).
  static constexpr int kFullMeshPeers = 8;
  bool full_mesh() const { return world_ - 1 <= kFullMeshPeers; }
  // The ranks this one beats to, ascending.
  const std::vector<int>& targets() const { return targets_; }
  // Datagrams sent so far (beats, relayed reports, goodbyes).
  uint64_t datagrams_sent() const { return sent_.load(std::memory_order_relaxed); }

 private:
  struct Peer {
    std::string host;  // as published, for messages
    std::vector<char> addr;  // sockaddr
    uint64_t epoch = 0;
    uint64_t last_seq = 0;
    std::chrono::steady_clock::time_point heard;  // last valid datagram (or start)
    std::chrono::steady_clock::duration silent{};  // this thread's running time since
    bool departed = false;
    bool dropped = false;    // drop(): out of the run until a readmit
    bool monitored = false;  // beats to this rank: judged here directly
    bool was_silent = false;  // at the last check (the heartbeat thread's)
    // Another rank's report that this one is silent: when its monitor last
    // confirmed it (none: the epoch), and which monitor.
    std::chrono::steady_clock::time_point confirmed{};
    int reported_by = -1;
  };
  // A rank reported silent: who, by which monitor, how long ago confirmed.
  struct Report {
    int rank;
    int by;
    uint32_t age_ms;
  };
  struct Watcher {
    std::vector<int> ranks;
    std::function<void(const std::string&)> fn;
    LossFn loss;  // set instead of fn by on_loss (ranks: the whole world)
  };

  void loop();
  void send_beats(bool goodbye);
  // Returns whether a report arrived of a rank not reported before.
  bool receive(std::chrono::steady_clock::time_point now);
  // What this rank reports (under mu_): the monitored peers silent past the
  // limit, and the fresh reports it was told.
  std::vector<Report> reports_locked(std::chrono::steady_clock::time_point now) const;
  bool reported_locked(const Peer& p, std::chrono::steady_clock::time_point now) const;
  std::vector<int> lost_locked(std::chrono::steady_clock::time_point now) const;
  std::string silence_locked(const std::vector<int>& ranks) const;
  std::string mac(const char* data, size_t bytes) const;
  std::string key(int rank) const;  // where rank's address is, in the current generation
  static std::string key_at(const std::string& prefix, int rank);
  // The addresses `ranks` published under `prefix`, in one store request
  // (start, reform); take_address copies one into a peer.
  static std::vector<Peer> read_peers(Store& store, const std::string& prefix, const std::vector<int>& ranks);
  static void take_address(Peer& p, const Peer& read);
  // A published "host port epoch" into p's host, address and epoch.
  static void parse_address(int rank, const std::vector<char>& raw, Peer& p);

  const int rank_, world_;
  std::vector<int> targets_;  // set in the constructor, and by reform under send_mu_
  std::atomic<uint64_t> sent_{0};
  const std::chrono::milliseconds period_, limit_;
  const std::string secret_;
  uint64_t epoch_ = 0;
  std::string address_;     // "host port epoch", as published
  std::string key_prefix_;  // under mu_: the current generation's ("zs/", "zs/gen1/", ...)
  std::mutex send_mu_;  // seq_ and the socket's sends (the thread's beats, leave's goodbye)
  uint64_t seq_ = 0;
  int fd_ = -1;
  int wake_fd_ = -1;  // eventfd: ends the thread's poll at once

  mutable std::mutex mu_;  // peers_, sending_, stop_
  std::vector<Peer> peers_;
  bool sending_ = true;
  bool stop_ = false;

  std::mutex watchers_mu_;  // held while a watcher's fn runs
  std::list<Watcher> watchers_;

  std::thread thread_;

  friend class Subscription;
};

class Heartbeat::Subscription {
 public:
  Subscription(Heartbeat& hb, std::list<Watcher>::iterator it) : hb_(hb), it_(it) {}
  ~Subscription();
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;

 private:
  Heartbeat& hb_;
  std::list<Watcher>::iterator it_;
};

}  // namespace zs
