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

#include "impl/common/error.h"

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
  // Several keys at once: set_many writes keys[i] = values[i]; get_many
  // blocks until every key exists (or the timeout passes) and returns
  // their values in order. The TCP store sends one request per
  // kMaxWaitKeys keys (a rank meeting N peers makes O(1) requests, not N);
  // the defaults here call set and get once per key.
  virtual void set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values);
  virtual std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys);
  // Clients connected to the server this process runs (its own client
  // included), or -1 when it runs none: how rank 0 knows that no peer
  // needs the store any more, dead ones included.
  virtual int clients_connected() const { return -1; }
  // Ends the call in progress now, if any, with Code::Comm and `why` (the
  // server rank has stopped: it would never answer; or a rank whose key
  // the call waits for has). Later calls go on as usual. Only signals;
  // safe from any thread. A no-op where calls cannot hang on a peer (the
  // memory store).
  virtual void interrupt(const std::string& why) { (void)why; }
  // The server closed this client's connection under a call (it exited)
  // and no connection was made since: a later call would only retry
  // connecting until the timeout. False where there is no server.
  virtual bool server_lost() const { return false; }

  // The job is over (the last rank to leave calls this): removes the keys
  // where they outlive the processes (the file store's files), so the next
  // job in the same place starts clean. A no-op elsewhere.
  virtual void discard() {}

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  static constexpr size_t kMaxKeyBytes = 4096;
  static constexpr size_t kMaxValueBytes = 64u << 20;

 protected:
  std::chrono::milliseconds timeout_{300000};
};

// TCP store. The rank with is_server serves on host:port (port 0 picks a
// free port, reported through *bound_port) and is also a client of itself;
// others connect, retrying until the timeout. Errors: Code::Bootstrap (cannot bind,
// cannot connect in time, bad reply), Code::Timeout, Code::InvalidArgument
// (key or value too long).
//
// Lifetime: the server lives inside rank 0's store object and stops when that
// object is destroyed, so rank 0 must outlive every other rank's use of the
// store (the engine ends with a barrier through the store before destroying
// it). Calls on one store object are serialised by a mutex, so a blocking get
// holds back other threads' calls on that object until it returns.
//
// `who` names this client to the server ("rank 2", at most 64 bytes): when
// its connection closes, the server appends who and a newline to the key
// kGoneKey, which is how a peer tells which ranks died (in one request).
//
// server_restarts: the server may exit and be started again on the same
// port from its journal (tools/zsstore under zsrun, store_journal.h): a call
// whose connection it closed connects again and resends within its
// deadline (ADD as ADD1, applied once), instead of failing at once.
std::unique_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server,
                                      std::chrono::milliseconds timeout,
                                      int* bound_port = nullptr, const std::string& who = "",
                                      bool server_restarts = false);
inline constexpr char kGoneKey[] = "zs/gone";

// File store: one file per key in dir (created if missing), written
// atomically (temp + rename); add() is serialised with flock.
std::unique_ptr<Store> make_file_store(const std::string& dir, std::chrono::milliseconds timeout);

// A store inside this process (a world of one that still rendezvouses).
std::unique_ptr<Store> make_memory_store(std::chrono::milliseconds timeout);

// Keys under a prefix ("prefix/key"), for sub-groups sharing one store.
// The base's timeout governs every call; timeout() of the prefix store only
// reports the base's timeout at creation.
std::unique_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, const std::string& prefix);

// Shared by the store implementations; not part of the store interface.
namespace store_detail {

// Key as shown in messages: printable bytes as they are, others as \xHH,
// cut after 128 bytes (keys may be binary and up to 4 KiB).
inline std::string quote_key(const std::string& key) {
  static const char kHex[] = "0123456789abcdef";
  const size_t shown = key.size() < 128 ? key.size() : 128;
  std::string out = "'";
  for (size_t i = 0; i < shown; ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  out += "'";
  if (shown < key.size()) out += "... (" + std::to_string(key.size()) + " bytes)";
  return out;
}

inline void check_key(const char* op, const std::string& key) {
  if (key.size() > Store::kMaxKeyBytes) {
    // The quoted key is cut and ends with its size.
    fail(Code::InvalidArgument, op, ": key ", quote_key(key), " is over the limit of ",
         Store::kMaxKeyBytes, " bytes");
  }
}

inline void check_value(const std::string& key, size_t size) {
  if (size > Store::kMaxValueBytes) {
    fail(Code::InvalidArgument, "set: value of key ", quote_key(key), " is ", size,
         " bytes, more than the limit of ", Store::kMaxValueBytes);
  }
}

// Parses a stored counter; false if it is not a whole decimal int64.
bool parse_int64(const std::string& s, int64_t* out);

}  // namespace store_detail

}  // namespace zs
