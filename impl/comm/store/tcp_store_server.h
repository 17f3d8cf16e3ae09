// The TCP store's server: one poll() thread on rank 0 that holds the keys,
// parks GET/WAIT requests until their keys arrive, and drops any client
// whose frame does not parse (it never trusts a length) or that does not
// prove the job secret. Its clients are tcp_store.cpp's.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "impl/comm/store/store_journal.h"
#include "impl/comm/store/tcp_wire.h"

namespace zs::tcp_wire {

struct ServerOptions {
  // Keeps the keys in this file (store_journal.h) and starts with those a
  // server on the same file held; "": in memory only.
  std::string journal;
  // A test's kill point (ZS_FAULT_STORE=N for tools/zsstore): the process
  // SIGKILLs itself at its N-th request, applied but not answered. 0: none.
  uint64_t die_at_request = 0;
};

class Server {
 public:
  // secret: the job secret every connection must prove it knows, or "".
  Server(const std::string& host, int port, std::string secret, ServerOptions options = {});
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  int port() const { return port_; }
  // Clients connected now (this process's own included).
  int clients() const { return clients_.load(std::memory_order_relaxed); }

 private:
  struct Conn {
    int fd = -1;
    bool greeted = false;  // sent Hello: anything else first drops the connection
    bool trusted = false;  // proved the job secret (at Hello when there is none)
    std::string challenge;  // sent with the Hello's answer, for Auth to prove
    std::string who;       // the client's name from its Hello ("rank 2"), if it gave one
    std::string in;  // received bytes; unparsed ones start at in_pos
    size_t in_pos = 0;
    std::string out;  // reply bytes not yet sent start at out_pos
    size_t out_pos = 0;
    bool dead = false;
    // A parked request: GET of get_key, or WAIT (or GETS, whose keys in
    // the order asked are get_many) for the keys in missing.
    bool parked = false;
    bool parked_get = false;
    std::string get_key;
    std::unordered_set<std::string> missing;
    std::vector<std::string> get_many;
  };

  void loop();
  void accept_all();
  void read_from(Conn& c);
  void process(Conn& c);
  bool handle(Conn& c, const char* body, size_t n);
  void reply(Conn& c, Status status, const char* data, size_t n);
  // GETS' answer: each key's value, in order (every key exists).
  void reply_values(Conn& c, const std::vector<std::string>& keys);
  // SETS: every pair, or none when they would pass kMaxStoredBytes.
  void set_many(Conn& c, const std::vector<std::string>& keys, std::vector<std::string>& values);
  // ADD, and ADD1 when once_key is set: the client's last (seq, value) is
  // kept there, and a seq already applied answers its value again.
  void add(Conn& c, const std::string& key, int64_t delta, const std::string* once_key, uint64_t seq);
  // Stores key = value, keeping stored_bytes_ (no limit checked here).
  void assign(const std::string& key, std::string value);
  // Writes the changes to the journal, if any; one that cannot be written
  // is said once and removed, and the store goes on in memory.
  void journal(const std::vector<std::pair<const std::string*, const std::string*>>& changes);
  void flush(Conn& c);
  void wake(const std::string& key);
  void drop(int fd);

  int listen_fd_ = -1;
  // Out of descriptors (EMFILE, ENFILE): the pending connection stays in the
  // backlog and the listening socket stays readable, so it is left out of
  // poll until this time instead of spinning on it.
  Clock::time_point accept_paused_until_{};
  std::atomic<int> clients_{0};
  size_t stored_bytes_ = 0;  // keys and values held
  uint64_t strangers_dropped_ = 0;
  uint64_t requests_ = 0;  // handled, from trusted clients (ZS_STORE_STATS)
  uint64_t replied_bytes_ = 0;  // what the replies carried, framing included (ZS_STORE_STATS)
  int peak_clients_ = 0;
  const std::string secret_;
  std::unique_ptr<StoreJournal> journal_;
  const uint64_t die_at_request_;
  int stop_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<int>> waiters_;  // key -> parked fds
  std::deque<int> ready_;  // unparked clients whose buffered requests wait to be handled
  std::vector<char> read_buf_;
  std::thread thread_;
};

}  // namespace zs::tcp_wire
