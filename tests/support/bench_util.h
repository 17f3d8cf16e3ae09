// Small helpers shared by benchmarks (header-only: no test framework).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "tools/free_port.h"

namespace zs::bench {

// A free TCP port on 127.0.0.1 for a benchmark's rendezvous.
inline int free_port() { return zs::net::free_loopback_port(); }

// How many of this process's file descriptors are sockets (-1: /proc
// unreadable).
inline int sockets_open() {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    char link[64] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    if (readlink(path.c_str(), link, sizeof link - 1) > 0 && std::strncmp(link, "socket:", 7) == 0) ++n;
  }
  closedir(d);
  return n;
}

}  // namespace zs::bench
