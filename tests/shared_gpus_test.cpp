// Which ranks were handed one GPU: the check that turns a default NCCL
// backend into Gloo before NCCL would refuse the communicator.
#include <gtest/gtest.h>

#include "impl/core/shared_gpus.h"

namespace {

TEST(SharedGpus, NamesTheFirstPairOnOneHost) {
  EXPECT_EQ(zs::first_shared_gpu({"a#0000:3c:00.0", "a#0000:4d:00.0", "a#0000:3c:00.0"}),
            "ranks 0 and 2 share GPU 0000:3c:00.0 on a");
}

TEST(SharedGpus, OneBusIdOnTwoHostsIsTwoGpus) {
  EXPECT_EQ(zs::first_shared_gpu({"a#0000:3c:00.0", "b#0000:3c:00.0", "a#0000:4d:00.0",
                                  "b#0000:4d:00.0"}),
            "");
}

TEST(SharedGpus, HostRanksAndUnknownIdsShareNothing) {
  EXPECT_EQ(zs::first_shared_gpu({"-", "-", "", ""}), "");
  EXPECT_EQ(zs::first_shared_gpu({}), "");
  EXPECT_EQ(zs::first_shared_gpu({"a#1", "-", "a#1"}), "ranks 0 and 2 share GPU 1 on a");
}

}  // namespace
