// The communicator of a group of one: every collective is a local copy, so
// a world of one runs without sockets.
#pragma once

#include <memory>

#include "impl/comm/communicator.h"

namespace zs {

std::unique_ptr<Communicator> make_local_communicator();

}  // namespace zs
