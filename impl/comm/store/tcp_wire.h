// What the TCP store's server (tcp_store_server.cpp) and client
// (tcp_store.cpp) share: the reply framing, the limits both sides enforce,
// and small socket and deadline helpers. Internal to comm/store.
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "impl/comm/store/store.h"
#include "impl/comm/store/store_protocol.h"

namespace zs::tcp_wire {

// ZS_STORE_STATS=1: the server and each client print, when they go, how
// many requests they handled or made (bench_scale reads them).
inline bool store_stats_wanted() {
  const char* v = std::getenv("ZS_STORE_STATS");
  return v != nullptr && *v != '\0' && *v != '0';
}

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using store_detail::quote_key;

using store_protocol::Cmd;
using store_protocol::kMaxRequestBytes;
using store_protocol::kMaxWaitKeys;
using store_protocol::load_le;
using store_protocol::put_u32;
using store_protocol::put_u64;
using store_protocol::kMaxClientName;
using store_protocol::kStoreMagic;
using store_protocol::kStoreMagicBytes;

// What the store holds at most: rendezvous data (addresses, configs, marks)
// is kilobytes per rank; a stranger's SETs must not grow rank 0 without end.
constexpr size_t kMaxStoredBytes = size_t{256} << 20;
constexpr uint64_t kStrangersLogged = 8;

enum class Status : uint8_t { Ok = 0, Error = 1 };

constexpr size_t kReplyHeaderBytes = 9;
// Replies carry a value, an i64, a flag or a short error message.
constexpr size_t kMaxReplyPayload = Store::kMaxValueBytes;
// The server stops reading requests of a client whose replies pile up unread.
constexpr size_t kMaxPendingOutput = 1 << 20;
constexpr size_t kReadChunk = 256 << 10;

inline std::string endpoint(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

inline int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Milliseconds left until deadline for poll(), rounded up so we never spin.
inline int remaining_ms(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<milliseconds>(left).count();
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) freeaddrinfo(list);
  }
};

}  // namespace zs::tcp_wire
