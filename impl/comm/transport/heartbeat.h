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
// Nothing here blocks a collective: waits ask silence() when they start and
// are cut short through watch() while they run.
#pragma once

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
  // Binds on host and publishes the address under "zs/heartbeat/<rank>" in
  // store. Throws Code::Bootstrap when host cannot be bound, naming it.
  Heartbeat(int rank, int world_size, const std::string& host, Store& store,
            std::chrono::milliseconds period, std::chrono::milliseconds limit);
  // Collective over the world: reads every peer's address (store timeout)
  // and starts beating. Until then no peer is silent. Called once the
  // world's transport is connected, so a rank that never came is named by
  // that connect, as without heartbeats.
  void start(Store& store);
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

  // This rank is going away: tells the peers (so its silence from now on
  // is no failure) and stops sending; it goes on listening until destroyed.
  void leave();

 private:
  struct Peer {
    std::string host;  // as published, for messages
    std::vector<char> addr;  // sockaddr
    uint64_t epoch = 0;
    uint64_t last_seq = 0;
    std::chrono::steady_clock::time_point heard;  // last valid datagram (or start)
    std::chrono::steady_clock::duration silent{};  // this thread's running time since
    bool departed = false;
  };
  struct Watcher {
    std::vector<int> ranks;
    std::function<void(const std::string&)> fn;
  };

  void loop();
  void send_beats(bool goodbye);
  void receive(std::chrono::steady_clock::time_point now);
  std::string mac(const char* data, size_t bytes) const;

  const int rank_, world_;
  const std::chrono::milliseconds period_, limit_;
  const std::string secret_;
  uint64_t epoch_ = 0;
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
