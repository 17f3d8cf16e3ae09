#include "impl/fetch/coordinator.h"

#include <algorithm>
#include <cstring>

#include "impl/common/env.h"
#include "impl/core/context.h"

namespace zs {
namespace {

uint64_t unit_elements(const ParamList& unit) {
  uint64_t n = 0;
  for (const auto& p : unit) n += p->layout.numel;
  return n;
}

// The median of unit sizes (the upper one of an even count); 0 for none.
uint64_t median(std::vector<uint64_t> sizes) {
  if (sizes.empty()) return 0;
  std::nth_element(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(sizes.size() / 2), sizes.end());
  return sizes[sizes.size() / 2];
}

uint64_t median_unit(const std::vector<ParamList>& units) {
  std::vector<uint64_t> sizes;
  for (const auto& u : units) sizes.push_back(unit_elements(u));
  return median(std::move(sizes));
}

bool same_unit(const ParamList& a, const ParamList& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// FNV-1a over the param identities of a step, for the cross-rank check.
uint64_t hash_order(const std::vector<ParamList>& order) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& unit : order) {
    mix(unit.size());
    for (const auto& p : unit) mix(std::hash<std::string>()(p->name) ^ p->layout.numel);
  }
  return h;
}

// Whether every rank holds the same h, in one world all-reduce of both
// words: the bytewise max of h and of ~h (which is ~ the bytewise min of
// h) are equal exactly when every rank has the same h.
std::vector<bool> every_rank_agrees(Context& ctx, const std::vector<uint64_t>& hashes) {
  const size_t n = hashes.size();
  std::vector<uint8_t> both(16 * n);
  for (size_t k = 0; k < n; ++k) {
    const uint64_t not_h = ~hashes[k];
    std::memcpy(both.data() + 8 * k, &hashes[k], 8);
    std::memcpy(both.data() + 8 * (n + k), &not_h, 8);
  }
  ctx.world()->run("trace check", [&](Communicator& c) {
    c.allreduce(both.data(), both.data(), both.size(), DType::U8, ReduceOp::Max);
  });
  std::vector<bool> agreed(n, true);
  for (size_t k = 0; k < n; ++k)
    for (size_t i = 0; i < 8; ++i)
      agreed[k] = agreed[k] && both[8 * k + i] == static_cast<uint8_t>(~both[8 * (n + k) + i]);
  return agreed;
}

}  // namespace

Coordinator::~Coordinator() = default;

bool Coordinator::persistent(const Param& p) const {
  return static_cast<int64_t>(p.layout.numel) <= ctx_.config().param_persistence_threshold;
}

ParamList Coordinator::expand(const ParamList& params) const {
  ParamList out;
  std::set<const Param*> seen;
  for (const auto& p : params) {
    auto leaf = leaf_of_.find(p.get());
    const ParamList one{p};
    const ParamList& members = leaf == leaf_of_.end() ? one : leaves_[leaf->second];
    for (const auto& q : members)
      if (seen.insert(q.get()).second) out.push_back(q);
  }
  return out;
}

void Coordinator::add_leaf(const ParamList& params) {
  const Entry entry(*this);
  if (params.empty()) fail(Code::InvalidArgument, "a leaf group needs at least one param");
  for (size_t i = 0; i < params.size(); ++i)
    if (leaf_of_.count(params[i].get()))
      fail(Code::InvalidArgument, "leaf group: params[", i, "] ", params[i]->describe(),
           " is already in leaf group ", leaf_of_.at(params[i].get()));
  leaves_.push_back(params);
  for (const auto& p : params) leaf_of_[p.get()] = leaves_.size() - 1;
  invalidate();  // units change shape
}

void Coordinator::step_begin() {
  const Entry entry(*this);
  if (in_step_) fail(Code::InvalidState, "step_begin: the previous step has not ended");
  in_step_ = true;
  current_.clear();
  step_units_ = 0;
  step_gathered_ = false;
  step_trained_ = false;
  step_released_ = false;
  cache_returned_ = false;
  pos_ = 0;
  prefetched_upto_ = 0;
  following_ = false;
  // Along the order that came after the last step's the time before (a
  // trainer's steps repeat, or alternate between kinds), else the last's.
  uint64_t expect = last_order_;
  for (const auto& o : orders_)
    if (o.id == last_order_ && o.next_id != 0) expect = o.next_id;
  for (size_t i = 0; i < orders_.size(); ++i)
    if (orders_[i].id == expect) {
      following_ = true;
      followed_ = i;
    }
  if (following_) prefetch_ahead();
}

const Coordinator::Order& Coordinator::after(const Order& o) const {
  for (const auto& other : orders_)
    if (other.id == o.next_id) return other;
  return o;
}

bool Coordinator::reused_next_step(const Param& p, uint64_t spent) const {
  const auto reuse = static_cast<uint64_t>(ctx_.config().max_reuse_distance);
  // Before its first gradient a training step looks like inference: a
  // param it will not use again (an embedding's table after the forward, a
  // frozen model's weights) would stay gathered to the step's end.
  if (step_trained_ || followed().trained) return false;
  const Order& next = after(followed());
  for (size_t k = 0; k < next.units.size() && spent + next.prefix[k] < reuse; ++k)
    for (const auto& q : next.units[k])
      if (q.get() == &p) return true;
  return false;
}

std::set<const Param*> Coordinator::kept_for_next_step() const {
  const auto reuse = static_cast<uint64_t>(ctx_.config().max_reuse_distance);
  const auto max_live = static_cast<uint64_t>(ctx_.config().max_live_parameters);
  std::set<const Param*> keep;
  if (orders_.empty()) return keep;
  // In the next step's order, not live_'s (addresses differ between
  // ranks), so every rank keeps the same params.
  const Order& next = after(orders_.front());
  uint64_t held = 0;
  for (size_t k = 0; k < next.units.size() && next.prefix[k] < reuse; ++k)
    for (const auto& p : next.units[k]) {
      if (!live_.count(p.get()) || keep.count(p.get())) continue;
      if (held + p->layout.numel > max_live) return keep;
      held += p->layout.numel;
      keep.insert(p.get());
    }
  return keep;
}

size_t Coordinator::next_use(const Param& p) const {
  const auto& units = followed().units;
  for (size_t k = pos_; k < units.size(); ++k)
    for (const auto& q : units[k])
      if (q.get() == &p) return k;
  return units.size();
}

// The windows of a step. A key the config sets is taken as it is; one it
// leaves out (or "auto") fits the model, as FSDP2 gathers a block and
// prefetches the next: prefetch 2 typical units (refilled at half, so one
// to two units ahead), reuse 1 (the forward's last block stays for the
// backward's first), live at most the largest unit and the prefetch
// window; a typical unit is the median of the order's units. The prefetch
// window is at least Context::kFittedWindowFloorBytes: two units of a
// model of tiny modules (when not persistent) made one gather per unit,
// where DeepSpeed's window coalesces the whole model. DeepSpeed's defaults
// (5e7, 5e7, 1e9 elements) kept several blocks of a GPT-2 medium, and its
// 206 MiB head, gathered at once. Units are the same on every rank, and so
// are the windows. Between steps (kept_for_next_step: evaluation,
// generate()) the config's values hold either way.
Coordinator::Coordinator(Context& ctx)
    : ctx_(ctx),
      prefetch_given_(ctx.config().given("zero_optimization.prefetch_bucket_size")),
      reuse_given_(ctx.config().given("zero_optimization.max_reuse_distance")),
      live_given_(ctx.config().given("zero_optimization.max_live_parameters")),
      host_trim_(env_int("ZS_HOST_TRIM", -1) != 0) {}

Coordinator::Windows Coordinator::windows(const Order& o) const {
  const Config& c = ctx_.config();
  const auto pick = [](bool given, int64_t configured, uint64_t fitted) {
    return given || fitted == 0 ? static_cast<uint64_t>(configured) : fitted;
  };
  const uint64_t ahead = o.typical_unit == 0 ? 0 : std::max(2 * o.typical_unit, o.floor_elements);
  return {pick(prefetch_given_, c.prefetch_bucket_size, ahead),
          pick(reuse_given_, c.max_reuse_distance, o.typical_unit),
          pick(live_given_, c.max_live_parameters, ahead == 0 ? 0 : o.largest_unit + ahead)};
}

// The window ahead of the trainer covers up to prefetch_bucket_size
// elements of the followed order (the next unit always, unless the size is 0: no
// prefetch, as in DeepSpeed), within max_live_parameters. It is refilled,
// as one coalesced gather, once what is in flight ahead of the trainer
// drops below half a bucket: a model of many small modules pays one
// collective per half bucket, not one per module.
void Coordinator::prefetch_ahead() {
  const Windows w = windows(followed());
  const uint64_t bucket = w.prefetch, max_live = w.max_live;
  if (bucket == 0) return;
  const auto& units = followed().units;
  const auto& prefix = followed().prefix;
  if (prefetched_upto_ > pos_ && prefix[prefetched_upto_] - prefix[pos_] >= bucket / 2) return;
  ParamList missing;
  std::set<const Param*> queued;
  uint64_t elems = 0;
  size_t upto = prefetched_upto_;
  for (size_t k = std::max(pos_, prefetched_upto_); k < units.size(); ++k) {
    if (k > pos_ && prefix[k + 1] - prefix[pos_] > bucket) break;
    ParamList unit_missing;
    uint64_t unit_elems = 0;
    for (const auto& p : units[k]) {
      settle_locked(ctx_, *p);
      if (p->status() == ParamStatus::NotAvailable && !queued.count(p.get())) {
        unit_missing.push_back(p);
        unit_elems += p->layout.numel;
      }
    }
    if (k > pos_ && !unit_missing.empty() && stats_.live_elements + elems + unit_elems > max_live) break;
    for (const auto& p : unit_missing) {
      queued.insert(p.get());
      missing.push_back(p);
    }
    elems += unit_elems;
    upto = k + 1;
  }
  if (!missing.empty()) {
    fetch_params_locked(ctx_, missing);
    step_gathered_ = true;
    ++stats_.prefetches;
    adopt(missing);
  }
  prefetched_upto_ = std::max(prefetched_upto_, upto);
}

// Params the coordinator just gathered: persistent ones are kept for the
// step, the others count as live until released.
void Coordinator::adopt(const ParamList& gathered) {
  for (const auto& p : gathered) {
    fresh_.insert(p.get());
    if (persistent(*p)) {
      if (!kept_.count(p.get())) kept_[p.get()] = Kept{p, kept_count_++};
    } else {
      live_[p.get()] = p;
      stats_.live_elements += p->layout.numel;
    }
  }
  stats_.peak_live_elements = std::max(stats_.peak_live_elements, stats_.live_elements);
}

void Coordinator::fetch(const ParamList& params) {
  const Entry entry(*this);
  ctx_.check_async_error();
  const ParamList unit = expand(params);
  ++stats_.fetch_calls;
  if (all_kept(unit)) {  // no event: see the header
    for (const auto& p : unit) fresh_.erase(p.get());
    ++stats_.reuse_hits;
    return;
  }
  if (in_step_) {
    if (++step_units_ <= kMaxStepUnits) {
      current_.push_back(unit);
      // Before the first order is kept, the units so far stand for the
      // model (the reducer sizes its bucket from them): the first backward
      // would otherwise fill reduce_bucket_size's buckets (200 MiB a rank
      // at 162M), whose blocks the pool keeps as its bound ever after.
      if (orders_.empty()) ctx_.set_typical_unit(median_unit(current_));
    } else if (!current_.empty()) {  // too long to record (no kept order is this long)
      current_ = {};
      following_ = false;
    }
    // The step's first unit picks an order if the step began with none.
    if (following_ || current_.size() == 1) {
      const bool on = following_ && pos_ < followed().units.size() && same_unit(followed().units[pos_], unit);
      following_ = on || follow_another(unit);
      if (following_) ++pos_;  // else an order no kept one has: gather on demand for the rest of the step
    }
  }
  ParamList missing;
  bool waited = false, gathered = false;
  for (const auto& p : unit) {
    settle_locked(ctx_, *p);
    if (p->status() == ParamStatus::NotAvailable) missing.push_back(p);
  }
  if (!missing.empty()) {
    fetch_params_locked(ctx_, missing);
    step_gathered_ = true;
    ++stats_.demand_fetches;
    gathered = true;
    adopt(missing);
  }
  const auto wait_begin = Trace::Clock::now();
  for (const auto& p : unit) {
    // A unit none of whose params was gathered for it is a reuse hit.
    if (fresh_.erase(p.get())) gathered = true;
    if (p->status() != ParamStatus::Inflight) continue;
    if (!p->inflight()->done()) waited = true;
    p->inflight()->wait(-1);
    settle_locked(ctx_, *p);
  }
  if (waited) {  // the trainer stood still for its params: exposed communication
    const auto wait_end = Trace::Clock::now();
    ctx_.comm_stats()->add_wait(std::chrono::duration<double>(wait_end - wait_begin).count());
    if (ctx_.trace()) ctx_.trace()->event("wait", "fetch wait", "trainer", wait_begin, wait_end);
  }
  if (waited && missing.empty()) ++stats_.blocked_waits;
  if (!gathered) ++stats_.reuse_hits;
  if (in_step_ && following_) prefetch_ahead();
}

bool Coordinator::all_kept(const ParamList& unit) {
  for (const auto& p : unit)
    if (!kept_.count(p.get())) return false;
  // A kept param is gathered, or its prefetch is in flight, alike on every
  // rank; whether that prefetch has finished yet differs between ranks, so
  // it is waited for here: a unit counted as an event on one rank and not
  // on another would set the ranks following different orders, and their
  // gathers apart.
  for (const auto& p : unit) {
    settle_locked(ctx_, *p);
    if (p->status() == ParamStatus::Inflight) {
      const auto wait_begin = Trace::Clock::now();
      p->inflight()->wait(-1);
      settle_locked(ctx_, *p);
      ctx_.comm_stats()->add_wait(std::chrono::duration<double>(Trace::Clock::now() - wait_begin).count());
    }
    if (p->status() != ParamStatus::Available) return false;
  }
  return !unit.empty();
}

ParamList Coordinator::kept_in_order() const {
  std::vector<const Kept*> sorted;
  for (const auto& [raw, k] : kept_) sorted.push_back(&k);
  std::sort(sorted.begin(), sorted.end(), [](const Kept* a, const Kept* b) { return a->order < b->order; });
  ParamList out;
  for (const Kept* k : sorted) out.push_back(k->param);
  return out;
}

void Coordinator::release_one_param(Param& p) {
  auto it = live_.find(&p);
  if (it == live_.end()) return;
  release_when_done(ctx_, p);
  stats_.live_elements -= p.layout.numel;
  fresh_.erase(&p);
  live_.erase(it);
  step_released_ = step_released_ || in_step_;
}

void Coordinator::release(const ParamList& params) {
  const Entry entry(*this);
  const ParamList unit = expand(params);
  for (const auto& p : unit) step_trained_ = step_trained_ || p->grad_pushed;
  for (const auto& p : unit) {
    if (kept_.count(p.get())) continue;  // persistent for the step
    if (!live_.count(p.get())) {
      settle_locked(ctx_, *p);
      if (p->status() != ParamStatus::Available)
        fail(Code::InvalidState, "release: ", p->describe(), " is ", param_status_name(p->status()),
             ", it was not fetched through the coordinator");
      continue;  // gathered by the trainer itself: not ours to free
    }
    if (in_step_ && following_) {
      const size_t next = next_use(*p);
      // Units up to prefetched_upto_ count on their params being gathered.
      if (next < prefetched_upto_) continue;
      const auto& prefix = followed().prefix;
      const bool reused = next < followed().units.size()
                              ? prefix[next] - prefix[pos_] < windows(followed()).reuse
                              : stats_.live_elements <= static_cast<uint64_t>(ctx_.config().max_live_parameters) &&
                                    reused_next_step(*p, prefix.back() - prefix[pos_]);
      if (reused) {
        ++stats_.kept_for_reuse;
        continue;
      }
    }
    release_one_param(*p);
  }
  return_idle_cache_after_last_gather();
}

// A training step along its order has given back the last param it
// gathers: nothing is fetched again before the next step's forward, while
// the gradients, the embedding's backward and the optimizer step peak. So
// the host pool's idle blocks (the gathered layers' it kept for reuse)
// go back to the system now; the next forward maps them again, on huge
// pages (a few hundred faults a step). Not on a GPU, whose pool refills
// through cudaMalloc, nor with ZS_HOST_TRIM=0.
void Coordinator::return_idle_cache_after_last_gather() {
  if (cache_returned_ || !in_step_ || !following_ || !followed().trained ||
      pos_ != followed().units.size() || !live_.empty() || ctx_.device()->is_cuda() || !host_trim_)
    return;
  cache_returned_ = true;
  ctx_.device()->trim();
}

void Coordinator::invalidate() {
  if (!orders_.empty()) ++stats_.trace_invalidations;
  orders_.clear();
  last_order_ = 0;
  following_ = false;
  stats_.trace_length = 0;
}

bool Coordinator::follow_another(const ParamList& unit) {
  // current_ holds the step so far, `unit` last: another order can only be
  // told to agree with it while it is recorded.
  if (current_.size() != pos_ + 1) return false;
  for (size_t i = 0; i < orders_.size(); ++i) {
    const auto& units = orders_[i].units;
    if (units.size() <= pos_ || !same_unit(units[pos_], unit)) continue;
    if (!std::equal(units.begin(), units.begin() + static_cast<std::ptrdiff_t>(pos_), current_.begin(), same_unit))
      continue;
    followed_ = i;
    prefetched_upto_ = pos_;  // what the other order's window gathered goes back at the step end
    return true;
  }
  return false;
}

void Coordinator::note_order() {
  const auto same_as_step = [&](const Order& o) {
    return o.units.size() == current_.size() && std::equal(o.units.begin(), o.units.end(), current_.begin(), same_unit);
  };
  // The followed order, or another the step equals: one that the followed
  // one begins with (an inference forward following a training step's).
  size_t at = orders_.size();
  if (following_ && pos_ == followed().units.size()) at = followed_;
  for (size_t i = 0; i < orders_.size() && at == orders_.size(); ++i)
    if (same_as_step(orders_[i])) at = i;
  if (at == orders_.size()) {
    // New: recorded, in place of the least recently used once kMaxOrders
    // are kept.
    if (!orders_.empty()) ++stats_.trace_invalidations;
    if (orders_.size() == kMaxOrders) orders_.pop_back();
    Order o;
    o.id = ++orders_made_;
    o.units = std::move(current_);
    o.prefix.assign(o.units.size() + 1, 0);
    std::vector<uint64_t> sizes;
    size_t widest = 1;
    for (size_t k = 0; k < o.units.size(); ++k) {
      sizes.push_back(unit_elements(o.units[k]));
      o.prefix[k + 1] = o.prefix[k] + sizes.back();
      for (const auto& p : o.units[k]) widest = std::max(widest, p->elem_bytes());
    }
    o.floor_elements = Context::kFittedWindowFloorBytes / widest;
    if (!sizes.empty()) o.largest_unit = *std::max_element(sizes.begin(), sizes.end());
    o.typical_unit = median(std::move(sizes));
    orders_.push_back(std::move(o));
    at = orders_.size() - 1;
  }
  std::rotate(orders_.begin(), orders_.begin() + static_cast<std::ptrdiff_t>(at),
              orders_.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  for (auto& o : orders_)
    if (o.id == last_order_) o.next_id = orders_.front().id;
  last_order_ = orders_.front().id;
  stats_.trace_length = orders_.front().units.size();
  ctx_.set_typical_unit(orders_.front().typical_unit);
}

void Coordinator::drop_all(const std::set<const Param*>& keep) {
  std::vector<Param*> live;
  for (const auto& [raw, p] : live_) live.push_back(raw);
  for (Param* p : live) release_one_param(*p);
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (keep.count(it->first)) {
      ++it;
      continue;
    }
    release_when_done(ctx_, *it->second.param);
    fresh_.erase(it->first);
    it = kept_.erase(it);
  }
}

std::optional<bool> Coordinator::step_end(uint64_t token) {
  const Entry entry(*this);
  if (!in_step_) fail(Code::InvalidState, "step_end: no step has begun");
  in_step_ = false;
  ++stats_.steps;
  // Prefetched units the step never used, and params kept for a reuse that
  // never came, go back now; those the next step uses within
  // max_reuse_distance stay after a step that pushed no gradient.
  const auto release_live = [&](const std::set<const Param*>& keep) {
    std::vector<Param*> live;
    for (const auto& [raw, p] : live_)
      if (!keep.count(raw)) live.push_back(raw);
    for (Param* p : live) release_one_param(*p);
  };

  // Gradients pushed (by a release's unit, or any param the step fetched,
  // such as kept units' swept at the backward's end): an optimizer step
  // follows.
  for (const auto& unit : current_)
    for (const auto& p : unit) step_trained_ = step_trained_ || p->grad_pushed;
  // A quiet step left the orders and the kept and live params as the last
  // comparison found them, alike on every rank, so its end runs no
  // collective (which would be a forward's only one): one that recorded no
  // unit and gathered nothing (every unit kept, as in a model of small
  // params, or no fetch at all), or one that ran on what the last step kept
  // gathered (nothing gathered or released, no gradient pushed: a
  // generate() token of a model within max_reuse_distance). It learns no
  // order. Every kCompareQuietSteps-th quiet step in a row still compares,
  // for the trainer's token.
  const bool nothing_recorded = step_units_ == 0 && !step_gathered_;
  const bool nothing_changed = !step_gathered_ && !step_released_ && !step_trained_;
  if ((nothing_recorded || nothing_changed) && ++quiet_steps_ % kCompareQuietSteps != 0) {
    if (nothing_recorded) {
      release_live({});
      last_order_ = 0;
      stats_.trace_length = 0;
    }
    current_.clear();
    return std::nullopt;
  }
  quiet_steps_ = 0;
  // Every rank must agree on the order, and on the kept params that the
  // next optimizer step gathers again: compared in one collective.
  // A step too long to record compares its length.
  const uint64_t order_hash = step_units_ <= kMaxStepUnits ? hash_order(current_) : ~step_units_;
  const ParamList kept = kept_in_order();
  const std::vector<bool> agree = every_rank_agrees(ctx_, {order_hash, hash_order({kept}), token});
  agreed_kept_ = agree[1] ? kept : ParamList{};  // else nothing stays gathered across the step
  std::set<const Param*> keep;
  if (!agree[0]) {
    invalidate();  // ranks differ: record again next step, everywhere
  } else if (current_.empty()) {
    // Nothing recorded (every unit kept, or too long): the orders stay.
    last_order_ = 0;
    stats_.trace_length = 0;
  } else {
    drop_units_kept_next_step();
    if (current_.empty()) {  // every unit stays kept: the next step records none
      last_order_ = 0;
      stats_.trace_length = 0;
    } else {
      note_order();
      orders_.front().trained = step_trained_;
      if (!step_trained_) keep = kept_for_next_step();
    }
  }
  release_live(keep);
  current_.clear();
  return agree[2];
}

void Coordinator::forget(Param& param) {
  const auto is_it = [&](const std::shared_ptr<Param>& q) { return q.get() == &param; };
  const auto drop_from = [&](ParamList& list) {
    const auto before = list.size();
    list.erase(std::remove_if(list.begin(), list.end(), is_it), list.end());
    return list.size() != before;
  };
  bool in_order = false;
  for (const auto& o : orders_)
    for (const auto& unit : o.units) in_order = in_order || std::any_of(unit.begin(), unit.end(), is_it);
  if (in_order) invalidate();
  for (auto& unit : current_) drop_from(unit);
  current_.erase(std::remove_if(current_.begin(), current_.end(), [](const ParamList& u) { return u.empty(); }),
                 current_.end());
  if (auto it = live_.find(&param); it != live_.end()) {
    stats_.live_elements -= param.layout.numel;
    live_.erase(it);
  }
  kept_.erase(&param);
  fresh_.erase(&param);
  drop_from(agreed_kept_);
  drop_from(refresh_);
  if (auto leaf = leaf_of_.find(&param); leaf != leaf_of_.end()) {
    drop_from(leaves_[leaf->second]);
    leaf_of_.erase(leaf);
    invalidate();  // its unit changed shape
  }
  publish();
}

void Coordinator::reset_for_heal() {
  const Entry entry(*this, Entry::UnderCallersHold);
  drop_all();
  invalidate();
  in_step_ = false;
  current_.clear();
  step_units_ = 0;
  step_gathered_ = step_trained_ = step_released_ = false;
  quiet_steps_ = 0;
  following_ = false;
  pos_ = prefetched_upto_ = 0;
  agreed_kept_.clear();
  refresh_.clear();
  fresh_.clear();
  stats_.live_elements = 0;
}

// The agreed kept params that stay gathered across an optimizer step: the
// first of them, in order, within stage3_model_persistence_threshold.
ParamList Coordinator::kept_across_update() const {
  ParamList out;
  const auto budget = static_cast<uint64_t>(ctx_.config().model_persistence_threshold);
  uint64_t used = 0;
  for (const auto& p : agreed_kept_) {
    if (p->unregistered || used + p->layout.numel > budget) continue;
    used += p->layout.numel;
    out.push_back(p);
  }
  return out;
}

// A unit whose params were gathered on demand in this step and stay kept
// (persistent: a norm's weight) is recorded here, but from the next step on
// it is no event (fetch returns before recording it): left in the order,
// the next step would differ from it there and gather the rest of that
// step on demand. What stays kept is agreed on every rank (agreed_kept_),
// so the orders stay equal everywhere.
void Coordinator::drop_units_kept_next_step() {
  std::set<const Param*> stays;
  for (const auto& p : step_trained_ ? kept_across_update() : agreed_kept_) stays.insert(p.get());
  if (stays.empty()) return;
  const auto all_stay = [&](const ParamList& unit) {
    return std::all_of(unit.begin(), unit.end(), [&](const auto& p) { return stays.count(p.get()) != 0; });
  };
  current_.erase(std::remove_if(current_.begin(), current_.end(), all_stay), current_.end());
}

void Coordinator::on_params_updated() {
  const Entry entry(*this, Entry::UnderCallersHold);
  // The kept list is the same on every rank (step_end compared it), so the
  // noted params and their order are too.
  refresh_ = kept_across_update();
  std::set<const Param*> noted;
  for (const auto& p : refresh_) noted.insert(p.get());
  drop_all(noted);
}

void Coordinator::refresh_persistent() {
  const Entry entry(*this, Entry::UnderCallersHold);
  ParamList todo, fresh;  // fresh: not gathered now, so a new buffer
  for (const auto& p : refresh_) {
    if (p->unregistered) continue;
    if (p->status() == ParamStatus::Inflight) p->inflight()->wait(-1);  // a prefetch the step overtook
    settle_locked(ctx_, *p);
    // A group of one gathers by aliasing the shard, which the step rewrote.
    if (p->status() == ParamStatus::Available && p->full_aliases_shard()) continue;
    todo.push_back(p);
    if (p->status() == ParamStatus::NotAvailable) fresh.push_back(p);
  }
  refresh_.clear();
  if (todo.empty()) return;
  // Waited for, so that the step returns with every gathered copy current:
  // a trainer that reads a persistent param right after the step (an EMA,
  // a log) sees the new values, never a gather in progress.
  auto work = fetch_params_locked(ctx_, todo, /*into_gathered=*/true);
  ++stats_.prefetches;
  adopt(fresh);
  work->wait(-1);
  for (const auto& p : todo) settle_locked(ctx_, *p);
}

void Coordinator::publish() {
  CoordStats s = stats_;
  s.persistent_params = kept_.size();
  std::lock_guard<std::mutex> held(published_mu_);
  published_ = s;
}

CoordStats Coordinator::stats() const {
  std::lock_guard<std::mutex> held(published_mu_);
  return published_;
}

void shards_rewritten(Context& ctx, const ParamList& params) {
  ctx.expect_locked();
  for (const auto& p : params) ++p->shard_version;
  drop_secondaries(ctx);
  if (Coordinator* coord = coordinator_if_any(ctx)) {
    coord->on_params_updated();
    coord->refresh_persistent();
  }
}

}  // namespace zs
