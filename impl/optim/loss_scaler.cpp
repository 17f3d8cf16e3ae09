#include "impl/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "impl/common/error.h"

namespace zs {

LossScaler::LossScaler(const LossScalerConfig& c)
    : cfg_(c),
      dynamic_(c.static_scale <= 0.0),
      scale_(dynamic_ ? std::ldexp(1.0, static_cast<int>(c.initial_scale_power)) : c.static_scale),
      hysteresis_left_(c.hysteresis) {}

void LossScaler::set_state(const State& s) {
  if (!(s.scale > 0.0) || !std::isfinite(s.scale))
    fail(Code::InvalidArgument, "loss scale ", s.scale, ": expected a finite value > 0");
  if (s.hysteresis_left < 0 || s.iter < 0 || s.last_overflow_iter < -1)
    fail(Code::InvalidArgument, "loss scaler state (hysteresis_left ", s.hysteresis_left, ", iter ",
         s.iter, ", last_overflow_iter ", s.last_overflow_iter, "): expected >= 0, >= 0, >= -1");
  // A static scaler keeps its configured scale: the config decides it.
  if (dynamic_) scale_ = s.scale;
  hysteresis_left_ = s.hysteresis_left;
  iter_ = s.iter;
  last_overflow_iter_ = s.last_overflow_iter;
}

bool LossScaler::update(bool overflow) {
  if (!dynamic_) return false;
  bool exhausted = false;
  if (overflow) {
    if (cfg_.hysteresis == 1 || hysteresis_left_ == 1) {
      exhausted = scale_ == cfg_.min_scale;
      scale_ = std::max(scale_ / 2.0, cfg_.min_scale);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else {
    if (cfg_.consecutive_hysteresis) hysteresis_left_ = cfg_.hysteresis;
    // DeepSpeed's count: the steps since the last overflow, less one, so
    // the scale doubles at the (window + 1)-th clean step, then every window.
    const int64_t stable = iter_ - last_overflow_iter_ - 1;
    if (stable > 0 && stable % cfg_.window == 0) {
      if (!cfg_.consecutive_hysteresis) hysteresis_left_ = cfg_.hysteresis;
      scale_ *= 2.0;
    }
  }
  ++iter_;
  return exhausted;
}

}  // namespace zs
