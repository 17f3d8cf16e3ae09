// What an optimizer tells an attachment of each step it takes, so that the
// heal layer (impl/heal/peer_copy.h), above this one, can copy the step's
// inputs to a peer and commit it in the step's own all-reduce.
#pragma once

namespace zs {

struct StepStats;

class StepListener {
 public:
  virtual ~StepListener() = default;
  // In the step's first half, under the engine lock, once the gradient
  // shards are final and before the gradient norm's all-reduce, which
  // carries the returned float: this rank's commit flag (1: the step's
  // inputs are durable where they must be).
  virtual float before_norm() = 0;
  // After that all-reduce: `commits` is the flags' sum over the world,
  // `skipped` whether the step updates nothing (overflow), grad_scale what
  // the gradients are multiplied by (unscale times clip). Throws to fail
  // the step before anything is updated.
  virtual void after_norm(float commits, bool skipped, double grad_scale) = 0;
  // A second float in the same all-reduce (healing's regrow,
  // impl/heal/regrow.h): this rank's vote that the world grows back after
  // this step; after the all-reduce, grow_votes() gets the votes' sum, alike on
  // every rank, so all grow at the same step or none does.
  virtual float grow_vote() { return 0.0f; }
  virtual void grow_votes(float sum) { (void)sum; }
  // Called first thing in ~Optimizer, before any state goes.
  virtual void detach() {}
  // The step's figures of the listener's own (zs_step_stats), as the step
  // ends.
  virtual void step_figures(StepStats& st) { (void)st; }
};

}  // namespace zs
