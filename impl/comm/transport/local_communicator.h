// The communicator of a group of one: every collective is a local copy, so
// a world of one runs without sockets. Copies go through `device` (any
// direction, so host and device buffers may be mixed) and are complete
// when a call returns.
#pragma once

#include <memory>

#include "impl/comm/algo/communicator.h"
#include "impl/device/device.h"

namespace zs {

std::unique_ptr<Communicator> make_local_communicator(std::shared_ptr<Device> device);

}  // namespace zs
