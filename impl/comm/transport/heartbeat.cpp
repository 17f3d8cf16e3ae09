#include "impl/comm/transport/heartbeat.h"

#include <netdb.h>
#include <poll.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "impl/comm/store/job_secret.h"
#include "impl/common/env.h"
#include "impl/common/error.h"

namespace zs {
namespace {

using Clock = std::chrono::steady_clock;

// A beat: "ZSHB", flags (bit 0: goodbye), 3 zero bytes, rank (u32), 4 zero
// bytes, the sender's epoch (u64), its sequence number (u64), then a 16-byte
// MAC of the first 32 bytes (zero without a secret). Little-endian.
constexpr size_t kSignedBytes = 32;
constexpr size_t kMacBytes = 16;
constexpr size_t kBeatBytes = kSignedBytes + kMacBytes;
constexpr char kMagic[4] = {'Z', 'S', 'H', 'B'};
constexpr unsigned char kGoodbye = 1;

void put_le(char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string key_of(int rank) { return "zs/heartbeat/" + std::to_string(rank); }

addrinfo* resolve(const std::string& host, const char* port, int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port, &hints, &res);
  if (rc != 0)
    fail(Code::Bootstrap, "heartbeat: cannot resolve host '", host, "': ", gai_strerror(rc),
         " (set ZS_SOCKET_HOST or transport_host to an address of this machine)");
  return res;
}

}  // namespace

std::chrono::milliseconds heartbeat_period() {
  return std::chrono::milliseconds(env_int("ZS_HEARTBEAT_MS", 250));
}

std::chrono::milliseconds heartbeat_limit() {
  const int limit = env_int("ZS_HEARTBEAT_TIMEOUT_MS", 2000);
  const auto period = heartbeat_period();
  if (period.count() > 0 && limit <= 2 * period.count())
    fail(Code::Bootstrap, "ZS_HEARTBEAT_TIMEOUT_MS ", limit,
         " must be more than twice the heartbeat period (ZS_HEARTBEAT_MS ", period.count(),
         "): a peer would be called silent between two beats");
  return std::chrono::milliseconds(limit);
}

Heartbeat::Heartbeat(int rank, int world_size, const std::string& host, Store& store,
                     std::chrono::milliseconds period, std::chrono::milliseconds limit)
    : rank_(rank), world_(world_size), period_(period), limit_(limit), secret_(job_secret()) {
  const std::string random = make_challenge();
  std::memcpy(&epoch_, random.data(), sizeof epoch_);

  // Bound where the transport is, never on every interface unless the
  // user's host says so.
  addrinfo* res = resolve(host, "0", AI_PASSIVE);
  std::string why = "no address";
  for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      close(fd);
      continue;
    }
    // Room for a few periods of beats from many peers (best effort, the
    // system's cap applies): a full buffer drops the newest beats.
    const int rcvbuf = 1 << 20;
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    fd_ = fd;
  }
  freeaddrinfo(res);
  if (fd_ < 0)
    fail(Code::Bootstrap, "heartbeat: cannot bind a UDP socket on host '", host, "': ", why,
         " (set ZS_SOCKET_HOST or transport_host to an address of this machine, or "
         "ZS_HEARTBEAT_MS=0 to turn heartbeats off)");
  sockaddr_storage self{};
  socklen_t len = sizeof self;
  getsockname(fd_, reinterpret_cast<sockaddr*>(&self), &len);
  char name[NI_MAXHOST], port[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&self), len, name, sizeof name, port, sizeof port,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    close(fd_);
    fail(Code::Bootstrap, "heartbeat: cannot read back the address bound on host '", host, "'");
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);

  peers_.resize(static_cast<size_t>(world_));
  try {
    const std::string mine = std::string(name) + " " + port + " " + std::to_string(epoch_);
    store.set(key_of(rank_), std::vector<char>(mine.begin(), mine.end()));
  } catch (...) {
    close(fd_);
    close(wake_fd_);
    throw;
  }
}

void Heartbeat::start(Store& store) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(key_of(r));
  store.wait(keys);
  std::vector<Peer> peers(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    Peer& p = peers[static_cast<size_t>(r)];
    const std::vector<char> raw = store.get(key_of(r));
    std::istringstream in(std::string(raw.begin(), raw.end()));
    std::string peer_port;
    in >> p.host >> peer_port >> p.epoch;
    if (!in)
      fail(Code::Bootstrap, "heartbeat: rank ", r, " published a malformed address '",
           std::string(raw.begin(), raw.end()), "'");
    addrinfo* pa = resolve(p.host, peer_port.c_str(), AI_NUMERICHOST | AI_NUMERICSERV);
    p.addr.assign(reinterpret_cast<const char*>(pa->ai_addr),
                  reinterpret_cast<const char*>(pa->ai_addr) + pa->ai_addrlen);
    freeaddrinfo(pa);
  }
  const auto now = Clock::now();
  for (Peer& p : peers) p.heard = now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_ = std::move(peers);
  }
  thread_ = std::thread([this] { loop(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof one) < 0) {
    // The eventfd cannot be full; the thread sees stop_ within a period anyway.
  }
  if (thread_.joinable()) thread_.join();
  close(fd_);
  close(wake_fd_);
}

std::string Heartbeat::mac(const char* data, size_t bytes) const {
  static const std::string kContext("zeroshard heartbeat", sizeof "zeroshard heartbeat");
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, reinterpret_cast<const unsigned char*>(secret_.data()),
                              secret_.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(kContext.data()),
                                kContext.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(data), bytes);
  unsigned char full[crypto_auth_hmacsha256_BYTES];
  crypto_auth_hmacsha256_final(&st, full);
  return std::string(reinterpret_cast<const char*>(full), kMacBytes);
}

void Heartbeat::send_beats(bool goodbye) {
  std::lock_guard<std::mutex> lock(send_mu_);
  char beat[kBeatBytes] = {};
  std::memcpy(beat, kMagic, sizeof kMagic);
  beat[4] = static_cast<char>(goodbye ? kGoodbye : 0);
  put_le(beat + 8, static_cast<uint64_t>(rank_), 4);
  put_le(beat + 16, epoch_, 8);
  put_le(beat + 24, ++seq_, 8);
  if (!secret_.empty()) std::memcpy(beat + kSignedBytes, mac(beat, kSignedBytes).data(), kMacBytes);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const Peer& p = peers_[static_cast<size_t>(r)];  // addr is set once, before the thread
    if (p.addr.empty()) continue;  // leave() before start()
    // Best effort: a lost beat is one of the eight a limit spans.
    (void)sendto(fd_, beat, sizeof beat, MSG_DONTWAIT,
                 reinterpret_cast<const sockaddr*>(p.addr.data()),
                 static_cast<socklen_t>(p.addr.size()));
  }
}

void Heartbeat::receive(Clock::time_point now) {
  char beat[kBeatBytes + 1];
  for (;;) {
    const ssize_t n = recv(fd_, beat, sizeof beat, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // drained (or an ICMP error from a peer gone: nothing to read)
    if (static_cast<size_t>(n) != kBeatBytes || std::memcmp(beat, kMagic, sizeof kMagic) != 0)
      continue;
    const uint64_t rank = get_le(beat + 8, 4);
    if (rank >= static_cast<uint64_t>(world_) || rank == static_cast<uint64_t>(rank_)) continue;
    if (!secret_.empty() &&
        sodium_memcmp(mac(beat, kSignedBytes).data(), beat + kSignedBytes, kMacBytes) != 0)
      continue;  // not from a process that knows the job secret
    const uint64_t epoch = get_le(beat + 16, 8), seq = get_le(beat + 24, 8);
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[static_cast<size_t>(rank)];
    if (epoch != p.epoch || seq <= p.last_seq) continue;  // another context, or a replay
    p.last_seq = seq;
    p.heard = now;
    p.silent = Clock::duration::zero();
    if (static_cast<unsigned char>(beat[4]) & kGoodbye) p.departed = true;
  }
}

void Heartbeat::loop() {
  auto last = Clock::now();
  auto next_send = last;
  for (;;) {
    bool sending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      sending = sending_;
    }
    auto now = Clock::now();
    if (sending && now >= next_send) {
      send_beats(false);
      next_send = now + period_;
    }
    const auto wait = sending ? next_send - now : Clock::duration(period_);
    const int wait_ms = static_cast<int>(
        std::chrono::ceil<std::chrono::milliseconds>(std::max(wait, Clock::duration::zero()))
            .count());
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    (void)poll(fds, 2, wait_ms);
    now = Clock::now();
    // Only time this thread ran counts as a peer's silence: after a stall
    // of our own (load, or this process stopped) a tick counts two periods.
    const auto tick = std::min<Clock::duration>(now - last, 2 * period_);
    last = now;
    bool any_silent = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r = 0; r < world_; ++r) {
        Peer& p = peers_[static_cast<size_t>(r)];
        if (r != rank_ && !p.departed) p.silent += tick;
      }
    }
    receive(now);  // what peers sent while we waited (or stalled) clears them
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r = 0; r < world_; ++r) {
        const Peer& p = peers_[static_cast<size_t>(r)];
        if (r != rank_ && !p.departed && p.silent > limit_) any_silent = true;
      }
    }
    if (!any_silent) continue;
    std::lock_guard<std::mutex> held(watchers_mu_);
    for (const Watcher& w : watchers_) {
      try {
        const std::string why = silence(w.ranks);
        if (!why.empty()) w.fn(why);
      } catch (const std::exception&) {
        // Out of memory for a message: the next check tries again.
      }
    }
  }
}

std::string Heartbeat::silence(const std::vector<int>& ranks) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  for (int r : ranks) {
    if (r == rank_ || r < 0 || r >= world_) continue;
    const Peer& p = peers_[static_cast<size_t>(r)];
    if (p.departed || p.silent <= limit_) continue;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f",
                  std::chrono::duration<double>(now - p.heard).count());
    return "rank " + std::to_string(r) + " (host " + p.host + ") has sent no heartbeat for " +
           secs + " s: it is stopped or hung (alive but not running), or it died";
  }
  return "";
}

std::unique_ptr<Heartbeat::Subscription> Heartbeat::watch(
    std::vector<int> ranks, std::function<void(const std::string&)> fn) {
  std::lock_guard<std::mutex> held(watchers_mu_);
  watchers_.push_back(Watcher{std::move(ranks), std::move(fn)});
  return std::make_unique<Subscription>(*this, std::prev(watchers_.end()));
}

Heartbeat::Subscription::~Subscription() {
  std::lock_guard<std::mutex> held(hb_.watchers_mu_);
  hb_.watchers_.erase(it_);
}

void Heartbeat::leave() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sending_) return;
    sending_ = false;
  }
  // Three times: a lost goodbye would make this rank look stopped.
  for (int i = 0; i < 3; ++i) send_beats(true);
}

}  // namespace zs
