// libFuzzer target: the real TCP store server (make_tcp_store with
// is_server) fed a stranger's bytes over loopback. Each input is one
// connection: the bytes are sent, the write side is shut, and the input is
// done when the server has closed the connection (it drops a client at EOF,
// after handling every whole frame it got, or at the first malformed one).
// This covers what store_request_fuzz.cpp cannot: Server::process's
// buffering, parked GET and WAIT requests, wake and drop, with state kept
// across inputs (up to a restart, below). A finding is a crash, a sanitizer report in the server
// thread, or a server that stops answering (the store's own client checks
// it after every input).
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "impl/comm/store/store.h"
#include "impl/comm/store/store_protocol.h"
#include "impl/common/error.h"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "store server fuzz finding: %s\n", what);
  std::abort();
}

struct Server {
  std::unique_ptr<zs::Store> store;  // the server and a client of it
  int port = 0;
};

// The server's state lives across inputs, but a fresh server starts every
// kRestartEvery inputs: the store keeps the keys clients set, up to its
// 256 MiB cap, which is past libFuzzer's memory limit over a million inputs.
constexpr int kRestartEvery = 20000;

Server& server() {
  static Server s;
  static int inputs = 0;
  if (inputs++ % kRestartEvery == 0) {
    s.store.reset();
    s.store = zs::make_tcp_store("127.0.0.1", 0, true, std::chrono::milliseconds(5000), &s.port);
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Server& s = server();
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) finding("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(s.port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    finding("cannot connect to the store server");
  }
  // Every client starts with the handshake (a connection that does not is
  // dropped at its first request), so the input goes after one.
  {
    const std::string body = zs::store_protocol::encode_hello("fuzz");
    std::string frame;
    zs::store_protocol::put_u32(frame, static_cast<uint32_t>(body.size()));
    frame += body;
    if (send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(frame.size()))
      finding("cannot send the handshake");
  }
  size_t sent = 0;
  char sink[4096];
  while (sent < size) {
    const ssize_t n = send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0) break;  // the server dropped us (a malformed frame): fine
    sent += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  // Read replies until the server closes; it must within the deadline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 1000) < 0) finding("poll failed");
    const ssize_t n = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() > deadline) finding("server kept a closed client open");
  }
  close(fd);
  // The server still serves its own client.
  try {
    s.store->set("fuzz/alive", std::vector<char>{'1'});
    if (!s.store->check("fuzz/alive")) finding("a key just set is missing");
  } catch (const zs::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    finding("the server stopped answering its own client");
  }
  return 0;
}
