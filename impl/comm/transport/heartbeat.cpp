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

// A beat: "ZSHB", flags (bit 0: goodbye), 3 zero bytes, rank (u32), the
// number of reports (u32), the sender's epoch (u64), its sequence number
// (u64); then each report (rank, its monitor, milliseconds since that
// monitor confirmed the silence: u32 each); then a 16-byte MAC of all that
// (zero without a secret). Little-endian.
constexpr size_t kHeaderBytes = 32;
constexpr size_t kReportBytes = 12;
constexpr size_t kMaxReports = 32;
constexpr size_t kMacBytes = 16;
constexpr size_t kMaxBeatBytes = kHeaderBytes + kMaxReports * kReportBytes + kMacBytes;
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


// The ranks 1, 2, 4, ... after `rank` (step +1) or before it (step -1),
// ascending: whom a rank of a sparse world beats to, or who beats to it.
std::vector<int> power_of_two_peers(int rank, int world, int step) {
  std::vector<int> out;
  for (int d = 1; d < world; d *= 2) out.push_back(((rank + step * d) % world + world) % world);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// a and b together, ascending, each rank once.
std::vector<int> sorted_union(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> out = a;
  out.insert(out.end(), b.begin(), b.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

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
                     std::chrono::milliseconds period, std::chrono::milliseconds limit,
                     const std::string& key_prefix)
    : rank_(rank), world_(world_size), period_(period), limit_(limit), secret_(job_secret()),
      key_prefix_(key_prefix) {
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
  if (full_mesh()) {
    for (int r = 0; r < world_; ++r)
      if (r != rank_) targets_.push_back(r);
  } else {
    targets_ = power_of_two_peers(rank_, world_, +1);
  }
  try {
    address_ = std::string(name) + " " + port + " " + std::to_string(epoch_);
    store.set(key(rank_), std::vector<char>(address_.begin(), address_.end()));
  } catch (...) {
    close(fd_);
    close(wake_fd_);
    throw;
  }
}

void Heartbeat::start(Store& store, const std::vector<int>& absent) {
  // Only the ranks this one beats to and those that beat to it (whose
  // targets include it): O(log N) addresses per rank.
  std::vector<Peer> peers(static_cast<size_t>(world_));
  const std::vector<int> monitors = full_mesh() ? targets_ : power_of_two_peers(rank_, world_, -1);
  for (int r : monitors) peers[static_cast<size_t>(r)].monitored = true;
  std::vector<int> known = sorted_union(targets_, monitors);
  known.erase(std::remove_if(known.begin(), known.end(),
                             [&](int r) { return std::find(absent.begin(), absent.end(), r) != absent.end(); }),
              known.end());
  const std::vector<Peer> read = read_peers(store, key_prefix_, known);
  for (size_t i = 0; i < known.size(); ++i) take_address(peers[static_cast<size_t>(known[i])], read[i]);
  const auto now = Clock::now();
  for (Peer& p : peers) p.heard = now;
  for (const int r : absent) {
    Peer& p = peers[static_cast<size_t>(r)];
    p.departed = p.dropped = true;
    p.monitored = false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_ = std::move(peers);
  }
  if (!absent.empty()) reform(store);  // past the full mesh: no live rank left unwatched
  thread_ = std::thread([this] { loop(); });
}

void Heartbeat::parse_address(int rank, const std::vector<char>& raw, Peer& p) {
  std::istringstream in(std::string(raw.begin(), raw.end()));
  std::string peer_port;
  in >> p.host >> peer_port >> p.epoch;
  if (!in)
    fail(Code::Bootstrap, "heartbeat: rank ", rank, " published a malformed address '",
         std::string(raw.begin(), raw.end()), "'");
  addrinfo* pa = resolve(p.host, peer_port.c_str(), AI_NUMERICHOST | AI_NUMERICSERV);
  p.addr.assign(reinterpret_cast<const char*>(pa->ai_addr),
                reinterpret_cast<const char*>(pa->ai_addr) + pa->ai_addrlen);
  freeaddrinfo(pa);
}

std::string Heartbeat::key_at(const std::string& prefix, int rank) { return prefix + "heartbeat/" + std::to_string(rank); }

std::string Heartbeat::key(int rank) const { return key_at(key_prefix_, rank); }

std::vector<Heartbeat::Peer> Heartbeat::read_peers(Store& store, const std::string& prefix,
                                                   const std::vector<int>& ranks) {
  std::vector<std::string> keys;
  for (const int r : ranks) keys.push_back(key_at(prefix, r));
  const std::vector<std::vector<char>> addresses = store.get_many(keys);  // one request
  std::vector<Peer> out(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) parse_address(ranks[i], addresses[i], out[i]);
  return out;
}

void Heartbeat::take_address(Peer& p, const Peer& read) {
  p.host = read.host;
  p.epoch = read.epoch;
  p.addr = read.addr;
}

void Heartbeat::republish(Store& store, const std::string& key_prefix) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    key_prefix_ = key_prefix;
  }
  store.set(key(rank_), std::vector<char>(address_.begin(), address_.end()));
}

void Heartbeat::readmit(int rank, Store& store) {
  if (rank < 0 || rank >= world_ || rank == rank_)
    fail(Code::InvalidArgument, "heartbeat: readmit of rank ", rank, " in a world of ", world_);
  std::string where;
  {
    std::lock_guard<std::mutex> lock(mu_);
    where = key(rank);
  }
  Peer fresh;
  parse_address(rank, store.get(where), fresh);
  // No loss callback straddles the reset: one that read the rank silent
  // before it lands before it, not after the caller forgot the loss.
  std::lock_guard<std::mutex> delivering(watchers_mu_);
  // The beats read a peer's address under send_mu_ alone: both locks, so
  // neither the sender nor the receiver sees it half written.
  std::lock_guard<std::mutex> sending(send_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[static_cast<size_t>(rank)];
  const bool known = !p.addr.empty();  // a target or a monitor (its address was read at start)
  p.host = fresh.host;
  p.epoch = fresh.epoch;
  if (known) p.addr = fresh.addr;
  p.last_seq = 0;
  p.heard = Clock::now();
  p.silent = Clock::duration::zero();
  p.departed = false;
  p.dropped = false;
  p.was_silent = false;
  p.confirmed = {};
  p.reported_by = -1;
}

void Heartbeat::drop(int rank) {
  if (rank < 0 || rank >= world_ || rank == rank_)
    fail(Code::InvalidArgument, "heartbeat: drop of rank ", rank, " in a world of ", world_);
  std::lock_guard<std::mutex> delivering(watchers_mu_);  // as in readmit
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[static_cast<size_t>(rank)];
  p.departed = true;
  p.dropped = true;
  p.was_silent = false;
  p.confirmed = {};
  p.reported_by = -1;
}

void Heartbeat::reform(Store& store) {
  if (full_mesh()) return;  // every rank beats to and judges every other already
  std::vector<int> members;
  std::vector<bool> known(static_cast<size_t>(world_));
  std::string prefix;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int r = 0; r < world_; ++r) {
      const Peer& p = peers_[static_cast<size_t>(r)];
      if (r == rank_ || !p.dropped) members.push_back(r);
      known[static_cast<size_t>(r)] = !p.addr.empty();
    }
    prefix = key_prefix_;
  }
  const int n = static_cast<int>(members.size());
  const int me = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  const auto among = [&](int step) {
    std::vector<int> out;
    for (const int at : power_of_two_peers(me, n, step)) out.push_back(members[static_cast<size_t>(at)]);
    std::sort(out.begin(), out.end());
    return out;
  };
  const std::vector<int> targets = among(+1), monitors = among(-1);
  std::vector<int> unknown = sorted_union(targets, monitors);
  unknown.erase(std::remove_if(unknown.begin(), unknown.end(), [&](int r) { return known[static_cast<size_t>(r)]; }),
                unknown.end());
  const std::vector<Peer> read = read_peers(store, prefix, unknown);
  std::lock_guard<std::mutex> delivering(watchers_mu_);  // as in readmit
  std::lock_guard<std::mutex> sending(send_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < unknown.size(); ++i) take_address(peers_[static_cast<size_t>(unknown[i])], read[i]);
  const auto now = Clock::now();
  for (int r = 0; r < world_; ++r) {
    Peer& p = peers_[static_cast<size_t>(r)];
    const bool judged = std::binary_search(monitors.begin(), monitors.end(), r);
    if (judged && !p.monitored) {  // judged afresh, as heard now
      p.heard = now;
      p.silent = Clock::duration::zero();
      p.was_silent = false;
      p.confirmed = {};
      p.reported_by = -1;
    }
    p.monitored = judged;
  }
  targets_ = targets;
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

bool Heartbeat::reported_locked(const Peer& p, Clock::time_point now) const {
  return p.reported_by >= 0 && now - p.confirmed < 3 * period_;
}

std::vector<Heartbeat::Report> Heartbeat::reports_locked(Clock::time_point now) const {
  std::vector<Report> out;
  if (full_mesh()) return out;  // every rank judges every other itself
  for (int r = 0; r < world_ && out.size() < kMaxReports; ++r) {
    const Peer& p = peers_[static_cast<size_t>(r)];
    if (r == rank_ || p.departed) continue;
    if (p.monitored && p.silent > limit_) {
      out.push_back({r, rank_, 0});
    } else if (!p.monitored && reported_locked(p, now)) {
      const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - p.confirmed);
      out.push_back({r, p.reported_by, static_cast<uint32_t>(age.count())});
    }
  }
  return out;
}

void Heartbeat::send_beats(bool goodbye) {
  std::lock_guard<std::mutex> lock(send_mu_);
  std::vector<Report> reports;
  if (!goodbye) {
    std::lock_guard<std::mutex> held(mu_);
    reports = reports_locked(Clock::now());
  }
  char beat[kMaxBeatBytes] = {};
  std::memcpy(beat, kMagic, sizeof kMagic);
  beat[4] = static_cast<char>(goodbye ? kGoodbye : 0);
  put_le(beat + 8, static_cast<uint64_t>(rank_), 4);
  put_le(beat + 12, reports.size(), 4);
  put_le(beat + 16, epoch_, 8);
  put_le(beat + 24, ++seq_, 8);
  size_t n = kHeaderBytes;
  for (const Report& r : reports) {
    put_le(beat + n, static_cast<uint64_t>(r.rank), 4);
    put_le(beat + n + 4, static_cast<uint64_t>(r.by), 4);
    put_le(beat + n + 8, r.age_ms, 4);
    n += kReportBytes;
  }
  if (!secret_.empty()) std::memcpy(beat + n, mac(beat, n).data(), kMacBytes);
  n += kMacBytes;
  for (int r : targets_) {
    const Peer& p = peers_[static_cast<size_t>(r)];  // addr changes only under send_mu_ (start, readmit)
    if (p.addr.empty()) continue;  // leave() before start()
    // Best effort: a lost beat is one of the eight a limit spans.
    (void)sendto(fd_, beat, n, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(p.addr.data()),
                 static_cast<socklen_t>(p.addr.size()));
    sent_.fetch_add(1, std::memory_order_relaxed);
  }
}

bool Heartbeat::receive(Clock::time_point now) {
  char beat[kMaxBeatBytes + 1];
  bool news = false;
  for (;;) {
    const ssize_t n = recv(fd_, beat, sizeof beat, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return news;  // drained (or an ICMP error from a peer gone: nothing to read)
    if (static_cast<size_t>(n) < kHeaderBytes + kMacBytes || std::memcmp(beat, kMagic, sizeof kMagic) != 0)
      continue;
    const uint64_t rank = get_le(beat + 8, 4), count = get_le(beat + 12, 4);
    if (rank >= static_cast<uint64_t>(world_) || rank == static_cast<uint64_t>(rank_)) continue;
    if (count > kMaxReports) continue;
    const size_t signed_bytes = kHeaderBytes + count * kReportBytes;
    if (static_cast<size_t>(n) != signed_bytes + kMacBytes) continue;
    if (!secret_.empty() &&
        sodium_memcmp(mac(beat, signed_bytes).data(), beat + signed_bytes, kMacBytes) != 0)
      continue;  // not from a process that knows the job secret
    const uint64_t epoch = get_le(beat + 16, 8), seq = get_le(beat + 24, 8);
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[static_cast<size_t>(rank)];
    // Unknown (not a monitor: its address was never read), another
    // context, or a replay.
    if (p.addr.empty() || epoch != p.epoch || seq <= p.last_seq) continue;
    p.last_seq = seq;
    p.heard = now;
    p.silent = Clock::duration::zero();
    if (static_cast<unsigned char>(beat[4]) & kGoodbye) p.departed = true;
    for (uint64_t i = 0; i < count; ++i) {
      const char* r = beat + kHeaderBytes + i * kReportBytes;
      const uint64_t who = get_le(r, 4), by = get_le(r + 4, 4), age = get_le(r + 8, 4);
      if (who >= static_cast<uint64_t>(world_) || who == static_cast<uint64_t>(rank_)) continue;
      Peer& q = peers_[static_cast<size_t>(who)];
      if (q.monitored || q.departed) continue;  // judged here, by its own beats
      const auto confirmed = now - std::chrono::milliseconds(age);
      if (q.reported_by >= 0 && confirmed <= q.confirmed) continue;  // not fresher
      news = news || !reported_locked(q, now);
      q.confirmed = confirmed;
      q.reported_by = static_cast<int>(by);
    }
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
    bool any_silent = false, newly_silent = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r = 0; r < world_; ++r) {
        Peer& p = peers_[static_cast<size_t>(r)];
        if (r != rank_ && !p.departed && p.monitored) p.silent += tick;
      }
    }
    // What peers sent while we waited (or stalled) clears them.
    const bool told = receive(now);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int r = 0; r < world_; ++r) {
        Peer& p = peers_[static_cast<size_t>(r)];
        if (r == rank_ || p.departed) continue;
        const bool silent = p.monitored ? p.silent > limit_ : reported_locked(p, now);
        newly_silent = newly_silent || (silent && !p.was_silent);
        p.was_silent = silent;
        any_silent = any_silent || silent;
      }
    }
    // A silence found or told goes on at once, not a period later: it
    // crosses the world in O(log N) hops of network latency.
    if (sending && (newly_silent || told) && !full_mesh()) send_beats(false);
    if (!any_silent) continue;
    std::lock_guard<std::mutex> held(watchers_mu_);
    for (const Watcher& w : watchers_) {
      try {
        if (w.loss) {
          // The ranks and the sentence from one look, so neither is judged
          // after a readmit the other missed.
          std::vector<int> gone;
          std::string why;
          {
            std::lock_guard<std::mutex> lock(mu_);
            gone = lost_locked(Clock::now());
            why = silence_locked(gone);
          }
          if (!gone.empty() && !why.empty()) w.loss(gone, why);
          continue;
        }
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
  return silence_locked(ranks);
}

std::string Heartbeat::silence_locked(const std::vector<int>& ranks) const {
  const auto now = Clock::now();
  for (int r : ranks) {
    if (r == rank_ || r < 0 || r >= world_) continue;
    const Peer& p = peers_[static_cast<size_t>(r)];
    if (p.departed) continue;
    if (!p.monitored) {
      if (!reported_locked(p, now)) continue;
      char limit[32];
      std::snprintf(limit, sizeof limit, "%.1f", std::chrono::duration<double>(limit_).count());
      return "rank " + std::to_string(r) + " has sent no heartbeat for over " + limit +
             " s (reported by rank " + std::to_string(p.reported_by) +
             ", which watches it): it is stopped or hung (alive but not running), or it died";
    }
    if (p.silent <= limit_) continue;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f",
                  std::chrono::duration<double>(now - p.heard).count());
    return "rank " + std::to_string(r) + " (host " + p.host + ") has sent no heartbeat for " +
           secs + " s: it is stopped or hung (alive but not running), or it died";
  }
  return "";
}

std::vector<int> Heartbeat::lost_locked(Clock::time_point now) const {
  std::vector<int> out;
  for (int r = 0; r < world_; ++r) {
    const Peer& p = peers_[static_cast<size_t>(r)];
    if (r == rank_ || p.departed) continue;
    if (p.monitored ? p.silent > limit_ : reported_locked(p, now)) out.push_back(r);
  }
  return out;
}

std::vector<int> Heartbeat::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_locked(Clock::now());
}

std::unique_ptr<Heartbeat::Subscription> Heartbeat::on_loss(LossFn fn) {
  std::lock_guard<std::mutex> held(watchers_mu_);
  watchers_.push_back(Watcher{{}, nullptr, std::move(fn)});
  return std::make_unique<Subscription>(*this, std::prev(watchers_.end()));
}

std::unique_ptr<Heartbeat::Subscription> Heartbeat::watch(
    std::vector<int> ranks, std::function<void(const std::string&)> fn) {
  std::lock_guard<std::mutex> held(watchers_mu_);
  watchers_.push_back(Watcher{std::move(ranks), std::move(fn), nullptr});
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
