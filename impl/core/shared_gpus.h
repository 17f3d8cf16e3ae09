// Ranks handed the same GPU. NCCL refuses a communicator in which two
// ranks sit on one device ("Duplicate GPU detected"), so where the trainer
// named no backend the engine looks for such a pair first and runs Gloo
// for everyone instead (staging GPU memory through pinned host memory):
// a test, a notebook or a small job may well start two ranks on one GPU.
#pragma once

#include <string>
#include <vector>

namespace zs {

// gpus[r] is rank r's GPU as "host#pci-bus-id", or "-" for a rank on the
// host or whose GPU could not be told apart (no bus id). Returns ""
// when no two ranks share one, else which do: "ranks 0 and 2 share
// 0000:3c:00.0 on host-a".
std::string first_shared_gpu(const std::vector<std::string>& gpus);

}  // namespace zs
