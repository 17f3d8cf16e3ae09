#include "impl/comm/transport/collective_watch.h"

#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

#include "impl/comm/transport/collective_label.h"
#include "impl/common/env.h"

namespace zs {
namespace {

constexpr auto kTick = std::chrono::milliseconds(100);
constexpr auto kMaxCheckGap = std::chrono::milliseconds(1000);
constexpr char kStoppedFirst[] = "' stopped first: ";

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

// A peer's published notes: its recent identities by sequence number and,
// once it failed, why.
struct PeerNotes {
  struct Item {
    uint64_t hash;
    bool done;
    std::string text;
  };
  std::map<uint64_t, Item> by_seq;
  uint64_t latest = 0;
  std::string failed;
};

PeerNotes parse_notes(const std::vector<char>& raw) {
  PeerNotes out;
  std::istringstream in(std::string(raw.begin(), raw.end()));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("failed ", 0) == 0) {
      out.failed = line.substr(7);
      continue;
    }
    std::istringstream fields(line);
    uint64_t seq = 0, hash = 0;
    int done = 0;
    fields >> seq >> std::hex >> hash >> std::dec >> done;
    if (!fields) continue;
    std::string text;
    std::getline(fields, text);
    if (!text.empty() && text[0] == ' ') text.erase(0, 1);
    out.by_seq[seq] = {hash, done != 0, text};
    if (seq >= out.latest) out.latest = seq;
  }
  return out;
}

// "finishing #11 ..." or "waiting in #12 ...": the peer's newest note, or "".
std::string last_report(const PeerNotes& notes) {
  const auto it = notes.by_seq.find(notes.latest);
  if (it == notes.by_seq.end()) return "";
  return (it->second.done ? "finishing " : "waiting in ") + it->second.text;
}

}  // namespace

std::string CollectiveWatch::notes_key(int rank) { return "watch/rank" + std::to_string(rank); }

std::vector<std::vector<char>> CollectiveWatch::notes_of(std::vector<int>& members) {
  if (members.empty())
    for (int member = 0; member < size_; ++member) members.push_back(member);
  std::vector<std::string> keys;
  for (const int member : members) keys.push_back(notes_key(member));
  return store_->get_many(keys);
}

std::string CollectiveIdentity::describe() const {
  std::string s = "#" + std::to_string(seq) + " " + op;
  if (!detail.empty()) s += " (" + detail + ")";
  if (!label.empty()) s += " for '" + label + "'";
  return s;
}

CollectiveIdentity make_identity(uint64_t seq, const char* op, std::string detail,
                                 uint64_t extra) {
  CollectiveIdentity id;
  id.seq = seq;
  id.op = op;
  id.detail = std::move(detail);
  id.label = CollectiveLabelScope::current();
  // Chained: each part seeds the next, so no concatenated copy is built
  // ("a" + "bc" and "ab" + "c" differ, as each part's length is hashed).
  uint64_t h = seq ^ (extra * 0x9E3779B97F4A7C15ull);
  h = XXH3_64bits_withSeed(id.op, std::strlen(id.op), h);
  h = XXH3_64bits_withSeed(id.detail.data(), id.detail.size(), h);
  id.hash = XXH3_64bits_withSeed(id.label.data(), id.label.size(), h);
  return id;
}

std::chrono::milliseconds collective_check_after() {
  return std::chrono::milliseconds(env_int("ZS_COLLECTIVE_CHECK_MS", 500));
}

std::chrono::milliseconds straggler_warn_after(std::chrono::milliseconds timeout) {
  const long long fallback = std::min<long long>(30000, timeout.count() / 3);
  return std::chrono::milliseconds(std::max<long long>(0, env_int("ZS_STRAGGLER_WARN_MS", static_cast<int>(fallback))));
}

CollectiveWatch::CollectiveWatch(std::string group, int rank, int size,
                                 std::shared_ptr<Store> store,
                                 std::chrono::milliseconds check_after,
                                 std::chrono::milliseconds warn_after,
                                 std::vector<int> world_ranks, std::vector<int> neighbours)
    : group_(std::move(group)),
      rank_(rank),
      size_(size),
      store_(std::move(store)),
      check_after_(check_after),
      warn_after_(warn_after),
      world_ranks_(std::move(world_ranks)),
      neighbours_(std::move(neighbours)) {
  if (store_ && size_ > 1) thread_ = std::thread([this] { loop(); });
}

CollectiveWatch::~CollectiveWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CollectiveWatch::begin(CollectiveIdentity id) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e;
  if (count_ < kHistory) {
    e = &ring_[(first_ + count_++) % kHistory];
  } else {
    e = &ring_[first_];
    first_ = (first_ + 1) % kHistory;
  }
  std::swap(e->id, id);  // the oldest entry's strings leave with `id`
  e->done = false;
  running_ = true;
  began_ = std::chrono::steady_clock::now();
  next_warn_ = warn_after_;
  next_check_ = check_after_;
  verdict_.clear();
}

void CollectiveWatch::end(bool completed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (count_ > 0) newest_locked().done = completed;
  running_ = false;
  abort_ = nullptr;
}

void CollectiveWatch::set_abort(std::function<void()> abort) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_ = std::move(abort);
  if (abort_) interruption_.clear();
  // A verdict reached between two waits cuts the next one short at once.
  if (abort_ && !verdict_.empty()) abort_();
}

std::string CollectiveWatch::verdict() const {
  std::lock_guard<std::mutex> lock(mu_);
  return verdict_;
}

void CollectiveWatch::interrupt(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!abort_ || !interruption_.empty()) return;
  interruption_ = why;
  abort_();
}

std::string CollectiveWatch::interruption() const {
  std::lock_guard<std::mutex> lock(mu_);
  return interruption_;
}

std::string CollectiveWatch::notes_locked() const {
  std::string notes;
  for (size_t i = 0; i < count_; ++i) {
    const Entry& e = at_locked(i);
    char head[64];
    std::snprintf(head, sizeof head, "%llu %016llx %d ",
                  static_cast<unsigned long long>(e.id.seq),
                  static_cast<unsigned long long>(e.id.hash), e.done ? 1 : 0);
    notes += head + one_line(e.id.describe()) + "\n";
  }
  if (!verdict_.empty()) notes += "failed " + one_line(verdict_) + "\n";
  return notes;
}

std::string CollectiveWatch::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (size_t i = 0; i < count_; ++i) {
    const Entry& e = at_locked(i);
    out += "  " + e.id.describe() + (e.done ? "" : "  <- did not complete") + "\n";
  }
  return out;
}

void CollectiveWatch::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kTick);
    if (stop_) break;
    if (!running_ || !verdict_.empty() || count_ == 0) continue;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - began_);
    if (waited < check_after_) continue;
    // Peers publish once their own wait passes check_after: name stragglers
    // only after they have had that long and a tick more to do so.
    const bool warn = warn_after_.count() > 0 && waited >= next_warn_ &&
                      waited >= check_after_ + 2 * kTick;
    if (!warn && waited < next_check_) continue;
    // Checks space out as the wait lengthens (a quarter of it, one tick to
    // kMaxCheckGap): a long wait of the whole job (a slow rank, a save)
    // costs the store a check per rank every second, not every tick.
    next_check_ = waited + std::clamp<std::chrono::milliseconds>(waited / 4, kTick, kMaxCheckGap);
    if (warn) next_warn_ = waited * 2;
    const CollectiveIdentity mine = newest_locked().id;
    const uint64_t seq = mine.seq;
    const std::string notes = published_seq_ == seq ? std::string() : notes_locked();
    lock.unlock();
    std::string verdict;
    std::vector<std::string> absent;
    try {
      verdict = compare_notes(mine, notes, warn ? &absent : nullptr);
    } catch (const std::exception&) {
      // The store is gone or slow: the collective's own timeout still holds.
    }
    if (warn && verdict.empty()) warn_straggler(mine, waited, absent);
    lock.lock();
    if (!notes.empty()) published_seq_ = seq;
    if (verdict.empty() || !running_ || count_ == 0 || newest_locked().id.seq != seq)
      continue;
    verdict_ = verdict;
    if (abort_) abort_();
    // Peers waiting elsewhere learn why this rank stopped.
    const std::string failed = notes_locked();
    lock.unlock();
    try {
      store_->set(notes_key(rank_), std::vector<char>(failed.begin(), failed.end()));
    } catch (const std::exception&) {
    }
    lock.lock();
  }
}

std::string CollectiveWatch::who(int rank) const {
  std::string s = "rank " + std::to_string(rank);
  if (rank >= 0 && static_cast<size_t>(rank) < world_ranks_.size() && world_ranks_[rank] != rank)
    s += " (world rank " + std::to_string(world_ranks_[rank]) + ")";
  return s;
}

void CollectiveWatch::warn_straggler(const CollectiveIdentity& mine,
                                     std::chrono::milliseconds waited,
                                     const std::vector<std::string>& absent) const {
  if (absent.empty()) return;  // everyone is here: slow, not straggling
  std::string names;
  for (size_t i = 0; i < absent.size(); ++i) names += (i ? "; " : "") + absent[i];
  std::fprintf(stderr,
               "zeroshard: warning: %s of group '%s' has waited %.1f s in %s: %zu of %d "
               "ranks have not arrived: %s\n",
               who(rank_).c_str(), group_.c_str(), waited.count() / 1000.0,
               mine.describe().c_str(), absent.size(), size_, names.c_str());
  std::fflush(stderr);
}

std::string CollectiveWatch::compare_notes(const CollectiveIdentity& mine,
                                          const std::string& notes,
                                          std::vector<std::string>* absent) {
  if (!notes.empty()) store_->set(notes_key(rank_), std::vector<char>(notes.begin(), notes.end()));
  const uint64_t seq = mine.seq;
  // A straggler warning names everyone absent: it reads every member.
  std::vector<int> members = absent ? std::vector<int>() : neighbours_;
  const auto read = notes_of(members);
  for (size_t i = 0; i < members.size(); ++i) {
    const int peer = members[i];
    if (peer == rank_) continue;
    if (read[i].empty()) {
      if (absent) absent->push_back(who(peer) + " (no report from it in this group yet: computing, stuck or gone)");
      continue;
    }
    const PeerNotes theirs = parse_notes(read[i]);
    // A verdict passed on from a neighbour is passed on as it is: it names
    // the rank that stopped first.
    if (!theirs.failed.empty())
      return theirs.failed.find(kStoppedFirst) != std::string::npos
                 ? theirs.failed
                 : "rank " + std::to_string(peer) + " of group '" + group_ + kStoppedFirst + theirs.failed;
    const auto it = theirs.by_seq.find(seq);
    if (absent && it == theirs.by_seq.end() && theirs.latest < seq) {
      const std::string last = last_report(theirs);
      absent->push_back(who(peer) + (last.empty() ? "" : " (last reported " + last + ")"));
    }
    if (it == theirs.by_seq.end() || it->second.hash == mine.hash) continue;
    const std::string my_side = "rank " + std::to_string(rank_) + " runs " + mine.describe();
    const std::string their_side = "rank " + std::to_string(peer) +
                                   (it->second.done ? " ran " : " runs ") + it->second.text;
    return "ranks disagree on collective #" + std::to_string(seq) + " of group '" + group_ +
           "': " + (peer < rank_ ? their_side + " where " + my_side
                                 : my_side + " where " + their_side) +
           " (every rank must issue the same collectives in the same order)";
  }
  return "";
}

std::string CollectiveWatch::whereabouts() {
  if (!store_) return "";
  std::string out;
  try {
    std::vector<int> everyone;
    const auto all = notes_of(everyone);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      if (all[static_cast<size_t>(peer)].empty()) {
        out += "; rank " + std::to_string(peer) +
               " never waited in a collective of this group long enough to report";
        continue;
      }
      const std::string last = last_report(parse_notes(all[static_cast<size_t>(peer)]));
      if (!last.empty()) out += "; rank " + std::to_string(peer) + " last reported " + last;
    }
  } catch (const std::exception&) {
    return "";
  }
  return out;
}

}  // namespace zs
