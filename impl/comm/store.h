// Rendezvous key-value store: how ranks find each other before any
// collective exists. Rank 0 serves a TCP store (or all ranks share a
// directory); gloo's full-mesh connect and sub-group creation exchange their
// addresses through it. Every blocking call has a deadline: a missing rank
// is a ZS_ERR_TIMEOUT naming the keys still missing, never a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zs {

class Store {
 public:
  virtual ~Store() = default;
  // Overwrites the key. Values are at most kMaxValueBytes.
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  // Blocks until the key exists or the timeout passes (Code::Timeout).
  virtual std::vector<char> get(const std::string& key) = 0;
  // Blocks until every key exists or the timeout passes (Code::Timeout).
  virtual void wait(const std::vector<std::string>& keys) = 0;
  // Atomically adds delta to the integer stored at key (absent = 0) and
  // returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True if the key exists now; never blocks for it.
  virtual bool check(const std::string& key) = 0;

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  static constexpr size_t kMaxKeyBytes = 4096;
  static constexpr size_t kMaxValueBytes = 64u << 20;

 protected:
  std::chrono::milliseconds timeout_{300000};
};

// TCP store. The rank with is_server serves on host:port (port 0 picks a
// free port; see TcpStore::port()) and is also a client of itself; others
// connect, retrying until the timeout. Errors: Code::Bootstrap (cannot bind,
// cannot connect in time, bad reply), Code::Timeout, Code::InvalidArgument
// (key or value too long).
std::unique_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server,
                                      std::chrono::milliseconds timeout,
                                      int* bound_port = nullptr);

// File store: one file per key in dir (created if missing), written
// atomically (temp + rename); add() is serialised with flock.
std::unique_ptr<Store> make_file_store(const std::string& dir, std::chrono::milliseconds timeout);

// Keys under a prefix ("prefix/key"), for sub-groups sharing one store.
std::unique_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, const std::string& prefix);

}  // namespace zs
