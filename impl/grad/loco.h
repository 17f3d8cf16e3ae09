// LoCo error feedback for qgZ (zeropp_loco_param): the fp32 errors this
// rank keeps for what it sends, per bucket layout. A bucket's layout (its
// group, params, their offsets, its size) is the same from step to step
// when the trainer pushes in the same order, so the error kept for it
// meets the same elements next step; a layout not seen in a round
// (another push order, a param unregistered) loses its errors, which is
// what a reset does anyway. Counted as gradient bytes in the memory stats.
//
// Reset: every reset_T reduction rounds (GradReducer::sync calls: one per
// optimizer step, or per micro-batch where the trainer syncs each one) the
// errors go back to zero, as DeepSpeed's reset_T does; also at checkpoint
// load (the errors are not saved: README, ZeRO++).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "impl/core/context.h"
#include "impl/device/buffer.h"
#include "impl/partition/param.h"

namespace zs {

class LocoErrors {
 public:
  explicit LocoErrors(Context& ctx) : ctx_(ctx) {}
  ~LocoErrors() { clear(); }
  LocoErrors(const LocoErrors&) = delete;
  LocoErrors& operator=(const LocoErrors&) = delete;

  // The error buffers of one bucket: hop1 for what the (first) all-to-all
  // sends, hop2 for the partial sums of the second hop (two-hop qgZ; null
  // when hop2_floats is 0). Zeroed when new.
  struct Buffers {
    std::shared_ptr<Buffer> hop1, hop2;
  };
  Buffers for_bucket(const Group* group, const std::vector<std::shared_ptr<Param>>& params,
                     const std::vector<uint64_t>& offsets, uint64_t used, size_t hop1_floats,
                     size_t hop2_floats);

  // The end of a reduction round, nothing in flight: layouts not used in
  // it are dropped, and every reset_T-th round zeroes the rest.
  void end_round();
  // Drop every error (checkpoint load, a param unregistered).
  void clear();

  uint64_t rounds() const { return rounds_; }

 private:
  struct Entry {
    Buffers buffers;
    bool made = false;
    bool used = false;
  };
  std::shared_ptr<Buffer> make(size_t floats);
  void drop(Entry& e);

  Context& ctx_;
  std::map<std::vector<uintptr_t>, Entry> entries_;
  uint64_t rounds_ = 0;
};

}  // namespace zs
