// The trainer's own state a replacement needs beside the engine's
// (docs/healing.md, section 1's table; landing step 4): a per-rank blob
// (its RNG states, captured when the optimizer step begins) and the shared
// state (loop position, LR scheduler: equal on every rank). Opaque bytes
// here; the Python frontend writes JSON.
//
// The per-rank blob is kept here as it is set, tagged with the step the
// optimizer is about to take, and rides in that step's peer copy to this
// rank's holder (peer_copy.cpp), who keeps it beside the replica once the
// step commits: a rank lost after its step committed has left the blob of
// that step with its holder, and one lost before the commit the blob of
// the step before (C is one behind). No store traffic a step, whatever the
// blob's size (GRPO's buffered completions ride in it). The shared state
// stays in this process: every survivor has it, and the lowest one posts it
// at the join.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "impl/core/context.h"
#include "impl/optim/optimizer.h"

namespace zs::heal {

class TrainerState : public Context::Attachment {
 public:
  explicit TrainerState(Context&) {}
  std::mutex mu;
  std::vector<char> shared;  // as last set here
  bool has_shared = false;
  // What the last join handed to this rank (a replacement): its own
  // blob at C and the survivors' shared state, each when there was one;
  // in a regrow's joiner, the lowest survivor's own blob (the donor's).
  std::vector<char> joined_rank, joined_shared, joined_donor;
  bool has_joined_rank = false, has_joined_shared = false, has_joined_donor = false;
  // This rank's blob as last set, for optimizer `pending_for`'s step
  // `pending_step` (null: none set).
  const Optimizer* pending_for = nullptr;
  int64_t pending_step = 0;
  std::shared_ptr<std::vector<char>> pending;  // rewritten in place when no copy in flight holds it
};

// Keeps this rank's blob for the step `opt` takes next. Not collective.
void set_rank_state(Context& ctx, Optimizer& opt, const void* data, size_t size);
void set_shared_state(Context& ctx, const void* data, size_t size);

// The blob set for `opt`'s step `step` (what its peer copy carries), or
// null when the trainer set none for that step.
std::shared_ptr<const std::vector<char>> rank_state_for(Context& ctx, const Optimizer& opt, int64_t step);
// `opt` is going: a blob set for it is dropped (no later optimizer made
// at its address takes it for its own).
void forget_rank_state(Context& ctx, const Optimizer& opt);
// In a replacement, at zs_heal_join: its own blob at C, as its lost
// predecessor's holder handed it over with the replica.
void handed_rank_state(Context& ctx, std::vector<char> blob);

// In zs_heal_join, once the verdict is posted: the lowest survivor posts
// its shared state under `key` (before its verdict, so a replacement reads
// it without waiting); a replacement reads it.
void post_shared(Context& ctx, Store& store, const std::string& key);
void receive_shared(Context& ctx, Store& store, const std::string& shared_key);

// In a regrow, for each optimizer: the lowest survivor posts its own blob
// of `opt`'s step `step` (the one the regrow came in) when the trainer set
// one, else a marker of none; a joiner keeps the one posted. A joiner has
// no predecessor whose blob it could take: a trainer takes from it what a
// rank takes from rank 0 at a checkpoint load (module buffers), never its
// RNG. Both copy.
void post_donor(Context& ctx, Store& store, const std::string& key, const Optimizer& opt, int64_t step);
void receive_donor(Context& ctx, Store& store, const std::string& key);

// which 0: this rank's blob, 1: the shared state, 2: the donor's blob, as
// the last join handed them over; false when it handed none.
bool joined_state(Context& ctx, int which, std::vector<char>* out);

}  // namespace zs::heal
