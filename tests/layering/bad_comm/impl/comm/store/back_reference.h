// A fixture for the test "layering_catches_a_comm_back_reference": stores
// sit below transports inside comm/, so this include must be refused. Not
// compiled.
#pragma once

#include "impl/comm/transport/heartbeat.h"
