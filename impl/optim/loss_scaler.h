// fp16 loss scaling with DeepSpeed's knobs and rules. Dynamic (loss_scale
// 0): an overflowing step halves the scale once `hysteresis` overflows
// have been absorbed (never below min_loss_scale); the (window + 1)-th
// clean step after an overflow (or the start) doubles it, and every
// loss_scale_window clean steps after that. Static (loss_scale > 0): the
// scale never changes.
#pragma once

#include <cstdint>

namespace zs {

struct LossScalerConfig {
  double static_scale = 0.0;  // > 0: static
  int64_t initial_scale_power = 16;
  int64_t window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_scale = 1.0;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerConfig& c);
  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  // Record the outcome of one step. True when the step overflowed with the
  // scale already at min_loss_scale and no hysteresis left: nothing can
  // absorb it (DeepSpeed ends the run there; the optimizer fails the step).
  bool update(bool overflow);

  // What a checkpoint keeps: the scale and where the hysteresis and the
  // growth window stand.
  struct State {
    double scale = 1.0;
    int64_t hysteresis_left = 0;
    int64_t iter = 0;
    int64_t last_overflow_iter = -1;
  };
  State state() const { return {scale_, hysteresis_left_, iter_, last_overflow_iter_}; }
  // InvalidArgument names a value that cannot be a state of this scaler.
  void set_state(const State& s);

 private:
  LossScalerConfig cfg_;
  bool dynamic_;
  double scale_;
  int64_t hysteresis_left_;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace zs
