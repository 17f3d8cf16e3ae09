// The trainer's own state a replacement needs beside the engine's
// (docs/healing.md, section 1's table; landing step 4): a per-rank blob
// (its RNG states, captured when the optimizer step begins) and the shared
// state (loop position, LR scheduler: equal on every rank). Opaque bytes
// here; the Python frontend writes JSON.
//
// The per-rank blob goes to the store as it is set, tagged with the step
// the optimizer is about to take, before that step can commit: a rank lost
// after its step committed has left the blob of that step. Two slots per
// rank (the step's parity), since a loss before the commit leaves C one
// step behind the last blob posted. The shared state stays in this
// process: every survivor has it, and the lowest one posts it at the join.
#pragma once

#include <cstdint>
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
  // blob at C and the survivors' shared state, each when there was one.
  std::vector<char> joined_rank, joined_shared;
  bool has_joined_rank = false, has_joined_shared = false;
};

// Posts this rank's blob for the step `opt` takes next. Not collective.
void set_rank_state(Context& ctx, Optimizer& opt, const void* data, size_t size);
void set_shared_state(Context& ctx, const void* data, size_t size);

// In zs_heal_join, once the verdict is posted: the lowest survivor posts
// its shared state under `key` (before its verdict, so a replacement reads
// it without waiting); a replacement of `rank` reads it, and its own blob
// for step `committed` (none before the first committed step, or when the
// trainer never set one).
void post_shared(Context& ctx, Store& store, const std::string& key);
void receive_shared(Context& ctx, Store& store, const std::string& shared_key);
void receive_rank(Context& ctx, Store& store, int rank, int64_t committed);

// which 0: this rank's blob, 1: the shared state, as the last join handed
// them over; false when it handed none.
bool joined_state(Context& ctx, int which, std::vector<char>* out);

}  // namespace zs::heal
