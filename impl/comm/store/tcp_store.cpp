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
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "impl/comm/store/store.h"
#include "impl/comm/store/tcp_store_server.h"
#include "impl/comm/store/tcp_wire.h"
#include "impl/comm/store/job_secret.h"
#include "impl/comm/store/store_protocol.h"
#include "impl/common/error.h"


namespace zs {
namespace {

using namespace tcp_wire;  // this file and the server speak it

// ----------------------------------------------------------------- store --

class TcpStore final : public Store {
 public:
  TcpStore(const std::string& host, int port, bool is_server, milliseconds timeout,
           std::string who, bool server_restarts);
  ~TcpStore() override;
  int port() const { return port_; }

  void set(const std::string& key, const std::vector<char>& value) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  void set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) override;
  std::vector<std::vector<char>> get_many(const std::vector<std::string>& keys) override;
  int clients_connected() const override { return server_ ? server_->clients() : -1; }
  void interrupt(const std::string& why) override;
  bool server_lost() const override { return server_lost_.load(); }

 private:
  // Interrupted: interrupt() was called during this call.
  enum class Io { Ok, Timeout, Closed, Interrupted };

  void connect_locked(Clock::time_point deadline);
  // The Hello round trip on a fresh connection; Bootstrap naming the port
  // when what answers is not a zeroshard store. False (disconnected) when
  // the connection closed before any answer and the server restarts: a dead
  // server's listening socket can take a connection as it closes.
  bool greet_locked(Clock::time_point deadline, Clock::time_point start);
  // Answers the store's job-secret challenge ("" when it sent none);
  // Bootstrap when this rank and the store disagree on having a secret.
  // False (disconnected) as greet_locked's.
  bool prove_locked(const std::string& challenge, Clock::time_point deadline);
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
  // A wait or get of many keys timed out in its request for keys[first,
  // first + count): Timeout naming those of them still missing.
  [[noreturn]] void fail_timeout_missing(const std::string& what, Clock::time_point start,
                                         const std::vector<std::string>& keys, size_t first, size_t count);
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
  uint64_t requests_ = 0;  // round trips made (under mu_), for ZS_STORE_STATS
  std::atomic<bool> server_lost_{false};
  // The server may be started again on its journal (zsstore under zsrun):
  // a call whose connection it closed connects again and resends, its ADDs
  // as ADD1 under this client's id, so that no resend adds twice.
  const bool server_restarts_;
  uint64_t client_id_ = 0;
  uint64_t add_seq_ = 0;   // under mu_
  uint64_t resends_ = 0;   // under mu_, for ZS_STORE_STATS
  std::mutex why_mu_;
  std::string why_;
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server, milliseconds timeout,
                   std::string who, bool server_restarts)
    : host_(host.empty() ? "localhost" : host),
      port_(port),
      who_(std::move(who)),
      secret_(job_secret()),
      server_restarts_(server_restarts) {
  timeout_ = timeout;
  if (server_restarts_) {
    std::random_device rd;
    client_id_ = (uint64_t{rd()} << 32) ^ rd();
  }
  if (is_server) {
    server_ = std::make_unique<Server>(host, port_, secret_);  // "" binds every interface
    port_ = server_->port();
  }
  where_ = endpoint(host_, port_);
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked(Clock::now() + timeout_);
}

TcpStore::~TcpStore() {
  if (store_stats_wanted())
    std::fprintf(stderr, "zeroshard: store stats: client '%s' made %llu requests (%llu resent to a restarted server)\n",
                 who_.c_str(), static_cast<unsigned long long>(requests_), static_cast<unsigned long long>(resends_));
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
        if (greet_locked(deadline, start)) {
          server_lost_ = false;
          return;
        }
        last_error = "the connection closed before the store answered";
        continue;
      }
      last_error = std::strerror(err);
      close(fd);
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    // A call waiting for a restarted server is abandoned as any other.
    if (interrupts_.load() != call_interrupts_) fail_interrupted("connecting");
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

bool TcpStore::greet_locked(Clock::time_point deadline, Clock::time_point start) {
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
      return prove_locked(answer.substr(n), deadline);
    }
  }
  disconnect_locked();
  if (io == Io::Closed && server_restarts_) return false;
  if (io == Io::Interrupted) fail_interrupted("greeting");
  fail(Code::Bootstrap, "store at ", where_, " accepted the connection but ",
       io == Io::Timeout ? "did not answer" : "did not answer as a zeroshard store", " within ",
       elapsed_ms(start),
       " ms: another program (a previous job?) holds that port; choose a free one "
       "(ZS_STORE_PORT, MASTER_PORT)");
}

bool TcpStore::prove_locked(const std::string& challenge, Clock::time_point deadline) {
  const char* same = ": start every rank with the same ZS_JOB_SECRET (zsrun makes one)";
  if (challenge.empty() && secret_.empty()) return true;
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
    return true;
  disconnect_locked();
  if (io == Io::Closed && server_restarts_) return false;  // the server died under the proof
  if (io == Io::Interrupted) fail_interrupted("the job-secret proof");
  if (io == Io::Timeout)
    fail(Code::Timeout, "the store at ", where_, " did not answer this rank's job-secret proof");
  fail(Code::Bootstrap, "the store at ", where_,
       " refused this rank's job secret: its ZS_JOB_SECRET differs from rank 0's", same);
}

bool TcpStore::exchange(const std::string& body, Clock::time_point deadline,
                        const std::string& what, std::string* payload) {
  call_interrupts_ = interrupts_.load();
  ++requests_;
  std::string frame;
  frame.reserve(4 + body.size());
  put_u32(frame, static_cast<uint32_t>(body.size()));
  frame += body;
  for (bool resent = false;; resent = true) {
    if (fd_ < 0) {
      try {
        connect_locked(deadline);
      } catch (const Error& e) {
        if (!resent || e.code() != Code::Bootstrap) throw;  // an interrupt says its own why
        server_lost_ = true;
        fail(Code::Bootstrap, what, ": the store at ", where_, " closed this rank's connection (its server exited) "
             "and no server answered there again within the timeout (", timeout_.count(), " ms): ", e.what());
      }
    }
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
    if (io == Io::Closed && server_restarts_ && Clock::now() < deadline) {
      // Its server exited under this call: the launcher starts another on
      // the same port and journal, and every request is safe to resend.
      disconnect_locked();
      ++resends_;
      continue;
    }
    if (io != Io::Ok) {
      // A late reply must never be read as the answer to the next request.
      disconnect_locked();
      if (io == Io::Timeout) return false;
      if (io == Io::Interrupted) fail_interrupted(what);
      server_lost_ = true;
      fail(Code::Bootstrap, what, ": connection to store at ", where_, " lost (",
           io_errno_ != 0 ? std::strerror(io_errno_) : "closed by the server",
           "); the store server (rank 0) may have exited");
    }
    if (static_cast<Status>(header[0]) != Status::Ok) {
      fail(Code::InvalidArgument, what, ": store at ", where_, " refused: ", *payload);
    }
    return true;
  }
}

void TcpStore::fail_timeout_missing(const std::string& what, Clock::time_point start,
                                    const std::vector<std::string>& keys, size_t first, size_t count) {
  const int64_t elapsed = elapsed_ms(start);  // before missing_keys' own round trips
  const std::vector<std::string> chunk(keys.begin() + first, keys.begin() + first + count);
  fail(Code::Timeout, what, ": timed out after ", elapsed, " ms (timeout ", timeout_.count(),
       " ms) on store at ", where_, "; missing: ", missing_keys(chunk));
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
    if (!exchange(body, deadline, what, &reply)) fail_timeout_missing(what, start, keys, first, count);
  }
}

void TcpStore::set_many(const std::vector<std::string>& keys, const std::vector<std::vector<char>>& values) {
  if (keys.size() != values.size())
    fail(Code::InvalidArgument, "set_many: ", keys.size(), " keys but ", values.size(), " values");
  for (size_t i = 0; i < keys.size(); ++i) {
    store_detail::check_key("set", keys[i]);
    store_detail::check_value(keys[i], values[i].size());
  }
  const std::string what = "set of " + std::to_string(keys.size()) + " key(s)";
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  // As many pairs per request as kMaxWaitKeys and kMaxRequestBytes allow.
  for (size_t first = 0; first < keys.size();) {
    size_t count = 0, bytes = 1 + 4;
    while (first + count < keys.size() && count < kMaxWaitKeys) {
      const size_t more = store_protocol::set_many_entry_bytes(keys[first + count], values[first + count].size());
      if (count > 0 && bytes + more > kMaxRequestBytes) break;
      bytes += more;
      ++count;
    }
    const std::string body = store_protocol::encode_set_many(keys.data() + first, values.data() + first, count);
    std::string reply;
    if (!exchange(body, start + timeout_, what, &reply)) fail_timeout(what, start);
    first += count;
  }
}

std::vector<std::vector<char>> TcpStore::get_many(const std::vector<std::string>& keys) {
  for (const std::string& key : keys) store_detail::check_key("get", key);
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  const auto deadline = start + timeout_;
  const std::string what = "get of " + std::to_string(keys.size()) + " key(s)";
  std::vector<std::vector<char>> values;
  values.reserve(keys.size());
  for (size_t first = 0; first < keys.size(); first += kMaxWaitKeys) {
    const size_t count = std::min(kMaxWaitKeys, keys.size() - first);
    const std::string body = store_protocol::encode_get_many(keys.data() + first, count);
    std::string reply;
    if (!exchange(body, deadline, what, &reply)) fail_timeout_missing(what, start, keys, first, count);
    // count x (u64 length, value), every length checked against what is left.
    size_t at = 0;
    for (size_t i = 0; i < count; ++i) {
      const bool room = reply.size() - at >= 8;
      const uint64_t len = room ? load_le(reply.data() + at, 8) : 0;
      if (!room || len > reply.size() - at - 8) {
        disconnect_locked();
        fail(Code::Bootstrap, what, ": store at ", where_, " sent a malformed reply (", reply.size(),
             " bytes for ", count, " values)");
      }
      values.emplace_back(reply.begin() + static_cast<std::ptrdiff_t>(at + 8),
                          reply.begin() + static_cast<std::ptrdiff_t>(at + 8 + len));
      at += 8 + len;
    }
    if (at != reply.size()) {
      disconnect_locked();
      fail(Code::Bootstrap, what, ": store at ", where_, " sent ", reply.size() - at, " bytes too many");
    }
  }
  return values;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  store_detail::check_key("add", key);
  const std::string what = "add to key " + quote_key(key);
  std::lock_guard<std::mutex> lock(mu_);
  const std::string body = server_restarts_ ? store_protocol::encode_add_once(key, delta, client_id_, ++add_seq_)
                                            : store_protocol::encode_add(key, delta);
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
                                      const std::string& who, bool server_restarts) {
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
  auto store = std::make_unique<TcpStore>(host, port, is_server, timeout, who, server_restarts);
  if (bound_port != nullptr) *bound_port = store->port();
  return store;
}

}  // namespace zs

