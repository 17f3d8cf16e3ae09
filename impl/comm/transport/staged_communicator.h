// A communicator that accepts memory from anywhere. Each backend addresses
// one kind of memory: Gloo the host, NCCL its CUDA device. This wrapper
// moves every buffer that lives elsewhere through a staging buffer on the
// backend's side, copying inputs in before and outputs out after the
// collective. It is how CUDA tensors go through Gloo (pinned host staging:
// slower, correct, and the way to run several ranks on one GPU), and how a
// host scalar (a norm, a flag) reaches NCCL.
#pragma once

#include <memory>

#include "impl/comm/algo/communicator.h"
#include "impl/device/device.h"

namespace zs {

enum class BackendMemory { Host, Device };

// `device` provides the copies and the staging memory. With stage_all,
// every buffer is staged (a test hook that runs the staging path on a
// host device: ZS_STAGE_ALL=1).
std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> inner,
                                                       std::shared_ptr<Device> device,
                                                       BackendMemory backend, bool stage_all);

}  // namespace zs
