// The fetch coordinator: a step records the order in which the trainer
// fetches params (one unit per fetch call, leaf groups expanded); later
// steps of the same order follow it and gather ahead of the trainer, up to
// prefetch_bucket_size elements in flight and max_live_parameters gathered.
// The last kMaxOrders distinct orders are kept, so a trainer whose steps
// alternate between kinds (an inference forward of a reference model, then
// the policy's training step; evaluation between training steps) prefetches
// in each: a step begins along the order that followed the last one the time
// before, and moves to another kept order that shares what the step fetched
// so far when its next unit differs. A step that matches none is recorded.
// Params of at most param_persistence_threshold elements stay gathered for
// the step, and across steps: an optimizer step drops every gathered copy
// and then gathers the kept persistent params again in one coalesced
// collective (up to model_persistence_threshold elements, in the order they
// were first kept, a list every rank agreed on at the last step end), so a
// model of many small params needs no gather per step. A unit whose params
// are all kept and gathered is no event at all: it is not recorded, so a
// trainer may skip fetching it (zeroshard.torch drops such modules' hooks)
// and the order stays the same; the order a step leaves drops the units
// that stay kept into the next step, which it records on demand the first
// time. A param used again within
// max_reuse_distance elements of the order is not released in between,
// also across a step end when no gradient was pushed since the optimizer
// step (inference: a generate() loop's forwards, each a step, find the
// params of a model within the distance still gathered); a step that
// pushed gradients ends in an optimizer step that rewrites the shards, so
// nothing stays gathered past its end.
// Prefetching gathers everything the window adds in one collective. A step
// whose order differs between ranks drops every kept order on every rank.
// A param unregistered (zs_param_destroy) leaves every list here, and the
// kept orders are dropped. Each call takes the engine lock itself; stats()
// reads without it.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "impl/fetch/gather.h"
#include "impl/partition/register.h"

namespace zs {

struct CoordStats {
  uint64_t steps = 0;
  uint64_t fetch_calls = 0;
  uint64_t demand_fetches = 0;  // gathers issued when the trainer asked
  uint64_t prefetches = 0;      // gathers issued ahead, along a kept order
  uint64_t blocked_waits = 0;   // fetch calls that found a gather still running
  uint64_t reuse_hits = 0;      // fetch calls satisfied without any gather
  uint64_t kept_for_reuse = 0;  // releases skipped for max_reuse_distance
  uint64_t persistent_params = 0;
  uint64_t live_elements = 0;
  uint64_t peak_live_elements = 0;
  uint64_t trace_invalidations = 0;  // steps that matched no kept order, and kept orders dropped
  uint64_t trace_length = 0;         // units of the order the last step recorded or followed
};

class Coordinator : public ParamKeeper {
 public:
  // A step longer than this is not recorded (a trainer that runs forwards
  // with gradients on and never ends the step would grow it without end):
  // it gathers on demand. 64 micro-batches of a 1000-unit model fit.
  static constexpr size_t kMaxStepUnits = size_t{1} << 18;
  explicit Coordinator(Context& ctx);
  ~Coordinator();

  void step_begin();
  // Collective over the world. `token` rides along in the step's one
  // agreement collective; the result says whether every rank passed the
  // same one (a trainer's own agreement at no collective of its own). A
  // quiet step (nothing gathered, and no unit recorded or nothing released
  // and no gradient pushed) runs no collective but every
  // kCompareQuietSteps-th in a row: nullopt when it ran none.
  std::optional<bool> step_end(uint64_t token = 0);
  static constexpr uint64_t kCompareQuietSteps = 64;
  // Blocks until every param of the unit (leaf groups expanded) is gathered.
  void fetch(const ParamList& params);
  void release(const ParamList& params);
  // The params become one unit: fetched and released together (the
  // reference's leaf modules, e.g. all experts of an MoE layer).
  void add_leaf(const ParamList& params);
  // Before an optimizer step rewrites the shards every gathered copy is
  // stale: drop them all but the agreed kept persistent params, which stay
  // (stale) where they are. Under the caller's hold of the engine lock.
  void on_params_updated();
  // After the shards were rewritten: gather the noted persistent params
  // again, into the buffers they have (one coalesced gather, waited for;
  // collective like the step), so views of them stay valid and current.
  // Under the caller's hold.
  void refresh_persistent();
  // The counters as of the last call that returned; never waits for one
  // in progress.
  CoordStats stats() const;
  // Under the engine lock (unregister_param): drop the kept orders that
  // use the param (all of them), the step's order, the kept and live
  // lists and its leaf group. Every rank unregisters the same params at
  // the same point, so this changes every rank alike.
  void forget(Param& param) override;
  // A heal (zs_heal_join) dropped the step a loss cut short on the
  // survivors, and a replacement starts with no history: every rank
  // forgets its orders, gathered params, open step and quiet-step count
  // here, so all begin the redone step alike (the replacement's orders
  // would otherwise differ from the survivors', and the quiet steps' count
  // decides which step ends run a collective). Leaf groups stay: every
  // rank's program makes the same. Under the caller's hold.
  void reset_for_heal();

 private:
  // An entry point's hold on the engine lock, or for one that runs under
  // its caller's hold (UnderCallersHold), a check of it; on leaving, it
  // publishes the counters for stats().
  struct Entry {
    enum Hold { Take, UnderCallersHold };
    explicit Entry(Coordinator& c, Hold hold = Take, const char* who = __builtin_FUNCTION())
        : coord(c) {
      if (hold == Take)
        held.emplace(c.ctx_.lock(who));
      else
        c.ctx_.expect_locked(who);
    }
    ~Entry() { coord.publish(); }
    Coordinator& coord;
    std::optional<EngineLock::Guard> held;
  };
  void publish();
  ParamList expand(const ParamList& params) const;
  bool persistent(const Param& p) const;
  void prefetch_ahead();
  void adopt(const ParamList& gathered);
  // Drops every kept order.
  void invalidate();
  // The step's next unit is not the followed order's: follow another kept
  // order that agrees with the step so far and has `unit` next, if any.
  bool follow_another(const ParamList& unit);
  // The step just ended matched the order followed, or is new: it becomes
  // the most recent, and the one the previous step's order is followed by.
  void note_order();
  ParamList kept_across_update() const;
  void drop_units_kept_next_step();
  void release_one_param(Param& p);
  void return_idle_cache_after_last_gather();
  // Releases every param the coordinator holds except those in `keep`.
  void drop_all(const std::set<const Param*>& keep = {});
  // Index of the next unit of the followed order (from pos_) that uses p,
  // or its size.
  size_t next_use(const Param& p) const;
  // Whether the step expected next uses p before `spent` elements (what
  // is left of this step) and those of its units before p's reach
  // max_reuse_distance. Never after a step that pushed gradients.
  bool reused_next_step(const Param& p, uint64_t spent) const;
  // The live params the step expected next uses within max_reuse_distance
  // elements of its start, taken in its order while they fit in
  // max_live_parameters: what a step end keeps gathered.
  std::set<const Param*> kept_for_next_step() const;

  Context& ctx_;
  bool in_step_ = false;
  // A recorded order of units, with the elements before each unit.
  struct Order {
    uint64_t id = 0;
    uint64_t next_id = 0;  // the order of the step after this one's, last time (0: none yet)
    std::vector<ParamList> units;
    std::vector<uint64_t> prefix;
    uint64_t typical_unit = 0;  // the median unit's elements
    uint64_t largest_unit = 0;
    // Context::kFittedWindowFloorBytes in elements of its widest dtype.
    uint64_t floor_elements = 0;
    // The last step along it pushed gradients: so will the next, which then
    // keeps nothing for the step after (reused_next_step).
    bool trained = false;
  };
  // The windows of one step along an order, in elements (windows()).
  struct Windows {
    uint64_t prefetch;  // ahead of the trainer
    uint64_t reuse;     // a released param whose next use is nearer stays
    uint64_t max_live;  // what prefetching may bring the live set to
  };
  Windows windows(const Order& o) const;
  // Which windows the config gives (read once: windows() runs per release).
  bool prefetch_given_ = false, reuse_given_ = false, live_given_ = false;
  // Distinct orders a trainer's steps take (train, evaluate, a reference
  // model's forward): more is rare, and each costs its params' references.
  static constexpr size_t kMaxOrders = 4;
  std::vector<Order> orders_;  // most recently used first
  // The order expected to follow `o`: the one that came after it last
  // time, else `o` itself (a loop of one kind of step).
  const Order& after(const Order& o) const;
  uint64_t orders_made_ = 0;
  uint64_t last_order_ = 0;  // id of the order the last step took (0: none)
  const Order& followed() const { return orders_[followed_]; }
  std::vector<ParamList> current_;  // this step's order so far
  uint64_t step_units_ = 0;         // units this step fetched (current_ stops at kMaxStepUnits)
  bool step_gathered_ = false;      // this step issued a gather
  bool step_trained_ = false;       // a param released this step had a gradient pushed
  bool step_released_ = false;      // this step released a live param
  bool cache_returned_ = false;     // this step gave the host pool's idle blocks back
  const bool host_trim_;            // ZS_HOST_TRIM is not 0 (read once)
  uint64_t quiet_steps_ = 0;        // quiet steps in a row (see step_end)
  bool following_ = false;  // this step matches the followed order so far
  size_t followed_ = 0;     // its index in orders_
  size_t pos_ = 0;          // next unit of it expected
  size_t prefetched_upto_ = 0;
  std::map<Param*, std::shared_ptr<Param>> live_;  // gathered by us, not persistent
  // Persistent, until the next optimizer step; each with the order in
  // which it was first kept.
  struct Kept {
    std::shared_ptr<Param> param;
    uint64_t order = 0;
  };
  std::map<Param*, Kept> kept_;
  uint64_t kept_count_ = 0;
  // Whether every param of `unit` is kept and gathered now.
  bool all_kept(const ParamList& unit);
  // The kept params in the order they were first kept.
  ParamList kept_in_order() const;
  ParamList agreed_kept_;  // as of the last step end whose kept list every rank shared
  ParamList refresh_;  // persistent params to gather again after the optimizer step
  std::set<const Param*> fresh_;  // gathered by us, not yet fetched
  std::map<const Param*, size_t> leaf_of_;
  std::vector<ParamList> leaves_;
  CoordStats stats_;
  mutable std::mutex published_mu_;
  CoordStats published_;
};

// After shards were rewritten outside the optimizer's step (a checkpoint or
// pretrained load, the optimizer's masters written back): `params` move to
// a new shard_version (a 16-bit param's fp32 master re-reads the values that
// changed before its next update), secondary shards and gathered copies are
// dropped, and persistent params are gathered again. Under the caller's
// hold of the engine lock.
void shards_rewritten(Context& ctx, const ParamList& params);

// The context's fetch coordinator, created on first use; null until then.
inline Coordinator& coordinator(Context& ctx) { return ctx.attachment<Coordinator>(); }
inline Coordinator* coordinator_if_any(Context& ctx) { return ctx.find_attachment<Coordinator>(); }

}  // namespace zs
