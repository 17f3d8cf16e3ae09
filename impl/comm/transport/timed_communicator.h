// A communicator that times every collective of the one it wraps: adds
// its time and bytes to the context's CommStats and, with ZS_TRACE, puts
// it on the rank's timeline in its group's lane.
#pragma once

#include <memory>
#include <string>

#include "impl/comm/transport/comm_stats.h"
#include "impl/comm/algo/communicator.h"
#include "impl/common/trace.h"

namespace zs {

std::unique_ptr<Communicator> make_timed_communicator(std::unique_ptr<Communicator> inner,
                                                      std::shared_ptr<CommStats> stats,
                                                      std::shared_ptr<Trace> trace,
                                                      std::string group_name);

}  // namespace zs
