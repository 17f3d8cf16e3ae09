// A free TCP port on 127.0.0.1 for a job's rendezvous, picked below the
// kernel's ephemeral range (ip_local_port_range). A port from bind(0) comes
// from that range, and between our closing it and rank 0 binding it, any
// outgoing connection on the host (ranks of other jobs or tests open
// dozens) can take it as its local port; below the range only another
// listener can. Header-only: zsrun links nothing, the tests include it.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <random>

namespace zs::net {

// Whether `port` (0: any) can be bound on 127.0.0.1 now; *bound, the port.
inline bool try_bind_loopback(int port, int* bound) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  if (ok) *bound = ntohs(addr.sin_port);
  return ok;
}

// The lowest ephemeral port (32768 where /proc does not say).
inline int ephemeral_low() {
  int lo = 32768, hi = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768;
    std::fclose(f);
  }
  return lo;
}

// A free port, -1 when none could be bound. Random below the ephemeral
// range (at most 16384 ports under it, none under 10000); bind(0) when that
// range is too small or 64 tries found nothing free.
inline int free_loopback_port() {
  const int top = ephemeral_low() - 1;
  const int bottom = top - 16383 < 10000 ? 10000 : top - 16383;
  int port = -1;
  if (top - bottom >= 1024) {
    std::random_device seed;
    std::mt19937 gen(seed());
    std::uniform_int_distribution<int> pick(bottom, top);
    for (int tries = 0; tries < 64; ++tries)
      if (try_bind_loopback(pick(gen), &port)) return port;
  }
  return try_bind_loopback(0, &port) ? port : -1;
}

}  // namespace zs::net
