// TCP rendezvous store. Rank 0 runs a single-threaded poll() server beside
// its own client; every rank (rank 0 included) talks to it over one TCP
// connection with a length-prefixed binary protocol (impl/comm/store/store_protocol.h,
// where requests are encoded and decoded).
//
// The server never trusts a length: a frame
// that is too long or does not parse exactly drops that client and nothing
// else. Deadlines live on the client: a parked GET/WAIT on the server costs
// nothing, and a client that gives up closes its connection so the late reply
// dies with it. Counters (ADD) are stored as decimal text, like torch's
// TCPStore, so get() of a counter reads "42".
#include <fcntl.h>
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
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "impl/comm/store/store.h"
#include "impl/comm/store/job_secret.h"
#include "impl/comm/store/store_protocol.h"
#include "impl/common/error.h"

namespace zs {
namespace {

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

std::string endpoint(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}


void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int64_t elapsed_ms(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Milliseconds left until deadline for poll(), rounded up so we never spin.
int remaining_ms(Clock::time_point deadline) {
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

// ---------------------------------------------------------------- server --

class Server {
 public:
  // secret: the job secret every connection must prove it knows, or "".
  Server(const std::string& host, int port, std::string secret);
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
    // A parked request: GET of get_key, or WAIT for the keys in missing.
    bool parked = false;
    bool parked_get = false;
    std::string get_key;
    std::unordered_set<std::string> missing;
  };

  void loop();
  void accept_all();
  void read_from(Conn& c);
  void process(Conn& c);
  bool handle(Conn& c, const char* body, size_t n);
  void reply(Conn& c, Status status, const char* data, size_t n);
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
  const std::string secret_;
  int stop_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<int>> waiters_;  // key -> parked fds
  std::deque<int> ready_;  // unparked clients whose buffered requests wait to be handled
  std::vector<char> read_buf_;
  std::thread thread_;
};

Server::Server(const std::string& host, int port, std::string secret) : secret_(std::move(secret)) {
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
  if (pipe2(stop_pipe_, O_NONBLOCK | O_CLOEXEC) != 0) {
    const int e = errno;
    close(listen_fd_);
    fail(Code::Bootstrap, "store server on ", where, ": cannot create a pipe: ", std::strerror(e));
  }
  read_buf_.resize(kReadChunk);
  thread_ = std::thread([this] { loop(); });
}

Server::~Server() {
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
    case Cmd::Wait: {
      std::unordered_set<std::string> missing;
      for (std::string& key : req.keys) {
        if (data_.count(key) == 0) missing.insert(std::move(key));
      }
      if (missing.empty()) {
        reply(c, Status::Ok, nullptr, 0);
      } else {
        for (const std::string& key : missing) waiters_[key].push_back(c.fd);
        c.parked = true;
        c.parked_get = false;
        c.missing = std::move(missing);
      }
      return true;
    }
    case Cmd::Add: {
      const std::string& key = req.keys[0];
      const int64_t delta = req.delta;
      int64_t value = 0;
      const auto it = data_.find(key);
      if (it != data_.end() && !store_detail::parse_int64(it->second, &value)) {
        const std::string msg = "it holds " + std::to_string(it->second.size()) +
                                " bytes that are not a decimal integer";
        reply(c, Status::Error, msg.data(), msg.size());
        return true;
      }
      if (__builtin_add_overflow(value, delta, &value)) {
        const std::string msg = it->second + " plus " + std::to_string(delta) + " overflows int64";
        reply(c, Status::Error, msg.data(), msg.size());
        return true;
      }
      std::string text = std::to_string(value);
      stored_bytes_ += key.size() + text.size() - (it == data_.end() ? 0 : key.size() + it->second.size());
      data_.insert_or_assign(key, std::move(text));
      std::string out;
      put_u64(out, static_cast<uint64_t>(value));
      reply(c, Status::Ok, out.data(), out.size());
      wake(key);
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

void Server::reply(Conn& c, Status status, const char* data, size_t n) {
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
      reply(w, Status::Ok, nullptr, 0);
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
  // Only a connection that proved itself may announce a rank's departure.
  const std::string gone = c.who.empty() || !c.trusted ? std::string() : gone_key(c.who);
  close(fd);
  conns_.erase(it);
  clients_.fetch_sub(1, std::memory_order_relaxed);
  if (!gone.empty() && data_.find(gone) == data_.end()) {
    stored_bytes_ += gone.size() + 1;
    data_.emplace(gone, "1");
    wake(gone);
  }
}

// ----------------------------------------------------------------- store --

class TcpStore final : public Store {
 public:
  TcpStore(const std::string& host, int port, bool is_server, milliseconds timeout,
           std::string who);
  ~TcpStore() override;
  int port() const { return port_; }

  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  int clients_connected() const override { return server_ ? server_->clients() : -1; }
  void interrupt(const std::string& why) override;

 private:
  // Interrupted: interrupt() was called during this call.
  enum class Io { Ok, Timeout, Closed, Interrupted };

  void connect_locked(Clock::time_point deadline);
  // The Hello round trip on a fresh connection; Bootstrap naming the port
  // when what answers is not a zeroshard store.
  void greet_locked(Clock::time_point deadline, Clock::time_point start);
  // Answers the store's job-secret challenge ("" when it sent none);
  // Bootstrap when this rank and the store disagree on having a secret.
  void prove_locked(const std::string& challenge, Clock::time_point deadline);
  void disconnect_locked();
  Io send_all(const std::string& data, Clock::time_point deadline);
  Io recv_exact(char* out, size_t n, Clock::time_point deadline);
  Io await(short events, Clock::time_point deadline);
  // One request/reply round trip. Returns false on timeout (the connection is
  // then closed); throws Bootstrap if the server went away.
  bool exchange(const std::string& body, Clock::time_point deadline, const std::string& what,
                std::string* payload);
  std::string missing_keys(const std::vector<std::string>& keys);
  [[noreturn]] void fail_timeout(const std::string& what, Clock::time_point start);
  [[noreturn]] void fail_interrupted(const std::string& what);

  std::unique_ptr<Server> server_;  // declared first: destroyed after the client is closed
  std::string host_;  // where the client connects
  int port_;
  std::string where_;
  const std::string who_;  // this client's name in its Hello
  const std::string secret_;  // the job secret (ZS_JOB_SECRET), or ""
  std::mutex mu_;
  int fd_ = -1;
  int io_errno_ = 0;
  // interrupt(): counts and wakes the poll of the call in flight, which
  // fails if the count moved since it began (call_interrupts_, under mu_).
  const int wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  std::atomic<uint64_t> interrupts_{0};
  uint64_t call_interrupts_ = 0;
  std::mutex why_mu_;
  std::string why_;
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server, milliseconds timeout,
                   std::string who)
    : host_(host.empty() ? "localhost" : host),
      port_(port),
      who_(std::move(who)),
      secret_(job_secret()) {
  timeout_ = timeout;
  if (is_server) {
    server_ = std::make_unique<Server>(host, port_, secret_);  // "" binds every interface
    port_ = server_->port();
  }
  where_ = endpoint(host_, port_);
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked(Clock::now() + timeout_);
}

TcpStore::~TcpStore() {
  disconnect_locked();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void TcpStore::interrupt(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why_ = why;
  }
  interrupts_.fetch_add(1);
  const uint64_t one = 1;
  if (wake_fd_ >= 0 && write(wake_fd_, &one, sizeof one) < 0) {
    // Cannot overflow in practice; the call then ends at its deadline.
  }
}

void TcpStore::fail_interrupted(const std::string& what) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why = why_;
  }
  fail(Code::Comm, what, " on store at ", where_, " was abandoned: ", why);
}

void TcpStore::disconnect_locked() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

// Connects with retries (backoff 10 ms doubling to 1 s): the server rank may
// start later than the others.
void TcpStore::connect_locked(Clock::time_point deadline) {
  const auto start = Clock::now();
  auto backoff = milliseconds(10);
  std::string last_error = "timeout too short to try";
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    AddrInfo ai;
    const std::string service = std::to_string(port_);
    const int rc = getaddrinfo(host_.c_str(), service.c_str(), &hints, &ai.list);
    if (rc != 0) {
      last_error = std::string("cannot resolve host: ") +
                   (rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc));
    }
    for (addrinfo* a = rc == 0 ? ai.list : nullptr; a != nullptr; a = a->ai_next) {
      const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        last_error = std::strerror(errno);
        continue;
      }
      int err = 0;
      if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          const int ready = poll(&p, 1, remaining_ms(deadline));
          socklen_t len = sizeof err;
          if (ready <= 0) {
            err = ready == 0 ? ETIMEDOUT : errno;
          } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
            err = errno;
          }
        }
      }
      if (err == 0) {
        set_nodelay(fd);
        fd_ = fd;
        greet_locked(deadline, start);
        return;
      }
      last_error = std::strerror(err);
      close(fd);
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, milliseconds(1000));
  }
  fail(Code::Bootstrap, "cannot connect to store at ", where_, " after ", elapsed_ms(start),
       " ms: ", last_error);
}

// After send or recv failed: EINTR is retried at once, EAGAIN waits (until
// the deadline) for the socket to be ready for `events`, anything else
// closes. Ok means "try the call again".
TcpStore::Io TcpStore::await(short events, Clock::time_point deadline) {
  if (errno == EINTR) return Io::Ok;
  if (errno != EAGAIN && errno != EWOULDBLOCK) {
    io_errno_ = errno;
    return Io::Closed;
  }
  pollfd p[2] = {{fd_, events, 0}, {wake_fd_, POLLIN, 0}};
  const int ready = poll(p, 2, remaining_ms(deadline));
  if (ready == 0) return Io::Timeout;
  if (ready < 0 && errno != EINTR) {
    io_errno_ = errno;
    return Io::Closed;
  }
  if (ready > 0 && (p[1].revents & POLLIN)) {
    uint64_t n = 0;
    if (read(wake_fd_, &n, sizeof n) < 0) {
      // Drained by an earlier call: nothing to do.
    }
    if (interrupts_.load() != call_interrupts_) return Io::Interrupted;
  }
  return Io::Ok;
}

TcpStore::Io TcpStore::send_all(const std::string& data, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (const Io io = await(POLLOUT, deadline); io != Io::Ok) return io;
  }
  return Io::Ok;
}

TcpStore::Io TcpStore::recv_exact(char* out, size_t n, Clock::time_point deadline) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd_, out + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) {
      io_errno_ = 0;
      return Io::Closed;
    }
    if (const Io io = await(POLLIN, deadline); io != Io::Ok) return io;
  }
  return Io::Ok;
}

void TcpStore::greet_locked(Clock::time_point deadline, Clock::time_point start) {
  constexpr size_t n = kStoreMagicBytes;
  const std::string body = store_protocol::encode_hello(who_);
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  frame += body;
  char header[kReplyHeaderBytes];
  Io io = send_all(frame, deadline);
  if (io == Io::Ok) io = recv_exact(header, sizeof header, deadline);
  const uint64_t len = io == Io::Ok ? load_le(header + 1, 8) : 0;
  if (io == Io::Ok && static_cast<Status>(header[0]) == Status::Ok &&
      (len == n || len == n + kChallengeBytes)) {
    std::string answer(static_cast<size_t>(len), '\0');
    io = recv_exact(answer.data(), answer.size(), deadline);
    if (io == Io::Ok && answer.compare(0, n, kStoreMagic) == 0) {
      prove_locked(answer.substr(n), deadline);
      return;
    }
  }
  disconnect_locked();
  if (io == Io::Interrupted) fail_interrupted("greeting");
  fail(Code::Bootstrap, "store at ", where_, " accepted the connection but ",
       io == Io::Timeout ? "did not answer" : "did not answer as a zeroshard store", " within ",
       elapsed_ms(start),
       " ms: another program (a previous job?) holds that port; choose a free one "
       "(ZS_STORE_PORT, MASTER_PORT)");
}

void TcpStore::prove_locked(const std::string& challenge, Clock::time_point deadline) {
  const char* same = ": start every rank with the same ZS_JOB_SECRET (zsrun makes one)";
  if (challenge.empty() && secret_.empty()) return;
  if (challenge.empty()) {
    disconnect_locked();
    fail(Code::Bootstrap, "this rank has a job secret (ZS_JOB_SECRET) but the store at ", where_,
         " checks none", same);
  }
  if (secret_.empty()) {
    disconnect_locked();
    fail(Code::Bootstrap, "the store at ", where_,
         " checks a job secret and this rank has none (ZS_JOB_SECRET is unset)", same);
  }
  const std::string body =
      store_protocol::encode_auth(job_proof(secret_, "store client " + who_, challenge));
  std::string frame;
  put_u32(frame, static_cast<uint32_t>(body.size()));
  frame += body;
  char header[kReplyHeaderBytes];
  Io io = send_all(frame, deadline);
  if (io == Io::Ok) io = recv_exact(header, sizeof header, deadline);
  if (io == Io::Ok && static_cast<Status>(header[0]) == Status::Ok && load_le(header + 1, 8) == 0)
    return;
  disconnect_locked();
  if (io == Io::Interrupted) fail_interrupted("the job-secret proof");
  if (io == Io::Timeout)
    fail(Code::Timeout, "the store at ", where_, " did not answer this rank's job-secret proof");
  fail(Code::Bootstrap, "the store at ", where_,
       " refused this rank's job secret: its ZS_JOB_SECRET differs from rank 0's", same);
}

bool TcpStore::exchange(const std::string& body, Clock::time_point deadline,
                        const std::string& what, std::string* payload) {
  call_interrupts_ = interrupts_.load();
  if (fd_ < 0) connect_locked(deadline);
  std::string frame;
  frame.reserve(4 + body.size());
  put_u32(frame, static_cast<uint32_t>(body.size()));
  frame += body;
  char header[kReplyHeaderBytes];
  Io io = send_all(frame, deadline);
  if (io == Io::Ok) io = recv_exact(header, sizeof header, deadline);
  uint64_t len = 0;
  if (io == Io::Ok) {
    len = load_le(header + 1, 8);
    if (len > kMaxReplyPayload) {
      disconnect_locked();
      fail(Code::Bootstrap, what, ": store at ", where_, " sent a reply of ", len,
           " bytes, more than the limit of ", kMaxReplyPayload);
    }
    payload->resize(static_cast<size_t>(len));
    io = recv_exact(payload->data(), payload->size(), deadline);
  }
  if (io != Io::Ok) {
    // A late reply must never be read as the answer to the next request.
    disconnect_locked();
    if (io == Io::Timeout) return false;
    if (io == Io::Interrupted) fail_interrupted(what);
    fail(Code::Bootstrap, what, ": connection to store at ", where_, " lost (",
         io_errno_ != 0 ? std::strerror(io_errno_) : "closed by the server",
         "); the store server (rank 0) may have exited");
  }
  if (static_cast<Status>(header[0]) != Status::Ok) {
    fail(Code::InvalidArgument, what, ": store at ", where_, " refused: ", *payload);
  }
  return true;
}

void TcpStore::fail_timeout(const std::string& what, Clock::time_point start) {
  fail(Code::Timeout, what, ": timed out after ", elapsed_ms(start), " ms (timeout ",
       timeout_.count(), " ms) on store at ", where_);
}

void TcpStore::set(const std::string& key, const std::vector<char>& value) {
  store_detail::check_key("set", key);
  store_detail::check_value(key, value.size());
  const std::string body = store_protocol::encode_set(key, value.data(), value.size());
  const std::string what = "set of key " + quote_key(key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  std::string reply;
  if (!exchange(body, start + timeout_, what, &reply)) fail_timeout(what, start);
}

std::vector<char> TcpStore::get(const std::string& key) {
  store_detail::check_key("get", key);
  const std::string body = store_protocol::encode_get(key);
  const std::string what = "get of key " + quote_key(key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  std::string reply;
  if (!exchange(body, start + timeout_, what, &reply)) fail_timeout(what, start);
  return std::vector<char>(reply.begin(), reply.end());
}

// Of keys, those not set now, as a message fragment. Best effort: it runs
// after a timeout, on a fresh connection with a short deadline of its own.
std::string TcpStore::missing_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 10;
  std::vector<const std::string*> missing;
  bool known = true;
  try {
    const auto deadline = Clock::now() + std::min(timeout_, milliseconds(1000));
    for (size_t i = 0; i < keys.size() && known; ++i) {
      const std::string body = store_protocol::encode_check(keys[i]);
      std::string reply;
      known = exchange(body, deadline, "check", &reply) && reply.size() == 1;
      if (known && reply[0] == 0) missing.push_back(&keys[i]);
    }
  } catch (const Error&) {
    known = false;
  }
  if (!known) {
    missing.clear();
    for (const std::string& key : keys) missing.push_back(&key);
  }
  std::string out;
  for (size_t i = 0; i < missing.size() && i < kShown; ++i) {
    out += (i ? ", " : "") + quote_key(*missing[i]);
  }
  if (missing.size() > kShown) out += " and " + std::to_string(missing.size() - kShown) + " more";
  return out;
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) store_detail::check_key("wait", key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  const auto deadline = start + timeout_;
  // Longer lists go in several requests under the one deadline.
  for (size_t first = 0; first < keys.size(); first += kMaxWaitKeys) {
    const size_t count = std::min(kMaxWaitKeys, keys.size() - first);
    const std::string body = store_protocol::encode_wait(keys.data() + first, count);
    std::string reply;
    const std::string what = "wait for " + std::to_string(keys.size()) + " key(s)";
    if (!exchange(body, deadline, what, &reply)) {
      const int64_t elapsed = elapsed_ms(start);
      const std::vector<std::string> chunk(keys.begin() + first, keys.begin() + first + count);
      fail(Code::Timeout, what, ": timed out after ", elapsed, " ms (timeout ", timeout_.count(),
           " ms) on store at ", where_, "; missing: ", missing_keys(chunk));
    }
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  store_detail::check_key("add", key);
  const std::string body = store_protocol::encode_add(key, delta);
  const std::string what = "add to key " + quote_key(key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  std::string reply;
  if (!exchange(body, start + timeout_, what, &reply)) fail_timeout(what, start);
  if (reply.size() != 8) {
    fail(Code::Bootstrap, what, ": store at ", where_, " sent a ", reply.size(),
         "-byte reply, expected 8");
  }
  return static_cast<int64_t>(load_le(reply.data(), 8));
}

bool TcpStore::check(const std::string& key) {
  store_detail::check_key("check", key);
  const std::string body = store_protocol::encode_check(key);
  const std::string what = "check of key " + quote_key(key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  std::string reply;
  if (!exchange(body, start + timeout_, what, &reply)) fail_timeout(what, start);
  if (reply.size() != 1) {
    fail(Code::Bootstrap, what, ": store at ", where_, " sent a ", reply.size(),
         "-byte reply, expected 1");
  }
  return reply[0] != 0;
}

}  // namespace

std::unique_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server,
                                      std::chrono::milliseconds timeout, int* bound_port,
                                      const std::string& who) {
  if (who.size() > kMaxClientName)
    fail(Code::InvalidArgument, "tcp store client name '", who, "' is ", who.size(),
         " bytes, more than ", kMaxClientName);
  if (port < (is_server ? 0 : 1) || port > 65535) {
    fail(Code::InvalidArgument, "tcp store port = ", port, ": expected ",
         is_server ? "0 (any free port)" : "1", "..65535");
  }
  if (!is_server && host.empty()) {
    fail(Code::InvalidArgument, "tcp store host is empty: clients need the server's address");
  }
  if (timeout.count() <= 0) {
    fail(Code::InvalidArgument, "tcp store timeout = ", timeout.count(), " ms: expected > 0");
  }
  auto store = std::make_unique<TcpStore>(host, port, is_server, timeout, who);
  if (bound_port != nullptr) *bound_port = store->port();
  return store;
}

}  // namespace zs
