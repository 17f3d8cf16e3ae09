#include "impl/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace zs {

LossScaler::LossScaler(const LossScalerConfig& c)
    : cfg_(c),
      dynamic_(c.static_scale <= 0.0),
      scale_(dynamic_ ? std::ldexp(1.0, static_cast<int>(c.initial_scale_power)) : c.static_scale),
      hysteresis_left_(c.hysteresis) {}

void LossScaler::update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    if (cfg_.hysteresis == 1 || hysteresis_left_ == 1) {
      scale_ = std::max(scale_ / 2.0, cfg_.min_scale);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else {
    if (cfg_.consecutive_hysteresis) hysteresis_left_ = cfg_.hysteresis;
    if ((iter_ - last_overflow_iter_) % cfg_.window == 0) {
      if (!cfg_.consecutive_hysteresis) hysteresis_left_ = cfg_.hysteresis;
      scale_ *= 2.0;
    }
  }
  ++iter_;
}

}  // namespace zs
