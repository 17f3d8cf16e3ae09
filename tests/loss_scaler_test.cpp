// The fp16 loss scaler against DeepSpeed's rules (runtime/fp16/loss_scaler.py
// DynamicLossScaler.update_scale): hysteresis absorbs overflows before the
// scale halves, the (window + 1)-th clean step doubles it, the floor holds
// and an overflow at the floor is reported.
#include <gtest/gtest.h>

#include "impl/optim/loss_scaler.h"

namespace {

zs::LossScalerConfig dynamic(int64_t power, int64_t window, int64_t hysteresis, double min_scale = 1.0) {
  zs::LossScalerConfig c;
  c.initial_scale_power = power;
  c.window = window;
  c.hysteresis = hysteresis;
  c.min_scale = min_scale;
  return c;
}

TEST(LossScaler, StartsAtTwoToTheInitialPower) {
  EXPECT_EQ(zs::LossScaler(dynamic(16, 1000, 2)).scale(), 65536.0);
  zs::LossScalerConfig s;
  s.static_scale = 128.0;
  zs::LossScaler st(s);
  EXPECT_FALSE(st.dynamic());
  st.update(true);
  st.update(false);
  EXPECT_EQ(st.scale(), 128.0);  // static never moves
}

TEST(LossScaler, HysteresisAbsorbsOverflowsBeforeBackoff) {
  zs::LossScaler s(dynamic(10, 1000, 3));
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 1024.0);
  s.update(true);  // third overflow: hysteresis exhausted
  EXPECT_EQ(s.scale(), 512.0);
  s.update(true);  // stays exhausted until a window completes
  EXPECT_EQ(s.scale(), 256.0);
}

// DeepSpeed doubles when (iter - last_overflow_iter - 1) is a positive
// multiple of the window: at the fourth clean step after an overflow with a
// window of 3, then every third.
TEST(LossScaler, GrowsAtTheStepAfterAWindowOfCleanSteps) {
  zs::LossScaler s(dynamic(4, 3, 1));
  s.update(true);  // iter 0 overflows: 16 -> 8
  EXPECT_EQ(s.scale(), 8.0);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 8.0);
  s.update(false);  // the fourth clean step
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 32.0);
}

TEST(LossScaler, FromTheStartTheWindowPlusOneThStepDoubles) {
  zs::LossScaler s(dynamic(4, 3, 2));
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 16.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 32.0);
}

TEST(LossScaler, NeverBelowTheMinimumAndAnOverflowThereIsReported) {
  zs::LossScaler s(dynamic(2, 1000, 1, 2.0));
  EXPECT_FALSE(s.update(true));  // 4 -> 2, the floor
  EXPECT_EQ(s.scale(), 2.0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(s.update(true)) << "an overflow at the floor, with no hysteresis left";
    EXPECT_EQ(s.scale(), 2.0);
  }
  zs::LossScaler h(dynamic(1, 1000, 2, 2.0));  // starts at the floor, hysteresis 2
  EXPECT_FALSE(h.update(true));  // absorbed
  EXPECT_TRUE(h.update(true));
}

TEST(LossScaler, WindowGrowthRestoresHysteresis) {
  zs::LossScaler s(dynamic(8, 2, 2));
  s.update(true);  // absorbed (hysteresis 2 -> 1)
  EXPECT_EQ(s.scale(), 256.0);
  s.update(false);
  s.update(false);
  s.update(false);  // window + 1: scale doubles, hysteresis back to 2
  EXPECT_EQ(s.scale(), 512.0);
  s.update(true);  // absorbed again thanks to the restored hysteresis
  EXPECT_EQ(s.scale(), 512.0);
}

}  // namespace
