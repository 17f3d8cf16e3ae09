// The TCP store's server (tcp_store_server.h).
#include "impl/comm/store/tcp_store_server.h"

#include <fcntl.h>
#include <signal.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "impl/comm/store/job_secret.h"
#include "impl/common/error.h"


namespace zs::tcp_wire {

Server::Server(const std::string& host, int port, std::string secret, ServerOptions options)
    : secret_(std::move(secret)), die_at_request_(options.die_at_request) {
  const std::string where = endpoint(host.empty() ? "*" : host, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  AddrInfo ai;
  const std::string service = std::to_string(port);
  const int rc =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &ai.list);
  if (rc != 0) {
    fail(Code::Bootstrap, "cannot resolve store host '", host, "' to serve on ", where, ": ",
         rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc));
  }
  int err = 0;
  for (addrinfo* a = ai.list; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
      break;
    }
    err = errno;
    close(fd);
  }
  if (listen_fd_ < 0) {
    fail(Code::Bootstrap, "cannot bind store server to ", where, ": ", std::strerror(err),
         err == EADDRINUSE ? " (another process holds that port: an earlier job's rank 0, or "
                             "another program; choose a free port)"
                           : "");
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  // Read once the port is this server's: never beside a live one's writes.
  if (!options.journal.empty()) {
    try {
      journal_ = std::make_unique<StoreJournal>(options.journal, &data_);
    } catch (...) {
      close(listen_fd_);
      throw;
    }
    for (const auto& [key, value] : data_) stored_bytes_ += key.size() + value.size();
  }
  if (pipe2(stop_pipe_, O_NONBLOCK | O_CLOEXEC) != 0) {
    const int e = errno;
    close(listen_fd_);
    fail(Code::Bootstrap, "store server on ", where, ": cannot create a pipe: ", std::strerror(e));
  }
  read_buf_.resize(kReadChunk);
  thread_ = std::thread([this] { loop(); });
}

Server::~Server() {
  if (store_stats_wanted())
    std::fprintf(stderr,
                 "zeroshard: store stats: server on port %d handled %llu requests, replied %llu bytes, %d "
                 "clients at most\n",
                 port_, static_cast<unsigned long long>(requests_), static_cast<unsigned long long>(replied_bytes_),
                 peak_clients_);
  const char byte = 1;
  // The pipe is empty and non-blocking, so this write cannot block or fail.
  [[maybe_unused]] ssize_t n = write(stop_pipe_[1], &byte, 1);
  thread_.join();
  close(listen_fd_);
  close(stop_pipe_[0]);
  close(stop_pipe_[1]);
}

void Server::loop() {
  std::vector<pollfd> fds;
  std::vector<int> dead;
  for (;;) {
    fds.clear();
    fds.push_back({stop_pipe_[0], POLLIN, 0});
    const auto now = Clock::now();
    const bool accepting = now >= accept_paused_until_;
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});  // poll skips a negative fd
    for (const auto& entry : conns_) {
      const Conn& c = entry.second;
      const short events = c.out_pos < c.out.size() ? POLLIN | POLLOUT : POLLIN;
      fds.push_back({entry.first, events, 0});
    }
    const int wait_ms =
        accepting ? -1
                  : static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         accept_paused_until_ - now).count()) + 1;
    if (poll(fds.data(), fds.size(), wait_ms) < 0) {
      if (errno == EINTR) continue;
      break;  // not expected with valid fds; closing below fails clients fast
    }
    if (fds[0].revents != 0) break;
    if (fds[1].revents & POLLIN) accept_all();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = conns_.find(fds[i].fd);
      if (it == conns_.end() || it->second.dead) continue;
      Conn& c = it->second;
      if (fds[i].revents & POLLOUT) {
        flush(c);
        if (c.in_pos < c.in.size()) ready_.push_back(c.fd);  // resume held-back requests
      }
      if (!c.dead && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) read_from(c);
    }
    while (!ready_.empty()) {
      auto it = conns_.find(ready_.front());
      ready_.pop_front();
      if (it != conns_.end() && !it->second.dead) process(it->second);
    }
    dead.clear();
    for (const auto& entry : conns_) {
      if (entry.second.dead) dead.push_back(entry.first);
    }
    for (int fd : dead) drop(fd);
  }
  for (const auto& entry : conns_) close(entry.first);
  conns_.clear();
}

void Server::accept_all() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
      return;  // EAGAIN: drained
    }
    set_nodelay(fd);
    conns_[fd].fd = fd;
    clients_.fetch_add(1, std::memory_order_relaxed);
  }
}

void Server::read_from(Conn& c) {
  const ssize_t n = recv(c.fd, read_buf_.data(), read_buf_.size(), 0);
  if (n == 0) {
    c.dead = true;
    return;
  }
  if (n < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c.dead = true;
    return;
  }
  try {
    c.in.append(read_buf_.data(), static_cast<size_t>(n));
    process(c);
  } catch (const std::bad_alloc&) {
    c.dead = true;  // one oversized client must not take the server down
  }
  // Unparsed input is below one frame unless the client pipelines requests
  // behind a parked one; bound that too.
  if (c.in.size() - c.in_pos > 4 + kMaxRequestBytes) c.dead = true;
}

void Server::process(Conn& c) {
  while (!c.dead && !c.parked && c.out.size() - c.out_pos < kMaxPendingOutput) {
    size_t len = 0;
    const auto frame =
        store_protocol::next_frame(c.in.data() + c.in_pos, c.in.size() - c.in_pos, &len);
    if (frame == store_protocol::Frame::Bad) {
      c.dead = true;
      break;
    }
    if (frame == store_protocol::Frame::Incomplete) break;
    const char* body = c.in.data() + c.in_pos + 4;
    c.in_pos += 4 + len;
    if (!handle(c, body, len)) c.dead = true;
  }
  if (c.in_pos == c.in.size()) {
    c.in.clear();
    c.in_pos = 0;
  } else if (c.in_pos > c.in.size() / 2) {
    c.in.erase(0, c.in_pos);
    c.in_pos = 0;
  }
}

// Handles one request; false if it is malformed.
bool Server::handle(Conn& c, const char* body, size_t n) {
  store_protocol::Request req;
  if (!store_protocol::decode_request(body, n, &req)) return false;
  if (!c.greeted && req.cmd != Cmd::Hello) {
    if (strangers_dropped_++ < kStrangersLogged)
      std::fprintf(stderr, "zeroshard store on port %d: dropped a connection that did not start "
                   "with the zeroshard handshake (a stranger, or another program)\n", port_);
    return false;
  }
  if (c.greeted && !c.trusted && req.cmd != Cmd::Auth) {
    if (strangers_dropped_++ < kStrangersLogged)
      std::fprintf(stderr, "zeroshard store on port %d: dropped a connection (\"%s\") that did "
                   "not prove the job secret\n", port_, c.who.c_str());
    return false;
  }
  ++requests_;
  peak_clients_ = std::max(peak_clients_, clients_.load(std::memory_order_relaxed));
  switch (req.cmd) {
    case Cmd::Set: {
      std::string& key = req.keys[0];
      const auto old = data_.find(key);
      const size_t replaced = old == data_.end() ? 0 : key.size() + old->second.size();
      if (stored_bytes_ - replaced + key.size() + req.value.size() > kMaxStoredBytes) {
        const std::string msg = "SET of " + std::to_string(key.size() + req.value.size()) +
                                " bytes would take the store past its limit of " +
                                std::to_string(kMaxStoredBytes) + " bytes (it holds " +
                                std::to_string(stored_bytes_) + ")";
        reply(c, Status::Error, msg.data(), msg.size());
        return true;
      }
      journal({{&key, &req.value}});
      stored_bytes_ += key.size() + req.value.size() - replaced;
      data_.insert_or_assign(key, std::move(req.value));
      reply(c, Status::Ok, nullptr, 0);
      wake(key);
      return true;
    }
    case Cmd::Hello: {
      if (c.greeted) return false;
      c.greeted = true;
      c.who = std::move(req.who);
      std::string answer(kStoreMagic, kStoreMagicBytes);
      if (secret_.empty()) {
        c.trusted = true;
      } else {
        c.challenge = make_challenge();
        answer += c.challenge;
      }
      reply(c, Status::Ok, answer.data(), answer.size());
      return true;
    }
    case Cmd::Auth: {
      if (c.trusted) return false;
      if (!proofs_equal(req.value, job_proof(secret_, "store client " + c.who, c.challenge))) {
        if (strangers_dropped_++ < kStrangersLogged)
          std::fprintf(stderr, "zeroshard store on port %d: dropped a connection (\"%s\") whose "
                       "job secret is not this job's\n", port_, c.who.c_str());
        return false;
      }
      c.trusted = true;
      reply(c, Status::Ok, nullptr, 0);
      return true;
    }
    case Cmd::Get: {
      std::string& key = req.keys[0];
      const auto it = data_.find(key);
      if (it != data_.end()) {
        reply(c, Status::Ok, it->second.data(), it->second.size());
      } else {
        waiters_[key].push_back(c.fd);
        c.parked = true;
        c.parked_get = true;
        c.get_key = std::move(key);
      }
      return true;
    }
    case Cmd::Wait:
    case Cmd::GetMany: {
      std::unordered_set<std::string> missing;
      for (const std::string& key : req.keys) {
        if (data_.count(key) == 0) missing.insert(key);
      }
      if (missing.empty()) {
        if (req.cmd == Cmd::GetMany)
          reply_values(c, req.keys);
        else
          reply(c, Status::Ok, nullptr, 0);
      } else {
        for (const std::string& key : missing) waiters_[key].push_back(c.fd);
        c.parked = true;
        c.parked_get = false;
        c.missing = std::move(missing);
        if (req.cmd == Cmd::GetMany) c.get_many = std::move(req.keys);
      }
      return true;
    }
    case Cmd::SetMany:
      set_many(c, req.keys, req.values);
      return true;
    case Cmd::Add:
      add(c, req.keys[0], req.delta, nullptr, 0);
      return true;
    case Cmd::AddOnce: {
      const std::string once_key = store_protocol::add_once_key(req.client);
      add(c, req.keys[0], req.delta, &once_key, req.seq);
      return true;
    }
    case Cmd::Check: {
      const char found = data_.count(req.keys[0]) ? 1 : 0;
      reply(c, Status::Ok, &found, 1);
      return true;
    }
  }
  return false;
}

void Server::reply_values(Conn& c, const std::vector<std::string>& keys) {
  size_t total = 0;
  for (const std::string& key : keys) total += 8 + data_.at(key).size();
  if (total > kMaxReplyPayload) {
    const std::string msg = "GETS of " + std::to_string(keys.size()) + " keys would reply " +
                            std::to_string(total) + " bytes, more than the limit of " +
                            std::to_string(kMaxReplyPayload) + ": ask for fewer keys at a time";
    reply(c, Status::Error, msg.data(), msg.size());
    return;
  }
  std::string out;
  out.reserve(total);
  for (const std::string& key : keys) {
    const std::string& value = data_.at(key);
    put_u64(out, value.size());
    out += value;
  }
  reply(c, Status::Ok, out.data(), out.size());
}

void Server::set_many(Conn& c, const std::vector<std::string>& keys, std::vector<std::string>& values) {
  // Counted as if no key were replaced but those stored now, each once:
  // at worst a request that repeats a key is refused a little early.
  size_t adds = 0, replaced = 0;
  std::unordered_set<std::string> seen;
  for (size_t i = 0; i < keys.size(); ++i) {
    adds += keys[i].size() + values[i].size();
    const auto old = data_.find(keys[i]);
    if (old != data_.end() && seen.insert(keys[i]).second) replaced += keys[i].size() + old->second.size();
  }
  if (stored_bytes_ - replaced + adds > kMaxStoredBytes) {
    const std::string msg = "SETS of " + std::to_string(keys.size()) + " keys (" + std::to_string(adds) +
                            " bytes) would take the store past its limit of " +
                            std::to_string(kMaxStoredBytes) + " bytes (it holds " +
                            std::to_string(stored_bytes_) + ")";
    reply(c, Status::Error, msg.data(), msg.size());
    return;
  }
  std::vector<std::pair<const std::string*, const std::string*>> changes;
  for (size_t i = 0; i < keys.size(); ++i) changes.emplace_back(&keys[i], &values[i]);
  journal(changes);
  for (size_t i = 0; i < keys.size(); ++i) assign(keys[i], std::move(values[i]));
  reply(c, Status::Ok, nullptr, 0);
  for (const std::string& key : keys) wake(key);
}

void Server::add(Conn& c, const std::string& key, int64_t delta, const std::string* once_key, uint64_t seq) {
  if (once_key) {
    // A resend of the client's last ADD1, applied before a restart cut its
    // answer short: the same answer, not a second addition.
    const auto last = data_.find(*once_key);
    uint64_t last_seq = 0;
    int64_t last_value = 0;
    if (last != data_.end() &&
        std::sscanf(last->second.c_str(), "%" SCNu64 " %" SCNd64, &last_seq, &last_value) == 2 &&
        last_seq == seq) {
      std::string out;
      put_u64(out, static_cast<uint64_t>(last_value));
      reply(c, Status::Ok, out.data(), out.size());
      return;
    }
  }
  int64_t value = 0;
  const auto it = data_.find(key);
  if (it != data_.end() && !store_detail::parse_int64(it->second, &value)) {
    const std::string msg =
        "it holds " + std::to_string(it->second.size()) + " bytes that are not a decimal integer";
    reply(c, Status::Error, msg.data(), msg.size());
    return;
  }
  if (__builtin_add_overflow(value, delta, &value)) {
    const std::string msg = it->second + " plus " + std::to_string(delta) + " overflows int64";
    reply(c, Status::Error, msg.data(), msg.size());
    return;
  }
  std::string text = std::to_string(value);
  std::string once_text = once_key ? std::to_string(seq) + " " + text : std::string();
  // The sum and the client's record of it in one write: a restart keeps
  // both or neither.
  std::vector<std::pair<const std::string*, const std::string*>> changes{{&key, &text}};
  if (once_key) changes.emplace_back(once_key, &once_text);
  journal(changes);
  assign(key, std::move(text));
  if (once_key) assign(*once_key, std::move(once_text));
  std::string out;
  put_u64(out, static_cast<uint64_t>(value));
  reply(c, Status::Ok, out.data(), out.size());
  wake(key);
}

void Server::assign(const std::string& key, std::string value) {
  const auto old = data_.find(key);
  stored_bytes_ += key.size() + value.size() - (old == data_.end() ? 0 : key.size() + old->second.size());
  data_.insert_or_assign(key, std::move(value));
}

void Server::journal(const std::vector<std::pair<const std::string*, const std::string*>>& changes) {
  if (!journal_) return;
  const std::string why = journal_->record(changes);
  if (why.empty()) return;
  // The store goes on in memory. A server started on what the file holds
  // would serve keys that are not these, so the file goes: the launcher
  // then restarts no store, and names why.
  const std::string path = journal_->path();
  journal_.reset();
  unlink(path.c_str());
  std::fprintf(stderr,
               "zeroshard store on port %d: %s; it goes on in memory and '%s' is removed, so a store that dies "
               "now is not started again\n",
               port_, why.c_str(), path.c_str());
}

void Server::reply(Conn& c, Status status, const char* data, size_t n) {
  if (die_at_request_ != 0 && requests_ >= die_at_request_) {
    std::fprintf(stderr, "zeroshard store on port %d: ZS_FAULT_STORE=%llu: killed at its request %llu, applied and "
                 "not answered\n", port_, static_cast<unsigned long long>(die_at_request_),
                 static_cast<unsigned long long>(requests_));
    kill(getpid(), SIGKILL);
  }
  replied_bytes_ += 1 + 8 + n;
  c.out.push_back(static_cast<char>(status));
  put_u64(c.out, n);
  c.out.append(data, n);
  flush(c);
}

void Server::flush(Conn& c) {
  while (c.out_pos < c.out.size()) {
    const ssize_t n = send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
      return;
    }
    c.out_pos += static_cast<size_t>(n);
  }
  c.out.clear();
  c.out_pos = 0;
}

// Answers the requests parked on key, which has just been written.
void Server::wake(const std::string& key) {
  const auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  const std::vector<int> fds = std::move(it->second);
  waiters_.erase(it);
  const std::string& value = data_.at(key);
  for (int fd : fds) {
    const auto ci = conns_.find(fd);
    if (ci == conns_.end() || ci->second.dead || !ci->second.parked) continue;
    Conn& w = ci->second;
    if (w.parked_get) {
      if (w.get_key != key) continue;
      w.parked = false;
      w.get_key.clear();
      reply(w, Status::Ok, value.data(), value.size());
    } else {
      if (w.missing.erase(key) == 0 || !w.missing.empty()) continue;
      w.parked = false;
      if (w.get_many.empty()) {
        reply(w, Status::Ok, nullptr, 0);
      } else {
        const std::vector<std::string> keys = std::move(w.get_many);
        w.get_many.clear();
        reply_values(w, keys);
      }
    }
    ready_.push_back(fd);  // it may have pipelined more requests
  }
}

void Server::drop(int fd) {
  const auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  Conn& c = it->second;
  if (c.parked) {
    std::vector<std::string> keys(c.missing.begin(), c.missing.end());
    if (c.parked_get) keys.push_back(c.get_key);
    for (const std::string& key : keys) {
      const auto w = waiters_.find(key);
      if (w == waiters_.end()) continue;
      w->second.erase(std::remove(w->second.begin(), w->second.end(), fd), w->second.end());
      if (w->second.empty()) waiters_.erase(w);
    }
  }
  // Only a connection that proved itself may announce a rank's departure:
  // its name joins the list under kGoneKey, one per line, so a peer reads
  // every departure in one request.
  const std::string who = c.who.empty() || !c.trusted ? std::string() : c.who;
  close(fd);
  conns_.erase(it);
  clients_.fetch_sub(1, std::memory_order_relaxed);
  if (who.empty()) return;
  auto [list, added] = data_.try_emplace(kGoneKey);
  if (added) stored_bytes_ += std::strlen(kGoneKey);
  list->second.append(who).push_back('\n');
  stored_bytes_ += who.size() + 1;
  // Best effort: the list only names departed ranks in messages.
  journal({{&list->first, &list->second}});
  wake(kGoneKey);
}

}  // namespace zs::tcp_wire
