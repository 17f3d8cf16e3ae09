// A copy of this rank's shard state in its holder's host memory, kept
// current step by step (docs/healing.md, section 1; landing step 1: the
// copy, no healing yet).
//
// Seed: at the first step (and whenever the state may have been written
// other than by a step: a checkpoint load, a pointer handed out, set_step,
// a param's shard rewritten) each rank sends its whole optimizer state to
// its holder: per param the shard, the fp32 master, the moments and its
// update count. Per step: each rank sends its gradient shards (and which
// params got one) to its holder over the heal group, once they are final
// and before the norm all-reduce; the holder puts "received, whole, for the
// step its replica is at" into that all-reduce as a flag (the
// acknowledgement rides on it: no message back). The flags' sum being the
// world size commits the step; the holder then replays it on its replica
// through step_shard, the function the optimizer's own update runs, with
// the all-reduce's scale, on a thread of its own, overlapped with whatever
// follows; the next step's copy waits for it (one queue, in order), so a
// replica changes only by a committed step.
//
// Params frozen for good in no optimizer (a reference model's, a reward
// model's, a teacher's: zeroshard.hf freezes them) ride with the context's
// first optimizer (ordinal 1) as slots of their own: their shards go in its
// seeds (once, and again only if a shard is rewritten), never a gradient,
// so a replacement receives them at its join like the rest.
//
// The trainer's per-rank blob for the step (trainer_state.h) rides in the
// same exchange, after the gradients; the holder keeps the last committed
// step's beside the replica and hands it over with it.
//
// The copy is sent synchronously under the engine lock, straight from
// engine memory (ShardAccess), so no write can race it and it needs no
// write fence; a large same-host message is one cross-memory read.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"
#include "impl/optim/step_listener.h"

namespace zs::heal {

// The optimizer group of a slot that is a frozen param in no optimizer
// (PeerCopy::slots_locked).
constexpr size_t kInNoOptimizer = 0xFFFFFFFFu;

struct Digest {
  int source = -1;   // the rank whose state it is
  int64_t step = 0;  // optimizer steps the state has taken
  uint64_t bytes = 0;
  uint64_t hash = 0;  // XXH3-64 over step, then per param: updates, shard, master, moments
};

class PeerCopy final : public StepListener {
 public:
  PeerCopy(Context& ctx, Optimizer& opt);
  ~PeerCopy() override;

  float before_norm() override;
  void after_norm(float commits, bool skipped, double grad_scale) override;
  void detach() override;
  void step_figures(StepStats& st) override;
  // A regrow (regrow.h): the lowest live rank votes at a step that ends an
  // iteration, and every rank learns from the votes' sum whether the world
  // grows back after this step (grow_due, acted on by regrow_after_step).
  float grow_vote() override;
  void grow_votes(float sum) override { grow_due = sum > 0.5f; }
  bool grow_due = false;

  int holder() const { return holder_; }
  // This optimizer's place among the context's peer copies (1, 2, ... in
  // the order the ranks made their optimizers, alike on every rank).
  int ordinal() const { return ordinal_; }
  int source() const { return source_; }
  // Under the caller's hold: this rank's own state, and the replica it holds
  // (InvalidState before the first step has seeded it).
  Digest own_digest();
  Digest replica_digest();
  // Under the caller's hold, once the replay in flight is done: the steps
  // the replica has taken (-1 before a seed, or after a replay failed).
  int64_t settled_replica_step();

  // Healing (docs/healing.md, section 3), under the caller's hold. The
  // agreement's outcome (protocol.cpp), which zs_heal_join acts on.
  struct Agreed {
    bool done = false;
    int64_t committed = 0;
    std::vector<int> lost;
  };
  Agreed agreed;
  // Made in a replacement (Context::replacing): its state comes at
  // zs_heal_join, until which it has none of its own.
  bool awaiting_state = false;
  // The next step seeds the holder again (its holder was replaced: the
  // replacement holds nothing yet).
  void reseed() { seeded_ = false; }
  // The replica handed over, collective over the heal group: a holder whose
  // source is in `lost` sends it its replica (state at its step), and a
  // replacement (this rank in `lost`) receives its own state from its
  // holder into its optimizer's buffers and params' shards. Returns the
  // steps of the state received (a replacement), else -1. A replica that
  // does not fit this rank's optimizer is InvalidState naming the param.
  int64_t hand_over(const std::vector<int>& lost);

  // What the copy carries: the optimizer's slots, then (for ordinal 1) the
  // frozen params in no optimizer with a peer copy, in registration order,
  // as slots of group kInNoOptimizer with no master or moments.
  std::vector<Optimizer::SlotState> slots_locked() const;

  // A shrink (docs/healing.md, section 4), under the caller's hold. Which
  // rank holds world rank r's copy (-1: none, r not in the run).
  int holder_of(int r) const {
    return r >= 0 && static_cast<size_t>(r) < holders_.size() ? holders_[static_cast<size_t>(r)] : -1;
  }
  // The replica this rank holds, slot by slot, once its replay is done:
  // StateLost naming the source unless it is at `step`.
  struct Parts {
    BufferPtr shard, master, state1, state2;
    bool master_stale = false;
  };
  std::vector<Parts> replica_at(int64_t step);
  // After the shrink: the copies placed anew over `members` (the live world
  // ranks), the replica dropped, the next step seeding the new holder.
  void place_over(const std::vector<int>& members);

 private:
  struct Slot {  // one param of the replica
    uint64_t n = 0;
    DType dtype = DType::F32;
    size_t group = 0;
    BufferPtr shard, master, state1, state2, grad;
    DType state_dtype = DType::F32;
    bool master_is_shard = false, master_is_working = false, master_stale = false;
    bool pushed = false, sgd_first_momentum = false;
    int64_t updates = 0;
  };
  float copy();  // before_norm's work
  void wait_replay();
  void replay(float grad_scale);
  void worker();
  BufferPtr alloc(uint64_t bytes);
  // The holder's replica equals this rank's state as it is now (a copy with
  // the state went out, or the state came from that replica).
  void note_holder_has(const std::vector<Optimizer::SlotState>& mine);

  Context& ctx_;
  Optimizer& opt_;
  std::shared_ptr<Group> group_;
  int holder_ = -1, source_ = -1;  // world ranks
  std::vector<int> holders_;        // by world rank: its holder (-1: none)
  // A world rank's position in the heal group, where exchange() takes it.
  int at(int world_rank) const;
  int ordinal_ = 0;

  // As a source: what the holder has.
  bool seeded_ = false;
  uint64_t epoch_sent_ = 0;
  std::vector<uint64_t> versions_sent_;

  // As a holder: the replica, its step, and whether this step's copy landed.
  std::vector<Slot> replica_;
  // The source's per-rank blob: as this step's copy brought it, and as of
  // the replica's step (swapped in when the step commits). Buffers of the
  // peer-copy memory kind, kept for reuse across steps.
  struct Blob {
    bool has = false;
    int64_t step = 0;  // the optimizer step it was set for
    uint64_t bytes = 0;
    BufferPtr buf;
  };
  Blob blob_in_, blob_;
  bool replica_seeded_ = false;
  int64_t replica_step_ = 0;
  bool received_ = false;
  bool received_state_ = false;
  bool writing_state_ = false;  // a seed is being received into the replica
  std::string failure_;  // why this step's copy failed here, for after_norm's message
  // ZS_HEAL_DROP_COPY=<rank>:<step> (tests of the commit rule): that rank,
  // as a holder, takes the copy of that optimizer step (1-based) as lost,
  // once. -1: off.
  int drop_rank_ = -1;
  int64_t drop_step_ = -1;

  // The replay thread: one job at a time.
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr replay_error_;
  std::thread thread_;

  // zs_step_stats's figures: this step's copy (time, bytes received), and
  // the last replay's time (written by the worker, read after it is done).
  double copy_seconds_ = 0.0;
  uint64_t copy_bytes_ = 0;
  double replay_seconds_ = 0.0, replayed_seconds_ = 0.0;
};

// Attaches a PeerCopy to opt when the context heals
// (zeroshard.healing.peer_copy); refuses by name what it cannot copy yet.
void attach(Context& ctx, Optimizer& opt);
// opt's PeerCopy, or InvalidState naming the config key when it has none.
PeerCopy& peer_copy_of(Context& ctx, Optimizer& opt);
// Under the caller's hold: the params some peer copy of the context
// carries (its optimizers' slots, and the frozen params in none), sorted.
std::vector<const Param*> copied_params(Context& ctx);
// Under the caller's hold: how many optimizers keep a peer copy now, and
// which, in the order made (their ordinals').
size_t peer_copies(Context& ctx);
std::vector<Optimizer*> peer_copy_optimizers(Context& ctx);

}  // namespace zs::heal
