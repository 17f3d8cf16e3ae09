// zsrun --warm-start: the socket protocol with the interpreter every rank
// forks from (bindings/python/zeroshard/warm_start.py). A request is one
// SOCK_SEQPACKET message: the rank's environment as NUL-terminated
// NAME=value strings, with its stdin, stdout and stderr as SCM_RIGHTS
// descriptors; the answer is one message, "pid N" or "error WHY".
// Header-only, like free_port.h: zsrun links nothing.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace zs::warm {

// Sends the request; false with *why set when the socket refuses it (an
// environment over the socket's buffer: EMSGSIZE; the interpreter gone).
inline bool send_request(int sock, const std::vector<std::string>& env, const int fds[3], std::string* why) {
  std::string block;
  for (const std::string& kv : env) {
    block += kv;
    block += '\0';
  }
  iovec iov{const_cast<char*>(block.data()), block.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(3 * sizeof(int));
  std::memcpy(CMSG_DATA(c), fds, 3 * sizeof(int));
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(block.size())) return true;
  *why = n < 0 ? std::string("cannot send the rank's request: ") + std::strerror(errno)
               : "the rank's request was cut short";
  return false;
}

// Parses an answer: the rank's pid, or -1 with *why set.
inline pid_t parse_answer(const std::string& answer, std::string* why) {
  if (answer.rfind("pid ", 0) == 0) {
    char* end = nullptr;
    const long pid = std::strtol(answer.c_str() + 4, &end, 10);
    if (pid > 0 && end && *end == '\0') return static_cast<pid_t>(pid);
  }
  *why = answer.rfind("error ", 0) == 0 ? answer.substr(6) : "it answered '" + answer + "'";
  return -1;
}

}  // namespace zs::warm
